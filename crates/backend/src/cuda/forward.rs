//! The CUDA kernels behind the shared layer sequence (`crate::forward`), enqueued on the stream
//! without host work in between, so the same code runs eagerly and under CUDA-graph capture.
//!
//! The order of the ops lives in `forward.rs`; this file says how CUDA does each one. Its fusions:
//! a one-token step's GEMV applies the pending RMSNorm to its input (that norm's op enqueues
//! nothing) and, where the down GEMV takes f16 rows, SwiGLU on its way out, or else the down GEMV
//! applies SwiGLU to its input (the `swiglu` op enqueues nothing); a decode step's attention
//! kernel applies bias, QK-norm and RoPE itself (`qkv_post` enqueues nothing); each op writes its
//! output in the input form the next matmul takes (f16 rows or 8-bit blocks).

use half::f16;
use quire_core::ModelConfig;

use super::attention::{AttnBuffers, Meta, Plan, RopeArgs};
use super::gemv::{Gemv, GemvInput};
use super::gpu::{DBuf, Gpu, KArg};
use super::llama::{CudaExecutor, Kernels, Layer};
use super::moe::{MoeInputs, MoeLayer, MoeRun, MoeScratch};
use super::nccl::Comm;
use super::profile::EventProfiler;
use super::qmat::WMat;
use super::tp::{gather_logits, GatherBufs};
use crate::forward::{forward, Act, LayerOps, Next};
use crate::tp::Shard;
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
    /// set where `CudaExecutor::output_by_gemv` holds, or for one row of a vocab-parallel rank.
    pub logits_host: u64,
    /// Device address of mapped host memory holding this step's metadata, which the embedding
    /// kernel copies (`meta_words` words) to `meta_base` first; 0: it was copied before.
    pub meta_src: u64,
    pub meta_words: usize,
}

/// Device addresses of one step's activations (`Scratch`), fixed for the whole step.
///
/// Why the launches below may use them (the `// SAFETY:` notes of this file refer here): every
/// address comes from `Scratch` grown by `CudaExecutor::run` for this step's `n` tokens and `nl`
/// logits rows before the enqueue, from the step's metadata uploaded at `meta_base` with `layout`
/// (or its mapped source `meta_src`), or from the weights, caches and RoPE table loaded with the
/// executor; all live as long as the executor, which synchronizes before it frees or grows any of
/// them, and a captured graph is dropped when they move (`GraphKey`). Each kernel's output is a
/// buffer none of its inputs share, except the residual rows `x`, which the kernels that add into
/// them are written to read and write.
#[derive(Debug, Clone, Copy)]
struct Bufs {
    x: u64,
    h: u64,
    qkv: u64,
    attn: u64,
    gu: u64,
    act: u64,
    q8: u64,
    logits: u64,
    logits_part: u64,
    logits_gathered: u64,
    part_acc: u64,
    part_ml: u64,
    wdq: u64,
}

/// What every part of one step's enqueue reads: the kernels, the step, its buffers, and the
/// profiler that marks each op (a no-op unless profiling); and what one op leaves to the next.
struct Fwd<'a> {
    g: &'a Gpu,
    k: &'a Kernels,
    c: &'a ModelConfig,
    prof: &'a mut EventProfiler,
    st: Step,
    b: Bufs,
    /// See `CudaOptions::dequant_gemm_tokens`.
    dq_min: usize,
    block_size: usize,
    rope_cs: u64,
    embed: &'a WMat,
    /// The layers, for the attention's output form (that of the o projection's input).
    layers: &'a [Layer],
    kv_caches: &'a [(DBuf<f16>, DBuf<f16>)],
    moe: &'a MoeScratch,
    /// The input the next matmul's GEMV computes itself (a pending RMSNorm or SwiGLU), its op
    /// having enqueued nothing.
    fused: Option<GemvInput>,
    /// The layer's bias, QK-norm and RoPE arguments (`qkv_post`), for a decode step's attention
    /// kernel, which applies them.
    rope_args: Option<RopeArgs>,
    /// This rank's communicator, when the model is sharded (`crate::tp`).
    tp: Option<(&'a Comm, Shard)>,
    /// Whether the output projection holds only this rank's vocabulary rows
    /// (`CudaExecutor::vocab_split`).
    vocab_split: bool,
}

impl CudaExecutor {
    /// Enqueues one forward pass: embedding, each layer's attention and feed-forward blocks, then
    /// the output norm and projection of the rows that get logits.
    pub(super) fn enqueue(&mut self, st: Step) -> Result<(), BackendError> {
        let s = &self.s;
        let a = s.acts(st.n);
        let b = Bufs {
            x: a.x.ptr,
            h: a.h.ptr,
            qkv: a.qkv.ptr,
            attn: a.attn.ptr,
            gu: a.gu.ptr,
            act: a.act.ptr,
            q8: a.q8.ptr,
            logits: s.logits.ptr,
            logits_part: s.logits_part.ptr,
            logits_gathered: s.logits_gathered.ptr,
            part_acc: s.part_acc.ptr,
            part_ml: s.part_ml.ptr,
            wdq: s.wdq.ptr,
        };
        let mut f = Fwd {
            g: &self.gpu,
            k: &self.k,
            c: &self.cfg,
            prof: &mut self.prof,
            st,
            b,
            dq_min: self.dequant_gemm_tokens,
            block_size: self.kv.block_size,
            rope_cs: self.rope_cs.ptr,
            embed: &self.embed,
            layers: &self.layers,
            kv_caches: &self.kv_caches,
            moe: &s.moe,
            fused: None,
            rope_args: None,
            tp: self.tp.as_ref().map(|(c, s)| (&**c, *s)),
            vocab_split: self.vocab_split.is_some(),
        };
        f.prof.start(f.g)?;
        let out_w = self.output.as_ref().unwrap_or(&self.embed);
        forward(&mut f, &self.layers, &self.output_norm, out_w)
    }
}

impl Fwd<'_> {
    /// Whether a matmul on `w` over `rows` tokens takes 8-bit blocks (else f16 rows).
    fn q8_in(&self, w: &WMat, rows: usize) -> bool {
        w.quant_type().is_some() && rows < self.dq_min
    }

    fn mm(&self, w: &WMat, rows: usize) -> MatMul {
        MatMul {
            n: rows,
            wdq: self.b.wdq,
            q8_in: self.q8_in(w, rows),
        }
    }

    /// The step's metadata array at word offset `off`.
    fn meta(&self, off: usize) -> u64 {
        self.st.meta_base + 4 * off as u64
    }

    /// (bytes, flops) of a matmul over the step's tokens, for the profiler.
    fn gemm_cost(&self, w: &WMat, k_in: usize, out: usize) -> (usize, usize) {
        let n = self.st.n;
        (
            w.bytes_for(out, k_in) + n * (k_in * 2 + out * 4),
            2 * n * k_in * out,
        )
    }

    fn mark_gemm(
        &mut self,
        name: &'static str,
        li: usize,
        w: &WMat,
        k_in: usize,
        out: usize,
    ) -> Result<(), BackendError> {
        let (b, f) = self.gemm_cost(w, k_in, out);
        self.prof.mark(self.g, name, Some(li), b, f)
    }

    /// RMSNorm of the step's rows into the input form of a matmul (`q8`: 8-bit blocks).
    fn norm(&mut self, q8: bool, norm_w: u64, li: usize) -> Result<(), BackendError> {
        let (n, hd) = (self.st.n, self.c.hidden_size);
        // SAFETY: the addresses are the step's, as `Bufs` says.
        unsafe {
            norm_for(
                self.g,
                self.k,
                q8,
                self.b.x,
                KArg::P(0),
                norm_w,
                (self.b.h, self.b.q8),
                n,
                self.norm_shape(),
            )
        }?;
        self.prof
            .mark(self.g, "rms_norm", Some(li), n * hd * 6, n * hd * 3)
    }

    /// (hidden, eps, threads per row) of the RMSNorm launches.
    fn norm_shape(&self) -> (usize, f32, u32) {
        let hd = self.c.hidden_size;
        (
            hd,
            self.c.rms_norm_eps,
            (hd.div_ceil(32) * 32).min(1024) as u32,
        )
    }

    /// The RMSNorm of the residual row with weight `norm_w` as a GEMV input.
    fn normed(&self, norm_w: u64, rows_idx: u64) -> GemvInput {
        GemvInput::Norm {
            x: self.b.x,
            rows_idx,
            norm_w,
            eps: self.c.rms_norm_eps,
        }
    }

    /// `rope_qkv`: bias, QK-norm and RoPE of the QKV rows in place (steps with prompt rows).
    fn rope(&mut self, li: usize, rope: &RopeArgs) -> Result<(), BackendError> {
        use KArg::{F, I, P};
        let (g, c, n) = (self.g, self.c, self.st.n);
        let (qs, kvs) = (c.q_size(), c.kv_size());
        let qkv_dim = qs + 2 * kvs;
        // SAFETY: rope_qkv's list; the addresses are the step's, as `Bufs` says.
        unsafe {
            g.launch(
                &self.k.rope,
                (n as u32, (c.num_heads + 2 * c.num_kv_heads) as u32, 1),
                (128, 1, 1),
                &[
                    P(self.b.qkv),
                    P(rope.bias),
                    P(rope.q_norm),
                    P(rope.k_norm),
                    P(rope.cs),
                    P(self.meta(self.st.layout.positions)),
                    I(qkv_dim as i32),
                    I(c.num_heads as i32),
                    I(c.num_kv_heads as i32),
                    I(c.head_dim as i32),
                    I(rope.pairs as i32),
                    I(rope.neox as i32),
                    F(rope.eps),
                ],
            )
        }?;
        self.prof
            .mark(g, "rope", Some(li), n * qkv_dim * 8, n * (qs + kvs) * 6)
    }

    /// SwiGLU of the gate/up rows into the down projection's input (`q8`: 8-bit blocks).
    fn swiglu(&mut self, li: usize, q8: bool) -> Result<(), BackendError> {
        use KArg::{I, L, P};
        let (g, k, b, n) = (self.g, self.k, self.b, self.st.n);
        let inter = self.c.intermediate_size;
        let total = n * inter;
        if q8 {
            let qblocks = total / 32;
            // SAFETY: swiglu_q8's list; the addresses are the step's, as `Bufs` says.
            unsafe {
                g.launch(
                    &k.q.swiglu_q8,
                    (qblocks.div_ceil(8) as u32, 1, 1),
                    (256, 1, 1),
                    &[P(b.gu), P(b.q8), I(inter as i32), L(qblocks as i64)],
                )
            }?;
        } else {
            let blocks = total.div_ceil(256).min(65535) as u32;
            // SAFETY: swiglu's list; the addresses are the step's, as `Bufs` says.
            unsafe {
                g.launch(
                    &k.swiglu,
                    (blocks, 1, 1),
                    (256, 1, 1),
                    &[P(b.gu), P(b.act), I(inter as i32), L(total as i64)],
                )
            }?;
        }
        self.prof
            .mark(g, "swiglu", Some(li), n * inter * 10, n * inter * 6)
    }
}

impl LayerOps for Fwd<'_> {
    type M = WMat;
    type V = DBuf<f32>;
    type E = MoeLayer;

    /// The token embeddings into the residual rows `x`.
    fn embed(&mut self) -> Result<(), BackendError> {
        use KArg::{I, P};
        let (g, k, st, b) = (self.g, self.k, self.st, self.b);
        let (n, hd) = (st.n, self.c.hidden_size);
        let tokens = self.meta(st.layout.tokens);
        match self.embed {
            // SAFETY: embed_meta's list; `meta_src` is mapped host memory of `meta_words` words; the rest as `Bufs` says.
            WMat::F16(t) if st.meta_src != 0 => unsafe {
                g.launch(
                    &k.embed_meta,
                    (n as u32, 1, 1),
                    (256, 1, 1),
                    &[
                        P(st.meta_src),
                        P(st.meta_base),
                        I(st.meta_words as i32),
                        I(st.layout.tokens as i32),
                        P(t.ptr),
                        P(b.x),
                        I(hd as i32),
                    ],
                )
            }?,
            // SAFETY: embed's list; the addresses are the step's, as `Bufs` says.
            WMat::F16(t) => unsafe {
                g.launch(
                    &k.embed,
                    (n as u32, 1, 1),
                    (256, 1, 1),
                    &[P(tokens), P(t.ptr), P(b.x), I(hd as i32)],
                )
            }?,
            // SAFETY: the addresses are the step's, as `Bufs` says.
            WMat::Quant { dtype, data } => {
                unsafe { k.q.embed(g, *dtype, tokens, data.ptr, b.x, n, hd) }?
            }
        }
        self.prof.mark(g, "embed", None, n * hd * 6, 0)
    }

    /// A one-token step whose matmul takes the GEMV leaves the norm to it (`fused`). The MoE
    /// router also takes f32 rows of the norm (`MoeScratch::hf`).
    fn rms_norm(
        &mut self,
        li: usize,
        w: &DBuf<f32>,
        next: Next<'_, WMat, MoeLayer>,
    ) -> Result<(), BackendError> {
        let (n, hd) = (self.st.n, self.c.hidden_size);
        let m = match next {
            Next::Matmul(m) => m,
            Next::Moe(m) => {
                use KArg::{F, I, P};
                let (g, k, b) = (self.g, self.k, self.b);
                let (hd, eps, threads) = self.norm_shape();
                // SAFETY: rms_norm_f32's list; `hf` is the MoE scratch, grown with the step; the rest as `Bufs` says.
                unsafe {
                    g.launch(
                        &k.rms_norm_f32,
                        (n as u32, 1, 1),
                        (threads, 1, 1),
                        &[
                            P(b.x),
                            P(0),
                            P(w.ptr),
                            P(self.moe.hf.ptr),
                            I(hd as i32),
                            F(eps),
                        ],
                    )
                }?;
                return self.norm(m.q8_in(), w.ptr, li);
            }
        };
        let normed = self.normed(w.ptr, 0);
        if one_token_gemv(self.k, m, n, hd, &normed).is_some() {
            self.fused = Some(normed);
            return Ok(());
        }
        self.norm(self.q8_in(m, n), w.ptr, li)
    }

    /// The o projection's 8-bit input is quantized here from the attention's f32 rows.
    fn matmul(
        &mut self,
        li: usize,
        w: &WMat,
        src: Act,
        dst: Act,
        add: bool,
    ) -> Result<(), BackendError> {
        let (g, k, b, n) = (self.g, self.k, self.b, self.st.n);
        let c = self.c;
        let (hd, qs, qkv_dim) = (c.hidden_size, c.q_size(), c.q_size() + 2 * c.kv_size());
        let (k_in, input) = match src {
            Act::H => (hd, b.h),
            Act::Attn => (qs, b.attn),
            Act::Swiglu => (c.intermediate_size, b.act),
            Act::X | Act::Qkv => {
                return Err(BackendError::Cuda(format!("no matmul reads {src:?}")));
            }
        };
        let (out, y) = match dst {
            Act::Qkv => (qkv_dim, b.qkv),
            Act::X => (hd, b.x),
            Act::H | Act::Attn | Act::Swiglu => {
                return Err(BackendError::Cuda(format!("no matmul writes {dst:?}")));
            }
        };
        let beta = if add { 1.0 } else { 0.0 };
        if let Some(fused) = self.fused.take() {
            let Some((gv, wp)) = one_token_gemv(k, w, n, k_in, &fused) else {
                return Err(BackendError::Cuda(format!(
                    "{fused:?} was left to a GEMV that does not take it"
                )));
            };
            // SAFETY: the addresses are the step's, as `Bufs` says.
            unsafe { gv.run(g, wp, fused, y, k_in, out, beta) }?;
        } else {
            if src == Act::Attn && self.q8_in(w, n) {
                // SAFETY: the addresses are the step's, as `Bufs` says.
                unsafe { k.q.quantize(g, b.attn, true, b.q8, n, qs) }?;
            }
            // SAFETY: the addresses are the step's, as `Bufs` says.
            unsafe {
                self.mm(w, n)
                    .run(g, k, w, (input, b.q8), y, k_in, out, beta)
            }?;
        }
        self.mark_gemm(Act::matmul_name(src, dst), li, w, k_in, out)
    }

    /// Steps with prompt rows run `rope_qkv`; a decode step's attention kernel applies the same
    /// itself.
    fn qkv_post(
        &mut self,
        li: usize,
        bias: Option<&DBuf<f32>>,
        q_norm: Option<&DBuf<f32>>,
        k_norm: Option<&DBuf<f32>>,
    ) -> Result<(), BackendError> {
        let c = self.c;
        let opt = |b: Option<&DBuf<f32>>| b.map_or(0, |b| b.ptr);
        let rope = RopeArgs {
            bias: opt(bias),
            q_norm: opt(q_norm),
            k_norm: opt(k_norm),
            cs: self.rope_cs,
            pairs: c.rope_dim / 2,
            neox: matches!(c.rope_style, quire_core::RopeStyle::Neox),
            eps: c.rms_norm_eps,
        };
        self.rope_args = Some(rope);
        if !self.st.plan.fused_rope {
            self.rope(li, &rope)?;
        }
        Ok(())
    }

    /// Paged attention with the KV write; its output in the o projection's input form (f32 rows
    /// to quantize, or f16 rows).
    fn attention(&mut self, li: usize) -> Result<(), BackendError> {
        let (g, k, c, st, b) = (self.g, self.k, self.c, self.st, self.b);
        let n = st.n;
        let (qs, kvs) = (c.q_size(), c.kv_size());
        let qkv_dim = qs + 2 * kvs;
        let q8w = self.q8_in(&self.layers[li].wo, n);
        let (k_cache, v_cache) = &self.kv_caches[li];
        let rope = self.rope_args.take().filter(|_| st.plan.fused_rope);
        // SAFETY: the addresses are the step's, as `Bufs` says.
        unsafe {
            k.attention.launch(
                g,
                n,
                self.block_size,
                st.plan,
                &AttnBuffers {
                    qkv: b.qkv,
                    qkv_stride: qkv_dim,
                    k_cache: k_cache.ptr,
                    v_cache: v_cache.ptr,
                    meta: st.meta_base,
                    layout: st.layout,
                    out: b.attn,
                    out_f32: q8w,
                    part_acc: b.part_acc,
                    part_ml: b.part_ml,
                    rope,
                },
            )
        }?;
        let kv_read = st.ctx_tokens * 2 * kvs * 2;
        let bytes = kv_read + n * (qkv_dim * 4 + qs * 2);
        self.prof
            .mark(g, "attention", Some(li), bytes, 4 * st.pairs * qs)
    }

    /// A one-token step runs gate/up as a GEMV with the norm fused in and, where the down GEMV
    /// takes f16 rows, the SwiGLU on its way out; else the down GEMV applies the SwiGLU to its
    /// input, or the `swiglu` kernel runs.
    fn gate_up(&mut self, li: usize, gate_up: &WMat, down: &WMat) -> Result<(), BackendError> {
        let (g, k, b, n) = (self.g, self.k, self.b, self.st.n);
        let (hd, inter) = (self.c.hidden_size, self.c.intermediate_size);
        if let Some(normed) = self.fused.take() {
            let Some((gv, wp)) = one_token_gemv(k, gate_up, n, hd, &normed) else {
                return Err(BackendError::Cuda(format!(
                    "{normed:?} was left to a GEMV that does not take it"
                )));
            };
            // With the SwiGLU on the gate/up GEMV's way out, the down GEMV reads f16 rows.
            if one_token_gemv(k, down, n, inter, &GemvInput::F16 { x: b.act }).is_some() {
                // SAFETY: the addresses are the step's, as `Bufs` says.
                unsafe { gv.run_glu(g, wp, normed, b.act, hd, inter) }?;
                return self.mark_gemm("matmul_gate_up", li, gate_up, hd, 2 * inter);
            }
            // SAFETY: the addresses are the step's, as `Bufs` says.
            unsafe { gv.run(g, wp, normed, b.gu, hd, 2 * inter, 0.0) }?;
        } else {
            let mm = self.mm(gate_up, n);
            // SAFETY: the addresses are the step's, as `Bufs` says.
            unsafe { mm.run(g, k, gate_up, (b.h, b.q8), b.gu, hd, 2 * inter, 0.0) }?;
        }
        self.mark_gemm("matmul_gate_up", li, gate_up, hd, 2 * inter)?;
        let act_in = GemvInput::SwiGlu { gu: b.gu };
        if one_token_gemv(k, down, n, inter, &act_in).is_some() {
            self.fused = Some(act_in);
            return Ok(());
        }
        self.swiglu(li, self.q8_in(down, n))
    }

    /// The router takes f32 rows; the experts f16 rows or 8-bit blocks (both from `rms_norm`).
    fn moe(&mut self, li: usize, m: &MoeLayer) -> Result<(), BackendError> {
        let (g, k, b, n) = (self.g, self.k, self.b, self.st.n);
        let hd = self.c.hidden_size;
        let ms = self.moe;
        let mk = k.moe.as_ref().expect("compiled for MoE models");
        let io = MoeInputs {
            hf: ms.hf.ptr,
            h: b.h,
            q8: b.q8,
            x: b.x,
            n,
            hidden: hd,
        };
        let run = MoeRun {
            g,
            mk,
            qk: &k.q,
            swiglu_f16: &k.swiglu,
        };
        // SAFETY: `hf` is the MoE scratch, grown with the step; the rest as `Bufs` says.
        unsafe { run.run(m, ms, &io) }?;
        let mc = &m.cfg;
        let pairs = n * mc.num_experts_per_tok;
        let flops = 2 * pairs * 3 * hd * mc.expert_intermediate_size;
        let bytes = pairs.min(mc.num_experts)
            * (m.gate_up.bytes_for(2 * mc.expert_intermediate_size, hd)
                + m.down.bytes_for(hd, mc.expert_intermediate_size));
        self.prof.mark(g, "moe", Some(li), bytes, flops)
    }

    fn shard(&self) -> Option<Shard> {
        self.tp.map(|(_, s)| s)
    }

    /// The residual rows summed over the group by NCCL, on the step's stream (so a captured
    /// decode graph holds the collective too).
    fn all_reduce(&mut self, li: usize) -> Result<(), BackendError> {
        let Some((comm, _)) = self.tp else {
            return Err(BackendError::Config(
                "an all-reduce in an unsharded model".into(),
            ));
        };
        let count = self.st.n * self.c.hidden_size;
        let stream = self.g.stream.cu_stream() as *mut std::ffi::c_void;
        // SAFETY: `x` holds the step's `n × hidden` f32 residual rows, as `Bufs` says; the stream
        // is this device's.
        unsafe { comm.all_reduce_f32(self.b.x, count, stream) }?;
        self.prof
            .mark(self.g, "all_reduce", Some(li), count * 4 * 2, count)
    }

    /// `rms_norm` wrote the MoE's inputs from `x` eagerly (`hf`, `h`/`q8`), so `x` may go.
    fn zero_residual(&mut self) -> Result<(), BackendError> {
        let bytes = self.st.n * self.c.hidden_size * 4;
        // SAFETY: `x` holds the step's `n × hidden` f32 rows, as `Bufs` says.
        unsafe {
            cudarc::driver::result::memset_d8_async(self.b.x, 0, bytes, self.g.stream.cu_stream())
        }
        .map_err(super::gpu::cuda_err("clearing the residual rows"))
    }

    /// The output norm and projection of the rows listed in `logits_idx`, into `logits` (or, for
    /// one row by the GEMV, straight into page-locked host memory at `st.logits_host`). A
    /// vocab-parallel rank computes its vocabulary rows' logits into `logits_part`, then
    /// `gather_logits` gives every rank the full rows.
    fn output(&mut self, norm: &DBuf<f32>, out_w: &WMat) -> Result<(), BackendError> {
        let norm_w = norm.ptr;
        let (g, k, c, st, b) = (self.g, self.k, self.c, self.st, self.b);
        let (nl, hd) = (st.nl, c.hidden_size);
        let split = self.tp.filter(|_| self.vocab_split);
        // [nl, cols]: every logit, or this rank's span of them.
        let (dst, cols) = match split {
            Some((_, s)) => (b.logits_part, s.vocab_span(c.vocab_size).1),
            None => (b.logits, c.vocab_size),
        };
        if nl > 0 {
            let rows_idx = self.meta(st.layout.logits_idx);
            let normed = self.normed(norm_w, rows_idx);
            if let Some((gv, wp)) = one_token_gemv(k, out_w, nl, hd, &normed) {
                if st.logits_host != 0 && split.is_none() {
                    // SAFETY: `logits_host` is the executor's mapped logits row (`vocab_size` f32); the rest as `Bufs` says.
                    unsafe { gv.run_host(g, wp, normed, st.logits_host, hd, c.vocab_size) }?;
                } else {
                    // SAFETY: the addresses are the step's, as `Bufs` says.
                    unsafe { gv.run(g, wp, normed, dst, hd, cols, 0.0) }?;
                }
            } else {
                debug_assert!(
                    st.logits_host == 0 || split.is_some(),
                    "host logits need the output GEMV"
                );
                let q8w = self.q8_in(out_w, nl);
                let inputs = (b.h, b.q8);
                let rows = KArg::P(rows_idx);
                // SAFETY: the addresses are the step's, as `Bufs` says.
                unsafe { norm_for(g, k, q8w, b.x, rows, norm_w, inputs, nl, self.norm_shape()) }?;
                let mm = self.mm(out_w, nl);
                // SAFETY: the addresses are the step's, as `Bufs` says.
                unsafe { mm.run(g, k, out_w, inputs, dst, hd, cols, 0.0) }?;
            }
        }
        let bytes = out_w.bytes_for(cols, hd) + nl * cols * 4;
        self.prof
            .mark(g, "output", None, bytes, 2 * nl * hd * cols)?;
        let Some((comm, s)) = split.filter(|_| nl > 0) else {
            return Ok(());
        };
        let bufs = GatherBufs {
            part: b.logits_part,
            gathered: b.logits_gathered,
            logits: b.logits,
            host_row: st.logits_host,
        };
        // SAFETY: `logits_part` holds `nl × stride` f32 and `logits_gathered` `size × nl × stride`
        // (grown with the logits by `CudaExecutor::grow` for a vocab-parallel rank),
        // `logits_host` is 0 or the mapped row of `vocab` f32 with `nl == 1`
        // (`CudaExecutor::logits_dst`); the rest as `Bufs` says.
        unsafe { gather_logits(g, comm, s, nl, c.vocab_size, bufs) }?;
        let stride = s.vocab_stride(c.vocab_size);
        let bytes = (s.size * nl * stride + nl * c.vocab_size) * 4;
        self.prof.mark(g, "all_gather", None, bytes, 0)
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
///
/// # Safety
///
/// `x` (f32 rows), `rows_idx` (`rows` ints, or null), `norm_w` (`hidden` f32) and the chosen
/// output are live device allocations on `g`'s context sized for `rows` rows of `hidden`, not
/// freed before the stream has finished the kernel; the output overlaps no input.
#[allow(clippy::too_many_arguments)]
unsafe fn norm_for(
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
    // SAFETY: the RMSNorm kernels' list; the addresses are the caller's (this fn's contract).
    unsafe {
        g.launch(
            f,
            (rows as u32, 1, 1),
            (threads, 1, 1),
            &[P(x), rows_idx, P(norm_w), P(out), I(hd as i32), F(eps)],
        )
    }
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
    ///
    /// # Safety
    ///
    /// The input form this matmul takes (`inputs.0`: `n · k_in` f16; `inputs.1`: `n · k_in / 32`
    /// 8-bit blocks), `y` (`n · out` f32) and, for a dequantized weight, `wdq` (`out · k_in`
    /// f16) are live device allocations on `g`'s context, not freed before the stream has
    /// finished; `y` overlaps no input.
    #[allow(clippy::too_many_arguments)]
    unsafe fn run(
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
        // SAFETY: `w` is a loaded weight of `[out, k_in]`; the other addresses are the caller's
        // (this fn's contract).
        unsafe {
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
}
