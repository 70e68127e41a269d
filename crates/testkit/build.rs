//! Decides at build time which hardware-bound tests run: libtest cannot skip a test at run time,
//! so a test whose hardware is missing must be marked `#[ignore]` when it is compiled. The cfgs
//! set here select which form of the testkit's marking macros is compiled (see src/lib.rs).

fn main() {
    println!("cargo::rustc-check-cfg=cfg(quire_require_gpu)");
    println!("cargo::rustc-check-cfg=cfg(quire_simd)");
    println!("cargo::rustc-check-cfg=cfg(quire_require_py)");
    println!("cargo::rustc-check-cfg=cfg(quire_require_nvrtc)");
    println!("cargo::rustc-check-cfg=cfg(quire_require_wgpu)");
    println!("cargo:rerun-if-changed=build.rs");
    for var in [
        "QUIRE_REQUIRE_GPU",
        "QUIRE_REQUIRE_WGPU",
        "QUIRE_REQUIRE_SIMD",
        "QUIRE_NO_SIMD",
        "QUIRE_REQUIRE_PY",
        "QUIRE_REQUIRE_NVRTC",
    ] {
        println!("cargo:rerun-if-env-changed={var}");
    }
    let set = |var: &str| std::env::var_os(var).is_some_and(|v| !v.is_empty() && v != "0");
    if set("QUIRE_REQUIRE_GPU") {
        println!("cargo:rustc-cfg=quire_require_gpu");
    }
    if set("QUIRE_REQUIRE_WGPU") {
        println!("cargo:rustc-cfg=quire_require_wgpu");
    }
    // Tests that drive Python packages (the OpenAI client, gguf-py) or NVRTC run where CI (or the
    // user) says these are installed.
    if set("QUIRE_REQUIRE_PY") {
        println!("cargo:rustc-cfg=quire_require_py");
    }
    if set("QUIRE_REQUIRE_NVRTC") {
        println!("cargo:rustc-cfg=quire_require_nvrtc");
    }
    // The build machine is the test machine for native builds: its CPU decides whether the SIMD
    // tests run (as the CPU backend's own `has_avx2` decides at run time which kernels it uses).
    if set("QUIRE_REQUIRE_SIMD") || (!set("QUIRE_NO_SIMD") && host_has_avx2()) {
        println!("cargo:rustc-cfg=quire_simd");
    }
}

fn host_has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        std::is_x86_feature_detected!("avx2")
            && std::is_x86_feature_detected!("fma")
            && std::is_x86_feature_detected!("f16c")
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}
