//! This machine's ceilings: how fast memory can be streamed and how many floating-point (and
//! quantized integer) operations per second the CPU can retire. They turn a benchmark's tokens/s
//! into "% of what this hardware allows" and draw the roofs of the roofline chart.
//!
//! Bandwidth is a multi-threaded sum over a buffer 16× the last-level cache (first touched by the
//! thread that later reads it), median of several runs. The FP32 peak is an AVX2 FMA loop with
//! enough independent accumulators to hide the FMA latency on both FMA ports, on every thread.
//! The quantized-kernel rate needs quire's kernels, so the caller measures it and stores it here.
//! Results are cached as JSON (`~/.cache/quire/ceilings.json`) so `bench` need not re-measure.

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::Path;
use std::time::Instant;

use serde::{Deserialize, Serialize};

use crate::stamp::RunStamp;
use crate::stats::median;
use crate::PerfError;

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct Ceilings {
    /// Median streaming-read bandwidth, GB/s (10^9 bytes).
    pub mem_bw_gbps: f64,
    pub mem_bw_samples: Vec<f64>,
    pub mem_buffer_mib: usize,
    /// Median FP32 FMA rate, GFLOP/s.
    pub fp32_gflops: f64,
    pub fp32_samples: Vec<f64>,
    /// Rate of quire's quantized dot-product kernels with operands in cache, GOP/s (2 ops per
    /// multiply-add), by weight type ("q4_0", "q4_1", "q8_0").
    #[serde(default)]
    pub quant_gops: BTreeMap<String, f64>,
    pub threads: usize,
    pub stamp: RunStamp,
}

impl Ceilings {
    /// Arithmetic intensity (FLOP/byte) where the FP32 roof meets the memory roof.
    pub fn ridge(&self) -> f64 {
        self.fp32_gflops / self.mem_bw_gbps
    }

    /// The compute roof for a weight type: its quantized-kernel rate when measured, else FP32.
    pub fn compute_gflops(&self, weight_type: &str) -> (f64, String) {
        let key = weight_type.to_ascii_lowercase();
        match self.quant_gops.get(&key) {
            Some(&g) => (g, format!("{key} kernel")),
            None => (self.fp32_gflops, "fp32 fma".to_string()),
        }
    }

    /// Whether these ceilings were measured on this CPU with this many threads.
    pub fn matches(&self, stamp: &RunStamp, threads: usize) -> bool {
        self.stamp.cpu == stamp.cpu && self.stamp.cores == stamp.cores && self.threads == threads
    }

    pub fn load(path: &Path) -> Result<Ceilings, PerfError> {
        let text = std::fs::read_to_string(path)
            .map_err(|e| PerfError::Io(format!("{}: {e}", path.display())))?;
        serde_json::from_str(&text)
            .map_err(|e| PerfError::Parse(format!("{}: {e}", path.display())))
    }

    pub fn save(&self, path: &Path) -> Result<(), PerfError> {
        if let Some(dir) = path.parent() {
            std::fs::create_dir_all(dir)
                .map_err(|e| PerfError::Io(format!("{}: {e}", dir.display())))?;
        }
        let text = serde_json::to_string_pretty(self).expect("ceilings serialize");
        std::fs::write(path, text + "\n")
            .map_err(|e| PerfError::Io(format!("{}: {e}", path.display())))
    }
}

/// Last-level cache size from sysfs (largest `index*/size`), if known.
pub fn llc_bytes() -> Option<usize> {
    let dir = std::fs::read_dir("/sys/devices/system/cpu/cpu0/cache").ok()?;
    dir.filter_map(|e| {
        let s = std::fs::read_to_string(e.ok()?.path().join("size")).ok()?;
        let s = s.trim();
        let (num, mult) = match s.strip_suffix('K') {
            Some(n) => (n, 1 << 10),
            None => match s.strip_suffix('M') {
                Some(n) => (n, 1 << 20),
                None => (s, 1),
            },
        };
        num.parse::<usize>().ok().map(|n| n * mult)
    })
    .max()
}

/// A streaming-read buffer size: 16× the last-level cache, at least 256 MiB, at most 1 GiB.
pub fn default_buffer_bytes() -> usize {
    let llc = llc_bytes().unwrap_or(32 << 20);
    (16 * llc).clamp(256 << 20, 1 << 30)
}

/// Streaming-read bandwidth in GB/s, one sample per run: `threads` threads each sum their own
/// contiguous share of a `bytes` buffer.
pub fn measure_bandwidth(threads: usize, bytes: usize, runs: usize) -> Vec<f64> {
    let threads = threads.max(1);
    let words = (bytes / 8).div_ceil(threads * 64) * threads * 64;
    let mut buf: Vec<u64> = Vec::with_capacity(words);
    // SAFETY: u64 has no invalid bit patterns; every element is written below, by the thread
    // that will read it (first touch places the pages near it on NUMA machines).
    #[allow(clippy::uninit_vec)]
    unsafe {
        buf.set_len(words)
    };
    let share = words / threads;
    std::thread::scope(|s| {
        for (t, chunk) in buf.chunks_mut(share).enumerate() {
            s.spawn(move || {
                for (i, w) in chunk.iter_mut().enumerate() {
                    *w = (t * share + i) as u64;
                }
            });
        }
    });
    let mut out = Vec::with_capacity(runs);
    // One unmeasured pass warms the TLB and the threads.
    for run in 0..=runs {
        let t0 = Instant::now();
        let total: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = buf
                .chunks(share)
                .map(|chunk| s.spawn(move || sum_words(chunk)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        let secs = t0.elapsed().as_secs_f64();
        black_box(total);
        if run > 0 {
            out.push((words * 8) as f64 / secs / 1e9);
        }
    }
    out
}

/// Sum with eight independent accumulators so the loads, not the adds, bound the loop.
fn sum_words(x: &[u64]) -> u64 {
    let mut acc = [0u64; 8];
    let chunks = x.chunks_exact(8);
    let rest = chunks.remainder();
    for c in chunks {
        for (a, v) in acc.iter_mut().zip(c) {
            *a = a.wrapping_add(*v);
        }
    }
    acc.iter().chain(rest).fold(0u64, |s, v| s.wrapping_add(*v))
}

/// Peak FP32 rate in GFLOP/s on `threads` threads, one sample per run of `iters` loop trips.
pub fn measure_fp32(threads: usize, iters: u64, runs: usize) -> Vec<f64> {
    let threads = threads.max(1);
    let mut out = Vec::with_capacity(runs);
    for run in 0..=runs {
        let t0 = Instant::now();
        let flops: u64 = std::thread::scope(|s| {
            let hs: Vec<_> = (0..threads)
                .map(|t| s.spawn(move || fma_loop(iters, 1.0 + t as f32 * 1e-7)))
                .collect();
            hs.into_iter().map(|h| h.join().unwrap_or(0)).sum()
        });
        let secs = t0.elapsed().as_secs_f64();
        if run > 0 {
            out.push(flops as f64 / secs / 1e9);
        }
    }
    out
}

/// Runs the FMA kernel for `iters` trips; returns the FLOPs it did.
fn fma_loop(iters: u64, seed: f32) -> u64 {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("avx2") && is_x86_feature_detected!("fma") {
        // SAFETY: the features were just detected.
        return unsafe { fma_loop_avx2(iters, seed) };
    }
    // Portable fallback: 8 independent multiply-add chains of 8 lanes each.
    let mut acc = [[seed; 8]; 8];
    let (m, a) = (black_box(0.999_999_9f32), black_box(1e-7f32));
    for _ in 0..iters {
        for lane in acc.iter_mut() {
            for v in lane.iter_mut() {
                *v = v.mul_add(m, a);
            }
        }
    }
    black_box(acc);
    iters * 8 * 8 * 2
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma")]
unsafe fn fma_loop_avx2(iters: u64, seed: f32) -> u64 {
    use std::arch::x86_64::*;
    // 12 chains: an FMA has 4–5 cycles latency and two pipes on current x86 cores.
    const CHAINS: usize = 12;
    let m = _mm256_set1_ps(black_box(0.999_999_9));
    let a = _mm256_set1_ps(black_box(1e-7));
    let mut acc = [_mm256_set1_ps(seed); CHAINS];
    for _ in 0..iters {
        for v in acc.iter_mut() {
            *v = _mm256_fmadd_ps(*v, m, a);
        }
    }
    let mut sum = _mm256_setzero_ps();
    for v in acc {
        sum = _mm256_add_ps(sum, v);
    }
    black_box(sum);
    iters * CHAINS as u64 * 8 * 2
}

/// Measures bandwidth and FP32 peak with default sizes (about a second on a small machine).
/// `quant_gops` is left empty for the caller to fill.
pub fn measure(threads: usize) -> Ceilings {
    let bytes = default_buffer_bytes();
    let bw = measure_bandwidth(threads, bytes, 7);
    let fp = measure_fp32(threads, 4_000_000, 5);
    Ceilings {
        mem_bw_gbps: median(&bw),
        mem_bw_samples: bw,
        mem_buffer_mib: bytes >> 20,
        fp32_gflops: median(&fp),
        fp32_samples: fp,
        quant_gops: BTreeMap::new(),
        threads,
        stamp: RunStamp::collect(),
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn small_measurements_are_positive_and_round_trip() {
        let bw = measure_bandwidth(2, 8 << 20, 2);
        assert_eq!(bw.len(), 2);
        assert!(bw.iter().all(|&g| g > 0.1), "{bw:?}");
        let fp = measure_fp32(1, 100_000, 2);
        assert!(fp.iter().all(|&g| g > 0.1), "{fp:?}");
        let c = Ceilings {
            mem_bw_gbps: median(&bw),
            mem_bw_samples: bw,
            mem_buffer_mib: 8,
            fp32_gflops: median(&fp),
            fp32_samples: fp,
            quant_gops: BTreeMap::from([("q8_0".to_string(), 12.5)]),
            threads: 2,
            stamp: RunStamp::collect(),
        };
        let dir = std::env::temp_dir().join(format!("quire-perf-{}", std::process::id()));
        let path = dir.join("ceilings.json");
        c.save(&path).unwrap();
        let back = Ceilings::load(&path).unwrap();
        assert_eq!(back, c);
        assert_eq!(back.compute_gflops("Q8_0"), (12.5, "q8_0 kernel".into()));
        assert_eq!(back.compute_gflops("F16").1, "fp32 fma");
        std::fs::remove_dir_all(dir).ok();
    }

    #[test]
    fn sums_are_exact() {
        let x: Vec<u64> = (1..=1003).collect();
        assert_eq!(sum_words(&x), 1003 * 1004 / 2);
    }
}
