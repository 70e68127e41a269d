//! The CPU backend: always built, the default, and the oracle the other backends are tested
//! against. Quantized weights stay quantized; activations are quantized per block for integer dot
//! products; one rayon pool of `threads` workers.

pub mod attention;
pub mod kquant;
pub mod llama;
pub mod matmul;
pub mod moe;
pub mod ops;
pub mod profile;
pub mod quant;
pub mod rows;
mod step;
pub mod team;

pub use llama::{CpuExecutor, CpuOptions, KvDtype};

/// How the CPU kernels round. `Exact` reproduces llama.cpp's AVX2 arithmetic bit for bit (the
/// default model's greedy text equals llama.cpp's); `Fast` may round differently for speed:
/// decode attention with a polynomial `exp`, f32 accumulators and AVX-512 where present, its
/// keys split across the threads (`attention::fast`). A tiled prompt matmul for it exists
/// (`matmul::fast_gemm`) but is not used yet: see `matmul::matmul_math`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub enum CpuMath {
    #[default]
    Exact,
    Fast,
}

impl CpuMath {
    pub fn as_str(self) -> &'static str {
        match self {
            CpuMath::Exact => "exact",
            CpuMath::Fast => "fast",
        }
    }
}

impl std::str::FromStr for CpuMath {
    type Err = String;
    fn from_str(s: &str) -> Result<Self, String> {
        match s {
            "exact" => Ok(CpuMath::Exact),
            "fast" => Ok(CpuMath::Fast),
            _ => Err(format!("unknown CPU arithmetic {s:?} (exact or fast)")),
        }
    }
}
