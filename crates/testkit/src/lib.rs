//! Test support shared by quire's test suites, so that every backend is held to the same tests
//! and no test passes silently where its hardware is missing.
//!
//! - **One test body per executor.** [`executor_test!`] expands one body, written against a
//!   [`Backend`], into one test per backend built into quire: `NAME::cpu`, `NAME::cuda` and
//!   `NAME::wgpu`. The CPU backend is the oracle other backends are compared with. A new backend
//!   plugs in with one [`Backend`] variant, its entry in [`BACKENDS`] and one line in
//!   [`executor_test!`].
//! - **No silent passes.** libtest cannot skip a test at run time, so whether a hardware-bound
//!   test runs is decided when it is compiled. This crate's build script reads
//!   `QUIRE_REQUIRE_GPU` and `QUIRE_REQUIRE_SIMD` (and the build machine's CPU) and picks one of
//!   two forms of the marking macros: [`gpu_test!`] (and the CUDA half of [`executor_test!`])
//!   marks its test `#[ignore = "needs a CUDA GPU: …"]` unless `QUIRE_REQUIRE_GPU` is set;
//!   [`simd_test!`] marks its test ignored unless the build machine has AVX2, FMA and F16C (or
//!   `QUIRE_REQUIRE_SIMD` is set). `cargo test` then lists them as *ignored*, with the reason.
//!   A marked test that does run (`QUIRE_REQUIRE_GPU=1` at build time, or `--include-ignored`)
//!   and lacks its hardware, or was built without the `cuda` feature, **fails** with a message
//!   saying what is missing. The macros expand in the test crate, but the choice of form is made
//!   here, so test crates need no build script or cfg of their own.
//! - **One error metric**, the relative L2 error ([`metric::rel_l2`]):
//!   `‖got − want‖₂ / ‖want‖₂`, summed in f64 over all compared elements; a non-finite `got`
//!   fails the test (outputs are poisoned with NaN first, so an unwritten element shows). The
//!   per-op bounds are the named constants of [`metric`], each with its reason.
//! - **One temporary folder** ([`TempDir`]) for tests that write files, removed on drop.
//! - **One random paged batch generator** ([`paged::PagedCase`]): seeded, random non-contiguous
//!   block tables, lengths chosen by the caller (odd ones by the tests), every cache slot that
//!   holds no key or value poisoned with NaN.
//!
//! The wgpu backend's tests ([`wgpu_test!`], and the wgpu half of [`executor_test!`]) follow the
//! same rule with `QUIRE_REQUIRE_WGPU` and the `wgpu` feature: any Vulkan, Metal or DX12 adapter
//! runs them (CI: lavapipe, Mesa's CPU Vulkan driver, with `WGPU_BACKEND=vulkan`), e.g.
//! `QUIRE_REQUIRE_WGPU=1 cargo test -p quire-backend -p quire-engine --features wgpu`.
//!
//! On the GPU machine: build and run with `QUIRE_REQUIRE_GPU=1` set (it must be set when the
//! test binaries are compiled: cargo rebuilds this crate and the test crates when it changes),
//! and `--features cuda`, e.g.
//! `QUIRE_REQUIRE_GPU=1 cargo test --release -p quire-backend -p quire-engine --features cuda`.
//! `-- --include-ignored` also runs the slow tests ignored for time. On a machine with several
//! GPUs, `QUIRE_TEST_TENSOR_PARALLEL=2` runs every CUDA executor of the suites as a
//! tensor-parallel group of 2 GPUs; a model whose heads the group cannot split runs padded with
//! zero heads ([`heads`]).

pub mod heads;
pub mod metric;
pub mod paged;
pub mod random;
mod tempdir;

pub use tempdir::TempDir;

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::cuda::{CudaExecutor, CudaOptions};
use quire_backend::wgpu::WgpuOptions;
use quire_backend::{Executor, KvCacheSpec, ModelWeights};

/// The reason a GPU test is ignored: shown by `cargo test` beside the test's name.
pub const GPU_IGNORE_REASON: &str =
    "needs a CUDA GPU: run tests/device/check.sh, or set QUIRE_REQUIRE_GPU=1";

/// The reason a wgpu test is ignored.
pub const WGPU_IGNORE_REASON: &str =
    "needs a wgpu adapter (Vulkan/Metal/DX12) and --features wgpu: set QUIRE_REQUIRE_WGPU=1";

/// A backend an [`executor_test!`] body runs on.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Backend {
    /// The CPU backend: always built, the oracle.
    Cpu,
    /// The CUDA backend: needs the `cuda` feature and a GPU.
    Cuda,
    /// The wgpu backend: needs the `wgpu` feature and an adapter (lavapipe will do).
    Wgpu,
}

/// Every backend, in the order the generated tests are named. A test body may loop over it (e.g.
/// to compare with the oracle); the macros generate one test per entry.
pub const BACKENDS: [Backend; 3] = [Backend::Cpu, Backend::Cuda, Backend::Wgpu];

impl Backend {
    pub fn name(self) -> &'static str {
        match self {
            Backend::Cpu => "cpu",
            Backend::Cuda => "cuda",
            Backend::Wgpu => "wgpu",
        }
    }

    /// True for the CPU backend, against which the others are compared. The oracle gives
    /// identical tokens whatever the batch (its kernels do not depend on the batch's shape);
    /// other backends choose kernels by batch shape and sum in other orders, so their greedy
    /// paths may part at near-ties, which tests then bound.
    pub fn is_oracle(self) -> bool {
        self == Backend::Cpu
    }

    /// A fresh executor of `w` with this backend's default options and a KV cache of `kv`.
    /// Fails the test, saying what is missing, when the backend cannot run here.
    pub fn executor(self, w: &ModelWeights, kv: KvCacheSpec) -> Box<dyn Executor> {
        match self {
            Backend::Cpu => self.ok(CpuExecutor::new(w, kv, CpuOptions::default())
                .map(|e| Box::new(e) as Box<dyn Executor>)),
            Backend::Cuda => self.cuda(w, kv, CudaOptions::default()),
            Backend::Wgpu => self.ok(quire_backend::wgpu::executor(
                w,
                kv,
                &WgpuOptions {
                    adapter: std::env::var("QUIRE_WGPU_ADAPTER").ok(),
                },
            )),
        }
    }

    /// A CUDA executor with `opts` (its block size and number of blocks taken from `kv`).
    pub fn cuda(self, w: &ModelWeights, kv: KvCacheSpec, opts: CudaOptions) -> Box<dyn Executor> {
        let opts = CudaOptions {
            num_blocks: Some(kv.num_blocks),
            block_size: kv.block_size,
            ..opts
        };
        match test_tensor_parallel_size() {
            // A model whose heads the group cannot split (the default model's 9 over 3 KV
            // heads) runs padded with zero heads, which compute the same function
            // ([`heads::pad_heads_for`]); one it still cannot split is the test setup's fault,
            // not a missing GPU: say so.
            n if n > 1 => {
                let padded = heads::pad_heads_for(w, n)
                    .unwrap_or_else(|e| panic!("QUIRE_TEST_TENSOR_PARALLEL={n}: {e}"));
                quire_backend::cuda::tp_group(padded.as_ref().unwrap_or(w), opts, n)
                    .unwrap_or_else(|e| panic!("QUIRE_TEST_TENSOR_PARALLEL={n}: {e}"))
            }
            _ => self.ok(CudaExecutor::new(w, opts)),
        }
    }

    fn ok(self, r: Result<Box<dyn Executor>, quire_backend::BackendError>) -> Box<dyn Executor> {
        r.unwrap_or_else(|e| missing(self, &e))
    }
}

/// `QUIRE_TEST_TENSOR_PARALLEL=N` (N > 1) makes every CUDA executor of the suites a group of N
/// GPUs (`--tensor-parallel-size N`), so that a whole suite (e.g. `batching`) runs sharded on a
/// multi-GPU machine; unset or 1, one GPU. A value that is not a number fails the test.
fn test_tensor_parallel_size() -> usize {
    match std::env::var("QUIRE_TEST_TENSOR_PARALLEL") {
        Ok(v) => v
            .trim()
            .parse()
            .unwrap_or_else(|_| panic!("QUIRE_TEST_TENSOR_PARALLEL={v:?}: want a number of GPUs")),
        Err(_) => 1,
    }
}

/// Fails a test whose backend cannot run: the message names what is missing.
#[track_caller]
pub fn missing(b: Backend, e: &dyn std::fmt::Display) -> ! {
    match b {
        Backend::Cpu => panic!("the CPU backend failed to start: {e}"),
        Backend::Cuda => panic!(
            "this test needs a CUDA GPU and a build with `--features cuda` ({e}); \
             without them it is ignored unless QUIRE_REQUIRE_GPU is set at build time"
        ),
        Backend::Wgpu => panic!(
            "this test needs a wgpu adapter (Vulkan, Metal or DX12; on Debian `apt-get install \
             mesa-vulkan-drivers libvulkan1` gives lavapipe) and a build with `--features wgpu` \
             ({e}); without them it is ignored unless QUIRE_REQUIRE_WGPU is set at build time"
        ),
    }
}

/// Fails a wgpu test compiled without the `wgpu` feature.
#[track_caller]
pub fn not_built_with_wgpu() -> ! {
    panic!(
        "this test needs the wgpu backend, which this test binary was built without: \
         add `--features wgpu`"
    )
}

/// Fails a GPU test that found no GPU (`e`: why `Gpu::new` failed).
#[track_caller]
pub fn no_gpu(e: &dyn std::fmt::Display) -> ! {
    missing(Backend::Cuda, e)
}

/// Fails a GPU test compiled without the `cuda` feature.
#[track_caller]
pub fn not_built_with_cuda() -> ! {
    panic!(
        "this test needs the CUDA backend, which this test binary was built without: \
         add `--features cuda`"
    )
}

/// Fails a SIMD test on a CPU without AVX2/FMA/F16C (or with QUIRE_NO_SIMD set).
#[track_caller]
pub fn require_simd() {
    if !quire_backend::cpu::quant::has_avx2() {
        panic!(
            "this test needs AVX2, FMA and F16C, which this CPU lacks (or QUIRE_NO_SIMD is set); \
             it is ignored where the build machine lacks them unless QUIRE_REQUIRE_SIMD is set"
        );
    }
}

/// The GPU form of a test item: ignored with [`GPU_IGNORE_REASON`] unless `QUIRE_REQUIRE_GPU`
/// was set when this crate was built (then the item is left as it is).
#[cfg(not(quire_require_gpu))]
#[doc(hidden)]
#[macro_export]
macro_rules! __gpu_item {
    ($($item:tt)*) => {
        #[ignore = "needs a CUDA GPU: run tests/device/check.sh, or set QUIRE_REQUIRE_GPU=1"]
        $($item)*
    };
}

#[cfg(quire_require_gpu)]
#[doc(hidden)]
#[macro_export]
macro_rules! __gpu_item {
    ($($item:tt)*) => { $($item)* };
}

/// The wgpu form of a test item: ignored with [`WGPU_IGNORE_REASON`] unless
/// `QUIRE_REQUIRE_WGPU` was set when this crate was built.
#[cfg(not(quire_require_wgpu))]
#[doc(hidden)]
#[macro_export]
macro_rules! __wgpu_item {
    ($($item:tt)*) => {
        #[ignore = "needs a wgpu adapter (Vulkan/Metal/DX12) and --features wgpu: set QUIRE_REQUIRE_WGPU=1"]
        $($item)*
    };
}

#[cfg(quire_require_wgpu)]
#[doc(hidden)]
#[macro_export]
macro_rules! __wgpu_item {
    ($($item:tt)*) => { $($item)* };
}

/// The SIMD form of a test item: ignored unless the build machine has AVX2, FMA and F16C or
/// `QUIRE_REQUIRE_SIMD` was set.
#[cfg(not(quire_simd))]
#[doc(hidden)]
#[macro_export]
macro_rules! __simd_item {
    ($($item:tt)*) => {
        #[ignore = "needs AVX2, FMA and F16C, which the build machine lacks (or QUIRE_NO_SIMD was \
                    set); set QUIRE_REQUIRE_SIMD=1 to run it"]
        $($item)*
    };
}

#[cfg(quire_simd)]
#[doc(hidden)]
#[macro_export]
macro_rules! __simd_item {
    ($($item:tt)*) => { $($item)* };
}

/// The Python form of a test item: ignored unless `QUIRE_REQUIRE_PY` was set when this crate
/// was built (the test then fails when the interpreter or its packages are missing).
#[cfg(not(quire_require_py))]
#[doc(hidden)]
#[macro_export]
macro_rules! __py_item {
    ($($item:tt)*) => {
        #[ignore = "needs python3 with tests/python/requirements.txt (QUIRE_PYTHON names the \
                    interpreter); set QUIRE_REQUIRE_PY=1 to run it, as .ci/run does"]
        $($item)*
    };
}

#[cfg(quire_require_py)]
#[doc(hidden)]
#[macro_export]
macro_rules! __py_item {
    ($($item:tt)*) => { $($item)* };
}

/// The NVRTC form of a test item: ignored unless `QUIRE_REQUIRE_NVRTC` was set when this crate
/// was built (the test then fails when libnvrtc cannot be loaded).
#[cfg(not(quire_require_nvrtc))]
#[doc(hidden)]
#[macro_export]
macro_rules! __nvrtc_item {
    ($($item:tt)*) => {
        #[ignore = "needs libnvrtc (CUDA's runtime compiler; no GPU): set QUIRE_REQUIRE_NVRTC=1 \
                    to run it, as .ci/run does"]
        $($item)*
    };
}

#[cfg(quire_require_nvrtc)]
#[doc(hidden)]
#[macro_export]
macro_rules! __nvrtc_item {
    ($($item:tt)*) => { $($item)* };
}

/// Test functions that drive Python packages: `py_test! { fn name() { … } }`. Listed as
/// ignored, with the reason, unless `QUIRE_REQUIRE_PY` was set at build time.
#[macro_export]
macro_rules! py_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $crate::__py_item! {
            $(#[$meta])*
            #[test]
            fn $name() $body
        }
    };
}

/// Test functions that need libnvrtc: `nvrtc_test! { fn name() { … } }`. Listed as
/// ignored, with the reason, unless `QUIRE_REQUIRE_NVRTC` was set at build time.
#[macro_export]
macro_rules! nvrtc_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $crate::__nvrtc_item! {
            $(#[$meta])*
            #[test]
            fn $name() $body
        }
    };
}

/// One test body, run on every backend: `executor_test! { fn name(backend) { … } }` defines
/// module `name` with tests `cpu`, `cuda` and `wgpu`, each calling the body with its
/// [`Backend`]. The CUDA and wgpu tests are ignored unless required (see the crate doc) and fail
/// without their device.
#[macro_export]
macro_rules! executor_test {
    ($(#[$meta:meta])* fn $name:ident($backend:ident) $body:block) => {
        $(#[$meta])*
        mod $name {
            #[allow(unused_imports)]
            use super::*;

            fn body($backend: $crate::Backend) $body

            #[test]
            fn cpu() {
                body($crate::Backend::Cpu)
            }

            $crate::__gpu_item! {
                #[test]
                fn cuda() {
                    body($crate::Backend::Cuda)
                }
            }

            $crate::__wgpu_item! {
                #[test]
                fn wgpu() {
                    body($crate::Backend::Wgpu)
                }
            }
        }
    };
}

/// A test of the wgpu backend's internals (kernels against CPU references): `wgpu_test! { fn
/// name() { … } }`. Ignored unless `QUIRE_REQUIRE_WGPU` was set at build time; when it runs, a
/// binary built without the test crate's `wgpu` feature fails it, and so does a machine without
/// an adapter (the body should get its device through [`missing`] on failure).
#[macro_export]
macro_rules! wgpu_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $crate::__wgpu_item! {
            $(#[$meta])*
            #[test]
            fn $name() {
                #[cfg(feature = "wgpu")]
                $body
                #[cfg(not(feature = "wgpu"))]
                $crate::not_built_with_wgpu()
            }
        }
    };
}

/// A test of GPU internals (kernels, planning) with no CPU form: `gpu_test! { fn name() { … } }`.
/// Ignored unless required (see the crate doc); when it runs, a binary built without the `cuda`
/// feature fails it. The body is compiled only with the test crate's `cuda` feature, so it may
/// use `quire_backend::cuda` freely; it should get its GPU through [`no_gpu`] on failure.
#[macro_export]
macro_rules! gpu_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $crate::__gpu_item! {
            $(#[$meta])*
            #[test]
            fn $name() {
                #[cfg(feature = "cuda")]
                $body
                #[cfg(not(feature = "cuda"))]
                $crate::not_built_with_cuda()
            }
        }
    };
}

/// A test of the CPU backend's AVX2/FMA/F16C paths: `simd_test! { fn name() { … } }`. Ignored
/// where the build machine lacks them (see the crate doc); when it runs on a CPU without them,
/// it fails.
#[macro_export]
macro_rules! simd_test {
    ($(#[$meta:meta])* fn $name:ident() $body:block) => {
        $crate::__simd_item! {
            $(#[$meta])*
            #[test]
            fn $name() {
                $crate::require_simd();
                $body
            }
        }
    };
}
