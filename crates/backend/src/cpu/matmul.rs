//! Weight matrices kept in their storage type and the multi-threaded matrix product over them.
//! Work is split over output rows (each thread reads a disjoint slice of the weights, which is what
//! bounds decode speed) and, inside a task, tiled so a tile of weight rows stays in L1 while every
//! token of a prefill batch passes over it.

use quire_gguf::GgmlType;

use super::quant::{dot_row, dot_row_x4, has_x4, needs_q8, quantize_row_q8a, BlockQ8A, QK};
use super::rows::{dot_rows4, has_rows4, prefetch, PREFETCH_GROUPS, ROWS};
use super::team::{DisjointPtr, Parallel};
use crate::{BackendError, HostTensor, TensorBytes};

/// A `[rows, cols]` weight matrix (rows = output features), rows contiguous in storage type.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub name: String,
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub data: TensorBytes,
}

impl QMatrix {
    pub fn from_tensor(t: &HostTensor, cols: usize, rows: usize) -> Result<Self, BackendError> {
        if t.dims.len() != 2 || t.dims[0] != cols || t.dims[1] != rows {
            return Err(BackendError::Shape {
                name: t.name.clone(),
                got: t.dims.clone(),
                expected: vec![cols, rows],
            });
        }
        if !super::quant::supported_matmul_type(t.dtype) {
            return Err(BackendError::UnsupportedType {
                dtype: t.dtype.name(),
                what: t.name.clone(),
            });
        }
        if !cols.is_multiple_of(t.dtype.block_size())
            || (needs_q8(t.dtype) && !cols.is_multiple_of(QK))
        {
            return Err(BackendError::Config(format!(
                "{}: row length {cols} is not a multiple of the block size",
                t.name
            )));
        }
        let row_bytes = cols / t.dtype.block_size() * t.dtype.type_size();
        if t.bytes.as_slice().len() != row_bytes * rows {
            return Err(BackendError::Config(format!(
                "{}: byte length does not match its shape",
                t.name
            )));
        }
        Ok(Self {
            name: t.name.clone(),
            dtype: t.dtype,
            rows,
            cols,
            row_bytes,
            data: t.bytes.clone(),
        })
    }

    /// Stacks matrices with the same type and row length (e.g. Q, K and V) into one, so one
    /// threaded launch computes all of them.
    pub fn concat_rows(name: &str, parts: &[QMatrix]) -> Result<Self, BackendError> {
        let first = &parts[0];
        if parts
            .iter()
            .any(|p| p.dtype != first.dtype || p.cols != first.cols)
        {
            return Err(BackendError::Config(format!(
                "{name}: parts differ in type or width"
            )));
        }
        let mut bytes = Vec::with_capacity(parts.iter().map(|p| p.data.as_slice().len()).sum());
        for p in parts {
            bytes.extend_from_slice(p.data.as_slice());
        }
        Ok(Self {
            name: name.to_string(),
            dtype: first.dtype,
            rows: parts.iter().map(|p| p.rows).sum(),
            cols: first.cols,
            row_bytes: first.row_bytes,
            data: TensorBytes::owned(bytes),
        })
    }

    pub fn row(&self, r: usize) -> &[u8] {
        &self.data.as_slice()[r * self.row_bytes..(r + 1) * self.row_bytes]
    }

    pub fn bytes(&self) -> usize {
        self.rows * self.row_bytes
    }

    /// Dequantizes row `r` into `out` (embedding lookup).
    pub fn dequantize_row(&self, r: usize, out: &mut [f32]) {
        quire_gguf::dequantize_row(self.dtype, self.row(r), out).expect("type checked at load");
    }
}

/// Activations of a batch, in f32 and (when the weights need it) quantized to 8 bits.
#[derive(Default)]
pub struct Activations {
    pub q: Vec<BlockQ8A>,
}

impl Activations {
    // x: [n, cols]
    pub fn prepare(&mut self, par: &dyn Parallel, x: &[f32], cols: usize, dtype: GgmlType) {
        if !needs_q8(dtype) {
            return;
        }
        let n = x.len() / cols;
        let nb = cols / QK;
        self.q.resize(n * nb, BlockQ8A::default());
        if n < 8 {
            for (row, out) in x.chunks_exact(cols).zip(self.q.chunks_exact_mut(nb)) {
                quantize_row_q8a(row, out);
            }
            return;
        }
        // Rows are independent; a prefill's rows are quantized in parallel, 8 rows a task.
        let q = DisjointPtr::new(&mut self.q);
        par.run_tasks(n.div_ceil(8), &|task| {
            for r in task * 8..(task * 8 + 8).min(n) {
                // SAFETY: each row's blocks are written by exactly one task.
                let out = unsafe { std::slice::from_raw_parts_mut(q.at(r * nb), nb) };
                quantize_row_q8a(&x[r * cols..(r + 1) * cols], out);
            }
        });
    }
}

const TILE_ROWS: usize = 16;

/// `out[t, r] = sum_i x[t, i] * w[r, i]` for every token t.
// x: [n, cols]; xq: quantized x (if the type needs it); out: [n, rows]
pub fn matmul(par: &dyn Parallel, w: &QMatrix, x: &[f32], act: &Activations, out: &mut [f32]) {
    let n = x.len() / w.cols;
    assert_eq!(out.len(), n * w.rows);
    let nb = w.cols / QK;
    let quantized = needs_q8(w.dtype);
    let threads = par.threads();
    // Enough tasks to balance, each a whole number of tiles.
    let tiles = w.rows.div_ceil(TILE_ROWS);
    let tasks = (threads * 4).min(tiles).max(1);
    let tiles_per_task = tiles.div_ceil(tasks);
    let out_ptr = DisjointPtr::new(out);
    // Four tokens at a time where a four-way kernel exists (weights unpacked once).
    let four_way = quantized && n >= 4 && has_x4(w.dtype);
    let rows4 = quantized && has_rows4(w.dtype);
    let run = |task: usize| {
        let r0 = task * tiles_per_task * TILE_ROWS;
        let r1 = ((task + 1) * tiles_per_task * TILE_ROWS).min(w.rows);
        if n == 1 && rows4 && r0 < r1 {
            // The first groups of the task (the loop below asks for the later ones ahead).
            let end = (r0 + PREFETCH_GROUPS * ROWS).min(r1);
            prefetch(&w.data.as_slice()[r0 * w.row_bytes..end * w.row_bytes]);
        }
        let mut tile = r0;
        while tile < r1 {
            let tile_end = (tile + TILE_ROWS).min(r1);
            let mut t0 = 0;
            if four_way {
                while t0 + 4 <= n {
                    let xq = [0, 1, 2, 3].map(|k| &act.q[(t0 + k) * nb..(t0 + k + 1) * nb]);
                    for r in tile..tile_end {
                        let v = dot_row_x4(w.dtype, w.row(r), xq).expect("checked above");
                        for (k, v) in v.into_iter().enumerate() {
                            // SAFETY: (t, r) is written by exactly one task; index < n * rows.
                            unsafe { *out_ptr.at((t0 + k) * w.rows + r) = v };
                        }
                    }
                    t0 += 4;
                }
            }
            for t in t0..n {
                let xt = &x[t * w.cols..(t + 1) * w.cols];
                let xqt: &[BlockQ8A] = if quantized {
                    &act.q[t * nb..(t + 1) * nb]
                } else {
                    &[]
                };
                let mut r = tile;
                // Four rows at a time where a four-row kernel exists (bit-identical to one row).
                if rows4 {
                    while r + ROWS <= tile_end {
                        if n == 1 {
                            // A matrix-vector product streams the weights once: ask ahead.
                            let ahead = r + PREFETCH_GROUPS * ROWS;
                            if ahead + ROWS <= w.rows {
                                let start = ahead * w.row_bytes;
                                prefetch(&w.data.as_slice()[start..start + ROWS * w.row_bytes]);
                            }
                        }
                        let v = dot_rows4(w.dtype, std::array::from_fn(|k| w.row(r + k)), xt, xqt);
                        for (k, v) in v.into_iter().enumerate() {
                            // SAFETY: (t, r + k) is written by exactly one task; inside out.
                            unsafe { *out_ptr.at(t * w.rows + r + k) = v };
                        }
                        r += ROWS;
                    }
                }
                for r in r..tile_end {
                    let v = dot_row(w.dtype, w.row(r), xt, xqt);
                    // SAFETY: (t, r) is written by exactly one task; index < n * rows.
                    unsafe { *out_ptr.at(t * w.rows + r) = v };
                }
            }
            tile = tile_end;
        }
    };
    par.run_tasks(tasks, &run);
}
