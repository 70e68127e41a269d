//! The environment variables the CUDA backend reads, in one place and read once per process, so a
//! benchmark can stamp the settings it ran under into its results (`non_default_env`).
//!
//! Each is a real option a user may need (a fallback, a diagnosis, an install layout); tuning
//! experiments do not belong here: their outcomes are constants beside the code they tune.

use std::sync::OnceLock;

/// The backend's environment settings.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct CudaEnv {
    /// `QUIRE_CUDA_GRAPHS=0`: run decode steps eagerly instead of through CUDA graphs.
    pub graphs: bool,
    /// `QUIRE_CUDA_GEMV=0`: one-token f16 matmuls through cuBLAS instead of quire's GEMV.
    pub gemv: bool,
    /// `QUIRE_CUDA_PDL=0`: launch without programmatic dependent launch (sm_90+ only anyway).
    pub pdl: bool,
    /// `QUIRE_CUDA_TRACE=1`: compile the kernels with the decode timeline's marks (trace.rs).
    pub trace: bool,
}

impl Default for CudaEnv {
    fn default() -> Self {
        Self {
            graphs: true,
            gemv: true,
            pdl: true,
            trace: false,
        }
    }
}

/// Variables that hold paths rather than switches; read where they are used (the kernel test
/// points the cache at a fresh directory while it runs), listed by `non_default_env` too.
pub const INCLUDE_VAR: &str = "QUIRE_CUDA_INCLUDE";
pub const KERNEL_CACHE_VAR: &str = "QUIRE_KERNEL_CACHE";

impl CudaEnv {
    /// Reads the switches from `get`: a variable set to `0` turns a default-on option off,
    /// `QUIRE_CUDA_TRACE=1` turns the trace on; anything else keeps the default.
    pub fn from_vars(get: impl Fn(&str) -> Option<String>) -> Self {
        let off = |name: &str| get(name).is_some_and(|v| v == "0");
        Self {
            graphs: !off("QUIRE_CUDA_GRAPHS"),
            gemv: !off("QUIRE_CUDA_GEMV"),
            pdl: !off("QUIRE_CUDA_PDL"),
            trace: get("QUIRE_CUDA_TRACE").is_some_and(|v| v == "1"),
        }
    }

    /// The process's settings, read from the environment on first use.
    pub fn get() -> &'static CudaEnv {
        static ENV: OnceLock<CudaEnv> = OnceLock::new();
        ENV.get_or_init(|| Self::from_vars(|n| std::env::var(n).ok()))
    }

    /// The switches that differ from the defaults, as (variable, value) pairs.
    pub fn non_default(&self) -> Vec<(String, String)> {
        let d = Self::default();
        let mut v = vec![];
        let mut flag = |name: &str, on: bool, default: bool| {
            if on != default {
                v.push((name.to_string(), if on { "1" } else { "0" }.to_string()));
            }
        };
        flag("QUIRE_CUDA_GRAPHS", self.graphs, d.graphs);
        flag("QUIRE_CUDA_GEMV", self.gemv, d.gemv);
        flag("QUIRE_CUDA_PDL", self.pdl, d.pdl);
        flag("QUIRE_CUDA_TRACE", self.trace, d.trace);
        v
    }
}

/// Every CUDA setting of this process that is not the default, as (variable, value) pairs, for
/// benchmarks and profiles to record beside their numbers: the switches of `CudaEnv::get`, then
/// the include and kernel-cache paths when set.
pub fn non_default_env() -> Vec<(String, String)> {
    let mut v = CudaEnv::get().non_default();
    for name in [INCLUDE_VAR, KERNEL_CACHE_VAR] {
        if let Some(p) = std::env::var_os(name) {
            v.push((name.to_string(), p.to_string_lossy().into_owned()));
        }
    }
    v
}

/// `QUIRE_CUDA_INCLUDE`: an include directory for NVRTC in place of the toolkit's.
#[cfg(feature = "cuda")]
pub fn include_dir() -> Option<String> {
    std::env::var(INCLUDE_VAR).ok()
}

/// `QUIRE_KERNEL_CACHE`: where compiled kernels are kept in place of `~/.cache/quire/kernels`.
#[cfg(feature = "cuda")]
pub fn kernel_cache_dir() -> Option<std::path::PathBuf> {
    std::env::var_os(KERNEL_CACHE_VAR).map(std::path::PathBuf::from)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn vars<'a>(set: &'a [(&'a str, &'a str)]) -> impl Fn(&str) -> Option<String> + 'a {
        move |n| {
            set.iter()
                .find(|(k, _)| *k == n)
                .map(|(_, v)| v.to_string())
        }
    }

    #[test]
    fn unset_variables_give_the_defaults_and_nothing_to_report() {
        let e = CudaEnv::from_vars(vars(&[]));
        assert_eq!(e, CudaEnv::default());
        assert!(e.non_default().is_empty());
    }

    #[test]
    fn switches_turned_off_or_on_are_reported_by_name() {
        let e = CudaEnv::from_vars(vars(&[
            ("QUIRE_CUDA_GRAPHS", "0"),
            ("QUIRE_CUDA_GEMV", "1"),
            ("QUIRE_CUDA_TRACE", "1"),
        ]));
        assert!(!e.graphs && e.gemv && e.pdl && e.trace);
        assert_eq!(
            e.non_default(),
            vec![
                ("QUIRE_CUDA_GRAPHS".to_string(), "0".to_string()),
                ("QUIRE_CUDA_TRACE".to_string(), "1".to_string()),
            ]
        );
    }

    #[test]
    fn values_other_than_the_switch_value_keep_the_default() {
        let e = CudaEnv::from_vars(vars(&[("QUIRE_CUDA_PDL", "no"), ("QUIRE_CUDA_TRACE", "0")]));
        assert_eq!(e, CudaEnv::default());
    }
}
