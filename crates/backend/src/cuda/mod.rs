//! The CUDA backend (cargo feature `cuda`): f16 weights with cuBLAS GEMMs, hand-written kernels in
//! `kernels/*.cu` compiled by NVRTC at first use, paged attention with the KV write fused in.
//! Libraries are loaded at run time, so the crate builds without CUDA; without the feature,
//! `CudaExecutor::new` says the backend was not built in.
//!
//! Kernel launches take raw device addresses, so the functions that launch with addresses a
//! caller passes are `unsafe fn`s; every unsafe operation inside them still sits in its own
//! `unsafe` block with the reason it holds.
#![deny(unsafe_op_in_unsafe_fn)]

mod env;
pub use env::{non_default_env, CudaEnv};

#[derive(Debug, Clone, Copy)]
pub struct CudaOptions {
    /// CUDA device ordinal.
    pub device: usize,
    /// Fraction of the device memory free before loading that weights, activations and the KV
    /// cache may take (when `num_blocks` is not given).
    pub gpu_memory_utilization: f32,
    /// Fixed number of KV-cache blocks, or `None` to size the pool from free memory.
    pub num_blocks: Option<usize>,
    pub block_size: usize,
    /// Run decode steps through CUDA graphs (one per batch-size bucket). `QUIRE_CUDA_GRAPHS=0`
    /// turns the default off (`CudaEnv`).
    pub graphs: bool,
    /// One-token f16 matmuls through quire's GEMV kernel rather than cuBLAS. `QUIRE_CUDA_GEMV=0`
    /// turns the default off (`CudaEnv`).
    pub gemv: bool,
    /// Keep Q4_0/Q4_1/Q8_0/Q4_K/Q5_K/Q6_K weights as stored and multiply them with 8-bit
    /// activations (the CPU backend's numerics, fewer bytes per step); `false` dequantizes every
    /// weight to f16 for cuBLAS. MoE experts stay stored only in the 32-element types.
    pub quantized_weights: bool,
    /// With `quantized_weights`: matmuls of at least this many tokens (prefill) dequantize the
    /// weight to f16 and use cuBLAS instead of the 8-bit kernels (the activations are then not
    /// quantized). `usize::MAX` keeps every matmul on the 8-bit path. The default, 256, sits
    /// between the crossing points `cuda_matmul_bench --only many` measured on an H100 (8B
    /// shapes, Q4_0/Q4_K/Q6_K/Q8_0): at 128 tokens the int8 tensor-core kernel, which reads the
    /// stored weights once, beats dequantize + cuBLAS on every shape (e.g. Q4_K 14336×4096:
    /// 233 µs against 334), at 512 cuBLAS wins (636 against 374).
    pub dequant_gemm_tokens: usize,
    /// The most tokens a step holds (the engine's `max_num_batched_tokens`): activations for that
    /// many are allocated at load, before the KV pool is sized from the free memory.
    pub max_num_batched_tokens: usize,
}

impl Default for CudaOptions {
    fn default() -> Self {
        Self {
            device: 0,
            gpu_memory_utilization: 0.9,
            num_blocks: None,
            block_size: 16,
            graphs: CudaEnv::get().graphs,
            gemv: CudaEnv::get().gemv,
            quantized_weights: true,
            dequant_gemm_tokens: 256,
            max_num_batched_tokens: 512,
        }
    }
}

#[cfg(feature = "cuda")]
pub mod attention;
#[cfg(feature = "cuda")]
mod chain;
#[cfg(feature = "cuda")]
mod forward;
#[cfg(feature = "cuda")]
pub mod gemv;
#[cfg(feature = "cuda")]
pub mod gpu;
#[cfg(feature = "cuda")]
mod llama;
#[cfg(feature = "cuda")]
mod load;
#[cfg(feature = "cuda")]
mod meta;
#[cfg(feature = "cuda")]
pub mod moe;
#[cfg(feature = "cuda")]
pub mod nccl;
#[cfg(feature = "cuda")]
pub mod nvrtc;
#[cfg(feature = "cuda")]
mod profile;
#[cfg(feature = "cuda")]
pub mod qmat;
#[cfg(feature = "cuda")]
pub mod sample;
#[cfg(feature = "cuda")]
mod scratch;
#[cfg(feature = "cuda")]
pub mod tp;
#[cfg(feature = "cuda")]
pub mod trace;

#[cfg(feature = "cuda")]
pub use llama::CudaExecutor;
#[cfg(feature = "cuda")]
pub use tp::{device_count, tp_group};

/// Stand-in when the backend is not compiled in.
#[cfg(not(feature = "cuda"))]
pub fn tp_group(
    _w: &crate::ModelWeights,
    _opts: CudaOptions,
    _size: usize,
) -> Result<Box<dyn crate::Executor>, crate::BackendError> {
    Err(crate::BackendError::NotBuilt("cuda"))
}

/// Stand-in when the backend is not compiled in: construction fails with a clear message.
#[cfg(not(feature = "cuda"))]
pub struct CudaExecutor;

#[cfg(not(feature = "cuda"))]
impl CudaExecutor {
    // Boxed: callers hold executors as `Box<dyn Executor>`, and the stand-in has nothing else to return.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(
        _w: &crate::ModelWeights,
        _opts: CudaOptions,
    ) -> Result<Box<dyn crate::Executor>, crate::BackendError> {
        Err(crate::BackendError::NotBuilt("cuda"))
    }
}
