//! Per-op timers for `quire profile` on the CPU. When off, `time` is a plain call: no clock reads.

use std::collections::HashMap;
use std::time::Instant;

use crate::OpStat;

#[derive(Default)]
pub struct Profiler {
    on: bool,
    stats: HashMap<(&'static str, Option<usize>), OpStat>,
}

impl Profiler {
    pub fn set(&mut self, on: bool) {
        self.on = on;
    }

    /// Runs `f`, charging its time, bytes and FLOPs to `(name, layer)` when profiling.
    #[inline]
    pub fn time<R>(
        &mut self,
        name: &'static str,
        layer: Option<usize>,
        bytes: u64,
        flops: u64,
        f: impl FnOnce() -> R,
    ) -> R {
        if !self.on {
            return f();
        }
        let t0 = Instant::now();
        let r = f();
        let ns = t0.elapsed().as_nanos() as u64;
        let e = self.stats.entry((name, layer)).or_insert_with(|| OpStat {
            name: name.to_string(),
            layer,
            ..Default::default()
        });
        e.calls += 1;
        e.total_ns += ns;
        e.bytes += bytes;
        e.flops += flops;
        r
    }

    pub fn take(&mut self) -> Vec<OpStat> {
        let mut v: Vec<OpStat> = self.stats.drain().map(|(_, s)| s).collect();
        v.sort_by_key(|s| std::cmp::Reverse(s.total_ns));
        v
    }
}
