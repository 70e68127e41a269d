//! The mixture-of-experts FFN on CUDA (Qwen3-MoE): router GEMM, on-device top-k and a counting
//! sort of the (token, expert) pairs into tiles of up to 8 pairs of one expert, expert matmuls that
//! read an expert's weights once per tile (quantized experts with 8-bit activations, or f16), SwiGLU
//! over the pairs, and the weighted combine into the residual stream. No host round trip, so decode
//! steps stay inside CUDA graphs.

use cudarc::driver::CudaFunction;
use half::f16;
use quire_core::MoeConfig;

use super::gpu::{DBuf, Gpu, KArg};
use super::nvrtc;
use super::qmat::{is_block32_quant, to_f16, WMat, Q8A_BYTES};
use crate::{BackendError, HostTensor, MoeWeights};

/// Pairs per tile (`MOE_TILE` in moe.cu) and weight rows per CTA (`MOE_WARPS × MOE_ROWS`).
const TILE: usize = 8;
const ROWS_PER_CTA: usize = 8;

pub struct MoeKernels {
    topk: CudaFunction,
    sort: CudaFunction,
    /// By type: Q4_0, Q4_1, Q8_0.
    mmq: [CudaFunction; 3],
    gemv_f16: CudaFunction,
    combine: CudaFunction,
}

impl MoeKernels {
    pub fn new(gpu: &Gpu) -> Result<Self, BackendError> {
        let m = gpu.module(&nvrtc::MOE, &[])?;
        let f = |name: &str| Gpu::function(&m, name);
        Ok(Self {
            topk: f("moe_topk")?,
            sort: f("moe_sort")?,
            mmq: [f("moe_mmq_q4_0")?, f("moe_mmq_q4_1")?, f("moe_mmq_q8_0")?],
            gemv_f16: f("moe_gemv_f16")?,
            combine: f("moe_combine")?,
        })
    }
}

/// One layer's experts on the device.
pub struct MoeLayer {
    pub cfg: MoeConfig,
    /// `[num_experts, hidden]` f32: router logits = x · routerᵀ, in f32 as the CPU computes them
    /// (near-equal logits must pick the same experts).
    pub router: DBuf<f32>,
    /// Per expert `[2 · inter, hidden]`: gate rows then up rows (expert slabs one after another).
    pub gate_up: WMat,
    /// Per expert `[hidden, inter]`.
    pub down: WMat,
}

/// Expert slabs of `gate` and `up` (each `[experts][inter][hidden]`) interleaved per expert.
fn stack_experts(
    gpu: &Gpu,
    parts: &[&HostTensor],
    experts: usize,
    keep_quant: bool,
) -> Result<WMat, BackendError> {
    let dtype = parts[0].dtype;
    if keep_quant && is_block32_quant(dtype) && parts.iter().all(|t| t.dtype == dtype) {
        let slabs: Vec<&[u8]> = parts.iter().map(|t| t.bytes.as_slice()).collect();
        let mut bytes = Vec::with_capacity(slabs.iter().map(|s| s.len()).sum());
        for e in 0..experts {
            for s in &slabs {
                let per = s.len() / experts;
                bytes.extend_from_slice(&s[e * per..(e + 1) * per]);
            }
        }
        return Ok(WMat::Quant {
            dtype,
            data: gpu.upload(&bytes)?,
        });
    }
    let vals: Vec<Vec<f16>> = parts.iter().map(|t| to_f16(t)).collect::<Result<_, _>>()?;
    let mut out = Vec::with_capacity(vals.iter().map(|v| v.len()).sum());
    for e in 0..experts {
        for v in &vals {
            let per = v.len() / experts;
            out.extend_from_slice(&v[e * per..(e + 1) * per]);
        }
    }
    Ok(WMat::F16(gpu.upload(&out)?))
}

fn check_dims(t: &HostTensor, want: [usize; 3]) -> Result<(), BackendError> {
    if t.dims != want {
        return Err(BackendError::Shape {
            name: t.name.clone(),
            got: t.dims.clone(),
            expected: want.to_vec(),
        });
    }
    Ok(())
}

impl MoeLayer {
    pub fn upload(
        gpu: &Gpu,
        w: &MoeWeights,
        cfg: MoeConfig,
        hidden: usize,
        keep_quant: bool,
    ) -> Result<Self, BackendError> {
        let (e, inter) = (cfg.num_experts, cfg.expert_intermediate_size);
        check_dims(&w.gate_exps, [hidden, inter, e])?;
        check_dims(&w.up_exps, [hidden, inter, e])?;
        check_dims(&w.down_exps, [inter, hidden, e])?;
        if w.gate_inp.dims != [hidden, e] {
            return Err(BackendError::Shape {
                name: w.gate_inp.name.clone(),
                got: w.gate_inp.dims.clone(),
                expected: vec![hidden, e],
            });
        }
        if keep_quant && is_block32_quant(w.down_exps.dtype) != is_block32_quant(w.gate_exps.dtype)
        {
            return Err(BackendError::Config(
                "expert gate/up and down weights must be both quantized or both float".into(),
            ));
        }
        Ok(Self {
            cfg,
            router: gpu.upload(&w.gate_inp.to_f32()?)?,
            gate_up: stack_experts(gpu, &[&w.gate_exps, &w.up_exps], e, keep_quant)?,
            down: stack_experts(gpu, &[&w.down_exps], e, keep_quant)?,
        })
    }

    /// Whether the experts take 8-bit activation blocks (else f16 rows).
    pub fn q8_in(&self) -> bool {
        self.gate_up.quant_type().is_some()
    }
}

/// Device scratch of the MoE FFN, grown to the largest step so far (empty until the first).
pub struct MoeScratch {
    /// Tokens the buffers hold (0: not grown).
    tokens: usize,
    /// The router's f32 input rows: [n, hidden].
    pub hf: DBuf<f32>,
    logits: DBuf<f32>,    // [n, experts]
    ids: DBuf<i32>,       // [n, k]
    weights: DBuf<f32>,   // [n, k]
    sorted: DBuf<i32>,    // [n * k]
    tiles: DBuf<i32>,     // [max_tiles, 4]
    num_tiles: DBuf<i32>, // [1]
    gu: DBuf<f32>,        // [n * k, 2 * inter]
    act: DBuf<u8>,        // [n * k, inter] f16 or 8-bit blocks
    y: DBuf<f32>,         // [n * k, hidden]
}

fn max_tiles(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(TILE) + experts
}

impl MoeScratch {
    /// No buffers yet (dense models never grow it).
    pub fn empty(gpu: &Gpu) -> Result<Self, BackendError> {
        Ok(Self {
            tokens: 0,
            hf: gpu.alloc(0)?,
            logits: gpu.alloc(0)?,
            ids: gpu.alloc(0)?,
            weights: gpu.alloc(0)?,
            sorted: gpu.alloc(0)?,
            tiles: gpu.alloc(0)?,
            num_tiles: gpu.alloc(0)?,
            gu: gpu.alloc(0)?,
            act: gpu.alloc(0)?,
            y: gpu.alloc(0)?,
        })
    }

    /// Grows to `n` tokens; true when anything moved.
    pub fn grow(
        &mut self,
        gpu: &Gpu,
        n: usize,
        cfg: &MoeConfig,
        hidden: usize,
    ) -> Result<bool, BackendError> {
        if n <= self.tokens {
            return Ok(false);
        }
        let cap = n.next_power_of_two().max(16);
        let (e, k, inter) = (
            cfg.num_experts,
            cfg.num_experts_per_tok,
            cfg.expert_intermediate_size,
        );
        let pairs = cap * k;
        self.hf = gpu.alloc(cap * hidden)?;
        self.logits = gpu.alloc(cap * e)?;
        self.ids = gpu.alloc(pairs)?;
        self.weights = gpu.alloc(pairs)?;
        self.sorted = gpu.alloc(pairs)?;
        self.tiles = gpu.alloc(4 * max_tiles(pairs, e))?;
        self.num_tiles = gpu.alloc(1)?;
        self.gu = gpu.alloc(pairs * 2 * inter)?;
        self.act = gpu.alloc(pairs * (2 * inter).max(inter / 32 * Q8A_BYTES))?;
        self.y = gpu.alloc(pairs * hidden)?;
        self.tokens = cap;
        Ok(true)
    }
}

/// The pieces of the step the MoE FFN reads: the normed input as f32 rows (`hf`, the router's),
/// f16 rows (`h`, f16 experts) and 8-bit blocks (`q8`, quantized experts), and the residual
/// stream `x` it adds into.
pub struct MoeInputs {
    pub hf: u64,
    pub h: u64,
    pub q8: u64,
    pub x: u64,
    pub n: usize,
    pub hidden: usize,
}

/// The kernels one MoE block launches.
pub struct MoeRun<'a> {
    pub g: &'a Gpu,
    pub mk: &'a MoeKernels,
    pub qk: &'a super::qmat::QuantKernels,
    /// The dense SwiGLU kernel (f16 activations).
    pub swiglu_f16: &'a CudaFunction,
}

/// One step's sizes: experts, picks per token, expert rows, tokens, hidden, (token, expert)
/// pairs, and the tile grid the expert matmuls launch over.
#[derive(Clone, Copy)]
struct Dims {
    e: usize,
    k: usize,
    inter: usize,
    n: usize,
    hd: usize,
    pairs: usize,
    grid_y: u32,
}

impl MoeRun<'_> {
    /// Layer `layer`'s MoE block over `io.n` tokens, added into `io.x`.
    ///
    /// # Safety
    ///
    /// `io`'s addresses are live device allocations on `g`'s context, not freed before the
    /// stream has finished the block: `hf` and `x` `n · hidden` f32, `h` `n · hidden` f16 (f16
    /// experts), `q8` `n · hidden / 32` 8-bit blocks (quantized experts); `x` overlaps none.
    pub unsafe fn run(
        &self,
        layer: &MoeLayer,
        s: &MoeScratch,
        io: &MoeInputs,
    ) -> Result<(), BackendError> {
        let c = &layer.cfg;
        let (e, k) = (c.num_experts, c.num_experts_per_tok);
        let pairs = io.n * k;
        let d = Dims {
            e,
            k,
            inter: c.expert_intermediate_size,
            n: io.n,
            hd: io.hidden,
            pairs,
            grid_y: max_tiles(pairs, e) as u32,
        };
        if io.n > s.tokens {
            return Err(BackendError::InvalidBatch(format!(
                "MoE scratch holds {} tokens, the step has {}",
                s.tokens, io.n
            )));
        }
        let quant = layer.q8_in();
        let x_in = if quant { io.q8 } else { io.h };
        // SAFETY: `io`'s addresses are the caller's (this fn's contract); every other address
        // is `s`'s, grown (checked above) for at least `n` tokens of this model's MoE shape, or
        // the layer's weights, both alive for the executor's life.
        unsafe {
            self.route(layer, s, io, d)?;
            self.experts(&layer.gate_up, x_in, k, s.gu.ptr, 2 * d.inter, d.hd, s, d)?;
            self.swiglu(quant, s, d)?;
            self.experts(&layer.down, s.act.ptr, 1, s.y.ptr, d.hd, d.inter, s, d)?;
            self.combine(io.x, s, d)
        }
    }

    /// Router logits (f32), the top `k` experts of each token, and the counting sort of the
    /// (token, expert) pairs into tiles of one expert.
    ///
    /// # Safety
    ///
    /// As `run`.
    unsafe fn route(
        &self,
        layer: &MoeLayer,
        s: &MoeScratch,
        io: &MoeInputs,
        d: Dims,
    ) -> Result<(), BackendError> {
        use KArg::{I, P};
        let (g, mk) = (self.g, self.mk);
        let norm_topk = layer.cfg.norm_topk_prob as i32;
        // SAFETY: as `run` (this fn's contract); the argument lists are moe.cu's.
        unsafe {
            g.gemm_f32(io.hf, layer.router.ptr, s.logits.ptr, d.n, d.hd, d.e, 0.0)?;
            g.launch(
                &mk.topk,
                (d.n.div_ceil(4) as u32, 1, 1),
                (128, 1, 1),
                &[
                    P(s.logits.ptr),
                    I(d.e as i32),
                    I(d.k as i32),
                    I(norm_topk),
                    I(d.n as i32),
                    P(s.ids.ptr),
                    P(s.weights.ptr),
                ],
            )?;
            g.launch(
                &mk.sort,
                (1, 1, 1),
                (1024, 1, 1),
                &[
                    P(s.ids.ptr),
                    I(d.pairs as i32),
                    I(d.e as i32),
                    P(s.sorted.ptr),
                    P(s.tiles.ptr),
                    P(s.num_tiles.ptr),
                ],
            )
        }
    }

    /// One expert matmul over the sorted tiles: `out[pair] = w[expert] · a[pair / act_div]`,
    /// `w` `rows × cols` per expert.
    ///
    /// # Safety
    ///
    /// As `run`; `a` holds the matmul's input rows (`act_div` 1: one per pair, `k`: one per
    /// token) and `out` `pairs · rows` f32.
    #[allow(clippy::too_many_arguments)]
    unsafe fn experts(
        &self,
        w: &WMat,
        a: u64,
        act_div: usize,
        out: u64,
        rows: usize,
        cols: usize,
        s: &MoeScratch,
        d: Dims,
    ) -> Result<(), BackendError> {
        use KArg::{I, L, P};
        let grid = (rows.div_ceil(ROWS_PER_CTA) as u32, d.grid_y, 1);
        let tiles = [P(s.sorted.ptr), P(s.tiles.ptr), P(s.num_tiles.ptr)];
        match w {
            WMat::Quant { dtype, data } => {
                let idx = match dtype {
                    quire_gguf::GgmlType::Q4_0 => 0,
                    quire_gguf::GgmlType::Q4_1 => 1,
                    _ => 2,
                };
                let expert_bytes = rows * dtype.row_size(cols as u64).unwrap_or(0) as usize;
                let mut args = vec![P(data.ptr), L(expert_bytes as i64), P(a), I(act_div as i32)];
                args.extend(tiles);
                args.extend([P(out), I(rows as i32), I((cols / 32) as i32)]);
                // SAFETY: moe_mmq's list; the addresses as this fn's contract says.
                unsafe { self.g.launch(&self.mk.mmq[idx], grid, (128, 1, 1), &args) }
            }
            WMat::F16(b) => {
                let mut args = vec![P(b.ptr), P(a), I(act_div as i32)];
                args.extend(tiles);
                args.extend([P(out), I(rows as i32), I(cols as i32)]);
                // SAFETY: moe_gemv_f16's list; the addresses as this fn's contract says.
                unsafe { self.g.launch(&self.mk.gemv_f16, grid, (128, 1, 1), &args) }
            }
        }
    }

    /// SwiGLU of every pair's gate/up row into the down matmul's input (`quant`: 8-bit blocks).
    ///
    /// # Safety
    ///
    /// As `run`.
    unsafe fn swiglu(&self, quant: bool, s: &MoeScratch, d: Dims) -> Result<(), BackendError> {
        use KArg::{I, L, P};
        let (gu, act, inter) = (s.gu.ptr, s.act.ptr, d.inter as i32);
        // SAFETY: the swiglu kernels' lists; `gu` and `act` are `s`'s, sized for the pairs.
        unsafe {
            if quant {
                let blocks = d.pairs * d.inter / 32;
                self.g.launch(
                    &self.qk.swiglu_q8,
                    (blocks.div_ceil(8) as u32, 1, 1),
                    (256, 1, 1),
                    &[P(gu), P(act), I(inter), L(blocks as i64)],
                )
            } else {
                let total = d.pairs * d.inter;
                self.g.launch(
                    self.swiglu_f16,
                    (total.div_ceil(256).min(65535) as u32, 1, 1),
                    (256, 1, 1),
                    &[P(gu), P(act), I(inter), L(total as i64)],
                )
            }
        }
    }

    /// `x[t] += Σ weight · y[pair]` over each token's `k` pairs.
    ///
    /// # Safety
    ///
    /// As `run`, `x` being `io.x`.
    unsafe fn combine(&self, x: u64, s: &MoeScratch, d: Dims) -> Result<(), BackendError> {
        use KArg::{I, P};
        // SAFETY: moe_combine's list; `x` is the caller's, the rest `s`'s.
        unsafe {
            self.g.launch(
                &self.mk.combine,
                (d.n as u32, 1, 1),
                (256, 1, 1),
                &[
                    P(x),
                    P(s.y.ptr),
                    P(s.weights.ptr),
                    I(d.k as i32),
                    I(d.hd as i32),
                ],
            )
        }
    }
}
