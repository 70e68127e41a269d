//! Quantized dot products. Activations are quantized to 8 bits per block of 32 (scale `d`, and `s =
//! d * sum(q)` so that weight offsets fold in), as llama.cpp does for Q4_x/Q8_0 weights: the inner loop
//! is then integer multiply-adds, which is both faster and numerically what the reference engine does.
//! Every kernel has a scalar version (the reference, used where AVX2 is missing and by the parity
//! tests) and an AVX2 version chosen at run time.

use half::f16;
use quire_gguf::{BlockQ4_0, BlockQ4_1, BlockQ8_0, GgmlType};

pub const QK: usize = 32;

/// One block of 32 quantized activations.
#[derive(Debug, Clone, Copy)]
#[repr(C)]
pub struct BlockQ8A {
    pub d: f32,
    /// `d * sum(qs)`.
    pub s: f32,
    pub qs: [i8; QK],
}

impl Default for BlockQ8A {
    fn default() -> Self {
        Self {
            d: 0.0,
            s: 0.0,
            qs: [0; QK],
        }
    }
}

/// Quantizes one activation row (`x.len()` a multiple of 32) into `out`: AVX2 where it runs,
/// the scalar reference otherwise (both give the same bits).
pub fn quantize_row_q8a(x: &[f32], out: &mut [BlockQ8A]) {
    debug_assert_eq!(x.len(), out.len() * QK);
    #[cfg(target_arch = "x86_64")]
    if has_avx2() {
        // SAFETY: the CPU has AVX2/FMA/F16C; lengths as asserted.
        unsafe { avx2::quantize_row_q8a(x, out) };
        return;
    }
    quantize_row_q8a_scalar(x, out)
}

/// The scalar reference of [`quantize_row_q8a`]: per block, `d = amax / 127`, `q = round(x × 127 /
/// amax)` (ties to even), scales kept at f16 precision as ggml's Q8_0/Q8_1 do.
pub fn quantize_row_q8a_scalar(x: &[f32], out: &mut [BlockQ8A]) {
    for (blk, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
        let amax = xs.iter().fold(0f32, |m, v| m.max(v.abs()));
        let d = amax / 127.0;
        let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
        let mut sum = 0i32;
        for (q, &v) in blk.qs.iter_mut().zip(xs) {
            let r = (v * id).round_ties_even() as i32;
            *q = r.clamp(-127, 127) as i8;
            sum += *q as i32;
        }
        // Scales are kept at f16 precision, as ggml's Q8_0/Q8_1 blocks store them: the products
        // then round the way the reference engine's do.
        blk.d = f16::from_f32(d).to_f32();
        blk.s = f16::from_f32(d * sum as f32).to_f32();
    }
}

/// Scalar reference dot products of one weight row (raw ggml blocks) with quantized activations.
pub mod scalar {
    use super::*;

    pub fn dot_q4_0(w: &[BlockQ4_0], a: &[BlockQ8A]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let mut isum = 0i32;
            for j in 0..16 {
                let lo = (wb.qs[j] & 0x0F) as i32 - 8;
                let hi = (wb.qs[j] >> 4) as i32 - 8;
                isum += lo * ab.qs[j] as i32 + hi * ab.qs[j + 16] as i32;
            }
            // Exact integer sum of (q - 8) * a, as ggml's Q4_0 × Q8_0 dot.
            acc += wb.d.to_f32() * ab.d * isum as f32;
        }
        acc
    }

    pub fn dot_q4_1(w: &[BlockQ4_1], a: &[BlockQ8A]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let mut isum = 0i32;
            for j in 0..16 {
                let lo = (wb.qs[j] & 0x0F) as i32;
                let hi = (wb.qs[j] >> 4) as i32;
                isum += lo * ab.qs[j] as i32 + hi * ab.qs[j + 16] as i32;
            }
            acc += wb.d.to_f32() * ab.d * isum as f32 + wb.m.to_f32() * ab.s;
        }
        acc
    }

    pub fn dot_q8_0(w: &[BlockQ8_0], a: &[BlockQ8A]) -> f32 {
        let mut acc = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let isum: i32 = wb
                .qs
                .iter()
                .zip(&ab.qs)
                .map(|(&x, &y)| x as i32 * y as i32)
                .sum();
            acc += wb.d.to_f32() * ab.d * isum as f32;
        }
        acc
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// Eight-lane quantization of [`super::quantize_row_q8a_scalar`]: the same max, the same
    /// product `x × id` rounded to nearest-even, the same integer sum.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn quantize_row_q8a(x: &[f32], out: &mut [BlockQ8A]) {
        let abs_mask = _mm256_castsi256_ps(_mm256_set1_epi32(0x7FFF_FFFF));
        for (blk, xs) in out.iter_mut().zip(x.chunks_exact(QK)) {
            let p = xs.as_ptr();
            let v = [0, 8, 16, 24].map(|o| _mm256_loadu_ps(p.add(o)));
            let a = v.map(|v| _mm256_and_ps(v, abs_mask));
            let m = _mm256_max_ps(_mm256_max_ps(a[0], a[1]), _mm256_max_ps(a[2], a[3]));
            let m = _mm_max_ps(_mm256_castps256_ps128(m), _mm256_extractf128_ps(m, 1));
            let m = _mm_max_ps(m, _mm_movehl_ps(m, m));
            let amax = _mm_cvtss_f32(_mm_max_ss(m, _mm_movehdup_ps(m)));
            let d = amax / 127.0;
            let id = if amax != 0.0 { 127.0 / amax } else { 0.0 };
            let mul = _mm256_set1_ps(id);
            let i = v.map(|v| {
                _mm256_cvtps_epi32(_mm256_round_ps(
                    _mm256_mul_ps(v, mul),
                    _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC,
                ))
            });
            let s = _mm256_add_epi32(_mm256_add_epi32(i[0], i[1]), _mm256_add_epi32(i[2], i[3]));
            let s = _mm_add_epi32(_mm256_castsi256_si128(s), _mm256_extracti128_si256(s, 1));
            let s = _mm_add_epi32(s, _mm_shuffle_epi32(s, 0b01_00_11_10));
            let sum = _mm_cvtsi128_si32(_mm_add_epi32(s, _mm_shuffle_epi32(s, 0b10_11_00_01)));
            // Packing works within 128-bit lanes; the permute restores element order.
            let w = _mm256_packs_epi32(i[0], i[1]);
            let z = _mm256_packs_epi32(i[2], i[3]);
            let b = _mm256_packs_epi16(w, z);
            let b = _mm256_permutevar8x32_epi32(b, _mm256_setr_epi32(0, 4, 1, 5, 2, 6, 3, 7));
            _mm256_storeu_si256(blk.qs.as_mut_ptr() as *mut __m256i, b);
            blk.d = f16::from_f32(d).to_f32();
            blk.s = f16::from_f32(d * sum as f32).to_f32();
        }
    }

    /// f16 → f32 with the F16C instruction (exact). `half`'s `to_f32` asks for the CPU feature
    /// at every call, which a kernel doing it twice per 32 weights can feel.
    #[inline(always)]
    unsafe fn h2f(x: half::f16) -> f32 {
        _mm_cvtss_f32(_mm_cvtph_ps(_mm_cvtsi32_si128(x.to_bits() as i32)))
    }

    /// Unpacks 16 bytes of nibbles to 32 u8 in element order (low nibbles first).
    #[inline(always)]
    unsafe fn unpack_nibbles(qs: *const u8) -> __m256i {
        let q = _mm_loadu_si128(qs as *const __m128i);
        let m = _mm_set1_epi8(0x0F);
        let lo = _mm_and_si128(q, m);
        let hi = _mm_and_si128(_mm_srli_epi16(q, 4), m);
        _mm256_set_m128i(hi, lo)
    }

    /// Sum of u8 × i8 products as 8 i32 lanes turned to f32.
    #[inline(always)]
    unsafe fn dot_u8_i8(w: __m256i, a: __m256i) -> __m256 {
        let p16 = _mm256_maddubs_epi16(w, a);
        let p32 = _mm256_madd_epi16(p16, _mm256_set1_epi16(1));
        _mm256_cvtepi32_ps(p32)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0(w: &[BlockQ4_0], a: &[BlockQ8A]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (wb, ab) in w.iter().zip(a) {
            // q - 8 in -8..7, then |q - 8| × (a × sign(q - 8)): exact integer sums.
            let wq = _mm256_sub_epi8(unpack_nibbles(wb.qs.as_ptr()), _mm256_set1_epi8(8));
            let aq = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let p = dot_u8_i8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(wb.d) * ab.d), p, acc);
        }
        hsum(acc)
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1(w: &[BlockQ4_1], a: &[BlockQ8A]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        let mut off = 0f32;
        for (wb, ab) in w.iter().zip(a) {
            let p = dot_u8_i8(
                unpack_nibbles(wb.qs.as_ptr()),
                _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i),
            );
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(wb.d) * ab.d), p, acc);
            off += h2f(wb.m) * ab.s;
        }
        hsum(acc) + off
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0(w: &[BlockQ8_0], a: &[BlockQ8A]) -> f32 {
        let mut acc = _mm256_setzero_ps();
        for (wb, ab) in w.iter().zip(a) {
            let wq = _mm256_loadu_si256(wb.qs.as_ptr() as *const __m256i);
            let aq = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            // |w| * (a * sign(w)) keeps maddubs' first operand unsigned.
            let p = dot_u8_i8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq));
            acc = _mm256_fmadd_ps(_mm256_set1_ps(h2f(wb.d) * ab.d), p, acc);
        }
        hsum(acc)
    }

    /// One weight row against four activation rows: the weights are unpacked once per block, and
    /// each of the four sums runs in exactly the order of `dot_q4_0` (so results are identical).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_0_x4(w: &[BlockQ4_0], a: [&[BlockQ8A]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (b, wb) in w.iter().enumerate() {
            let wq = _mm256_sub_epi8(unpack_nibbles(wb.qs.as_ptr()), _mm256_set1_epi8(8));
            let wabs = _mm256_sign_epi8(wq, wq);
            let dw = h2f(wb.d);
            for k in 0..4 {
                let ab = a[k].get_unchecked(b);
                let aq = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                let p = dot_u8_i8(wabs, _mm256_sign_epi8(aq, wq));
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab.d), p, acc[k]);
            }
        }
        [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
    }

    /// As `dot_q4_0_x4`, for Q4_1 (same order as `dot_q4_1`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q4_1_x4(w: &[BlockQ4_1], a: [&[BlockQ8A]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        let mut off = [0f32; 4];
        for (b, wb) in w.iter().enumerate() {
            let wq = unpack_nibbles(wb.qs.as_ptr());
            let (dw, mw) = (h2f(wb.d), h2f(wb.m));
            for k in 0..4 {
                let ab = a[k].get_unchecked(b);
                let p = dot_u8_i8(wq, _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i));
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab.d), p, acc[k]);
                off[k] += mw * ab.s;
            }
        }
        [
            hsum(acc[0]) + off[0],
            hsum(acc[1]) + off[1],
            hsum(acc[2]) + off[2],
            hsum(acc[3]) + off[3],
        ]
    }

    /// As `dot_q4_0_x4`, for Q8_0 (same order as `dot_q8_0`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_q8_0_x4(w: &[BlockQ8_0], a: [&[BlockQ8A]; 4]) -> [f32; 4] {
        let mut acc = [_mm256_setzero_ps(); 4];
        for (b, wb) in w.iter().enumerate() {
            let wq = _mm256_loadu_si256(wb.qs.as_ptr() as *const __m256i);
            let wabs = _mm256_sign_epi8(wq, wq);
            let dw = h2f(wb.d);
            for k in 0..4 {
                let ab = a[k].get_unchecked(b);
                let aq = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
                let p = dot_u8_i8(wabs, _mm256_sign_epi8(aq, wq));
                acc[k] = _mm256_fmadd_ps(_mm256_set1_ps(dw * ab.d), p, acc[k]);
            }
        }
        [hsum(acc[0]), hsum(acc[1]), hsum(acc[2]), hsum(acc[3])]
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f32(w: &[f32], x: &[f32]) -> f32 {
        let n = w.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < n {
            acc = _mm256_fmadd_ps(
                _mm256_loadu_ps(w.as_ptr().add(i)),
                _mm256_loadu_ps(x.as_ptr().add(i)),
                acc,
            );
            i += 8;
        }
        let mut s = hsum(acc);
        for j in n..w.len() {
            s += w[j] * x[j];
        }
        s
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot_f16(w: &[f16], x: &[f32]) -> f32 {
        let n = w.len() / 8 * 8;
        let mut acc = _mm256_setzero_ps();
        let mut i = 0;
        while i < n {
            let h = _mm_loadu_si128(w.as_ptr().add(i) as *const __m128i);
            acc = _mm256_fmadd_ps(_mm256_cvtph_ps(h), _mm256_loadu_ps(x.as_ptr().add(i)), acc);
            i += 8;
        }
        let mut s = hsum(acc);
        for j in n..w.len() {
            s += w[j].to_f32() * x[j];
        }
        s
    }
}

/// True when the AVX2 kernels can run on this CPU (checked once).
pub fn has_avx2() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            std::env::var_os("QUIRE_NO_SIMD").is_none()
                && is_x86_feature_detected!("avx2")
                && is_x86_feature_detected!("fma")
                && is_x86_feature_detected!("f16c")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// Reinterprets raw ggml blocks. The caller has checked the length is a whole number of blocks;
/// block structs have alignment 2 and GGUF data is 32-aligned, owned buffers come from `Vec<u8>`
/// copies made aligned by `AlignedBytes`.
fn blocks<T>(bytes: &[u8]) -> &[T] {
    let size = std::mem::size_of::<T>();
    assert!(bytes.len().is_multiple_of(size), "partial block");
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()),
        "misaligned blocks"
    );
    // SAFETY: length and alignment checked above; the block types are plain old data.
    unsafe { std::slice::from_raw_parts(bytes.as_ptr() as *const T, bytes.len() / size) }
}

/// Dot product of one weight row (raw bytes of `dtype`) with an activation row, which is given both
/// as f32 (for float weights) and quantized (for quantized weights).
#[inline]
/// Whether `dot_row_x4` has a kernel for `dtype` on this CPU.
pub fn has_x4(dtype: GgmlType) -> bool {
    has_avx2() && matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// Four dot products of one quantized weight row with four activation rows, identical to four
/// `dot_row` calls; `None` where there is no four-way kernel (float weights, no AVX2).
pub fn dot_row_x4(dtype: GgmlType, w: &[u8], xq: [&[BlockQ8A]; 4]) -> Option<[f32; 4]> {
    if !has_avx2() {
        return None;
    }
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2/FMA/F16C presence checked at run time; every xq row has a block per weight block.
    unsafe {
        let nb = w.len() / dtype.type_size();
        assert!(xq.iter().all(|r| r.len() >= nb));
        match dtype {
            GgmlType::Q4_0 => return Some(avx2::dot_q4_0_x4(blocks(w), xq)),
            GgmlType::Q4_1 => return Some(avx2::dot_q4_1_x4(blocks(w), xq)),
            GgmlType::Q8_0 => return Some(avx2::dot_q8_0_x4(blocks(w), xq)),
            _ => {}
        }
    }
    None
}

pub fn dot_row(dtype: GgmlType, w: &[u8], x: &[f32], xq: &[BlockQ8A]) -> f32 {
    let simd = has_avx2();
    match dtype {
        GgmlType::Q4_0 => {
            let w = blocks::<BlockQ4_0>(w);
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: AVX2/FMA/F16C presence checked at run time.
                return unsafe { avx2::dot_q4_0(w, xq) };
            }
            scalar::dot_q4_0(w, xq)
        }
        GgmlType::Q4_1 => {
            let w = blocks::<BlockQ4_1>(w);
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: as above.
                return unsafe { avx2::dot_q4_1(w, xq) };
            }
            scalar::dot_q4_1(w, xq)
        }
        GgmlType::Q8_0 => {
            let w = blocks::<BlockQ8_0>(w);
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: as above.
                return unsafe { avx2::dot_q8_0(w, xq) };
            }
            scalar::dot_q8_0(w, xq)
        }
        GgmlType::F32 => {
            let w = blocks::<f32>(w);
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: as above.
                return unsafe { avx2::dot_f32(w, x) };
            }
            w.iter().zip(x).map(|(a, b)| a * b).sum()
        }
        GgmlType::F16 => {
            let w = blocks::<f16>(w);
            #[cfg(target_arch = "x86_64")]
            if simd {
                // SAFETY: as above.
                return unsafe { avx2::dot_f16(w, x) };
            }
            w.iter().zip(x).map(|(a, b)| a.to_f32() * b).sum()
        }
        GgmlType::BF16 => {
            let w = blocks::<half::bf16>(w);
            w.iter().zip(x).map(|(a, b)| a.to_f32() * b).sum()
        }
        GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => super::kquant::dot_row(dtype, w, xq),
        other => unreachable!("matmul weight type {} rejected at load", other.name()),
    }
}

/// Whether activations must be quantized for this weight type.
pub fn needs_q8(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
        || super::kquant::is_kquant(dtype)
}

pub fn supported_matmul_type(dtype: GgmlType) -> bool {
    matches!(
        dtype,
        GgmlType::Q4_0
            | GgmlType::Q4_1
            | GgmlType::Q8_0
            | GgmlType::F32
            | GgmlType::F16
            | GgmlType::BF16
    ) || super::kquant::is_kquant(dtype)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::{Rng, SeedableRng};

    fn rand_vec(rng: &mut rand::rngs::StdRng, n: usize) -> Vec<f32> {
        (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect()
    }

    /// SIMD kernels against the scalar reference, and both against an f64 dot of the dequantized
    /// weights with the dequantized activations.
    #[test]
    fn simd_matches_scalar_and_dequantized_reference() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(7);
        for dtype in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::F32,
            GgmlType::F16,
            GgmlType::BF16,
        ] {
            for nblocks in [1usize, 3, 18, 48] {
                let n = nblocks * QK;
                let wf = rand_vec(&mut rng, n);
                let x = rand_vec(&mut rng, n);
                let mut wq = Vec::new();
                quire_gguf::quantize_row(dtype, &wf, &mut wq).unwrap();
                let mut wd = vec![0f32; n];
                quire_gguf::dequantize_row(dtype, &wq, &mut wd).unwrap();
                let mut xq = vec![BlockQ8A::default(); nblocks];
                quantize_row_q8a(&x, &mut xq);
                let xd: Vec<f64> = if needs_q8(dtype) {
                    xq.iter()
                        .flat_map(|b| b.qs.iter().map(move |&q| b.d as f64 * q as f64))
                        .collect()
                } else {
                    x.iter().map(|&v| v as f64).collect()
                };
                let mut want: f64 = wd.iter().zip(&xd).map(|(&a, &b)| a as f64 * b).sum();
                if dtype == GgmlType::Q4_1 {
                    // Q4_1's offset uses the block sum `s` as stored (rounded to f16), as ggml does.
                    for (wb, ab) in blocks::<BlockQ4_1>(&wq).iter().zip(&xq) {
                        let sum: i32 = ab.qs.iter().map(|&q| q as i32).sum();
                        want += wb.m.to_f32() as f64 * (ab.s as f64 - ab.d as f64 * sum as f64);
                    }
                }
                let got = dot_row(dtype, &wq, &x, &xq) as f64;
                let scale: f64 = wd
                    .iter()
                    .zip(&xd)
                    .map(|(&a, &b)| (a as f64 * b).abs())
                    .sum();
                assert!(
                    (got - want).abs() <= 1e-5 * scale.max(1.0),
                    "{dtype:?} n={n}: got {got}, want {want}"
                );
                let sc = match dtype {
                    GgmlType::Q4_0 => scalar::dot_q4_0(blocks(&wq), &xq) as f64,
                    GgmlType::Q4_1 => scalar::dot_q4_1(blocks(&wq), &xq) as f64,
                    GgmlType::Q8_0 => scalar::dot_q8_0(blocks(&wq), &xq) as f64,
                    _ => want,
                };
                assert!(
                    (got - sc).abs() <= 1e-5 * scale.max(1.0),
                    "{dtype:?} simd vs scalar"
                );
            }
        }
    }

    quire_testkit::simd_test! {
        fn four_way_kernels_equal_single_dots_bit_for_bit() {
            let mut rng = rand::rngs::StdRng::seed_from_u64(11);
            for dtype in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
                for nblocks in [1usize, 5, 18, 48] {
                    let n = nblocks * QK;
                    let mut wq = Vec::new();
                    quire_gguf::quantize_row(dtype, &rand_vec(&mut rng, n), &mut wq).unwrap();
                    let xs: Vec<Vec<BlockQ8A>> = (0..4)
                        .map(|_| {
                            let mut q = vec![BlockQ8A::default(); nblocks];
                            quantize_row_q8a(&rand_vec(&mut rng, n), &mut q);
                            q
                        })
                        .collect();
                    let got = dot_row_x4(dtype, &wq, [&xs[0], &xs[1], &xs[2], &xs[3]])
                        .expect("the four-way kernels run where AVX2 does");
                    for k in 0..4 {
                        let one = dot_row(dtype, &wq, &[], &xs[k]);
                        assert_eq!(got[k].to_bits(), one.to_bits(), "{dtype:?} n={n} k={k}");
                    }
                }
            }
        }
    }

    #[test]
    fn simd_activation_quantization_equals_scalar() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(9);
        for n in [32, 64, 576, 1536] {
            for scale in [1e-3f32, 1.0, 300.0] {
                let mut x: Vec<f32> = rand_vec(&mut rng, n).iter().map(|v| v * scale).collect();
                // A zero block, and exact half-steps that must round to even.
                x[..QK].iter_mut().for_each(|v| *v = 0.0);
                if n > 64 {
                    x[32] = 127.0;
                    x[33] = 0.5;
                    x[34] = -1.5;
                    x[35] = 2.5;
                }
                let nb = n / QK;
                let (mut a, mut b) = (vec![BlockQ8A::default(); nb], vec![BlockQ8A::default(); nb]);
                quantize_row_q8a(&x, &mut a);
                quantize_row_q8a_scalar(&x, &mut b);
                for (i, (a, b)) in a.iter().zip(&b).enumerate() {
                    assert_eq!(a.qs, b.qs, "n={n} block {i}");
                    assert_eq!(a.d.to_bits(), b.d.to_bits(), "n={n} block {i}");
                    assert_eq!(a.s.to_bits(), b.s.to_bits(), "n={n} block {i}");
                }
            }
        }
    }

    #[test]
    fn activation_quantization_error_is_bounded() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        let x = rand_vec(&mut rng, 256);
        let mut q = vec![BlockQ8A::default(); 8];
        quantize_row_q8a(&x, &mut q);
        for (b, xs) in q.iter().zip(x.chunks(QK)) {
            let sum: i32 = b.qs.iter().map(|&v| v as i32).sum();
            assert!((b.s - b.d * sum as f32).abs() <= 1e-3 * b.s.abs().max(1e-3));
            for (&qv, &v) in b.qs.iter().zip(xs) {
                // d is rounded to f16 (relative error 2^-11), so allow for it on 127 steps.
                assert!((qv as f32 * b.d - v).abs() <= b.d * (0.5 + 127.0 / 2048.0) + 1e-7);
            }
        }
        let _ = rng.random::<u8>();
    }
}
