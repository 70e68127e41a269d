//! The single-token f16 matrix-vector product (kernels/gemv.cu) that decode steps of one sequence
//! use instead of cuBLAS: cuBLAS's M=1 path reads the smaller matrices well under the copy rate
//! and, on small models, costs more launches than the work they do.

use cudarc::driver::CudaFunction;

use super::gpu::{Gpu, KArg};
use super::nvrtc;
use crate::BackendError;

pub struct Gemv {
    /// 16 rows per CTA (2 per warp), and 8 (1 per warp) for matrices of few rows.
    f: CudaFunction,
    f_r1: CudaFunction,
    sms: usize,
}

impl Gemv {
    pub fn new(gpu: &Gpu) -> Result<Self, BackendError> {
        let m = gpu.module(&nvrtc::GEMV, &[])?;
        Ok(Gemv {
            f: Gpu::function(&m, "gemv_f16")?,
            f_r1: Gpu::function(&m, "gemv_f16_r1")?,
            sms: gpu.sms as usize,
        })
    }

    /// Whether `run` takes a matrix of rows `k_in` long (whole 16-byte chunks).
    pub fn fits(k_in: usize) -> bool {
        k_in > 0 && k_in.is_multiple_of(8)
    }

    /// `y[out] = w[out, k_in] · x[k_in] + beta · y` (w, x f16; y f32; y is not read when beta is 0).
    #[allow(clippy::too_many_arguments)]
    pub fn run(
        &self,
        g: &Gpu,
        w: u64,
        x: u64,
        y: u64,
        k_in: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        if !Self::fits(k_in) {
            return Err(BackendError::InvalidBatch(format!(
                "gemv_f16 needs rows of a multiple of 8 elements (got {k_in})"
            )));
        }
        use KArg::{F, I, P};
        // Fewer than four CTAs of 16 rows per SM: halve the rows per CTA.
        let (f, rows) = if out.div_ceil(16) < 4 * self.sms {
            (&self.f_r1, 8)
        } else {
            (&self.f, 16)
        };
        g.launch(
            f,
            (out.div_ceil(rows) as u32, 1, 1),
            (256, 1, 1),
            &[P(w), P(x), P(y), I(k_in as i32), I(out as i32), F(beta)],
        )
    }
}
