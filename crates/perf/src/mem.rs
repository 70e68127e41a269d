//! Peak memory of the running process: with load time, the fourth headline number of a run next
//! to prompt, generation and latency figures. A model that loads fast but needs twice the memory
//! is a different trade than the throughput alone shows.

/// The most resident host memory this process has had, in bytes: `VmHWM` of /proc/self/status on
/// Linux, `getrusage`'s `ru_maxrss` on other Unix systems, `None` where neither exists.
pub fn peak_rss_bytes() -> Option<u64> {
    #[cfg(target_os = "linux")]
    {
        let status = std::fs::read_to_string("/proc/self/status").ok()?;
        vm_hwm(&status)
    }
    #[cfg(all(unix, not(target_os = "linux")))]
    {
        // SAFETY: getrusage only writes the struct it is given, which is plain data that is
        // valid zeroed.
        let usage = unsafe {
            let mut u: libc::rusage = std::mem::zeroed();
            (libc::getrusage(libc::RUSAGE_SELF, &mut u) == 0).then_some(u)?
        };
        // Bytes on macOS and iOS, kilobytes on the BSDs.
        let scale = if cfg!(target_vendor = "apple") {
            1
        } else {
            1024
        };
        u64::try_from(usage.ru_maxrss).ok().map(|v| v * scale)
    }
    #[cfg(not(unix))]
    {
        None
    }
}

/// `VmHWM` of a /proc/PID/status text, in bytes (the kernel writes it in kB).
#[cfg_attr(not(target_os = "linux"), allow(dead_code))]
fn vm_hwm(status: &str) -> Option<u64> {
    let line = status.lines().find(|l| l.starts_with("VmHWM:"))?;
    let mut parts = line["VmHWM:".len()..].split_whitespace();
    let kb: u64 = parts.next()?.parse().ok()?;
    (parts.next() == Some("kB")).then_some(kb * 1024)
}

/// Bytes as MiB with one decimal, or "n/a".
pub fn fmt_mib(bytes: Option<u64>) -> String {
    match bytes {
        Some(b) => format!("{:.1} MiB", b as f64 / (1u64 << 20) as f64),
        None => "n/a".into(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn parses_vm_hwm() {
        let status = "Name:\tquire\nVmPeak:\t  999 kB\nVmHWM:\t   20480 kB\nVmRSS:\t 1 kB\n";
        assert_eq!(vm_hwm(status), Some(20480 * 1024));
        assert_eq!(vm_hwm("VmRSS:\t 1 kB\n"), None);
        assert_eq!(vm_hwm("VmHWM:\t  x kB\n"), None);
        assert_eq!(vm_hwm("VmHWM:\t  12 MB\n"), None);
    }

    #[cfg(unix)]
    #[test]
    fn peak_rss_grows_with_a_touched_allocation() {
        let before = peak_rss_bytes().expect("peak RSS on Unix");
        // 64 MiB written page by page is resident at once, so the peak is at least that.
        let big = vec![1u8; 64 << 20];
        let after = peak_rss_bytes().unwrap();
        assert!(big.iter().step_by(4096).all(|&b| b == 1));
        assert!(after >= 64 << 20, "peak {after} below the 64 MiB held");
        assert!(after >= before);
    }

    #[test]
    fn formats_mib() {
        assert_eq!(fmt_mib(Some(3 << 20)), "3.0 MiB");
        assert_eq!(fmt_mib(None), "n/a");
    }
}
