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
