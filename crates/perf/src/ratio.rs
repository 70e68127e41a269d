//! How much faster is B than A, and is the difference real? `quire compare` answers with the
//! ratio of mean throughputs and a 95% confidence interval from Welch's t-interval on the
//! logarithms of the samples.
//!
//! Why logs: throughput is a ratio-scale quantity whose noise is multiplicative (a background task
//! costs a fraction of the speed, not a fixed number of tokens/s). On the log scale the ratio B/A
//! becomes a difference of means, the noise is closer to symmetric, and the interval maps back to
//! a ratio interval that can never include zero or negative speeds. Why Welch and not a
//! bootstrap: benchmarks have few repetitions (llama-bench's default is 5); a percentile bootstrap
//! of 5 samples has only 126 distinct resamples per side and its intervals are known to be too
//! narrow, while Welch's t-interval keeps its coverage for small normal-ish samples and does not
//! assume equal variances. The interval is centred on the ratio of geometric means; the reported
//! point estimate is the ratio of arithmetic means (`avg_ts`, llama-bench's number), which lies
//! within a fraction of a percent of it whenever the spread is a few percent.
//!
//! The t quantile comes from the Student t CDF written with the regularized incomplete beta
//! function, evaluated by its continued fraction (DLMF 8.17.22) and inverted by bisection.

use serde::{Deserialize, Serialize};

use crate::stats::{mean, variance};

/// A ratio B/A with its confidence interval.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct RatioCi {
    /// mean(B) / mean(A).
    pub ratio: f64,
    pub lo: f64,
    pub hi: f64,
    /// Confidence level of `lo..=hi`, e.g. 0.95.
    pub level: f64,
    /// Welch–Satterthwaite degrees of freedom (infinite when both samples are constant).
    pub df: f64,
}

impl RatioCi {
    /// The interval excludes 1: B and A differ at this confidence level.
    pub fn significant(&self) -> bool {
        self.lo > 1.0 || self.hi < 1.0
    }
}

/// Ratio of means B/A with a `level` confidence interval (Welch on logs). `None` when a side has
/// fewer than two samples or a sample is not positive.
pub fn ratio_ci(a: &[f64], b: &[f64], level: f64) -> Option<RatioCi> {
    if a.len() < 2 || b.len() < 2 || a.iter().chain(b).any(|&x| !(x > 0.0 && x.is_finite())) {
        return None;
    }
    let la: Vec<f64> = a.iter().map(|x| x.ln()).collect();
    let lb: Vec<f64> = b.iter().map(|x| x.ln()).collect();
    let d = mean(&lb) - mean(&la);
    let va = variance(&la) / la.len() as f64;
    let vb = variance(&lb) / lb.len() as f64;
    let se = (va + vb).sqrt();
    let df = if se == 0.0 {
        f64::INFINITY
    } else {
        (va + vb).powi(2) / (va * va / (la.len() - 1) as f64 + vb * vb / (lb.len() - 1) as f64)
    };
    let t = if se == 0.0 {
        0.0
    } else {
        t_quantile(0.5 + level / 2.0, df)
    };
    Some(RatioCi {
        ratio: mean(b) / mean(a),
        lo: (d - t * se).exp(),
        hi: (d + t * se).exp(),
        level,
        df,
    })
}

/// Quantile `p` (0.5 ≤ p < 1) of Student's t distribution with `df` degrees of freedom.
pub fn t_quantile(p: f64, df: f64) -> f64 {
    assert!((0.5..1.0).contains(&p), "t_quantile wants 0.5 <= p < 1");
    // Beyond a million degrees of freedom the t and normal quantiles agree to 1e-6.
    let df = df.min(1e6);
    let (mut lo, mut hi) = (0.0f64, 1.0f64);
    while t_cdf(hi, df) < p {
        hi *= 2.0;
    }
    for _ in 0..200 {
        let mid = 0.5 * (lo + hi);
        if t_cdf(mid, df) < p {
            lo = mid;
        } else {
            hi = mid;
        }
    }
    0.5 * (lo + hi)
}

/// P(T ≤ t) for Student's t with `df` degrees of freedom.
pub fn t_cdf(t: f64, df: f64) -> f64 {
    let x = df / (df + t * t);
    let tail = 0.5 * inc_beta(x, df / 2.0, 0.5);
    if t >= 0.0 {
        1.0 - tail
    } else {
        tail
    }
}

/// Regularized incomplete beta function I_x(a, b).
pub fn inc_beta(x: f64, a: f64, b: f64) -> f64 {
    if x <= 0.0 {
        return 0.0;
    }
    if x >= 1.0 {
        return 1.0;
    }
    // The continued fraction converges fast below (a + 1) / (a + b + 2); use the symmetry
    // I_x(a, b) = 1 − I_{1−x}(b, a) above it.
    if x > (a + 1.0) / (a + b + 2.0) {
        return 1.0 - inc_beta(1.0 - x, b, a);
    }
    let ln_front = a * x.ln() + b * (1.0 - x).ln() - ln_beta(a, b) - a.ln();
    ln_front.exp() * beta_fraction(x, a, b)
}

/// The continued fraction 1 / (1 + d1 / (1 + d2 / (1 + …))) of DLMF 8.17.22, by the modified
/// Lentz method.
fn beta_fraction(x: f64, a: f64, b: f64) -> f64 {
    const TINY: f64 = 1e-300;
    let coeff = |k: usize| -> f64 {
        let m = (k / 2) as f64;
        if k % 2 == 1 {
            -(a + m) * (a + b + m) * x / ((a + 2.0 * m) * (a + 2.0 * m + 1.0))
        } else {
            m * (b - m) * x / ((a + 2.0 * m - 1.0) * (a + 2.0 * m))
        }
    };
    // f = 1 / (1 + d1 / (1 + d2 / …)): evaluate g = 1 + d1 / (1 + d2 / …) with Lentz.
    let mut f = 1.0f64;
    let mut c = 1.0f64;
    let mut d = 0.0f64;
    for k in 1..20_000 {
        let dk = coeff(k);
        d = 1.0 + dk * d;
        if d.abs() < TINY {
            d = TINY;
        }
        c = 1.0 + dk / c;
        if c.abs() < TINY {
            c = TINY;
        }
        d = 1.0 / d;
        let delta = c * d;
        f *= delta;
        if (delta - 1.0).abs() < 1e-15 {
            break;
        }
    }
    1.0 / f
}

fn ln_beta(a: f64, b: f64) -> f64 {
    ln_gamma(a) + ln_gamma(b) - ln_gamma(a + b)
}

/// ln Γ(x) for x > 0: Stirling's series after shifting x above 10 with Γ(x + 1) = x Γ(x).
pub fn ln_gamma(x: f64) -> f64 {
    let mut x = x;
    let mut shift = 0.0;
    while x < 10.0 {
        shift += x.ln();
        x += 1.0;
    }
    let x2 = x * x;
    let series = 1.0 / (12.0 * x) - 1.0 / (360.0 * x * x2) + 1.0 / (1260.0 * x * x2 * x2)
        - 1.0 / (1680.0 * x * x2 * x2 * x2);
    (x - 0.5) * x.ln() - x + 0.5 * (2.0 * std::f64::consts::PI).ln() + series - shift
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gamma_and_t_quantiles_match_tables() {
        assert!((ln_gamma(1.0)).abs() < 1e-12);
        assert!((ln_gamma(0.5) - std::f64::consts::PI.sqrt().ln()).abs() < 1e-12);
        assert!((ln_gamma(20.0) - 39.339884187199494).abs() < 1e-10);
        for (df, want) in [
            (1.0, 12.706204736174698),
            (4.0, 2.7764451051977934),
            (10.0, 2.2281388519862744),
            (30.0, 2.0422724563012373),
            // Capped at 1e6 degrees of freedom: t = z + (z³ + z) / 4ν ≈ z + 2.4e-6.
            (1e9, 1.959966357),
        ] {
            let got = t_quantile(0.975, df);
            assert!((got - want).abs() < 2e-6, "df {df}: {got} vs {want}");
        }
        assert!((t_cdf(0.0, 3.0) - 0.5).abs() < 1e-15);
    }

    #[test]
    fn identical_samples_cover_one() {
        let a = [100.0, 102.0, 98.0, 101.0, 99.0];
        let ci = ratio_ci(&a, &a, 0.95).unwrap();
        assert_eq!(ci.ratio, 1.0);
        assert!(ci.lo < 1.0 && ci.hi > 1.0 && !ci.significant(), "{ci:?}");
        let flat = [5.0, 5.0, 5.0];
        let ci = ratio_ci(&flat, &flat, 0.95).unwrap();
        assert!(ci.lo <= 1.0 && ci.hi >= 1.0 && !ci.significant());
    }

    #[test]
    fn clearly_different_samples_exclude_one() {
        let a = [100.0, 102.0, 98.0, 101.0, 99.0];
        let b = [120.0, 123.0, 118.0, 121.0, 119.5];
        let ci = ratio_ci(&a, &b, 0.95).unwrap();
        assert!(ci.significant() && ci.lo > 1.15 && ci.hi < 1.25, "{ci:?}");
        assert!(ci.lo <= ci.ratio && ci.ratio <= ci.hi);
        let back = ratio_ci(&b, &a, 0.95).unwrap();
        assert!(back.hi < 1.0 && back.significant());
    }

    #[test]
    fn overlapping_noisy_samples_are_not_significant() {
        let a = [100.0, 130.0, 80.0, 115.0, 90.0];
        let b = [105.0, 85.0, 125.0, 95.0, 110.0];
        assert!(!ratio_ci(&a, &b, 0.95).unwrap().significant());
        assert!(ratio_ci(&[1.0], &a, 0.95).is_none());
        assert!(ratio_ci(&[1.0, 0.0], &a, 0.95).is_none());
    }
}
