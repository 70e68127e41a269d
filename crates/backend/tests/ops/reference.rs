//! The plain references every backend's kernels are compared with: straight loops in f64 over
//! the inputs as the backend's arithmetic sees them (weights dequantized by the GGUF format's
//! definition, activations rounded as the backend rounds them). Nothing here is optimized, and
//! nothing here is what the CPU backend runs, so its variant of each test is a real test too.

use half::f16;
use quire_backend::cpu::attention::{dense_reference, AttnParams};
use quire_backend::cpu::quant::{quantize_row_q8a_scalar, BlockQ8A, QK};
use quire_backend::HostTensor;
use quire_core::RopeStyle;
use quire_gguf::{scale_min_k4, GgmlType};

use super::{AttnCase, MatmulForm, Operand, QkvCase};

/// `v` as the operand form `op` makes it.
fn operand(v: &[f32], op: Operand) -> Vec<f64> {
    match op {
        Operand::Exact => v.iter().map(|&x| x as f64).collect(),
        Operand::F16 => v.iter().map(|&x| f16::from_f32(x).to_f64()).collect(),
        Operand::Q8 => q8(v)
            .iter()
            .flat_map(|b| b.qs.iter().map(move |&x| b.d as f64 * x as f64))
            .collect(),
    }
}

fn q8(v: &[f32]) -> Vec<BlockQ8A> {
    let mut q = vec![BlockQ8A::default(); v.len() / QK];
    quantize_row_q8a_scalar(v, &mut q);
    q
}

/// The constant term of each 32-value block of each row (`[rows, cols / 32]`) of the types whose
/// dequantized values are `scale · q + offset`: Q4_1 (`offset = m`) and Q4_K/Q5_K (`offset =
/// -dmin · m` of each sub-block). Their dot products with 8-bit activations add `offset · s`,
/// where `s` is the block's sum kept at f16 precision (ggml's Q8_1), not the exact sum of the
/// block's values.
fn block_offsets(w: &HostTensor) -> Option<Vec<f64>> {
    let b = w.bytes.as_slice();
    let half = |b: &[u8], at: usize| f16::from_le_bytes([b[at], b[at + 1]]).to_f64();
    match w.dtype {
        // d (f16), m (f16), 16 bytes of 4-bit values.
        GgmlType::Q4_1 => Some(b.chunks_exact(20).map(|b| half(b, 2)).collect()),
        // d (f16), dmin (f16), 12 bytes of 6-bit scales and mins, then the values.
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let size = if w.dtype == GgmlType::Q4_K { 144 } else { 176 };
            Some(
                b.chunks_exact(size)
                    .flat_map(|b| {
                        let dmin = half(b, 2);
                        let scales: [u8; 12] = b[4..16].try_into().unwrap();
                        (0..8)
                            .map(move |j| -(dmin as f32 * scale_min_k4(j, &scales).1 as f32) as f64)
                    })
                    .collect(),
            )
        }
        _ => None,
    }
}

/// `x · wᵀ (+ add)` in f64 with the operands in `form`: `[n, rows]`.
pub fn matmul(
    w: &HostTensor,
    form: MatmulForm,
    x: &[f32],
    n: usize,
    add: Option<&[f32]>,
) -> Vec<f64> {
    let (cols, rows) = (w.row_len(), w.rows());
    let wf = operand(&w.to_f32().expect("dequantizes"), form.weights);
    let mins = block_offsets(w).filter(|_| form.act == Operand::Q8);
    let nb = cols / QK;
    let mut out = vec![0f64; n * rows];
    for t in 0..n {
        // Activations are quantized row by row (blocks never straddle rows: cols % 32 == 0).
        let xr = &x[t * cols..(t + 1) * cols];
        let xt = operand(xr, form.act);
        let blocks = mins.as_ref().map(|_| q8(xr));
        for r in 0..rows {
            let mut dot: f64 = (0..cols).map(|c| wf[r * cols + c] * xt[c]).sum();
            if let (Some(m), Some(blocks)) = (&mins, &blocks) {
                for (b, blk) in blocks.iter().enumerate() {
                    let exact: f64 = xt[b * QK..(b + 1) * QK].iter().sum();
                    dot += m[r * nb + b] * (blk.s as f64 - exact);
                }
            }
            out[t * rows + r] = dot + add.map_or(0.0, |a| a[t * rows + r] as f64);
        }
    }
    out
}

/// The rows of `tokens`, dequantized by the format's definition.
pub fn embed(w: &HostTensor, tokens: &[u32]) -> Vec<f32> {
    let all = w.to_f32().expect("dequantizes");
    let cols = w.row_len();
    tokens
        .iter()
        .flat_map(|&t| all[t as usize * cols..][..cols].to_vec())
        .collect()
}

/// `x / sqrt(mean(x²) + eps) · w` of each row.
pub fn rms_norm(x: &[f32], w: &[f32], eps: f32) -> Vec<f64> {
    let mut out = Vec::with_capacity(x.len());
    for row in x.chunks_exact(w.len()) {
        let ms = row.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / w.len() as f64;
        let s = 1.0 / (ms + eps as f64).sqrt();
        out.extend(row.iter().zip(w).map(|(&v, &g)| v as f64 * s * g as f64));
    }
    out
}

/// Bias, QK-norm and the rotation of every Q and K head, in f64.
pub fn qkv_post(c: &QkvCase) -> Vec<f64> {
    let h = c.heads;
    let pairs = c.pairs();
    let mut out: Vec<f64> = c.qkv.iter().map(|&v| v as f64).collect();
    for (t, row) in out.chunks_exact_mut(h.stride()).enumerate() {
        if let Some(b) = &c.bias {
            row.iter_mut().zip(b).for_each(|(v, &b)| *v += b as f64);
        }
        let cs = &c.cs[t * pairs..(t + 1) * pairs];
        for (head, hrow) in row[..(h.q + h.kv) * h.dim]
            .chunks_exact_mut(h.dim)
            .enumerate()
        {
            if let Some((qn, kn)) = &c.norms {
                let w = if head < h.q { qn } else { kn };
                let ms = hrow.iter().map(|v| v * v).sum::<f64>() / h.dim as f64;
                let s = 1.0 / (ms + c.eps as f64).sqrt();
                hrow.iter_mut()
                    .zip(w)
                    .for_each(|(v, &g)| *v *= s * g as f64);
            }
            for (i, &(cos, sin)) in cs.iter().enumerate() {
                let (a, b) = match c.style {
                    RopeStyle::Normal => (2 * i, 2 * i + 1),
                    RopeStyle::Neox => (i, i + pairs),
                };
                let (x0, x1, cos, sin) = (hrow[a], hrow[b], cos as f64, sin as f64);
                hrow[a] = x0 * cos - x1 * sin;
                hrow[b] = x0 * sin + x1 * cos;
            }
        }
    }
    out
}

/// silu(gate) · up of each `[gate | up]` row.
pub fn swiglu(gu: &[f32], inter: usize) -> Vec<f64> {
    gu.chunks_exact(2 * inter)
        .flat_map(|row| {
            let (g, u) = row.split_at(inter);
            g.iter()
                .zip(u)
                .map(|(&g, &u)| g as f64 / (1.0 + (-g as f64).exp()) * u as f64)
        })
        .collect()
}

/// The index of each row's largest logit: the first of ties, NaN never, 0 for a row without a
/// number.
pub fn argmax(logits: &[f32], vocab: usize) -> Vec<u32> {
    logits
        .chunks_exact(vocab)
        .map(|row| {
            let mut best: Option<(usize, f32)> = None;
            for (i, &v) in row.iter().enumerate() {
                if !v.is_nan() && best.is_none_or(|(_, b)| v > b) {
                    best = Some((i, v));
                }
            }
            best.map_or(0, |(i, _)| i as u32)
        })
        .collect()
}

/// Dense f64 attention of each sequence over its keys (`[tokens, q_size]`, in batch order).
pub fn attention(c: &AttnCase) -> Vec<f64> {
    let h = c.heads;
    let p = AttnParams {
        num_heads: h.q,
        num_kv_heads: h.kv,
        head_dim: h.dim,
        block_size: c.batch.block_size,
        scale: 1.0 / (h.dim as f32).sqrt(),
        f16_accum: false,
        sliding_window: c.window,
    };
    let mut out = vec![0f64; c.batch.tokens() * h.q_size()];
    for s in &c.batch.seqs {
        let q = &c.q[s.query_start * h.q_size()..(s.query_start + s.query_len) * h.q_size()];
        let o = dense_reference(&p, q, &s.keys, &s.values, s.seq_len);
        out[s.query_start * h.q_size()..][..o.len()].copy_from_slice(&o);
    }
    out
}

/// The caches after the step's K/V write: each new token's slot holds its K/V rounded to f16,
/// every other slot what it held (NaN stays NaN).
pub fn caches_after_write(c: &AttnCase) -> (Vec<f16>, Vec<f16>) {
    let b = &c.batch;
    let (mut k, mut v) = (b.k_cache.clone(), b.v_cache.clone());
    let row = b.kv_row;
    for (t, &slot) in b.slot_mapping.iter().enumerate() {
        for i in 0..row {
            k[slot as usize * row + i] = f16::from_f32(b.k_new[t * row + i]);
            v[slot as usize * row + i] = f16::from_f32(b.v_new[t * row + i]);
        }
    }
    (k, v)
}
