//! Weight matrices on the GPU, in one of two forms: f16 for cuBLAS, or ggml Q4_0/Q4_1/Q8_0 blocks
//! (and Q4_K/Q5_K/Q6_K super-blocks, whose 32-element sub-blocks line up with activation blocks)
//! kept exactly as stored, multiplied by the dp4a kernels of `kernels/quant.cu` against
//! activations quantized to 8 bits per block of 32. The quantized form reads 3.5× (Q4) or 1.9×
//! (Q8_0) fewer bytes per decode step than f16, and it is the CPU backend's (and llama.cpp's)
//! arithmetic, so a quantized model gives the same logits on both backends. Below
//! [`TC_MIN_TOKENS`] tokens, rows that start 16-byte aligned go to the staged kernel (`mmv_*`:
//! coalesced 16-byte loads of whole stored blocks into shared memory, the next stage in flight
//! while the current one is multiplied; the decode step's path), others to the dp4a kernel
//! (`mmq_*`, loads of 2 or 4 bytes straight from the row). From [`TC_MIN_TOKENS`] tokens on, the
//! matmul runs on the int8 tensor cores (`kernels/mmq_tc.cu`), which reads each weight once per
//! token tile (8 to 64 tokens) instead of once per 8, with the same per-block arithmetic:
//! the pipelined kernel (`mmq_*_tcp*`: `cp.async` stages, K split over CTAs until the grid fills
//! the GPU, the partial tiles summed in a fixed order) below [`PIPE_MAX_TOKENS`] where the weights
//! and activations are 16-byte aligned, else the first 64 × 64 tile kernel (`mmq_*_tc`).

use cudarc::driver::sys::CUfunction_attribute as FuncAttr;
use cudarc::driver::{CudaFunction, CudaModule};
use half::f16;
use quire_gguf::GgmlType;
use std::sync::Arc;

use super::gpu::{DBuf, Gpu, KArg};
use super::nvrtc;
use crate::{BackendError, HostTensor};

/// Bytes of one quantized activation block on the device (`q8a_t`: d, s, 32 × i8), the CPU's
/// `BlockQ8A` layout.
pub const Q8A_BYTES: usize = 40;

/// Tokens per CTA of the many-token matmul kernel (`mmq_*_t8`).
const MMQ_TOK: usize = 8;
/// Weight rows per CTA (4 warps × 2 rows, `MMQ_WARPS × MMQ_ROWS` in quant.cu).
const MMQ_ROWS_PER_CTA: usize = 8;
/// The staged kernel's rows per CTA (`MMV_WARPS × MMV_ROWS`).
const MMV_ROWS_PER_CTA: usize = 8;
/// Threads per CTA of both dp4a kernels (4 warps: `MMQ_WARPS`, `MMV_WARPS`).
const DP4A_THREADS: u32 = 128;
/// The tensor-core kernel's tile (`TC_ROWS × TC_TOK` in mmq_tc.cu) and threads per CTA.
const TC_ROWS: usize = 64;
const TC_TOK: usize = 64;
const TC_THREADS: u32 = 256;

/// The pipelined tensor-core kernel's rows per CTA and threads (`TCP_ROWS`, `TCP_THREADS`), the
/// shared-memory bytes of one token's activation stage (`TCP_ASTR`) and its token tiles.
const TCP_ROWS: usize = 64;
const TCP_THREADS: u32 = 128;
const TCP_ASTR: usize = 336;
const TCP_TILES: [usize; 4] = [8, 16, 32, 64];
/// Scratch for the split-K partial tiles (f32 values) and the per-tile counters: a fixed buffer
/// allocated once, so a captured CUDA graph keeps valid addresses. A launch whose partials would
/// not fit runs unsplit.
const TCP_PART_FLOATS: usize = 4 << 20;
const TCP_COUNTERS: usize = 8192;

/// The fewest tokens [`QuantKernels::matmul`] sends to the tensor-core kernels (on sm_80 and
/// newer). Measured on an H100 (`cuda_matmul_bench --only many --reps 50`, 2026-11-27): at 8
/// tokens the pipelined kernel beats the dp4a kernel on every 8B shape and type, e.g. Q4_K o
/// 4096 × 4096 17.8 µs against 31.3, gate/up 28672 × 4096 69.3 against 165.8, down 4096 × 14336
/// 35.1 against 88.2 (Q6_K gate/up 104.4 against 330.4). Fewer tokens were not measured.
pub const TC_MIN_TOKENS: usize = 8;

/// From this many tokens the first 64 × 64 tile kernel takes over from the pipelined one (up to
/// `CudaOptions::dequant_gemm_tokens`). Same measurement, 128 tokens: Q4_K o 67.5 µs against
/// 87.4, gate/up 332.1 against 409.9, down 246.9 against 259.7; Q8_0 gate/up 361.0 against 701.5
/// (Q6_K the one type a little faster pipelined: down 283.8 against 329.2). At 64 tokens the
/// pipelined kernel is ahead (Q4_K o 49.4 against 67.0, down 147.7 against 236.7).
pub const PIPE_MAX_TOKENS: usize = 128;

/// Which kernel multiplies a quantized weight (the benchmark times each; [`QuantKernels::matmul`]
/// picks by token count).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QKernel {
    /// dp4a straight from the rows (`mmq_*`): one token per CTA row pass at n = 1, eight tokens
    /// per CTA otherwise. Any row alignment.
    Dp4a,
    /// The same dp4a arithmetic on rows staged through shared memory by 16-byte loads (`mmv_*`):
    /// one token at n = 1, eight per CTA otherwise. Needs [`QuantKernels::mmv_ok`].
    Staged,
    /// int8 `mma.sync`: 64 rows × 64 tokens per CTA (sm_80 and newer).
    TensorCore,
    /// int8 `mma.sync`, pipelined: 64 rows × 8/16/32/64 tokens per CTA, `cp.async` stages, K split
    /// over CTAs (sm_80 and newer; weights and activations 16-byte aligned).
    TensorCorePipe,
}

/// Stored bytes of one 8-block K step of a row, as `tcp_geom<TYPE>::step_bytes`.
fn tcp_step_bytes(dtype: GgmlType) -> usize {
    match dtype {
        GgmlType::Q4_0 => 8 * 18,
        GgmlType::Q4_1 => 8 * 20,
        GgmlType::Q8_0 => 8 * 34,
        GgmlType::Q4_K => 144,
        GgmlType::Q5_K => 176,
        _ => 210, // Q6_K
    }
}

/// Dynamic shared memory of `mmq_*_tcp<nt>`: `tcp_stages<NT>` stages of 64 weight rows
/// (`tcp_geom::wstr` bytes each) and `nt` activation rows.
pub fn tcp_smem(dtype: GgmlType, nt: usize) -> usize {
    let units = (tcp_step_bytes(dtype) + 30) / 16;
    let wstr = if units % 2 == 1 {
        units * 16
    } else {
        units * 16 + 16
    };
    let stages = if nt <= 32 { 4 } else { 3 };
    stages * (TCP_ROWS * wstr + nt * TCP_ASTR)
}

/// How the pipelined kernel covers a `[rows, nb blocks] × n tokens` product.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct TcpPlan {
    /// Tokens per CTA (8, 16, 32 or 64) and its index in [`TCP_TILES`].
    pub nt: usize,
    tile: usize,
    /// The grid: row tiles × token tiles × K splits.
    pub grid: (usize, usize, usize),
    /// K steps (8 blocks) per split.
    pub steps_per: usize,
}

/// The pipelined kernel's plan: the smallest token tile that holds the batch (64 beyond), then
/// K split until the grid holds `target` CTAs, each split keeping at least 2 K steps, and only
/// while the partials fit the scratch.
pub fn tcp_plan(rows: usize, nb: usize, n: usize, target: usize) -> TcpPlan {
    let tile = TCP_TILES
        .iter()
        .position(|&t| n <= t)
        .unwrap_or(TCP_TILES.len() - 1);
    let nt = TCP_TILES[tile];
    let (gx, gy) = (rows.div_ceil(TCP_ROWS), n.div_ceil(nt));
    let steps = nb.div_ceil(8);
    let tiles = gx * gy;
    let want = target.div_ceil(tiles).min(steps / 2).max(1);
    let mut steps_per = steps.div_ceil(want);
    let mut z = steps.div_ceil(steps_per);
    if z > 1 && (tiles * z * TCP_ROWS * nt > TCP_PART_FLOATS || tiles > TCP_COUNTERS) {
        steps_per = steps;
        z = 1;
    }
    TcpPlan {
        nt,
        tile,
        grid: (gx, gy, z),
        steps_per,
    }
}

/// The stored types the quantized matmul kernels read.
pub fn is_native_quant(dtype: GgmlType) -> bool {
    is_block32_quant(dtype) || matches!(dtype, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

/// The legacy 32-element block types.
pub fn is_block32_quant(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// A weight matrix `[rows, row_len]` (ggml order: each row contiguous).
pub enum WMat {
    F16(DBuf<f16>),
    Quant { dtype: GgmlType, data: DBuf<u8> },
}

impl WMat {
    pub fn quant_type(&self) -> Option<GgmlType> {
        match self {
            WMat::F16(_) => None,
            WMat::Quant { dtype, .. } => Some(*dtype),
        }
    }

    /// Device address of the data.
    pub fn ptr(&self) -> u64 {
        match self {
            WMat::F16(b) => b.ptr,
            WMat::Quant { data, .. } => data.ptr,
        }
    }

    /// Bytes of a `[rows, row_len]` matrix in this form (for sizing and the profiler).
    pub fn bytes_for(&self, rows: usize, row_len: usize) -> usize {
        match self {
            WMat::F16(_) => 2 * rows * row_len,
            WMat::Quant { dtype, .. } => {
                rows * dtype.row_size(row_len as u64).unwrap_or(0) as usize
            }
        }
    }
}

fn check_shape(t: &HostTensor, row_len: usize, rows: usize) -> Result<(), BackendError> {
    if t.row_len() != row_len || t.rows() != rows {
        return Err(BackendError::Shape {
            name: t.name.clone(),
            got: t.dims.clone(),
            expected: vec![row_len, rows],
        });
    }
    Ok(())
}

/// A 2-D weight as f16 on the host (dequantized when stored quantized).
pub fn to_f16(t: &HostTensor) -> Result<Vec<f16>, BackendError> {
    Ok(match t.dtype {
        GgmlType::F16 => t
            .bytes
            .as_slice()
            .chunks_exact(2)
            .map(|b| f16::from_bits(u16::from_le_bytes([b[0], b[1]])))
            .collect(),
        _ => t.to_f32()?.into_iter().map(f16::from_f32).collect(),
    })
}

/// Uploads `parts` (each `[rows_i, row_len]`) stacked by rows into one matrix: kept quantized when
/// `keep_quant` and every part is stored in the same native quantized type, f16 otherwise.
pub fn upload_stacked(
    gpu: &Gpu,
    parts: &[&HostTensor],
    row_len: usize,
    rows: &[usize],
    keep_quant: bool,
) -> Result<WMat, BackendError> {
    for (t, &r) in parts.iter().zip(rows) {
        check_shape(t, row_len, r)?;
    }
    let dtype = parts[0].dtype;
    if keep_quant && is_native_quant(dtype) && parts.iter().all(|t| t.dtype == dtype) {
        let mut bytes = Vec::with_capacity(parts.iter().map(|t| t.bytes.as_slice().len()).sum());
        for t in parts {
            bytes.extend_from_slice(t.bytes.as_slice());
        }
        return Ok(WMat::Quant {
            dtype,
            data: gpu.upload(&bytes)?,
        });
    }
    let total: usize = rows.iter().sum();
    let mut buf = gpu.alloc::<f16>(total * row_len)?;
    let mut off = 0;
    for (t, &r) in parts.iter().zip(rows) {
        gpu.htod(&to_f16(t)?, &mut buf, off)?;
        off += r * row_len;
    }
    Ok(WMat::F16(buf))
}

/// The kernels of quant.cu.
pub struct QuantKernels {
    pub rms_norm_q8: CudaFunction,
    pub swiglu_q8: CudaFunction,
    pub quantize_f16: CudaFunction,
    pub quantize_f32: CudaFunction,
    /// A read-only pass over a buffer (`read_roof(p, n16, out)`): the benchmark's memory roof.
    pub read_roof: CudaFunction,
    /// By type (`NATIVE` order): the one-token, the eight-token and the tensor-core matmul.
    mmq: [[CudaFunction; 3]; 6],
    /// By type: the staged one-token and eight-token kernels.
    mmv: [[CudaFunction; 2]; 6],
    /// By type and token tile ([`TCP_TILES`]): the pipelined tensor-core kernel, `None` where its
    /// shared memory does not fit this device.
    tcp: [[Option<CudaFunction>; 4]; 6],
    /// Split-K scratch: partial tiles and per-tile counters (zero between launches).
    tcp_part: DBuf<f32>,
    tcp_cnt: DBuf<u32>,
    /// By type and token tile: the CTAs a split-K grid aims at (one full wave: the kernel's CTAs
    /// per multiprocessor, by its shared memory and registers, times the multiprocessors).
    tcp_target: [[usize; 4]; 6],
    /// The device has int8 `mma.sync` (sm_80+): the tensor-core kernels may be launched.
    has_mma: bool,
    embed: [CudaFunction; 6],
    dequant: [CudaFunction; 6],
}

/// The kernels' types, in their array order, with the suffix of their kernel names.
const NATIVE: [(GgmlType, &str); 6] = [
    (GgmlType::Q4_0, "q4_0"),
    (GgmlType::Q4_1, "q4_1"),
    (GgmlType::Q8_0, "q8_0"),
    (GgmlType::Q4_K, "q4_k"),
    (GgmlType::Q5_K, "q5_k"),
    (GgmlType::Q6_K, "q6_k"),
];

fn six<T>(v: Vec<T>) -> [T; 6] {
    v.try_into()
        .unwrap_or_else(|_| unreachable!("one per NATIVE type"))
}

/// `XY` of an `sm_XY` architecture name (0 when it is not one).
fn sm_version(arch: &str) -> u32 {
    arch.strip_prefix("sm_")
        .and_then(|v| v.parse().ok())
        .unwrap_or(0)
}

fn type_index(dtype: GgmlType) -> usize {
    NATIVE
        .iter()
        .position(|(t, _)| *t == dtype)
        .expect("callers hold a native quantized type")
}

impl QuantKernels {
    pub fn new(gpu: &Gpu) -> Result<Self, BackendError> {
        let m: Arc<CudaModule> = gpu.module(&nvrtc::QUANT, &[])?;
        let f = |name: &str| Gpu::function(&m, name);
        let by_type = |prefix: &str| -> Result<Vec<CudaFunction>, BackendError> {
            NATIVE
                .iter()
                .map(|(_, t)| f(&prefix.replace("{}", t)))
                .collect()
        };
        let t1 = by_type("mmq_{}_t1")?;
        let t8 = by_type("mmq_{}_t8")?;
        let tc = by_type("mmq_{}_tc")?;
        let v1 = by_type("mmv_{}_t1")?;
        let v8 = by_type("mmv_{}_t8")?;
        let has_mma = sm_version(&gpu.arch) >= 80;
        let mut tcp = Vec::with_capacity(6);
        let mut tcp_target = [[0usize; 4]; 6];
        for (ti, (dtype, t)) in NATIVE.into_iter().enumerate() {
            let mut per = Vec::with_capacity(4);
            for (ni, nt) in TCP_TILES.into_iter().enumerate() {
                let func = f(&format!("mmq_{t}_tcp{nt}"))?;
                // The kernel is used only where its shared memory can be granted (sm_80+).
                let ok = has_mma
                    && func
                        .set_attribute(
                            FuncAttr::CU_FUNC_ATTRIBUTE_MAX_DYNAMIC_SHARED_SIZE_BYTES,
                            tcp_smem(dtype, nt) as i32,
                        )
                        .is_ok();
                let per_sm = if ok {
                    func.occupancy_max_active_blocks_per_multiprocessor(
                        TCP_THREADS,
                        tcp_smem(dtype, nt),
                        None,
                    )
                    .map_or(1, |b| b.max(1) as usize)
                } else {
                    1
                };
                tcp_target[ti][ni] = per_sm * gpu.sms as usize;
                per.push(ok.then_some(func));
            }
            tcp.push([per[0].take(), per[1].take(), per[2].take(), per[3].take()]);
        }
        Ok(Self {
            rms_norm_q8: f("rms_norm_q8")?,
            swiglu_q8: f("swiglu_q8")?,
            quantize_f16: f("quantize_q8_f16")?,
            quantize_f32: f("quantize_q8_f32")?,
            read_roof: f("read_roof")?,
            mmq: six(t1
                .into_iter()
                .zip(t8)
                .zip(tc)
                .map(|((a, b), c)| [a, b, c])
                .collect()),
            mmv: six(v1.into_iter().zip(v8).map(|(a, b)| [a, b]).collect()),
            tcp: six(tcp),
            tcp_part: gpu.alloc::<f32>(TCP_PART_FLOATS)?,
            tcp_cnt: gpu.alloc::<u32>(TCP_COUNTERS)?,
            tcp_target,
            has_mma,
            embed: six(by_type("embed_{}")?),
            dequant: six(by_type("dequant_{}")?),
        })
    }

    /// The kernel [`Self::matmul`] uses for `n` tokens on `dtype` weights at address `w` with rows
    /// of `k_in` values.
    pub fn pick(&self, dtype: GgmlType, n: usize, k_in: usize, w: u64) -> QKernel {
        if n >= TC_MIN_TOKENS && self.tc_ok(w) {
            if n < PIPE_MAX_TOKENS && self.tcp_ok(dtype, n) {
                QKernel::TensorCorePipe
            } else {
                QKernel::TensorCore
            }
        } else if Self::mmv_ok(dtype, k_in, w) {
            QKernel::Staged
        } else {
            QKernel::Dp4a
        }
    }

    /// Whether the staged kernel can read `dtype` rows of `k_in` values from `w`: every row starts
    /// 16-byte aligned (the base is, and a row's bytes are a multiple of 16). True for every type
    /// at the 8B shapes (k = 4096, 14336; Q6_K and the legacy types need a multiple of 8 blocks).
    pub fn mmv_ok(dtype: GgmlType, k_in: usize, w: u64) -> bool {
        let row_bytes = dtype.row_size(k_in as u64).unwrap_or(1);
        w.is_multiple_of(16) && row_bytes.is_multiple_of(16)
    }

    /// Whether the tensor-core kernel can run here on weights at `w`: sm_80+, and 16-byte aligned
    /// (its K-quant rows are read in 16-byte loads).
    pub fn tc_ok(&self, w: u64) -> bool {
        self.has_mma && w.is_multiple_of(16)
    }

    /// Whether the pipelined tensor-core kernel for `n` tokens of `dtype` could be set up on this
    /// device (its alignment needs are checked per launch: see [`Self::matmul`]).
    pub fn tcp_ok(&self, dtype: GgmlType, n: usize) -> bool {
        let plan = tcp_plan(1, 8, n, 1);
        self.tcp[type_index(dtype)][plan.tile].is_some()
    }

    /// The pipelined kernel's plan for this device (the benchmark prints it).
    pub fn tcp_plan(&self, dtype: GgmlType, rows: usize, k_in: usize, n: usize) -> TcpPlan {
        let tile = tcp_plan(1, 8, n, 1).tile;
        tcp_plan(rows, k_in / 32, n, self.tcp_target[type_index(dtype)][tile])
    }

    /// `y[n, out] (f32) = x · wᵀ + beta · y` for a quantized `w: [out, k_in]`; `xq: [n, k_in / 32]`
    /// q8 blocks. The kernel is [`Self::pick`]'s.
    ///
    /// # Safety
    ///
    /// `w` (`[out, k_in]` blocks of `dtype`), `xq` (`n · k_in / 32` q8 blocks) and `y` (`n · out`
    /// f32) are live device allocations on `gpu`'s context, not freed before the stream has
    /// finished the kernel; `y` overlaps neither input.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul(
        &self,
        gpu: &Gpu,
        dtype: GgmlType,
        w: u64,
        xq: u64,
        y: u64,
        n: usize,
        k_in: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        let mut kernel = self.pick(dtype, n, k_in, w);
        if kernel == QKernel::TensorCorePipe && !xq.is_multiple_of(16) {
            kernel = QKernel::TensorCore;
        }
        // SAFETY: this fn's contract is `matmul_with`'s.
        unsafe { self.matmul_with(kernel, gpu, dtype, w, xq, y, n, k_in, out, beta) }
    }

    /// [`Self::matmul`] with the kernel named (for the benchmark and the kernel-equality test).
    /// [`QKernel::TensorCore`] where [`Self::tc_ok`] is false, or [`QKernel::Staged`] where
    /// [`Self::mmv_ok`] is false, is an error.
    ///
    /// # Safety
    ///
    /// As [`Self::matmul`].
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn matmul_with(
        &self,
        kernel: QKernel,
        gpu: &Gpu,
        dtype: GgmlType,
        w: u64,
        xq: u64,
        y: u64,
        n: usize,
        k_in: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        use KArg::{F, I, P};
        let args = [
            P(w),
            P(xq),
            P(y),
            I(out as i32),
            I((k_in / 32) as i32),
            I(n as i32),
            F(beta),
        ];
        if kernel == QKernel::TensorCorePipe {
            // SAFETY: this fn's contract.
            return unsafe { self.matmul_pipe(gpu, dtype, w, xq, y, n, k_in, out, beta) };
        }
        if kernel == QKernel::TensorCore {
            if !self.tc_ok(w) {
                return Err(BackendError::Cuda(format!(
                    "the tensor-core quantized matmul needs sm_80 or newer (this device is {}) \
                     and 16-byte aligned weights (address {w:#x})",
                    gpu.arch
                )));
            }
            let grid_y = n.div_ceil(TC_TOK);
            if grid_y > 65535 {
                return Err(BackendError::InvalidBatch(format!(
                    "{n} tokens in one quantized matmul (at most {})",
                    65535 * TC_TOK
                )));
            }
            // SAFETY: the arguments are mmq_*_tc's list; the addresses are the caller's.
            return unsafe {
                gpu.launch(
                    &self.mmq[type_index(dtype)][2],
                    (out.div_ceil(TC_ROWS) as u32, grid_y as u32, 1),
                    (TC_THREADS, 1, 1),
                    &args,
                )
            };
        }
        if kernel == QKernel::Staged && !Self::mmv_ok(dtype, k_in, w) {
            return Err(BackendError::Cuda(format!(
                "the staged quantized matmul needs 16-byte aligned rows ({} rows of {k_in} \
                 values at address {w:#x})",
                dtype.name()
            )));
        }
        let (kernels, per_cta) = if kernel == QKernel::Staged {
            (&self.mmv[type_index(dtype)][..], MMV_ROWS_PER_CTA)
        } else {
            (&self.mmq[type_index(dtype)][..2], MMQ_ROWS_PER_CTA)
        };
        let (f, tok) = if n == 1 {
            (&kernels[0], 1)
        } else {
            (&kernels[1], MMQ_TOK)
        };
        let grid_y = n.div_ceil(tok);
        if grid_y > 65535 {
            return Err(BackendError::InvalidBatch(format!(
                "{n} tokens in one quantized matmul (at most {})",
                65535 * MMQ_TOK
            )));
        }
        // SAFETY: the arguments are mmq's list; the addresses are the caller's (this fn's contract).
        unsafe {
            gpu.launch(
                f,
                (out.div_ceil(per_cta) as u32, grid_y as u32, 1),
                (DP4A_THREADS, 1, 1),
                &args,
            )
        }
    }

    /// The pipelined tensor-core kernel (see [`Self::matmul_with`]).
    ///
    /// # Safety
    ///
    /// As [`Self::matmul`].
    #[allow(clippy::too_many_arguments)]
    unsafe fn matmul_pipe(
        &self,
        gpu: &Gpu,
        dtype: GgmlType,
        w: u64,
        xq: u64,
        y: u64,
        n: usize,
        k_in: usize,
        out: usize,
        beta: f32,
    ) -> Result<(), BackendError> {
        if !self.tc_ok(w) || !xq.is_multiple_of(16) {
            return Err(BackendError::Cuda(format!(
                "the pipelined tensor-core quantized matmul needs sm_80 or newer (this device is \
                 {}) and 16-byte aligned weights and activations (addresses {w:#x}, {xq:#x})",
                gpu.arch
            )));
        }
        let plan = self.tcp_plan(dtype, out, k_in, n);
        let Some(f) = &self.tcp[type_index(dtype)][plan.tile] else {
            return Err(BackendError::Cuda(format!(
                "the pipelined tensor-core kernel for {} at {} tokens does not fit this device's \
                 shared memory ({} bytes)",
                dtype.name(),
                plan.nt,
                tcp_smem(dtype, plan.nt)
            )));
        };
        let (gx, gy, gz) = plan.grid;
        if gy > 65535 {
            return Err(BackendError::InvalidBatch(format!(
                "{n} tokens in one quantized matmul (at most {})",
                65535 * plan.nt
            )));
        }
        use KArg::{F, I, P};
        let args = [
            P(w),
            P(xq),
            P(y),
            I(out as i32),
            I((k_in / 32) as i32),
            I(n as i32),
            F(beta),
            I(plan.steps_per as i32),
            P(self.tcp_part.ptr),
            P(self.tcp_cnt.ptr),
        ];
        // SAFETY: the arguments are mmq_*_tcp's list; the addresses are the caller's (this fn's
        // contract) and the scratch is this struct's, sized by `tcp_plan`'s limits; the shared
        // memory is what the kernel was set up for.
        unsafe {
            gpu.launch_smem(
                f,
                (gx as u32, gy as u32, gz as u32),
                (TCP_THREADS, 1, 1),
                tcp_smem(dtype, plan.nt) as u32,
                &args,
            )
        }
    }

    /// Quantizes `x: [n, k]` (f32 when `x_f32`, else f16) into `xq: [n, k / 32]` blocks.
    ///
    /// # Safety
    ///
    /// `x` and `xq` are live device allocations on `gpu`'s context of those sizes, not freed
    /// before the stream has finished the kernel, and do not overlap.
    pub unsafe fn quantize(
        &self,
        gpu: &Gpu,
        x: u64,
        x_f32: bool,
        xq: u64,
        n: usize,
        k: usize,
    ) -> Result<(), BackendError> {
        let blocks = n * k / 32;
        // SAFETY: the arguments are the quantize kernels' list; the addresses are the caller's.
        unsafe {
            gpu.launch(
                if x_f32 {
                    &self.quantize_f32
                } else {
                    &self.quantize_f16
                },
                (blocks.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                &[KArg::P(x), KArg::P(xq), KArg::L(blocks as i64)],
            )
        }
    }

    /// `x[t] = table[ids[t]]` from a quantized `[vocab, hidden]` table.
    ///
    /// # Safety
    ///
    /// `ids` (`n` ints, each below the table's rows), `table` and `x` (`n · hidden` f32) are live
    /// device allocations on `gpu`'s context, not freed before the stream has finished the kernel.
    #[allow(clippy::too_many_arguments)]
    pub unsafe fn embed(
        &self,
        gpu: &Gpu,
        dtype: GgmlType,
        ids: u64,
        table: u64,
        x: u64,
        n: usize,
        hidden: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: the arguments are the embed kernels' list; the addresses are the caller's.
        unsafe {
            gpu.launch(
                &self.embed[type_index(dtype)],
                (n as u32, 1, 1),
                (256, 1, 1),
                &[
                    KArg::P(ids),
                    KArg::P(table),
                    KArg::P(x),
                    KArg::I(hidden as i32),
                ],
            )
        }
    }

    /// Dequantizes a whole `[rows, row_len]` matrix (`elems` values) to f16 into `out`.
    ///
    /// # Safety
    ///
    /// `w` (`elems` values of `dtype`) and `out` (`elems` f16) are live device allocations on
    /// `gpu`'s context, not freed before the stream has finished the kernel, and do not overlap.
    pub unsafe fn dequantize(
        &self,
        gpu: &Gpu,
        dtype: GgmlType,
        w: u64,
        out: u64,
        elems: usize,
    ) -> Result<(), BackendError> {
        // SAFETY: the arguments are the dequantize kernels' list; the addresses are the caller's.
        unsafe {
            gpu.launch(
                &self.dequant[type_index(dtype)],
                (elems.div_ceil(256) as u32, 1, 1),
                (256, 1, 1),
                &[KArg::P(w), KArg::P(out), KArg::L(elems as i64)],
            )
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    /// The staged kernel reads rows in 16-byte words: it is chosen only where every row starts
    /// 16-byte aligned, which depends on the type's block bytes and the row length.
    #[test]
    fn staged_kernel_takes_only_16_byte_aligned_rows() {
        let base = 0x7f00_0000_0100u64;
        // Q4_K (144-byte super-blocks) and Q5_K (176): any whole number of super-blocks.
        for k in [256, 768, 4096, 14336] {
            assert!(QuantKernels::mmv_ok(GgmlType::Q4_K, k, base), "Q4_K k={k}");
            assert!(QuantKernels::mmv_ok(GgmlType::Q5_K, k, base), "Q5_K k={k}");
        }
        // Q6_K (210 bytes): 8 super-blocks at a time; the 8B shapes qualify, 3 super-blocks not.
        assert!(QuantKernels::mmv_ok(GgmlType::Q6_K, 4096, base));
        assert!(QuantKernels::mmv_ok(GgmlType::Q6_K, 14336, base));
        assert!(!QuantKernels::mmv_ok(GgmlType::Q6_K, 768, base));
        // Q4_0 (18 bytes) and Q8_0 (34): 8 blocks; Q4_1 (20): 4.
        assert!(QuantKernels::mmv_ok(GgmlType::Q4_0, 256, base));
        assert!(!QuantKernels::mmv_ok(GgmlType::Q4_0, 96, base));
        assert!(QuantKernels::mmv_ok(GgmlType::Q8_0, 4096, base));
        assert!(!QuantKernels::mmv_ok(GgmlType::Q8_0, 576, base));
        assert!(QuantKernels::mmv_ok(GgmlType::Q4_1, 128, base));
        assert!(!QuantKernels::mmv_ok(GgmlType::Q4_1, 96, base));
        // A base off the 16-byte grid never qualifies.
        assert!(!QuantKernels::mmv_ok(GgmlType::Q4_K, 4096, base + 8));
    }

    /// The pipelined kernel's plan: the token tile holds the batch (64 beyond), the split K ranges
    /// cover every K step once with none empty, the grid grows toward the target only while the
    /// partials fit the scratch, and short rows are not split.
    #[test]
    fn pipelined_plan_covers_the_product_and_fits_the_scratch() {
        let target = 2 * 132;
        for (n, nt) in [
            (1, 8),
            (8, 8),
            (9, 16),
            (16, 16),
            (17, 32),
            (32, 32),
            (33, 64),
            (64, 64),
            (127, 64),
        ] {
            assert_eq!(tcp_plan(4096, 128, n, target).nt, nt, "n={n}");
        }
        for rows in [1usize, 61, 4096, 6144, 28672, 128256] {
            for nb in [1usize, 8, 45, 128, 448] {
                for n in [1usize, 16, 17, 63, 64, 128, 255] {
                    let p = tcp_plan(rows, nb, n, target);
                    let steps = nb.div_ceil(8);
                    let (gx, gy, gz) = p.grid;
                    assert_eq!(gx, rows.div_ceil(64));
                    assert_eq!(gy, n.div_ceil(p.nt));
                    assert!(
                        gz * p.steps_per >= steps,
                        "{p:?} misses steps of {nb} blocks"
                    );
                    assert!((gz - 1) * p.steps_per < steps, "{p:?} has an empty split");
                    if gz > 1 {
                        assert!(gx * gy * gz * 64 * p.nt <= TCP_PART_FLOATS, "{p:?}");
                        assert!(gx * gy <= TCP_COUNTERS, "{p:?}");
                        assert!(p.steps_per >= 2, "{p:?}");
                    }
                }
            }
        }
        // The 8B decode shapes at 64 tokens: the 4096-row matrices split to fill 132 SMs, the
        // 28672-row one already does.
        assert_eq!(tcp_plan(4096, 128, 64, target).grid, (64, 1, 4));
        assert_eq!(tcp_plan(4096, 448, 64, target).grid, (64, 1, 5));
        assert_eq!(tcp_plan(28672, 128, 64, target).grid, (448, 1, 1));
    }
}
