//! Paged attention on the GPU (kernels/attention.cu): the launch plan (how many key splits), the
//! per-step metadata layout, and a host-data entry point for parity tests and `attn-bench`.

use cudarc::driver::CudaFunction;
use half::f16;

use super::gpu::{DBuf, Gpu, KArg};
use super::nvrtc;
use crate::{BackendError, ForwardBatch};

/// Offsets (in i32 elements) of the per-step metadata inside one upload.
#[derive(Debug, Clone, Copy)]
pub struct Meta {
    pub tokens: usize,
    pub positions: usize,
    pub slots: usize,
    pub row_seq: usize,
    pub logits_idx: usize,
    pub seqs: usize,
    pub block_tables: usize,
}

/// Packs a batch's indices into `m` (cleared first): one host-to-device copy per step.
pub fn pack_meta(b: &ForwardBatch, m: &mut Vec<i32>) -> Meta {
    m.clear();
    // Each array starts 16-byte aligned (the SeqInfo array is read as int4).
    let mark = |m: &mut Vec<i32>| {
        while !m.len().is_multiple_of(4) {
            m.push(0);
        }
        m.len()
    };
    let tokens = mark(m);
    m.extend(b.token_ids.iter().map(|&t| t as i32));
    let positions = mark(m);
    m.extend(b.positions.iter().map(|&t| t as i32));
    let slots = mark(m);
    m.extend(b.slot_mapping.iter().map(|&t| t as i32));
    let row_seq = mark(m);
    for (i, s) in b.seqs.iter().enumerate() {
        m.extend(std::iter::repeat_n(i as i32, s.query_len));
    }
    let logits_idx = mark(m);
    m.extend(b.logits_indices.iter().map(|&t| t as i32));
    let seqs = mark(m);
    let mut bt_off = 0usize;
    for s in b.seqs {
        m.extend([
            s.query_start as i32,
            s.query_len as i32,
            s.seq_len as i32,
            bt_off as i32,
        ]);
        bt_off += s.block_table.len();
    }
    let block_tables = mark(m);
    for s in b.seqs {
        m.extend(s.block_table.iter().map(|b| b.as_usize() as i32));
    }
    Meta {
        tokens,
        positions,
        slots,
        row_seq,
        logits_idx,
        seqs,
        block_tables,
    }
}

/// How a launch divides the keys: `splits` CTAs per (row, KV head); each row cuts its own
/// context into that many parts (whole 32-key chunks).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub splits: usize,
}

pub struct PagedAttention {
    attention: CudaFunction,
    reduce: CudaFunction,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding window in keys; 0: none.
    window: usize,
}

/// Device addresses one launch reads and writes.
#[derive(Debug, Clone, Copy)]
pub struct AttnBuffers {
    pub qkv: u64,
    pub qkv_stride: usize,
    pub k_cache: u64,
    pub v_cache: u64,
    /// Base of the metadata upload and its layout.
    pub meta: u64,
    pub layout: Meta,
    /// `[n, num_heads * head_dim]`: f16, or f32 when `out_f32`.
    pub out: u64,
    pub out_f32: bool,
    pub part_acc: u64,
    pub part_ml: u64,
}

impl PagedAttention {
    pub fn new(
        gpu: &Gpu,
        num_heads: usize,
        num_kv_heads: usize,
        head_dim: usize,
    ) -> Result<Self, BackendError> {
        if !matches!(head_dim, 64 | 128 | 256) {
            return Err(BackendError::Config(format!(
                "CUDA attention supports head_dim 64, 128 or 256 (got {head_dim})"
            )));
        }
        if num_kv_heads == 0
            || !num_heads.is_multiple_of(num_kv_heads)
            || num_heads / num_kv_heads > 8
        {
            return Err(BackendError::Config(format!(
                "CUDA attention supports 1 to 8 query heads per KV head (got {num_heads} / {num_kv_heads})"
            )));
        }
        let m = gpu.module(
            &nvrtc::ATTENTION,
            &[
                ("HEAD_DIM", head_dim.to_string()),
                ("GQA", (num_heads / num_kv_heads).to_string()),
            ],
        )?;
        Ok(Self {
            attention: Gpu::function(&m, "paged_attention")?,
            reduce: Gpu::function(&m, "attention_reduce")?,
            num_heads,
            num_kv_heads,
            head_dim,
            window: 0,
        })
    }

    /// Limits each query to its last `window` keys (`None`: all keys).
    pub fn with_window(mut self, window: Option<usize>) -> Self {
        self.window = window.unwrap_or(0);
        self
    }

    /// Splits the keys (flash-decoding) until about eight CTAs per multiprocessor are in flight
    /// (a memory-bound kernel needs many warps waiting on loads), at least 128 keys per split.
    pub fn plan(&self, sms: u32, num_tokens: usize, max_seq_len: usize) -> Plan {
        let ctas = (num_tokens * self.num_kv_heads).max(1);
        let target = 8 * sms as usize;
        let splits = if ctas < target {
            target.div_ceil(ctas).min(max_seq_len.div_ceil(128)).max(1)
        } else {
            1
        };
        Plan { splits }
    }

    /// Writes the step's K/V into the cache and attends every row into `b.out`.
    pub fn launch(
        &self,
        gpu: &Gpu,
        n: usize,
        block_size: usize,
        plan: Plan,
        b: &AttnBuffers,
    ) -> Result<(), BackendError> {
        use KArg::{F, I, P};
        let mp = |off: usize| P(b.meta + 4 * off as u64);
        gpu.launch(
            &self.attention,
            (n as u32, self.num_kv_heads as u32, plan.splits as u32),
            (128, 1, 1),
            &[
                P(b.qkv),
                I(b.qkv_stride as i32),
                P(b.k_cache),
                P(b.v_cache),
                mp(b.layout.row_seq),
                mp(b.layout.seqs),
                mp(b.layout.block_tables),
                mp(b.layout.slots),
                I(self.num_kv_heads as i32),
                I(block_size.trailing_zeros() as i32),
                F(1.0 / (self.head_dim as f32).sqrt()),
                I(self.window as i32),
                P(b.out),
                I(b.out_f32 as i32),
                P(b.part_acc),
                P(b.part_ml),
            ],
        )?;
        if plan.splits > 1 {
            gpu.launch(
                &self.reduce,
                (n as u32, self.num_heads as u32, 1),
                (self.head_dim as u32, 1, 1),
                &[
                    P(b.part_acc),
                    P(b.part_ml),
                    I(plan.splits as i32),
                    P(b.out),
                    I(b.out_f32 as i32),
                ],
            )?;
        }
        Ok(())
    }
}

/// What `HostRun::read` returns: the output rows, then the K and V caches.
pub type HostResult = (Vec<f32>, Vec<f16>, Vec<f16>);

/// One batch uploaded from host data (tests, `attn-bench`), kept for repeated launches.
pub struct HostRun {
    pub qkv: DBuf<f32>,
    pub k_cache: DBuf<f16>,
    pub v_cache: DBuf<f16>,
    pub meta: DBuf<i32>,
    pub layout: Meta,
    pub out: DBuf<f16>,
    pub part_acc: DBuf<f32>,
    pub part_ml: DBuf<f32>,
    pub plan: Plan,
    pub n: usize,
    pub qkv_stride: usize,
    pub block_size: usize,
}

impl HostRun {
    /// Uploads a batch: `qkv` rows `[n, stride]` (q | k | v after RoPE), caches
    /// `[num_slots, num_kv_heads, head_dim]`.
    #[allow(clippy::too_many_arguments)]
    pub fn new(
        gpu: &Gpu,
        a: &PagedAttention,
        qkv: &[f32],
        qkv_stride: usize,
        batch: &ForwardBatch,
        block_size: usize,
        k_cache: &[f16],
        v_cache: &[f16],
    ) -> Result<Self, BackendError> {
        let n = batch.num_tokens();
        batch.validate(
            block_size,
            k_cache.len() / (a.num_kv_heads * a.head_dim) / block_size,
        )?;
        let mut m = vec![];
        let layout = pack_meta(batch, &mut m);
        let max_ctx = batch.seqs.iter().map(|s| s.seq_len).max().unwrap_or(1);
        let plan = a.plan(gpu.sms, n, max_ctx);
        let part = n * a.num_heads * plan.splits;
        Ok(Self {
            qkv: gpu.upload(qkv)?,
            k_cache: gpu.upload(k_cache)?,
            v_cache: gpu.upload(v_cache)?,
            meta: gpu.upload(&m)?,
            layout,
            out: gpu.alloc(n * a.num_heads * a.head_dim)?,
            part_acc: gpu.alloc(part * a.head_dim)?,
            part_ml: gpu.alloc(part * 2)?,
            plan,
            n,
            qkv_stride,
            block_size,
        })
    }

    pub fn launch(&self, gpu: &Gpu, a: &PagedAttention) -> Result<(), BackendError> {
        a.launch(
            gpu,
            self.n,
            self.block_size,
            self.plan,
            &AttnBuffers {
                qkv: self.qkv.ptr,
                qkv_stride: self.qkv_stride,
                k_cache: self.k_cache.ptr,
                v_cache: self.v_cache.ptr,
                meta: self.meta.ptr,
                layout: self.layout,
                out: self.out.ptr,
                out_f32: false,
                part_acc: self.part_acc.ptr,
                part_ml: self.part_ml.ptr,
            },
        )
    }

    /// The output `[n, num_heads * head_dim]` and the K and V caches after the fused write.
    pub fn read(&self, gpu: &Gpu) -> Result<HostResult, BackendError> {
        let mut out = vec![f16::ZERO; self.out.len];
        gpu.dtoh(&self.out, &mut out)?;
        let mut k = vec![f16::ZERO; self.k_cache.len];
        gpu.dtoh(&self.k_cache, &mut k)?;
        let mut v = vec![f16::ZERO; self.v_cache.len];
        gpu.dtoh(&self.v_cache, &mut v)?;
        Ok((out.into_iter().map(f16::to_f32).collect(), k, v))
    }
}
