//! `expf` eight lanes at a time, bit-identical to glibc's x86-64 `expf` on FMA machines
//! (`__expf_fma`, sysdeps/ieee754/flt-32/e_expf.c compiled with FMA contraction, glibc ≥ 2.27),
//! which is what `f32::exp` calls there and what ggml's flash attention calls. The algorithm, in
//! double precision: `k = round(x · 32/ln2)` by the shift trick, `r = x · 32/ln2 − k` (both fused),
//! `2^(k/32)` from a 32-entry table plus the exponent bits of `k`, and a cubic in `r` evaluated with
//! the same three fused multiply-adds, then one rounding to f32. Lanes with |x| ≥ 88 or NaN (the
//! C code's special cases) are computed by the scalar `f32::exp`.
//!
//! A libm that computes `expf` otherwise (musl, an older glibc) would differ from this in rare
//! last bits, so `usable()` compares the two once on probe arguments before the kernel uses it.

use std::arch::x86_64::*;
use std::sync::OnceLock;

/// `__exp2f_data.tab`: `bits(2^(i/32)) − (i << 47)`.
const TAB: [u64; 32] = [
    0x3ff0000000000000,
    0x3fefd9b0d3158574,
    0x3fefb5586cf9890f,
    0x3fef9301d0125b51,
    0x3fef72b83c7d517b,
    0x3fef54873168b9aa,
    0x3fef387a6e756238,
    0x3fef1e9df51fdee1,
    0x3fef06fe0a31b715,
    0x3feef1a7373aa9cb,
    0x3feedea64c123422,
    0x3feece086061892d,
    0x3feebfdad5362a27,
    0x3feeb42b569d4f82,
    0x3feeab07dd485429,
    0x3feea47eb03a5585,
    0x3feea09e667f3bcd,
    0x3fee9f75e8ec5f74,
    0x3feea11473eb0187,
    0x3feea589994cce13,
    0x3feeace5422aa0db,
    0x3feeb737b0cdc5e5,
    0x3feec49182a3f090,
    0x3feed503b23e255d,
    0x3feee89f995ad3ad,
    0x3feeff76f2fb5e47,
    0x3fef199bdd85529c,
    0x3fef3720dcef9069,
    0x3fef5818dcfba487,
    0x3fef7c97337b9b5f,
    0x3fefa4afa2a490da,
    0x3fefd0765b6e4540,
];
/// 32 / ln 2 (`invln2_scaled`).
const INV_LN2_N: u64 = 0x40471547652b82fe;
/// The cubic's coefficients for `r` in units of 1/32 (`poly_scaled`).
const C0: u64 = 0x3ebc6af84b912394;
const C1: u64 = 0x3f2ebfce50fac4f3;
const C2: u64 = 0x3f962e42ff0c52d6;
/// 1.5 · 2^52: adding it rounds to an integer, kept in the low bits.
const SHIFT: u64 = 0x4338000000000000;

#[inline(always)]
unsafe fn pd(bits: u64) -> __m256d {
    _mm256_set1_pd(f64::from_bits(bits))
}

/// Four lanes in double precision, as the C code computes one.
#[inline(always)]
unsafe fn exp4(x: __m128) -> __m128 {
    let xd = _mm256_cvtps_pd(x);
    let inv = pd(INV_LN2_N);
    let shift = pd(SHIFT);
    let kds = _mm256_fmadd_pd(inv, xd, shift);
    let ki = _mm256_castpd_si256(kds);
    let kd = _mm256_sub_pd(kds, shift);
    let r = _mm256_fmsub_pd(inv, xd, kd);
    let idx = _mm256_and_si256(ki, _mm256_set1_epi64x(31));
    let tab = _mm256_i64gather_epi64::<8>(TAB.as_ptr().cast(), idx);
    let s = _mm256_castsi256_pd(_mm256_add_epi64(tab, _mm256_slli_epi64::<47>(ki)));
    let z = _mm256_fmadd_pd(r, pd(C0), pd(C1));
    let r2 = _mm256_mul_pd(r, r);
    let y = _mm256_fmadd_pd(r, pd(C2), _mm256_set1_pd(1.0));
    let y = _mm256_fmadd_pd(z, r2, y);
    _mm256_cvtpd_ps(_mm256_mul_pd(y, s))
}

/// `expf` of eight lanes.
///
/// # Safety
/// AVX2 and FMA must be present.
#[inline(always)]
pub(super) unsafe fn exp8(x: __m256) -> __m256 {
    let lo = exp4(_mm256_castps256_ps128(x));
    let hi = exp4(_mm256_extractf128_ps::<1>(x));
    let y = _mm256_insertf128_ps::<1>(_mm256_castps128_ps256(lo), hi);
    // The special cases: top bits of |x| at or above those of 88.0 (0x42b), NaN and ±inf included.
    let top = _mm256_and_si256(
        _mm256_srli_epi32::<20>(_mm256_castps_si256(x)),
        _mm256_set1_epi32(0x7ff),
    );
    let special = _mm256_movemask_ps(_mm256_castsi256_ps(_mm256_cmpgt_epi32(
        top,
        _mm256_set1_epi32(0x42a),
    )));
    if special == 0 {
        return y;
    }
    let mut xs = [0f32; 8];
    let mut ys = [0f32; 8];
    _mm256_storeu_ps(xs.as_mut_ptr(), x);
    _mm256_storeu_ps(ys.as_mut_ptr(), y);
    for i in 0..8 {
        if special & (1 << i) != 0 {
            ys[i] = xs[i].exp();
        }
    }
    _mm256_loadu_ps(ys.as_ptr())
}

#[target_feature(enable = "avx2,fma")]
unsafe fn exp8_slice(x: &[f32], y: &mut [f32]) {
    for (xc, yc) in x.chunks_exact(8).zip(y.chunks_exact_mut(8)) {
        _mm256_storeu_ps(yc.as_mut_ptr(), exp8(_mm256_loadu_ps(xc.as_ptr())));
    }
}

/// Whether `exp8` gives `f32::exp`'s bits here: AVX2 and FMA present and the platform `expf`
/// agreeing on probe arguments (checked once). Otherwise callers use `f32::exp`.
pub(super) fn usable() -> bool {
    static OK: OnceLock<bool> = OnceLock::new();
    *OK.get_or_init(|| crate::cpu::quant::has_avx2() && agrees(&probes()))
}

/// Probe arguments: a sweep of [-104, 1], the special cases, and arguments where an `expf`
/// computed without fused multiply-adds rounds differently (found by exhaustive search).
fn probes() -> Vec<f32> {
    let mut x: Vec<f32> = (0..65536)
        .map(|i| -104.0 + i as f32 * (105.0 / 65536.0))
        .collect();
    x.extend(UNFUSED_DIFFERS);
    x.extend([
        0.0,
        -0.0,
        f32::NEG_INFINITY,
        f32::NAN,
        -88.0,
        -87.99,
        -103.9,
        -1e-30,
    ]);
    while !x.len().is_multiple_of(8) {
        x.push(0.0);
    }
    x
}

/// Whether `exp8` equals `f32::exp` bit for bit on `x` (a multiple of 8 long).
pub(super) fn agrees(x: &[f32]) -> bool {
    let mut y = vec![0f32; x.len()];
    // SAFETY: callers check AVX2/FMA first (`usable`) or only run where they are (tests).
    unsafe { exp8_slice(x, &mut y) };
    x.iter()
        .zip(&y)
        .all(|(a, b)| a.exp().to_bits() == b.to_bits())
}

/// Arguments whose `expf` differs in the last bit between the fused evaluation (glibc's FMA
/// build, what this file does) and the same C code without contraction.
const UNFUSED_DIFFERS: [f32; 2] = [-63.09946, 32.564632];

#[cfg(test)]
mod tests {
    use super::*;

    /// The C code without fused multiply-adds (glibc's non-FMA build, musl).
    fn expf_unfused(x: f32) -> f32 {
        let xd = x as f64;
        let z = f64::from_bits(INV_LN2_N) * xd;
        let kds = z + f64::from_bits(SHIFT);
        let ki = kds.to_bits();
        let kd = kds - f64::from_bits(SHIFT);
        let r = z - kd;
        let t = TAB[(ki % 32) as usize].wrapping_add(ki << 47);
        let s = f64::from_bits(t);
        let z = f64::from_bits(C0) * r + f64::from_bits(C1);
        let r2 = r * r;
        let y = f64::from_bits(C2) * r + 1.0;
        ((z * r2 + y) * s) as f32
    }

    quire_testkit::simd_test! {
        fn exp8_equals_f32_exp_on_probes_and_random_arguments() {
            assert!(agrees(&probes()), "exp8 differs from this platform's expf");
            assert!(usable());
            use rand::{Rng, SeedableRng};
            let mut rng = rand::rngs::StdRng::seed_from_u64(1);
            let x: Vec<f32> = (0..1 << 20)
                .map(|_| rng.random_range(-110.0f32..90.0))
                .collect();
            assert!(agrees(&x));
        }
    }

    #[test]
    fn the_probes_tell_an_unfused_expf_apart() {
        for &x in &UNFUSED_DIFFERS {
            // black_box: LLVM would fold `exp` of a constant with its own, correctly rounded, value.
            let x = std::hint::black_box(x);
            assert_ne!(expf_unfused(x).to_bits(), x.exp().to_bits(), "{x:e}");
        }
    }

    /// Every f32 in [-104, 88] (about 2.2e9 arguments, ~10 s): `cargo test --release -p
    /// quire-backend exp8_exhaustive -- --ignored --nocapture`. Also lists arguments where the
    /// unfused evaluation differs (the source of `UNFUSED_DIFFERS`).
    #[test]
    #[ignore = "about 10 s: run with --ignored"]
    fn exp8_exhaustive() {
        quire_testkit::require_simd();
        let ranges = [(0x8000_0000u32, (-104f32).to_bits()), (0, 88f32.to_bits())];
        let mut unfused = Vec::new();
        let mut n = 0u64;
        for (lo, hi) in ranges {
            let mut bits = lo;
            let mut x = vec![0f32; 1 << 16];
            let mut y = vec![0f32; 1 << 16];
            while bits <= hi {
                for v in x.iter_mut() {
                    *v = f32::from_bits(bits.min(hi));
                    bits = bits.saturating_add(1);
                }
                unsafe { exp8_slice(&x, &mut y) };
                for (a, b) in x.iter().zip(&y) {
                    let want = a.exp();
                    assert_eq!(want.to_bits(), b.to_bits(), "expf({a:e})");
                    if unfused.len() < 16 && expf_unfused(*a).to_bits() != want.to_bits() {
                        unfused.push(*a);
                    }
                }
                n += x.len() as u64;
                if bits == u32::MAX {
                    break;
                }
            }
        }
        println!("{n} arguments agree; unfused differs at {unfused:?}");
    }
}
