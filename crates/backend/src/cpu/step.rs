//! The CPU's kernels behind the shared layer sequence (`crate::forward`): one `CpuStep` per
//! forward step, bound to the step's batch and the executor's buffers. The order of the ops lives
//! in `forward.rs`; this file says how the CPU does each one. Its fusions: every RMSNorm quantizes
//! its output for the matmul that reads it, and a decode step's gate/up product applies SwiGLU and
//! quantizes for the down product itself (`matmul_swiglu`).

use half::f16;
use quire_core::ModelConfig;
use quire_gguf::GgmlType;

use super::attention::{paged_attention_math, AttnParams, KvElem};
use super::matmul::{
    matmul_math, matmul_multi_swiglu, matmul_swiglu, multi_isa, Activations, QMatrix,
};
use super::moe::{MoeLayer, MoeScratch};
use super::ops;
use super::profile::Profiler;
use super::quant::{needs_q8, QK};
use super::team::Parallel;
use super::CpuMath;
use crate::forward::{Act, LayerOps, Next};
use crate::tp::{HostReduce, Shard};
use crate::{BackendError, ForwardBatch};

/// Every layer's K and V caches, in the cache's element type.
pub(super) enum KvStore {
    F32(Vec<Vec<f32>>, Vec<Vec<f32>>),
    F16(Vec<Vec<f16>>, Vec<Vec<f16>>),
}

/// The activations of a step, by role; they only grow.
#[derive(Default)]
pub(super) struct Scratch {
    pub x: Vec<f32>,    // [n, hidden] residual stream
    pub h: Vec<f32>,    // [n, hidden] normed
    pub qkv: Vec<f32>,  // [n, q + 2kv]
    pub attn: Vec<f32>, // [n, q]
    pub tmp: Vec<f32>,  // [n, hidden] projection output
    pub gu: Vec<f32>,   // [n, 2 * inter]
    pub act: Vec<f32>,  // [n, inter]
    pub last: Vec<f32>, // [n_logits, hidden]
    pub q8: Activations,
    /// The SwiGLU output quantized for the down product.
    pub q8_act: Activations,
    pub logits: Vec<f32>,
    /// A vocab-parallel rank's own logits columns, [n_logits, its vocabulary span], and every
    /// rank's gathered, [rank][n_logits][span].
    pub logits_part: Vec<f32>,
    pub logits_gathered: Vec<f32>,
    pub rope_cs: Vec<(f32, f32)>, // [n, rope_dim / 2] (cos, sin) per token
    pub cs_tmp: Vec<(f32, f32)>,
    pub moe: MoeScratch,
}

/// One forward step on the CPU: the batch, its buffers (sized for its tokens, `rope_cs` filled)
/// and the thread team.
pub(super) struct CpuStep<'a> {
    pub c: &'a ModelConfig,
    pub pool: &'a dyn Parallel,
    pub prof: &'a mut Profiler,
    pub s: &'a mut Scratch,
    pub store: &'a mut KvStore,
    pub embed: &'a QMatrix,
    pub batch: &'a ForwardBatch<'a>,
    pub attn: AttnParams,
    pub math: CpuMath,
    /// This rank's group, when the model is sharded (`crate::tp`).
    pub tp: Option<(&'a HostReduce, Shard)>,
}

/// `x` += `y`, or `x` ← `y` (a partial product of a rank other than the lead).
fn add_or_set(x: &mut [f32], y: &[f32], add: bool) {
    if add {
        ops::add_in_place(x, y);
    } else {
        x.copy_from_slice(y);
    }
}

/// Dims of the matrix product `n × w`: bytes read (weights + activations + output) and FLOPs.
pub(super) fn mm_cost(w: &QMatrix, n: usize) -> (u64, u64) {
    let bytes = w.bytes() + n * (w.cols + w.rows) * 4;
    (bytes as u64, (2 * n * w.rows * w.cols) as u64)
}

impl CpuStep<'_> {
    fn n(&self) -> usize {
        self.batch.num_tokens()
    }

    fn no_group(&self) -> Result<(), BackendError> {
        Err(BackendError::Config(
            "an all-reduce in a model that is not sharded".into(),
        ))
    }
}

impl LayerOps for CpuStep<'_> {
    type M = QMatrix;
    type V = Vec<f32>;
    type E = MoeLayer;

    fn embed(&mut self) -> Result<(), BackendError> {
        let (n, hd) = (self.n(), self.c.hidden_size);
        let Self {
            prof,
            s,
            embed,
            batch,
            ..
        } = self;
        prof.time("embed", None, (n * embed.row_bytes) as u64, 0, || {
            for (t, &tok) in batch.token_ids.iter().enumerate() {
                embed.dequantize_row(tok as usize, &mut s.x[t * hd..(t + 1) * hd]);
            }
        });
        Ok(())
    }

    fn rms_norm(
        &mut self,
        layer: usize,
        w: &Vec<f32>,
        next: Next<'_, QMatrix, MoeLayer>,
    ) -> Result<(), BackendError> {
        let (n, hd, eps) = (self.n(), self.c.hidden_size, self.c.rms_norm_eps);
        // MoE quantizes its own gathered rows.
        let dtype = match next {
            Next::Matmul(m) => m.dtype,
            Next::Moe(_) => GgmlType::F32,
        };
        let (pool, s) = (self.pool, &mut *self.s);
        let (bytes, flops) = ((n * hd * 8) as u64, (n * hd * 3) as u64);
        self.prof.time("rms_norm", Some(layer), bytes, flops, || {
            ops::rms_norm_par(pool, &s.x, w, eps, &mut s.h);
            s.q8.prepare(pool, &s.h, hd, dtype);
        });
        Ok(())
    }

    fn matmul(
        &mut self,
        layer: usize,
        w: &QMatrix,
        src: Act,
        dst: Act,
        add: bool,
    ) -> Result<(), BackendError> {
        let (b, f) = mm_cost(w, self.n());
        let (pool, name, layer) = (self.pool, Act::matmul_name(src, dst), Some(layer));
        let math = self.math;
        let Scratch {
            x,
            h,
            qkv,
            attn,
            tmp,
            act,
            q8,
            q8_act,
            ..
        } = &mut *self.s;
        // The products the sequence makes: into `Qkv`, or added into the residual.
        match (src, dst, add) {
            (Act::H, Act::Qkv, false) => self
                .prof
                .time(name, layer, b, f, || matmul_math(pool, math, w, h, q8, qkv)),
            (Act::Attn, Act::X, _) => self.prof.time(name, layer, b, f, || {
                q8.prepare(pool, attn, w.cols, w.dtype);
                matmul_math(pool, math, w, attn, q8, tmp);
                add_or_set(x, tmp, add);
            }),
            (Act::Swiglu, Act::X, _) => self.prof.time(name, layer, b, f, || {
                matmul_math(pool, math, w, act, q8_act, tmp);
                add_or_set(x, tmp, add);
            }),
            _ => {
                return Err(BackendError::Config(format!(
                    "the CPU has no matmul from {src:?} to {dst:?} (add: {add})"
                )))
            }
        }
        Ok(())
    }

    fn qkv_post(
        &mut self,
        layer: usize,
        bias: Option<&Vec<f32>>,
        q_norm: Option<&Vec<f32>>,
        k_norm: Option<&Vec<f32>>,
    ) -> Result<(), BackendError> {
        let c = self.c;
        let n = self.n();
        let qk = c.q_size() + c.kv_size();
        let s = &mut *self.s;
        self.prof.time(
            "rope",
            Some(layer),
            (n * qk * 8) as u64,
            (n * qk * 6) as u64,
            || {
                let post = (
                    bias.map(Vec::as_slice),
                    q_norm.map(Vec::as_slice),
                    k_norm.map(Vec::as_slice),
                );
                bias_norm_rope(c, post, &mut s.qkv, &s.rope_cs)
            },
        );
        Ok(())
    }

    fn attention(&mut self, li: usize) -> Result<(), BackendError> {
        let c = self.c;
        let (batch, n, pool, p, math) = (self.batch, self.n(), self.pool, &self.attn, self.math);
        let (qs, kvs) = (c.q_size(), c.kv_size());
        let qkv_dim = qs + 2 * kvs;
        let ctx: usize = batch.seqs.iter().map(|q| q.query_len * q.seq_len).sum();
        let elem = match self.store {
            KvStore::F32(..) => 4,
            KvStore::F16(..) => 2,
        };
        let attn_bytes = (batch.seqs.iter().map(|q| q.seq_len).sum::<usize>() * 2 * kvs * elem
            + n * qs * 8) as u64;
        let attn_flops = (4 * ctx * qs) as u64;
        let (s, store) = (&mut *self.s, &mut *self.store);
        self.prof
            .time("attention", Some(li), attn_bytes, attn_flops, || {
                // Rows of qkv are [q | k | v]; each view keeps the row stride.
                let (q, k_new, v_new) = (&s.qkv[..], &s.qkv[qs..], &s.qkv[qs + kvs..]);
                let qkv = (q, k_new, v_new, qkv_dim);
                match store {
                    KvStore::F32(kc, vc) => run_attn(
                        pool,
                        math,
                        p,
                        qkv,
                        batch,
                        &mut kc[li],
                        &mut vc[li],
                        &mut s.attn,
                    ),
                    KvStore::F16(kc, vc) => run_attn(
                        pool,
                        math,
                        p,
                        qkv,
                        batch,
                        &mut kc[li],
                        &mut vc[li],
                        &mut s.attn,
                    ),
                }
            });
        Ok(())
    }

    /// Decode with interleaved gate/up rows and a quantized down matrix: SwiGLU and the down
    /// product's quantization inside the gate/up product (its time includes them).
    fn gate_up(
        &mut self,
        layer: usize,
        gate_up: &QMatrix,
        down: &QMatrix,
    ) -> Result<(), BackendError> {
        let (n, inter) = (self.n(), self.c.intermediate_size);
        let (pool, s) = (self.pool, &mut *self.s);
        let (b, f) = mm_cost(gate_up, n);
        if gate_up.interleaved == Some(QK) && needs_q8(down.dtype) {
            if n == 1 {
                self.prof.time("matmul_gate_up", Some(layer), b, f, || {
                    matmul_swiglu(pool, gate_up, &s.h, &s.q8, &mut s.act, &mut s.q8_act)
                });
                return Ok(());
            }
            if let Some(isa) = multi_isa(gate_up, n) {
                self.prof.time("matmul_gate_up", Some(layer), b, f, || {
                    matmul_multi_swiglu(pool, isa, gate_up, &s.q8, &mut s.act, &mut s.q8_act)
                });
                return Ok(());
            }
        }
        self.prof.time("matmul_gate_up", Some(layer), b, f, || {
            matmul_math(pool, self.math, gate_up, &s.h, &s.q8, &mut s.gu)
        });
        self.prof.time(
            "swiglu",
            Some(layer),
            (n * inter * 12) as u64,
            (n * inter * 6) as u64,
            || {
                match gate_up.interleaved {
                    Some(chunk) => ops::swiglu_chunked(&s.gu, inter, chunk, &mut s.act),
                    None => ops::swiglu(&s.gu, inter, &mut s.act),
                }
                s.q8_act.prepare(pool, &s.act, inter, down.dtype);
            },
        );
        Ok(())
    }

    fn moe(&mut self, layer: usize, moe: &MoeLayer) -> Result<(), BackendError> {
        let s = &mut *self.s;
        moe.forward(
            self.pool,
            self.prof,
            Some(layer),
            &s.h,
            &mut s.moe,
            &mut s.x,
        );
        Ok(())
    }

    fn shard(&self) -> Option<Shard> {
        self.tp.map(|(_, s)| s)
    }

    fn all_reduce(&mut self, layer: usize) -> Result<(), BackendError> {
        let Some((group, shard)) = self.tp else {
            return self.no_group();
        };
        let x = &mut self.s.x;
        let bytes = (x.len() * 4 * 2) as u64;
        self.prof.time("all_reduce", Some(layer), bytes, 0, || {
            group.all_reduce(shard.rank, x)
        })
    }

    fn zero_residual(&mut self) -> Result<(), BackendError> {
        if self.tp.is_none() {
            return self.no_group();
        }
        self.s.x.fill(0.0);
        Ok(())
    }

    /// The logits of the wanted rows. A rank of a group holds only its vocabulary rows of `w`
    /// (`Shard::vocab_span`): it computes those columns, then the ranks all-gather them, so
    /// every rank ends with the full `[n_logits, vocab]` rows.
    fn output(&mut self, norm: &Vec<f32>, w: &QMatrix) -> Result<(), BackendError> {
        let (c, pool, s) = (self.c, self.pool, &mut *self.s);
        let hd = c.hidden_size;
        let rows = self.batch.logits_indices;
        let nl = rows.len();
        s.last.resize(nl * hd, 0.0);
        s.h.resize(nl * hd, 0.0);
        for (i, &row) in rows.iter().enumerate() {
            let row = row as usize;
            s.last[i * hd..(i + 1) * hd].copy_from_slice(&s.x[row * hd..(row + 1) * hd]);
        }
        let split = self.tp.filter(|_| w.rows != c.vocab_size);
        let out = if split.is_some() {
            &mut s.logits_part
        } else {
            &mut s.logits
        };
        out.resize(nl * w.rows, 0.0);
        let (b, f) = mm_cost(w, nl);
        self.prof.time("output", None, b, f, || {
            ops::rms_norm(&s.last, norm, c.rms_norm_eps, &mut s.h[..nl * hd]);
            s.q8.prepare(pool, &s.h[..nl * hd], hd, w.dtype);
            matmul_math(pool, self.math, w, &s.h[..nl * hd], &s.q8, out);
        });
        let Some((group, shard)) = split else {
            return Ok(());
        };
        let v = c.vocab_size;
        let bytes = (nl * v * 4 * 2) as u64;
        self.prof.time("all_gather", None, bytes, 0, || {
            group.all_gather(shard.rank, &s.logits_part, &mut s.logits_gathered)
        })?;
        if s.logits_gathered.len() != nl * v {
            return Err(BackendError::Config(format!(
                "the group's gathered logits are {} values, not {nl} rows of {v}",
                s.logits_gathered.len()
            )));
        }
        // [rank][nl][span] → [nl][vocab]
        s.logits.resize(nl * v, 0.0);
        let mut src = &s.logits_gathered[..];
        for r in 0..shard.size {
            let (first, count) = Shard { rank: r, ..shard }.vocab_span(v);
            let (part, rest) = src.split_at(nl * count);
            if count == 0 {
                continue;
            }
            for (dst, row) in s.logits.chunks_exact_mut(v).zip(part.chunks_exact(count)) {
                dst[first..first + count].copy_from_slice(row);
            }
            src = rest;
        }
        Ok(())
    }
}

/// A layer's (bias, q_norm, k_norm) vectors, each where the model has them.
type QkvPost<'a> = (Option<&'a [f32]>, Option<&'a [f32]>, Option<&'a [f32]>);

/// Each token's Q and K after the QKV projection: the biases (Qwen2), the per-head RMSNorm
/// (Qwen3), then RoPE with the token's angles. qkv: [tokens, q | k | v] f32; rope_cs: [tokens,
/// rope_dim / 2] (cos, sin).
fn bias_norm_rope(c: &ModelConfig, post: QkvPost<'_>, qkv: &mut [f32], rope_cs: &[(f32, f32)]) {
    let (bias, q_norm, k_norm) = post;
    let (qs, kvs, pairs) = (c.q_size(), c.kv_size(), c.rope_dim / 2);
    for (t, row) in qkv.chunks_exact_mut(qs + 2 * kvs).enumerate() {
        if let Some(b) = bias {
            ops::add_in_place(row, b);
        }
        let (q, rest) = row.split_at_mut(qs);
        let k = &mut rest[..kvs];
        if let (Some(qn), Some(kn)) = (q_norm, k_norm) {
            ops::rms_norm_heads(q, qn, c.rms_norm_eps);
            ops::rms_norm_heads(k, kn, c.rms_norm_eps);
        }
        let cs = &rope_cs[t * pairs..(t + 1) * pairs];
        ops::rope(q, c.head_dim, cs, c.rope_style);
        ops::rope(k, c.head_dim, cs, c.rope_style);
    }
}

/// Paged attention of the step with its KV write. `qkv`: (q, k_new, v_new, row stride), views of
/// the QKV rows.
#[allow(clippy::too_many_arguments)]
fn run_attn<T: KvElem>(
    pool: &dyn Parallel,
    math: CpuMath,
    p: &AttnParams,
    qkv: (&[f32], &[f32], &[f32], usize),
    batch: &ForwardBatch,
    k_cache: &mut [T],
    v_cache: &mut [T],
    out: &mut [f32],
) {
    let (q, k_new, v_new, stride) = qkv;
    paged_attention_math(
        pool,
        math,
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
