//! The device: one context, one stream, one cuBLAS handle. Buffers are plain device allocations
//! passed to kernels as raw pointers; cudarc's per-slice event tracking is turned off (one stream,
//! and graph capture needs it off), so the stream's order is the only synchronization.

use std::sync::Arc;

use cudarc::cublas::{result as blas_result, sys as blas_sys, CudaBlas};
use cudarc::driver::{
    sys as drv_sys, CudaContext, CudaFunction, CudaModule, CudaSlice, CudaStream, DevicePtr,
    DeviceRepr, ValidAsZeroBits,
};

use super::nvrtc::{self, KernelSource};
use crate::BackendError;

/// Flags of `CudaContext::new_event` (timing events use `CU_EVENT_DEFAULT`).
pub use cudarc::driver::sys::CUevent_flags as EventFlags;

pub(crate) fn cuda_err(what: &str) -> impl Fn(cudarc::driver::DriverError) -> BackendError + '_ {
    move |e| BackendError::Cuda(format!("{what}: {e}"))
}

/// A device allocation and its raw address.
pub struct DBuf<T> {
    _buf: CudaSlice<T>,
    pub ptr: u64,
    pub len: usize,
}

impl<T> DBuf<T> {
    /// Address of element `i`.
    pub fn at(&self, i: usize) -> u64 {
        self.ptr + (i * std::mem::size_of::<T>()) as u64
    }
}

/// Page-locked host memory (`cuMemHostAlloc` without write-combining: the host reads it), so a
/// device-to-host copy runs at the bus rate instead of through the driver's staging buffer. Grows
/// on demand; freed on drop. Allocation needs the context current on the calling thread.
pub struct HostBuf<T> {
    ptr: *mut T,
    cap: usize,
}

// SAFETY: the buffer is owned memory like a Vec's; nothing else holds the pointer.
unsafe impl<T: Send> Send for HostBuf<T> {}

impl<T: Copy + ValidAsZeroBits> Default for HostBuf<T> {
    fn default() -> Self {
        HostBuf {
            ptr: std::ptr::null_mut(),
            cap: 0,
        }
    }
}

impl<T: Copy + ValidAsZeroBits> HostBuf<T> {
    /// The first `len` elements, for writing (the allocation grows, zeroed, when it is shorter).
    pub fn slice_mut(&mut self, len: usize) -> Result<&mut [T], BackendError> {
        if len > self.cap {
            self.free();
            let bytes = len.max(1) * std::mem::size_of::<T>();
            // SAFETY: a fresh allocation of `bytes`, zeroed before use (all-zero is a valid T).
            let p = unsafe { cudarc::driver::result::malloc_host(bytes, 0) }
                .map_err(cuda_err("allocating pinned host memory"))?;
            unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
            self.ptr = p as *mut T;
            self.cap = len.max(1);
        }
        // SAFETY: `len` <= cap elements of an owned, initialized allocation.
        Ok(unsafe { std::slice::from_raw_parts_mut(self.ptr, len) })
    }

    /// `len` zeroed elements that the device can also write (`CU_MEMHOSTALLOC_DEVICEMAP`), and
    /// their device address: a one-row step's logits go there straight from the output GEMV,
    /// with no copy after it. Never grown (`slice_mut` must stay within `len`, or the address a
    /// captured graph holds would go stale).
    pub fn mapped(len: usize) -> Result<(Self, u64), BackendError> {
        let bytes = len.max(1) * std::mem::size_of::<T>();
        let flags = drv_sys::CU_MEMHOSTALLOC_DEVICEMAP;
        // SAFETY: a fresh allocation of `bytes`, zeroed before use (all-zero is a valid T).
        let p = unsafe { cudarc::driver::result::malloc_host(bytes, flags) }
            .map_err(cuda_err("allocating mapped host memory"))?;
        unsafe { std::ptr::write_bytes(p as *mut u8, 0, bytes) };
        let buf = HostBuf {
            ptr: p as *mut T,
            cap: len.max(1),
        };
        let mut dptr: drv_sys::CUdeviceptr = 0;
        // SAFETY: `p` is a live page-locked allocation made with DEVICEMAP.
        unsafe { drv_sys::cuMemHostGetDevicePointer_v2(&mut dptr, p, 0) }
            .result()
            .map_err(cuda_err("mapping host memory into the device"))?;
        Ok((buf, dptr))
    }

    /// The first `len` elements (`len` at most what `slice_mut` last provided).
    pub fn slice(&self, len: usize) -> &[T] {
        assert!(
            len <= self.cap || len == 0,
            "HostBuf read past its allocation"
        );
        if len == 0 {
            return &[];
        }
        // SAFETY: within the owned, initialized allocation.
        unsafe { std::slice::from_raw_parts(self.ptr, len) }
    }

    fn free(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: allocated by malloc_host and not freed since; no copy is in flight (every
            // copy into it is synchronized before the slice is handed out).
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
            self.ptr = std::ptr::null_mut();
            self.cap = 0;
        }
    }
}

impl<T> Drop for HostBuf<T> {
    fn drop(&mut self) {
        if !self.ptr.is_null() {
            // SAFETY: as in `free`.
            let _ = unsafe { cudarc::driver::result::free_host(self.ptr as *mut std::ffi::c_void) };
        }
    }
}

const CUBLAS_WORKSPACE: usize = 32 << 20;

pub struct Gpu {
    pub ctx: Arc<CudaContext>,
    pub stream: Arc<CudaStream>,
    blas: CudaBlas,
    _workspace: CudaSlice<u8>,
    /// `sm_XY`, the NVRTC target.
    pub arch: String,
    pub name: String,
    pub sms: u32,
    /// Launch with programmatic dependent launch (sm_90+, `QUIRE_CUDA_PDL=0` turns it off): the
    /// next kernel's CTAs are scheduled while this one finishes and wait in `pdl_enter`
    /// (common.cuh) for its writes, hiding most of the ~1 µs gap between two small kernels.
    pub pdl: bool,
    /// The decode timeline (`QUIRE_CUDA_TRACE=1`, trace.rs); `None` normally.
    pub trace: Option<super::trace::Tracer>,
}

/// Fails with the library names tried when the CUDA driver, cuBLAS or NVRTC cannot be loaded
/// (cudarc would panic on first use).
fn check_libraries() -> Result<(), BackendError> {
    // SAFETY: only probes whether the libraries can be opened.
    let (drv, blas) = unsafe { (drv_sys::is_culib_present(), blas_sys::is_culib_present()) };
    if !drv {
        return Err(BackendError::Cuda(format!(
            "the CUDA driver library was not found (tried {}); is an NVIDIA driver installed and on LD_LIBRARY_PATH?",
            nvrtc::lib_candidates("cuda")
        )));
    }
    if !blas {
        return Err(BackendError::Cuda(format!(
            "cuBLAS was not found (tried {}); add the CUDA toolkit's lib directory to LD_LIBRARY_PATH",
            nvrtc::lib_candidates("cublas")
        )));
    }
    nvrtc::check_nvrtc()
}

impl Gpu {
    /// Fails, naming the library, when the CUDA driver cannot be loaded.
    pub fn check_driver() -> Result<(), BackendError> {
        check_libraries()
    }

    pub fn new(ordinal: usize) -> Result<Self, BackendError> {
        check_libraries()?;
        let n = CudaContext::device_count().map_err(cuda_err("cuDeviceGetCount"))?;
        if ordinal >= n.max(0) as usize {
            return Err(BackendError::Cuda(format!(
                "no CUDA device {ordinal} (found {n})"
            )));
        }
        let ctx = CudaContext::new(ordinal).map_err(cuda_err("creating the CUDA context"))?;
        // SAFETY: quire uses one stream per context and orders all work on it.
        unsafe { ctx.disable_event_tracking() };
        // Not the legacy default stream: CUDA graphs cannot capture it.
        let stream = ctx.new_stream().map_err(cuda_err("creating a stream"))?;
        let blas = CudaBlas::new(stream.clone())
            .map_err(|e| BackendError::Cuda(format!("creating the cuBLAS handle: {e}")))?;
        // A fixed workspace, so cuBLAS allocates nothing while a graph is being captured.
        let workspace = stream
            .alloc_zeros::<u8>(CUBLAS_WORKSPACE)
            .map_err(cuda_err("allocating the cuBLAS workspace"))?;
        {
            let (ptr, _) = workspace.device_ptr(&stream);
            // SAFETY: the workspace lives as long as the handle (both owned by `Gpu`).
            let r = unsafe {
                blas_sys::cublasSetWorkspace_v2(*blas.handle(), ptr as *mut _, CUBLAS_WORKSPACE)
            };
            if r != blas_sys::cublasStatus_t::CUBLAS_STATUS_SUCCESS {
                return Err(BackendError::Cuda(format!("cublasSetWorkspace: {r:?}")));
            }
        }
        let (major, minor) = ctx
            .compute_capability()
            .map_err(cuda_err("compute capability"))?;
        let sms = ctx
            .attribute(drv_sys::CUdevice_attribute::CU_DEVICE_ATTRIBUTE_MULTIPROCESSOR_COUNT)
            .map_err(cuda_err("multiprocessor count"))? as u32;
        let trace = if super::trace::wanted() {
            let buf = stream
                .alloc_zeros::<u64>(super::trace::TRACE_CAP + 1)
                .map_err(cuda_err("allocating the trace buffer"))?;
            let (ptr, _) = buf.device_ptr(&stream);
            Some(super::trace::Tracer::new(DBuf {
                ptr,
                len: super::trace::TRACE_CAP + 1,
                _buf: buf,
            }))
        } else {
            None
        };
        Ok(Self {
            trace,
            name: ctx.name().unwrap_or_else(|_| "CUDA device".into()),
            ctx,
            stream,
            blas,
            _workspace: workspace,
            arch: format!("sm_{major}{minor}"),
            sms,
            pdl: major >= 9 && super::CudaEnv::get().pdl,
        })
    }

    /// Marks logged for the decode timeline so far (0 untraced); a graph capture takes its marks
    /// back with `trace_take` and replays them with `trace_replay` (trace.rs).
    pub fn trace_len(&self) -> usize {
        self.trace.as_ref().map_or(0, |t| t.logged())
    }

    pub fn trace_take(&self, from: usize) -> Vec<super::trace::Mark> {
        self.trace.as_ref().map_or(vec![], |t| t.split_off(from))
    }

    pub fn trace_replay(&self, marks: &[super::trace::Mark]) {
        if let Some(t) = &self.trace {
            t.extend(marks);
        }
    }

    /// Logs the end mark of the kernel just launched (`argmax_rows` makes one).
    pub fn trace_end(&self) {
        if let Some(t) = &self.trace {
            t.note(super::trace::Mark::End);
        }
    }

    /// Free and total device memory in bytes.
    pub fn mem_info(&self) -> Result<(usize, usize), BackendError> {
        self.ctx.mem_get_info().map_err(cuda_err("cuMemGetInfo"))
    }

    pub fn module(
        &self,
        k: &KernelSource,
        defines: &[(&str, String)],
    ) -> Result<Arc<CudaModule>, BackendError> {
        let mut defines = defines.to_vec();
        if self.trace.is_some() {
            defines.push(("QUIRE_TRACE", "1".into()));
        }
        let (cubin, _) = nvrtc::compile(k, &defines, &self.arch)?;
        let m = self
            .ctx
            .load_module(cudarc::nvrtc::Ptx::from_binary(cubin))
            .map_err(cuda_err(k.name))?;
        if let Some(t) = &self.trace {
            super::trace::attach(self, &m, t)?;
        }
        Ok(m)
    }

    pub fn function(m: &Arc<CudaModule>, name: &str) -> Result<CudaFunction, BackendError> {
        m.load_function(name)
            .map_err(|e| BackendError::Cuda(format!("kernel {name}: {e}")))
    }

    pub fn alloc<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        len: usize,
    ) -> Result<DBuf<T>, BackendError> {
        let buf = self.stream.alloc_zeros::<T>(len.max(1)).map_err(|e| {
            BackendError::OutOfMemory(format!(
                "allocating {} MiB on the GPU: {e}",
                (len * std::mem::size_of::<T>()) >> 20
            ))
        })?;
        let (ptr, _) = buf.device_ptr(&self.stream);
        Ok(DBuf {
            ptr,
            len,
            _buf: buf,
        })
    }

    pub fn upload<T: DeviceRepr + ValidAsZeroBits>(
        &self,
        data: &[T],
    ) -> Result<DBuf<T>, BackendError> {
        let mut b = self.alloc::<T>(data.len())?;
        self.htod(data, &mut b, 0)?;
        Ok(b)
    }

    /// Copies `data` into `dst` at element `offset` (asynchronous with respect to the host only
    /// for pinned memory; plain host memory is staged by the driver).
    pub fn htod<T: DeviceRepr>(
        &self,
        data: &[T],
        dst: &mut DBuf<T>,
        offset: usize,
    ) -> Result<(), BackendError> {
        if data.is_empty() {
            return Ok(());
        }
        assert!(offset + data.len() <= dst.len, "htod out of range");
        // SAFETY: the range lies inside `dst`, checked above.
        unsafe {
            cudarc::driver::result::memcpy_htod_async(dst.at(offset), data, self.stream.cu_stream())
        }
        .map_err(cuda_err("host-to-device copy"))
    }

    pub fn dtoh<T: DeviceRepr>(&self, src: &DBuf<T>, out: &mut [T]) -> Result<(), BackendError> {
        assert!(out.len() <= src.len, "dtoh out of range");
        if out.is_empty() {
            return Ok(());
        }
        // SAFETY: the range lies inside `src`, checked above.
        unsafe { cudarc::driver::result::memcpy_dtoh_async(out, src.ptr, self.stream.cu_stream()) }
            .map_err(cuda_err("device-to-host copy"))?;
        self.sync()
    }

    pub fn sync(&self) -> Result<(), BackendError> {
        self.stream.synchronize().map_err(cuda_err("synchronize"))
    }

    /// `y[n, out] (f32) = x[n, in] (f16) · w[out, in]ᵀ (f16) + beta · y`, f32 accumulation.
    ///
    /// # Safety
    ///
    /// `x`, `w` and `y` are addresses of live device allocations on this context holding at least
    /// `n·k_in`, `out·k_in` and `n·out` elements of their types, not freed before the stream has
    /// finished the GEMM; `y` overlaps neither input.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_f16(
        &self,
        x: u64,
        w: u64,
        y: u64,
        n: usize,
        k_in: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        let f16 = blas_sys::cudaDataType::CUDA_R_16F;
        // SAFETY: the caller's contract is `gemm`'s.
        unsafe { self.gemm(f16, x, w, y, (n, k_in, out), beta) }
            .map_err(|e| BackendError::Cuda(format!("cuBLAS GEMM {n}x{k_in}x{out}: {e}")))
    }

    /// `y[n, out] = x[n, in] · w[out, in]ᵀ + beta · y`, all f32 (full-precision FP32 math).
    ///
    /// # Safety
    ///
    /// `x`, `w` and `y` are addresses of live device allocations on this context holding at least
    /// `n·k_in`, `out·k_in` and `n·out` elements of their types, not freed before the stream has
    /// finished the GEMM; `y` overlaps neither input.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn gemm_f32(
        &self,
        x: u64,
        w: u64,
        y: u64,
        n: usize,
        k_in: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        let f32 = blas_sys::cudaDataType::CUDA_R_32F;
        // SAFETY: the caller's contract is `gemm`'s.
        unsafe { self.gemm(f32, x, w, y, (n, k_in, out), beta) }
            .map_err(|e| BackendError::Cuda(format!("cuBLAS SGEMM {n}x{k_in}x{out}: {e}")))
    }

    /// The one cuBLAS call behind both: `x` and `w` of type `input`, `y` f32, f32 compute.
    /// Row-major y[n, out] is column-major [out, n] = wᵀ(col-major [in, out])ᵀ · x(col-major [in, n]).
    ///
    /// # Safety
    ///
    /// As `gemm_f16`, with `x` and `w` of type `input`.
    unsafe fn gemm(
        &self,
        input: blas_sys::cudaDataType,
        x: u64,
        w: u64,
        y: u64,
        (n, k_in, out): (usize, usize, usize),
        beta: f32,
    ) -> Result<(), blas_result::CublasError> {
        let alpha = 1.0f32;
        // SAFETY: the caller passes live device buffers of the stated shapes (this fn's contract).
        unsafe {
            blas_result::gemm_ex(
                *self.blas.handle(),
                blas_sys::cublasOperation_t::CUBLAS_OP_T,
                blas_sys::cublasOperation_t::CUBLAS_OP_N,
                out as i32,
                n as i32,
                k_in as i32,
                &alpha as *const f32 as *const _,
                w as *const _,
                input,
                k_in as i32,
                x as *const _,
                input,
                k_in as i32,
                &beta as *const f32 as *const _,
                y as *mut _,
                blas_sys::cudaDataType::CUDA_R_32F,
                out as i32,
                blas_sys::cublasComputeType_t::CUBLAS_COMPUTE_32F,
                blas_sys::cublasGemmAlgo_t::CUBLAS_GEMM_DEFAULT,
            )
        }
    }
}

/// Device-to-device copy bandwidth: what [`Gpu::copy_bandwidth`] measured.
#[derive(Debug, Clone, PartialEq)]
pub struct CopyBandwidth {
    /// Median of `samples`, GB/s (10^9 bytes per second).
    pub gbps: f64,
    /// One figure per timed copy, GB/s.
    pub samples: Vec<f64>,
    /// Size of the copied buffer, bytes.
    pub bytes: usize,
}

impl Gpu {
    /// Measures the device's memory bandwidth with device-to-device copies of one buffer of at
    /// most `max_bytes` (less when free memory is short: both buffers together take at most half
    /// of it): two untimed copies, then `runs` copies each timed with CUDA events, median.
    ///
    /// Convention: a copy of `S` bytes counts as `2·S` bytes moved (each byte is read once and
    /// written once), as STREAM's "copy" counts; GB/s is 10^9 bytes per second. The buffers are
    /// freed before it returns.
    pub fn copy_bandwidth(
        &self,
        max_bytes: usize,
        runs: usize,
    ) -> Result<CopyBandwidth, BackendError> {
        let (free, _) = self.mem_info()?;
        let bytes = max_bytes.min(free / 4) & !((1 << 20) - 1);
        if bytes == 0 {
            return Err(BackendError::OutOfMemory(format!(
                "{} MiB free on the GPU: too little to measure the copy bandwidth",
                free >> 20
            )));
        }
        let src = self.alloc::<u8>(bytes)?;
        let dst = self.alloc::<u8>(bytes)?;
        let event = || {
            self.ctx
                .new_event(Some(EventFlags::CU_EVENT_DEFAULT))
                .map_err(cuda_err("cuEventCreate"))
        };
        let (start, end) = (event()?, event()?);
        let copy = || {
            // SAFETY: both buffers are live allocations of `bytes` bytes.
            unsafe {
                cudarc::driver::result::memcpy_dtod_async(
                    dst.ptr,
                    src.ptr,
                    bytes,
                    self.stream.cu_stream(),
                )
            }
            .map_err(cuda_err("device-to-device copy"))
        };
        copy()?;
        copy()?;
        let mut samples = Vec::with_capacity(runs.max(1));
        for _ in 0..runs.max(1) {
            start
                .record(&self.stream)
                .map_err(cuda_err("cuEventRecord"))?;
            copy()?;
            end.record(&self.stream)
                .map_err(cuda_err("cuEventRecord"))?;
            // Waits for `end`.
            let ms = start
                .elapsed_ms(&end)
                .map_err(cuda_err("cuEventElapsedTime"))?;
            samples.push(2.0 * bytes as f64 / (f64::from(ms) * 1e-3) / 1e9);
        }
        drop((src, dst));
        self.sync()?;
        let mut sorted = samples.clone();
        sorted.sort_by(f64::total_cmp);
        let n = sorted.len();
        let gbps = (sorted[(n - 1) / 2] + sorted[n / 2]) / 2.0;
        Ok(CopyBandwidth {
            gbps,
            samples,
            bytes,
        })
    }
}

/// One kernel argument: a device pointer, an `int`, a `long` or a `float`.
#[derive(Debug, Clone, Copy)]
pub enum KArg {
    P(u64),
    I(i32),
    L(i64),
    F(f32),
}

impl Gpu {
    /// Launches `f` on the stream; `args` must match the kernel's parameter list (see its .cu file).
    ///
    /// # Safety
    ///
    /// `args` match `f`'s parameter list in number and type, and every `KArg::P` is null (where
    /// the kernel allows it) or the address of a live device allocation on this context at least
    /// as large as the kernel reads or writes through it for the given shape arguments and grid,
    /// not freed before the stream has finished the kernel; no two pointers alias where the
    /// kernel writes through one of them, unless the kernel is written for it (in-place forms).
    pub unsafe fn launch(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        args: &[KArg],
    ) -> Result<(), BackendError> {
        // SAFETY: the caller's contract is `launch_smem`'s.
        unsafe { self.launch_smem(f, grid, block, 0, args) }
    }

    /// `launch` with `smem` bytes of dynamic shared memory.
    ///
    /// # Safety
    ///
    /// As `launch`; `smem` is what `f` expects for this launch (at most its configured limit).
    pub unsafe fn launch_smem(
        &self,
        f: &CudaFunction,
        grid: (u32, u32, u32),
        block: (u32, u32, u32),
        smem: u32,
        args: &[KArg],
    ) -> Result<(), BackendError> {
        if let Some(t) = &self.trace {
            t.note(super::trace::Mark::Kernel(f.cu_function() as usize));
        }
        // Kernel parameters: one pointer to each argument's value.
        let mut vals: Vec<u64> = Vec::with_capacity(args.len());
        for a in args {
            vals.push(match *a {
                KArg::P(v) => v,
                KArg::I(v) => v as u32 as u64,
                KArg::L(v) => v as u64,
                KArg::F(v) => v.to_bits() as u64,
            });
        }
        // Little-endian: an i32/f32 argument is the low 4 bytes of its slot.
        let mut params: Vec<*mut std::ffi::c_void> = vals
            .iter_mut()
            .map(|v| v as *mut u64 as *mut std::ffi::c_void)
            .collect();
        // SAFETY: an all-zero launch attribute is a valid "ignore" value; it is filled below.
        let mut attr: drv_sys::CUlaunchAttribute = unsafe { std::mem::zeroed() };
        attr.id =
            drv_sys::CUlaunchAttributeID::CU_LAUNCH_ATTRIBUTE_PROGRAMMATIC_STREAM_SERIALIZATION;
        attr.value.programmaticStreamSerializationAllowed = 1;
        let cfg = drv_sys::CUlaunchConfig {
            gridDimX: grid.0,
            gridDimY: grid.1,
            gridDimZ: grid.2,
            blockDimX: block.0,
            blockDimY: block.1,
            blockDimZ: block.2,
            sharedMemBytes: smem,
            hStream: self.stream.cu_stream(),
            attrs: &mut attr,
            numAttrs: self.pdl as u32,
        };
        // SAFETY: the caller matches `args` to the kernel's signature and vouches for every
        // address (this fn's contract); every kernel starts with `pdl_enter`, so the relaxed serialization is safe; the parameter
        // values outlive the call (the driver copies them at launch).
        unsafe {
            drv_sys::cuLaunchKernelEx(
                &cfg,
                f.cu_function(),
                params.as_mut_ptr(),
                std::ptr::null_mut(),
            )
        }
        .result()
        .map_err(cuda_err("kernel launch"))
    }
}
