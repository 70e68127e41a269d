//! Per-op GPU time from CUDA events: an event is recorded after each op of a profiled step, and
//! each op's time is the gap to the event before it. Off by default (no events recorded).

use cudarc::driver::{sys, CudaEvent};

use super::gpu::{cuda_err, Gpu};
use crate::{BackendError, OpStat};

#[derive(Default)]
pub struct EventProfiler {
    on: bool,
    pool: Vec<CudaEvent>,
    used: usize,
    marks: Vec<(&'static str, Option<usize>, u64, u64)>,
    stats: Vec<OpStat>,
}

impl EventProfiler {
    pub fn set(&mut self, on: bool) {
        self.on = on;
    }

    pub fn is_on(&self) -> bool {
        self.on
    }

    fn record(&mut self, g: &Gpu) -> Result<(), BackendError> {
        if self.used == self.pool.len() {
            let e = g
                .ctx
                .new_event(Some(sys::CUevent_flags::CU_EVENT_DEFAULT))
                .map_err(cuda_err("cuEventCreate"))?;
            self.pool.push(e);
        }
        self.pool[self.used]
            .record(&g.stream)
            .map_err(cuda_err("cuEventRecord"))?;
        self.used += 1;
        Ok(())
    }

    pub fn start(&mut self, g: &Gpu) -> Result<(), BackendError> {
        self.used = 0;
        self.marks.clear();
        if self.on {
            self.record(g)?;
        }
        Ok(())
    }

    /// Ends the op `name` that ran since the last mark.
    pub fn mark(
        &mut self,
        g: &Gpu,
        name: &'static str,
        layer: Option<usize>,
        bytes: usize,
        flops: usize,
    ) -> Result<(), BackendError> {
        if self.on {
            self.record(g)?;
            self.marks.push((name, layer, bytes as u64, flops as u64));
        }
        Ok(())
    }

    /// Reads the step's events (the stream must be synchronized) into the statistics.
    pub fn finish(&mut self, _g: &Gpu) -> Result<(), BackendError> {
        if !self.on {
            return Ok(());
        }
        for (i, &(name, layer, bytes, flops)) in self.marks.iter().enumerate() {
            let ms = self.pool[i]
                .elapsed_ms(&self.pool[i + 1])
                .map_err(cuda_err("cuEventElapsedTime"))?;
            let ns = (ms as f64 * 1e6) as u64;
            match self
                .stats
                .iter_mut()
                .find(|s| s.name == name && s.layer == layer)
            {
                Some(s) => {
                    s.calls += 1;
                    s.total_ns += ns;
                    s.bytes += bytes;
                    s.flops += flops;
                }
                None => self.stats.push(OpStat {
                    name: name.to_string(),
                    layer,
                    calls: 1,
                    total_ns: ns,
                    bytes,
                    flops,
                }),
            }
        }
        Ok(())
    }

    pub fn take(&mut self) -> Vec<OpStat> {
        std::mem::take(&mut self.stats)
    }
}
