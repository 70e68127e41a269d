//! Element-wise and row-wise ops of the transformer block: RMSNorm, RoPE, SwiGLU, softmax.
//! Small next to the matrix products, so plain loops that the compiler vectorizes.

use quire_core::RopeStyle;

/// `out = x / sqrt(mean(x^2) + eps) * weight`, per row.
// x, out: [n, dim]; weight: [dim]
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        // The sum of squares in f64, as ggml does, so long rows lose nothing.
        let ss = (xr.iter().map(|&v| (v * v) as f64).sum::<f64>() / dim as f64) as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
}

/// Row counts below which the row-wise ops (RMSNorm, activation quantization) stay on the
/// calling thread.
pub const SERIAL_ROWS: usize = 32;

/// `rms_norm` with the rows of a prefill spread over the pool (rows are independent).
pub fn rms_norm_par(
    par: &dyn super::team::Parallel,
    x: &[f32],
    weight: &[f32],
    eps: f32,
    out: &mut [f32],
) {
    let dim = weight.len();
    let n = x.len() / dim;
    // A few rows (a verify step, a small batch) take a few µs here: less than a parallel
    // section, which on a busy machine can wait a scheduler slice for its other thread.
    if n < SERIAL_ROWS {
        return rms_norm(x, weight, eps, out);
    }
    let o = super::team::DisjointPtr::new(out);
    par.run_tasks(n.div_ceil(8), &|task| {
        let (r0, r1) = (task * 8, (task * 8 + 8).min(n));
        // SAFETY: rows r0..r1 belong to this task alone.
        let out = unsafe { std::slice::from_raw_parts_mut(o.at(r0 * dim), (r1 - r0) * dim) };
        rms_norm(&x[r0 * dim..r1 * dim], weight, eps, out);
    });
}

/// In-place RMSNorm of each `head_dim` slice (Qwen3's QK-norm).
pub fn rms_norm_heads(x: &mut [f32], weight: &[f32], eps: f32) {
    let dim = weight.len();
    for xr in x.chunks_exact_mut(dim) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for (v, &w) in xr.iter_mut().zip(weight) {
            *v *= scale * w;
        }
    }
}

/// RoPE angles, computed as ggml does (`ggml_rope_cache_init`): the angle of pair `i` at
/// position `p` is `p · θ^(-2i/d)` accumulated by repeated f32 multiplication, divided by Llama 3's
/// per-frequency factor when present. The f32 rounding of that product differs from an exact
/// `p · inv_freq[i]` by up to ~1e-4 rad at long positions; matching it keeps greedy paths aligned
/// with llama.cpp's.
#[derive(Debug, Clone)]
pub struct RopeTable {
    theta_scale: f32,
    freq_factors: Option<Vec<f32>>,
    pairs: usize,
}

impl RopeTable {
    pub fn new(rope_dim: usize, theta: f32, freq_factors: Option<&[f32]>) -> Self {
        Self {
            theta_scale: theta.powf(-2.0 / rope_dim as f32),
            freq_factors: freq_factors.map(|f| f.to_vec()),
            pairs: rope_dim / 2,
        }
    }

    /// `(cos, sin)` of every pair's angle at `pos`.
    pub fn angles(&self, pos: u32, out: &mut Vec<(f32, f32)>) {
        out.clear();
        let mut theta = pos as f32;
        for i in 0..self.pairs {
            let ff = self
                .freq_factors
                .as_ref()
                .and_then(|f| f.get(i).copied())
                .unwrap_or(1.0);
            let t = theta / ff;
            out.push((t.cos(), t.sin()));
            theta *= self.theta_scale;
        }
    }
}

/// Rotates the first `rope_dim` dims of each head of one token by precomputed angles.
// x: [num_heads, head_dim]; cs: [rope_dim / 2] (cos, sin)
pub fn rope(x: &mut [f32], head_dim: usize, cs: &[(f32, f32)], style: RopeStyle) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: FMA is available. Without the feature enabled, each `mul_add` is a call into
        // the C library's `fmaf` (same result, ~10x the time).
        return unsafe { rope_fma(x, head_dim, cs, style) };
    }
    rope_generic(x, head_dim, cs, style)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn rope_fma(x: &mut [f32], head_dim: usize, cs: &[(f32, f32)], style: RopeStyle) {
    rope_generic(x, head_dim, cs, style)
}

#[inline(always)]
fn rope_generic(x: &mut [f32], head_dim: usize, cs: &[(f32, f32)], style: RopeStyle) {
    let half = cs.len();
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &(cos, sin)) in cs.iter().enumerate() {
            let (a, b) = match style {
                RopeStyle::Normal => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            // Fused as GCC contracts ggml's `x0*cos - x1*sin` (bit-identical to llama.cpp).
            head[a] = x0.mul_add(cos, -(x1 * sin));
            head[b] = x0.mul_add(sin, x1 * cos);
        }
    }
}

/// `out = silu(gate) * up`, where each row of `gu` is `[gate | up]`.
///
/// SiLU is `x / (1 + exp(-x))` with exp evaluated by the polynomial of ARM's optimized-routines
/// `expf` (max error ~1.5 ulp), the one ggml's AVX2 SwiGLU uses for every full group of eight; the
/// last `inter % 8` use the C library's `expf`, as ggml does. Matching it bit for bit keeps the
/// 8-bit activation quantization that follows identical to llama.cpp's.
// gu: [n, 2 * inter]; out: [n, inter]
pub fn swiglu(gu: &[f32], inter: usize, out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: FMA is available.
        return unsafe { swiglu_fma(gu, inter, out) };
    }
    swiglu_generic(gu, inter, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn swiglu_fma(gu: &[f32], inter: usize, out: &mut [f32]) {
    swiglu_generic(gu, inter, out)
}

/// SwiGLU of one element by the polynomial `exp` (what ggml uses for full groups of eight).
#[inline(always)]
fn silu_mul(g: f32, u: f32) -> f32 {
    g / (1.0 + expf_poly(0.0 - g)) * u
}

/// SwiGLU over rows of `gu` whose gate and up halves are interleaved in chunks of `chunk`
/// (`[g0 u0 g1 u1 …]`, chunk a multiple of 8 dividing `inter`; see
/// `QMatrix::interleave_rows`): every element is a full group of eight, so each equals
/// [`swiglu`]'s result for the same gate and up values.
// gu: [n, 2 * inter] chunk-interleaved; out: [n, inter]
pub fn swiglu_chunked(gu: &[f32], inter: usize, chunk: usize, out: &mut [f32]) {
    assert!(chunk.is_multiple_of(8) && inter.is_multiple_of(chunk));
    for (row, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        for (pair, o) in row.chunks_exact(2 * chunk).zip(o.chunks_exact_mut(chunk)) {
            let (g, u) = pair.split_at(chunk);
            swiglu_full(g, u, o);
        }
    }
}

/// `out[i] = silu(g[i]) * u[i]` by the polynomial `exp` (for elements in full groups of eight).
// g, u, out: [len]
pub fn swiglu_full(g: &[f32], u: &[f32], out: &mut [f32]) {
    #[cfg(target_arch = "x86_64")]
    if is_x86_feature_detected!("fma") {
        // SAFETY: FMA is available.
        return unsafe { swiglu_full_fma(g, u, out) };
    }
    swiglu_full_generic(g, u, out)
}

#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "fma")]
unsafe fn swiglu_full_fma(g: &[f32], u: &[f32], out: &mut [f32]) {
    swiglu_full_generic(g, u, out)
}

#[inline(always)]
fn swiglu_full_generic(g: &[f32], u: &[f32], out: &mut [f32]) {
    for ((o, &g), &u) in out.iter_mut().zip(g).zip(u) {
        *o = silu_mul(g, u);
    }
}

#[inline(always)]
fn swiglu_generic(gu: &[f32], inter: usize, out: &mut [f32]) {
    let full = inter / 8 * 8;
    for (row, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (g, u) = row.split_at(inter);
        for i in 0..full {
            o[i] = silu_mul(g[i], u[i]);
        }
        for i in full..inter {
            o[i] = g[i] / (1.0 + (-g[i]).exp()) * u[i];
        }
    }
}

/// `exp(x)`: range reduction `x = n·ln2 + b`, a degree-5 polynomial in `b`, and scaling by `2^n`
/// with care for |n| > 126 (constants from ARM optimized-routines, as ggml uses them).
#[inline(always)]
pub fn expf_poly(x: f32) -> f32 {
    let f = f32::from_bits;
    let r = f(0x4b40_0000); // 1.5 * 2^23: adding it rounds to an integer
    let z = x.mul_add(f(0x3fb8_aa3b), r); // x * log2(e) + r
    let n = z - r;
    let b = (-n).mul_add(f(0x35bf_be8e), (-n).mul_add(f(0x3f31_7200), x)); // x - n*ln2 (hi, lo)
    let e = z.to_bits().wrapping_shl(23);
    let k = f(e.wrapping_add(1f32.to_bits())); // 2^n
    let u = b * b;
    let j = f(0x3c07_2010)
        .mul_add(b, f(0x3d2b_9f17))
        .mul_add(u, f(0x3e2a_af33).mul_add(b, f(0x3eff_fedb)))
        .mul_add(u, f(0x3f7f_fff6) * b);
    if n.abs() <= 126.0 {
        return k.mul_add(j, k);
    }
    let g: u32 = if n <= 0.0 { 0x8200_0000 } else { 0 };
    let s1 = f(g.wrapping_add(0x7f00_0000));
    let s2 = f(e.wrapping_sub(g));
    if n.abs() > 192.0 {
        s1 * s1
    } else {
        s2.mul_add(j, s2) * s1
    }
}

pub fn add_in_place(x: &mut [f32], y: &[f32]) {
    for (a, b) in x.iter_mut().zip(y) {
        *a += b;
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rope_styles_rotate_the_right_pairs() {
        let table = RopeTable::new(4, 10000.0, None);
        let mut cs = Vec::new();
        table.angles(1, &mut cs);
        let mut x = vec![1.0, 0.0, 1.0, 0.0];
        rope(&mut x, 4, &cs, RopeStyle::Normal);
        // pair (0,1) rotated by 1 rad, pair (2,3) by 0.01 rad
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
        assert!((x[2] - 0.01f32.cos()).abs() < 1e-6 && (x[3] - 0.01f32.sin()).abs() < 1e-6);
        let mut y = vec![1.0, 1.0, 0.0, 0.0];
        rope(&mut y, 4, &cs, RopeStyle::Neox);
        // pairs (0,2) and (1,3)
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[2] - 1f32.sin()).abs() < 1e-6);
        assert!((y[1] - 0.01f32.cos()).abs() < 1e-6 && (y[3] - 0.01f32.sin()).abs() < 1e-6);
    }

    #[test]
    fn expf_poly_is_within_two_ulp_of_exp() {
        let mut worst = 0u32;
        let mut x = -103.0f32;
        while x < 88.0 {
            let (a, b) = (expf_poly(x), x.exp());
            worst = worst.max(a.to_bits().abs_diff(b.to_bits()));
            x += 0.0137;
        }
        assert!(worst <= 2, "{worst} ulp");
        assert_eq!(expf_poly(-200.0), 0.0);
        assert_eq!(expf_poly(100.0), f32::INFINITY);
        assert_eq!(expf_poly(0.0), 1.0);
    }

    #[test]
    fn chunked_swiglu_equals_swiglu_bit_for_bit() {
        let (inter, chunk, n) = (96, 32, 3);
        let gu: Vec<f32> = (0..n * 2 * inter)
            .map(|i| ((i * 7919 % 1013) as f32 - 506.0) / 37.0)
            .collect();
        let mut want = vec![0f32; n * inter];
        swiglu(&gu, inter, &mut want);
        // The same values with gate and up interleaved in chunks of 32.
        let mut inter_gu = Vec::new();
        for row in gu.chunks_exact(2 * inter) {
            let (g, u) = row.split_at(inter);
            for c in 0..inter / chunk {
                inter_gu.extend_from_slice(&g[c * chunk..(c + 1) * chunk]);
                inter_gu.extend_from_slice(&u[c * chunk..(c + 1) * chunk]);
            }
        }
        let mut got = vec![0f32; n * inter];
        swiglu_chunked(&inter_gu, inter, chunk, &mut got);
        for (a, b) in got.iter().zip(&want) {
            assert_eq!(a.to_bits(), b.to_bits());
        }
    }

    #[test]
    fn rms_norm_normalizes() {
        let x = [3.0f32, 4.0];
        let mut out = [0f32; 2];
        rms_norm(&x, &[1.0, 2.0], 0.0, &mut out);
        let r = (12.5f32).sqrt();
        assert!((out[0] - 3.0 / r).abs() < 1e-6 && (out[1] - 8.0 / r).abs() < 1e-6);
    }
}
