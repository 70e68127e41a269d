//! Dot products of K-quant weight rows (Q4_K, Q5_K, Q6_K; 256-element super-blocks) with
//! activations quantized to 8 bits per block of 32 ([`BlockQ8A`]), so K-quant matrices run through
//! the same matmul as Q4_0/Q4_1/Q8_0.
//!
//! Every 32 weights of a K-quant block share one scale (Q4_K/Q5_K: `d * sc`, and a min `dmin *
//! m`; Q6_K: two scales of 16), so a sub-block lines up with one activation block: its integer
//! sum `Σ q·a` is exact, the scale multiplies it once, and the min term uses the activation
//! block's stored sum `s` (as Q4_1 does). The AVX2 kernels compute the same integer sums eight
//! lanes at a time and then run exactly the scalar code's float arithmetic in the same order, so
//! they give the scalar reference's bits (tested).

use quire_gguf::{cast_blocks, scale_min_k4, BlockQ4K, BlockQ5K, BlockQ6K, GgmlType, Pod, QK_K};

use super::quant::{BlockQ8A, QK};

/// Activation blocks per K-quant super-block.
const SUB: usize = QK_K / QK;

/// Whether `dtype` is one of the K-quants handled here.
pub fn is_kquant(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K)
}

/// Views a weight row (whole, 2-aligned blocks: checked at load by `QMatrix::from_tensor`).
fn blocks<T: Pod>(w: &[u8]) -> &[T] {
    cast_blocks(w).expect("K-quant weight row is whole, aligned blocks")
}

/// Dot product of one K-quant weight row `w` (raw blocks, `n` elements) with its quantized
/// activations `xq` (`n / 32` blocks): AVX2 where it runs, the scalar reference otherwise (same
/// bits).
pub fn dot_row(dtype: GgmlType, w: &[u8], xq: &[BlockQ8A]) -> f32 {
    let nb = w.len() / dtype.type_size();
    assert!(
        xq.len() >= nb * SUB,
        "activation row shorter than the weight row"
    );
    #[cfg(target_arch = "x86_64")]
    if super::quant::has_avx2() {
        // SAFETY: AVX2/FMA/F16C present (checked at run time); `xq` covers every weight block.
        unsafe {
            return match dtype {
                GgmlType::Q4_K => avx2::dot_q4_k(blocks(w), xq),
                GgmlType::Q5_K => avx2::dot_q5_k(blocks(w), xq),
                GgmlType::Q6_K => avx2::dot_q6_k(blocks(w), xq),
                other => unreachable!("{} is not a K-quant", other.name()),
            };
        }
    }
    match dtype {
        GgmlType::Q4_K => scalar::dot_q4_k(blocks(w), xq),
        GgmlType::Q5_K => scalar::dot_q5_k(blocks(w), xq),
        GgmlType::Q6_K => scalar::dot_q6_k(blocks(w), xq),
        other => unreachable!("{} is not a K-quant", other.name()),
    }
}

/// The float part shared by the scalar and AVX2 Q4_K/Q5_K kernels: adds sub-block `j`'s
/// `(d·sc)·a.d·isum − (dmin·m)·a.s` to `acc` in a fixed order.
#[inline(always)]
fn add_affine(
    acc: &mut f32,
    d: f32,
    dmin: f32,
    scales: &[u8; 12],
    a: &[BlockQ8A],
    isum: &[i32; 8],
) {
    for j in 0..SUB {
        let (sc, m) = scale_min_k4(j, scales);
        *acc += d * sc as f32 * a[j].d * isum[j] as f32 - dmin * m as f32 * a[j].s;
    }
}

/// The float part of Q6_K: `isum` already carries the 8-bit sub-block scales.
#[inline(always)]
fn add_symmetric(acc: &mut f32, d: f32, a: &[BlockQ8A], isum: &[i32; 8]) {
    for j in 0..SUB {
        *acc += d * a[j].d * isum[j] as f32;
    }
}

/// Scalar references: one super-block at a time, integer sums per activation block.
pub mod scalar {
    use super::*;

    fn dot_affine(
        d: f32,
        dmin: f32,
        scales: &[u8; 12],
        code: impl Fn(usize) -> u8,
        a: &[BlockQ8A],
        acc: &mut f32,
    ) {
        let mut isum = [0i32; 8];
        for (j, s) in isum.iter_mut().enumerate() {
            *s = (0..QK)
                .map(|l| code(QK * j + l) as i32 * a[j].qs[l] as i32)
                .sum();
        }
        add_affine(acc, d, dmin, scales, a, &isum);
    }

    pub fn dot_q4_k(w: &[BlockQ4K], a: &[BlockQ8A]) -> f32 {
        let mut acc = 0f32;
        for (wb, a) in w.iter().zip(a.chunks_exact(SUB)) {
            let (d, dmin) = (wb.d.to_f32(), wb.dmin.to_f32());
            dot_affine(d, dmin, &wb.scales, |i| wb.code(i), a, &mut acc);
        }
        acc
    }

    pub fn dot_q5_k(w: &[BlockQ5K], a: &[BlockQ8A]) -> f32 {
        let mut acc = 0f32;
        for (wb, a) in w.iter().zip(a.chunks_exact(SUB)) {
            let (d, dmin) = (wb.d.to_f32(), wb.dmin.to_f32());
            dot_affine(d, dmin, &wb.scales, |i| wb.code(i), a, &mut acc);
        }
        acc
    }

    pub fn dot_q6_k(w: &[BlockQ6K], a: &[BlockQ8A]) -> f32 {
        let mut acc = 0f32;
        for (wb, a) in w.iter().zip(a.chunks_exact(SUB)) {
            let mut isum = [0i32; 8];
            for (j, s) in isum.iter_mut().enumerate() {
                for half in 0..2 {
                    let sc = wb.scales[2 * j + half] as i32;
                    let part: i32 = (16 * half..16 * half + 16)
                        .map(|l| wb.code(QK * j + l) as i32 * a[j].qs[l] as i32)
                        .sum();
                    *s += sc * part;
                }
            }
            add_symmetric(&mut acc, wb.d.to_f32(), a, &isum);
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Sums of pairs of u8 × i8 products widened to 8 i32 lanes.
    #[inline(always)]
    unsafe fn dot_u8_i8(w: __m256i, a: __m256i) -> __m256i {
        _mm256_madd_epi16(_mm256_maddubs_epi16(w, a), _mm256_set1_epi16(1))
    }

    /// The eight horizontal sums of `v[0..8]` in order.
    #[inline(always)]
    unsafe fn hsum8(v: &[__m256i; 8]) -> [i32; 8] {
        let h01 = _mm256_hadd_epi32(v[0], v[1]);
        let h23 = _mm256_hadd_epi32(v[2], v[3]);
        let h45 = _mm256_hadd_epi32(v[4], v[5]);
        let h67 = _mm256_hadd_epi32(v[6], v[7]);
        // [s0 s1 s2 s3 | s0' s1' s2' s3'] for the low and high 128-bit halves of each input.
        let a = _mm256_hadd_epi32(h01, h23);
        let b = _mm256_hadd_epi32(h45, h67);
        let s = _mm256_add_epi32(
            _mm256_permute2x128_si256(a, b, 0x20),
            _mm256_permute2x128_si256(a, b, 0x31),
        );
        let mut out = [0i32; 8];
        _mm256_storeu_si256(out.as_mut_ptr() as *mut __m256i, s);
        out
    }

    #[inline(always)]
    unsafe fn load(p: *const u8) -> __m256i {
        _mm256_loadu_si256(p as *const __m256i)
    }

    #[inline(always)]
    unsafe fn act(a: &BlockQ8A) -> __m256i {
        load(a.qs.as_ptr() as *const u8)
    }

    /// Per-activation-block integer sums of a Q4_K/Q5_K super-block; `qh` adds the fifth bit.
    #[inline(always)]
    unsafe fn affine_sums(qs: &[u8; 128], qh: Option<&[u8; 32]>, a: &[BlockQ8A]) -> [i32; 8] {
        let m4 = _mm256_set1_epi8(0x0F);
        let hbits = qh.map(|h| load(h.as_ptr()));
        let mut v = [_mm256_setzero_si256(); 8];
        for c in 0..4 {
            let q = load(qs.as_ptr().add(32 * c));
            let mut lo = _mm256_and_si256(q, m4);
            let mut hi = _mm256_and_si256(_mm256_srli_epi16(q, 4), m4);
            if let Some(h) = hbits {
                let sixteen = _mm256_set1_epi8(16);
                let bl = _mm256_set1_epi8(1 << (2 * c));
                let bh = _mm256_set1_epi8((1u8 << (2 * c + 1)) as i8);
                let l = _mm256_cmpeq_epi8(_mm256_and_si256(h, bl), bl);
                let u = _mm256_cmpeq_epi8(_mm256_and_si256(h, bh), bh);
                lo = _mm256_or_si256(lo, _mm256_and_si256(l, sixteen));
                hi = _mm256_or_si256(hi, _mm256_and_si256(u, sixteen));
            }
            v[2 * c] = dot_u8_i8(lo, act(&a[2 * c]));
            v[2 * c + 1] = dot_u8_i8(hi, act(&a[2 * c + 1]));
        }
        hsum8(&v)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_k(w: &[BlockQ4K], a: &[BlockQ8A]) -> f32 {
        let mut acc = 0f32;
        for (wb, a) in w.iter().zip(a.chunks_exact(SUB)) {
            let isum = affine_sums(&wb.qs, None, a);
            add_affine(
                &mut acc,
                wb.d.to_f32(),
                wb.dmin.to_f32(),
                &wb.scales,
                a,
                &isum,
            );
        }
        acc
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q5_k(w: &[BlockQ5K], a: &[BlockQ8A]) -> f32 {
        let mut acc = 0f32;
        for (wb, a) in w.iter().zip(a.chunks_exact(SUB)) {
            let isum = affine_sums(&wb.qs, Some(&wb.qh), a);
            add_affine(
                &mut acc,
                wb.d.to_f32(),
                wb.dmin.to_f32(),
                &wb.scales,
                a,
                &isum,
            );
        }
        acc
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q6_k(w: &[BlockQ6K], a: &[BlockQ8A]) -> f32 {
        let m4 = _mm256_set1_epi8(0x0F);
        let m2 = _mm256_set1_epi8(3);
        let off = _mm256_set1_epi8(32);
        let mut acc = 0f32;
        for (wb, a) in w.iter().zip(a.chunks_exact(SUB)) {
            let mut v = [_mm256_setzero_si256(); 8];
            for h in 0..2 {
                let ql0 = load(wb.ql.as_ptr().add(64 * h));
                let ql1 = load(wb.ql.as_ptr().add(64 * h + 32));
                let qh = load(wb.qh.as_ptr().add(32 * h));
                let lows = [
                    _mm256_and_si256(ql0, m4),
                    _mm256_and_si256(ql1, m4),
                    _mm256_and_si256(_mm256_srli_epi16(ql0, 4), m4),
                    _mm256_and_si256(_mm256_srli_epi16(ql1, 4), m4),
                ];
                let highs = [
                    _mm256_and_si256(qh, m2),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 2), m2),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 4), m2),
                    _mm256_and_si256(_mm256_srli_epi16(qh, 6), m2),
                ];
                for k in 0..4 {
                    let j = 4 * h + k;
                    let q = _mm256_or_si256(lows[k], _mm256_slli_epi16(highs[k], 4));
                    // q - 32 in -32..31: |q - 32| × (a × sign(q - 32)) keeps maddubs' first
                    // operand unsigned; every sum stays exact.
                    let wq = _mm256_sub_epi8(q, off);
                    let aq = act(&a[j]);
                    let p16 =
                        _mm256_maddubs_epi16(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq));
                    let sc = _mm256_set_m128i(
                        _mm_set1_epi16(wb.scales[2 * j + 1] as i16),
                        _mm_set1_epi16(wb.scales[2 * j] as i16),
                    );
                    v[j] = _mm256_madd_epi16(p16, sc);
                }
            }
            add_symmetric(&mut acc, wb.d.to_f32(), a, &hsum8(&v));
        }
        acc
    }
}

#[cfg(test)]
mod tests {
    use super::super::quant::{quantize_row_q8a, BlockQ8A};
    use super::*;
    use rand::{Rng, SeedableRng};

    const KQUANTS: [GgmlType; 3] = [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

    fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize, scale: f32) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-scale..scale)).collect()
    }

    fn scalar_dot(dtype: GgmlType, w: &[u8], xq: &[BlockQ8A]) -> f32 {
        match dtype {
            GgmlType::Q4_K => scalar::dot_q4_k(blocks(w), xq),
            GgmlType::Q5_K => scalar::dot_q5_k(blocks(w), xq),
            _ => scalar::dot_q6_k(blocks(w), xq),
        }
    }

    /// Random weight rows, quantized by quire's quantizer and also made of random bytes (every
    /// code and scale pattern, including the largest 6-bit scales and mins): the kernel in use
    /// (AVX2 here when present) equals the scalar reference bit for bit, and both match an f64 dot
    /// of the dequantized weights with the dequantized activations (the min term with the stored
    /// block sum `s`, as the kernels use it).
    #[test]
    fn kernels_match_scalar_bits_and_dequantized_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(17);
        for dtype in KQUANTS {
            for (case, nsuper) in [1usize, 3, 6, 8].into_iter().enumerate() {
                let n = nsuper * QK_K;
                let mut wq = Vec::new();
                if case % 2 == 0 {
                    quire_gguf::quantize_row(dtype, &rand_vec(&mut rng, n, 1.0), &mut wq).unwrap();
                } else {
                    let ts = dtype.type_size();
                    for _ in 0..nsuper {
                        let mut b: Vec<u8> = (0..ts).map(|_| rng.random()).collect();
                        let d = half::f16::from_f32(rng.random_range(-0.01f32..0.01));
                        let at = if dtype == GgmlType::Q6_K { ts - 2 } else { 0 };
                        b[at..at + 2].copy_from_slice(&d.to_bits().to_le_bytes());
                        if dtype != GgmlType::Q6_K {
                            let m = half::f16::from_f32(rng.random_range(0f32..0.01));
                            b[2..4].copy_from_slice(&m.to_bits().to_le_bytes());
                        }
                        wq.extend(b);
                    }
                }
                let mut wd = vec![0f32; n];
                quire_gguf::dequantize_row(dtype, &wq, &mut wd).unwrap();
                let x = rand_vec(&mut rng, n, 3.0);
                let mut xq = vec![BlockQ8A::default(); n / QK];
                quantize_row_q8a(&x, &mut xq);

                let got = dot_row(dtype, &wq, &xq);
                let sc = scalar_dot(dtype, &wq, &xq);
                assert_eq!(
                    got.to_bits(),
                    sc.to_bits(),
                    "{dtype} n={n}: {got} vs scalar {sc}"
                );

                let xd: Vec<f64> = xq
                    .iter()
                    .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
                    .collect();
                let mut want: f64 = wd.iter().zip(&xd).map(|(&a, &b)| a as f64 * b).sum();
                if dtype != GgmlType::Q6_K {
                    // The min term uses `s` as stored (f16-rounded d·Σq), as the kernels do.
                    for (sb, wb) in wq.chunks_exact(dtype.type_size()).enumerate() {
                        let dmin = half::f16::from_le_bytes([wb[2], wb[3]]).to_f32() as f64;
                        let scales: &[u8; 12] = wb[4..16].try_into().unwrap();
                        for j in 0..SUB {
                            let ab = &xq[sb * SUB + j];
                            let m = scale_min_k4(j, scales).1 as f64;
                            let sum: i32 = ab.qs.iter().map(|&q| q as i32).sum();
                            want -= dmin * m * (ab.s as f64 - ab.d as f64 * sum as f64);
                        }
                    }
                }
                let scale: f64 = wd
                    .iter()
                    .zip(&xd)
                    .map(|(&a, &b)| (a as f64 * b).abs())
                    .sum();
                assert!(
                    (got as f64 - want).abs() <= 1e-5 * scale.max(1e-3),
                    "{dtype} n={n}: got {got}, want {want} (scale {scale})"
                );
            }
        }
    }

    /// A whole matmul (`[rows, cols]` K-quant weights, odd row and token counts, several threads)
    /// against f64 dots of the dequantized weights with the f32 activations: the error is that of
    /// 8-bit activations only.
    #[test]
    fn matmul_with_odd_rows_matches_dequantized_f64() {
        use super::super::matmul::{matmul, Activations, QMatrix};
        use crate::{HostTensor, TensorBytes};
        let mut rng = rand::rngs::StdRng::seed_from_u64(23);
        let team = super::super::team::Team::new(3);
        for dtype in KQUANTS {
            let (rows, cols, n) = (37usize, 3 * QK_K, 5usize);
            let wf = rand_vec(&mut rng, rows * cols, 0.5);
            let mut bytes = Vec::new();
            quire_gguf::quantize_row(dtype, &wf, &mut bytes).unwrap();
            let mut wd = vec![0f32; rows * cols];
            quire_gguf::dequantize_row(dtype, &bytes, &mut wd).unwrap();
            let t = HostTensor {
                name: "w".into(),
                dtype,
                dims: vec![cols, rows],
                bytes: TensorBytes::owned(bytes),
            };
            let w = QMatrix::from_tensor(&t, cols, rows).unwrap();
            let x = rand_vec(&mut rng, n * cols, 2.0);
            let mut act = Activations::default();
            act.prepare(&team, &x, cols, dtype);
            let mut out = vec![f32::NAN; n * rows];
            matmul(&team, &w, &x, &act, &mut out);
            for t in 0..n {
                for r in 0..rows {
                    let (wr, xt) = (&wd[r * cols..][..cols], &x[t * cols..][..cols]);
                    let want: f64 = wr.iter().zip(xt).map(|(&a, &b)| a as f64 * b as f64).sum();
                    let mag: f64 = wr
                        .iter()
                        .zip(xt)
                        .map(|(&a, &b)| (a as f64 * b as f64).abs())
                        .sum();
                    let got = out[t * rows + r] as f64;
                    // 8-bit activations: relative error about 2^-8 of the magnitude.
                    assert!(
                        (got - want).abs() <= 4e-3 * mag,
                        "{dtype} token {t} row {r}: {got} vs {want} (magnitude {mag})"
                    );
                }
            }
        }
    }
}
