//! The GPU's ceilings for `quire bench --backend cuda` and `quire roofline --backend cuda`:
//! memory bandwidth measured by device-to-device copies (bytes read plus bytes written), and the
//! dense f16/bf16 tensor-core peak from the datasheet figures in `quire_perf::chips` when the
//! device name identifies a chip there (else unknown: runs are then placed against memory only).
//! Not cached: measuring takes well under a second after the CUDA context is up.

use anyhow::Result;
use quire_backend::cuda::gpu::Gpu;
use quire_perf::chips::{self, Chip};
use serde::Serialize;

use crate::roofs::Roofs;

/// Size of the copied buffer (less when free GPU memory is short).
const COPY_BYTES: usize = 1 << 30;
/// Timed copies (after two untimed ones).
const COPY_RUNS: usize = 10;

#[derive(Debug, Clone, PartialEq, Serialize)]
pub struct GpuCeilings {
    /// The device name the driver reports.
    pub device: String,
    /// Median device-to-device copy bandwidth, GB/s; a copy of S bytes counts 2·S (read + write).
    pub copy_gbps: f64,
    pub copy_samples: Vec<f64>,
    pub copy_buffer_mib: usize,
    /// The datasheet entry for `device`, if the chip table has it.
    pub chip: Option<Chip>,
}

impl GpuCeilings {
    /// Measures device 0 (the one the CUDA executor uses) and frees everything it allocated.
    pub fn measure() -> Result<GpuCeilings> {
        eprintln!("measuring the GPU's copy bandwidth…");
        let g = Gpu::new(0)?;
        let bw = g.copy_bandwidth(COPY_BYTES, COPY_RUNS)?;
        Ok(Self::new(&g.name, bw.gbps, bw.samples, bw.bytes >> 20))
    }

    pub fn new(device: &str, copy_gbps: f64, samples: Vec<f64>, buffer_mib: usize) -> Self {
        GpuCeilings {
            device: device.to_string(),
            copy_gbps,
            copy_samples: samples,
            copy_buffer_mib: buffer_mib,
            chip: chips::for_device(device).copied(),
        }
    }

    /// The tensor-core peak in GFLOP/s, for every weight type (quantized weights are multiplied
    /// as f16 by cuBLAS in prefill, and no integer peak is in the table).
    pub fn tensor_gflops(&self) -> Option<f64> {
        self.chip.map(|c| c.half_tflops * 1e3)
    }

    pub fn roofs(&self) -> Roofs {
        Roofs {
            mem_bw_gbps: self.copy_gbps,
            compute: self.tensor_gflops().map(|g| (g, "f16-tensor".to_string())),
        }
    }

    /// One line for the report, like the CPU's "ceilings (N threads): …".
    pub fn line(&self) -> String {
        let compute = match &self.chip {
            Some(c) => format!(
                "f16 tensor {:.0} TFLOP/s (datasheet: {})",
                c.half_tflops, c.name
            ),
            None => "tensor peak unknown (device not in the chip table), % against memory only"
                .to_string(),
        };
        format!(
            "ceilings ({}): copy {:.0} GB/s measured (read + write, {} MiB buffer), {compute}",
            self.device, self.copy_gbps, self.copy_buffer_mib
        )
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn known_gpu_gets_its_tensor_peak_and_copy_bandwidth() {
        let g = GpuCeilings::new("NVIDIA H100 80GB HBM3", 3000.0, vec![3000.0], 1024);
        let r = g.roofs();
        assert_eq!(r.mem_bw_gbps, 3000.0);
        assert_eq!(r.compute, Some((989_400.0, "f16-tensor".to_string())));
        assert_eq!(
            g.line(),
            "ceilings (NVIDIA H100 80GB HBM3): copy 3000 GB/s measured (read + write, 1024 MiB \
             buffer), f16 tensor 989 TFLOP/s (datasheet: NVIDIA H100 SXM5 80GB)"
        );
        // tg on a 1 GB model: 1000 forwards/s reads 1000 GB/s, a third of the copy roof.
        let (pct, bound) = r.pct_of_ceiling(128e9, 2.0 * 0.5e9 * 128.0, 128e6);
        assert!((pct - 100.0 / 3.0).abs() < 1e-9, "{pct}");
        assert_eq!(bound, "memory 3000.0 GB/s");
        // pp512 of an 8B model (intensity far past the ridge) is placed under the tensor roof.
        let (pct, bound) = r.pct_of_ceiling(16e9, 2.0 * 8e9 * 512.0, 100e6);
        assert!((pct - 81_920.0 / 989_400.0 * 100.0).abs() < 1e-9, "{pct}");
        assert_eq!(bound, "f16-tensor 989400.0 GOP/s");
    }

    #[test]
    fn unknown_gpu_is_placed_against_memory_only() {
        let g = GpuCeilings::new("NVIDIA H100 PCIe", 1800.0, vec![1800.0], 1024);
        assert_eq!(g.tensor_gflops(), None);
        assert!(g.line().contains("tensor peak unknown"), "{}", g.line());
        let (pct, bound) = g.roofs().pct_of_ceiling(16e9, 1.6e13, 100e6);
        assert!((pct - 16e9 / 100e6 / 1800.0 * 100.0).abs() < 1e-9, "{pct}");
        assert_eq!(bound, "memory 1800.0 GB/s");
    }
}
