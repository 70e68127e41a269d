//! ggml's "K-quant" super-block formats Q4_K, Q5_K and Q6_K: block structs, the reference
//! dequantizers, and quire's quantizers.
//!
//! A K-quant block covers 256 elements ([`QK_K`]) split into sub-blocks that each have their own
//! scale, and the sub-block scales are themselves quantized against one f16 super-block scale, so
//! the format spends fewer bits on scales than Q4_0/Q4_1 for the same sub-block size. Layouts and
//! dequantization formulas are the facts of ggml's `block_q4_K`/`block_q5_K`/`block_q6_K` and
//! `dequantize_row_q{4,5,6}_K` / `get_scale_min_k4` (ggml/src/ggml-quants.c, llama.cpp); the code
//! here is written from those formulas. Dequantization rounds exactly as ggml's does (each
//! product and difference rounded to f32 separately, in ggml's order), which the tests check bit
//! for bit against a per-element reference and against the `gguf` Python package.
//!
//! The quantizers are quire's own, in the spirit of ggml's `make_qkx2_quants`/`make_qx_quants`
//! without importance weights: per sub-block, try 21 candidate step sizes around `range / nmax`,
//! refit scale (and offset) by least squares on the resulting integer codes, keep the candidate
//! with the smallest squared error; then quantize the sub-block scales to 6 bits (Q4_K/Q5_K) or
//! 8 bits (Q6_K) against the super-block scale and recompute the codes with the scales as stored.
//! They do not reproduce llama.cpp's bytes, only its format.

use half::f16;

/// Elements per K-quant super-block.
pub const QK_K: usize = 256;
/// Bytes of packed 6-bit scales and mins in Q4_K/Q5_K.
pub const K_SCALE_SIZE: usize = 12;

/// 4-bit affine with 8 sub-blocks of 32: `x = d * sc[j] * q - dmin * m[j]`, `sc`/`m` 6-bit values
/// packed in `scales` (see [`scale_min_k4`]). Bytes `32c..32c+32` of `qs` hold elements
/// `64c..64c+32` in their low nibbles and `64c+32..64c+64` in their high nibbles.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qs: [u8; QK_K / 2],
}

/// 5-bit affine: [`BlockQ4K`] plus a fifth bit per element: bit `2c` of `qh[l]` is the high bit
/// of element `64c + l`, bit `2c + 1` that of element `64c + 32 + l`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ5K {
    pub d: f16,
    pub dmin: f16,
    pub scales: [u8; K_SCALE_SIZE],
    pub qh: [u8; QK_K / 8],
    pub qs: [u8; QK_K / 2],
}

/// 6-bit symmetric with 16 sub-blocks of 16: `x = d * scales[e / 16] * (q - 32)`. In half `h` (128
/// elements), element `128h + 32k + l` (`k` in 0..4, `l` in 0..32) has its low 4 bits in
/// `ql[64h + l + 32 * (k & 1)]` (low nibble for `k < 2`, high for `k >= 2`) and its high 2 bits in
/// bits `2k..2k+2` of `qh[32h + l]`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ6K {
    pub ql: [u8; QK_K / 2],
    pub qh: [u8; QK_K / 4],
    pub scales: [i8; QK_K / 16],
    pub d: f16,
}

const _: () = assert!(std::mem::size_of::<BlockQ4K>() == 144);
const _: () = assert!(std::mem::size_of::<BlockQ5K>() == 176);
const _: () = assert!(std::mem::size_of::<BlockQ6K>() == 210);
const _: () = assert!(std::mem::align_of::<BlockQ6K>() == 2);

/// The 6-bit scale and min of sub-block `j` (0..8) from the 12 packed bytes (ggml's
/// `get_scale_min_k4`): sub-blocks 0..4 keep theirs in the low 6 bits of bytes `j` and `j + 4`;
/// sub-blocks 4..8 keep the low 4 bits in byte `j + 4` and the high 2 in the top bits of bytes
/// `j - 4` and `j`.
#[inline]
pub fn scale_min_k4(j: usize, q: &[u8; K_SCALE_SIZE]) -> (u8, u8) {
    if j < 4 {
        (q[j] & 63, q[j + 4] & 63)
    } else {
        (
            (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4),
            (q[j + 4] >> 4) | ((q[j] >> 6) << 4),
        )
    }
}

/// Inverse of [`scale_min_k4`] for eight 6-bit scales and mins.
fn pack_scale_min_k4(sc: &[u8; 8], m: &[u8; 8]) -> [u8; K_SCALE_SIZE] {
    let mut q = [0u8; K_SCALE_SIZE];
    for j in 0..4 {
        q[j] = sc[j] | ((sc[j + 4] >> 4) << 6);
        q[j + 4] = m[j] | ((m[j + 4] >> 4) << 6);
        q[j + 8] = (sc[j + 4] & 0x0F) | ((m[j + 4] & 0x0F) << 4);
    }
    q
}

impl BlockQ4K {
    /// The 4-bit code of element `i` (0..256).
    #[inline]
    pub fn code(&self, i: usize) -> u8 {
        let b = self.qs[32 * (i / 64) + i % 32];
        if i % 64 < 32 {
            b & 0x0F
        } else {
            b >> 4
        }
    }

    pub fn dequantize(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        for (j, sub) in out[..QK_K].chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min_k4(j, &self.scales);
            let (dj, mj) = (d * sc as f32, dmin * m as f32);
            for (l, o) in sub.iter_mut().enumerate() {
                *o = dj * self.code(32 * j + l) as f32 - mj;
            }
        }
    }
}

impl BlockQ5K {
    /// The 5-bit code of element `i` (0..256).
    #[inline]
    pub fn code(&self, i: usize) -> u8 {
        let (c, l) = (i / 64, i % 32);
        let b = self.qs[32 * c + l];
        let bit = 2 * c + usize::from(i % 64 >= 32);
        let lo = if i % 64 < 32 { b & 0x0F } else { b >> 4 };
        lo | (((self.qh[l] >> bit) & 1) << 4)
    }

    pub fn dequantize(&self, out: &mut [f32]) {
        let (d, dmin) = (self.d.to_f32(), self.dmin.to_f32());
        for (j, sub) in out[..QK_K].chunks_exact_mut(32).enumerate() {
            let (sc, m) = scale_min_k4(j, &self.scales);
            let (dj, mj) = (d * sc as f32, dmin * m as f32);
            for (l, o) in sub.iter_mut().enumerate() {
                *o = dj * self.code(32 * j + l) as f32 - mj;
            }
        }
    }
}

impl BlockQ6K {
    /// The signed 6-bit code `q - 32` of element `i` (0..256).
    #[inline]
    pub fn code(&self, i: usize) -> i8 {
        let (h, k, l) = (i / 128, (i % 128) / 32, i % 32);
        let b = self.ql[64 * h + l + 32 * (k & 1)];
        let lo = if k < 2 { b & 0x0F } else { b >> 4 };
        let hi = (self.qh[32 * h + l] >> (2 * k)) & 3;
        (lo | (hi << 4)) as i8 - 32
    }

    pub fn dequantize(&self, out: &mut [f32]) {
        let d = self.d.to_f32();
        for (i, o) in out[..QK_K].iter_mut().enumerate() {
            // (d * scale) * q, in ggml's order.
            *o = d * self.scales[i / 16] as f32 * self.code(i) as f32;
        }
    }
}

/// Least-squares fit of `x ≈ a * L + b` (`b <= 0`) over candidate integer codes `L` in `0..=nmax`
/// for one sub-block; returns `(a, -b)`, both `>= 0`.
fn fit_affine(x: &[f32], nmax: u8) -> (f32, f32) {
    let n = x.len() as f32;
    let xmax = x.iter().fold(f32::MIN, |a, &v| a.max(v));
    let xmin = x.iter().fold(0f32, |a, &v| a.min(v));
    // Also catches NaN (comparisons false) and infinite ranges.
    if xmax.partial_cmp(&xmin) != Some(std::cmp::Ordering::Greater) || !(xmax - xmin).is_finite() {
        return (0.0, -xmin.max(-f32::MAX));
    }
    let range = xmax - xmin;
    let err = |a: f32, b: f32| -> f32 {
        x.iter()
            .map(|&v| {
                let l = ((v - b) / a).round().clamp(0.0, nmax as f32);
                (a * l + b - v).powi(2)
            })
            .sum()
    };
    let mut best = (range / nmax as f32, xmin);
    let mut best_err = err(best.0, best.1);
    for k in -10..=10 {
        let iscale = (nmax as f32 + 0.1 * k as f32) / range;
        let (mut sl, mut sl2, mut sx, mut slx) = (0f32, 0f32, 0f32, 0f32);
        for &v in x {
            let l = (iscale * (v - xmin)).round().clamp(0.0, nmax as f32);
            sl += l;
            sl2 += l * l;
            sx += v;
            slx += l * v;
        }
        let det = n * sl2 - sl * sl;
        if det <= 0.0 {
            continue;
        }
        let mut a = (n * slx - sl * sx) / det;
        let mut b = (sx - a * sl) / n;
        if b > 0.0 {
            b = 0.0;
            a = slx / sl2;
        }
        if a.is_nan() || a <= 0.0 {
            continue;
        }
        let e = err(a, b);
        if e < best_err {
            best = (a, b);
            best_err = e;
        }
    }
    (best.0, -best.1)
}

/// Least-squares fit of `x ≈ a * L` over candidate codes `L` in `-32..=31` for one sub-block of
/// Q6_K; returns the signed scale `a`.
fn fit_symmetric(x: &[f32]) -> f32 {
    let mut max = 0f32;
    for &v in x {
        if v.abs() > max.abs() {
            max = v;
        }
    }
    if max == 0.0 || !max.is_finite() {
        return 0.0;
    }
    let err = |a: f32| -> f32 {
        x.iter()
            .map(|&v| (a * (v / a).round().clamp(-32.0, 31.0) - v).powi(2))
            .sum()
    };
    let mut best = max / -32.0;
    let mut best_err = err(best);
    for k in -10..=10 {
        let iscale = -(32.0 + 0.1 * k as f32) / max;
        let (mut sl2, mut slx) = (0f32, 0f32);
        for &v in x {
            let l = (iscale * v).round().clamp(-32.0, 31.0);
            sl2 += l * l;
            slx += l * v;
        }
        if sl2 == 0.0 {
            continue;
        }
        let a = slx / sl2;
        let e = err(a);
        if e < best_err {
            best = a;
            best_err = e;
        }
    }
    best
}

/// `round(x / step)` clamped to `lo..=hi`, or `lo.max(0)` when the step is zero.
fn code(v: f32, step: f32, lo: f32, hi: f32) -> i32 {
    if step == 0.0 {
        return lo.max(0.0) as i32;
    }
    (v / step).round().clamp(lo, hi) as i32
}

/// Quantizes 256 values to Q4_K (`bits == 4`) or Q5_K (`bits == 5`) codes: returns the stored
/// `d`, `dmin`, packed scales and the per-element codes.
fn quantize_affine_k(x: &[f32], bits: u32) -> (f16, f16, [u8; K_SCALE_SIZE], [u8; QK_K]) {
    let nmax = ((1u32 << bits) - 1) as u8;
    let mut scales = [0f32; 8];
    let mut mins = [0f32; 8];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        (scales[j], mins[j]) = fit_affine(sub, nmax);
    }
    let max_scale = scales.iter().fold(0f32, |a, &v| a.max(v));
    let max_min = mins.iter().fold(0f32, |a, &v| a.max(v));
    let (mut sc, mut m) = ([0u8; 8], [0u8; 8]);
    for j in 0..8 {
        sc[j] = code(scales[j], max_scale / 63.0, 0.0, 63.0) as u8;
        m[j] = code(mins[j], max_min / 63.0, 0.0, 63.0) as u8;
    }
    let d = f16::from_f32(max_scale / 63.0);
    let dmin = f16::from_f32(max_min / 63.0);
    let mut q = [0u8; QK_K];
    for (j, sub) in x.chunks_exact(32).enumerate() {
        let step = d.to_f32() * sc[j] as f32;
        let off = dmin.to_f32() * m[j] as f32;
        for (l, &v) in sub.iter().enumerate() {
            q[32 * j + l] = code(v + off, step, 0.0, nmax as f32) as u8;
        }
    }
    (d, dmin, pack_scale_min_k4(&sc, &m), q)
}

/// Appends one Q4_K block for `x` (256 values) to `dst`.
pub(crate) fn quantize_q4_k(x: &[f32], dst: &mut Vec<u8>) {
    let (d, dmin, scales, q) = quantize_affine_k(x, 4);
    dst.extend(d.to_bits().to_le_bytes());
    dst.extend(dmin.to_bits().to_le_bytes());
    dst.extend(scales);
    for c in 0..4 {
        dst.extend((0..32).map(|l| q[64 * c + l] | (q[64 * c + 32 + l] << 4)));
    }
}

/// Appends one Q5_K block for `x` (256 values) to `dst`.
pub(crate) fn quantize_q5_k(x: &[f32], dst: &mut Vec<u8>) {
    let (d, dmin, scales, q) = quantize_affine_k(x, 5);
    dst.extend(d.to_bits().to_le_bytes());
    dst.extend(dmin.to_bits().to_le_bytes());
    dst.extend(scales);
    dst.extend((0..32).map(|l| {
        (0..4).fold(0u8, |h, c| {
            h | ((q[64 * c + l] >> 4) << (2 * c)) | ((q[64 * c + 32 + l] >> 4) << (2 * c + 1))
        })
    }));
    for c in 0..4 {
        dst.extend((0..32).map(|l| (q[64 * c + l] & 0x0F) | ((q[64 * c + 32 + l] & 0x0F) << 4)));
    }
}

/// Appends one Q6_K block for `x` (256 values) to `dst`.
pub(crate) fn quantize_q6_k(x: &[f32], dst: &mut Vec<u8>) {
    let mut scales = [0f32; 16];
    for (j, sub) in x.chunks_exact(16).enumerate() {
        scales[j] = fit_symmetric(sub);
    }
    let mut max_scale = 0f32;
    for &s in &scales {
        if s.abs() > max_scale.abs() {
            max_scale = s;
        }
    }
    // The largest scale maps to -128 (as in ggml), the others relative to it.
    let iscale = if max_scale != 0.0 {
        -128.0 / max_scale
    } else {
        0.0
    };
    let sc: [i8; 16] = scales.map(|s| (iscale * s).round().clamp(-128.0, 127.0) as i8);
    let d = f16::from_f32(if iscale != 0.0 { 1.0 / iscale } else { 0.0 });
    let mut q = [0u8; QK_K];
    for (i, &v) in x.iter().enumerate() {
        let step = d.to_f32() * sc[i / 16] as f32;
        q[i] = (code(v, step, -32.0, 31.0) + 32) as u8;
    }
    let (mut ql, mut qh) = ([0u8; QK_K / 2], [0u8; QK_K / 4]);
    for h in 0..2 {
        for l in 0..32 {
            let e = |k: usize| q[128 * h + 32 * k + l];
            ql[64 * h + l] = (e(0) & 0x0F) | ((e(2) & 0x0F) << 4);
            ql[64 * h + l + 32] = (e(1) & 0x0F) | ((e(3) & 0x0F) << 4);
            qh[32 * h + l] = (0..4).fold(0u8, |b, k| b | ((e(k) >> 4) << (2 * k)));
        }
    }
    dst.extend(ql);
    dst.extend(qh);
    dst.extend(sc.map(|s| s as u8));
    dst.extend(d.to_bits().to_le_bytes());
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn scale_packing_round_trips_every_6_bit_value() {
        for base in 0..64u8 {
            let sc: [u8; 8] = std::array::from_fn(|j| (base + 7 * j as u8) % 64);
            let m: [u8; 8] = std::array::from_fn(|j| (base * 3 + 11 * j as u8) % 64);
            let q = pack_scale_min_k4(&sc, &m);
            for j in 0..8 {
                assert_eq!(scale_min_k4(j, &q), (sc[j], m[j]), "base {base} j {j}");
            }
        }
    }
}
