//! Kernels are `.cu` files (one op family per file) compiled by NVRTC, at first use, to a CUBIN for
//! the device's architecture, and cached on disk under a hash of the source, the options, the
//! architecture and the NVRTC version, so a second run loads them in microseconds. CUBIN rather
//! than PTX: PTX from an NVRTC newer than the driver is rejected.
//!
//! Nothing here needs a GPU, only libnvrtc: CI compiles every kernel this way.

use std::ffi::{c_char, CStr, CString};
use std::path::PathBuf;

use cudarc::nvrtc::sys;
use sha2::{Digest, Sha256};

use crate::BackendError;

/// One kernel family: its file name and source.
#[derive(Debug, Clone, Copy)]
pub struct KernelSource {
    pub name: &'static str,
    pub src: &'static str,
}

const COMMON: &str = include_str!("kernels/common.cuh");

pub const NORM: KernelSource = KernelSource {
    name: "norm.cu",
    src: include_str!("kernels/norm.cu"),
};
pub const EMBED: KernelSource = KernelSource {
    name: "embed.cu",
    src: include_str!("kernels/embed.cu"),
};
pub const ACTIVATION: KernelSource = KernelSource {
    name: "activation.cu",
    src: include_str!("kernels/activation.cu"),
};
pub const ROPE: KernelSource = KernelSource {
    name: "rope.cu",
    src: include_str!("kernels/rope.cu"),
};
pub const SAMPLE: KernelSource = KernelSource {
    name: "sample.cu",
    src: include_str!("kernels/sample.cu"),
};
/// The dp4a matmuls (direct and staged through shared memory) and the tensor-core matmul for many
/// tokens (mmq_tc.cuh builds on quant.cu's blocks and unpacking, so they are one module).
pub const QUANT: KernelSource = KernelSource {
    name: "quant.cu + mmq_tc.cu",
    src: concat!(
        include_str!("kernels/quant.cu"),
        include_str!("kernels/mmq_tc.cuh"),
        include_str!("kernels/mmq_tc.cu")
    ),
};
pub const GEMV: KernelSource = KernelSource {
    name: "gemv.cu",
    src: include_str!("kernels/gemv.cu"),
};
/// The MoE kernels build on quant.cu's blocks and dot products and on mmq_tc.cuh's tensor-core
/// tile, so the file is compiled after them.
pub const MOE: KernelSource = KernelSource {
    name: "moe.cu",
    src: concat!(
        include_str!("kernels/quant.cu"),
        include_str!("kernels/mmq_tc.cuh"),
        include_str!("kernels/moe.cu")
    ),
};
/// Needs `HEAD_DIM` and `GQA` defined. The decode and prefill kernels build on attention.cu's
/// helpers, so the three files are one module.
pub const ATTENTION: KernelSource = KernelSource {
    name: "attention.cu + decode.cu + prefill.cu",
    src: concat!(
        include_str!("kernels/attention.cu"),
        include_str!("kernels/decode.cu"),
        include_str!("kernels/prefill.cu")
    ),
};

/// Every kernel family with the defines it is compiled with for the shapes quire supports.
pub fn all_variants() -> Vec<(KernelSource, Vec<(&'static str, String)>)> {
    let mut v: Vec<_> = [NORM, EMBED, ACTIVATION, ROPE, SAMPLE, QUANT, MOE, GEMV]
        .into_iter()
        .map(|k| (k, vec![]))
        .collect();
    for hd in [64, 128, 256] {
        for gqa in [1, 2, 3, 4, 5, 6, 7, 8] {
            v.push((
                ATTENTION,
                vec![("HEAD_DIM", hd.to_string()), ("GQA", gqa.to_string())],
            ));
        }
    }
    // The decode timeline's builds (`QUIRE_CUDA_TRACE=1`: every module with `QUIRE_TRACE`).
    let traced: Vec<_> = [NORM, EMBED, ACTIVATION, ROPE, SAMPLE, QUANT, MOE, GEMV]
        .into_iter()
        .map(|k| (k, vec![("QUIRE_TRACE", "1".to_string())]))
        .chain([(
            ATTENTION,
            vec![
                ("HEAD_DIM", "128".to_string()),
                ("GQA", "4".to_string()),
                ("QUIRE_TRACE", "1".to_string()),
            ],
        )])
        .collect();
    v.extend(traced);
    v
}

/// Library file names cudarc tries for `lib` (for error messages).
pub fn lib_candidates(lib: &str) -> String {
    cudarc::get_lib_name_candidates(lib).join(", ")
}

/// Fails with a message naming the library files tried when libnvrtc cannot be loaded.
pub fn check_nvrtc() -> Result<(), BackendError> {
    // SAFETY: only probes whether the library can be opened.
    if unsafe { sys::is_culib_present() } {
        Ok(())
    } else {
        Err(BackendError::Cuda(format!(
            "NVRTC (the CUDA runtime compiler) was not found; tried {} on the library path \
             (add the CUDA toolkit's lib directory to LD_LIBRARY_PATH)",
            lib_candidates("nvrtc")
        )))
    }
}

pub fn nvrtc_version() -> Result<(i32, i32), BackendError> {
    check_nvrtc()?;
    let (mut major, mut minor) = (0, 0);
    // SAFETY: plain out-parameters.
    let r = unsafe { sys::nvrtcVersion(&mut major, &mut minor) };
    check(r, "nvrtcVersion")?;
    Ok((major, minor))
}

fn check(r: sys::nvrtcResult, what: &str) -> Result<(), BackendError> {
    if r == sys::nvrtcResult::NVRTC_SUCCESS {
        Ok(())
    } else {
        Err(BackendError::Cuda(format!("{what} failed: {r:?}")))
    }
}

fn cache_dir() -> Option<PathBuf> {
    if let Some(d) = super::env::kernel_cache_dir() {
        return Some(d);
    }
    let base = std::env::var_os("XDG_CACHE_HOME")
        .map(PathBuf::from)
        .or_else(|| std::env::var_os("HOME").map(|h| PathBuf::from(h).join(".cache")))?;
    Some(base.join("quire").join("kernels"))
}

/// Include directories for NVRTC: `QUIRE_CUDA_INCLUDE`, else the toolkit's, when present.
fn include_paths() -> Vec<String> {
    let mut v = vec![];
    if let Some(p) = super::env::include_dir() {
        v.push(p);
    } else if std::path::Path::new("/usr/local/cuda/include").is_dir() {
        v.push("/usr/local/cuda/include".into());
    }
    v
}

/// Compiles `k` with `defines` for `arch` (e.g. `sm_90`) to a CUBIN, through the disk cache.
/// Returns the CUBIN and whether it came from the cache.
pub fn compile(
    k: &KernelSource,
    defines: &[(&str, String)],
    arch: &str,
) -> Result<(Vec<u8>, bool), BackendError> {
    let (major, minor) = nvrtc_version()?;
    let src = format!("{COMMON}\n#line 1 \"{}\"\n{}", k.name, k.src);
    let mut opts = vec![
        format!("--gpu-architecture={arch}"),
        "--std=c++17".to_string(),
        "-default-device".to_string(),
        "--use_fast_math".to_string(),
    ];
    opts.extend(defines.iter().map(|(n, v)| format!("-D{n}={v}")));
    let mut h = Sha256::new();
    h.update(src.as_bytes());
    h.update(opts.join(" ").as_bytes());
    h.update(format!("nvrtc {major}.{minor}").as_bytes());
    let key: String = h.finalize()[..12]
        .iter()
        .map(|b| format!("{b:02x}"))
        .collect();
    let stem = k.name.trim_end_matches(".cu");
    let cached = cache_dir().map(|d| d.join(format!("{stem}-{arch}-{key}.cubin")));
    if let Some(p) = &cached {
        if let Ok(bytes) = std::fs::read(p) {
            if !bytes.is_empty() {
                return Ok((bytes, true));
            }
        }
    }
    opts.extend(
        include_paths()
            .into_iter()
            .map(|p| format!("--include-path={p}")),
    );
    let cubin = compile_uncached(k.name, &src, &opts)?;
    if let Some(p) = cached {
        // Best effort: a read-only cache only costs a recompile next time.
        if let Some(dir) = p.parent() {
            let _ = std::fs::create_dir_all(dir);
        }
        let tmp = p.with_extension(format!("tmp{}", std::process::id()));
        if std::fs::write(&tmp, &cubin).is_ok() {
            let _ = std::fs::rename(&tmp, &p);
        }
    }
    Ok((cubin, false))
}

fn compile_uncached(name: &str, src: &str, opts: &[String]) -> Result<Vec<u8>, BackendError> {
    let c_src = CString::new(src).map_err(|_| BackendError::Cuda("NUL in kernel source".into()))?;
    let c_name = CString::new(name).map_err(|_| BackendError::Cuda("NUL in kernel name".into()))?;
    let c_opts: Vec<CString> = opts
        .iter()
        .map(|o| CString::new(o.as_str()).expect("options have no NUL"))
        .collect();
    let ptrs: Vec<*const c_char> = c_opts.iter().map(|o| o.as_ptr()).collect();
    let mut prog: sys::nvrtcProgram = std::ptr::null_mut();
    // SAFETY: valid C strings that outlive the program; no headers passed.
    unsafe {
        check(
            sys::nvrtcCreateProgram(
                &mut prog,
                c_src.as_ptr(),
                c_name.as_ptr(),
                0,
                std::ptr::null(),
                std::ptr::null(),
            ),
            "nvrtcCreateProgram",
        )?;
        let r = sys::nvrtcCompileProgram(prog, ptrs.len() as i32, ptrs.as_ptr());
        let out = if r != sys::nvrtcResult::NVRTC_SUCCESS {
            let mut n = 0usize;
            sys::nvrtcGetProgramLogSize(prog, &mut n);
            let mut log = vec![0 as c_char; n.max(1)];
            sys::nvrtcGetProgramLog(prog, log.as_mut_ptr());
            let log = CStr::from_ptr(log.as_ptr()).to_string_lossy().into_owned();
            Err(BackendError::Kernel {
                name: name.to_string(),
                log: format!("options {}\n{log}", opts.join(" ")),
            })
        } else {
            let mut n = 0usize;
            check(sys::nvrtcGetCUBINSize(prog, &mut n), "nvrtcGetCUBINSize")?;
            let mut bin = vec![0u8; n];
            check(
                sys::nvrtcGetCUBIN(prog, bin.as_mut_ptr() as *mut c_char),
                "nvrtcGetCUBIN",
            )?;
            Ok(bin)
        };
        sys::nvrtcDestroyProgram(&mut prog);
        out
    }
}
