//! One wgpu device and its queue, wrapped so that nothing on it can panic or hang the process:
//! wgpu reports validation and out-of-memory errors through callbacks (its default handler
//! panics), so every error goes to a sink here and becomes a `BackendError`; shader modules and
//! pipelines are created inside error scopes so a compile failure comes back with its log; every
//! wait on the device has a time limit.

use std::sync::{Arc, Mutex};
use std::time::Duration;

use crate::BackendError;

/// An adapter as `quire adapters` lists it.
#[derive(Debug, Clone)]
pub struct AdapterSummary {
    pub index: usize,
    pub name: String,
    /// Vulkan, Metal, Dx12, …
    pub backend: String,
    /// DiscreteGpu, IntegratedGpu, Cpu, …
    pub device_type: String,
    pub driver: String,
    /// The features quire cares about that the adapter has (SHADER_F16, SUBGROUP, …).
    pub features: Vec<&'static str>,
    pub max_storage_binding: u64,
}

/// The features the summary names (quire needs none of them: each has a fallback).
const NAMED_FEATURES: [(wgpu::Features, &str); 5] = [
    (wgpu::Features::SHADER_F16, "SHADER_F16"),
    (wgpu::Features::SUBGROUP, "SUBGROUP"),
    (wgpu::Features::TIMESTAMP_QUERY, "TIMESTAMP_QUERY"),
    (
        wgpu::Features::TIMESTAMP_QUERY_INSIDE_PASSES,
        "TIMESTAMP_QUERY_INSIDE_PASSES",
    ),
    (
        wgpu::Features::EXPERIMENTAL_COOPERATIVE_MATRIX,
        "COOPERATIVE_MATRIX",
    ),
];

fn instance() -> wgpu::Instance {
    // Backends from WGPU_BACKEND when set (e.g. `vulkan`), else every one built in.
    wgpu::Instance::new(wgpu::InstanceDescriptor::new_without_display_handle_from_env())
}

fn summarize(index: usize, a: &wgpu::Adapter) -> AdapterSummary {
    let info = a.get_info();
    let f = a.features();
    AdapterSummary {
        index,
        name: info.name,
        backend: format!("{:?}", info.backend),
        device_type: format!("{:?}", info.device_type),
        driver: format!("{} {}", info.driver, info.driver_info)
            .trim()
            .to_string(),
        features: NAMED_FEATURES
            .iter()
            .filter(|(x, _)| f.contains(*x))
            .map(|(_, n)| *n)
            .collect(),
        max_storage_binding: a.limits().max_storage_buffer_binding_size,
    }
}

fn compute_adapters(inst: &wgpu::Instance) -> Vec<wgpu::Adapter> {
    pollster::block_on(inst.enumerate_adapters(wgpu::Backends::all()))
        .into_iter()
        // Compute needs storage buffers in compute shaders: a downlevel GL adapter may lack them.
        .filter(|a| {
            a.get_downlevel_capabilities()
                .flags
                .contains(wgpu::DownlevelFlags::COMPUTE_SHADERS)
        })
        .collect()
}

/// Every adapter this machine offers for compute, in the order `--adapter N` counts them.
pub fn list_adapters() -> Vec<AdapterSummary> {
    compute_adapters(&instance())
        .iter()
        .enumerate()
        .map(|(i, a)| summarize(i, a))
        .collect()
}

/// The adapter `choice` names (an index, or a case-insensitive substring of the name), or the
/// first discrete GPU, else the first adapter.
fn pick(adapters: Vec<wgpu::Adapter>, choice: Option<&str>) -> Result<wgpu::Adapter, BackendError> {
    let names = || {
        adapters
            .iter()
            .enumerate()
            .map(|(i, a)| format!("{i}: {}", a.get_info().name))
            .collect::<Vec<_>>()
            .join(", ")
    };
    if adapters.is_empty() {
        return Err(BackendError::Wgpu(
            "no GPU adapter found (no Vulkan, Metal or DX12 driver; on Debian, \
             `apt-get install mesa-vulkan-drivers libvulkan1` gives a CPU one)"
                .into(),
        ));
    }
    let idx = match choice {
        None => adapters
            .iter()
            .position(|a| a.get_info().device_type == wgpu::DeviceType::DiscreteGpu)
            .unwrap_or(0),
        Some(c) => match c.parse::<usize>() {
            Ok(i) if i < adapters.len() => i,
            Ok(i) => {
                return Err(BackendError::Wgpu(format!(
                    "no adapter {i}; the adapters are {}",
                    names()
                )))
            }
            Err(_) => {
                let lc = c.to_lowercase();
                adapters
                    .iter()
                    .position(|a| a.get_info().name.to_lowercase().contains(&lc))
                    .ok_or_else(|| {
                        BackendError::Wgpu(format!(
                            "no adapter's name contains {c:?}; the adapters are {}",
                            names()
                        ))
                    })?
            }
        },
    };
    Ok(adapters.into_iter().nth(idx).expect("index checked"))
}

/// The prompt GEMM's cooperative-matrix configuration on `adapter` and the features it needs
/// (f16, subgroups, cooperative matrices), or none of them where the adapter lacks one.
fn coop_request(adapter: &wgpu::Adapter) -> (Option<super::gemm::CoopTile>, wgpu::Features) {
    use wgpu::Features as F;
    let have = adapter.features();
    let need = F::SHADER_F16 | F::SUBGROUP | F::EXPERIMENTAL_COOPERATIVE_MATRIX;
    if !have.contains(need) {
        return (None, F::empty());
    }
    let info = adapter.get_info();
    let tile = super::gemm::pick_coop(
        &adapter.cooperative_matrix_properties(),
        true,
        Some((info.subgroup_min_size, info.subgroup_max_size)),
    );
    (tile, if tile.is_some() { need } else { F::empty() })
}

/// Errors wgpu reported through its callbacks since the last check.
type Sink = Arc<Mutex<Vec<String>>>;

/// How this device can time GPU work.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Timestamps {
    /// No timestamp queries: timing falls back to the wall clock around a submission.
    None,
    /// Timestamps only at compute-pass boundaries (Apple GPUs): one pass per timed dispatch.
    PassBoundaries,
    /// Timestamps anywhere in a pass (NVIDIA and Mesa on Vulkan): one pass, a pair around each
    /// dispatch.
    InsidePasses,
}

/// The optional features this device was opened with (each requested only where the adapter
/// has it), for kernels and tools to pick a variant or a fallback.
#[derive(Debug, Clone, Copy)]
pub struct Caps {
    /// SHADER_F16: f16 arithmetic and storage in shaders.
    pub f16: bool,
    /// SUBGROUP, with the adapter's (min, max) subgroup size; kernels must not assume either.
    pub subgroup: Option<(u32, u32)>,
    pub timestamps: Timestamps,
    /// Nanoseconds per timestamp tick.
    pub timestamp_period_ns: f64,
}

impl Caps {
    fn of(adapter: &wgpu::Adapter) -> (Caps, wgpu::Features) {
        use wgpu::Features as F;
        let have = adapter.features();
        let info = adapter.get_info();
        let mut want = F::empty();
        for f in [F::SHADER_F16, F::SUBGROUP, F::TIMESTAMP_QUERY] {
            if have.contains(f) {
                want |= f;
            }
        }
        let timestamps = if !have.contains(F::TIMESTAMP_QUERY) {
            Timestamps::None
        } else if have.contains(F::TIMESTAMP_QUERY_INSIDE_PASSES) {
            want |= F::TIMESTAMP_QUERY_INSIDE_PASSES;
            Timestamps::InsidePasses
        } else {
            Timestamps::PassBoundaries
        };
        let caps = Caps {
            f16: want.contains(F::SHADER_F16),
            subgroup: want
                .contains(F::SUBGROUP)
                .then_some((info.subgroup_min_size, info.subgroup_max_size)),
            timestamps,
            timestamp_period_ns: 1.0,
        };
        (caps, want)
    }
}

/// Most timestamp pairs one [`Timer`] holds (wgpu allows 4,096 queries per set).
pub const MAX_TIMED: usize = 2048;

/// A timestamp query set with its resolve and readback buffers: times up to `cap` dispatches of
/// one submission. Made only when profiling, so untimed steps pay nothing.
pub struct Timer {
    pub set: wgpu::QuerySet,
    resolve: wgpu::Buffer,
    read: wgpu::Buffer,
    pub cap: usize,
    pub mode: Timestamps,
    period_ns: f64,
}

impl Timer {
    /// Copies the first `n` pairs' ticks to the readback buffer (after the timed work in `enc`).
    pub fn resolve(&self, enc: &mut wgpu::CommandEncoder, n: usize) {
        if n == 0 {
            return;
        }
        let q = (2 * n) as u32;
        enc.resolve_query_set(&self.set, 0..q, &self.resolve, 0);
        enc.copy_buffer_to_buffer(&self.resolve, 0, &self.read, 0, q as u64 * 8);
    }

    /// The nanoseconds of the first `n` pairs, once the submission that resolved them finished.
    pub fn read(&self, gpu: &Gpu, n: usize) -> Result<Vec<f64>, BackendError> {
        Ok(self
            .read_spans(gpu, n)?
            .into_iter()
            .map(|(a, b)| (b - a).max(0.0))
            .collect())
    }

    /// The first `n` pairs as (start, end) in nanoseconds from the first pair's start.
    pub fn read_spans(&self, gpu: &Gpu, n: usize) -> Result<Vec<(f64, f64)>, BackendError> {
        let raw = gpu.read(&self.read, (16 * n) as u64)?;
        let ticks: Vec<u64> = raw
            .chunks_exact(8)
            .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
            .collect();
        let t0 = ticks.first().copied().unwrap_or(0);
        let ns = |t: u64| t.wrapping_sub(t0) as i64 as f64 * self.period_ns;
        Ok(ticks
            .chunks_exact(2)
            .map(|p| (ns(p[0]), ns(p[1])))
            .collect())
    }
}

pub struct Gpu {
    pub device: wgpu::Device,
    pub queue: wgpu::Queue,
    pub limits: wgpu::Limits,
    pub info: AdapterSummary,
    /// The prompt GEMM's matrix-unit configuration, where the device was opened with it.
    pub coop: Option<super::gemm::CoopTile>,
    pub caps: Caps,
    errors: Sink,
    timeout: Duration,
    /// Bytes of buffers created (weights, cache, work buffers), and the most at once.
    pub allocated: u64,
    pub peak: u64,
}

impl Gpu {
    /// Opens the adapter `choice` names (see [`pick`]) with its own limits.
    pub fn new(choice: Option<&str>) -> Result<Gpu, BackendError> {
        let inst = instance();
        let adapter = pick(compute_adapters(&inst), choice)?;
        let info = summarize(0, &adapter);
        let down = adapter.get_downlevel_capabilities().flags;
        if !down.contains(wgpu::DownlevelFlags::SHADER_F16_IN_F32) {
            return Err(BackendError::Wgpu(format!(
                "adapter {} ({}) cannot pack f16 pairs in shaders (pack2x16float): the f16 \
                 weights and KV cache need it",
                info.name, info.backend
            )));
        }
        let limits = adapter.limits();
        let (mut caps, features) = Caps::of(&adapter);
        let (coop, coop_features) = coop_request(&adapter);
        let experimental = if coop.is_some() {
            // SAFETY: wgpu marks cooperative matrices experimental (its implementation may have
            // bugs); quire asks for them only where the adapter reports a configuration its
            // GEMM kernel was written for (the tiled GEMM serves every other adapter).
            unsafe { wgpu::ExperimentalFeatures::enabled() }
        } else {
            wgpu::ExperimentalFeatures::disabled()
        };
        let (device, queue) = pollster::block_on(adapter.request_device(&wgpu::DeviceDescriptor {
            label: Some("quire"),
            required_features: features | coop_features,
            required_limits: limits.clone(),
            experimental_features: experimental,
            memory_hints: wgpu::MemoryHints::Performance,
            trace: wgpu::Trace::Off,
        }))
        .map_err(|e| BackendError::Wgpu(format!("cannot open adapter {}: {e}", info.name)))?;
        let errors: Sink = Arc::default();
        let sink = errors.clone();
        device.on_uncaptured_error(Arc::new(move |e: wgpu::Error| {
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(e.to_string());
        }));
        let sink = errors.clone();
        device.set_device_lost_callback(move |reason, msg| {
            sink.lock()
                .unwrap_or_else(|p| p.into_inner())
                .push(format!("device lost ({reason:?}): {msg}"));
        });
        let secs = std::env::var("QUIRE_WGPU_TIMEOUT_S")
            .ok()
            .and_then(|s| s.parse().ok())
            .unwrap_or(600u64);
        caps.timestamp_period_ns = queue.get_timestamp_period() as f64;
        Ok(Gpu {
            device,
            queue,
            limits,
            info,
            coop,
            caps,
            errors,
            timeout: Duration::from_secs(secs),
            allocated: 0,
            peak: 0,
        })
    }

    /// A timer for up to `pairs` dispatches (at most [`MAX_TIMED`]), or `None` when this device
    /// has no timestamp queries.
    pub fn timer(&mut self, pairs: usize) -> Result<Option<Timer>, BackendError> {
        if self.caps.timestamps == Timestamps::None {
            return Ok(None);
        }
        let cap = pairs.clamp(1, MAX_TIMED);
        let set = self.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("dispatch timestamps"),
            ty: wgpu::QueryType::Timestamp,
            count: (2 * cap) as u32,
        });
        let bytes = (16 * cap) as u64;
        let resolve = self.buffer(
            "timestamps",
            bytes,
            wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
        )?;
        let read = self.buffer(
            "timestamps readback",
            bytes,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        )?;
        self.check()?;
        Ok(Some(Timer {
            set,
            resolve,
            read,
            cap,
            mode: self.caps.timestamps,
            period_ns: self.caps.timestamp_period_ns,
        }))
    }

    /// The errors wgpu reported since the last call, as one error.
    pub fn check(&self) -> Result<(), BackendError> {
        let mut e = self.errors.lock().unwrap_or_else(|p| p.into_inner());
        if e.is_empty() {
            return Ok(());
        }
        let msg = e.join("\n");
        e.clear();
        Err(BackendError::Wgpu(msg))
    }

    /// The largest buffer one binding may hold.
    pub fn max_binding(&self) -> u64 {
        self.limits
            .max_storage_buffer_binding_size
            .min(self.limits.max_buffer_size)
    }

    /// A buffer of `bytes` (rounded up to 4, at least 16), refused with an error naming `what`
    /// when one binding cannot hold it.
    pub fn buffer(
        &mut self,
        what: &str,
        bytes: u64,
        usage: wgpu::BufferUsages,
    ) -> Result<wgpu::Buffer, BackendError> {
        let size = bytes.div_ceil(4).max(4) * 4;
        let limit = if usage.contains(wgpu::BufferUsages::STORAGE) {
            self.max_binding()
        } else {
            self.limits.max_buffer_size
        };
        if size > limit {
            return Err(BackendError::OutOfMemory(format!(
                "{what} needs {} MiB in one binding, more than this adapter's \
                 max_storage_buffer_binding_size ({} MiB)",
                size >> 20,
                limit >> 20
            )));
        }
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::OutOfMemory);
        let buf = self.device.create_buffer(&wgpu::BufferDescriptor {
            label: Some(what),
            size,
            usage,
            mapped_at_creation: false,
        });
        if let Some(e) = pollster::block_on(scope.pop()) {
            return Err(BackendError::OutOfMemory(format!(
                "{what} ({size} bytes): {e}"
            )));
        }
        self.allocated += size;
        self.peak = self.peak.max(self.allocated);
        Ok(buf)
    }

    /// A storage buffer holding `data` (padded with zeros to a multiple of 4 bytes).
    pub fn upload(&mut self, what: &str, data: &[u8]) -> Result<wgpu::Buffer, BackendError> {
        let usage = wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_DST;
        let buf = self.buffer(what, data.len() as u64, usage)?;
        let whole = data.len() / 4 * 4;
        if whole > 0 {
            self.queue.write_buffer(&buf, 0, &data[..whole]);
        }
        if whole < data.len() {
            let mut tail = [0u8; 4];
            tail[..data.len() - whole].copy_from_slice(&data[whole..]);
            self.queue.write_buffer(&buf, whole as u64, &tail);
        }
        Ok(buf)
    }

    /// Forgets a buffer's bytes in the allocation count (the caller drops it).
    pub fn release(&mut self, b: &wgpu::Buffer) {
        self.allocated = self.allocated.saturating_sub(b.size());
    }

    /// A compute pipeline for `entry` of the WGSL `source`, its layout derived from the shader.
    /// A shader that does not compile is an error carrying the compiler's log.
    pub fn pipeline(
        &self,
        name: &str,
        source: &str,
        entry: &str,
    ) -> Result<wgpu::ComputePipeline, BackendError> {
        let scope = self.device.push_error_scope(wgpu::ErrorFilter::Validation);
        let desc = wgpu::ShaderModuleDescriptor {
            label: Some(name),
            source: wgpu::ShaderSource::Wgsl(source.into()),
        };
        // Without the loop counters naga adds to every loop by default (they keep a shader that
        // never ends from being undefined behaviour): every loop of quire's kernels is bounded
        // by its parameters, which the host checks, and the counters cost CPU drivers (lavapipe)
        // most of their speed. Buffer bounds checks stay on.
        let checks = wgpu::ShaderRuntimeChecks {
            force_loop_bounding: false,
            ..wgpu::ShaderRuntimeChecks::checked()
        };
        // SAFETY: the checks kept (bounds checks) are those that guard memory; the one dropped
        // only matters for a loop without end, and every kernel loop runs to a bound that comes
        // from parameters the host validated.
        let module = unsafe { self.device.create_shader_module_trusted(desc, checks) };
        let pipe = self
            .device
            .create_compute_pipeline(&wgpu::ComputePipelineDescriptor {
                label: Some(name),
                layout: None,
                module: &module,
                entry_point: Some(entry),
                compilation_options: Default::default(),
                cache: None,
            });
        if let Some(e) = pollster::block_on(scope.pop()) {
            let info = pollster::block_on(module.get_compilation_info());
            let mut log: Vec<String> = info
                .messages
                .iter()
                .map(|m| {
                    let at = m
                        .location
                        .map(|l| format!("line {}:{}: ", l.line_number, l.line_position))
                        .unwrap_or_default();
                    format!("{:?}: {at}{}", m.message_type, m.message)
                })
                .collect();
            log.push(e.to_string());
            return Err(BackendError::Kernel {
                name: format!("{name} ({entry})"),
                log: log.join("\n"),
            });
        }
        Ok(pipe)
    }

    /// Submits `cmd` and waits for it (within the time limit), then reports any error wgpu
    /// raised meanwhile.
    pub fn submit_wait(&self, cmd: wgpu::CommandBuffer) -> Result<(), BackendError> {
        let idx = self.queue.submit([cmd]);
        self.wait(Some(idx))?;
        self.check()
    }

    fn wait(&self, idx: Option<wgpu::SubmissionIndex>) -> Result<(), BackendError> {
        self.device
            .poll(wgpu::PollType::Wait {
                submission_index: idx,
                timeout: Some(self.timeout),
            })
            .map(|_| ())
            .map_err(|e| {
                BackendError::Wgpu(format!(
                    "waiting for the device ({}s limit, QUIRE_WGPU_TIMEOUT_S): {e}",
                    self.timeout.as_secs()
                ))
            })
    }

    /// Submits `cmd` and reads the first `bytes` of the MAP_READ buffer `staging` once it has
    /// run: the map is asked for before the wait, so one wait serves both.
    pub fn submit_read(
        &self,
        cmd: wgpu::CommandBuffer,
        staging: &wgpu::Buffer,
        bytes: u64,
    ) -> Result<Vec<u8>, BackendError> {
        self.submit_read_with(cmd, staging, bytes, |b| b.to_vec())
    }

    /// [`Self::submit_read`], handing the mapped bytes to `f` instead of copying them (a
    /// decode step's logits row of a large vocabulary is half a megabyte: the caller decodes it
    /// straight into its own buffer).
    pub fn submit_read_with<T>(
        &self,
        cmd: wgpu::CommandBuffer,
        staging: &wgpu::Buffer,
        bytes: u64,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<T, BackendError> {
        if bytes == 0 {
            self.submit_wait(cmd)?;
            return Ok(f(&[]));
        }
        self.queue.submit([cmd]);
        self.read_with(staging, bytes, f)
    }

    /// Reads the first `bytes` of a MAP_READ buffer after the work submitted so far.
    pub fn read(&self, staging: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>, BackendError> {
        self.read_with(staging, bytes, |b| b.to_vec())
    }

    /// [`Self::read`], handing the mapped bytes to `f`.
    pub fn read_with<T>(
        &self,
        staging: &wgpu::Buffer,
        bytes: u64,
        f: impl FnOnce(&[u8]) -> T,
    ) -> Result<T, BackendError> {
        if bytes == 0 {
            return Ok(f(&[]));
        }
        let done: Arc<Mutex<Option<Result<(), wgpu::BufferAsyncError>>>> = Arc::default();
        let d = done.clone();
        staging.map_async(wgpu::MapMode::Read, 0..bytes, move |r| {
            *d.lock().unwrap_or_else(|p| p.into_inner()) = Some(r);
        });
        self.wait(None)?;
        let r = done.lock().unwrap_or_else(|p| p.into_inner()).take();
        match r {
            Some(Ok(())) => {}
            Some(Err(e)) => return Err(BackendError::Wgpu(format!("reading back: {e}"))),
            None => {
                return Err(BackendError::Wgpu(
                    "reading back: the map never finished".into(),
                ))
            }
        }
        let out = f(&staging
            .get_mapped_range(0..bytes)
            .map_err(|e| BackendError::Wgpu(format!("reading back: {e}")))?);
        staging.unmap();
        self.check()?;
        Ok(out)
    }

    /// Copies the first `bytes` of `src` back to the host (a one-off, for tests and tools).
    pub fn download(&mut self, src: &wgpu::Buffer, bytes: u64) -> Result<Vec<u8>, BackendError> {
        let size = bytes.div_ceil(4) * 4;
        let staging = self.buffer(
            "download",
            size,
            wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        )?;
        let mut enc = self.device.create_command_encoder(&Default::default());
        enc.copy_buffer_to_buffer(src, 0, &staging, 0, size);
        self.submit_wait(enc.finish())?;
        let mut out = self.read(&staging, size)?;
        out.truncate(bytes as usize);
        self.release(&staging);
        Ok(out)
    }
}
