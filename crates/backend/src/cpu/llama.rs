//! The Llama-family forward pass on the CPU (Llama 2/3, SmolLM2, Mistral; Qwen2's QKV bias and
//! Qwen3's QK-norm are switches of the same block). Q/K/V and gate/up are stacked at load time so
//! each layer makes four threaded matrix products. Buffers live in `Scratch` and only grow.

use half::f16;
use quire_core::ModelConfig;

use super::attention::{paged_attention, AttnParams, KvElem};
use super::matmul::{matmul, matmul_swiglu, Activations, QMatrix};
use super::moe::{Ffn, MoeScratch};
use super::ops;
use super::profile::Profiler;
use super::quant::{needs_q8, QK};
use super::team::{Parallel, Team};
use crate::{BackendError, Executor, ForwardBatch, KvCacheSpec, ModelWeights, OpStat};

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
}

#[derive(Debug, Clone, Copy)]
pub struct CpuOptions {
    pub threads: usize,
    pub kv_dtype: KvDtype,
    /// With an f16 cache: round Q and the attention's V accumulator to f16 as llama.cpp's CPU
    /// flash attention does (the default: its logits). `false` accumulates in f32, the CUDA
    /// kernels' numerics (what the CUDA parity test compares against).
    pub attn_f16_accum: bool,
}

impl Default for CpuOptions {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            kv_dtype: KvDtype::F16,
            attn_f16_accum: true,
        }
    }
}

struct Layer {
    attn_norm: Vec<f32>,
    wqkv: QMatrix,
    bqkv: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    wo: QMatrix,
    ffn_norm: Vec<f32>,
    ffn: Ffn,
}

enum KvStore {
    F32(Vec<Vec<f32>>, Vec<Vec<f32>>),
    F16(Vec<Vec<f16>>, Vec<Vec<f16>>),
}

#[derive(Default)]
struct Scratch {
    x: Vec<f32>,    // [n, hidden] residual stream
    h: Vec<f32>,    // [n, hidden] normed
    qkv: Vec<f32>,  // [n, q + 2kv]
    attn: Vec<f32>, // [n, q]
    tmp: Vec<f32>,  // [n, hidden] projection output
    gu: Vec<f32>,   // [n, 2 * inter]
    act: Vec<f32>,  // [n, inter]
    last: Vec<f32>, // [n_logits, hidden]
    q8: Activations,
    /// The SwiGLU output quantized by the fused decode gate/up product.
    q8_act: Activations,
    logits: Vec<f32>,
    rope_cs: Vec<(f32, f32)>, // [n, rope_dim / 2] (cos, sin) per token
    cs_tmp: Vec<(f32, f32)>,
    moe: MoeScratch,
}

pub struct CpuExecutor {
    cfg: ModelConfig,
    team: Team,
    embed: QMatrix,
    output: QMatrix,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: ops::RopeTable,
    kv: KvCacheSpec,
    store: KvStore,
    attn_f16_accum: bool,
    scratch: Scratch,
    prof: Profiler,
}

/// Element types whose all-zero bit pattern is the value zero.
trait ZeroBits: Copy {}
impl ZeroBits for f32 {}
impl ZeroBits for f16 {}

/// `n` zeros, or an out-of-memory error naming `what` when the allocator refuses (a plain `vec!`
/// would abort the process). Zeroed pages come from the OS lazily, as with `vec![0; n]`, so a
/// large cache costs memory only as it fills.
fn zeroed_vec<T: ZeroBits>(n: usize, what: &str) -> Result<Vec<T>, BackendError> {
    let oom = || BackendError::OutOfMemory(format!("cannot allocate the {what}"));
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| oom())?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout has a nonzero size, as `alloc_zeroed` requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `[T; n]` (so the Vec frees
    // it with the same layout), and its `n` elements are initialized: all bytes are zero, which
    // `ZeroBits` types accept as the value 0.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// The K and V caches of every layer, `slots` zeros each.
type KvLayers<T> = (Vec<Vec<T>>, Vec<Vec<T>>);

fn kv_layers<T: ZeroBits>(
    layers: usize,
    slots: usize,
    what: &str,
) -> Result<KvLayers<T>, BackendError> {
    let one = || {
        (0..layers)
            .map(|_| zeroed_vec(slots, what))
            .collect::<Result<Vec<_>, _>>()
    };
    Ok((one()?, one()?))
}

fn vec_f32(t: &crate::HostTensor, len: usize) -> Result<Vec<f32>, BackendError> {
    if t.n_elements() != len {
        return Err(BackendError::Shape {
            name: t.name.clone(),
            got: t.dims.clone(),
            expected: vec![len],
        });
    }
    t.to_f32()
}

impl CpuExecutor {
    pub fn new(w: &ModelWeights, kv: KvCacheSpec, opts: CpuOptions) -> Result<Self, BackendError> {
        let c = &w.config;
        w.check()?;
        if !kv.block_size.is_power_of_two() || kv.block_size > 128 || kv.num_blocks == 0 {
            return Err(BackendError::Config(format!(
                "block size must be a power of two up to 128 and the cache non-empty (got {} blocks of {})",
                kv.num_blocks, kv.block_size
            )));
        }
        if c.num_heads / c.num_kv_heads > 16 {
            return Err(BackendError::Config(
                "GQA groups above 16 heads are not supported".into(),
            ));
        }
        let (hd, qs, kvs) = (c.hidden_size, c.q_size(), c.kv_size());
        let embed = QMatrix::from_tensor(&w.tok_embd, hd, c.vocab_size)?;
        let output = match &w.output {
            Some(t) => QMatrix::from_tensor(t, hd, c.vocab_size)?,
            None => embed.clone(),
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in &w.layers {
            let wq = QMatrix::from_tensor(&l.wq, hd, qs)?;
            let wk = QMatrix::from_tensor(&l.wk, hd, kvs)?;
            let wv = QMatrix::from_tensor(&l.wv, hd, kvs)?;
            let bqkv = match (&l.bq, &l.bk, &l.bv) {
                (Some(bq), Some(bk), Some(bv)) => {
                    let mut b = vec_f32(bq, qs)?;
                    b.extend(vec_f32(bk, kvs)?);
                    b.extend(vec_f32(bv, kvs)?);
                    Some(b)
                }
                (None, None, None) => None,
                _ => {
                    return Err(BackendError::Config(
                        "Q, K and V biases must come together".into(),
                    ))
                }
            };
            layers.push(Layer {
                attn_norm: vec_f32(&l.attn_norm, hd)?,
                wqkv: QMatrix::concat_rows(&format!("{}+k+v", l.wq.name), &[wq, wk, wv])?,
                bqkv,
                q_norm: l
                    .q_norm
                    .as_ref()
                    .map(|t| vec_f32(t, c.head_dim))
                    .transpose()?,
                k_norm: l
                    .k_norm
                    .as_ref()
                    .map(|t| vec_f32(t, c.head_dim))
                    .transpose()?,
                wo: QMatrix::from_tensor(&l.wo, qs, hd)?,
                ffn_norm: vec_f32(&l.ffn_norm, hd)?,
                ffn: Ffn::new(&l.ffn, c)?,
            });
        }
        let slots = kv
            .num_blocks
            .checked_mul(kv.block_size)
            .and_then(|s| s.checked_mul(kvs))
            .ok_or_else(|| BackendError::OutOfMemory("KV cache size overflows".into()))?;
        let what = |elem: usize| {
            format!(
                "KV cache of {} blocks of {} tokens ({} MiB per layer for K and for V)",
                kv.num_blocks,
                kv.block_size,
                slots.saturating_mul(elem) >> 20
            )
        };
        let store = match opts.kv_dtype {
            KvDtype::F32 => {
                let (k, v) = kv_layers(c.num_layers, slots, &what(4))?;
                KvStore::F32(k, v)
            }
            KvDtype::F16 => {
                let (k, v) = kv_layers(c.num_layers, slots, &what(2))?;
                KvStore::F16(k, v)
            }
        };
        let team = Team::new(opts.threads.max(1));
        Ok(Self {
            rope: ops::RopeTable::new(c.rope_dim, c.rope_theta, w.rope_freqs.as_deref()),
            output_norm: vec_f32(&w.output_norm, hd)?,
            cfg: c.clone(),
            team,
            embed,
            output,
            layers,
            kv,
            store,
            attn_f16_accum: opts.attn_f16_accum,
            scratch: Scratch::default(),
            prof: Profiler::default(),
        })
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn threads(&self) -> usize {
        self.team.threads()
    }

    /// Bytes of weights read by one forward pass (all layers plus the output projection).
    pub fn weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.wqkv.bytes() + l.wo.bytes() + l.ffn.bytes())
            .sum::<usize>()
            + self.output.bytes()
    }
}

/// Dims of the matrix product `n × w`: bytes read (weights + activations + output) and FLOPs.
fn mm_cost(w: &QMatrix, n: usize) -> (u64, u64) {
    let bytes = w.bytes() + n * (w.cols + w.rows) * 4;
    (bytes as u64, (2 * n * w.rows * w.cols) as u64)
}

impl Executor for CpuExecutor {
    fn backend_name(&self) -> &'static str {
        "cpu"
    }

    fn kv_spec(&self) -> KvCacheSpec {
        self.kv
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn set_profiling(&mut self, on: bool) {
        self.prof.set(on);
    }

    fn take_profile(&mut self) -> Vec<OpStat> {
        self.prof.take()
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<&[f32], BackendError> {
        self.forward_inner(batch)?;
        Ok(&self.scratch.logits)
    }
}

impl CpuExecutor {
    fn forward_inner(&mut self, batch: &ForwardBatch) -> Result<(), BackendError> {
        batch.check(self.kv, self.cfg.vocab_size)?;
        let c = &self.cfg;
        let n = batch.num_tokens();
        let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
        let qkv_dim = qs + 2 * kvs;
        let s = &mut self.scratch;
        s.x.resize(n * hd, 0.0);
        s.h.resize(n * hd, 0.0);
        s.qkv.resize(n * qkv_dim, 0.0);
        s.attn.resize(n * qs, 0.0);
        s.tmp.resize(n * hd, 0.0);
        s.gu.resize(n * 2 * inter, 0.0);
        s.act.resize(n * inter, 0.0);
        let prof = &mut self.prof;
        let pool: &dyn Parallel = &self.team;

        prof.time("embed", None, (n * self.embed.row_bytes) as u64, 0, || {
            for (t, &tok) in batch.token_ids.iter().enumerate() {
                self.embed
                    .dequantize_row(tok as usize, &mut s.x[t * hd..(t + 1) * hd]);
            }
        });
        let attn = AttnParams {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: self.kv.block_size,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            f16_accum: self.attn_f16_accum && matches!(self.store, KvStore::F16(..)),
            sliding_window: c.sliding_window,
        };
        s.rope_cs.clear();
        for &pos in batch.positions {
            self.rope.angles(pos, &mut s.cs_tmp);
            s.rope_cs.extend_from_slice(&s.cs_tmp);
        }
        for (li, l) in self.layers.iter().enumerate() {
            let layer = Some(li);
            prof.time(
                "rms_norm",
                layer,
                (n * hd * 8) as u64,
                (n * hd * 3) as u64,
                || {
                    ops::rms_norm_par(pool, &s.x, &l.attn_norm, c.rms_norm_eps, &mut s.h);
                    s.q8.prepare(pool, &s.h, hd, l.wqkv.dtype);
                },
            );
            let (b, f) = mm_cost(&l.wqkv, n);
            prof.time("matmul_qkv", layer, b, f, || {
                matmul(pool, &l.wqkv, &s.h, &s.q8, &mut s.qkv)
            });
            prof.time(
                "rope",
                layer,
                (n * (qs + kvs) * 8) as u64,
                (n * (qs + kvs) * 6) as u64,
                || bias_norm_rope(c, l, &mut s.qkv, &s.rope_cs),
            );
            let ctx: usize = batch.seqs.iter().map(|q| q.query_len * q.seq_len).sum();
            let elem = match self.store {
                KvStore::F32(..) => 4,
                KvStore::F16(..) => 2,
            };
            let attn_bytes = (batch.seqs.iter().map(|q| q.seq_len).sum::<usize>() * 2 * kvs * elem
                + n * qs * 8) as u64;
            let attn_flops = (4 * ctx * qs) as u64;
            prof.time("attention", layer, attn_bytes, attn_flops, || {
                // Rows of qkv are [q | k | v]; each view keeps the row stride.
                let (q, k_new, v_new) = (&s.qkv[..], &s.qkv[qs..], &s.qkv[qs + kvs..]);
                match &mut self.store {
                    KvStore::F32(kc, vc) => run_attn(
                        pool,
                        &attn,
                        q,
                        qkv_dim,
                        k_new,
                        v_new,
                        batch,
                        &mut kc[li],
                        &mut vc[li],
                        &mut s.attn,
                    ),
                    KvStore::F16(kc, vc) => run_attn(
                        pool,
                        &attn,
                        q,
                        qkv_dim,
                        k_new,
                        v_new,
                        batch,
                        &mut kc[li],
                        &mut vc[li],
                        &mut s.attn,
                    ),
                }
            });
            let (b, f) = mm_cost(&l.wo, n);
            prof.time("matmul_o", layer, b, f, || {
                s.q8.prepare(pool, &s.attn, qs, l.wo.dtype);
                matmul(pool, &l.wo, &s.attn, &s.q8, &mut s.tmp);
                ops::add_in_place(&mut s.x, &s.tmp);
            });
            prof.time(
                "rms_norm",
                layer,
                (n * hd * 8) as u64,
                (n * hd * 3) as u64,
                || {
                    ops::rms_norm_par(pool, &s.x, &l.ffn_norm, c.rms_norm_eps, &mut s.h);
                    s.q8.prepare(pool, &s.h, hd, l.ffn.input_dtype());
                },
            );
            match &l.ffn {
                Ffn::Dense {
                    gate_up,
                    chunked,
                    down,
                } => dense_ffn(pool, prof, layer, s, (gate_up, *chunked, down), n, inter),
                Ffn::Moe(m) => m.forward(pool, prof, layer, &s.h, &mut s.moe, &mut s.x),
            }
        }
        let nl = batch.logits_indices.len();
        s.last.resize(nl * hd, 0.0);
        s.h.resize(nl * hd, 0.0);
        for (i, &row) in batch.logits_indices.iter().enumerate() {
            let row = row as usize;
            s.last[i * hd..(i + 1) * hd].copy_from_slice(&s.x[row * hd..(row + 1) * hd]);
        }
        s.logits.resize(nl * c.vocab_size, 0.0);
        let (b, f) = mm_cost(&self.output, nl);
        let output = &self.output;
        prof.time("output", None, b, f, || {
            ops::rms_norm(
                &s.last,
                &self.output_norm,
                c.rms_norm_eps,
                &mut s.h[..nl * hd],
            );
            s.q8.prepare(pool, &s.h[..nl * hd], hd, output.dtype);
            matmul(pool, output, &s.h[..nl * hd], &s.q8, &mut s.logits);
        });
        Ok(())
    }
}

/// Each token's Q and K after the QKV projection: the biases (Qwen2), the per-head RMSNorm
/// (Qwen3), then RoPE with the token's angles. qkv: [tokens, q | k | v] f32; rope_cs: [tokens,
/// rope_dim / 2] (cos, sin).
fn bias_norm_rope(c: &ModelConfig, l: &Layer, qkv: &mut [f32], rope_cs: &[(f32, f32)]) {
    let (qs, kvs, pairs) = (c.q_size(), c.kv_size(), c.rope_dim / 2);
    for (t, row) in qkv.chunks_exact_mut(qs + 2 * kvs).enumerate() {
        if let Some(b) = &l.bqkv {
            ops::add_in_place(row, b);
        }
        let (q, rest) = row.split_at_mut(qs);
        let k = &mut rest[..kvs];
        if let (Some(qn), Some(kn)) = (&l.q_norm, &l.k_norm) {
            ops::rms_norm_heads(q, qn, c.rms_norm_eps);
            ops::rms_norm_heads(k, kn, c.rms_norm_eps);
        }
        let cs = &rope_cs[t * pairs..(t + 1) * pairs];
        ops::rope(q, c.head_dim, cs, c.rope_style);
        ops::rope(k, c.head_dim, cs, c.rope_style);
    }
}

/// A dense SwiGLU block on the normed rows in `s.h` (quantized in `s.q8`), added into the
/// residual `s.x`: `down(silu(gate(h)) * up(h))`. `ffn`: the gate/up matrix, whether its rows
/// interleave gate and up by blocks (`chunked`), and the down matrix.
fn dense_ffn(
    pool: &dyn Parallel,
    prof: &mut Profiler,
    layer: Option<usize>,
    s: &mut Scratch,
    ffn: (&QMatrix, bool, &QMatrix),
    n: usize,
    inter: usize,
) {
    let (w_gate_up, chunked, w_down) = ffn;
    let (b, f) = mm_cost(w_gate_up, n);
    if n == 1 && chunked && needs_q8(w_down.dtype) {
        // Decode: SwiGLU and the down projection's quantization inside the gate/up
        // section (its time includes them).
        prof.time("matmul_gate_up", layer, b, f, || {
            matmul_swiglu(pool, w_gate_up, &s.h, &s.q8, &mut s.act, &mut s.q8_act)
        });
    } else {
        prof.time("matmul_gate_up", layer, b, f, || {
            matmul(pool, w_gate_up, &s.h, &s.q8, &mut s.gu)
        });
        prof.time(
            "swiglu",
            layer,
            (n * inter * 12) as u64,
            (n * inter * 6) as u64,
            || {
                if chunked {
                    ops::swiglu_chunked(&s.gu, inter, QK, &mut s.act)
                } else {
                    ops::swiglu(&s.gu, inter, &mut s.act)
                }
                s.q8_act.prepare(pool, &s.act, inter, w_down.dtype);
            },
        );
    }
    let (b, f) = mm_cost(w_down, n);
    prof.time("matmul_down", layer, b, f, || {
        matmul(pool, w_down, &s.act, &s.q8_act, &mut s.tmp);
        ops::add_in_place(&mut s.x, &s.tmp);
    });
}

#[allow(clippy::too_many_arguments)]
fn run_attn<T: KvElem>(
    pool: &dyn Parallel,
    p: &AttnParams,
    q: &[f32],
    stride: usize,
    k_new: &[f32],
    v_new: &[f32],
    batch: &ForwardBatch,
    k_cache: &mut [T],
    v_cache: &mut [T],
    out: &mut [f32],
) {
    paged_attention(
        pool,
        p,
        q,
        stride,
        k_new,
        v_new,
        stride,
        batch.slot_mapping,
        batch.seqs,
        k_cache,
        v_cache,
        out,
    );
}

#[cfg(test)]
mod alloc_tests {
    use super::*;

    #[test]
    fn an_impossible_kv_cache_is_an_error_not_an_abort() {
        let z: Vec<f32> = zeroed_vec(1000, "test").unwrap();
        assert!(z.iter().all(|&x| x == 0.0));
        // 2^60 f16s (2 EiB): no allocator grants it.
        let e = zeroed_vec::<f16>(1 << 60, "KV cache").unwrap_err();
        assert!(
            e.to_string().contains("cannot allocate the KV cache"),
            "{e}"
        );
        assert!(zeroed_vec::<f32>(usize::MAX, "x").is_err());
    }
}
