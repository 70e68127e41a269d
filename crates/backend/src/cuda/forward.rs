//! The kernel sequence of one forward pass, enqueued on the stream without host work in between,
//! so the same code runs eagerly and under CUDA-graph capture.

use super::attention::{AttnBuffers, Meta, Plan};
use super::gpu::{DBuf, KArg};
use super::llama::CudaExecutor;
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
}

impl CudaExecutor {
    pub(super) fn enqueue(&mut self, st: Step) -> Result<(), BackendError> {
        let c = &self.cfg;
        let (n, nl, plan, meta) = (st.n, st.nl, st.plan, st.layout);
        let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
        let qkv_dim = qs + 2 * kvs;
        let g = &self.gpu;
        let s = &self.s;
        let (x, h, qkv, attn, gu, act, logits) = (
            s.x.as_ref().unwrap().ptr,
            s.h.as_ref().unwrap().ptr,
            s.qkv.as_ref().unwrap().ptr,
            s.attn.as_ref().unwrap().ptr,
            s.gu.as_ref().unwrap().ptr,
            s.act.as_ref().unwrap().ptr,
            s.logits.as_ref().unwrap().ptr,
        );
        let (part_acc, part_ml) = (
            s.part_acc.as_ref().unwrap().ptr,
            s.part_ml.as_ref().unwrap().ptr,
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
        g.launch(
            &k.embed,
            (nu, 1, 1),
            (256, 1, 1),
            &[mp(meta.tokens), P(self.embed.ptr), P(x), I(hd as i32)],
        )?;
        prof.mark(g, "embed", None, n * hd * 6, 0)?;
        for (li, l) in self.layers.iter().enumerate() {
            let layer = Some(li);
            let gemm_cost = |k_in: usize, out: usize| {
                (
                    2 * k_in * out + n * (k_in * 2 + out * 4),
                    2 * n * k_in * out,
                )
            };
            g.launch(
                &k.rms_norm,
                (nu, 1, 1),
                (norm_threads, 1, 1),
                &[P(x), P(0), P(l.attn_norm.ptr), P(h), I(hd as i32), F(eps)],
            )?;
            prof.mark(g, "rms_norm", layer, n * hd * 6, n * hd * 3)?;
            g.gemm_f16(h, l.wqkv.ptr, qkv, n, hd, qkv_dim, 0.0)?;
            let (b, f) = gemm_cost(hd, qkv_dim);
            prof.mark(g, "matmul_qkv", layer, b, f)?;
            let opt = |b: &Option<DBuf<f32>>| P(b.as_ref().map_or(0, |b| b.ptr));
            g.launch(
                &k.rope,
                (nu, (c.num_heads + 2 * c.num_kv_heads) as u32, 1),
                (128, 1, 1),
                &[
                    P(qkv),
                    opt(&l.bqkv),
                    opt(&l.q_norm),
                    opt(&l.k_norm),
                    P(self.rope_cs.ptr),
                    mp(meta.positions),
                    I(qkv_dim as i32),
                    I(c.num_heads as i32),
                    I(c.num_kv_heads as i32),
                    I(c.head_dim as i32),
                    I((c.rope_dim / 2) as i32),
                    I(matches!(c.rope_style, quire_core::RopeStyle::Neox) as i32),
                    F(eps),
                ],
            )?;
            prof.mark(g, "rope", layer, n * qkv_dim * 8, n * (qs + kvs) * 6)?;
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
                    part_acc,
                    part_ml,
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
            g.gemm_f16(attn, l.wo.ptr, x, n, qs, hd, 1.0)?;
            let (b, f) = gemm_cost(qs, hd);
            prof.mark(g, "matmul_o", layer, b, f)?;
            g.launch(
                &k.rms_norm,
                (nu, 1, 1),
                (norm_threads, 1, 1),
                &[P(x), P(0), P(l.ffn_norm.ptr), P(h), I(hd as i32), F(eps)],
            )?;
            prof.mark(g, "rms_norm", layer, n * hd * 6, n * hd * 3)?;
            g.gemm_f16(h, l.w_gate_up.ptr, gu, n, hd, 2 * inter, 0.0)?;
            let (b, f) = gemm_cost(hd, 2 * inter);
            prof.mark(g, "matmul_gate_up", layer, b, f)?;
            let total = n * inter;
            let blocks = total.div_ceil(256).min(65535) as u32;
            g.launch(
                &k.swiglu,
                (blocks, 1, 1),
                (256, 1, 1),
                &[P(gu), P(act), I(inter as i32), L(total as i64)],
            )?;
            prof.mark(g, "swiglu", layer, n * inter * 10, n * inter * 6)?;
            g.gemm_f16(act, l.w_down.ptr, x, n, inter, hd, 1.0)?;
            let (b, f) = gemm_cost(inter, hd);
            prof.mark(g, "matmul_down", layer, b, f)?;
        }
        let out_w = self.output.as_ref().unwrap_or(&self.embed).ptr;
        if nl > 0 {
            g.launch(
                &k.rms_norm,
                (nl as u32, 1, 1),
                (norm_threads, 1, 1),
                &[
                    P(x),
                    mp(meta.logits_idx),
                    P(self.output_norm.ptr),
                    P(h),
                    I(hd as i32),
                    F(eps),
                ],
            )?;
            g.gemm_f16(h, out_w, logits, nl, hd, c.vocab_size, 0.0)?;
        }
        prof.mark(
            g,
            "output",
            None,
            2 * hd * c.vocab_size + nl * c.vocab_size * 4,
            2 * nl * hd * c.vocab_size,
        )?;
        Ok(())
    }
}
