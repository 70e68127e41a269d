//! The roofs a benchmark run is placed under ("% of ceiling"): the device's memory bandwidth and,
//! when known, its compute peak — the CPU's measured by `quire roofline`, the GPU's by
//! `gpu_ceilings`.

use quire_perf::Ceilings;

/// The roofs one model's runs are placed under: the device's memory bandwidth and, when known,
/// its compute peak for the model's weight type (GOP/s, with the roof's name).
#[derive(Debug, Clone, PartialEq)]
pub struct Roofs {
    pub mem_bw_gbps: f64,
    pub compute: Option<(f64, String)>,
}

impl Roofs {
    /// The CPU's: measured bandwidth and the roof `Ceilings::compute_gflops` picks.
    pub fn cpu(c: &Ceilings, weight_type: &str) -> Roofs {
        Roofs {
            mem_bw_gbps: c.mem_bw_gbps,
            compute: Some(c.compute_gflops(weight_type)),
        }
    }

    /// Where a run sits under the roofs: (percent of the attainable rate, which roof bounds it).
    /// With no compute peak known, the memory roof is the only one.
    pub fn pct_of_ceiling(&self, bytes: f64, flops: f64, ns: f64) -> (f64, String) {
        let mem = self.mem_bw_gbps * flops / bytes;
        let achieved = flops / ns;
        match &self.compute {
            Some((peak, label)) if *peak <= mem => {
                (100.0 * achieved / peak, format!("{label} {peak:.1} GOP/s"))
            }
            _ => (
                100.0 * achieved / mem,
                format!("memory {:.1} GB/s", self.mem_bw_gbps),
            ),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn pct_of_ceiling_picks_the_lower_roof() {
        let r = Roofs {
            mem_bw_gbps: 100.0,
            compute: Some((1000.0, "fp32 fma".into())),
        };
        // Intensity 1 FLOP/B: memory allows 100 GFLOP/s; 50 GFLOP/s achieved.
        let (pct, bound) = r.pct_of_ceiling(1e9, 1e9, 2e7);
        assert!((pct - 50.0).abs() < 1e-9, "{pct}");
        assert_eq!(bound, "memory 100.0 GB/s");
        // Intensity 100 FLOP/B: compute bounds at 1000 GFLOP/s; 500 achieved.
        let (pct, bound) = r.pct_of_ceiling(1e9, 1e11, 2e8);
        assert!((pct - 50.0).abs() < 1e-9, "{pct}");
        assert_eq!(bound, "fp32 fma 1000.0 GOP/s");
        // No compute peak known: always against memory.
        let m = Roofs { compute: None, ..r };
        let (pct, bound) = m.pct_of_ceiling(1e9, 1e11, 2e8);
        assert!((pct - 5.0).abs() < 1e-9, "{pct}");
        assert_eq!(bound, "memory 100.0 GB/s");
    }
}
