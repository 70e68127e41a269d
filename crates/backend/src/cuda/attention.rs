//! Paged attention on the GPU (kernels/attention.cu, decode.cu, prefill.cu): the launch plan
//! (which kernel, how many key splits), the per-step metadata layout, and a host-data entry point
//! for parity tests and `attn-bench`.
//!
//! Two kernels share one launch shape: `paged_attention` for any batch, and `paged_decode` for
//! batches whose rows outside prompt tiles are all decodes (query_len 1), which streams the keys
//! through shared memory with cp.async at memory bandwidth (beside a prompt chunk, a server's
//! usual step, it cut attention from 542 µs per layer; see PERF.md). The choice is made per
//! launch on the host (`Plan`, `PagedAttention::plan_batch`);
//! CUDA graphs only capture decode steps, so a captured launch always takes the decode kernel, its
//! splits fixed by the batch-size bucket and the cache's maximum context.
//!
//! In a decode layer `paged_decode` applies the QKV bias, QK-norm and RoPE to what it reads of
//! the QKV rows (`RopeArgs`; the forward pass then skips `rope_qkv`). Both kernels' key splits
//! are merged by a second launch, `attention_reduce`. (An in-kernel merge by the last CTA to
//! finish cost the decode kernel 3–5 µs on the H100, B16 L4096 116.0 against 110.9 µs, to save a
//! launch worth at most 1.5% of the 135M model's tg128 and nothing on the 8B; decode.cu keeps the
//! code, reached only with split counters, which the host does not pass.)
//!
//! Sequences with a prompt chunk of at least `PREFILL_MIN_ROWS` rows go to a third kernel,
//! `paged_prefill` (flash attention on tensor cores, one CTA per tile of query rows and KV head;
//! the tiles are listed in the metadata); the other kernel then skips their rows.

use cudarc::driver::sys::CUfunction_attribute as FuncAttr;
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
    /// `paged_prefill`'s work list: `num_tiles` (sequence, first row) pairs covering
    /// `tiled_rows` rows.
    pub tiles: usize,
    pub num_tiles: usize,
    pub tiled_rows: usize,
}

/// Sequences whose chunk has at least this many query rows are attended by `paged_prefill`.
pub const PREFILL_MIN_ROWS: usize = 16;

/// Packs a batch's indices into `m` (cleared first): one host-to-device copy per step.
/// `prefill_rows`: query rows per `paged_prefill` tile (`PagedAttention::prefill_rows`).
pub fn pack_meta(b: &ForwardBatch, m: &mut Vec<i32>, prefill_rows: usize) -> Meta {
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
    let tiles = mark(m);
    let (mut num_tiles, mut tiled_rows) = (0, 0);
    for (i, s) in b.seqs.iter().enumerate() {
        if s.query_len >= PREFILL_MIN_ROWS {
            for first in (0..s.query_len).step_by(prefill_rows.max(1)) {
                m.extend([i as i32, first as i32]);
                num_tiles += 1;
            }
            tiled_rows += s.query_len;
        }
    }
    Meta {
        tokens,
        positions,
        slots,
        row_seq,
        logits_idx,
        seqs,
        block_tables,
        tiles,
        num_tiles,
        tiled_rows,
    }
}

/// How a launch divides the keys: `splits` CTAs per (row, KV head); each row cuts its own
/// context into that many parts (whole 32-key chunks, or whole tiles for the decode kernel).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Plan {
    pub splits: usize,
    /// `paged_decode` rather than `paged_attention` for the rows outside `paged_prefill`'s tiles
    /// (every one of them a decode, query_len 1).
    pub decode: bool,
    /// Every row of the step is a decode: `paged_decode` may apply bias, QK-norm and RoPE
    /// itself. Not beside prompt chunks, whose tiles need the rows roped first.
    pub fused_rope: bool,
}

/// Whether the rows of `b` that `paged_prefill` does not take (sequences with fewer than
/// `PREFILL_MIN_ROWS` query rows) are all decodes: then `paged_decode` attends them, beside prompt
/// chunks too. (A short chunk of 2..16 rows needs `paged_attention`, which reads its rows' new
/// keys from the step's rows rather than from the cache that other CTAs are writing.)
fn untiled_rows_decode(b: &ForwardBatch) -> bool {
    b.seqs
        .iter()
        .all(|s| s.query_len == 1 || s.query_len >= PREFILL_MIN_ROWS)
}

/// Keys of one `paged_decode` tile (16 KB of K and V at any head_dim); see decode.cu.
fn decode_tile(head_dim: usize) -> usize {
    4096 / head_dim
}

/// Dynamic shared memory of `paged_decode` (decode.cu's DEC_SMEM): 3 stages of 16 KB of K and
/// V tiles, then the group's queries, 40 floats per 32 dims.
fn decode_smem(head_dim: usize, gqa: usize) -> usize {
    3 * 2 * decode_tile(head_dim) * head_dim * 2 + gqa * head_dim / 32 * 40 * 4
}

pub struct PagedAttention {
    attention: CudaFunction,
    decode: CudaFunction,
    prefill: CudaFunction,
    reduce: CudaFunction,
    /// `paged_prefill`'s dynamic shared memory (prefill.cu's PF_SMEM).
    prefill_smem: u32,
    /// `paged_decode`'s dynamic shared memory and how many of its CTAs fit on one SM.
    decode_smem: u32,
    decode_ctas_per_sm: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    /// Sliding window in keys; 0: none.
    window: usize,
}

/// Fewest key tiles per decode split (64 KB of K and V), but up to four splits of
/// `DECODE_SHORT_TILES` whatever the context (see `PagedAttention::plan`). Measured on the H100:
/// two tiles everywhere gave the 8B model's tg128 +0.8% but a single sequence at 4,096 keys
/// 23.3 µs instead of 18.6; one tile lost 13% on the 135M model.
const DECODE_MIN_TILES: usize = 4;

/// Tiles per split short contexts may go down to. At 4 the 8B model's steps at 65-128 keys take
/// one split and no merge launch, yet its tg128 fell 0.3% on the H100.
const DECODE_SHORT_TILES: usize = 2;

/// What `paged_decode` needs to apply the QKV bias, QK-norm and RoPE itself, as `rope_qkv` does
/// (rope.cu): device addresses (0: none) and the rotation's shape. The rows' positions come from
/// the step's metadata.
#[derive(Debug, Clone, Copy)]
pub struct RopeArgs {
    /// `[q_size + 2 * kv_size]` (q | k | v), or 0.
    pub bias: u64,
    /// `[head_dim]` each (Qwen3's QK-norm), or 0.
    pub q_norm: u64,
    pub k_norm: u64,
    /// `[max_pos, pairs]` (cos, sin) pairs of f32.
    pub cs: u64,
    /// rope_dim / 2.
    pub pairs: usize,
    /// Pairs (i, i + pairs) rather than (2i, 2i + 1).
    pub neox: bool,
    /// The QK-norm's epsilon.
    pub eps: f32,
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
    /// `[n, num_heads, splits, head_dim]` and `[n, num_heads, splits]` (max, sum): the splits'
    /// partial results.
    pub part_acc: u64,
    pub part_ml: u64,
    /// `Some`: the QKV rows are un-roped and the decode kernel applies bias, QK-norm and RoPE
    /// (decode launches only). `None`: the rows come roped.
    pub rope: Option<RopeArgs>,
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
        let gqa = num_heads / num_kv_heads;
        let m = gpu.module(
            &nvrtc::ATTENTION,
            &[("HEAD_DIM", head_dim.to_string()), ("GQA", gqa.to_string())],
        )?;
        gpu.ctx
            .bind_to_thread()
            .map_err(super::gpu::cuda_err("binding the context"))?;
        let decode = Gpu::function(&m, "paged_decode")?;
        let smem = decode_smem(head_dim, gqa);
        let per_sm = big_smem(&decode, "paged_decode", smem)?;
        let prefill = Gpu::function(&m, "paged_prefill")?;
        let prefill_smem = prefill_smem(head_dim);
        big_smem(&prefill, "paged_prefill", prefill_smem)?;
        Ok(Self {
            attention: Gpu::function(&m, "paged_attention")?,
            decode,
            prefill,
            reduce: Gpu::function(&m, "attention_reduce")?,
            prefill_smem: prefill_smem as u32,
            decode_smem: smem as u32,
            decode_ctas_per_sm: per_sm,
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

    /// Query rows per `paged_prefill` tile: 64 score rows shared by the GQA group's heads.
    pub fn prefill_rows(&self) -> usize {
        PREFILL_SCORE_ROWS / (self.num_heads / self.num_kv_heads)
    }

    /// How many of `paged_decode`'s CTAs fit on one multiprocessor (the occupancy it is planned for).
    pub fn decode_ctas_per_sm(&self) -> usize {
        self.decode_ctas_per_sm
    }

    /// The launch for `num_tokens` rows whose longest context is `max_seq_len` (under a CUDA graph:
    /// the longest the cache holds); `decode`: the rows outside prompt tiles are all decodes
    /// (query_len 1). The plan allows the fused RoPE whenever `decode` holds: a step with prompt
    /// chunks takes `plan_batch`, which knows better.
    ///
    /// Decode: as many splits as fill the GPU's CTA slots in one wave (slots = SMs × CTAs per SM,
    /// splits = slots / (rows × KV heads), rounded down so no second partial wave trails), with at
    /// least `DECODE_MIN_TILES` tiles (64 KB of K and V) per split, so every CTA
    /// overlaps copies with compute, yet up to four splits of two tiles for short contexts. Every
    /// resident CTA keeps two 16 KB tiles in flight. Otherwise: splits until about eight CTAs per
    /// multiprocessor are in flight, at least 128 keys per split.
    pub fn plan(&self, sms: u32, num_tokens: usize, max_seq_len: usize, decode: bool) -> Plan {
        let ctas = (num_tokens * self.num_kv_heads).max(1);
        if decode {
            let slots = self.decode_ctas_per_sm * sms as usize;
            let keys = match self.window {
                0 => max_seq_len,
                w => max_seq_len.min(w),
            };
            let tile = decode_tile(self.head_dim);
            // Short contexts (the graph's smallest bucket) may go down to two tiles a split, up
            // to four splits, so a single sequence's few CTAs each have less to walk.
            let max_splits = keys
                .div_ceil(DECODE_MIN_TILES * tile)
                .max(keys.div_ceil(DECODE_SHORT_TILES * tile).min(4))
                .max(1);
            return Plan {
                splits: (slots / ctas).clamp(1, max_splits),
                decode: true,
                fused_rope: true,
            };
        }
        let target = 8 * sms as usize;
        let splits = if ctas < target {
            target.div_ceil(ctas).min(max_seq_len.div_ceil(128)).max(1)
        } else {
            1
        };
        Plan {
            splits,
            decode: false,
            fused_rope: false,
        }
    }

    /// The launch for a batch run step by step (not under a CUDA graph): decode rows take
    /// `paged_decode` beside prompt chunks too, but only a step of decodes alone lets it apply
    /// RoPE itself.
    pub fn plan_batch(&self, sms: u32, b: &ForwardBatch) -> Plan {
        let max_ctx = b.seqs.iter().map(|s| s.seq_len).max().unwrap_or(1);
        let mut plan = self.plan(sms, b.num_tokens(), max_ctx, untiled_rows_decode(b));
        plan.fused_rope = b.seqs.iter().all(|s| s.query_len == 1);
        plan
    }

    /// Writes the step's K/V into the cache and attends every row into `b.out` (with `b.rope`,
    /// applying bias, QK-norm and RoPE first: decode plans only).
    ///
    /// # Safety
    ///
    /// Every address in `b` is a live device allocation on `gpu`'s context, not freed before the
    /// stream has finished the launches: `qkv` `n` rows of `qkv_stride` f16, the caches as
    /// `PagedAttention` was built for and covering every slot and block the metadata names,
    /// `meta` the step's metadata laid out as `layout` says, `out` `n` rows (f16 or f32),
    /// `part_acc`/`part_ml` sized for `plan.splits`, and the RoPE tables (null where absent) for
    /// `pairs`; `out` overlaps no input.
    pub unsafe fn launch(
        &self,
        gpu: &Gpu,
        n: usize,
        block_size: usize,
        plan: Plan,
        b: &AttnBuffers,
    ) -> Result<(), BackendError> {
        use KArg::{F, I, P};
        if b.rope.is_some() && !plan.fused_rope {
            return Err(BackendError::InvalidBatch(
                "fused RoPE needs a step of decodes alone (every query_len 1)".into(),
            ));
        }
        let mp = |off: usize| P(b.meta + 4 * off as u64);
        let l = &b.layout;
        let scale = 1.0 / (self.head_dim as f32).sqrt();
        if l.num_tiles > 0 {
            // SAFETY: paged_prefill's list; the addresses are `b`'s (this fn's contract).
            unsafe {
                gpu.launch_smem(
                    &self.prefill,
                    (l.num_tiles as u32, self.num_kv_heads as u32, 1),
                    (THREADS, 1, 1),
                    self.prefill_smem,
                    &[
                        P(b.qkv),
                        I(b.qkv_stride as i32),
                        P(b.k_cache),
                        P(b.v_cache),
                        mp(l.seqs),
                        mp(l.block_tables),
                        mp(l.slots),
                        mp(l.tiles),
                        I(self.num_kv_heads as i32),
                        I(block_size.trailing_zeros() as i32),
                        F(scale),
                        I(self.window as i32),
                        P(b.out),
                        I(b.out_f32 as i32),
                    ],
                )
            }?;
            if l.tiled_rows == n {
                return Ok(());
            }
        }
        // The other rows; those of tiled sequences are skipped.
        let skip = if l.num_tiles > 0 { PREFILL_MIN_ROWS } else { 0 } as i32;
        let mut args = vec![
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
            F(scale),
            I(self.window as i32),
            P(b.out),
            I(b.out_f32 as i32),
            P(b.part_acc),
            P(b.part_ml),
            I(skip),
        ];
        if plan.decode {
            let r = b.rope.unwrap_or(RopeArgs {
                bias: 0,
                q_norm: 0,
                k_norm: 0,
                cs: 0,
                pairs: 0,
                neox: false,
                eps: 0.0,
            });
            if 2 * r.pairs > self.head_dim {
                return Err(BackendError::Config(format!(
                    "RoPE over {} dims of {}-dim heads",
                    2 * r.pairs,
                    self.head_dim
                )));
            }
            args.extend([
                P(r.bias),
                P(r.q_norm),
                P(r.k_norm),
                P(r.cs),
                mp(l.positions),
                I(r.pairs as i32),
                I(r.neox as i32),
                F(r.eps),
            ]);
            // SAFETY: `args` is paged_decode's list; the addresses are `b`'s (this fn's contract).
            unsafe {
                gpu.launch_smem(
                    &self.decode,
                    (n as u32, self.num_kv_heads as u32, plan.splits as u32),
                    (THREADS, 1, 1),
                    self.decode_smem,
                    &args,
                )
            }?;
        } else {
            // SAFETY: `args` is paged_attention's list; the addresses are `b`'s (this fn's contract).
            unsafe {
                gpu.launch(
                    &self.attention,
                    (n as u32, self.num_kv_heads as u32, plan.splits as u32),
                    (THREADS, 1, 1),
                    &args,
                )
            }?;
        }
        if plan.splits > 1 {
            // SAFETY: the partials and output are `b`'s, sized for the plan (this fn's contract).
            unsafe {
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
                        mp(l.row_seq),
                        mp(l.seqs),
                        I(skip),
                    ],
                )
            }?;
        }
        Ok(())
    }
}

/// Score rows per `paged_prefill` CTA (prefill.cu's PF_BM).
const PREFILL_SCORE_ROWS: usize = 64;

/// Dynamic shared memory of `paged_prefill` (prefill.cu's PF_SMEM): Q tile, then two stages of
/// K and V tiles (32 keys at head_dim 256, else 64), all f16.
fn prefill_smem(head_dim: usize) -> usize {
    let keys = if head_dim == 256 { 32 } else { 64 };
    (PREFILL_SCORE_ROWS + 4 * keys) * head_dim * 2
}

/// Opts `f` in to `smem` bytes of dynamic shared memory (over 48 KB needs it) with the SM's
/// whole shared memory preferred over L1; returns how many of its CTAs fit on one multiprocessor.
fn big_smem(f: &CudaFunction, name: &str, smem: usize) -> Result<usize, BackendError> {
    let err = |what: &'static str| {
        move |e| {
            BackendError::Cuda(format!(
                "{name} ({smem} bytes of shared memory): {what}: {e}"
            ))
        }
    };
    f.set_attribute(
        FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
        smem as i32,
    )
    .map_err(err("setting the dynamic shared memory size"))?;
    f.set_attribute(
        FuncAttr::CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT,
        100,
    )
    .map_err(err("setting the shared memory carveout"))?;
    let per_sm = f
        .occupancy_max_active_blocks_per_multiprocessor(THREADS, smem, None)
        .map_err(err("occupancy"))? as usize;
    if per_sm == 0 {
        return Err(BackendError::Cuda(format!(
            "{name} does not fit on one multiprocessor ({smem} bytes of shared memory)"
        )));
    }
    Ok(per_sm)
}

/// Threads per CTA of both attention kernels (4 warps).
const THREADS: u32 = 128;

/// What `HostRun::read` returns: the output rows, then the K and V caches.
pub type HostResult = (Vec<f32>, Vec<f16>, Vec<f16>);

/// One batch uploaded from host data (tests, `attn-bench`), kept for repeated launches.
pub struct HostRun {
    pub qkv: DBuf<f32>,
    pub k_cache: DBuf<f16>,
    pub v_cache: DBuf<f16>,
    pub meta: DBuf<i32>,
    pub layout: Meta,
    /// The output rows: f16 packed two to a word, or f32 when `out_f32`.
    pub out: DBuf<f32>,
    /// Whether the kernel writes f32 output rows (as when the o-projection quantizes them).
    pub out_f32: bool,
    pub part_acc: DBuf<f32>,
    pub part_ml: DBuf<f32>,
    /// Set by `set_rope`: the decode kernel applies bias, QK-norm and RoPE.
    pub rope: Option<HostRope>,
    pub plan: Plan,
    pub n: usize,
    pub qkv_stride: usize,
    pub block_size: usize,
}

/// Bias, QK-norm and RoPE inputs from host data (tests), for `HostRun::set_rope`.
pub struct RopeInputs<'a> {
    /// `[q_size + 2 * kv_size]` (q | k | v).
    pub bias: Option<&'a [f32]>,
    /// `[head_dim]` each.
    pub q_norm: Option<&'a [f32]>,
    pub k_norm: Option<&'a [f32]>,
    /// `[max_pos, rope_dim / 2]` (cos, sin), as `RopeTable::angles` gives them per position.
    pub cs: &'a [(f32, f32)],
    /// rope_dim / 2.
    pub pairs: usize,
    pub neox: bool,
    pub eps: f32,
}

/// `RopeInputs` on the device.
pub struct HostRope {
    pub bias: Option<DBuf<f32>>,
    pub q_norm: Option<DBuf<f32>>,
    pub k_norm: Option<DBuf<f32>>,
    pub cs: DBuf<f32>,
    pub pairs: usize,
    pub neox: bool,
    pub eps: f32,
}

impl HostRope {
    fn args(&self) -> RopeArgs {
        let ptr = |b: &Option<DBuf<f32>>| b.as_ref().map_or(0, |b| b.ptr);
        RopeArgs {
            bias: ptr(&self.bias),
            q_norm: ptr(&self.q_norm),
            k_norm: ptr(&self.k_norm),
            cs: self.cs.ptr,
            pairs: self.pairs,
            neox: self.neox,
            eps: self.eps,
        }
    }
}

impl HostRun {
    /// Uploads a batch: `qkv` rows `[n, stride]` (q | k | v after RoPE, or before it with
    /// `set_rope`), caches `[num_slots, num_kv_heads, head_dim]`.
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
        let layout = pack_meta(batch, &mut m, a.prefill_rows());
        let plan = a.plan_batch(gpu.sms, batch);
        let part = n * a.num_heads * plan.splits;
        Ok(Self {
            qkv: gpu.upload(qkv)?,
            k_cache: gpu.upload(k_cache)?,
            v_cache: gpu.upload(v_cache)?,
            meta: gpu.upload(&m)?,
            layout,
            out: gpu.alloc(n * a.num_heads * a.head_dim)?,
            out_f32: false,
            part_acc: gpu.alloc(part * a.head_dim)?,
            part_ml: gpu.alloc(part * 2)?,
            rope: None,
            plan,
            n,
            qkv_stride,
            block_size,
        })
    }

    /// Makes the decode kernel apply bias, QK-norm and RoPE to the uploaded rows (decode plans
    /// only, as in the forward pass).
    pub fn set_rope(&mut self, gpu: &Gpu, r: &RopeInputs) -> Result<(), BackendError> {
        if !self.plan.fused_rope {
            return Err(BackendError::InvalidBatch(
                "fused RoPE needs a decode batch (every query_len 1)".into(),
            ));
        }
        let up = |v: Option<&[f32]>| v.map(|v| gpu.upload(v)).transpose();
        let cs: Vec<f32> = r.cs.iter().flat_map(|&(c, s)| [c, s]).collect();
        self.rope = Some(HostRope {
            bias: up(r.bias)?,
            q_norm: up(r.q_norm)?,
            k_norm: up(r.k_norm)?,
            cs: gpu.upload(&cs)?,
            pairs: r.pairs,
            neox: r.neox,
            eps: r.eps,
        });
        Ok(())
    }

    /// Forces `splits` key splits (tests), reallocating the partial results to fit.
    pub fn set_splits(
        &mut self,
        gpu: &Gpu,
        a: &PagedAttention,
        splits: usize,
    ) -> Result<(), BackendError> {
        let part = self.n * a.num_heads * splits.max(1);
        self.part_acc = gpu.alloc(part * a.head_dim)?;
        self.part_ml = gpu.alloc(part * 2)?;
        self.plan.splits = splits.max(1);
        Ok(())
    }

    /// Enqueues the attention over the uploaded batch: the safe form of
    /// `PagedAttention::launch`, every buffer owned here.
    pub fn launch(&self, gpu: &Gpu, a: &PagedAttention) -> Result<(), BackendError> {
        let out_words = self.n * a.num_heads * a.head_dim / if self.out_f32 { 1 } else { 2 };
        if self.qkv.len < self.n * self.qkv_stride || self.out.len < out_words {
            return Err(BackendError::InvalidBatch(format!(
                "attention buffers too small for {} rows",
                self.n
            )));
        }
        // SAFETY: every address is a buffer owned by `self` (alive while it is borrowed here, and
        // `DBuf`'s drop frees in stream order: cudarc frees on the stream or synchronizes first): `new` sized the caches and metadata for a
        // batch it validated against them, `set_splits` the partials for the plan, and the rows
        // are checked above.
        unsafe {
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
                    out_f32: self.out_f32,
                    part_acc: self.part_acc.ptr,
                    part_ml: self.part_ml.ptr,
                    rope: self.rope.as_ref().map(HostRope::args),
                },
            )
        }
    }

    /// The output `[n, num_heads * head_dim]` and the K and V caches after the fused write.
    pub fn read(&self, gpu: &Gpu) -> Result<HostResult, BackendError> {
        let out = if self.out_f32 {
            let mut out = vec![0f32; self.out.len];
            gpu.dtoh(&self.out, &mut out)?;
            out
        } else {
            let mut words = vec![0f32; self.out.len / 2];
            gpu.dtoh(&self.out, &mut words)?;
            words
                .iter()
                .flat_map(|w| {
                    let b = w.to_bits();
                    [b as u16, (b >> 16) as u16].map(|h| f16::from_bits(h).to_f32())
                })
                .collect()
        };
        let mut k = vec![f16::ZERO; self.k_cache.len];
        gpu.dtoh(&self.k_cache, &mut k)?;
        let mut v = vec![f16::ZERO; self.v_cache.len];
        gpu.dtoh(&self.v_cache, &mut v)?;
        Ok((out, k, v))
    }
}
