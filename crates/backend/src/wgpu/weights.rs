//! Weights on the device. The quantized types (Q8_0, Q4_0, Q4_1, Q4_K, Q5_K, Q6_K) keep their
//! bytes (the kernels dequantize them); f16 stays f16; f32 and bf16 become f16. Rows stay
//! row-major, since the GPU kernels walk a row with a group of invocations, each loading 16 bytes
//! at a time: blocks whose size is not a multiple of 16 bytes (Q8_0, Q4_0, Q4_1, Q6_K) are
//! stored without their scales, which follow all the part's blocks (types.wgsl says where).
//! A matrix is a list of parts, each in a buffer of its own: the stacked matrices (Q/K/V,
//! gate/up) keep one part per run of source tensors of one type (their types may differ), and a
//! part larger than one storage binding (128 MiB on lavapipe, 2 GiB on NVIDIA) is split by rows.

use std::sync::atomic::{AtomicU32, Ordering};

use half::f16;
use quire_gguf::GgmlType;

use super::gpu::Gpu;
use super::kernels::WType;
use crate::{BackendError, HostTensor};

/// A fresh id for a device tensor (the key of its cached bind groups).
fn next_id() -> u32 {
    static NEXT: AtomicU32 = AtomicU32::new(1);
    NEXT.fetch_add(1, Ordering::Relaxed)
}

/// Rows `row0..row0 + rows` of a source tensor, written to output columns `y_off..`.
pub struct Part {
    pub id: u32,
    pub ty: WType,
    pub buf: wgpu::Buffer,
    /// First row of the source tensor this part holds (the token id of its first row, for the
    /// embedding).
    pub row0: usize,
    pub rows: usize,
    /// Output column of this part's first row in a stacked matrix.
    pub y_off: usize,
}

/// A matrix `[rows, cols]` (rows are outputs) on the device.
pub struct DMatrix {
    pub name: String,
    pub parts: Vec<Part>,
    pub rows: usize,
    pub cols: usize,
}

/// A vector of f32 on the device (norm weights, biases).
pub struct DVec {
    pub id: u32,
    pub buf: wgpu::Buffer,
    pub len: usize,
}

impl DVec {
    pub fn new(gpu: &mut Gpu, what: &str, v: &[f32]) -> Result<DVec, BackendError> {
        let bytes: Vec<u8> = v.iter().flat_map(|x| x.to_le_bytes()).collect();
        Ok(DVec {
            id: next_id(),
            buf: gpu.upload(what, &bytes)?,
            len: v.len(),
        })
    }

    pub fn from_tensor(gpu: &mut Gpu, t: &HostTensor, len: usize) -> Result<DVec, BackendError> {
        if t.n_elements() != len {
            return Err(BackendError::Shape {
                name: t.name.clone(),
                got: t.dims.clone(),
                expected: vec![len],
            });
        }
        DVec::new(gpu, &t.name, &t.to_f32()?)
    }
}

/// The device type of a tensor's data, and its data in GGUF's row-major layout (f32 and bf16
/// converted to f16).
fn host_rows(t: &HostTensor, cols: usize) -> Result<(WType, Vec<u8>), BackendError> {
    let src = t.bytes.as_slice();
    let out = match t.dtype {
        GgmlType::F16 => (WType::F16, src.to_vec()),
        GgmlType::F32 | GgmlType::BF16 => {
            let bytes = t
                .to_f32()?
                .into_iter()
                .flat_map(|v| f16::from_f32(v).to_le_bytes())
                .collect();
            (WType::F16, bytes)
        }
        GgmlType::Q8_0 => (WType::Q8_0, src.to_vec()),
        GgmlType::Q4_0 => (WType::Q4_0, src.to_vec()),
        GgmlType::Q4_1 => (WType::Q4_1, src.to_vec()),
        GgmlType::Q4_K => (WType::Q4_K, src.to_vec()),
        GgmlType::Q5_K => (WType::Q5_K, src.to_vec()),
        GgmlType::Q6_K => (WType::Q6_K, src.to_vec()),
        _ => {
            return Err(BackendError::UnsupportedType {
                dtype: t.dtype.name(),
                what: format!(
                    "{} on the wgpu backend (it takes F16, BF16, F32, Q8_0, Q4_0, Q4_1, Q4_K, \
                     Q5_K and Q6_K weights)",
                    t.name
                ),
            })
        }
    };
    let need = out.0.block().0;
    if !cols.is_multiple_of(need) {
        return Err(BackendError::Config(format!(
            "{}: rows of {cols} {} values; the wgpu kernels take multiples of {need}",
            t.name,
            t.dtype.name()
        )));
    }
    Ok(out)
}

/// The device layout of whole rows of type `ty` (GGUF's bytes, `rows` rows): for Q8_0, Q4_0,
/// Q4_1 and Q6_K every block without its scale bytes, then the scales in the same order (so
/// every block the kernels load is whole 16-byte words); the other types as they are. Padded
/// to a multiple of 16 bytes (the kernels bind the buffer as vec4s).
fn device_layout(ty: WType, src: &[u8]) -> Vec<u8> {
    // Stored block size, and the byte range of its scale(s).
    let split = match ty {
        WType::Q8_0 => Some((34, 0..2)),
        WType::Q4_0 => Some((18, 0..2)),
        WType::Q4_1 => Some((20, 0..4)),
        WType::Q6_K => Some((210, 208..210)),
        WType::F16 | WType::Q4_K | WType::Q5_K => None,
    };
    let mut out = match split {
        None => src.to_vec(),
        Some((block, scale)) => {
            let mut quants = Vec::with_capacity(src.len());
            let mut scales = Vec::new();
            for b in src.chunks_exact(block) {
                quants.extend_from_slice(&b[..scale.start]);
                quants.extend_from_slice(&b[scale.end..]);
                scales.extend_from_slice(&b[scale.clone()]);
            }
            quants.extend_from_slice(&scales);
            quants
        }
    };
    out.resize(out.len().div_ceil(16) * 16, 0);
    out
}

impl DMatrix {
    /// The tensors `ts` (each `[rows_i, cols]`) stacked by rows into one matrix. Consecutive
    /// tensors of one device type share a part (Q, K and V; gate and up), so a product over the
    /// stack is one dispatch per type rather than one per tensor (each dispatch costs a decode
    /// step a few microseconds of its own); a part larger than one storage binding is split by
    /// rows.
    pub fn stack(
        gpu: &mut Gpu,
        name: &str,
        ts: &[&HostTensor],
        cols: usize,
    ) -> Result<DMatrix, BackendError> {
        // Runs of rows of one type: (type, bytes, rows, names).
        let mut runs: Vec<(WType, Vec<u8>, usize, String)> = Vec::new();
        for t in ts {
            if t.row_len() != cols {
                return Err(BackendError::Shape {
                    name: t.name.clone(),
                    got: t.dims.clone(),
                    expected: vec![cols, t.rows()],
                });
            }
            let (ty, bytes) = host_rows(t, cols)?;
            match runs.last_mut() {
                Some(r) if r.0 == ty => {
                    r.1.extend_from_slice(&bytes);
                    r.2 += t.rows();
                    r.3 = format!("{}+{}", r.3, t.name);
                }
                _ => runs.push((ty, bytes, t.rows(), t.name.clone())),
            }
        }
        let mut parts = Vec::new();
        let mut y_off = 0;
        for (ty, bytes, rows, what) in runs {
            // GGUF's bytes per row equal the device's (the layouts only move bytes within a part).
            let row_bytes = ty.row_bytes(cols);
            let room = (gpu.max_binding() as usize).saturating_sub(16) / 16 * 16;
            let per_part = (room / row_bytes.max(1)).max(1);
            let mut row0 = 0;
            while row0 < rows {
                let n = per_part.min(rows - row0);
                let label = format!("{what} rows {row0}..{}", row0 + n);
                let rows_bytes = &bytes[row0 * row_bytes..(row0 + n) * row_bytes];
                let buf = gpu.upload(&label, &device_layout(ty, rows_bytes))?;
                parts.push(Part {
                    id: next_id(),
                    ty,
                    buf,
                    row0,
                    rows: n,
                    y_off: y_off + row0,
                });
                row0 += n;
            }
            y_off += rows;
        }
        Ok(DMatrix {
            name: name.to_string(),
            parts,
            rows: y_off,
            cols,
        })
    }

    /// Bytes of weights one product reads.
    pub fn bytes(&self) -> u64 {
        self.parts.iter().map(|p| p.buf.size()).sum()
    }
}
