//! The mixture-of-experts FFN on CUDA (Qwen3-MoE): router GEMM, on-device top-k and a counting
//! sort of the (token, expert) pairs into tiles of one expert, expert matmuls that read an expert's
//! weights once per tile, SwiGLU over the pairs, and the weighted combine into the residual stream.
//! No host round trip, so decode steps stay inside CUDA graphs.
//!
//! Quantized experts (Q4_0, Q4_1, Q8_0 and the K-quants Q4_K, Q5_K, Q6_K) stay as stored and take
//! 8-bit activations, with the dense kernels' per-block arithmetic; other types go to f16. Decode
//! (few tokens) sorts into tiles of up to [`TILE`] pairs; prompt chunks (from [`TC_MIN_TOKENS`])
//! into tiles of up to [`TC_TILE`] pairs for a grouped int8 tensor-core GEMM, so each expert's
//! weights are read once per 64 of its pairs instead of once per 8.
//!
//! Decode reads little (one token: 8 experts × 3 matrices, ~21 MB at the 30B-A3B shape, ~7 µs at
//! the H100's read roof), so what costs is how the reads are issued: the GEMV path
//! ([`MoePath::Gemv`]) stages each warp's weight rows through shared memory with 16-byte loads
//! as the dense one-token GEMV does, launches only as many tile rows as the pairs can fill, and
//! runs the down matrix and the combine as one launch. The older dp4a tile kernels
//! ([`MoePath::Dp4a`], 2-byte loads straight from memory) stay for rows that are not 16-byte
//! aligned and as the reference the test holds the GEMV path to.
//!
//! Launches per layer: up to [`FUSED_ROUTE_MAX_TOKENS`] tokens, route (logits, top-k, sort),
//! gate/up, SwiGLU into 8-bit blocks, then down and combine (one launch on the GEMV path up to
//! [`FUSED_DOWN_MAX_TOKENS`] tokens: 4 in all; else 5); above, cuBLAS's router GEMM, top-k and
//! sort in place of the route (7). Each expert matmul is one launch over every expert's tiles.

use cudarc::driver::CudaFunction;
use half::f16;
use quire_core::MoeConfig;
use quire_gguf::GgmlType;

use super::gpu::{DBuf, Gpu, KArg};
use super::nvrtc;
use super::qmat::{is_native_quant, to_f16, WMat, Q8A_BYTES};
use crate::{BackendError, HostTensor, MoeWeights};

/// Pairs per tile of the dp4a and GEMV-shaped expert kernels (`MOE_TILE` in moe.cu) and their
/// weight rows per CTA (`MOE_WARPS × MOE_ROWS`, `MMV_WARPS × MMV_ROWS` in quant.cu).
pub const TILE: usize = 8;
const ROWS_PER_CTA: usize = 8;
/// Rows per CTA of the fused down + combine kernel (`MMV_ROWS`: its warps split the slots).
const DOWN_ROWS_PER_CTA: usize = 2;
/// Threads per CTA of the GEMV-shaped expert kernels (`MMV_WARPS` warps).
const MMV_THREADS: u32 = 128;
/// Pairs per tile of the tensor-core expert kernels (`TC_TOK` in mmq_tc.cuh), their weight rows
/// per CTA (`TC_ROWS`) and threads (`TC_THREADS`).
pub const TC_TILE: usize = 64;
const TC_ROWS: usize = 64;
const TC_THREADS: u32 = 256;

/// The most tokens whose expert matmuls take the GEMV-shaped kernels ([`MoePath::Gemv`]); from
/// there to [`TC_MIN_TOKENS`] the dp4a tiles. `cuda_moe_bench --reps 50` on an H100 (one
/// 30B-A3B block, median µs, Gemv / Dp4a): Q4_0 1 token 31.8 / 40.4, 4 tokens 85.5 / 92.5, 8
/// tokens 142.5 / 150.8, 16 tokens 259.6 / 264.1; Q4_K 1 token 34.8 / 44.0, 4 tokens 94.8 /
/// 97.9, 8 tokens 162.5 / 155.7, 16 tokens 297.3 / 278.6. Q4_K turns at 8, so 4 is the bound.
pub const GEMV_MAX_TOKENS: usize = 4;

/// The fewest tokens whose expert matmuls run on the tensor cores (quantized experts, sm_80+).
/// At `n` tokens an expert gets about `n · k / experts` pairs (n / 16 for 30B-A3B): below ~8 the
/// dp4a tiles already read each expert once and the tensor-core tile would be mostly empty; above,
/// dp4a reads an expert once per 8 pairs and the tensor cores once per 64. 128 tokens (~8 pairs an
/// expert) is the estimate from that count; the lead measures the crossing with
/// `cuda_moe_bench` (`--path` forces either) and sets it from the numbers.
pub const TC_MIN_TOKENS: usize = 128;

/// Up to this many tokens the router logits, the top-k and the sort are one launch (`moe_route`:
/// a warp per expert, then the last CTA routes every token), two launches fewer per layer than
/// cuBLAS's GEMM, the top-k and the sort that larger steps take.
pub const FUSED_ROUTE_MAX_TOKENS: usize = 64;

/// Up to this many tokens the GEMV path runs the down matrix and the combine as one launch: each
/// CTA owns rows of one token, its warps split the token's `k` experts, and one thread per row
/// sums them in order (deterministic, no float atomics), reading an expert once per pair rather
/// than once per tile of pairs. At 16 tokens (~128 pairs over ~80 experts) a shared expert's rows
/// should come from L2 the second time (the CTAs of one row block for every token are launched
/// together); the benchmark's `down+combine` stage against `down` + `combine` on the dp4a path
/// tells whether that holds (not yet measured).
pub const FUSED_DOWN_MAX_TOKENS: usize = 16;

/// Which kernels multiply the experts (the test and the benchmark name one; a step picks by
/// token count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum MoePath {
    /// Tiles of up to [`TILE`] pairs, dp4a (quantized) or f16 GEMV.
    Dp4a,
    /// Tiles of up to [`TILE`] pairs shaped like the dense one-token GEMV: each warp stages its
    /// rows through shared memory with 16-byte loads (quantized experts whose rows start 16-byte
    /// aligned; a matrix whose rows do not takes the dp4a kernel). Decode's path.
    Gemv,
    /// Tiles of up to [`TC_TILE`] pairs on the int8 tensor cores (quantized experts, sm_80+).
    TensorCore,
}

impl MoePath {
    /// Every path (the benchmark's rows).
    pub const ALL: [MoePath; 3] = [MoePath::Dp4a, MoePath::Gemv, MoePath::TensorCore];
}

/// The expert kernels' stored types, in the order of `MoeKernels::mmq`, with their name suffix.
const TYPES: [(GgmlType, &str); 6] = [
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q4_K, "q4_k"),
    (GgmlType::Q5_K, "q5_k"),
    (GgmlType::Q6_K, "q6_k"),
];

/// Experts and picks per token the top-k kernel handles (its taken-set and one lane per pick;
/// `MOE_MAX_TOP_K` in moe.cu, the fused down kernel's slots).
const MAX_EXPERTS: usize = 512;
const MAX_TOP_K: usize = 32;

pub struct MoeKernels {
    topk: CudaFunction,
    route: CudaFunction,
    sort: CudaFunction,
    /// By type (`TYPES` order): the dp4a kernel, the GEMV-shaped one (tiles of up to [`TILE`]
    /// pairs, and of one pair: one token), and the tensor-core one.
    mmq: Vec<[CudaFunction; 4]>,
    /// By type: the GEMV-shaped down matrix with the combine (few tokens).
    down: Vec<CudaFunction>,
    gemv_f16: CudaFunction,
    combine: CudaFunction,
}

impl MoeKernels {
    pub fn new(gpu: &Gpu) -> Result<Self, BackendError> {
        let m = gpu.module(&nvrtc::MOE, &[])?;
        let f = |name: &str| Gpu::function(&m, name);
        let mmq = TYPES
            .iter()
            .map(|(_, t)| {
                Ok([
                    f(&format!("moe_mmq_{t}"))?,
                    f(&format!("moe_mmq_{t}_mmv"))?,
                    f(&format!("moe_mmq_{t}_mmv1"))?,
                    f(&format!("moe_mmq_{t}_tc"))?,
                ])
            })
            .collect::<Result<_, BackendError>>()?;
        Ok(Self {
            topk: f("moe_topk")?,
            route: f("moe_route")?,
            sort: f("moe_sort")?,
            mmq,
            down: TYPES
                .iter()
                .map(|(_, t)| f(&format!("moe_mmq_{t}_down")))
                .collect::<Result<_, _>>()?,
            gemv_f16: f("moe_gemv_f16")?,
            combine: f("moe_combine")?,
        })
    }
}

/// One layer's experts on the device.
pub struct MoeLayer {
    pub cfg: MoeConfig,
    /// The model's hidden size (the experts' gate/up row length).
    pub hidden: usize,
    /// `[num_experts, hidden]` f32: router logits = x · routerᵀ, in f32 as the CPU computes them
    /// (near-equal logits must pick the same experts).
    pub router: DBuf<f32>,
    /// Per expert `[2 · inter, hidden]`: gate rows then up rows (expert slabs one after another).
    pub gate_up: WMat,
    /// Per expert `[hidden, inter]`.
    pub down: WMat,
}

/// Expert slabs of `gate` and `up` (each `[experts][inter][hidden]`) interleaved per expert: kept as
/// stored when `keep_quant` and every part has the same type the expert kernels read, else f16.
fn stack_experts(
    gpu: &Gpu,
    parts: &[&HostTensor],
    experts: usize,
    keep_quant: bool,
) -> Result<WMat, BackendError> {
    let dtype = parts[0].dtype;
    if keep_quant && is_native_quant(dtype) && parts.iter().all(|t| t.dtype == dtype) {
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
        if e > MAX_EXPERTS
            || cfg.num_experts_per_tok == 0
            || cfg.num_experts_per_tok > e.min(MAX_TOP_K)
        {
            return Err(BackendError::Config(format!(
                "the CUDA MoE block takes up to {MAX_EXPERTS} experts and 1 to {MAX_TOP_K} \
                 (at most the experts) per token; the model has {e} and {}",
                cfg.num_experts_per_tok
            )));
        }
        if keep_quant && is_native_quant(w.down_exps.dtype) != is_native_quant(w.gate_exps.dtype) {
            return Err(BackendError::Config(
                "expert gate/up and down weights must be both quantized or both float".into(),
            ));
        }
        Ok(Self {
            cfg,
            hidden,
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
    done: DBuf<u32>,      // [1] moe_route's count of finished CTAs, zero between launches
    gu: DBuf<f32>,        // [n * k, 2 * inter]
    act: DBuf<u8>,        // [n * k, inter] f16 or 8-bit blocks
    y: DBuf<f32>,         // [n * k, hidden]
}

/// Tiles of at most `tile` pairs that `pairs` pairs over `experts` experts can take: a partial
/// tile at most per expert that has a pair, and never more tiles than pairs. The expert matmuls
/// launch this many CTA rows (those past the step's tile count leave at once), so the bound is
/// kept tight: one token's 8 pairs launch 8, not 129.
fn max_tiles(pairs: usize, experts: usize, tile: usize) -> usize {
    (pairs.div_ceil(tile) + experts.min(pairs)).min(pairs)
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
            done: gpu.alloc(1)?,
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
        self.tiles = gpu.alloc(4 * max_tiles(pairs, e, TILE))?;
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
/// pairs, the expert kernels and their tile size, and the tile count the expert matmuls launch
/// over.
#[derive(Clone, Copy)]
struct Dims {
    e: usize,
    k: usize,
    inter: usize,
    n: usize,
    hd: usize,
    pairs: usize,
    path: MoePath,
    tile: usize,
    grid_y: u32,
}

impl MoeRun<'_> {
    /// The expert kernels a step of `n` tokens takes on `layer`.
    pub fn path_for(&self, layer: &MoeLayer, n: usize) -> MoePath {
        if n >= TC_MIN_TOKENS && self.tc_ok(layer) {
            MoePath::TensorCore
        } else if n <= GEMV_MAX_TOKENS && self.gemv_ok(layer) {
            MoePath::Gemv
        } else {
            MoePath::Dp4a
        }
    }

    /// Whether `path` can run on `layer` here (the dp4a path always can).
    pub fn path_ok(&self, layer: &MoeLayer, path: MoePath) -> bool {
        match path {
            MoePath::Dp4a => true,
            MoePath::Gemv => self.gemv_ok(layer),
            MoePath::TensorCore => self.tc_ok(layer),
        }
    }

    /// Whether the GEMV-shaped expert kernels can run on `layer`'s gate/up matrix: quantized
    /// experts whose rows start 16-byte aligned (its down matrix, where they do not, takes the
    /// dp4a kernel).
    pub fn gemv_ok(&self, layer: &MoeLayer) -> bool {
        layer.gate_up.quant_type().is_some_and(|t| {
            super::qmat::QuantKernels::mmv_ok(t, layer.hidden, layer.gate_up.ptr())
        })
    }

    /// Whether the tensor-core expert kernels can run on `layer` here: quantized experts, sm_80+
    /// and 16-byte aligned slabs.
    pub fn tc_ok(&self, layer: &MoeLayer) -> bool {
        layer.q8_in() && self.qk.tc_ok(layer.gate_up.ptr()) && self.qk.tc_ok(layer.down.ptr())
    }

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
        let path = self.path_for(layer, io.n);
        // SAFETY: this fn's contract is `run_with`'s.
        unsafe { self.run_with(layer, s, io, path) }
    }

    /// [`Self::run`] with the expert kernels named (the test and the benchmark); the tensor-core
    /// path where [`Self::tc_ok`] is false is an error.
    ///
    /// # Safety
    ///
    /// As [`Self::run`].
    pub unsafe fn run_with(
        &self,
        layer: &MoeLayer,
        s: &MoeScratch,
        io: &MoeInputs,
        path: MoePath,
    ) -> Result<(), BackendError> {
        // SAFETY: this fn's contract is `run_marked`'s.
        unsafe { self.run_marked(layer, s, io, path, &mut |_| Ok(())) }
    }

    /// [`Self::run_with`], calling `mark` with the stage's name right after each stage's
    /// launches are queued (`route`, `gate_up`, `swiglu`, then `down` and `combine`, or
    /// `down+combine` where they are one launch): the benchmark records a CUDA event there to
    /// time each stage.
    ///
    /// # Safety
    ///
    /// As [`Self::run`].
    pub unsafe fn run_marked(
        &self,
        layer: &MoeLayer,
        s: &MoeScratch,
        io: &MoeInputs,
        path: MoePath,
        mark: &mut dyn FnMut(&'static str) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        let c = &layer.cfg;
        let (e, k) = (c.num_experts, c.num_experts_per_tok);
        if io.n > s.tokens {
            return Err(BackendError::InvalidBatch(format!(
                "MoE scratch holds {} tokens, the step has {}",
                s.tokens, io.n
            )));
        }
        if path == MoePath::TensorCore && !self.tc_ok(layer) {
            return Err(BackendError::Cuda(format!(
                "the tensor-core expert kernels need quantized experts, sm_80 or newer (this \
                 device is {}) and 16-byte aligned weights",
                self.g.arch
            )));
        }
        if path == MoePath::Gemv && !self.gemv_ok(layer) {
            return Err(BackendError::Config(
                "the GEMV-shaped expert kernels need quantized experts whose gate/up rows start \
                 16-byte aligned"
                    .into(),
            ));
        }
        let pairs = io.n * k;
        let tile = match path {
            MoePath::Dp4a | MoePath::Gemv => TILE,
            MoePath::TensorCore => TC_TILE,
        };
        let grid_y = max_tiles(pairs, e, tile);
        if grid_y > 65535 {
            return Err(BackendError::InvalidBatch(format!(
                "{} tokens in one MoE block (at most {} tiles)",
                io.n, 65535
            )));
        }
        let d = Dims {
            e,
            k,
            inter: c.expert_intermediate_size,
            n: io.n,
            hd: io.hidden,
            pairs,
            path,
            tile,
            grid_y: grid_y as u32,
        };
        let quant = layer.q8_in();
        let x_in = if quant { io.q8 } else { io.h };
        // SAFETY: `io`'s addresses are the caller's (this fn's contract); every other address
        // is `s`'s, grown (checked above) for at least `n` tokens of this model's MoE shape (its
        // tile list for the smaller tile, so for either), or the layer's weights, both alive for
        // the executor's life.
        unsafe {
            self.route(layer, s, io, d)?;
            mark("route")?;
            self.experts(&layer.gate_up, x_in, k, s.gu.ptr, 2 * d.inter, d.hd, s, d)?;
            mark("gate_up")?;
            self.swiglu(quant, s, d)?;
            mark("swiglu")?;
            if self.down_fused(layer, d) {
                self.down_combine(layer, io.x, s, d)?;
                return mark("down+combine");
            }
            self.experts(&layer.down, s.act.ptr, 1, s.y.ptr, d.hd, d.inter, s, d)?;
            mark("down")?;
            self.combine(io.x, s, d)?;
            mark("combine")
        }
    }

    /// Router logits (f32), the top `k` experts of each token, and the counting sort of the
    /// (token, expert) pairs into tiles of one expert (all one launch for few tokens).
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
        let topk_args = [
            P(s.logits.ptr),
            I(d.e as i32),
            I(d.k as i32),
            I(norm_topk),
            I(d.n as i32),
            P(s.ids.ptr),
            P(s.weights.ptr),
        ];
        let sort_out = [
            I(d.tile as i32),
            P(s.sorted.ptr),
            P(s.tiles.ptr),
            P(s.num_tiles.ptr),
        ];
        // SAFETY: as `run` (this fn's contract); the argument lists are moe.cu's.
        unsafe {
            if d.n <= FUSED_ROUTE_MAX_TOKENS && d.hd.is_multiple_of(4) {
                let mut args = vec![P(io.hf), P(layer.router.ptr), I(d.hd as i32)];
                args.extend(topk_args);
                args.extend(sort_out);
                args.push(P(s.done.ptr));
                const WARPS: usize = 8;
                let grid = (d.e.div_ceil(WARPS) as u32, 1, 1);
                return g.launch(&mk.route, grid, (32 * WARPS as u32, 1, 1), &args);
            }
            g.gemm_f32(io.hf, layer.router.ptr, s.logits.ptr, d.n, d.hd, d.e, 0.0)?;
            g.launch(
                &mk.topk,
                (d.n.div_ceil(4) as u32, 1, 1),
                (128, 1, 1),
                &topk_args,
            )?;
            let args: Vec<KArg> = [P(s.ids.ptr), I(d.pairs as i32), I(d.e as i32)]
                .into_iter()
                .chain(sort_out)
                .collect();
            g.launch(&mk.sort, (1, 1, 1), (1024, 1, 1), &args)
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
        let tiles = [P(s.sorted.ptr), P(s.tiles.ptr), P(s.num_tiles.ptr)];
        match w {
            WMat::Quant { dtype, data } => {
                let idx = TYPES.iter().position(|(t, _)| t == dtype).ok_or_else(|| {
                    BackendError::Config(format!("no MoE expert kernel for {dtype:?}"))
                })?;
                let row_bytes = dtype.row_size(cols as u64).ok_or_else(|| {
                    BackendError::Config(format!(
                        "{cols} is not a whole number of {dtype:?} blocks"
                    ))
                })?;
                let expert_bytes = rows * row_bytes as usize;
                let mut args = vec![P(data.ptr), L(expert_bytes as i64), P(a), I(act_div as i32)];
                args.extend(tiles);
                args.extend([P(out), I(rows as i32), I((cols / 32) as i32)]);
                let gemv = d.path == MoePath::Gemv
                    && super::qmat::QuantKernels::mmv_ok(*dtype, cols, data.ptr);
                let (f, grid, block) = match d.path {
                    // One token: its k experts are distinct, so every tile is one pair.
                    MoePath::Gemv if gemv => (
                        &self.mk.mmq[idx][if d.n == 1 { 2 } else { 1 }],
                        (rows.div_ceil(ROWS_PER_CTA) as u32, d.grid_y, 1),
                        (MMV_THREADS, 1, 1),
                    ),
                    MoePath::Dp4a | MoePath::Gemv => (
                        &self.mk.mmq[idx][0],
                        (rows.div_ceil(ROWS_PER_CTA) as u32, d.grid_y, 1),
                        (128, 1, 1),
                    ),
                    MoePath::TensorCore => (
                        &self.mk.mmq[idx][3],
                        (rows.div_ceil(TC_ROWS) as u32, d.grid_y, 1),
                        (TC_THREADS, 1, 1),
                    ),
                };
                // SAFETY: moe_mmq's (and moe_mmq_*_mmv's, moe_mmq_*_tc's) list; the addresses
                // as this fn's contract says; the GEMV-shaped kernel only where every expert's
                // rows start 16-byte aligned (`mmv_ok` of the slab base and the row length: the
                // expert slabs are whole rows).
                unsafe { self.g.launch(f, grid, block, &args) }
            }
            WMat::F16(b) => {
                let grid = (rows.div_ceil(ROWS_PER_CTA) as u32, d.grid_y, 1);
                let mut args = vec![P(b.ptr), P(a), I(act_div as i32)];
                args.extend(tiles);
                args.extend([P(out), I(rows as i32), I(cols as i32)]);
                // SAFETY: moe_gemv_f16's list; the addresses as this fn's contract says.
                unsafe { self.g.launch(&self.mk.gemv_f16, grid, (128, 1, 1), &args) }
            }
        }
    }

    /// Whether the step's down matrix and combine are one launch (`moe_mmq_*_down`): the GEMV
    /// path, at most [`FUSED_DOWN_MAX_TOKENS`] tokens, down rows 16-byte aligned.
    fn down_fused(&self, layer: &MoeLayer, d: Dims) -> bool {
        d.path == MoePath::Gemv
            && d.n <= FUSED_DOWN_MAX_TOKENS
            && layer
                .down
                .quant_type()
                .is_some_and(|t| super::qmat::QuantKernels::mmv_ok(t, d.inter, layer.down.ptr()))
    }

    /// `x[t] += Σ_s weight · down[expert](act[pair])` over each token's `k` pairs in order, one
    /// launch (the down matrix and the combine; see [`Self::down_fused`]).
    ///
    /// # Safety
    ///
    /// As `run`, `x` being `io.x`; [`Self::down_fused`] holds.
    unsafe fn down_combine(
        &self,
        layer: &MoeLayer,
        x: u64,
        s: &MoeScratch,
        d: Dims,
    ) -> Result<(), BackendError> {
        use KArg::{I, L, P};
        let WMat::Quant { dtype, data } = &layer.down else {
            return Err(BackendError::Config(
                "the fused down kernel takes quantized experts".into(),
            ));
        };
        let idx = TYPES
            .iter()
            .position(|(t, _)| t == dtype)
            .ok_or_else(|| BackendError::Config(format!("no MoE expert kernel for {dtype:?}")))?;
        let row_bytes = dtype.row_size(d.inter as u64).ok_or_else(|| {
            BackendError::Config(format!(
                "{} is not a whole number of {dtype:?} blocks",
                d.inter
            ))
        })?;
        let expert_bytes = d.hd * row_bytes as usize;
        let args = [
            P(data.ptr),
            L(expert_bytes as i64),
            P(s.act.ptr),
            P(s.ids.ptr),
            P(s.weights.ptr),
            I(d.k as i32),
            P(x),
            I(d.hd as i32),
            I((d.inter / 32) as i32),
        ];
        let grid = (d.n as u32, d.hd.div_ceil(DOWN_ROWS_PER_CTA) as u32, 1);
        // SAFETY: moe_mmq_*_down's list; `x` is the caller's, the rest `s`'s (sized for the
        // pairs) or the layer's; every expert's down rows start 16-byte aligned (`down_fused`).
        unsafe {
            self.g
                .launch(&self.mk.down[idx], grid, (MMV_THREADS, 1, 1), &args)
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
