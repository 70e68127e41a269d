//! The run stamp: which code ran where and when. A number without its commit, machine and settings
//! cannot be compared with anything, so every result the toolkit writes carries one.

use std::time::{SystemTime, UNIX_EPOCH};

use serde::{Deserialize, Serialize};

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct RunStamp {
    /// Short git commit the binary was built from, `-dirty` for uncommitted changes
    /// (`QUIRE_COMMIT` overrides; "unknown" when not built in a checkout).
    pub commit: String,
    pub quire_version: String,
    /// CPU model name, e.g. "AMD EPYC 7B13".
    pub cpu: String,
    /// Logical cores available to this process.
    pub cores: usize,
    /// SIMD features the kernels can use, e.g. "avx2 fma f16c".
    pub cpu_features: String,
    /// Operating system and kernel release, e.g. "linux 6.8.0".
    pub os: String,
    /// RFC 3339 UTC time of the stamp.
    pub date: String,
    /// 1-minute load average when stamped: above ~0.5 on an idle-by-design benchmark host,
    /// something else was competing for the cores.
    #[serde(default)]
    pub load_avg: f64,
    /// `QUIRE_*` settings of the run as `NAME=VALUE` ([`quire_env`]); empty when none was set.
    #[serde(default)]
    pub env: Vec<String>,
}

impl RunStamp {
    /// Collects the stamp now.
    pub fn collect() -> RunStamp {
        RunStamp {
            commit: git_commit(),
            quire_version: env!("CARGO_PKG_VERSION").to_string(),
            cpu: cpu_model(),
            cores: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            cpu_features: cpu_features(),
            os: os_release(),
            date: rfc3339_utc(SystemTime::now()),
            load_avg: load_avg(),
            env: quire_env(),
        }
    }

    /// One line for the end of a human-readable report (with the `QUIRE_*` settings, if any).
    pub fn line(&self) -> String {
        let mut l = format!(
            "quire {} ({}) on {} ({} cores, {}), {}, {}, load average {:.2}",
            self.quire_version,
            self.commit,
            self.cpu,
            self.cores,
            self.cpu_features,
            self.os,
            self.date,
            self.load_avg
        );
        if !self.env.is_empty() {
            l += &format!(", env {}", self.env.join(" "));
        }
        l
    }

    /// A warning when the machine was busy (load average above half a core) at stamp time.
    pub fn busy_warning(&self) -> Option<String> {
        (self.load_avg > 0.5).then(|| {
            format!(
                "warning: load average {:.2} on {} cores: other work is competing for the CPU, results will be noisy",
                self.load_avg, self.cores
            )
        })
    }
}

/// The 1-minute load average from /proc/loadavg (0 where unavailable).
pub fn load_avg() -> f64 {
    std::fs::read_to_string("/proc/loadavg")
        .ok()
        .and_then(|s| s.split_whitespace().next()?.parse().ok())
        .unwrap_or(0.0)
}

/// `QUIRE_COMMIT` when set (scripts that build elsewhere and copy the binary name the commit this
/// way), else the commit the binary was built from: `git rev-parse --short HEAD` at build time,
/// with `-dirty` for uncommitted changes, "unknown" when not built in a git checkout (build.rs).
pub fn git_commit() -> String {
    match std::env::var("QUIRE_COMMIT") {
        Ok(c) if !c.trim().is_empty() => c.trim().to_string(),
        _ => env!("QUIRE_BUILD_COMMIT").to_string(),
    }
}

/// Variables whose values are secrets: recorded by name only.
const SECRET_MARKS: [&str; 4] = ["KEY", "TOKEN", "SECRET", "PASSWORD"];

/// Every `QUIRE_*` environment variable set for this run, as `NAME=VALUE`, sorted: the switches
/// (`QUIRE_CUDA_GRAPHS=0`, `QUIRE_NO_SIMD`, ...) that change what a measurement measured. Two
/// exceptions: `QUIRE_COMMIT` is left out (it only relabels the stamp, and is its `commit`), and
/// variables named like secrets (`QUIRE_API_KEY`) keep their name but not their value.
pub fn quire_env() -> Vec<String> {
    quire_env_of(std::env::vars_os())
}

fn quire_env_of(
    vars: impl IntoIterator<Item = (std::ffi::OsString, std::ffi::OsString)>,
) -> Vec<String> {
    let mut out: Vec<String> = vars
        .into_iter()
        .filter_map(|(k, v)| {
            let k = k.into_string().ok()?;
            if !k.starts_with("QUIRE_") || k == "QUIRE_COMMIT" {
                return None;
            }
            let v = if SECRET_MARKS.iter().any(|m| k.contains(m)) {
                "<redacted>".to_string()
            } else {
                v.to_string_lossy().into_owned()
            };
            Some(format!("{k}={v}"))
        })
        .collect();
    out.sort();
    out
}

/// The CPU's model name from /proc/cpuinfo (x86 "model name", ARM "Hardware"/"Model"), else the
/// architecture.
pub fn cpu_model() -> String {
    let info = std::fs::read_to_string("/proc/cpuinfo").unwrap_or_default();
    for key in ["model name", "Hardware", "Model", "cpu model"] {
        if let Some(v) = info.lines().find_map(|l| {
            let (k, v) = l.split_once(':')?;
            (k.trim() == key).then(|| v.trim().to_string())
        }) {
            if !v.is_empty() {
                return v;
            }
        }
    }
    std::env::consts::ARCH.to_string()
}

/// The SIMD features relevant to quire's kernels that this CPU has.
pub fn cpu_features() -> String {
    #[cfg(target_arch = "x86_64")]
    {
        let mut f = Vec::new();
        if is_x86_feature_detected!("avx2") {
            f.push("avx2");
        }
        if is_x86_feature_detected!("fma") {
            f.push("fma");
        }
        if is_x86_feature_detected!("f16c") {
            f.push("f16c");
        }
        if is_x86_feature_detected!("avx512f") {
            f.push("avx512f");
        }
        if f.is_empty() {
            "sse2".into()
        } else {
            f.join(" ")
        }
    }
    #[cfg(target_arch = "aarch64")]
    {
        "neon".into()
    }
    #[cfg(not(any(target_arch = "x86_64", target_arch = "aarch64")))]
    {
        "scalar".into()
    }
}

/// "linux 6.8.0-1015-gcp" (the kernel release where /proc has it).
pub fn os_release() -> String {
    let rel = std::fs::read_to_string("/proc/sys/kernel/osrelease").unwrap_or_default();
    let rel = rel.trim();
    if rel.is_empty() {
        std::env::consts::OS.to_string()
    } else {
        format!("{} {rel}", std::env::consts::OS)
    }
}

/// `YYYY-MM-DDTHH:MM:SSZ` for a system time (UTC, proleptic Gregorian calendar).
pub fn rfc3339_utc(t: SystemTime) -> String {
    let secs = t
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs() as i64)
        .unwrap_or(0);
    let (days, rem) = (secs.div_euclid(86_400), secs.rem_euclid(86_400));
    let (y, m, d) = civil_from_days(days);
    format!(
        "{y:04}-{m:02}-{d:02}T{:02}:{:02}:{:02}Z",
        rem / 3600,
        rem % 3600 / 60,
        rem % 60
    )
}

/// Calendar date of a day count since 1970-01-01. Works in 400-year eras (146097 days each) with
/// years starting on March 1st, so the leap day falls at the end of the counted year.
fn civil_from_days(days: i64) -> (i64, u32, u32) {
    let z = days + 719_468; // days since 0000-03-01
    let era = z.div_euclid(146_097);
    let doe = z.rem_euclid(146_097); // day of era, 0..=146096
    let yoe = (doe - doe / 1460 + doe / 36_524 - doe / 146_096) / 365; // year of era
    let doy = doe - (365 * yoe + yoe / 4 - yoe / 100); // day of the March-based year
    let mp = (5 * doy + 2) / 153; // month index from March
    let d = (doy - (153 * mp + 2) / 5 + 1) as u32;
    let m = if mp < 10 { mp + 3 } else { mp - 9 } as u32;
    let y = yoe + era * 400 + i64::from(m <= 2);
    (y, m, d)
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::time::Duration;

    #[test]
    fn dates() {
        let at = |s: u64| rfc3339_utc(UNIX_EPOCH + Duration::from_secs(s));
        assert_eq!(at(0), "1970-01-01T00:00:00Z");
        assert_eq!(at(951_782_400), "2000-02-29T00:00:00Z");
        assert_eq!(at(1_709_251_199), "2024-02-29T23:59:59Z");
        assert_eq!(at(4_102_444_800), "2100-01-01T00:00:00Z");
    }

    #[test]
    fn quire_env_lists_settings_but_not_the_commit_or_secrets() {
        let vars = [
            ("PATH", "/bin"),
            ("QUIRE_CUDA_GRAPHS", "0"),
            ("QUIRE_COMMIT", "abc1234"),
            ("QUIRE_API_KEY", "sk-secret"),
            ("QUIRE_NO_SIMD", "1"),
            ("XQUIRE_OTHER", "1"),
        ]
        .map(|(k, v)| (k.into(), v.into()));
        assert_eq!(
            quire_env_of(vars),
            [
                "QUIRE_API_KEY=<redacted>",
                "QUIRE_CUDA_GRAPHS=0",
                "QUIRE_NO_SIMD=1"
            ]
        );
    }

    #[test]
    fn commit_is_the_builds() {
        let built = env!("QUIRE_BUILD_COMMIT");
        assert!(!built.is_empty());
        // The build script's own answer, checked against git here (the test runs in the crate's
        // directory): the short hash of HEAD, marked dirty or not.
        let head = std::process::Command::new("git")
            .args(["rev-parse", "--short", "HEAD"])
            .output()
            .ok()
            .filter(|o| o.status.success())
            .map(|o| String::from_utf8_lossy(&o.stdout).trim().to_string());
        match head {
            Some(h) => assert!(
                built == h || built == format!("{h}-dirty"),
                "built {built}, HEAD {h}"
            ),
            None => assert_eq!(built, "unknown"),
        }
    }

    #[test]
    fn stamp_is_filled() {
        let s = RunStamp::collect();
        assert!(s.cores >= 1);
        assert!(!s.cpu.is_empty() && !s.commit.is_empty());
        assert!(s.date.ends_with('Z'));
    }
}
