//! Profiled steps of the wgpu executor: what each op costs a step on the device (GPU
//! timestamps around the whole step with and without the op's dispatches), or the wall clock
//! around one submission per dispatch where the adapter has no timestamps. Kept apart from
//! executor.rs, which runs the steps, so each file stays readable.

use std::time::Instant;

use super::WgpuExecutor;
use crate::wgpu::gpu::Timestamps;
use crate::wgpu::kernels;
use crate::{BackendError, OpStat};

/// Rounds of a profiled step's timing passes (each op's cost is a difference of medians).
pub(super) const OMISSION_ROUNDS: usize = 5;

impl WgpuExecutor {
    /// Profiling on a device without timestamp queries: runs the step's dispatches one
    /// submission each, timed by the wall clock around the submission (so each includes a
    /// submission's overhead), before the step runs as usual. The KV write is idempotent, so
    /// running a step's dispatches twice changes nothing.
    pub(super) fn time_each(&mut self) -> Result<(), BackendError> {
        for i in 0..self.list.len() {
            let t = Instant::now();
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            kernels::encode(&mut enc, std::slice::from_ref(&self.list[i]));
            self.gpu.submit_wait(enc.finish())?;
            let d = &self.list[i];
            let (name, bytes, flops) = (d.name, d.bytes, d.flops);
            self.add_stat(name, t.elapsed().as_nanos() as u64, bytes, flops);
        }
        Ok(())
    }

    /// Profiling with timestamps: what each op costs the step, measured as the device time of
    /// the whole step (one timestamp at its start, one at its end) minus that of the step with
    /// the op's dispatches left out, medians of [`OMISSION_ROUNDS`] rounds, before the step runs
    /// as usual. A timestamp pair around each dispatch would be simpler, but on NVIDIA's Vulkan
    /// driver each pair drains the GPU and adds microseconds to every dispatch, more than many
    /// of them take. Leaving dispatches out changes the values the rest compute, never their
    /// time (no kernel's work depends on the values), and the real step then recomputes
    /// everything, its K/V writes included.
    pub(super) fn time_by_omission(&mut self) -> Result<(), BackendError> {
        let mut names: Vec<&'static str> = Vec::new();
        for d in self.list.iter().filter(|d| d.runs()) {
            if !names.contains(&d.name) {
                names.push(d.name);
            }
        }
        let passes = names.len() + 1;
        if self.timer.as_ref().is_none_or(|t| t.cap < passes) {
            self.timer = self.gpu.timer(passes)?;
        }
        let timer = self.timer.as_ref().expect("the device has timestamps");
        let mut samples = vec![Vec::new(); passes];
        for _ in 0..OMISSION_ROUNDS {
            let mut enc = self.gpu.device.create_command_encoder(&Default::default());
            for k in 0..passes {
                let skip = k.checked_sub(1).map(|i| names[i]);
                let list: Vec<kernels::Dispatch> = self
                    .list
                    .iter()
                    .filter(|d| Some(d.name) != skip)
                    .cloned()
                    .collect();
                let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                    label: Some("quire step (profiled)"),
                    timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                        query_set: &timer.set,
                        beginning_of_pass_write_index: Some(2 * k as u32),
                        end_of_pass_write_index: Some(2 * k as u32 + 1),
                    }),
                });
                kernels::record_all(&mut pass, &list);
            }
            timer.resolve(&mut enc, passes);
            self.gpu.submit_wait(enc.finish())?;
            for (k, ns) in timer.read(&self.gpu, passes)?.into_iter().enumerate() {
                samples[k].push(ns);
            }
        }
        let median = |v: &mut Vec<f64>| {
            v.sort_by(f64::total_cmp);
            v[v.len() / 2]
        };
        let full = median(&mut samples[0]);
        self.step_device_ns = Some(full.round() as u64);
        for (i, name) in names.into_iter().enumerate() {
            let ns = (full - median(&mut samples[i + 1])).max(0.0).round() as u64;
            let of = |f: fn(&kernels::Dispatch) -> u64| -> u64 {
                self.list.iter().filter(|d| d.name == name).map(f).sum()
            };
            let calls = of(|d| d.runs() as u64);
            let (bytes, flops) = (of(|d| d.bytes), of(|d| d.flops));
            self.add_stat(name, ns, bytes, flops);
            if let Some(s) = self.profile.iter_mut().find(|s| s.name == name) {
                s.calls += calls - 1;
            }
        }
        Ok(())
    }

    fn add_stat(&mut self, name: &str, ns: u64, bytes: u64, flops: u64) {
        match self.profile.iter_mut().find(|s| s.name == name) {
            Some(s) => {
                s.calls += 1;
                s.total_ns += ns;
                s.bytes += bytes;
                s.flops += flops;
            }
            None => self.profile.push(OpStat {
                name: name.to_string(),
                layer: None,
                calls: 1,
                total_ns: ns,
                bytes,
                flops,
            }),
        }
    }

    /// How profiled steps are timed on this device, in words (for tools to print).
    pub fn timing(&self) -> &'static str {
        match self.gpu.caps.timestamps {
            Timestamps::InsidePasses | Timestamps::PassBoundaries => {
                "GPU timestamps around the whole step, with and without each op's dispatches"
            }
            Timestamps::None => {
                "no timestamp queries on this adapter: wall clock around one submission per dispatch"
            }
        }
    }
}
