//! Published ceilings of chips people run LLMs on, to put a measurement from this machine next to
//! what other hardware would allow (`quire roofline --chips`). Decode speed is bounded by
//! bandwidth ÷ bytes per token, prefill by the FLOP rate, so these two numbers per chip are what
//! matters for a first estimate.
//!
//! Sources:
//! - Apple bandwidths: Apple's newsroom announcements of each chip (M1 2020-11, M1 Pro/Max
//!   2021-10, M1 Ultra 2022-03, M2 2022-06, M2 Pro/Max 2023-01, M2 Ultra 2023-06, M3 family
//!   2023-10, M4 2024-05, M4 Pro/Max 2024-10). For M3 Max and M4 Max the top GPU configuration's
//!   figure is given (the binned parts have 300 and 410 GB/s).
//! - Apple FP16 rates: Apple does not publish them. The figures are GPU cores × 128 ALUs × 2
//!   FLOPs × GPU clock, the FP32 rate, with FP16 issued at the same rate as FP32 on these GPUs
//!   (Philip Turner, "metal-benchmarks", github.com/philipturner/metal-benchmarks). Some tables
//!   list twice that; treat these as ±10% estimates for the largest GPU configuration.
//! - NVIDIA H100 SXM5: "NVIDIA H100 Tensor Core GPU" datasheet: 3.35 TB/s HBM3, 989.4 dense
//!   BF16 TFLOP/s (1,979 with 2:4 sparsity).
//! - NVIDIA H200 SXM: NVIDIA H200 product page / datasheet: 4.8 TB/s HBM3e, same tensor cores as
//!   H100 SXM, 989 dense BF16 TFLOP/s (1,979 sparse).

use serde::Serialize;

#[derive(Debug, Clone, Copy, PartialEq, Serialize)]
pub struct Chip {
    pub name: &'static str,
    /// Memory bandwidth, GB/s.
    pub mem_bw_gbps: f64,
    /// Dense half-precision rate, TFLOP/s (FP16 for Apple GPUs, BF16 tensor cores for NVIDIA).
    pub half_tflops: f64,
    pub note: &'static str,
}

impl Chip {
    /// Arithmetic intensity (FLOP/byte) where compute and bandwidth roofs meet.
    pub fn ridge(&self) -> f64 {
        self.half_tflops * 1e3 / self.mem_bw_gbps
    }
}

const APPLE: &str = "GPU FP16 = FP32 rate, estimate";

pub const CHIPS: &[Chip] = &[
    chip("Apple M1 (8-core GPU)", 68.25, 2.6, APPLE),
    chip("Apple M1 Pro (16-core GPU)", 200.0, 5.2, APPLE),
    chip("Apple M1 Max (32-core GPU)", 400.0, 10.4, APPLE),
    chip("Apple M1 Ultra (64-core GPU)", 800.0, 21.0, APPLE),
    chip("Apple M2 (10-core GPU)", 100.0, 3.6, APPLE),
    chip("Apple M2 Pro (19-core GPU)", 200.0, 6.8, APPLE),
    chip("Apple M2 Max (38-core GPU)", 400.0, 13.6, APPLE),
    chip("Apple M2 Ultra (76-core GPU)", 800.0, 27.2, APPLE),
    chip("Apple M3 (10-core GPU)", 100.0, 3.6, APPLE),
    chip("Apple M3 Pro (18-core GPU)", 150.0, 6.4, APPLE),
    chip("Apple M3 Max (40-core GPU)", 400.0, 14.2, APPLE),
    chip("Apple M4 (10-core GPU)", 120.0, 4.3, APPLE),
    chip("Apple M4 Pro (20-core GPU)", 273.0, 8.5, APPLE),
    chip("Apple M4 Max (40-core GPU)", 546.0, 17.0, APPLE),
    chip(
        "NVIDIA H100 SXM5 80GB",
        3350.0,
        989.4,
        "dense BF16 tensor cores (1979 sparse)",
    ),
    chip(
        "NVIDIA H200 SXM 141GB",
        4800.0,
        989.4,
        "dense BF16 tensor cores (1979 sparse)",
    ),
];

/// The table's entry for a CUDA device name (as `cuDeviceGetName` reports it), when the name
/// identifies one of its chips: "NVIDIA H100 80GB HBM3" is the H100 SXM5, "NVIDIA H200" the H200
/// SXM. Other parts (H100 PCIe and NVL, H200 NVL, GH200) have other clocks or memory and are not
/// in the table, so they get `None` rather than a wrong figure.
pub fn for_device(name: &str) -> Option<&'static Chip> {
    let words: Vec<String> = name
        .split_whitespace()
        .map(|w| w.to_ascii_uppercase())
        .collect();
    let has = |w: &str| words.iter().any(|x| x == w);
    if has("NVL") || has("PCIE") {
        return None;
    }
    let prefix = if has("H100") && has("HBM3") {
        "NVIDIA H100 SXM5"
    } else if has("H200") {
        "NVIDIA H200 SXM"
    } else {
        return None;
    };
    CHIPS.iter().find(|c| c.name.starts_with(prefix))
}

const fn chip(name: &'static str, bw: f64, tf: f64, note: &'static str) -> Chip {
    Chip {
        name,
        mem_bw_gbps: bw,
        half_tflops: tf,
        note,
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn table_is_sane() {
        assert!(CHIPS.len() >= 16);
        let h100 = CHIPS.iter().find(|c| c.name.contains("H100")).unwrap();
        let h200 = CHIPS.iter().find(|c| c.name.contains("H200")).unwrap();
        assert_eq!((h100.mem_bw_gbps, h200.mem_bw_gbps), (3350.0, 4800.0));
        assert!(CHIPS.iter().all(|c| c.ridge() > 1.0 && c.ridge() < 1000.0));
    }

    #[test]
    fn device_names_find_their_chip_or_none() {
        let tf = |n: &str| for_device(n).map(|c| c.half_tflops);
        assert_eq!(tf("NVIDIA H100 80GB HBM3"), Some(989.4));
        assert_eq!(tf("NVIDIA H200"), Some(989.4));
        assert_eq!(
            for_device("NVIDIA H200").unwrap().name,
            "NVIDIA H200 SXM 141GB"
        );
        for other in [
            "NVIDIA H100 PCIe",
            "NVIDIA H100 NVL",
            "NVIDIA H200 NVL",
            "NVIDIA GH200 480GB",
            "NVIDIA A100-SXM4-80GB",
            "NVIDIA GeForce RTX 4090",
            "CUDA device",
            "",
        ] {
            assert_eq!(for_device(other), None, "{other}");
        }
    }
}
