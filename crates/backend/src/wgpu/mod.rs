//! The portable GPU backend (cargo feature `wgpu`): Vulkan on Linux, Metal on macOS, DX12 or
//! Vulkan on Windows, through wgpu, with kernels written in WGSL. Dense Llama-family models with
//! f16 (f32 and bf16 converted at load) or Q8_0/Q4_0/Q4_1/Q4_K/Q5_K/Q6_K weights kept as stored, an f16 paged
//! KV cache, and the argmax on the device. Without the feature, the same names exist and say
//! the backend was not built in, so callers need no cfg of their own.

/// Which adapter to run on.
#[derive(Debug, Clone, Default)]
pub struct WgpuOptions {
    /// An adapter's index in [`adapters`]'s list, or a substring of its name (case-insensitive);
    /// `None`: the first discrete GPU, else the first adapter. `WGPU_BACKEND` (e.g. `vulkan`)
    /// narrows the APIs searched.
    pub adapter: Option<String>,
}

#[cfg(feature = "wgpu")]
pub mod attn_prompt;
#[cfg(feature = "wgpu")]
pub mod decode;
#[cfg(feature = "wgpu")]
mod executor;
#[cfg(feature = "wgpu")]
pub mod gemm;
#[cfg(feature = "wgpu")]
pub mod gemv;
#[cfg(feature = "wgpu")]
pub mod gemv_q;
#[cfg(feature = "wgpu")]
pub mod gpu;
#[cfg(feature = "wgpu")]
pub mod kernels;
#[cfg(feature = "wgpu")]
pub mod moe;
#[cfg(feature = "wgpu")]
pub mod probe;
#[cfg(feature = "wgpu")]
mod step;
#[cfg(feature = "wgpu")]
pub mod weights;

#[cfg(feature = "wgpu")]
pub use executor::WgpuExecutor;
#[cfg(feature = "wgpu")]
pub use gpu::AdapterSummary;

/// An adapter as `quire adapters` lists it (the stand-in without the feature).
#[cfg(not(feature = "wgpu"))]
#[derive(Debug, Clone)]
pub struct AdapterSummary {
    pub index: usize,
    pub name: String,
    pub backend: String,
    pub device_type: String,
    pub driver: String,
    pub features: Vec<&'static str>,
    pub max_storage_binding: u64,
}

/// Every adapter this machine offers for compute.
pub fn adapters() -> Result<Vec<AdapterSummary>, crate::BackendError> {
    #[cfg(feature = "wgpu")]
    return Ok(gpu::list_adapters());
    #[cfg(not(feature = "wgpu"))]
    Err(crate::BackendError::NotBuilt("wgpu"))
}

/// A wgpu executor of `w` with a KV cache of `kv`, boxed; without the feature, `NotBuilt`.
pub fn executor(
    w: &crate::ModelWeights,
    kv: crate::KvCacheSpec,
    opts: &WgpuOptions,
) -> Result<Box<dyn crate::Executor>, crate::BackendError> {
    #[cfg(feature = "wgpu")]
    return Ok(Box::new(WgpuExecutor::new(w, kv, opts)?));
    #[cfg(not(feature = "wgpu"))]
    {
        let _ = (w, kv, opts);
        Err(crate::BackendError::NotBuilt("wgpu"))
    }
}
