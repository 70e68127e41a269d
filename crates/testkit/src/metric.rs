//! The one error metric of quire's numeric tests, and the bound each op is held to.
//!
//! Relative L2 error: `rel_l2(got, want) = ‖got − want‖₂ / ‖want‖₂`, both norms summed in f64
//! over every compared element (a whole output, or one logits row where a test says so). It
//! weighs every element, unlike a maximum, and does not blow up at single elements near zero,
//! unlike an elementwise relative error. A non-finite element of `got` fails the test: outputs
//! are poisoned with NaN before a kernel runs, so an element it never wrote shows here.

/// Paged attention with f32 accumulation (CPU) against the f64 dense reference: f32 rounding
/// of softmax sums over at most a few hundred keys.
pub const ATTENTION_F32: f64 = 1e-5;
/// Attention with an f16 V accumulator and f16 Q (llama.cpp's CPU flash-attention numerics):
/// each step rounds to f16 (2^-11 relative), over up to a few hundred steps.
pub const ATTENTION_F16_ACCUM: f64 = 2e-2;
/// The CUDA attention kernels against the f64 dense reference: f16 K/V and f16 products on
/// tensor cores, f32 softmax, outputs that may be rounded to f16 (2^-11 relative per element).
pub const ATTENTION_GPU: f64 = 2e-3;
/// A kernel whose f32 result is rounded to f16 (RMSNorm, SwiGLU): one f16 rounding (2^-11
/// relative, ~5e-4) plus f32 sums.
pub const F16_OUTPUT: f64 = 1e-3;
/// f32 elementwise kernels that evaluate the same formula in another order (RoPE with bias and
/// QK-norm): a few f32 roundings.
pub const F32_ELEMENTWISE: f64 = 1e-5;
/// Dot products of f16 (or 8-bit quantized) rows summed in f32 in another order than the f64
/// or CPU reference: f32 accumulation over up to ~16k products.
pub const DOT_F32: f64 = 1e-5;
/// Two f32-accumulating GEMV implementations (quire's GEMV and cuBLAS) against each other:
/// each is within [`DOT_F32`] of the exact sum; cuBLAS may split K differently.
pub const DOT_F32_VS_CUBLAS: f64 = 1e-4;
/// A GEMV that computes its input itself (RMSNorm or SwiGLU rounded to f16, then the product):
/// the input's f16 rounding ([`F16_OUTPUT`]) carried through a long dot product.
pub const DOT_FUSED_F16_INPUT: f64 = 2e-3;
/// Whole-model logits of a backend on f16-dequantized weights against the CPU backend on the
/// same weights, teacher-forced, per row: f16 activations and cuBLAS sums across 30 layers.
pub const LOGITS_F16_WEIGHTS: f64 = 1e-2;

/// `‖got − want‖₂ / ‖want‖₂` in f64 (0 when both are zero). Panics when the lengths differ or
/// `got` holds a non-finite element.
#[track_caller]
pub fn rel_l2<A, B>(got: &[A], want: &[B]) -> f64
where
    A: Copy + Into<f64>,
    B: Copy + Into<f64>,
{
    assert_eq!(got.len(), want.len(), "compared outputs differ in length");
    let (mut num, mut den) = (0f64, 0f64);
    for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
        let (g, w): (f64, f64) = (g.into(), w.into());
        assert!(
            g.is_finite(),
            "output element {i} is {g} (NaN: never written, or a poisoned cache slot was read)"
        );
        num += (g - w) * (g - w);
        den += w * w;
    }
    if num == 0.0 {
        0.0
    } else {
        (num / den).sqrt()
    }
}

/// Accumulates [`rel_l2`] over several pieces (e.g. the sequences of a batch compared one by
/// one): the error of their concatenation.
#[derive(Debug, Clone, Copy, Default)]
pub struct RelL2 {
    num: f64,
    den: f64,
}

impl RelL2 {
    #[track_caller]
    pub fn add<A, B>(&mut self, got: &[A], want: &[B])
    where
        A: Copy + Into<f64>,
        B: Copy + Into<f64>,
    {
        assert_eq!(got.len(), want.len(), "compared outputs differ in length");
        for (i, (&g, &w)) in got.iter().zip(want).enumerate() {
            let (g, w): (f64, f64) = (g.into(), w.into());
            assert!(
                g.is_finite(),
                "output element {i} is {g} (NaN: never written, or a poisoned cache slot was read)"
            );
            self.num += (g - w) * (g - w);
            self.den += w * w;
        }
    }

    pub fn value(&self) -> f64 {
        if self.num == 0.0 {
            0.0
        } else {
            (self.num / self.den).sqrt()
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rel_l2_is_the_norm_ratio() {
        assert_eq!(rel_l2(&[1f32, 2.0], &[1f32, 2.0]), 0.0);
        // ‖(0, 1)‖ / ‖(3, 4)‖ = 1 / 5
        let e = rel_l2(&[3f32, 5.0], &[3f64, 4.0]);
        assert!((e - 0.2).abs() < 1e-12, "{e}");
        assert_eq!(rel_l2(&[1f32], &[0f32]), f64::INFINITY);
        let mut acc = RelL2::default();
        acc.add(&[3f32], &[3f32]);
        acc.add(&[5f32], &[4f32]);
        assert!((acc.value() - 0.2).abs() < 1e-12);
    }

    #[test]
    #[should_panic(expected = "never written")]
    fn a_nan_output_fails() {
        rel_l2(&[f32::NAN], &[1f32]);
    }
}
