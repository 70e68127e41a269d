//! The feed-forward block of a CPU layer: dense SwiGLU, or a sparse mixture of SwiGLU experts
//! (Qwen3-MoE), as the CPU loads it; the layer sequence (`crate::forward`) only asks "which FFN".
//!
//! MoE semantics, as transformers' `Qwen3MoeSparseMoeBlock` and llama.cpp's `build_moe_ffn`
//! (softmax gating) define them: per token, router logits `x · gate_inpᵀ` in f32, softmax over all
//! experts in f32, the `k` largest probabilities (ties: the lower expert index first), divided by
//! their sum when `norm_topk_prob`, then `out = Σ w_e · down_e(silu(gate_e(x)) ⊙ up_e(x))`.
//!
//! Prefill groups the tokens by expert, so each chosen expert's weights are read once per step
//! and its three products run as small batched matmuls (threaded over rows by `matmul`). Expert
//! matrices are zero-copy views of the slabs of the stacked `*_exps` tensors.

use quire_core::ModelConfig;
use quire_gguf::GgmlType;

use super::matmul::{matmul, Activations, QMatrix};
use super::profile::Profiler;
use super::quant::{needs_q8, QK};
use super::team::Parallel;
use crate::forward::Ffn;
use crate::{BackendError, FfnWeights, HostTensor, MoeWeights, TensorBytes};

/// A layer's FFN in the form the CPU computes it: gate and up in one `[2 * inter, hidden]` matrix,
/// interleaved in chunks of 32 rows where `inter` allows (the fused decode `matmul_swiglu`; the
/// matrix says so in `interleaved`), else stacked `[gate | up]`; down `[hidden, inter]`.
pub fn ffn(w: &FfnWeights, c: &ModelConfig) -> Result<Ffn<QMatrix, MoeLayer>, BackendError> {
    let hd = c.hidden_size;
    match (w, &c.moe) {
        (
            FfnWeights::Dense {
                w_gate,
                w_up,
                w_down,
            },
            None,
        ) => {
            let inter = c.intermediate_size;
            let gate = QMatrix::from_tensor(w_gate, hd, inter)?;
            let up = QMatrix::from_tensor(w_up, hd, inter)?;
            let name = format!("{}+up", w_gate.name);
            Ok(Ffn::Dense {
                gate_up: if inter.is_multiple_of(QK) {
                    QMatrix::interleave_rows(&name, &gate, &up, QK)?
                } else {
                    QMatrix::concat_rows(&name, &[gate, up])?
                },
                down: QMatrix::from_tensor(w_down, inter, hd)?,
            })
        }
        (FfnWeights::Moe(m), Some(_)) => Ok(Ffn::Moe(MoeLayer::new(m, c)?)),
        (FfnWeights::Dense { .. }, Some(_)) => Err(BackendError::Config(
            "the config has experts but the layer a dense FFN".into(),
        )),
        (FfnWeights::Moe(_), None) => Err(BackendError::Config(
            "the layer has experts but the config no MoE section".into(),
        )),
    }
}

/// Weight bytes one token reads in `f` (a MoE token reads the router and its top-k experts).
pub fn ffn_bytes(f: &Ffn<QMatrix, MoeLayer>) -> usize {
    match f {
        Ffn::Dense { gate_up, down } => gate_up.bytes() + down.bytes(),
        Ffn::Moe(m) => m.router.bytes() + m.top_k * m.expert_bytes(),
    }
}

/// One layer's experts.
pub struct MoeLayer {
    pub num_experts: usize,
    pub top_k: usize,
    pub inter: usize,
    pub hidden: usize,
    pub norm_topk_prob: bool,
    /// Router in f32: [num_experts, hidden].
    pub router: QMatrix,
    /// Per expert: gate, up `[inter, hidden]`; down `[hidden, inter]`.
    pub gate: Vec<QMatrix>,
    pub up: Vec<QMatrix>,
    pub down: Vec<QMatrix>,
}

/// Expert `e`'s `[rows, row_len]` slab of a stacked `[row_len, rows, experts]` tensor, as a matrix.
fn expert_views(
    t: &HostTensor,
    row_len: usize,
    rows: usize,
    experts: usize,
) -> Result<Vec<QMatrix>, BackendError> {
    if t.dims != [row_len, rows, experts] {
        return Err(BackendError::Shape {
            name: t.name.clone(),
            got: t.dims.clone(),
            expected: vec![row_len, rows, experts],
        });
    }
    let bs = t.dtype.block_size();
    if !row_len.is_multiple_of(bs) {
        return Err(BackendError::Config(format!(
            "{}: row length {row_len} is not a multiple of the block size {bs}",
            t.name
        )));
    }
    let slab = row_len / bs * t.dtype.type_size() * rows;
    if t.bytes.as_slice().len() != slab * experts {
        return Err(BackendError::Config(format!(
            "{}: byte length does not match its shape",
            t.name
        )));
    }
    (0..experts)
        .map(|e| {
            let view = HostTensor {
                name: format!("{}[{e}]", t.name),
                dtype: t.dtype,
                dims: vec![row_len, rows],
                bytes: t.bytes.slice(e * slab, slab).ok_or_else(|| {
                    BackendError::Config(format!("{}: expert {e} out of range", t.name))
                })?,
            };
            QMatrix::from_tensor(&view, row_len, rows)
        })
        .collect()
}

impl MoeLayer {
    pub fn new(w: &MoeWeights, c: &ModelConfig) -> Result<Self, BackendError> {
        let m = c
            .moe
            .ok_or_else(|| BackendError::Config("MoE weights without a MoE config".into()))?;
        let (hd, ne, inter) = (c.hidden_size, m.num_experts, m.expert_intermediate_size);
        if w.gate_inp.dims != [hd, ne] {
            return Err(BackendError::Shape {
                name: w.gate_inp.name.clone(),
                got: w.gate_inp.dims.clone(),
                expected: vec![hd, ne],
            });
        }
        // The router runs in f32 whatever its stored type (llama.cpp keeps it f32 too).
        let router_bytes: Vec<u8> = w
            .gate_inp
            .to_f32()?
            .into_iter()
            .flat_map(f32::to_le_bytes)
            .collect();
        let router = HostTensor {
            name: w.gate_inp.name.clone(),
            dtype: GgmlType::F32,
            dims: vec![hd, ne],
            bytes: TensorBytes::owned(router_bytes),
        };
        let gate = expert_views(&w.gate_exps, hd, inter, ne)?;
        let up = expert_views(&w.up_exps, hd, inter, ne)?;
        let down = expert_views(&w.down_exps, inter, hd, ne)?;
        Ok(Self {
            num_experts: ne,
            top_k: m.num_experts_per_tok,
            inter,
            hidden: hd,
            norm_topk_prob: m.norm_topk_prob,
            router: QMatrix::from_tensor(&router, hd, ne)?,
            gate,
            up,
            down,
        })
    }

    /// Bytes of one expert's three matrices.
    pub fn expert_bytes(&self) -> usize {
        self.gate[0].bytes() + self.up[0].bytes() + self.down[0].bytes()
    }

    /// `x += moe(h)` for every token.
    // h: [n, hidden] (normed FFN input); x: [n, hidden] (residual stream)
    #[allow(clippy::too_many_arguments)]
    pub fn forward(
        &self,
        pool: &dyn Parallel,
        prof: &mut Profiler,
        layer: Option<usize>,
        h: &[f32],
        s: &mut MoeScratch,
        x: &mut [f32],
    ) {
        let (hd, ne, k, inter) = (self.hidden, self.num_experts, self.top_k, self.inter);
        let n = h.len() / hd;
        s.logits.resize(n * ne, 0.0);
        prof.time(
            "moe_router",
            layer,
            (self.router.bytes() + n * (hd + ne) * 4) as u64,
            (2 * n * ne * hd) as u64,
            || {
                matmul(
                    pool,
                    &self.router,
                    h,
                    &Activations::default(),
                    &mut s.logits,
                );
                s.by_expert.resize_with(ne, Vec::new);
                s.by_expert.iter_mut().for_each(Vec::clear);
                for (t, row) in s.logits.chunks_exact(ne).enumerate() {
                    route(row, k, self.norm_topk_prob, &mut s.chosen);
                    for &(e, w) in &s.chosen {
                        s.by_expert[e].push((t, w));
                    }
                }
            },
        );
        let active = s.by_expert.iter().filter(|v| !v.is_empty()).count();
        prof.time(
            "moe_experts",
            layer,
            (active * self.expert_bytes() + n * k * (2 * hd + 3 * inter) * 4) as u64,
            (6 * n * k * hd * inter) as u64,
            || {
                s.out.clear();
                s.out.resize(n * hd, 0.0);
                for e in 0..ne {
                    let routed = &s.by_expert[e];
                    let m = routed.len();
                    if m == 0 {
                        continue;
                    }
                    // Gather this expert's tokens: xe [m, hidden].
                    s.xe.clear();
                    for &(t, _) in routed {
                        s.xe.extend_from_slice(&h[t * hd..(t + 1) * hd]);
                    }
                    let (gate, up, down) = (&self.gate[e], &self.up[e], &self.down[e]);
                    let in_dtype = if needs_q8(gate.dtype) {
                        gate.dtype
                    } else {
                        up.dtype
                    };
                    s.qx.prepare(pool, &s.xe, hd, in_dtype);
                    s.g.resize(m * inter, 0.0);
                    s.u.resize(m * inter, 0.0);
                    matmul(pool, gate, &s.xe, &s.qx, &mut s.g);
                    matmul(pool, up, &s.xe, &s.qx, &mut s.u);
                    // silu(g) * u, in place in g: [m, inter].
                    for (g, u) in s.g.iter_mut().zip(&s.u) {
                        *g = *g / (1.0 + (-*g).exp()) * u;
                    }
                    s.qa.prepare(pool, &s.g, inter, down.dtype);
                    s.y.resize(m * hd, 0.0);
                    matmul(pool, down, &s.g, &s.qa, &mut s.y);
                    for (j, &(t, w)) in routed.iter().enumerate() {
                        let out = &mut s.out[t * hd..(t + 1) * hd];
                        for (o, &y) in out.iter_mut().zip(&s.y[j * hd..(j + 1) * hd]) {
                            *o += w * y;
                        }
                    }
                }
                for (xv, &o) in x.iter_mut().zip(&s.out) {
                    *xv += o;
                }
            },
        );
    }
}

/// Buffers of the MoE block; they only grow.
#[derive(Default)]
pub struct MoeScratch {
    logits: Vec<f32>,                  // [n, num_experts]
    chosen: Vec<(usize, f32)>,         // [k] (expert, weight) of one token
    by_expert: Vec<Vec<(usize, f32)>>, // [num_experts][tokens routed] (token, weight)
    xe: Vec<f32>,                      // [m, hidden] one expert's gathered inputs
    qx: Activations,
    g: Vec<f32>, // [m, inter] gate, then silu(gate) * up
    u: Vec<f32>, // [m, inter]
    qa: Activations,
    y: Vec<f32>,   // [m, hidden]
    out: Vec<f32>, // [n, hidden] weighted sum of the experts
}

/// One token's routing: softmax over `logits` (f32), the `k` largest probabilities (ties: lower
/// expert index first), renormalized to sum 1 when `norm`. `out` gets `(expert, weight)` in
/// descending weight order.
// logits: [num_experts]
pub fn route(logits: &[f32], k: usize, norm: bool, out: &mut Vec<(usize, f32)>) {
    let max = logits.iter().copied().fold(f32::NEG_INFINITY, f32::max);
    let sum: f32 = logits.iter().map(|&l| (l - max).exp()).sum();
    out.clear();
    for (e, &l) in logits.iter().enumerate() {
        let p = (l - max).exp() / sum;
        // Insert after every entry with a probability >= p: equal ones keep index order.
        let at = out.partition_point(|&(_, q)| q >= p);
        if at < k {
            if out.len() == k {
                out.pop();
            }
            out.insert(at, (e, p));
        }
    }
    if norm {
        let s: f32 = out.iter().map(|&(_, w)| w).sum();
        out.iter_mut().for_each(|(_, w)| *w /= s);
    }
}

#[cfg(test)]
#[path = "moe_tests.rs"]
mod tests;
