//! Every CUDA kernel compiles with NVRTC to an sm_90 CUBIN. Needs libnvrtc only, no GPU: CI runs
//! it with NVRTC from PyPI. Listed as ignored unless QUIRE_REQUIRE_NVRTC was set at build time;
//! then a missing library is a failure.
#![cfg(feature = "cuda")]

use quire_backend::cuda::nvrtc;

quire_testkit::nvrtc_test! {
fn every_kernel_compiles_to_a_cubin() {
    if let Err(e) = nvrtc::check_nvrtc() {
        panic!("{e}");
    }
    let dir = std::env::temp_dir().join(format!("quire-kernels-{}", std::process::id()));
    std::env::set_var("QUIRE_KERNEL_CACHE", &dir);
    let variants = nvrtc::all_variants();
    for (k, defines) in &variants {
        for arch in ["sm_90", "sm_80"] {
            let (cubin, cached) = nvrtc::compile(k, defines, arch)
                .unwrap_or_else(|e| panic!("{} {defines:?} for {arch}: {e}", k.name));
            assert!(!cached, "a fresh cache directory cannot hold {}", k.name);
            assert_eq!(&cubin[..4], b"\x7fELF", "{} is not an ELF CUBIN", k.name);
        }
    }
    // A second compile of the same source and options comes from the disk cache.
    let (k, d) = &variants[0];
    let (_, cached) = nvrtc::compile(k, d, "sm_90").unwrap();
    assert!(cached, "the second compile of {} was not cached", k.name);
    let _ = std::fs::remove_dir_all(&dir);
}
}

quire_testkit::nvrtc_test! {
fn a_kernel_error_names_the_file_and_carries_the_log() {
    if let Err(e) = nvrtc::check_nvrtc() {
        panic!("{e}");
    }
    let bad = nvrtc::KernelSource {
        name: "broken.cu",
        src: "extern \"C\" __global__ void k() { undefined_thing(); }",
    };
    let e = nvrtc::compile(&bad, &[], "sm_90").unwrap_err().to_string();
    assert!(
        e.contains("broken.cu") && e.contains("undefined_thing"),
        "{e}"
    );
}
}
