//! Weight matrices kept in their storage type and the multi-threaded matrix product over them.
//! Work is split over output rows (each thread reads a disjoint slice of the weights, which is what
//! bounds decode speed) and, inside a task, tiled so a tile of weight rows stays in L1 while every
//! token of a prefill batch passes over it.

use quire_gguf::GgmlType;

use super::quant::{dot_row, dot_row_x4, has_x4, needs_q8, quantize_row_q8a, BlockQ8A, QK};
use super::rows::{dot_rows4, has_rows4, prefetch, PREFETCH_GROUPS, ROWS};
use super::team::{DisjointPtr, Parallel};
use super::CpuMath;
use crate::{BackendError, HostTensor, TensorBytes};

pub mod fast_gemm;
pub mod multi;

/// A `[rows, cols]` weight matrix (rows = output features), rows contiguous in storage type.
#[derive(Debug, Clone)]
pub struct QMatrix {
    pub name: String,
    pub dtype: GgmlType,
    pub rows: usize,
    pub cols: usize,
    pub row_bytes: usize,
    pub data: TensorBytes,
    /// `Some(chunk)`: the rows of two matrices alternate in chunks of `chunk` rows
    /// (`interleave_rows`: gate and up, for the fused decode `matmul_swiglu`).
    pub interleaved: Option<usize>,
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
            interleaved: None,
        })
    }

    /// A `[rows, cols]` matrix of `dtype` made from `vals` (row-major f32, quantized by the gguf
    /// crate's reference quantizer): test and benchmark inputs.
    pub fn quantized(
        name: &str,
        dtype: GgmlType,
        rows: usize,
        cols: usize,
        vals: &[f32],
    ) -> Result<Self, BackendError> {
        let mut bytes = Vec::new();
        quire_gguf::quantize_row(dtype, vals, &mut bytes)
            .map_err(|e| BackendError::Config(format!("{name}: {e}")))?;
        let t = HostTensor {
            name: name.into(),
            dtype,
            dims: vec![cols, rows],
            bytes: TensorBytes::owned(bytes),
        };
        Self::from_tensor(&t, cols, rows)
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
            interleaved: None,
        })
    }

    /// Stacks two matrices of the same type and shape with their rows interleaved in chunks of
    /// `chunk` (`[a₀ b₀ a₁ b₁ …]`): gate and up, so that one task of the decode product has both
    /// halves of `chunk` SwiGLU outputs (`matmul_swiglu`).
    pub fn interleave_rows(
        name: &str,
        a: &QMatrix,
        b: &QMatrix,
        chunk: usize,
    ) -> Result<Self, BackendError> {
        if a.dtype != b.dtype || a.cols != b.cols || a.rows != b.rows {
            return Err(BackendError::Config(format!(
                "{name}: parts differ in type or shape"
            )));
        }
        if chunk == 0 || !a.rows.is_multiple_of(chunk) {
            return Err(BackendError::Config(format!(
                "{name}: {} rows are not a whole number of chunks of {chunk}",
                a.rows
            )));
        }
        let span = chunk * a.row_bytes;
        let mut bytes = Vec::with_capacity(2 * a.bytes());
        for c in 0..a.rows / chunk {
            bytes.extend_from_slice(&a.data.as_slice()[c * span..(c + 1) * span]);
            bytes.extend_from_slice(&b.data.as_slice()[c * span..(c + 1) * span]);
        }
        Ok(Self {
            name: name.to_string(),
            dtype: a.dtype,
            rows: 2 * a.rows,
            cols: a.cols,
            row_bytes: a.row_bytes,
            data: TensorBytes::owned(bytes),
            interleaved: Some(chunk),
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
        if n < super::ops::SERIAL_ROWS {
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
    if let Some(isa) = multi_isa(w, n) {
        return matmul_multi(par, isa, w, act, out);
    }
    matmul_rows(par, w, x, act, out)
}

/// The multi-token path [`matmul`] takes for `n` tokens of `w`, where there is one.
pub fn multi_isa(w: &QMatrix, n: usize) -> Option<multi::Isa> {
    multi::Isa::detect().filter(|isa| multi::supports(w.dtype) && n >= isa.min_tokens())
}

/// [`matmul`] through the one- and four-token kernels of `quant` and `rows` only (the AVX2 and
/// scalar paths, and the reference that `matmul_multi` is tested against).
// x: [n, cols]; act: quantized x (if the type needs it); out: [n, rows]
pub fn matmul_rows(par: &dyn Parallel, w: &QMatrix, x: &[f32], act: &Activations, out: &mut [f32]) {
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
        if n == 1 && rows4 {
            // The first groups of the task (the loop below asks for the later ones ahead).
            prefetch_rows(w, r0, (r0 + PREFETCH_GROUPS * ROWS).min(r1));
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
                            prefetch_rows(w, ahead, (ahead + ROWS).min(w.rows));
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

/// [`matmul`] of two or more tokens by the kernels of [`multi`] on path `isa` (bit-identical
/// to the one-token kernels; public for their tests and benchmarks). Tasks take ranges of whole
/// tiles of rows (`multi_rows`).
// act: the n tokens quantized; out: [n, rows]
pub fn matmul_multi(
    par: &dyn Parallel,
    isa: multi::Isa,
    w: &QMatrix,
    act: &Activations,
    out: &mut [f32],
) {
    let n = out.len() / w.rows;
    with_packed(par, w, act, n, |packed| {
        let tiles = w.rows.div_ceil(TILE_ROWS);
        let tasks = (par.threads() * 4).min(tiles).max(1);
        let tiles_per_task = tiles.div_ceil(tasks);
        let out_ptr = DisjointPtr::new(out);
        par.run_tasks(tasks, &|task| {
            let r0 = task * tiles_per_task * TILE_ROWS;
            let r1 = ((task + 1) * tiles_per_task * TILE_ROWS).min(w.rows);
            multi_rows(isa, w, packed, r0..r1, &mut |t, r, v| {
                // SAFETY: rows r.. of token t are written by exactly one task (they are in its
                // rows); t < n and r + v.len() <= rows, so the run is inside `out`.
                let dst =
                    unsafe { std::slice::from_raw_parts_mut(out_ptr.at(t * w.rows + r), v.len()) };
                dst.copy_from_slice(v);
            });
        });
    });
}

/// The gate/up product of two or more tokens fused with SwiGLU and the 8-bit quantization of
/// its output, as [`matmul_swiglu`] does for one token: `w` is gate and up interleaved in chunks
/// of 32 rows, a task takes whole chunk pairs and turns each into one quantized block of every
/// token's down-projection input, so SwiGLU runs on all threads. Every value equals the unfused
/// path's ([`matmul`], `ops::swiglu_chunked`, `Activations::prepare`).
// w: [2 * inter, cols] chunk-interleaved; act: the n tokens quantized; out: [n, inter];
// out_q: out quantized, resized to n * inter / 32 blocks
pub fn matmul_multi_swiglu(
    par: &dyn Parallel,
    isa: multi::Isa,
    w: &QMatrix,
    act: &Activations,
    out: &mut [f32],
    out_q: &mut Activations,
) {
    let inter = w.rows / 2;
    assert!(w.interleaved == Some(QK) && inter.is_multiple_of(QK));
    let n = out.len() / inter;
    let chunks = inter / QK;
    out_q.q.resize(n * chunks, BlockQ8A::default());
    with_packed(par, w, act, n, |packed| {
        let per_task = chunks.div_ceil((par.threads() * 4).min(chunks).max(1));
        let (o, oq) = (DisjointPtr::new(out), DisjointPtr::new(&mut out_q.q));
        par.run_tasks(chunks.div_ceil(per_task), &|task| {
            let mut gu = vec![0f32; n * 2 * QK];
            for c in task * per_task..((task + 1) * per_task).min(chunks) {
                let r0 = 2 * QK * c;
                multi_rows(isa, w, packed, r0..r0 + 2 * QK, &mut |t, r, v| {
                    gu[t * 2 * QK + r - r0..][..v.len()].copy_from_slice(v)
                });
                for (t, gu) in gu.chunks_exact(2 * QK).enumerate() {
                    // SAFETY: block c of every token (32 outputs) belongs to this task alone;
                    // t < n and c < chunks.
                    let (dst, dq) = unsafe {
                        (
                            std::slice::from_raw_parts_mut(o.at(t * inter + c * QK), QK),
                            std::slice::from_raw_parts_mut(oq.at(t * chunks + c), 1),
                        )
                    };
                    super::ops::swiglu_full(&gu[..QK], &gu[QK..], dst);
                    quantize_row_q8a(dst, dq);
                }
            }
        });
    });
}

/// Runs `f` with `act`'s first `n` token rows packed for `w` (a per-thread buffer, reused).
fn with_packed(
    par: &dyn Parallel,
    w: &QMatrix,
    act: &Activations,
    n: usize,
    f: impl FnOnce(&multi::Packed),
) {
    use std::cell::RefCell;
    thread_local! {
        static PACKED: RefCell<multi::Packed> = RefCell::new(multi::Packed::default());
    }
    let nb = w.cols / QK;
    PACKED.with(|packed| {
        let mut packed = packed.borrow_mut();
        packed.pack(par, w.dtype, &act.q[..n * nb], nb, n);
        f(&packed)
    });
}

/// Rows `rows` of `w` against every token of `packed`, a tile of 16 rows at a time: every group
/// of 16 tokens passes over the tile while it is in L1, so the weights are read from memory once
/// whatever the number of tokens. The first group asks for the rows one tile ahead of those it
/// computes (a hint for the memory). Each token's results for a tile go to `put(t, first_row,
/// values)` in one piece (`values[i]` is row `first_row + i`): writing them value by value, a
/// token's row of a wide output a multiple of 4 KiB from the next, cost as much as the products
/// at 16 tokens.
fn multi_rows(
    isa: multi::Isa,
    w: &QMatrix,
    packed: &multi::Packed,
    rows: std::ops::Range<usize>,
    put: &mut impl FnMut(usize, usize, &[f32]),
) {
    let ahead = |g: usize, r: usize, k: usize| {
        if g == 0 {
            let a = (r + TILE_ROWS).min(w.rows);
            prefetch_rows(w, a, (a + k).min(w.rows));
        }
    };
    // [token][row in tile]
    let mut vals = [[0f32; TILE_ROWS]; multi::TOKENS];
    let mut tile = rows.start;
    while tile < rows.end {
        let tile_end = (tile + TILE_ROWS).min(rows.end);
        for g in 0..packed.groups() {
            let tokens = packed.tokens_in(g);
            let vals = &mut vals[..tokens];
            let mut r = tile;
            let step = isa.rows_for(tokens);
            while step == 4 && r + 4 <= tile_end {
                ahead(g, r, 4);
                let rows = std::array::from_fn(|k| w.row(r + k));
                keep(
                    vals,
                    r - tile,
                    &multi::tile::<4>(isa, w.dtype, rows, packed, g),
                );
                r += 4;
            }
            while step >= 2 && r + 2 <= tile_end {
                ahead(g, r, 2);
                let v = multi::tile::<2>(isa, w.dtype, [w.row(r), w.row(r + 1)], packed, g);
                keep(vals, r - tile, &v);
                r += 2;
            }
            for r in r..tile_end {
                ahead(g, r, 1);
                keep(
                    vals,
                    r - tile,
                    &multi::tile::<1>(isa, w.dtype, [w.row(r)], packed, g),
                );
            }
            for (t, v) in vals.iter().enumerate() {
                put(g * multi::TOKENS + t, tile, &v[..tile_end - tile]);
            }
        }
        tile = tile_end;
    }
}

/// Each token's `R` results of a tile call (`v[t]`, rows `at..at + R` of the tile) into its row
/// of `vals` ([token][row in tile]); `v` has a slot for every token of a group, `vals` one for
/// each real token.
#[inline(always)]
fn keep<const R: usize>(vals: &mut [[f32; TILE_ROWS]], at: usize, v: &[[f32; R]]) {
    for (vt, out) in v.iter().zip(vals) {
        out[at..at + R].copy_from_slice(vt);
    }
}

/// [`matmul`] in arithmetic mode `math`: `Fast` computes batches of 4 or more tokens with the
/// register-tiled kernel of [`fast_gemm`] where it has one for the weight type (f32 accumulation,
/// another summation order); `Exact`, one token, or other types take [`matmul`] unchanged.
pub fn matmul_math(
    par: &dyn Parallel,
    math: CpuMath,
    w: &QMatrix,
    x: &[f32],
    act: &Activations,
    out: &mut [f32],
) {
    // The tiled kernel rounds differently from the one-token kernels, which take the tokens
    // past its last group of 4 and every step of fewer than 4 rows: a token's result would
    // depend on the batch it rides in, and the server's output would part from `generate`'s
    // (crates/cli/tests/server.rs caught it). Until every row count takes the same arithmetic,
    // the engine keeps to `matmul`; `matmul_tiled` stays tested and benchmarked on its own.
    let _ = math;
    matmul(par, w, x, act, out);
}

/// The fast-mode tiled product, for its tests and benchmarks (see [`matmul_math`]).
pub fn matmul_fast_tiled(
    par: &dyn Parallel,
    w: &QMatrix,
    x: &[f32],
    act: &Activations,
    out: &mut [f32],
) {
    let n = x.len() / w.cols;
    if n >= fast_gemm::TOKENS && fast_gemm::has_fast_gemm(w.dtype) {
        matmul_tiled(par, w, x, act, out);
    } else {
        matmul(par, w, x, act, out);
    }
}

/// The fast-mode product: tiles of 4 weight rows × 4 tokens (`fast_gemm`), tasks over row tiles
/// as in [`matmul`]; tokens past the last whole group of 4 take the one-token kernels.
fn matmul_tiled(par: &dyn Parallel, w: &QMatrix, x: &[f32], act: &Activations, out: &mut [f32]) {
    use fast_gemm::{gemm_row, gemm_tile, TokenScales, ROWS as TR, TOKENS};
    let n = x.len() / w.cols;
    assert_eq!(out.len(), n * w.rows);
    let nb = w.cols / QK;
    let groups = n / TOKENS;
    let scales = TokenScales::new(w.dtype, &act.q, nb, groups);
    let tiles = w.rows.div_ceil(TILE_ROWS);
    let tasks = (par.threads() * 4).min(tiles).max(1);
    let tiles_per_task = tiles.div_ceil(tasks);
    let out_ptr = DisjointPtr::new(out);
    // SAFETY (for every write below): (t, r) is written by exactly one task (r in its rows);
    // t < n and r < rows, so the index is inside `out`.
    let put = |t: usize, r: usize, v: f32| unsafe { *out_ptr.at(t * w.rows + r) = v };
    let run = |task: usize| {
        let r0 = task * tiles_per_task * TILE_ROWS;
        let r1 = ((task + 1) * tiles_per_task * TILE_ROWS).min(w.rows);
        let mut tile = r0;
        while tile < r1 {
            let tile_end = (tile + TILE_ROWS).min(r1);
            for g in 0..groups {
                let mut r = tile;
                while r + TR <= tile_end {
                    let v = gemm_tile(
                        w.dtype,
                        std::array::from_fn(|k| w.row(r + k)),
                        &act.q,
                        &scales,
                        g,
                    )
                    .expect("checked by the caller");
                    for (t, row) in v.iter().enumerate() {
                        for (k, &v) in row.iter().enumerate() {
                            put(g * TOKENS + t, r + k, v);
                        }
                    }
                    r += TR;
                }
                for r in r..tile_end {
                    let v = gemm_row(w.dtype, w.row(r), &act.q, &scales, g).expect("checked");
                    for (t, &v) in v.iter().enumerate() {
                        put(g * TOKENS + t, r, v);
                    }
                }
            }
            for t in groups * TOKENS..n {
                let (xt, xqt) = (
                    &x[t * w.cols..(t + 1) * w.cols],
                    &act.q[t * nb..(t + 1) * nb],
                );
                for r in tile..tile_end {
                    put(t, r, dot_row(w.dtype, w.row(r), xt, xqt));
                }
            }
            tile = tile_end;
        }
    };
    par.run_tasks(tasks, &run);
}

/// Asks for rows `r0..r1` of `w` ahead of their use (nothing when the range is empty).
#[inline]
fn prefetch_rows(w: &QMatrix, r0: usize, r1: usize) {
    if r0 < r1 {
        prefetch(&w.data.as_slice()[r0 * w.row_bytes..r1 * w.row_bytes]);
    }
}

/// Decode's gate/up product fused with SwiGLU and the 8-bit quantization of its output. The
/// weights are gate and up interleaved in chunks of 32 rows (`QMatrix::interleave_rows`), so the
/// task that computes a chunk pair holds both halves of 32 outputs and turns them into the down
/// projection's input block at once: in the parallel section instead of on one thread after it.
/// Every value equals the unfused path's (same dot products, `ops::swiglu`'s element function,
/// blockwise quantization).
// w: [2 * inter, cols] chunk-interleaved; x: [cols]; act: x quantized (if w's type needs it);
// out: [inter]; out_q: out quantized, resized to inter / 32 blocks
pub fn matmul_swiglu(
    par: &dyn Parallel,
    w: &QMatrix,
    x: &[f32],
    act: &Activations,
    out: &mut [f32],
    out_q: &mut Activations,
) {
    let inter = w.rows / 2;
    assert!(x.len() == w.cols && out.len() == inter && inter.is_multiple_of(QK));
    let chunks = inter / QK;
    out_q.q.resize(chunks, BlockQ8A::default());
    let xq: &[BlockQ8A] = if needs_q8(w.dtype) { &act.q } else { &[] };
    let per_task = chunks.div_ceil((par.threads() * 4).min(chunks).max(1));
    let o = DisjointPtr::new(out);
    let oq = DisjointPtr::new(&mut out_q.q);
    par.run_tasks(chunks.div_ceil(per_task), &|task| {
        let (c0, c1) = (task * per_task, ((task + 1) * per_task).min(chunks));
        prefetch_rows(
            w,
            2 * QK * c0,
            (2 * QK * c0 + PREFETCH_GROUPS * ROWS).min(w.rows),
        );
        for c in c0..c1 {
            let mut gu = [0f32; 2 * QK];
            for (k, v) in gu.chunks_exact_mut(ROWS).enumerate() {
                let r = 2 * QK * c + k * ROWS;
                let ahead = r + PREFETCH_GROUPS * ROWS;
                prefetch_rows(w, ahead, (ahead + ROWS).min(w.rows));
                v.copy_from_slice(&dot_rows4(
                    w.dtype,
                    std::array::from_fn(|j| w.row(r + j)),
                    x,
                    xq,
                ));
            }
            // SAFETY: chunk c (32 outputs, one block) belongs to this task alone; c < chunks.
            let (dst, dq) = unsafe {
                (
                    std::slice::from_raw_parts_mut(o.at(c * QK), QK),
                    std::slice::from_raw_parts_mut(oq.at(c), 1),
                )
            };
            super::ops::swiglu_full(&gu[..QK], &gu[QK..], dst);
            quantize_row_q8a(dst, dq);
        }
    });
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::ops;
    use rand::{Rng, SeedableRng};

    fn random_matrix(
        rng: &mut rand::rngs::StdRng,
        dtype: GgmlType,
        rows: usize,
        cols: usize,
    ) -> QMatrix {
        let vals: Vec<f32> = (0..rows * cols)
            .map(|_| rng.random_range(-1.0f32..1.0))
            .collect();
        QMatrix::quantized("w", dtype, rows, cols, &vals).unwrap()
    }

    /// The fused decode gate/up + SwiGLU + quantization, and the chunk-interleaved layout through
    /// the plain product, give exactly the values of the stacked `[gate | up]` path.
    #[test]
    fn fused_swiglu_equals_stacked_path_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(5);
        let team = super::super::team::Team::new(2);
        for dtype in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::F16,
        ] {
            for (inter, cols, n) in [
                (32usize, 64usize, 1usize),
                (96, 96, 1),
                (160, 64, 1),
                (96, 64, 5),
            ] {
                let gate = random_matrix(&mut rng, dtype, inter, cols);
                let up = random_matrix(&mut rng, dtype, inter, cols);
                let stacked = QMatrix::concat_rows("gu", &[gate.clone(), up.clone()]).unwrap();
                let chunked = QMatrix::interleave_rows("gu", &gate, &up, QK).unwrap();
                let x: Vec<f32> = (0..n * cols)
                    .map(|_| rng.random_range(-2.0f32..2.0))
                    .collect();
                let mut act = Activations::default();
                act.prepare(&team, &x, cols, dtype);

                let mut gu = vec![0f32; n * 2 * inter];
                matmul(&team, &stacked, &x, &act, &mut gu);
                let mut want = vec![0f32; n * inter];
                ops::swiglu(&gu, inter, &mut want);
                let mut want_q = Activations::default();
                want_q.prepare(&team, &want, inter, GgmlType::Q4_1);

                matmul(&team, &chunked, &x, &act, &mut gu);
                let mut got = vec![0f32; n * inter];
                ops::swiglu_chunked(&gu, inter, QK, &mut got);
                assert!(got
                    .iter()
                    .zip(&want)
                    .all(|(a, b)| a.to_bits() == b.to_bits()));

                if n == 1 {
                    let mut got_q = Activations::default();
                    matmul_swiglu(&team, &chunked, &x, &act, &mut got, &mut got_q);
                    for (a, b) in got.iter().zip(&want) {
                        assert_eq!(a.to_bits(), b.to_bits(), "{dtype:?} inter={inter}");
                    }
                    for (a, b) in got_q.q.iter().zip(&want_q.q) {
                        assert_eq!(
                            (a.d.to_bits(), a.s.to_bits(), a.qs),
                            (b.d.to_bits(), b.s.to_bits(), b.qs)
                        );
                    }
                }
            }
        }
    }

    #[test]
    fn interleave_rejects_mismatched_parts() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(6);
        let a = random_matrix(&mut rng, GgmlType::Q4_1, 64, 64);
        let b = random_matrix(&mut rng, GgmlType::Q4_1, 32, 64);
        assert!(QMatrix::interleave_rows("x", &a, &b, QK).is_err());
        let c = random_matrix(&mut rng, GgmlType::Q4_1, 48, 64);
        assert!(QMatrix::interleave_rows("x", &c, &c, QK).is_err());
    }
}
