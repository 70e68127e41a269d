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

/// Device scratch of the MoE FFN for `n` tokens.
#[derive(Default)]
pub struct MoeScratch {
    tokens: usize,
    /// The router's f32 input rows: [n, hidden].
    pub hf: Option<DBuf<f32>>,
    logits: Option<DBuf<f32>>,    // [n, experts]
    ids: Option<DBuf<i32>>,       // [n, k]
    weights: Option<DBuf<f32>>,   // [n, k]
    sorted: Option<DBuf<i32>>,    // [n * k]
    tiles: Option<DBuf<i32>>,     // [max_tiles, 4]
    num_tiles: Option<DBuf<i32>>, // [1]
    gu: Option<DBuf<f32>>,        // [n * k, 2 * inter]
    act: Option<DBuf<u8>>,        // [n * k, inter] f16 or 8-bit blocks
    y: Option<DBuf<f32>>,         // [n * k, hidden]
}

fn max_tiles(pairs: usize, experts: usize) -> usize {
    pairs.div_ceil(TILE) + experts
}

impl MoeScratch {
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
        self.hf = Some(gpu.alloc(cap * hidden)?);
        self.logits = Some(gpu.alloc(cap * e)?);
        self.ids = Some(gpu.alloc(pairs)?);
        self.weights = Some(gpu.alloc(pairs)?);
        self.sorted = Some(gpu.alloc(pairs)?);
        self.tiles = Some(gpu.alloc(4 * max_tiles(pairs, e))?);
        self.num_tiles = Some(gpu.alloc(1)?);
        self.gu = Some(gpu.alloc(pairs * 2 * inter)?);
        self.act = Some(gpu.alloc(pairs * (2 * inter).max(inter / 32 * Q8A_BYTES))?);
        self.y = Some(gpu.alloc(pairs * hidden)?);
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

#[allow(clippy::too_many_arguments)]
pub fn run(
    g: &Gpu,
    mk: &MoeKernels,
    qk: &super::qmat::QuantKernels,
    swiglu_f16: &CudaFunction,
    layer: &MoeLayer,
    s: &MoeScratch,
    io: &MoeInputs,
) -> Result<(), BackendError> {
    use KArg::{I, L, P};
    let c = &layer.cfg;
    let (e, k, inter) = (
        c.num_experts,
        c.num_experts_per_tok,
        c.expert_intermediate_size,
    );
    let (n, hd) = (io.n, io.hidden);
    let pairs = n * k;
    let p = |b: &Option<DBuf<i32>>| b.as_ref().unwrap().ptr;
    let pf = |b: &Option<DBuf<f32>>| b.as_ref().unwrap().ptr;
    let (logits, weights, gu, y) = (pf(&s.logits), pf(&s.weights), pf(&s.gu), pf(&s.y));
    let (ids, sorted, tiles, num_tiles) = (p(&s.ids), p(&s.sorted), p(&s.tiles), p(&s.num_tiles));
    let act = s.act.as_ref().unwrap().ptr;

    // Router logits (f32), top-k, sort into tiles.
    g.gemm_f32(io.hf, layer.router.ptr, logits, n, hd, e, 0.0)?;
    g.launch(
        &mk.topk,
        (n.div_ceil(4) as u32, 1, 1),
        (128, 1, 1),
        &[
            P(logits),
            I(e as i32),
            I(k as i32),
            I(c.norm_topk_prob as i32),
            I(n as i32),
            P(ids),
            P(weights),
        ],
    )?;
    g.launch(
        &mk.sort,
        (1, 1, 1),
        (1024, 1, 1),
        &[
            P(ids),
            I(pairs as i32),
            I(e as i32),
            P(sorted),
            P(tiles),
            P(num_tiles),
        ],
    )?;
    let grid_y = max_tiles(pairs, e) as u32;
    let expert_mm = |w: &WMat, a: u64, act_div: usize, out: u64, rows: usize, cols: usize| match w {
        WMat::Quant { dtype, data } => {
            let idx = match dtype {
                quire_gguf::GgmlType::Q4_0 => 0,
                quire_gguf::GgmlType::Q4_1 => 1,
                _ => 2,
            };
            let expert_bytes = rows * dtype.row_size(cols as u64).unwrap_or(0) as usize;
            g.launch(
                &mk.mmq[idx],
                (rows.div_ceil(ROWS_PER_CTA) as u32, grid_y, 1),
                (128, 1, 1),
                &[
                    P(data.ptr),
                    L(expert_bytes as i64),
                    P(a),
                    I(act_div as i32),
                    P(sorted),
                    P(tiles),
                    P(num_tiles),
                    P(out),
                    I(rows as i32),
                    I((cols / 32) as i32),
                ],
            )
        }
        WMat::F16(b) => g.launch(
            &mk.gemv_f16,
            (rows.div_ceil(ROWS_PER_CTA) as u32, grid_y, 1),
            (128, 1, 1),
            &[
                P(b.ptr),
                P(a),
                I(act_div as i32),
                P(sorted),
                P(tiles),
                P(num_tiles),
                P(out),
                I(rows as i32),
                I(cols as i32),
            ],
        ),
    };
    let quant = layer.q8_in();
    expert_mm(
        &layer.gate_up,
        if quant { io.q8 } else { io.h },
        k,
        gu,
        2 * inter,
        hd,
    )?;
    if quant {
        let blocks = pairs * inter / 32;
        g.launch(
            &qk.swiglu_q8,
            (blocks.div_ceil(8) as u32, 1, 1),
            (256, 1, 1),
            &[P(gu), P(act), I(inter as i32), L(blocks as i64)],
        )?;
    } else {
        let total = pairs * inter;
        g.launch(
            swiglu_f16,
            (total.div_ceil(256).min(65535) as u32, 1, 1),
            (256, 1, 1),
            &[P(gu), P(act), I(inter as i32), L(total as i64)],
        )?;
    }
    expert_mm(&layer.down, act, 1, y, hd, inter)?;
    g.launch(
        &mk.combine,
        (n as u32, 1, 1),
        (256, 1, 1),
        &[P(io.x), P(y), P(weights), I(k as i32), I(hd as i32)],
    )?;
    Ok(())
}
