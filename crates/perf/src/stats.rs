//! Summary statistics of timing samples. Benchmarks report a mean ± sample standard deviation
//! (llama-bench's convention, so tables compare) and the order statistics that tell a noisy run
//! from a slow one: median, p10/p90 and p99.
//!
//! Percentiles interpolate linearly between the two closest ranks (the "linear" method of
//! Hyndman & Fan, definition 7, numpy's default), so they are exact and reproducible on small
//! samples such as five repetitions.

use serde::{Deserialize, Serialize};

/// Summary of a sample. Every field is `NaN` for an empty sample; `stddev` is 0 for one sample.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct Summary {
    pub n: usize,
    pub mean: f64,
    /// Sample standard deviation (divides by n − 1).
    pub stddev: f64,
    pub min: f64,
    pub max: f64,
    pub median: f64,
    pub p10: f64,
    pub p90: f64,
    pub p99: f64,
}

impl Summary {
    pub fn of(samples: &[f64]) -> Summary {
        let n = samples.len();
        if n == 0 {
            return Summary {
                n,
                mean: f64::NAN,
                stddev: f64::NAN,
                min: f64::NAN,
                max: f64::NAN,
                median: f64::NAN,
                p10: f64::NAN,
                p90: f64::NAN,
                p99: f64::NAN,
            };
        }
        let mut sorted = samples.to_vec();
        sorted.sort_by(f64::total_cmp);
        Summary {
            n,
            mean: mean(samples),
            stddev: stddev(samples),
            min: sorted[0],
            max: sorted[n - 1],
            median: percentile_sorted(&sorted, 50.0),
            p10: percentile_sorted(&sorted, 10.0),
            p90: percentile_sorted(&sorted, 90.0),
            p99: percentile_sorted(&sorted, 99.0),
        }
    }

    /// Coefficient of variation (stddev / mean).
    pub fn cv(&self) -> f64 {
        self.stddev / self.mean
    }
}

pub fn mean(x: &[f64]) -> f64 {
    if x.is_empty() {
        return f64::NAN;
    }
    x.iter().sum::<f64>() / x.len() as f64
}

/// Sample variance (n − 1 in the denominator); 0 for a single sample.
pub fn variance(x: &[f64]) -> f64 {
    match x.len() {
        0 => f64::NAN,
        1 => 0.0,
        n => {
            let m = mean(x);
            x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / (n - 1) as f64
        }
    }
}

pub fn stddev(x: &[f64]) -> f64 {
    variance(x).sqrt()
}

/// The `q`-th percentile (0..=100) of an ascending sample, linearly interpolated.
pub fn percentile_sorted(sorted: &[f64], q: f64) -> f64 {
    let n = sorted.len();
    if n == 0 {
        return f64::NAN;
    }
    let h = (n - 1) as f64 * (q.clamp(0.0, 100.0) / 100.0);
    let lo = h.floor() as usize;
    let hi = (lo + 1).min(n - 1);
    sorted[lo] + (h - lo as f64) * (sorted[hi] - sorted[lo])
}

/// The `q`-th percentile of an unsorted sample.
pub fn percentile(x: &[f64], q: f64) -> f64 {
    let mut s = x.to_vec();
    s.sort_by(f64::total_cmp);
    percentile_sorted(&s, q)
}

pub fn median(x: &[f64]) -> f64 {
    percentile(x, 50.0)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn exact_on_known_inputs() {
        let s = Summary::of(&[2.0, 4.0, 4.0, 4.0, 5.0, 5.0, 7.0, 9.0]);
        assert_eq!(s.n, 8);
        assert_eq!(s.mean, 5.0);
        // Sum of squared deviations is 32; 32 / 7.
        assert!((s.stddev - (32.0f64 / 7.0).sqrt()).abs() < 1e-15);
        assert_eq!(s.median, 4.5);
        assert_eq!(s.min, 2.0);
        assert_eq!(s.max, 9.0);
        // h = 7 * 0.1 = 0.7 → 2 + 0.7 * (4 - 2)
        assert!((s.p10 - 3.4).abs() < 1e-12);
        // h = 6.3 → 7 + 0.3 * 2
        assert!((s.p90 - 7.6).abs() < 1e-12);
        // h = 6.93 → 7 + 0.93 * 2
        assert!((s.p99 - 8.86).abs() < 1e-12);
    }

    #[test]
    fn percentiles_of_one_to_hundred_one() {
        let x: Vec<f64> = (0..=100).rev().map(f64::from).collect();
        assert_eq!(percentile(&x, 10.0), 10.0);
        assert_eq!(percentile(&x, 99.0), 99.0);
        assert_eq!(median(&x), 50.0);
        assert_eq!(percentile(&x, 0.0), 0.0);
        assert_eq!(percentile(&x, 100.0), 100.0);
    }

    #[test]
    fn degenerate_samples() {
        let one = Summary::of(&[3.0]);
        assert_eq!(
            (one.mean, one.stddev, one.median, one.p99),
            (3.0, 0.0, 3.0, 3.0)
        );
        assert!(Summary::of(&[]).mean.is_nan());
        assert_eq!(median(&[1.0, 3.0]), 2.0);
    }
}
