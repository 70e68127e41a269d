//! Decode-shaped dot products: four weight rows against one quantized activation row. A decode
//! step is a matrix-vector product, where the one-row kernels of `quant` leave the core waiting on
//! each row's chain of dependent FMAs and redo the activation load and the scale conversions per
//! row. Here four rows advance together (four independent chains, one activation load per block),
//! and the per-block scales are converted with one instruction (`d` and `m` together for Q4_1).
//!
//! Every row's arithmetic is exactly that of the one-row kernel (`quant::dot_row`): the same
//! 8-lane integer partial sums, the same f32 products and FMAs in the same order, the same final
//! horizontal sum. Results are therefore bit-identical to it, and so to llama.cpp's AVX2
//! `ggml_vec_dot_q4_1_q8_1` / `q8_0_q8_0` whose order that kernel reproduces (tested below).

use quire_gguf::{BlockQ4_0, BlockQ4_1, BlockQ8_0, GgmlType};

use super::quant::{dot_row, has_avx2, BlockQ8A};

/// Rows per call of [`dot_rows4`].
pub const ROWS: usize = 4;

/// Whether [`dot_rows4`] has a four-row kernel for `dtype` on this CPU (else it loops over
/// [`dot_row`]).
pub fn has_rows4(dtype: GgmlType) -> bool {
    has_avx2() && matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// `[dot_row(dtype, w[k], x, xq) for k in 0..4]`, bit for bit, faster where [`has_rows4`].
// w: 4 rows of raw `dtype` blocks, equal lengths; x: [cols] f32; xq: [cols / 32] quantized x
pub fn dot_rows4(dtype: GgmlType, w: [&[u8]; ROWS], x: &[f32], xq: &[BlockQ8A]) -> [f32; ROWS] {
    #[cfg(target_arch = "x86_64")]
    if has_rows4(dtype) {
        let nb = w[0].len() / dtype.type_size();
        assert!(
            w.iter().all(|r| r.len() == w[0].len()) && xq.len() >= nb,
            "rows of unequal length or a short activation row"
        );
        // SAFETY: AVX2/FMA/F16C checked at run time; every row holds `nb` whole blocks (checked
        // above: rows have equal lengths, and `blocks` checks whole blocks and alignment) and
        // `xq` at least `nb` blocks.
        unsafe {
            match dtype {
                GgmlType::Q4_0 => return avx2::q4_0(w.map(blocks::<BlockQ4_0>), nb, xq),
                GgmlType::Q4_1 => return avx2::q4_1(w.map(blocks::<BlockQ4_1>), nb, xq),
                GgmlType::Q8_0 => return avx2::q8_0(w.map(blocks::<BlockQ8_0>), nb, xq),
                _ => {}
            }
        }
    }
    w.map(|r| dot_row(dtype, r, x, xq))
}

/// Groups of [`ROWS`] rows that a decode's matrix-vector product asks the memory for ahead of the
/// one it computes: the hardware prefetcher alone leaves a single thread well short of the memory
/// bandwidth on this kind of machine (`examples/matvec_bench.rs`: 5.2 → 10.6 GB/s, streamed).
pub const PREFETCH_GROUPS: usize = 2;

/// Asks for every cache line of `bytes` to be loaded (a hint: no effect on results).
#[inline]
pub fn prefetch(bytes: &[u8]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let mut off = 0;
        while off < bytes.len() {
            // SAFETY: a prefetch never faults, and the address is inside `bytes` anyway.
            unsafe { _mm_prefetch(bytes.as_ptr().add(off) as *const i8, _MM_HINT_T0) };
            off += 64;
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = bytes;
}

/// Raw bytes as blocks, checking whole blocks and alignment (as `quant`'s reader does).
fn blocks<T>(bytes: &[u8]) -> *const T {
    let size = std::mem::size_of::<T>();
    assert!(bytes.len().is_multiple_of(size), "partial block");
    assert!(
        (bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()),
        "misaligned blocks"
    );
    bytes.as_ptr() as *const T
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// The horizontal sum in `quant::avx2::hsum`'s (and ggml's `hsum_float_8`'s) order.
    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let lo = _mm256_castps256_ps128(v);
        let hi = _mm256_extractf128_ps(v, 1);
        let s = _mm_add_ps(lo, hi);
        let s = _mm_add_ps(s, _mm_movehl_ps(s, s));
        let s = _mm_add_ss(s, _mm_movehdup_ps(s));
        _mm_cvtss_f32(s)
    }

    /// The first four f16 values at `p` as f32 (exact). Blocks start with their f16 scale(s) and
    /// are at least 18 bytes long, so the 8 bytes read stay inside the block.
    #[inline(always)]
    unsafe fn scales(p: *const u8) -> __m128 {
        _mm_cvtph_ps(_mm_loadl_epi64(p as *const __m128i))
    }

    /// 16 bytes of nibbles as 32 u8 in element order (low nibbles, then high): one broadcast load
    /// and a per-lane shift (0 for the low half, 4 for the high half).
    #[inline(always)]
    unsafe fn nibbles(qs: *const u8) -> __m256i {
        let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
        let q = _mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4));
        _mm256_and_si256(q, _mm256_set1_epi8(0x0F))
    }

    /// Sum of u8 × i8 products in 8 i32 lanes (4 consecutive elements each) as f32.
    #[inline(always)]
    unsafe fn dot_u8_i8(w: __m256i, a: __m256i) -> __m256 {
        let p16 = _mm256_maddubs_epi16(w, a);
        _mm256_cvtepi32_ps(_mm256_madd_epi16(p16, _mm256_set1_epi16(1)))
    }

    /// Q4_1: per row `acc = fma(d_w × d_a, p, acc)` and `off += m_w × s_a` per block, then
    /// `hsum(acc) + off` (the order of `quant::avx2::dot_q4_1`).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4_1(w: [*const BlockQ4_1; ROWS], nb: usize, a: &[BlockQ8A]) -> [f32; ROWS] {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        // Lane 1 holds the row's offset sum (lane 0 a by-product, unused).
        let mut off = [_mm_setzero_ps(); ROWS];
        for b in 0..nb {
            let ab = a.get_unchecked(b);
            let aq = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let ads = _mm_setr_ps(ab.d, ab.s, 0.0, 0.0);
            for r in 0..ROWS {
                let wb = w[r].add(b);
                // [d_w × d_a, m_w × s_a]: the same two f32 products as the one-row kernel.
                let prod = _mm_mul_ps(scales(wb as *const u8), ads);
                let p = dot_u8_i8(nibbles((*wb).qs.as_ptr()), aq);
                acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(prod), p, acc[r]);
                off[r] = _mm_add_ps(off[r], prod);
            }
        }
        std::array::from_fn(|r| hsum(acc[r]) + _mm_cvtss_f32(_mm_shuffle_ps(off[r], off[r], 0b01)))
    }

    /// Q4_0: `|q − 8| × (a × sign(q − 8))` per block, as `quant::avx2::dot_q4_0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q4_0(w: [*const BlockQ4_0; ROWS], nb: usize, a: &[BlockQ8A]) -> [f32; ROWS] {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        for b in 0..nb {
            let ab = a.get_unchecked(b);
            let aq = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let ad = _mm_set_ss(ab.d);
            for r in 0..ROWS {
                let wb = w[r].add(b);
                let d = _mm_mul_ss(scales(wb as *const u8), ad);
                let wq = _mm256_sub_epi8(nibbles((*wb).qs.as_ptr()), _mm256_set1_epi8(8));
                let p = dot_u8_i8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq));
                acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(d), p, acc[r]);
            }
        }
        acc.map(|v| hsum(v))
    }

    /// Q8_0: `|w| × (a × sign(w))` per block, as `quant::avx2::dot_q8_0`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn q8_0(w: [*const BlockQ8_0; ROWS], nb: usize, a: &[BlockQ8A]) -> [f32; ROWS] {
        let mut acc = [_mm256_setzero_ps(); ROWS];
        for b in 0..nb {
            let ab = a.get_unchecked(b);
            let aq = _mm256_loadu_si256(ab.qs.as_ptr() as *const __m256i);
            let ad = _mm_set_ss(ab.d);
            for r in 0..ROWS {
                let wb = w[r].add(b);
                let d = _mm_mul_ss(scales(wb as *const u8), ad);
                let wq = _mm256_loadu_si256((*wb).qs.as_ptr() as *const __m256i);
                let p = dot_u8_i8(_mm256_sign_epi8(wq, wq), _mm256_sign_epi8(aq, wq));
                acc[r] = _mm256_fmadd_ps(_mm256_broadcastss_ps(d), p, acc[r]);
            }
        }
        acc.map(|v| hsum(v))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::cpu::quant::{quantize_row_q8a, QK};
    use rand::{Rng, SeedableRng};

    /// Four-row results equal four one-row results bit for bit, for random rows (including
    /// zero rows, large and tiny scales) of several lengths.
    #[test]
    fn four_rows_equal_one_row_kernel_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(21);
        for dtype in [
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q8_0,
            GgmlType::F32,
            GgmlType::F16,
        ] {
            for nblocks in [1usize, 3, 18, 48, 49] {
                let n = nblocks * QK;
                for trial in 0..8 {
                    let scale = [1e-3f32, 1.0, 50.0][trial % 3];
                    let mut w = Vec::new();
                    for r in 0..ROWS {
                        let row: Vec<f32> = (0..n)
                            .map(|_| {
                                if trial == 7 && r == 2 {
                                    0.0
                                } else {
                                    rng.random_range(-scale..scale)
                                }
                            })
                            .collect();
                        quire_gguf::quantize_row(dtype, &row, &mut w).unwrap();
                    }
                    let rb = w.len() / ROWS;
                    let x: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0f32..2.0)).collect();
                    let mut xq = vec![BlockQ8A::default(); nblocks];
                    quantize_row_q8a(&x, &mut xq);
                    let rows: [&[u8]; ROWS] = std::array::from_fn(|r| &w[r * rb..(r + 1) * rb]);
                    let got = dot_rows4(dtype, rows, &x, &xq);
                    for r in 0..ROWS {
                        let want = dot_row(dtype, rows[r], &x, &xq);
                        assert_eq!(
                            got[r].to_bits(),
                            want.to_bits(),
                            "{dtype:?} blocks={nblocks} trial={trial} row={r}: {} vs {want}",
                            got[r]
                        );
                    }
                }
            }
        }
    }
}
