//! The decode timeline (`QUIRE_CUDA_TRACE=1`): where a step's time goes *inside* a CUDA graph,
//! which the event profiler cannot see (it runs steps eagerly, one event per op, and so measures
//! launches that a graph with programmatic dependent launch no longer pays).
//!
//! Every kernel is then compiled with `QUIRE_TRACE` (common.cuh): its first CTA, the moment it is
//! released from `griddepcontrol.wait` (the kernel before has finished), appends the GPU's global
//! timer to one device buffer; `argmax_rows` also marks its own end. The host logs, in the same
//! order, which kernel each mark belongs to (graphs log their captured sequence at every replay),
//! so mark i's time to mark i + 1 is kernel i's share of the step: its run plus the hand-over to
//! the next. The time from the argmax's end to the next step's first kernel is the host's: waking
//! on the copy of the ids, the scheduler, the metadata upload and the graph launch.
//!
//! The tracer perturbs what it measures a little (one atomic and one store per kernel, by one
//! thread); compare a traced run's tok/s with an untraced one. Kernels launched by cuBLAS leave no
//! mark, so their time lands on the quire kernel before them.

use std::cell::RefCell;
use std::collections::HashMap;
use std::ffi::CStr;

use cudarc::driver::sys as drv_sys;

use super::gpu::{cuda_err, DBuf, Gpu};
use crate::BackendError;

/// Marks the device buffer holds (`QUIRE_TRACE_CAP` in common.cuh); later marks are counted, not
/// kept.
pub const TRACE_CAP: usize = 1 << 20;

/// What one device mark belongs to.
#[derive(Debug, Clone, Copy)]
pub enum Mark {
    /// A kernel's release from its wait (the raw `CUfunction`, named at report time).
    Kernel(usize),
    /// The end of the kernel logged just before (the step's last, before the host takes over).
    End,
}

pub struct Tracer {
    /// `[0]`: marks written so far; `[1 ..= TRACE_CAP]`: global-timer readings, ns.
    pub buf: DBuf<u64>,
    log: RefCell<Vec<Mark>>,
}

impl Tracer {
    pub fn new(buf: DBuf<u64>) -> Self {
        Tracer {
            buf,
            log: RefCell::new(Vec::new()),
        }
    }

    pub fn note(&self, m: Mark) {
        self.log.borrow_mut().push(m);
    }

    /// Marks logged so far (a graph capture takes what it logged back off with `split_off`).
    pub fn logged(&self) -> usize {
        self.log.borrow().len()
    }

    pub fn split_off(&self, at: usize) -> Vec<Mark> {
        self.log.borrow_mut().split_off(at)
    }

    /// A replayed graph's captured marks.
    pub fn extend(&self, marks: &[Mark]) {
        self.log.borrow_mut().extend_from_slice(marks);
    }

    /// The timeline so far as a markdown table: per kernel (named with the kernel after it, so the
    /// same GEMV before attention and before the SwiGLU GEMV are told apart) its calls, mean and
    /// median µs and share of the traced time, then the host's gap and the step time.
    pub fn report(&self, gpu: &Gpu) -> Result<String, BackendError> {
        gpu.sync()?;
        let mut head = [0u64; 1];
        gpu.dtoh(&self.buf, &mut head)?;
        let written = head[0] as usize;
        let kept = written.min(TRACE_CAP);
        let mut all = vec![0u64; kept + 1];
        gpu.dtoh(&self.buf, &mut all)?;
        let times = &all[1..];
        let log = self.log.borrow();
        let mut out = String::new();
        if written != log.len() {
            out.push_str(&format!(
                "(trace: {written} device marks against {} logged launches; the table pairs the first {} of each)\n",
                log.len(),
                kept.min(log.len())
            ));
        }
        let n = kept.min(log.len());
        let mut names: HashMap<usize, String> = HashMap::new();
        let mut name = |m: Mark| -> String {
            match m {
                Mark::End => "end".into(),
                Mark::Kernel(f) => names.entry(f).or_insert_with(|| func_name(f)).clone(),
            }
        };
        // (label) -> durations in ns
        let mut per: Vec<(String, Vec<u64>)> = Vec::new();
        let mut index: HashMap<String, usize> = HashMap::new();
        let mut steps: Vec<u64> = Vec::new();
        let mut last_end: Option<u64> = None;
        for i in 0..n.saturating_sub(1) {
            let dt = times[i + 1].saturating_sub(times[i]);
            let label = match log[i] {
                Mark::End => {
                    "after the argmax: the host (or a chain's copy) until the next step".to_string()
                }
                Mark::Kernel(_) => {
                    let next = match log[i + 1] {
                        Mark::End => "its end".to_string(),
                        m => name(m),
                    };
                    format!("{} ▸ {next}", name(log[i]))
                }
            };
            if let Mark::End = log[i] {
                if let Some(prev) = last_end {
                    steps.push(times[i] - prev);
                }
                last_end = Some(times[i]);
            }
            let k = *index.entry(label.clone()).or_insert_with(|| {
                per.push((label, Vec::new()));
                per.len() - 1
            });
            per[k].1.push(dt);
        }
        let total: u64 = per.iter().flat_map(|(_, v)| v.iter()).sum();
        per.sort_by_key(|(_, v)| std::cmp::Reverse(v.iter().sum::<u64>()));
        out.push_str("| kernel ▸ next | calls | mean µs | median µs | total ms | share |\n");
        out.push_str("|---|---:|---:|---:|---:|---:|\n");
        for (label, mut v) in per {
            let sum: u64 = v.iter().sum();
            v.sort_unstable();
            out.push_str(&format!(
                "| {label} | {} | {:.2} | {:.2} | {:.3} | {:.1}% |\n",
                v.len(),
                sum as f64 / v.len() as f64 / 1e3,
                v[v.len() / 2] as f64 / 1e3,
                sum as f64 / 1e6,
                100.0 * sum as f64 / total.max(1) as f64
            ));
        }
        if !steps.is_empty() {
            steps.sort_unstable();
            out.push_str(&format!(
                "steps ending in an argmax: {}, median {:.1} µs apart ({:.0} tok/s)\n",
                steps.len(),
                steps[steps.len() / 2] as f64 / 1e3,
                1e9 / steps[steps.len() / 2] as f64
            ));
        }
        Ok(out)
    }
}

fn func_name(f: usize) -> String {
    let mut p: *const std::ffi::c_char = std::ptr::null();
    // SAFETY: `f` is a live CUfunction (its module lives as long as the executor); the driver
    // returns a pointer to a NUL-terminated name it owns.
    let r = unsafe { drv_sys::cuFuncGetName(&mut p, f as drv_sys::CUfunction) };
    if r != drv_sys::CUresult::CUDA_SUCCESS || p.is_null() {
        return format!("kernel@{f:#x}");
    }
    // SAFETY: checked non-null above; NUL-terminated per the driver's contract.
    unsafe { CStr::from_ptr(p) }.to_string_lossy().into_owned()
}

/// `QUIRE_CUDA_TRACE=1`: whether to compile the kernels with their timeline marks.
pub fn wanted() -> bool {
    super::CudaEnv::get().trace
}

/// Points the module's `quire_trace` at the tracer's buffer.
pub fn attach(
    gpu: &Gpu,
    m: &std::sync::Arc<cudarc::driver::CudaModule>,
    t: &Tracer,
) -> Result<(), BackendError> {
    use cudarc::driver::DevicePtr;
    let view = m
        .get_global("quire_trace", &gpu.stream)
        .map_err(cuda_err("finding quire_trace"))?;
    let (ptr, _g) = view.device_ptr(&gpu.stream);
    // SAFETY: `quire_trace` is one 8-byte device pointer; the copy is ordered on the stream.
    unsafe { cudarc::driver::result::memcpy_htod_async(ptr, &[t.buf.ptr], gpu.stream.cu_stream()) }
        .map_err(cuda_err("setting quire_trace"))?;
    gpu.sync()
}
