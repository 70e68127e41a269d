//! The wgpu adapter's ceilings for `quire roofline --backend wgpu` and `quire profile --backend
//! wgpu`: read bandwidth measured by a plain 16-byte-load read of the largest buffer one binding
//! allows (up to 1 GiB), timed by GPU timestamps where the adapter has them (else the wall clock
//! around each submission, which counts the submission's overhead too). The matrix peak is
//! measured by `quire roofline --backend wgpu` through the backend's matmul kernel.

use anyhow::Result;
use quire_backend::wgpu::probe::Probe;
use serde::Serialize;

const READ_BYTES: u64 = 1 << 30;
const READ_RUNS: usize = 10;

#[derive(Debug, Clone, Serialize)]
pub struct WgpuCeilings {
    pub adapter: String,
    pub backend: String,
    pub driver: String,
    /// Median read bandwidth, GB/s.
    pub read_gbps: f64,
    pub read_samples: Vec<f64>,
    pub read_buffer_mib: u64,
    /// Whether the times are GPU timestamps (else wall clock).
    pub gpu_timestamps: bool,
}

impl WgpuCeilings {
    pub fn measure(p: &mut Probe) -> Result<WgpuCeilings> {
        eprintln!("measuring the adapter's read bandwidth…");
        let (bytes, secs, gpu) = p.read_bandwidth(READ_BYTES, READ_RUNS)?;
        let samples: Vec<f64> = secs.iter().map(|s| bytes as f64 / s / 1e9).collect();
        let i = &p.gpu.info;
        Ok(WgpuCeilings {
            adapter: i.name.clone(),
            backend: i.backend.clone(),
            driver: i.driver.clone(),
            read_gbps: quire_perf::stats::median(&samples),
            read_samples: samples,
            read_buffer_mib: bytes >> 20,
            gpu_timestamps: gpu,
        })
    }

    pub fn line(&self) -> String {
        format!(
            "ceilings ({}, {} {}): read {:.0} GB/s measured ({} MiB buffer, {})",
            self.adapter,
            self.backend,
            self.driver,
            self.read_gbps,
            self.read_buffer_mib,
            if self.gpu_timestamps {
                "GPU timestamps"
            } else {
                "wall clock: the adapter has no timestamp queries"
            }
        )
    }
}
