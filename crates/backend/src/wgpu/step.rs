//! One forward step on the device: the kernels behind `forward::LayerOps`, recorded as a list of
//! dispatches that the executor encodes into one compute pass and submits once.
//!
//! Bind groups are made on first use and kept (keyed by the op and the weight it reads), each
//! with a fixed slot of the parameter buffer; a step only rewrites the parameter words (the token
//! count changes per step). The work buffers grow to the largest step seen; growing them drops
//! the bind groups, which the next step makes again.
//!
//! A one-token step fuses what the one-token GEMV can take (each small dispatch costs a pipeline
//! barrier and a launch, microseconds on NVIDIA's Vulkan driver, more than its work): each
//! RMSNorm into the GEMV that reads its output (QKV, gate/up, the output), RoPE into the QKV
//! GEMV where the model's RoPE rotates adjacent pairs with nothing before it (no bias, no
//! QK-norm), and the SwiGLU into the down GEMV; 5 dispatches per Llama layer instead of 8.

use std::collections::HashMap;

use quire_core::ModelConfig;

use super::gpu::Gpu;
use super::kernels::{self, bind, Dispatch, HeadShape, Kernels, MmShape, Params};
use super::moe::{self, DMoe};
use super::weights::{DMatrix, DVec};
use crate::forward::{Act, LayerOps, Next};
use crate::{BackendError, KvCacheSpec};

mod mm;
pub use mm::{mm_kernel, Mm};

/// What a cached bind group belongs to: an op and the id of the weight (or layer) it reads.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Key {
    Embed(u32),
    Norm(u32, bool),
    Matmul(u32, u8),
    /// The GEMV that reads silu(gate) · up (its own pipeline, so its own bind group).
    MatmulSwiglu(u32),
    /// The one-token GEMV of a part, plain and reading silu(gate) · up (pipelines of their own).
    Gemv1(u32, u8),
    Gemv1Swiglu(u32),
    /// The one-token GEMV of a part with the RMSNorm before it fused in, without and with RoPE.
    Gemv1Norm(u32),
    Gemv1NormRope(u32),
    /// The prompt GEMM of a weight part through one of the device's GEMM paths (by index): a
    /// bind group of its own, since each pipeline's layout is derived from its shader and a
    /// group made for one does not fit another.
    Gemm(u32, u8, u8),
    /// The reduce after a GEMM split over its columns.
    GemmReduce(u32, u8),
    /// A mixture-of-experts layer: its routing (by router id), an expert matmul (by part id),
    /// the SwiGLU over the pairs' rows, the weighted sum into the residual.
    MoeRoute(u32),
    MoeExperts(u32),
    MoeSwiglu,
    MoeCombine,
    QkvPost(usize),
    Attention(usize),
    AttnSplit(usize),
    Swiglu,
    Argmax,
}

/// The parameter buffer's slots and the bind groups that use them.
pub struct Binder {
    pub buf: wgpu::Buffer,
    /// Bytes per slot (the adapter's uniform offset alignment, at least 256).
    pub align: usize,
    pub slots: usize,
    /// Host copy of the slots in use, written to `buf` before each submission where it differs
    /// from what was written last (`written`).
    pub words: Vec<u32>,
    pub written: Vec<u32>,
    /// Counts [`Binder::clear`]s: a recorded list of dispatches is valid while it is unchanged.
    pub generation: u64,
    binds: HashMap<Key, (wgpu::BindGroup, usize)>,
}

impl Binder {
    pub fn new(gpu: &mut Gpu, slots: usize) -> Result<Binder, BackendError> {
        let align = (gpu.limits.min_uniform_buffer_offset_alignment as usize).max(256);
        let buf = gpu.buffer(
            "parameters",
            (slots * align) as u64,
            wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
        )?;
        Ok(Binder {
            buf,
            align,
            slots,
            words: Vec::new(),
            written: Vec::new(),
            generation: 0,
            binds: HashMap::new(),
        })
    }

    /// Forgets every bind group (the work buffers they name are gone).
    pub fn clear(&mut self) {
        self.binds.clear();
        self.words.clear();
        self.written.clear();
        self.generation += 1;
    }

    /// The dispatch of `pipe` over `groups` for `key`, its bind group made on first use, with
    /// `params` written to its slot.
    #[allow(clippy::too_many_arguments)]
    fn dispatch(
        &mut self,
        gpu: &Gpu,
        name: &'static str,
        key: Key,
        pipe: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
        params: Params,
        groups: [u32; 3],
    ) -> Result<Dispatch, BackendError> {
        let next = self.binds.len();
        let (bg, slot) = match self.binds.get(&key) {
            Some(b) => b.clone(),
            None => {
                if next >= self.slots {
                    return Err(BackendError::Wgpu(format!(
                        "more than {} distinct dispatches in a step",
                        self.slots
                    )));
                }
                let bg = bind(gpu, pipe, (&self.buf, (next * self.align) as u64), buffers);
                self.binds.insert(key, (bg.clone(), next));
                (bg, next)
            }
        };
        let at = slot * self.align / 4;
        if self.words.len() < at + 16 {
            self.words.resize(at + 16, 0);
        }
        self.words[at..at + 16].copy_from_slice(&params);
        Ok(Dispatch {
            name,
            pipe: pipe.clone(),
            bind: bg,
            groups,
            bytes: 0,
            flops: 0,
        })
    }
}

/// The work buffers of a step, sized for `cap` tokens, `cap_logits` logits rows and
/// `cap_tables` block-table entries.
pub struct Bufs {
    pub cap: usize,
    pub cap_logits: usize,
    pub cap_tables: usize,
    pub x: wgpu::Buffer,      // [cap, hidden] f32: the residual stream
    pub h: wgpu::Buffer,      // [cap, hidden] f32: normed
    pub qkv: wgpu::Buffer,    // [cap, q + 2kv] f32
    pub attn: wgpu::Buffer,   // [cap, q] f32
    pub gu: wgpu::Buffer,     // [cap, 2 inter] f32: [gate | up]
    pub act: wgpu::Buffer,    // [cap, inter] f32: the SwiGLU output
    pub logits: wgpu::Buffer, // [cap_logits, vocab] f32
    pub ids: wgpu::Buffer,    // [cap_logits] u32: argmax
    pub tokens: wgpu::Buffer, // [cap] u32
    pub tok: wgpu::Buffer,    // [cap, TOK_WORDS] u32: the attention kernel's token table
    pub tables: wgpu::Buffer, // [cap_tables] u32: the step's block tables, concatenated
    pub rope: wgpu::Buffer,   // [cap, rope_dim / 2, 2] f32: (cos, sin)
    pub lidx: wgpu::Buffer,   // [cap_logits] u32: rows whose logits are wanted
    pub read_logits: wgpu::Buffer,
    pub read_ids: wgpu::Buffer,
    /// The partial sums of a GEMM split over its columns (`GemmKernels::scratch_floats`).
    pub gemm_part: wgpu::Buffer,
    /// Mixture-of-experts layers (4 bytes each without): per (token, expert) pair, `k` a token,
    /// the chosen expert and its weight, [gate | up], the SwiGLU and the expert's output.
    pub moe_ids: wgpu::Buffer, // [cap k] u32
    pub moe_wts: wgpu::Buffer, // [cap k] f32
    pub moe_gu: wgpu::Buffer,  // [cap k, 2 expert_inter] f32
    pub moe_act: wgpu::Buffer, // [cap k, expert_inter] f32
    pub moe_y: wgpu::Buffer,   // [cap k, hidden] f32
}

impl Bufs {
    pub fn new(
        gpu: &mut Gpu,
        c: &ModelConfig,
        cap: usize,
        cap_logits: usize,
        cap_tables: usize,
        gemm_floats: usize,
    ) -> Result<Bufs, BackendError> {
        use wgpu::BufferUsages as U;
        let work = U::STORAGE;
        let input = U::STORAGE | U::COPY_DST;
        let out = U::STORAGE | U::COPY_SRC;
        let read = U::MAP_READ | U::COPY_DST;
        let stride = c.q_size() + 2 * c.kv_size();
        let f = |n: usize| (n.max(1) * 4) as u64;
        let (k, ei) = c.moe.map_or((0, 0), |m| {
            (m.num_experts_per_tok, m.expert_intermediate_size)
        });
        let mut b = |what: &str, bytes: u64, usage| gpu.buffer(what, bytes, usage);
        Ok(Bufs {
            cap,
            cap_logits,
            cap_tables,
            x: b("x", f(cap * c.hidden_size), work)?,
            h: b("h", f(cap * c.hidden_size), work)?,
            qkv: b("qkv", f(cap * stride), work)?,
            attn: b("attn", f(cap * c.q_size()), work)?,
            gu: b("gate_up", f(cap * 2 * c.intermediate_size), work)?,
            act: b("swiglu", f(cap * c.intermediate_size), work)?,
            logits: b("logits", f(cap_logits * c.vocab_size), out)?,
            ids: b("ids", f(cap_logits), out)?,
            tokens: b("tokens", f(cap), input)?,
            tok: b("token table", f(cap * kernels::TOK_WORDS), input)?,
            tables: b("block tables", f(cap_tables), input)?,
            rope: b("rope", f(cap * c.rope_dim.max(2)), input)?,
            lidx: b("logits rows", f(cap_logits), input)?,
            read_logits: b("logits readback", f(cap_logits * c.vocab_size), read)?,
            read_ids: b("ids readback", f(cap_logits), read)?,
            gemm_part: b("GEMM partial sums", f(gemm_floats.max(4)), work)?,
            moe_ids: b("expert ids", f(cap * k), work)?,
            moe_wts: b("expert weights", f(cap * k), work)?,
            moe_gu: b("expert gate_up", f(cap * k * 2 * ei), work)?,
            moe_act: b("expert swiglu", f(cap * k * ei), work)?,
            moe_y: b("expert outputs", f(cap * k * c.hidden_size), work)?,
        })
    }

    /// Every buffer, for the allocation count when they are dropped.
    pub fn all(&self) -> [&wgpu::Buffer; 21] {
        [
            &self.x,
            &self.h,
            &self.qkv,
            &self.attn,
            &self.gu,
            &self.act,
            &self.logits,
            &self.ids,
            &self.tokens,
            &self.tok,
            &self.tables,
            &self.rope,
            &self.lidx,
            &self.read_logits,
            &self.read_ids,
            &self.gemm_part,
            &self.moe_ids,
            &self.moe_wts,
            &self.moe_gu,
            &self.moe_act,
            &self.moe_y,
        ]
    }
}

/// Bytes and FLOPs of one step's attention over `keys` keys in all (summed over its `n`
/// tokens): the f16 K and V read per key (a workgroup serves every query head of its KV head),
/// each token's QKV row read, its K/V written to the cache and its output written.
pub fn attn_cost(s: &HeadShape, n: usize, keys: usize) -> (usize, usize) {
    let bytes =
        keys * s.kv_size() * 2 * 2 + n * (s.stride() * 4 + s.kv_size() * 2 * 2 + s.q_size() * 4);
    (bytes, 4 * keys * s.q_size())
}

/// One step's kernels, bound to its batch.
pub struct Step<'a> {
    pub gpu: &'a Gpu,
    pub k: &'a Kernels,
    pub cfg: &'a ModelConfig,
    pub shape: HeadShape,
    pub kv: KvCacheSpec,
    pub bufs: &'a Bufs,
    pub binder: &'a mut Binder,
    pub list: &'a mut Vec<Dispatch>,
    /// Per layer: the K and V cache, `[slots, kv_heads, head_dim]` f16.
    pub cache: &'a [(wgpu::Buffer, wgpu::Buffer)],
    pub embed: &'a DMatrix,
    /// Bound where a kernel's optional input is absent.
    pub dummy: &'a wgpu::Buffer,
    /// Tokens of the step, and logits rows wanted.
    pub n: usize,
    pub nl: usize,
    /// Keys attended over the step, summed over its tokens (for the profile's bytes).
    pub keys: usize,
    /// Query tiles of the prompt attention (kernels::fill_tiles).
    pub tiles: usize,
    /// Whether a one-token step fuses its small ops into its GEMVs (module header); whether
    /// gate_up left the SwiGLU to the down GEMV; the norm weight an RMSNorm left to the GEMV
    /// after it; whether the QKV GEMV may apply RoPE (the model's RoPE rotates adjacent pairs
    /// and nothing comes between the projection and it), and whether it did (so qkv_post is
    /// left nothing).
    pub fuse: bool,
    pub swiglu_pending: bool,
    pub norm_pending: Option<wgpu::Buffer>,
    pub rope_in_gemv: bool,
    pub rope_done: bool,
    /// Decode rows only: the split of the decode attention kernel, its scratch (partials, with
    /// the maxima and sums from the given word) and its range counters.
    pub split: Option<(
        kernels::SplitPlan,
        &'a wgpu::Buffer,
        &'a wgpu::Buffer,
        usize,
    )>,
}

impl<'a> Step<'a> {
    fn act(&self, a: Act) -> (&'a wgpu::Buffer, usize) {
        let (c, b) = (self.cfg, self.bufs);
        match a {
            Act::X => (&b.x, c.hidden_size),
            Act::H => (&b.h, c.hidden_size),
            Act::Qkv => (&b.qkv, self.shape.stride()),
            Act::Attn => (&b.attn, c.q_size()),
            Act::Swiglu => (&b.act, c.intermediate_size),
        }
    }

    /// Records the bytes moved and the arithmetic of the last dispatch (for profiles).
    fn cost(&mut self, bytes: usize, flops: usize) {
        if let Some(d) = self.list.last_mut() {
            d.bytes = bytes as u64;
            d.flops = flops as u64;
        }
    }

    fn push(
        &mut self,
        name: &'static str,
        key: Key,
        pipe: &wgpu::ComputePipeline,
        buffers: &[(u32, &wgpu::Buffer)],
        params: Params,
        groups: [u32; 3],
    ) -> Result<(), BackendError> {
        let d = self
            .binder
            .dispatch(self.gpu, name, key, pipe, buffers, params, groups)?;
        self.list.push(d);
        Ok(())
    }

    /// Appends the device argmax of the step's logits rows.
    pub fn argmax(&mut self) -> Result<(), BackendError> {
        let b = self.bufs;
        let p = kernels::argmax_params(self.nl, self.cfg.vocab_size);
        let k = self.k;
        let pipe = &k.argmax;
        self.push(
            "argmax",
            Key::Argmax,
            pipe,
            &[(1, &b.logits), (2, &b.ids)],
            p,
            [self.nl as u32, 1, 1],
        )?;
        self.cost(self.nl * (self.cfg.vocab_size + 1) * 4, 0);
        Ok(())
    }
}

impl LayerOps for Step<'_> {
    type M = DMatrix;
    type V = DVec;
    type E = DMoe;

    fn embed(&mut self) -> Result<(), BackendError> {
        let hd = self.cfg.hidden_size;
        for part in &self.embed.parts {
            let s = MmShape {
                rows: part.rows,
                cols: hd,
                n: self.n,
                x_stride: 0,
                y_stride: hd,
                y_off: 0,
                add: false,
                row_words: part.ty.row_words(hd),
                row0: part.row0,
            };
            let d = self.binder.dispatch(
                self.gpu,
                "embed",
                Key::Embed(part.id),
                self.k.embed(part.ty),
                &[(1, &part.buf), (3, &self.bufs.x), (4, &self.bufs.tokens)],
                s.params(),
                s.embed_groups(part.ty),
            )?;
            self.list.push(d);
            self.cost(self.n * (s.row_words * 4 + hd * 4), 0);
        }
        Ok(())
    }

    fn rms_norm(
        &mut self,
        _layer: usize,
        w: &DVec,
        next: Next<'_, DMatrix, DMoe>,
    ) -> Result<(), BackendError> {
        if let Next::Matmul(m) = next {
            if self.norm_fuses(m, self.n) {
                // The GEMV after this norm applies it to its input (mm_norm).
                self.norm_pending = Some(w.buf.clone());
                return Ok(());
            }
        }
        let b = self.bufs;
        let p = kernels::rms_params(w.len, self.n, self.cfg.rms_norm_eps, false);
        let k = self.k;
        let pipe = &k.rms_norm;
        self.push(
            "rms_norm",
            Key::Norm(w.id, false),
            pipe,
            &[(1, &b.x), (2, &w.buf), (3, &b.h), (4, &b.lidx)],
            p,
            [self.n as u32, 1, 1],
        )?;
        self.cost((2 * self.n + 1) * w.len * 4, 4 * self.n * w.len);
        Ok(())
    }

    fn matmul(
        &mut self,
        _layer: usize,
        w: &DMatrix,
        src: Act,
        dst: Act,
        add: bool,
    ) -> Result<(), BackendError> {
        let (x, y) = (self.act(src), self.act(dst));
        if src == Act::H {
            if let Some(g) = self.norm_pending.take() {
                let qkv = dst == Act::Qkv;
                let rope = qkv && self.rope_fuses(w);
                self.rope_done = rope;
                let name = if qkv { "matmul_qkv" } else { "matmul" };
                return self.mm_norm(w, &g, y, rope, name);
            }
        }
        if src == Act::Swiglu && self.swiglu_pending {
            // gate_up left the activation to this GEMV: it reads the [gate | up] rows.
            self.swiglu_pending = false;
            let b = self.bufs;
            let x = (&b.gu, 2 * self.cfg.intermediate_size);
            return self.mm_with(w, x, y, self.n, add, 0, "matmul_down", true);
        }
        let name = match (src, dst) {
            (Act::H, Act::Qkv) => "matmul_qkv",
            (Act::Attn, _) => "matmul_o",
            (Act::Swiglu, _) => "matmul_down",
            _ => "matmul",
        };
        self.mm(w, x, y, self.n, add, 0, name)
    }

    fn qkv_post(
        &mut self,
        layer: usize,
        bias: Option<&DVec>,
        q_norm: Option<&DVec>,
        k_norm: Option<&DVec>,
    ) -> Result<(), BackendError> {
        if std::mem::take(&mut self.rope_done) {
            // The QKV GEMV applied RoPE, and the model has nothing else for this op.
            debug_assert!(bias.is_none() && q_norm.is_none() && k_norm.is_none());
            return Ok(());
        }
        let (c, b, d) = (self.cfg, self.bufs, self.dummy);
        let norm = q_norm.is_some() && k_norm.is_some();
        let p = kernels::qkv_params(
            &self.shape,
            self.n,
            c.rope_dim / 2,
            c.rope_style == quire_core::RopeStyle::Neox,
            bias.is_some(),
            norm,
            c.rms_norm_eps,
        );
        let buffers = [
            (1, &b.qkv),
            (2, bias.map_or(d, |v| &v.buf)),
            (3, q_norm.map_or(d, |v| &v.buf)),
            (4, k_norm.map_or(d, |v| &v.buf)),
            (5, &b.rope),
        ];
        let groups = kernels::qkv_groups(&self.shape, self.n);
        let k = self.k;
        let pipe = &k.qkv_post;
        self.push("rope", Key::QkvPost(layer), pipe, &buffers, p, groups)?;
        let s = self.shape;
        let rot = self.n * (s.q_heads + s.kv_heads) * c.rope_dim;
        self.cost(self.n * (2 * s.stride() + c.rope_dim) * 4, 3 * rot);
        Ok(())
    }

    fn attention(&mut self, layer: usize) -> Result<(), BackendError> {
        let b = self.bufs;
        let (kc, vc) = &self.cache[layer];
        let split = self.split.filter(|_| kernels::split_fits(&self.shape));
        if let Some((plan, part, done, ml_off)) = split {
            let (s, n) = (self.shape, self.n);
            let window = self.cfg.sliding_window.unwrap_or(0);
            let p = kernels::split_params(&s, n, self.kv.block_size, window, plan, ml_off);
            let k = self.k;
            let buffers = [
                (1, &b.qkv),
                (2, kc),
                (3, vc),
                (4, &b.tok),
                (5, &b.tables),
                (6, part),
                (7, done),
                (8, &b.attn),
            ];
            let groups = kernels::split_groups(&s, n, plan);
            let key = Key::AttnSplit(layer);
            let pipe = k.attn_split.pipe(self.gpu, &s)?;
            self.push("attn_decode", key, &pipe, &buffers, p, groups)?;
            let (bytes, flops) = attn_cost(&s, n, self.keys);
            let (pw, mw) = plan.scratch_words(&s, n);
            self.cost(bytes + 2 * (pw + mw) * 4, flops);
            return Ok(());
        }
        let p = self.k.attention.params(
            &self.shape,
            self.n,
            self.kv.block_size,
            self.cfg.sliding_window.unwrap_or(0),
        );
        let buffers = [
            (1, &b.qkv),
            (2, kc),
            (3, vc),
            (4, &b.tok),
            (5, &b.tables),
            (6, &b.attn),
        ];
        let groups = kernels::attn_groups(&self.shape, self.tiles);
        let pipe = self.k.attention.pipe(self.gpu, &self.shape)?;
        self.push(
            "attention",
            Key::Attention(layer),
            &pipe,
            &buffers,
            p,
            groups,
        )?;
        let (bytes, flops) = attn_cost(&self.shape, self.n, self.keys);
        self.cost(bytes, flops);
        Ok(())
    }

    fn gate_up(
        &mut self,
        _layer: usize,
        gate_up: &DMatrix,
        down: &DMatrix,
    ) -> Result<(), BackendError> {
        let inter = self.cfg.intermediate_size;
        let b = self.bufs;
        if let Some(g) = self.norm_pending.take() {
            self.mm_norm(gate_up, &g, (&b.gu, 2 * inter), false, "matmul_gate_up")?;
        } else {
            self.mm(
                gate_up,
                (&b.h, self.cfg.hidden_size),
                (&b.gu, 2 * inter),
                self.n,
                false,
                0,
                "matmul_gate_up",
            )?;
        }
        if self.fuse && self.down_takes_swiglu(down) {
            // The down GEMV applies silu(gate) · up as it reads its input: no dispatch here.
            self.swiglu_pending = true;
            return Ok(());
        }
        let p = kernels::swiglu_params(self.n, inter);
        let groups = kernels::swiglu_groups(self.n, inter);
        let k = self.k;
        let pipe = &k.swiglu;
        let bufs = [(1, &b.gu), (2, &b.act)];
        self.push("swiglu", Key::Swiglu, pipe, &bufs, p, groups)?;
        self.cost(self.n * inter * 3 * 4, 6 * self.n * inter);
        Ok(())
    }

    fn moe(&mut self, _layer: usize, m: &DMoe) -> Result<(), BackendError> {
        let (b, k) = (self.bufs, self.k);
        let mk = k.moe.as_ref().ok_or_else(|| {
            BackendError::Wgpu("a MoE layer without the MoE kernels (load made none)".into())
        })?;
        let (n, top, inter, hd) = (self.n, m.top_k, m.inter, m.hidden);
        let pairs = n * top;
        let (p, g) = moe::route_params(m, n);
        let bufs = [
            (1, &b.h),
            (2, &m.router.buf),
            (3, &b.moe_ids),
            (4, &b.moe_wts),
        ];
        self.push(
            "moe_route",
            Key::MoeRoute(m.router.id),
            &mk.route,
            &bufs,
            p,
            g,
        )?;
        self.cost(
            (n * hd + m.router.len + 2 * pairs) * 4,
            2 * n * m.router.len,
        );
        let expert = m.expert_bytes();
        for (w, off) in [(&m.gate, 0), (&m.up, inter)] {
            let part = &w.parts[0];
            let (p, g) = moe::experts_params(w, inter, pairs, top, hd, 2 * inter, off, true);
            let bufs = [(1, &part.buf), (2, &b.h), (3, &b.moe_gu), (4, &b.moe_ids)];
            let pipe = mk.experts(part.ty);
            self.push("moe_gate_up", Key::MoeExperts(part.id), pipe, &bufs, p, g)?;
            self.cost(
                pairs * (expert / 3 + (hd + inter) * 4),
                2 * pairs * inter * hd,
            );
        }
        let (p, g) = (
            kernels::swiglu_params(pairs, inter),
            kernels::swiglu_groups(pairs, inter),
        );
        let bufs = [(1, &b.moe_gu), (2, &b.moe_act)];
        self.push("moe_swiglu", Key::MoeSwiglu, &k.swiglu, &bufs, p, g)?;
        self.cost(pairs * inter * 3 * 4, 6 * pairs * inter);
        let part = &m.down.parts[0];
        let (p, g) = moe::experts_params(&m.down, hd, pairs, top, inter, hd, 0, false);
        let bufs = [
            (1, &part.buf),
            (2, &b.moe_act),
            (3, &b.moe_y),
            (4, &b.moe_ids),
        ];
        let pipe = mk.experts(part.ty);
        self.push("moe_down", Key::MoeExperts(part.id), pipe, &bufs, p, g)?;
        self.cost(
            pairs * (expert / 3 + (hd + inter) * 4),
            2 * pairs * inter * hd,
        );
        let (p, g) = moe::combine_params(m, n);
        let bufs = [(1, &b.moe_y), (2, &b.moe_wts), (4, &b.x)];
        self.push("moe_combine", Key::MoeCombine, &mk.combine, &bufs, p, g)?;
        self.cost((pairs * hd + pairs + 2 * n * hd) * 4, 2 * pairs * hd);
        Ok(())
    }

    fn output(&mut self, norm: &DVec, w: &DMatrix) -> Result<(), BackendError> {
        let b = self.bufs;
        let hd = self.cfg.hidden_size;
        if self.norm_fuses(w, self.nl) {
            // One token, one logits row (row 0): the norm goes into the output GEMV.
            let y = (&b.logits, self.cfg.vocab_size);
            return self.mm_norm(w, &norm.buf, y, false, "output");
        }
        let p = kernels::rms_params(hd, self.nl, self.cfg.rms_norm_eps, true);
        let k = self.k;
        let pipe = &k.rms_norm;
        self.push(
            "rms_norm",
            Key::Norm(norm.id, true),
            pipe,
            &[(1, &b.x), (2, &norm.buf), (3, &b.h), (4, &b.lidx)],
            p,
            [self.nl as u32, 1, 1],
        )?;
        self.cost((2 * self.nl + 1) * hd * 4, 4 * self.nl * hd);
        self.mm(
            w,
            (&b.h, hd),
            (&b.logits, self.cfg.vocab_size),
            self.nl,
            false,
            1,
            "output",
        )
    }
}
