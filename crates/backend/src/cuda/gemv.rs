//! The single-token f16 matrix-vector product (kernels/gemv.cu) that decode steps of one sequence
//! use instead of cuBLAS: cuBLAS's M=1 path reads the smaller matrices well under the copy rate
//! and, on small models, costs more launches than the work they do. The GEMV can also take its
//! input as the RMSNorm of the residual row or the SwiGLU of the gate/up row, computing it itself,
//! which removes those launches from a decode step.

use cudarc::driver::CudaFunction;

use super::gpu::{Gpu, KArg};
use super::nvrtc;
use crate::BackendError;

/// Where the GEMV's input vector comes from.
#[derive(Debug, Clone, Copy)]
pub enum GemvInput {
    /// `x`: f16 `[k]`.
    F16 { x: u64 },
    /// RMSNorm of the f32 row `x[rows_idx[0]]` (`rows_idx` 0: row 0) with weight `norm_w`.
    Norm {
        x: u64,
        rows_idx: u64,
        norm_w: u64,
        eps: f32,
    },
    /// SwiGLU of the f32 gate/up row `gu` `[2k]`: silu(gate) · up.
    SwiGlu { gu: u64 },
}

/// Longest input the fused forms take. Every CTA computes the vector itself, so its L2 reads grow
/// with the input and the CTA count. Measured on the H100 (tg128, every input fused against this
/// bound): the 1B model's 2048/8192 inputs gain 4.6% fused, the 8B model's 4096/14336 lose 7.5%
/// (its 14336-long SwiGLU input is read by 512 CTAs: 59 MB of L2 reads beside 117 MB of weights).
const MAX_FUSED_K: usize = 8192;

/// Shortest rows that take the EARLY forms. Measured on the H100 (tg128 after pp512, alternating
/// in one call): 1B (rows of 2,048 and 8,192) 993.4 / 997.9 → 1,016.6 / 1,019.0, 8B (4,096 and
/// 14,336) 185.2 / 185.7 → 187.7 / 188.4, but the 135M model (576 and 1,536) 2,634 / 2,622 →
/// 2,577 / 2,585, so its short rows keep the plain forms.
const EARLY_MIN_K: usize = 2048;

/// Longest rows the host-output form takes on a persistent grid (`gemv_host_rounds`): one 2 × 4
/// batch, 32 lanes × 4 chunks × 8 elements. The 135M model's 576-long output rows: tg128 after
/// pp512 +0.6% on the H100 (2,514.6 against 2,499.1, three alternating pairs).
const HOST_ROUNDS_MAX_K: usize = 32 * 4 * 8;

/// Rows of at least this many elements take one row per warp with 8 chunks in flight (a warp's
/// row is several batches); see `Gemv::shape_for`.
const LONG_ROWS_K: usize = 8192;

/// The compiled shapes (rows per warp, chunks per row in flight), gemv.cu's `GEMV_SHAPES`: 1 × 8
/// for long rows and short matrices, 2 × 4 otherwise (`Gemv::shape_for` says why).
pub const SHAPES: [(usize, usize); 2] = [(1, 8), (2, 4)];

/// Index of 1 × 8 and 2 × 4 in `SHAPES`.
const R1U8: usize = 0;
const R2U4: usize = 1;

pub struct Gemv {
    /// [input form][shape of `SHAPES`]
    f: [[CudaFunction; 2]; 3],
    /// The GLU forms (2 × 4), [f16 input, RMSNorm input]: gate/up with the SwiGLU on the way out.
    glu_f: [CudaFunction; 2],
    /// The host-output forms (RMSNorm input) of shapes 1 × 8 and 2 × 4: a one-row step's
    /// logits straight into page-locked host memory.
    host_f: [CudaFunction; 2],
    /// The host-output form for rows of one batch (≤ `HOST_ROUNDS_MAX_K` elements) on a
    /// persistent grid of `host_rounds_grid` CTAs (gemv.cu's `gemv_host_rounds`).
    host_rounds_f: CudaFunction,
    host_rounds_grid: usize,
    /// Whether `run_host` takes `host_rounds_f` for short rows (true; tests turn it off to check
    /// the plain host forms at those lengths).
    pub host_rounds: bool,
    /// CTAs of a 1 × 8 grid that fit the GPU at once: matrices whose rows fit one 1 × 8 batch
    /// (k ≤ 2048) and whose 1 × 8 grid fits one wave take 1 × 8, so every weight load is issued
    /// before the wait. Only the 1B model's o projection is such a matrix: 5.09 → 4.06 µs, tg128
    /// +0.9% on the H100 (987.8 against 979.1).
    wave_1x8: usize,
    sms: usize,
    /// The EARLY forms (gemv.cu: the norm weight and the residual rows read before the wait),
    /// [input form][1 × 8, 2 × 4], the GLU forms and the host forms; used for rows of at least
    /// `early_min_k` elements.
    early_f: [[CudaFunction; 2]; 3],
    early_glu: [CudaFunction; 2],
    early_host: [CudaFunction; 2],
    /// `EARLY_MIN_K`; tests set 0 (always) or `usize::MAX` (never) to compare the two forms.
    pub early_min_k: usize,
}

impl Gemv {
    pub fn new(gpu: &Gpu) -> Result<Self, BackendError> {
        let m = gpu.module(&nvrtc::GEMV, &[])?;
        let pair = |a: &str, b: &str| -> Result<[CudaFunction; 2], BackendError> {
            Ok([Gpu::function(&m, a)?, Gpu::function(&m, b)?])
        };
        let shapes = |name: &str| pair(&format!("{name}_r1u8"), &format!("{name}_r2u4"));
        let f = [
            shapes("gemv_f16")?,
            shapes("gemv_f16_norm")?,
            shapes("gemv_f16_swiglu")?,
        ];
        let host_rounds_f = Gpu::function(&m, "gemv_f16_norm_host_rounds_r2u4")?;
        // CTAs of 256 threads resident per SM.
        let per_sm = |f: &CudaFunction| -> Result<usize, BackendError> {
            Ok(
                f.occupancy_max_active_blocks_per_multiprocessor(256, 0, None)
                    .map_err(|e| BackendError::Cuda(format!("gemv occupancy: {e}")))?
                    .max(1) as usize,
            )
        };
        let sms = gpu.sms as usize;
        Ok(Gemv {
            wave_1x8: per_sm(&f[0][R1U8])? * sms,
            host_rounds_grid: per_sm(&host_rounds_f)? * sms,
            host_rounds_f,
            host_rounds: true,
            f,
            glu_f: pair("gemv_f16_glu_r2u4", "gemv_f16_norm_glu_r2u4")?,
            host_f: pair("gemv_f16_norm_host_r1u8", "gemv_f16_norm_host_r2u4")?,
            early_f: [
                pair("gemv_f16_r1u8_e", "gemv_f16_r2u4_e")?,
                pair("gemv_f16_norm_r1u8_e", "gemv_f16_norm_r2u4_e")?,
                pair("gemv_f16_swiglu_r1u8_e", "gemv_f16_swiglu_r2u4_e")?,
            ],
            early_glu: pair("gemv_f16_glu_r2u4_e", "gemv_f16_norm_glu_r2u4_e")?,
            early_host: pair("gemv_f16_norm_host_r1u8_e", "gemv_f16_norm_host_r2u4_e")?,
            early_min_k: EARLY_MIN_K,
            sms,
        })
    }

    /// Whether `run` takes a matrix of rows `k_in` long with this input form (whole 16-byte
    /// chunks; the fused forms up to `MAX_FUSED_K`).
    pub fn fits(&self, k_in: usize, input: &GemvInput) -> bool {
        k_in > 0
            && k_in.is_multiple_of(8)
            && (matches!(input, GemvInput::F16 { .. }) || k_in <= MAX_FUSED_K)
    }

    /// The input form's index (`f`'s first axis), its kernel arguments (x, rows_idx, norm_w, eps)
    /// and the dynamic shared memory it needs, once `fits` holds; `name` for the error.
    fn input_args(
        &self,
        input: GemvInput,
        k_in: usize,
        name: &str,
    ) -> Result<(usize, u64, u64, u64, f32, usize), BackendError> {
        if !self.fits(k_in, &input) {
            return Err(BackendError::InvalidBatch(format!(
                "{name} needs rows of a multiple of 8 elements, at most {MAX_FUSED_K} when fused (got {k_in})"
            )));
        }
        Ok(match input {
            GemvInput::F16 { x } => (0, x, 0, 0, 0.0, 0),
            GemvInput::Norm {
                x,
                rows_idx,
                norm_w,
                eps,
            } => (1, x, rows_idx, norm_w, eps, k_in * 2),
            GemvInput::SwiGlu { gu } => (2, gu, 0, 0, 0.0, k_in * 2),
        })
    }

    /// The gate/up projection with the SwiGLU applied on the way out: `w` `[2 * inter, k_in]`
    /// (gate rows, then up rows), `act[i] = silu(gate_i) · up_i` as f16 `[inter]`, one gate row
    /// and its up row per warp (gemv.cu's GLU form). Input forms as `run`; not the SwiGLU one.
    ///
    /// # Safety
    ///
    /// As `run`, with `act` holding `inter` f16 values and `w` `2 · inter` rows.
    pub unsafe fn run_glu(
        &self,
        g: &Gpu,
        w: u64,
        input: GemvInput,
        act: u64,
        k_in: usize,
        inter: usize,
    ) -> Result<(), BackendError> {
        if matches!(input, GemvInput::SwiGlu { .. }) {
            return Err(BackendError::InvalidBatch(
                "the GLU GEMV takes an f16 or RMSNorm input".into(),
            ));
        }
        let (form, x, rows_idx, norm_w, eps, smem) =
            self.input_args(input, k_in, "gemv_f16_glu")?;
        let args = [w, x, rows_idx, norm_w, act];
        let (f, smem) = match self.early_smem(form, k_in, smem) {
            Some(smem) => (&self.early_glu[form], smem),
            None => (&self.glu_f[form], smem),
        };
        // One (gate, up) pair per warp, eight warps per CTA.
        // SAFETY: the addresses are the caller's (this fn's contract); the shapes are checked.
        unsafe { launch_gemv(g, f, inter.div_ceil(8), smem, args, k_in, inter, eps, 0.0) }
    }

    /// `y[out] = w[out, k_in] · input + beta · y` (w f16; y f32, not read when beta is 0).
    /// With rows of `early_min_k` or more, y is read before the kernel launched just before this
    /// one has finished (the EARLY forms): that kernel must not write y. In a decode step it never
    /// does (y is the residual row: o follows attention, down follows gate/up).
    ///
    /// # Safety
    ///
    /// `w` (`[out, k_in]` f16), `y` (`out` f32) and the input's addresses (`x`: `k_in` f16, the
    /// norm's row and `k_in` f16 weights, `rows_idx` one int or null, `gu` `2 · k_in` f32) are
    /// live device allocations on `g`'s context, not freed before the stream has finished the
    /// kernel; `y` overlaps no input.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn run(
        &self,
        g: &Gpu,
        w: u64,
        input: GemvInput,
        y: u64,
        k_in: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        let (form, x, rows_idx, norm_w, eps, smem) = self.input_args(input, k_in, "gemv_f16")?;
        let variant = self.shape_for(k_in, out);
        // One row group per warp, eight warps per CTA.
        let grid = out.div_ceil(SHAPES[variant].0 * 8);
        let args = [w, x, rows_idx, norm_w, y];
        let (f, smem) = match self.early_smem(form, k_in, smem) {
            Some(smem) => (&self.early_f[form][variant], smem),
            None => (&self.f[form][variant], smem),
        };
        // SAFETY: the addresses are the caller's (this fn's contract); the shapes are checked.
        unsafe { launch_gemv(g, f, grid, smem, args, k_in, out, eps, beta) }
    }

    /// `y[out] = w[out, k_in] · RMSNorm(x)` with `y` the device address of page-locked host
    /// memory (`HostBuf::mapped`): each CTA's rows leave in one store (gemv.cu's HOST form). Rows
    /// of one batch go on a persistent grid; longer ones take `run`'s shape.
    ///
    /// # Safety
    ///
    /// As `run`, `y` being the device address of mapped host memory of `out` f32.
    pub unsafe fn run_host(
        &self,
        g: &Gpu,
        w: u64,
        input: GemvInput,
        y: u64,
        k_in: usize,
        out: usize,
    ) -> Result<(), BackendError> {
        let (form, x, rows_idx, norm_w, eps, smem) =
            self.input_args(input, k_in, "gemv_f16_norm_host")?;
        if form != 1 {
            return Err(BackendError::InvalidBatch(
                "the host-output GEMV takes an RMSNorm input".into(),
            ));
        }
        let (f, grid, smem) = if self.host_rounds && k_in <= HOST_ROUNDS_MAX_K {
            let grid = self.host_rounds_grid.min(out.div_ceil(16));
            (&self.host_rounds_f, grid, smem)
        } else {
            let variant = self.shape_for(k_in, out);
            let grid = out.div_ceil(SHAPES[variant].0 * 8);
            match self.early_smem(form, k_in, smem) {
                Some(smem) => (&self.early_host[variant], grid, smem),
                None => (&self.host_f[variant], grid, smem),
            }
        };
        let args = [w, x, rows_idx, norm_w, y];
        // SAFETY: the addresses are the caller's (this fn's contract); the shapes are checked.
        unsafe { launch_gemv(g, f, grid, smem, args, k_in, out, eps, 0.0) }
    }

    /// The dynamic shared memory of the EARLY form of input `form` with rows `k_in` long (its
    /// plain form taking `smem`), or `None` when it is off or the norm weight does not fit
    /// beside the input vector (inputs over 6,826 elements: 48 KB in all).
    fn early_smem(&self, form: usize, k_in: usize, smem: usize) -> Option<usize> {
        match form {
            _ if k_in < self.early_min_k => None,
            1 if smem + k_in * 4 <= 40 << 10 => Some(smem + k_in * 4),
            1 => None,
            _ => Some(smem),
        }
    }

    /// The shape (index into `SHAPES`) for a matrix `[out, k_in]`.
    ///
    /// Long rows (k ≥ 8192), and 8 KB rows of a matrix with many rows (the 8B model's output
    /// projection): one row per warp, 8 chunks in flight (a warp's row is several batches);
    /// otherwise two rows per warp, 4 chunks each. Measured end to end on the H100 against every
    /// shape once compiled (1 × 8, 2 × 4, 1 × 16, 2 × 8, 4 × 4, 4 × 2, 2 × 2): 135M 2,086 tok/s
    /// (1,931 by row count), 1B 929 (875), 8B 178.3 (176.9); per kernel, the 8B model's q/k/v
    /// and o matrices (k 4096) take 20.05 and 13.75 µs at 2 × 4 against 20.36 and 14.02 at 1 × 8,
    /// its 14336-long down rows 40.2 at 1 × 8 against 46.3.
    /// Rows of one 1 × 8 batch whose grid fits one wave (`wave_1x8`), and short rows of a matrix
    /// of few rows (the 135M model's per-layer matrices: k 576 and 1536): also 1 × 8, a warp's
    /// whole row in one batch issued before the wait; 135M tg128 2,427 / 2,486 against 2,375 /
    /// 2,368 at 2 × 4. The 1B model's 4 KB rows lose at 1 × 8 (938 against 969): 2 × 4.
    fn shape_for(&self, k_in: usize, out: usize) -> usize {
        let few_rows = out.div_ceil(16) < 4 * self.sms;
        let long_rows = k_in >= LONG_ROWS_K || (k_in >= LONG_ROWS_K / 2 && out >= 65536);
        let one_wave = k_in <= 2048 && out.div_ceil(8) <= self.wave_1x8;
        if long_rows || one_wave || (k_in < 2048 && few_rows) {
            R1U8
        } else {
            R2U4
        }
    }
}

/// One launch of a gemv.cu entry point (they share one argument list): `args` are the weight,
/// input, rows_idx, norm weight and output pointers.
///
/// # Safety
///
/// As `Gemv::run` for the addresses in `args`.
#[allow(clippy::too_many_arguments)]
unsafe fn launch_gemv(
    g: &Gpu,
    f: &CudaFunction,
    grid: usize,
    smem: usize,
    args: [u64; 5],
    k_in: usize,
    out: usize,
    eps: f32,
    beta: f32,
) -> Result<(), BackendError> {
    use KArg::{F, I, P};
    let [w, x, rows_idx, norm_w, y] = args;
    // SAFETY: the argument list is gemv.cu's shared one; the addresses are the caller's.
    unsafe {
        g.launch_smem(
            f,
            (grid as u32, 1, 1),
            (256, 1, 1),
            smem as u32,
            &[
                P(w),
                P(x),
                P(rows_idx),
                P(norm_w),
                F(eps),
                P(y),
                I(k_in as i32),
                I(out as i32),
                F(beta),
            ],
        )
    }
}
