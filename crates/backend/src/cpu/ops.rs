//! Element-wise and row-wise ops of the transformer block: RMSNorm, RoPE, SwiGLU, softmax.
//! Small next to the matrix products, so plain loops that the compiler vectorizes.

use quire_core::RopeStyle;

/// `out = x / sqrt(mean(x^2) + eps) * weight`, per row.
// x, out: [n, dim]; weight: [dim]
pub fn rms_norm(x: &[f32], weight: &[f32], eps: f32, out: &mut [f32]) {
    let dim = weight.len();
    for (xr, or) in x.chunks_exact(dim).zip(out.chunks_exact_mut(dim)) {
        let ss: f32 = xr.iter().map(|v| v * v).sum::<f32>() / dim as f32;
        let scale = 1.0 / (ss + eps).sqrt();
        for ((o, &v), &w) in or.iter_mut().zip(xr).zip(weight) {
            *o = v * scale * w;
        }
    }
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

/// Inverse frequencies of RoPE, with Llama 3's per-frequency divisors when present.
pub fn rope_inv_freq(rope_dim: usize, theta: f32, freq_factors: Option<&[f32]>) -> Vec<f32> {
    (0..rope_dim / 2)
        .map(|i| {
            let f = (theta as f64).powf(-(2.0 * i as f64) / rope_dim as f64) as f32;
            match freq_factors {
                Some(ff) => f / ff.get(i).copied().unwrap_or(1.0),
                None => f,
            }
        })
        .collect()
}

/// Rotates the first `rope_dim` dims of each head of one token at `pos`.
// x: [num_heads, head_dim]
pub fn rope(x: &mut [f32], head_dim: usize, inv_freq: &[f32], pos: u32, style: RopeStyle) {
    let half = inv_freq.len();
    for head in x.chunks_exact_mut(head_dim) {
        for (i, &f) in inv_freq.iter().enumerate() {
            let (sin, cos) = (pos as f32 * f).sin_cos();
            let (a, b) = match style {
                RopeStyle::Normal => (2 * i, 2 * i + 1),
                RopeStyle::Neox => (i, i + half),
            };
            let (x0, x1) = (head[a], head[b]);
            head[a] = x0 * cos - x1 * sin;
            head[b] = x0 * sin + x1 * cos;
        }
    }
}

/// `out = silu(gate) * up`, where each row of `gu` is `[gate | up]`.
// gu: [n, 2 * inter]; out: [n, inter]
pub fn swiglu(gu: &[f32], inter: usize, out: &mut [f32]) {
    for (row, o) in gu.chunks_exact(2 * inter).zip(out.chunks_exact_mut(inter)) {
        let (g, u) = row.split_at(inter);
        for ((o, &g), &u) in o.iter_mut().zip(g).zip(u) {
            *o = g / (1.0 + (-g).exp()) * u;
        }
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
        let inv = rope_inv_freq(4, 10000.0, None);
        let mut x = vec![1.0, 0.0, 1.0, 0.0];
        rope(&mut x, 4, &inv, 1, RopeStyle::Normal);
        // pair (0,1) rotated by 1 rad, pair (2,3) by 0.01 rad
        assert!((x[0] - 1f32.cos()).abs() < 1e-6 && (x[1] - 1f32.sin()).abs() < 1e-6);
        assert!((x[2] - 0.01f32.cos()).abs() < 1e-6 && (x[3] - 0.01f32.sin()).abs() < 1e-6);
        let mut y = vec![1.0, 1.0, 0.0, 0.0];
        rope(&mut y, 4, &inv, 1, RopeStyle::Neox);
        // pairs (0,2) and (1,3)
        assert!((y[0] - 1f32.cos()).abs() < 1e-6 && (y[2] - 1f32.sin()).abs() < 1e-6);
        assert!((y[1] - 0.01f32.cos()).abs() < 1e-6 && (y[3] - 0.01f32.sin()).abs() < 1e-6);
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
