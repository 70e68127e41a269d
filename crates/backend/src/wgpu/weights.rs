//! Weights on the device. Q4_0, Q4_1 and Q8_0 stay as stored (the kernels dequantize them),
//! only padded so each block starts on a 4-byte word; f16 stays f16; f32 and bf16 become f16.
//! Each part's 32-bit words are stored transposed (word j of every row together), so that the
//! kernels' invocations, one per row, read consecutive addresses.
//! A matrix is a list of parts, each in a buffer of its own: the stacked matrices (Q/K/V,
//! gate/up) keep one part per source tensor (so their types may differ), and a tensor larger
//! than one storage binding (128 MiB on lavapipe, 2 GiB on NVIDIA) is split by rows.

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

/// The device type of a tensor's data, and its rows in that layout (bytes per row).
fn device_rows(t: &HostTensor, cols: usize) -> Result<(WType, Vec<u8>), BackendError> {
    let unsupported = || BackendError::UnsupportedType {
        dtype: t.dtype.name(),
        what: format!(
            "{} on the wgpu backend (it takes F16, BF16, F32, Q4_0, Q4_1 and Q8_0 weights; \
             K-quants come later)",
            t.name
        ),
    };
    let src = t.bytes.as_slice();
    let repad = |block: usize| -> Vec<u8> {
        // A 2-byte scale and block - 2 bytes of quants: the scale gets a word of its own.
        src.chunks_exact(block)
            .flat_map(|b| [&b[..2], &[0u8, 0][..], &b[2..]].concat())
            .collect()
    };
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
        GgmlType::Q4_1 => (WType::Q4_1, src.to_vec()),
        GgmlType::Q4_0 => (WType::Q4_0, repad(18)),
        GgmlType::Q8_0 => (WType::Q8_0, repad(34)),
        _ => return Err(unsupported()),
    };
    let (block_cols, _) = out.0.block();
    let need = if out.0 == WType::F16 { 8 } else { block_cols };
    if !cols.is_multiple_of(need) {
        return Err(BackendError::Config(format!(
            "{}: rows of {cols} {} values; the wgpu kernels take multiples of {need}",
            t.name,
            t.dtype.name()
        )));
    }
    Ok(out)
}

/// `[rows, words]` 32-bit words → `[words, rows]`: the kernels' invocations, one per row, then
/// read consecutive words.
fn transpose_words(bytes: &[u8], rows: usize, words: usize) -> Vec<u8> {
    let mut out = vec![0u8; bytes.len()];
    for r in 0..rows {
        for j in 0..words {
            let src = (r * words + j) * 4;
            let dst = (j * rows + r) * 4;
            out[dst..dst + 4].copy_from_slice(&bytes[src..src + 4]);
        }
    }
    out
}

impl DMatrix {
    /// The tensors `ts` (each `[rows_i, cols]`) stacked by rows into one matrix.
    pub fn stack(
        gpu: &mut Gpu,
        name: &str,
        ts: &[&HostTensor],
        cols: usize,
    ) -> Result<DMatrix, BackendError> {
        let mut parts = Vec::new();
        let mut y_off = 0;
        for t in ts {
            if t.row_len() != cols {
                return Err(BackendError::Shape {
                    name: t.name.clone(),
                    got: t.dims.clone(),
                    expected: vec![cols, t.rows()],
                });
            }
            let rows = t.rows();
            let (ty, bytes) = device_rows(t, cols)?;
            let row_bytes = ty.row_words(cols) * 4;
            let per_part = (gpu.max_binding() as usize / row_bytes.max(1)).max(1);
            let mut row0 = 0;
            while row0 < rows {
                let n = per_part.min(rows - row0);
                let what = format!("{} rows {row0}..{}", t.name, row0 + n);
                let rows_bytes = &bytes[row0 * row_bytes..(row0 + n) * row_bytes];
                let buf = gpu.upload(&what, &transpose_words(rows_bytes, n, row_bytes / 4))?;
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
