//! The kernel sequence of one forward pass, enqueued on the stream without host work in between,
//! so the same code runs eagerly and under CUDA-graph capture.

use super::attention::{AttnBuffers, Meta, Plan, RopeArgs};
use super::gemv::{Gemv, GemvInput};
use super::gpu::{DBuf, Gpu, KArg};
use super::llama::{CudaExecutor, CudaFfn, Kernels};
use super::moe::{self, MoeInputs};
use super::qmat::WMat;
use crate::BackendError;

/// One forward pass's shape and where its metadata lies on the device.
#[derive(Debug, Clone, Copy)]
pub(super) struct Step {
    pub n: usize,
    /// Rows that get logits (gathered through `layout.logits_idx`).
    pub nl: usize,
    pub plan: Plan,
    pub meta_base: u64,
    pub layout: Meta,
    /// For the profiler: Σ query_len · seq_len and Σ seq_len over the sequences.
    pub pairs: usize,
    pub ctx_tokens: usize,
    /// Device address of page-locked host memory the logits row goes to (0: `s.logits`); only
    /// set where `CudaExecutor::output_by_gemv` holds.
    pub logits_host: u64,
    /// Device address of mapped host memory holding this step's metadata, which the embedding
    /// kernel copies (`meta_words` words) to `meta_base` first; 0: it was copied before.
    pub meta_src: u64,
    pub meta_words: usize,
}

impl CudaExecutor {
    pub(super) fn enqueue(&mut self, st: Step) -> Result<(), BackendError> {
        let c = &self.cfg;
        let (n, nl, plan, meta) = (st.n, st.nl, st.plan, st.layout);
        let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
        let qkv_dim = qs + 2 * kvs;
        let g = &self.gpu;
        let s = &self.s;
        let a = s.acts(n);
        let q8 = a.q8.as_ref().unwrap().ptr;
        let wdq = s.wdq.as_ref().map_or(0, |b| b.ptr);
        // Whether a matmul on `w` over `rows` tokens takes 8-bit blocks (else f16 rows).
        let dq_min = self.dequant_gemm_tokens;
        let q8_in = |w: &WMat, rows: usize| w.quant_type().is_some() && rows < dq_min;
        let (x, h, qkv, attn, gu, act, logits) = (
            a.x.as_ref().unwrap().ptr,
            a.h.as_ref().unwrap().ptr,
            a.qkv.as_ref().unwrap().ptr,
            a.attn.as_ref().unwrap().ptr,
            a.gu.as_ref().unwrap().ptr,
            a.act.as_ref().unwrap().ptr,
            s.logits.as_ref().unwrap().ptr,
        );
        let (part_acc, part_ml, counters) = (
            s.part_acc.as_ref().unwrap().ptr,
            s.part_ml.as_ref().unwrap().ptr,
            a.attn_counters.as_ref().unwrap().ptr,
        );
        let meta_base = st.meta_base;
        let mp = |off: usize| KArg::P(meta_base + 4 * off as u64);
        let prof = &mut self.prof;
        let k = &self.k;
        use KArg::{F, I, L, P};
        let nu = n as u32;
        let norm_threads = (hd.div_ceil(32) * 32).min(1024) as u32;
        let eps = c.rms_norm_eps;

        prof.start(g)?;
        match &self.embed {
            WMat::F16(t) if st.meta_src != 0 => g.launch(
                &k.embed_meta,
                (nu, 1, 1),
                (256, 1, 1),
                &[
                    P(st.meta_src),
                    P(meta_base),
                    I(st.meta_words as i32),
                    I(meta.tokens as i32),
                    P(t.ptr),
                    P(x),
                    I(hd as i32),
                ],
            )?,
            WMat::F16(t) => g.launch(
                &k.embed,
                (nu, 1, 1),
                (256, 1, 1),
                &[mp(meta.tokens), P(t.ptr), P(x), I(hd as i32)],
            )?,
            WMat::Quant { dtype, data } => k.q.embed(
                g,
                *dtype,
                meta_base + 4 * meta.tokens as u64,
                data.ptr,
                x,
                n,
                hd,
            )?,
        }
        prof.mark(g, "embed", None, n * hd * 6, 0)?;
        for (li, l) in self.layers.iter().enumerate() {
            let layer = Some(li);
            let gemm_cost = |w: &WMat, k_in: usize, out: usize| {
                (
                    w.bytes_for(out, k_in) + n * (k_in * 2 + out * 4),
                    2 * n * k_in * out,
                )
            };
            let norm = (hd, eps, norm_threads);
            let q8w = q8_in(&l.wqkv, n);
            let normed = GemvInput::Norm {
                x,
                rows_idx: 0,
                norm_w: l.attn_norm.ptr,
                eps,
            };
            if let Some((gv, wp)) = one_token_gemv(k, &l.wqkv, n, hd, &normed) {
                gv.run(g, wp, normed, qkv, hd, qkv_dim, 0.0)?;
            } else {
                norm_for(g, k, q8w, x, P(0), l.attn_norm.ptr, (h, q8), n, norm)?;
                prof.mark(g, "rms_norm", layer, n * hd * 6, n * hd * 3)?;
                let mm = MatMul { n, wdq, q8_in: q8w };
                mm.run(g, k, &l.wqkv, (h, q8), qkv, hd, qkv_dim, 0.0)?;
            }
            let (b, f) = gemm_cost(&l.wqkv, hd, qkv_dim);
            prof.mark(g, "matmul_qkv", layer, b, f)?;
            let opt = |b: &Option<DBuf<f32>>| b.as_ref().map_or(0, |b| b.ptr);
            let rope = RopeArgs {
                bias: opt(&l.bqkv),
                q_norm: opt(&l.q_norm),
                k_norm: opt(&l.k_norm),
                cs: self.rope_cs.ptr,
                pairs: c.rope_dim / 2,
                neox: matches!(c.rope_style, quire_core::RopeStyle::Neox),
                eps,
            };
            // A decode step's attention kernel applies bias, QK-norm and RoPE itself.
            let fused_rope = plan.decode && k.attention.decode_ropes;
            if !fused_rope {
                g.launch(
                    &k.rope,
                    (nu, (c.num_heads + 2 * c.num_kv_heads) as u32, 1),
                    (128, 1, 1),
                    &[
                        P(qkv),
                        P(rope.bias),
                        P(rope.q_norm),
                        P(rope.k_norm),
                        P(rope.cs),
                        mp(meta.positions),
                        I(qkv_dim as i32),
                        I(c.num_heads as i32),
                        I(c.num_kv_heads as i32),
                        I(c.head_dim as i32),
                        I(rope.pairs as i32),
                        I(rope.neox as i32),
                        F(eps),
                    ],
                )?;
                prof.mark(g, "rope", layer, n * qkv_dim * 8, n * (qs + kvs) * 6)?;
            }
            // The o-projection's input: 8-bit blocks quantized from f32 rows, or f16 rows.
            let q8w = q8_in(&l.wo, n);
            k.attention.launch(
                g,
                n,
                self.kv.block_size,
                plan,
                &AttnBuffers {
                    qkv,
                    qkv_stride: qkv_dim,
                    k_cache: l.k_cache.ptr,
                    v_cache: l.v_cache.ptr,
                    meta: meta_base,
                    layout: meta,
                    out: attn,
                    out_f32: q8w,
                    part_acc,
                    part_ml,
                    counters,
                    rope: fused_rope.then_some(rope),
                },
            )?;
            let kv_read = st.ctx_tokens * 2 * kvs * 2;
            prof.mark(
                g,
                "attention",
                layer,
                kv_read + n * (qkv_dim * 4 + qs * 2),
                4 * st.pairs * qs,
            )?;
            if q8w {
                k.q.quantize(g, attn, true, q8, n, qs)?;
            }
            let mm = MatMul { n, wdq, q8_in: q8w };
            mm.run(g, k, &l.wo, (attn, q8), x, qs, hd, 1.0)?;
            let (b, f) = gemm_cost(&l.wo, qs, hd);
            prof.mark(g, "matmul_o", layer, b, f)?;
            let (w_gate_up, w_down) = match &l.ffn {
                CudaFfn::Dense { w_gate_up, w_down } => (w_gate_up, w_down),
                CudaFfn::Moe(m) => {
                    // The router takes f32 rows; the experts f16 rows or 8-bit blocks.
                    let hf = s.moe.hf.as_ref().expect("grown for MoE models").ptr;
                    g.launch(
                        &k.rms_norm_f32,
                        (nu, 1, 1),
                        (norm_threads, 1, 1),
                        &[P(x), P(0), P(l.ffn_norm.ptr), P(hf), I(hd as i32), F(eps)],
                    )?;
                    norm_for(g, k, m.q8_in(), x, P(0), l.ffn_norm.ptr, (h, q8), n, norm)?;
                    prof.mark(g, "rms_norm", layer, n * hd * 6, n * hd * 3)?;
                    let mk = k.moe.as_ref().expect("compiled for MoE models");
                    let io = MoeInputs {
                        hf,
                        h,
                        q8,
                        x,
                        n,
                        hidden: hd,
                    };
                    moe::run(g, mk, &k.q, &k.swiglu, m, &s.moe, &io)?;
                    let mc = &m.cfg;
                    let pairs = n * mc.num_experts_per_tok;
                    let flops = 2 * pairs * 3 * hd * mc.expert_intermediate_size;
                    let bytes = pairs.min(mc.num_experts)
                        * (m.gate_up.bytes_for(2 * mc.expert_intermediate_size, hd)
                            + m.down.bytes_for(hd, mc.expert_intermediate_size));
                    prof.mark(g, "moe", layer, bytes, flops)?;
                    continue;
                }
            };
            let q8w = q8_in(w_gate_up, n);
            let normed = GemvInput::Norm {
                x,
                rows_idx: 0,
                norm_w: l.ffn_norm.ptr,
                eps,
            };
            let act_f16 = GemvInput::F16 { x: act };
            if let Some((gv, wp)) = one_token_gemv(k, w_gate_up, n, hd, &normed) {
                // With the SwiGLU on the gate/up GEMV's way out, the down GEMV reads f16 rows.
                if gv.glu && one_token_gemv(k, w_down, n, inter, &act_f16).is_some() {
                    gv.run_glu(g, wp, normed, act, hd, inter)?;
                    let (b, f) = gemm_cost(w_gate_up, hd, 2 * inter);
                    prof.mark(g, "matmul_gate_up", layer, b, f)?;
                    let mm = MatMul {
                        n,
                        wdq,
                        q8_in: false,
                    };
                    mm.run(g, k, w_down, (act, q8), x, inter, hd, 1.0)?;
                    let (b, f) = gemm_cost(w_down, inter, hd);
                    prof.mark(g, "matmul_down", layer, b, f)?;
                    continue;
                }
                gv.run(g, wp, normed, gu, hd, 2 * inter, 0.0)?;
            } else {
                norm_for(g, k, q8w, x, P(0), l.ffn_norm.ptr, (h, q8), n, norm)?;
                prof.mark(g, "rms_norm", layer, n * hd * 6, n * hd * 3)?;
                let mm = MatMul { n, wdq, q8_in: q8w };
                mm.run(g, k, w_gate_up, (h, q8), gu, hd, 2 * inter, 0.0)?;
            }
            let (b, f) = gemm_cost(w_gate_up, hd, 2 * inter);
            prof.mark(g, "matmul_gate_up", layer, b, f)?;
            let total = n * inter;
            let q8w = q8_in(w_down, n);
            let act_in = GemvInput::SwiGlu { gu };
            if let Some((gv, wp)) = one_token_gemv(k, w_down, n, inter, &act_in) {
                gv.run(g, wp, act_in, x, inter, hd, 1.0)?;
                let (b, f) = gemm_cost(w_down, inter, hd);
                prof.mark(g, "matmul_down", layer, b, f)?;
                continue;
            }
            if q8w {
                let qblocks = total / 32;
                g.launch(
                    &k.q.swiglu_q8,
                    (qblocks.div_ceil(8) as u32, 1, 1),
                    (256, 1, 1),
                    &[P(gu), P(q8), I(inter as i32), L(qblocks as i64)],
                )?;
            } else {
                let blocks = total.div_ceil(256).min(65535) as u32;
                g.launch(
                    &k.swiglu,
                    (blocks, 1, 1),
                    (256, 1, 1),
                    &[P(gu), P(act), I(inter as i32), L(total as i64)],
                )?;
            }
            prof.mark(g, "swiglu", layer, n * inter * 10, n * inter * 6)?;
            let mm = MatMul { n, wdq, q8_in: q8w };
            mm.run(g, k, w_down, (act, q8), x, inter, hd, 1.0)?;
            let (b, f) = gemm_cost(w_down, inter, hd);
            prof.mark(g, "matmul_down", layer, b, f)?;
        }
        let out_w = self.output.as_ref().unwrap_or(&self.embed);
        if nl > 0 {
            let norm = (hd, eps, norm_threads);
            let rows_idx = mp(meta.logits_idx);
            let q8w = q8_in(out_w, nl);
            let normed = GemvInput::Norm {
                x,
                rows_idx: meta_base + 4 * meta.logits_idx as u64,
                norm_w: self.output_norm.ptr,
                eps,
            };
            if let Some((gv, wp)) = one_token_gemv(k, out_w, nl, hd, &normed) {
                if st.logits_host != 0 {
                    gv.run_host(g, wp, normed, st.logits_host, hd, c.vocab_size)?;
                } else {
                    gv.run(g, wp, normed, logits, hd, c.vocab_size, 0.0)?;
                }
            } else {
                debug_assert_eq!(st.logits_host, 0, "host logits need the output GEMV");
                norm_for(
                    g,
                    k,
                    q8w,
                    x,
                    rows_idx,
                    self.output_norm.ptr,
                    (h, q8),
                    nl,
                    norm,
                )?;
                let mm = MatMul {
                    n: nl,
                    wdq,
                    q8_in: q8w,
                };
                mm.run(g, k, out_w, (h, q8), logits, hd, c.vocab_size, 0.0)?;
            }
        }
        prof.mark(
            g,
            "output",
            None,
            out_w.bytes_for(c.vocab_size, hd) + nl * c.vocab_size * 4,
            2 * nl * hd * c.vocab_size,
        )?;
        Ok(())
    }
}

impl CudaExecutor {
    /// Whether a step with `nl` logits rows computes them with the one-token GEMV (so they can
    /// be written straight to page-locked host memory): the same choice `enqueue` makes.
    pub(super) fn output_by_gemv(&self, nl: usize) -> bool {
        let out_w = self.output.as_ref().unwrap_or(&self.embed);
        let probe = GemvInput::Norm {
            x: 0,
            rows_idx: 0,
            norm_w: 0,
            eps: 0.0,
        };
        one_token_gemv(&self.k, out_w, nl, self.cfg.hidden_size, &probe).is_some()
    }
}

/// The GEMV and the weight's address when a matmul of `n` tokens over `w` (rows `k_in` long, input
/// `input`) takes the one-token GEMV: one token, f16 weights, the GEMV on.
fn one_token_gemv<'a>(
    k: &'a Kernels,
    w: &WMat,
    n: usize,
    k_in: usize,
    input: &GemvInput,
) -> Option<(&'a Gemv, u64)> {
    match (&k.gemv, w) {
        (Some(gv), WMat::F16(b)) if n == 1 && gv.fits(k_in, input) => Some((gv, b.ptr)),
        _ => None,
    }
}

/// RMSNorm of `rows` rows of `x` (gathered through `rows_idx` when it is not null) into the input
/// form the next matmul takes: f16 rows in `inputs.0`, or 8-bit blocks in `inputs.1` when `q8`.
/// `norm`: (hidden, eps, threads per row).
#[allow(clippy::too_many_arguments)]
fn norm_for(
    g: &Gpu,
    k: &Kernels,
    q8: bool,
    x: u64,
    rows_idx: KArg,
    norm_w: u64,
    inputs: (u64, u64),
    rows: usize,
    norm: (usize, f32, u32),
) -> Result<(), BackendError> {
    let (hd, eps, threads) = norm;
    let (f, out) = if q8 {
        (&k.q.rms_norm_q8, inputs.1)
    } else {
        (&k.rms_norm, inputs.0)
    };
    use KArg::{F, I, P};
    g.launch(
        f,
        (rows as u32, 1, 1),
        (threads, 1, 1),
        &[P(x), rows_idx, P(norm_w), P(out), I(hd as i32), F(eps)],
    )
}

/// One matmul of a step: `n` tokens; `q8_in`: the input comes as 8-bit blocks (quantized weight,
/// 8-bit kernels), else as f16 rows (cuBLAS; a quantized weight is first dequantized into `wdq`).
struct MatMul {
    n: usize,
    wdq: u64,
    q8_in: bool,
}

impl MatMul {
    /// `y[n, out] = input · wᵀ + beta · y`; `inputs`: (f16 rows, 8-bit blocks).
    #[allow(clippy::too_many_arguments)]
    fn run(
        &self,
        g: &Gpu,
        k: &Kernels,
        w: &WMat,
        inputs: (u64, u64),
        y: u64,
        k_in: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        let n = self.n;
        match w {
            WMat::F16(b) => {
                let x = GemvInput::F16 { x: inputs.0 };
                match one_token_gemv(k, w, n, k_in, &x) {
                    Some((gv, wp)) => gv.run(g, wp, x, y, k_in, out, beta),
                    None => g.gemm_f16(inputs.0, b.ptr, y, n, k_in, out, beta),
                }
            }
            WMat::Quant { dtype, data } if self.q8_in => {
                k.q.matmul(g, *dtype, data.ptr, inputs.1, y, n, k_in, out, beta)
            }
            WMat::Quant { dtype, data } => {
                k.q.dequantize(g, *dtype, data.ptr, self.wdq, k_in * out)?;
                g.gemm_f16(inputs.0, self.wdq, y, n, k_in, out, beta)
            }
        }
    }
}
