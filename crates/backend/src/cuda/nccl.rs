//! NCCL, the collectives of a tensor-parallel group of GPUs, opened at run time like cuBLAS so that
//! quire builds and runs without it (only `--tensor-parallel-size` above 1 on CUDA needs it). The
//! few entry points quire calls are bound by hand: one communicator per GPU of this process
//! (`ncclCommInitAll`, so no rank waits for another to start), an in-place f32 sum per all-reduce,
//! an all-gather (the vocab-parallel output's logits), and an abort that frees ranks stuck in a collective when one rank fails.
//!
//! NVLink multicast (NVLS) stays off: `NCCL_NVLS_ENABLE=0` is set before NCCL starts unless the
//! user set it (a process that uses multicast can take a host's shared GPUs out of service); so
//! is `NCCL_RUNTIME_CONNECT=0` (see `open`).

use std::ffi::{c_char, c_int, c_void, CStr};
use std::sync::atomic::{AtomicBool, Ordering};
use std::sync::OnceLock;

use crate::BackendError;

type NcclComm = *mut c_void;
type NcclResult = c_int;

const NCCL_FLOAT32: c_int = 7;
const NCCL_SUM: c_int = 0;

/// The library names tried, in order.
pub const LIBRARY: [&str; 2] = ["libnccl.so.2", "libnccl.so"];

struct Lib {
    _lib: libloading::Library,
    init_all: unsafe extern "C" fn(*mut NcclComm, c_int, *const c_int) -> NcclResult,
    all_reduce: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        c_int,
        NcclComm,
        *mut c_void,
    ) -> NcclResult,
    all_gather: unsafe extern "C" fn(
        *const c_void,
        *mut c_void,
        usize,
        c_int,
        NcclComm,
        *mut c_void,
    ) -> NcclResult,
    destroy: unsafe extern "C" fn(NcclComm) -> NcclResult,
    abort: unsafe extern "C" fn(NcclComm) -> NcclResult,
    error_string: unsafe extern "C" fn(NcclResult) -> *const c_char,
    version: unsafe extern "C" fn(*mut c_int) -> NcclResult,
}

fn lib() -> Result<&'static Lib, BackendError> {
    static LIB: OnceLock<Result<Lib, String>> = OnceLock::new();
    LIB.get_or_init(open)
        .as_ref()
        .map_err(|e| BackendError::Cuda(e.clone()))
}

fn open() -> Result<Lib, String> {
    // NVLink multicast off; and peers connected when the communicators are made, not lazily at
    // a collective's first use, which NCCL cannot do inside a CUDA-graph capture (measured on 4
    // H200s: "failed to peer with device 1: operation not permitted when stream is capturing"
    // at the first 64-sequence decode step).
    for (k, v) in [("NCCL_NVLS_ENABLE", "0"), ("NCCL_RUNTIME_CONNECT", "0")] {
        if std::env::var_os(k).is_none() {
            // SAFETY: set once, before NCCL (their only reader) is loaded; quire's other threads
            // do not touch the environment.
            unsafe { std::env::set_var(k, v) };
        }
    }
    let mut tried = Vec::new();
    for name in LIBRARY {
        // SAFETY: loading NCCL runs its initializers, which only set up its own state.
        match unsafe { libloading::Library::new(name) } {
            Ok(lib) => return bind(lib).map_err(|e| format!("{name}: {e}")),
            Err(e) => tried.push(format!("{name}: {e}")),
        }
    }
    Err(format!(
        "tensor parallelism on CUDA needs NCCL 2, which was not found ({}); install NCCL or put \
         the directory holding libnccl.so.2 on LD_LIBRARY_PATH (PyTorch's wheels ship one under \
         site-packages/nvidia/nccl/lib)",
        tried.join("; ")
    ))
}

fn bind(lib: libloading::Library) -> Result<Lib, libloading::Error> {
    // SAFETY: each symbol is looked up with the signature NCCL 2's nccl.h declares for it.
    unsafe {
        Ok(Lib {
            init_all: *lib.get(b"ncclCommInitAll\0")?,
            all_reduce: *lib.get(b"ncclAllReduce\0")?,
            all_gather: *lib.get(b"ncclAllGather\0")?,
            destroy: *lib.get(b"ncclCommDestroy\0")?,
            abort: *lib.get(b"ncclCommAbort\0")?,
            error_string: *lib.get(b"ncclGetErrorString\0")?,
            version: *lib.get(b"ncclGetVersion\0")?,
            _lib: lib,
        })
    }
}

fn check(l: &Lib, r: NcclResult, what: &str) -> Result<(), BackendError> {
    if r == 0 {
        return Ok(());
    }
    // SAFETY: ncclGetErrorString returns a static, NUL-terminated string for any code.
    let msg = unsafe { CStr::from_ptr((l.error_string)(r)) }.to_string_lossy();
    Err(BackendError::Cuda(format!("NCCL {what}: {msg} (code {r})")))
}

/// NCCL's version as `major.minor.patch`.
pub fn version() -> Result<String, BackendError> {
    let l = lib()?;
    let mut v: c_int = 0;
    // SAFETY: ncclGetVersion writes one int.
    check(l, unsafe { (l.version)(&mut v) }, "version")?;
    let v = v as i64;
    Ok(if v >= 10000 {
        format!("{}.{}.{}", v / 10000, v / 100 % 100, v % 100)
    } else {
        format!("{}.{}.{}", v / 1000, v / 100 % 10, v % 100)
    })
}

/// One GPU's communicator. It is used by one rank thread at a time, and `abort` may come from
/// the group's thread while that rank waits in a collective (NCCL allows it).
pub struct Comm {
    comm: NcclComm,
    aborted: AtomicBool,
    pub rank: usize,
    pub size: usize,
}

// SAFETY: an NCCL communicator may be used from any thread, one call at a time (the rank's), and
// ncclCommAbort is meant to be called from another thread to stop a stuck collective.
unsafe impl Send for Comm {}
// SAFETY: see above.
unsafe impl Sync for Comm {}

impl Comm {
    /// One communicator per device of `devices` (CUDA ordinals), rank i on `devices[i]`.
    pub fn init_all(devices: &[usize]) -> Result<Vec<Comm>, BackendError> {
        let l = lib()?;
        let n = devices.len();
        let mut comms: Vec<NcclComm> = vec![std::ptr::null_mut(); n];
        let list: Vec<c_int> = devices.iter().map(|&d| d as c_int).collect();
        // SAFETY: `comms` has room for `n` handles and `list` holds `n` device ordinals.
        let r = unsafe { (l.init_all)(comms.as_mut_ptr(), n as c_int, list.as_ptr()) };
        check(l, r, "initializing the communicators")?;
        Ok(comms
            .into_iter()
            .enumerate()
            .map(|(rank, comm)| Comm {
                comm,
                aborted: AtomicBool::new(false),
                rank,
                size: n,
            })
            .collect())
    }

    /// `buf` ← the sum over ranks of `buf` (`count` f32 values), enqueued on `stream`.
    ///
    /// # Safety
    /// `buf` is a device allocation of at least `count` f32 on this communicator's device, live
    /// until the stream has run the operation; `stream` is a stream of that device.
    pub unsafe fn all_reduce_f32(
        &self,
        buf: u64,
        count: usize,
        stream: *mut c_void,
    ) -> Result<(), BackendError> {
        let l = lib()?;
        if self.aborted.load(Ordering::Acquire) {
            return Err(BackendError::Cuda(
                "NCCL all-reduce on a stopped tensor-parallel group".into(),
            ));
        }
        let p = buf as *mut c_void;
        // SAFETY: the caller's contract: `buf` holds `count` f32 on this device; in place.
        let r = unsafe { (l.all_reduce)(p, p, count, NCCL_FLOAT32, NCCL_SUM, self.comm, stream) };
        check(l, r, "all-reduce")
    }

    /// `recv` ← every rank's `send` (`count` f32 values each) one after another in rank order,
    /// `[size][count]`, enqueued on `stream`.
    ///
    /// # Safety
    /// `send` holds `count` f32 and `recv` room for `size × count` f32, device allocations of this
    /// communicator's device that do not overlap, live until the stream has run the operation;
    /// `stream` is a stream of that device.
    pub unsafe fn all_gather_f32(
        &self,
        send: u64,
        recv: u64,
        count: usize,
        stream: *mut c_void,
    ) -> Result<(), BackendError> {
        let l = lib()?;
        if self.aborted.load(Ordering::Acquire) {
            return Err(BackendError::Cuda(
                "NCCL all-gather on a stopped tensor-parallel group".into(),
            ));
        }
        let (s, r) = (send as *const c_void, recv as *mut c_void);
        // SAFETY: the caller's contract: `send` holds `count` f32, `recv` room for every rank's.
        let r = unsafe { (l.all_gather)(s, r, count, NCCL_FLOAT32, self.comm, stream) };
        check(l, r, "all-gather")
    }

    /// Stops the communicator's collectives in flight (a rank waiting in one returns with an
    /// error); later all-reduces fail. Only the first call does anything.
    pub fn abort(&self) {
        let Ok(l) = lib() else { return };
        if self.aborted.swap(true, Ordering::AcqRel) {
            return;
        }
        // SAFETY: the handle is live, and aborted only once (the flag); NCCL allows the abort
        // while another thread is inside a collective of the communicator.
        unsafe { (l.abort)(self.comm) };
    }
}

impl Drop for Comm {
    fn drop(&mut self) {
        let Ok(l) = lib() else { return };
        if !*self.aborted.get_mut() {
            // SAFETY: the handle is live (not aborted, which frees it) and no collective uses it.
            unsafe { (l.destroy)(self.comm) };
        }
    }
}
