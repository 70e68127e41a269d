//! The single-token f16 matrix-vector product (kernels/gemv.cu) that decode steps of one sequence
//! use instead of cuBLAS: cuBLAS's M=1 path reads the smaller matrices well under the copy rate
//! and, on small models, costs more launches than the work they do.

use cudarc::driver::CudaFunction;

use super::gpu::{Gpu, KArg};
use super::nvrtc;
use crate::BackendError;

/// Output rows per CTA (gemv.cu's GV_WARPS × GV_RPW).
const ROWS_PER_CTA: usize = 16;

pub struct Gemv {
    f: CudaFunction,
}

impl Gemv {
    pub fn new(gpu: &Gpu) -> Result<Self, BackendError> {
        let m = gpu.module(&nvrtc::GEMV, &[])?;
        Ok(Gemv {
            f: Gpu::function(&m, "gemv_f16")?,
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
        g.launch(
            &self.f,
            (out.div_ceil(ROWS_PER_CTA) as u32, 1, 1),
            (256, 1, 1),
            &[P(w), P(x), P(y), I(k_in as i32), I(out as i32), F(beta)],
        )
    }
}
