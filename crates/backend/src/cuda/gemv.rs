//! The f16 weight × few-token products of decode steps (`kernels/gemv.cu`): up to
//! [`MAX_TOKENS`] rows through a hand-written kernel built to stream the weights near the copy
//! ceiling (cuBLAS reaches 55-90% of it on these shapes; `examples/cuda_matmul_bench.rs` times
//! both). Larger batches, shapes the kernel does not take (`k % 8 != 0`, unaligned buffers) and
//! devices before sm_80 (no m16n8k16 mma) keep cuBLAS.
//! `QUIRE_CUDA_GEMV=0` turns the kernel off (A/B timing).
//!
//! The launch is one kernel with pointer arguments (no allocation, no host sync), so it records
//! into CUDA graphs like the rest of a step.

use cudarc::driver::CudaFunction;

use super::gpu::{cuda_err, Gpu, KArg};
use super::nvrtc;
use crate::BackendError;

/// Most tokens one launch takes (the mma's N).
pub const MAX_TOKENS: usize = 8;
/// Output rows per CTA (`GEMV_ROWS`).
const ROWS: usize = 16;
/// k per warp per chunk (`GEMV_CHUNK`).
const CHUNK: usize = 128;
/// Most warps per CTA (`GEMV_MAX_WARPS`).
pub const MAX_WARPS: u32 = 16;
/// The warp counts [`Gemv::warps_for`] picks from.
const WARP_CHOICES: [usize; 3] = [4, 8, 16];

pub struct Gemv {
    f: CudaFunction,
    sms: usize,
    /// CTAs of 4, 8 and 16 warps that fit on one SM at once.
    resident: [usize; 3],
}

impl Gemv {
    /// Compiles the kernel for `gpu` (which must be sm_80 or newer).
    pub fn new(gpu: &Gpu) -> Result<Self, BackendError> {
        let m = gpu.module(&nvrtc::GEMV, &[])?;
        let f = Gpu::function(&m, "gemv_f16")?;
        let mut resident = [1; 3];
        for (r, w) in resident.iter_mut().zip(WARP_CHOICES) {
            let ctas = f
                .occupancy_max_active_blocks_per_multiprocessor(32 * w as u32, 0, None)
                .map_err(cuda_err("GEMV occupancy"))?;
            *r = (ctas as usize).max(1);
        }
        Ok(Self {
            f,
            sms: gpu.sms.max(1) as usize,
            resident,
        })
    }

    /// The kernel for the forward pass: `None` (cuBLAS for every f16 matmul) when
    /// `QUIRE_CUDA_GEMV=0` or the device predates sm_80.
    pub fn for_device(gpu: &Gpu) -> Result<Option<Self>, BackendError> {
        let off = std::env::var("QUIRE_CUDA_GEMV").is_ok_and(|v| v == "0");
        let sm: u32 = gpu.arch.trim_start_matches("sm_").parse().unwrap_or(0);
        if off || sm < 80 {
            return Ok(None);
        }
        Self::new(gpu).map(Some)
    }

    /// Whether the kernel takes `n` tokens of length `k` at these addresses: 1..=8 tokens,
    /// `k % 8 == 0`, `w` and `x` 16-byte aligned, at least one output.
    pub fn supports(n: usize, k: usize, out: usize, x: u64, w: u64) -> bool {
        (1..=MAX_TOKENS).contains(&n)
            && k > 0
            && k.is_multiple_of(8)
            && k <= i32::MAX as usize
            && (1..=i32::MAX as usize).contains(&out)
            && x.is_multiple_of(16)
            && w.is_multiple_of(16)
    }

    /// Warps per CTA for a `[out, k]` weight: see [`choose_warps`].
    pub fn warps_for(&self, k: usize, out: usize) -> u32 {
        choose_warps(k, out, self.sms, self.resident)
    }

    /// `y[n, out] (f32) = x[n, k] (f16) · w[out, k]ᵀ (f16) + beta · y`, f32 accumulation; `beta` 0
    /// never reads `y`. Fails when [`Gemv::supports`] does not hold.
    #[allow(clippy::too_many_arguments)]
    pub fn matmul(
        &self,
        gpu: &Gpu,
        x: u64,
        w: u64,
        y: u64,
        n: usize,
        k: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        let warps = self.warps_for(k, out);
        self.matmul_with(gpu, warps, x, w, y, n, k, out, beta)
    }

    /// [`Gemv::matmul`] with `warps` (1..=16) warps per CTA splitting k (for tests and tuning).
    #[allow(clippy::too_many_arguments)]
    pub fn matmul_with(
        &self,
        gpu: &Gpu,
        warps: u32,
        x: u64,
        w: u64,
        y: u64,
        n: usize,
        k: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        if !Self::supports(n, k, out, x, w) || !(1..=MAX_WARPS).contains(&warps) {
            return Err(BackendError::InvalidBatch(format!(
                "f16 GEMV of {n} tokens, k {k}, out {out}, {warps} warps (x at {x:#x}, w at {w:#x}): \
                 needs 1..=8 tokens, k % 8 == 0, 16-byte aligned x and w, 1..=16 warps"
            )));
        }
        use KArg::{F, I, P};
        gpu.launch(
            &self.f,
            (out.div_ceil(ROWS) as u32, 1, 1),
            (32 * warps, 1, 1),
            &[
                P(w),
                P(x),
                P(y),
                I(out as i32),
                I(k as i32),
                I(n as i32),
                F(beta),
            ],
        )
    }
}

/// Warps per CTA (the split of k) for a `[out, k]` weight on `sms` SMs that hold `resident` CTAs
/// of 4, 8 and 16 warps each: the most warps that still run every CTA in one wave (more warps,
/// more loads in flight, until CTAs would wait for a second wave), at least 4, never more than
/// k has chunks of 128.
pub fn choose_warps(k: usize, out: usize, sms: usize, resident: [usize; 3]) -> u32 {
    let tiles = out.div_ceil(ROWS);
    let chunks = k.div_ceil(CHUNK).max(1);
    let mut warps = WARP_CHOICES[0];
    for (&w, &r) in WARP_CHOICES.iter().zip(&resident).skip(1) {
        if w > chunks || tiles > sms * r {
            break;
        }
        warps = w;
    }
    warps.min(chunks) as u32
}

/// `y[n, out] = x[n, k] · w[out, k]ᵀ + beta · y` for f16 `x` and `w`: the GEMV kernel when it is
/// loaded and takes the shape, cuBLAS otherwise.
#[allow(clippy::too_many_arguments)]
pub(super) fn matmul_f16(
    g: &Gpu,
    gemv: Option<&Gemv>,
    x: u64,
    w: u64,
    y: u64,
    n: usize,
    k: usize,
    out: usize,
    beta: f32,
) -> Result<(), BackendError> {
    match gemv {
        Some(v) if Gemv::supports(n, k, out, x, w) => v.matmul(g, x, w, y, n, k, out, beta),
        _ => g.gemm_f16(x, w, y, n, k, out, beta),
    }
}
