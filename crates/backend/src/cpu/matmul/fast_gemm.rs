//! The prompt (many-token) quantized matrix product of the `fast` arithmetic mode (`CpuMath::Fast`).
//!
//! The exact path computes each (weight row, token) dot product on its own, in llama.cpp's order:
//! per 32-weight block an 8-lane integer sum, its conversion to f32, a scalar product of the two
//! scales, a broadcast and an FMA — about ten instructions per block and product, of which only
//! the multiply-add of the integers is real work. Here a tile of 4 weight rows × 4 tokens is
//! computed together: each unpacked weight block is used against 4 tokens, each activation block
//! against 4 rows, and the 4 tokens' integer sums of one row are folded into one vector (one lane
//! per token) before the single conversion and FMA. The per-token scales are laid out once per
//! product (`TokenScales`), so the inner loop loads them instead of converting and broadcasting.
//!
//! Accumulation is f32 throughout (no f16 rounding of partial sums); the integer part of every
//! block is exact, as in the reference. What differs from the scalar reference (`quant::scalar`)
//! is only the order of the f32 additions and, for Q4_0, that the `-8` offset is applied as
//! `-8 · d_w · (d_a · Σa)` rather than inside the integer sum: per product the difference is a few
//! f32 roundings of the block terms (the bound the tests check is stated there).

use quire_gguf::GgmlType;

use crate::cpu::quant::{has_avx2, BlockQ8A};

/// Tokens per tile (the lanes of the folded sums).
pub const TOKENS: usize = 4;
/// Weight rows per tile.
pub const ROWS: usize = 4;

/// Whether [`gemm_tile`] has a kernel for `dtype` on this CPU.
pub fn has_fast_gemm(dtype: GgmlType) -> bool {
    has_avx2() && matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// Per group of [`TOKENS`] tokens and per block, the activation scales in the lanes the kernel
/// multiplies with: `d[g][b] = [d_a of the 4 tokens]`, and `off[g][b]` the term the weight's
/// offset multiplies (Q4_1: the block's `s`; Q4_0: `d_a · Σa` in f32; Q8_0: zero), in the low
/// four lanes of eight (the high four zero, so the term is added once).
pub struct TokenScales {
    nb: usize,
    d: Vec<[f32; TOKENS]>,
    off: Vec<[f32; 2 * TOKENS]>,
}

impl TokenScales {
    /// Scales of the first `groups * 4` token rows of `xq` (`nb` blocks a row) for `dtype`.
    pub fn new(dtype: GgmlType, xq: &[BlockQ8A], nb: usize, groups: usize) -> Self {
        let mut d = Vec::with_capacity(groups * nb);
        let mut off = Vec::with_capacity(groups * nb);
        for g in 0..groups {
            for b in 0..nb {
                let blk = |t: usize| &xq[(g * TOKENS + t) * nb + b];
                d.push(std::array::from_fn(|t| blk(t).d));
                off.push(std::array::from_fn(|l| {
                    if l >= TOKENS {
                        return 0.0;
                    }
                    let a = blk(l);
                    match dtype {
                        GgmlType::Q4_1 => a.s,
                        GgmlType::Q4_0 => a.d * a.qs.iter().map(|&q| q as i32).sum::<i32>() as f32,
                        _ => 0.0,
                    }
                }));
            }
        }
        Self { nb, d, off }
    }
}

/// `out[t][r] = Σ w[r] · x[4g + t]` for a tile of [`ROWS`] weight rows (raw `dtype` blocks, equal
/// lengths) and token group `g` (`xq`: all token rows, `nb` blocks each). `None` where
/// [`has_fast_gemm`] is false.
pub fn gemm_tile(
    dtype: GgmlType,
    w: [&[u8]; ROWS],
    xq: &[BlockQ8A],
    scales: &TokenScales,
    g: usize,
) -> Option<[[f32; ROWS]; TOKENS]> {
    gemm_tile_n::<ROWS>(dtype, w, xq, scales, g)
}

/// [`gemm_tile`] for one weight row (the rows left over after the 4-row tiles).
pub fn gemm_row(
    dtype: GgmlType,
    w: &[u8],
    xq: &[BlockQ8A],
    scales: &TokenScales,
    g: usize,
) -> Option<[f32; TOKENS]> {
    gemm_tile_n::<1>(dtype, [w], xq, scales, g).map(|v| v.map(|t| t[0]))
}

fn gemm_tile_n<const R: usize>(
    dtype: GgmlType,
    w: [&[u8]; R],
    xq: &[BlockQ8A],
    scales: &TokenScales,
    g: usize,
) -> Option<[[f32; R]; TOKENS]> {
    if !has_fast_gemm(dtype) {
        return None;
    }
    let nb = scales.nb;
    assert!(
        w.iter().all(|r| r.len() == nb * dtype.type_size())
            && xq.len() >= (g + 1) * TOKENS * nb
            && scales.d.len() >= (g + 1) * nb,
        "weight rows, activations and scales disagree in length"
    );
    let a: [&[BlockQ8A]; TOKENS] =
        std::array::from_fn(|t| &xq[(g * TOKENS + t) * nb..(g * TOKENS + t + 1) * nb]);
    let (d, off) = (
        &scales.d[g * nb..(g + 1) * nb],
        &scales.off[g * nb..(g + 1) * nb],
    );
    #[cfg(target_arch = "x86_64")]
    // SAFETY: AVX2/FMA/F16C checked (`has_fast_gemm`); every weight row holds `nb` whole blocks of
    // `dtype` and every token row, `d` and `off` hold `nb` entries (asserted above).
    unsafe {
        let w = w.map(|r| r.as_ptr());
        let r = match dtype {
            GgmlType::Q4_0 => avx2::tile::<R, 0>(w, nb, a, d, off),
            GgmlType::Q4_1 => avx2::tile::<R, 1>(w, nb, a, d, off),
            _ => avx2::tile::<R, 2>(w, nb, a, d, off),
        };
        return Some(r);
    }
    #[allow(unreachable_code)]
    {
        let _ = (a, d, off);
        None
    }
}

/// Bytes of one block of `dtype` before its quants (the f16 scale, and Q4_1's f16 minimum).
#[cfg(target_arch = "x86_64")]
const fn quants_at(kind: u8) -> usize {
    match kind {
        1 => 4,
        _ => 2,
    }
}

#[cfg(target_arch = "x86_64")]
pub(super) mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Block sizes in bytes: Q4_0, Q4_1, Q8_0.
    const BLOCK: [usize; 3] = [18, 20, 34];

    /// 16 bytes of nibbles as 32 u8 in element order (low nibbles, then high).
    #[inline(always)]
    pub(in crate::cpu::matmul) unsafe fn nibbles(qs: *const u8) -> __m256i {
        let q = _mm256_broadcastsi128_si256(_mm_loadu_si128(qs as *const __m128i));
        let q = _mm256_srlv_epi64(q, _mm256_setr_epi64x(0, 0, 4, 4));
        _mm256_and_si256(q, _mm256_set1_epi8(0x0F))
    }

    /// The tile kernel; `KIND` 0 = Q4_0, 1 = Q4_1, 2 = Q8_0. Per block and row: the 4 tokens'
    /// integer sums as 8 i32 lanes each, folded by three horizontal adds into one vector whose
    /// lane `t` (low half) and `4 + t` (high half) hold token t's two half-sums; then one
    /// conversion, `acc += (d_w · d_a) × sums` and `acc += m_w × off` (low half only).
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile<const R: usize, const KIND: u8>(
        w: [*const u8; R],
        nb: usize,
        a: [&[BlockQ8A]; TOKENS],
        d: &[[f32; TOKENS]],
        off: &[[f32; 2 * TOKENS]],
    ) -> [[f32; R]; TOKENS] {
        let bs = BLOCK[KIND as usize];
        let ones = _mm256_set1_epi16(1);
        let mut acc = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let da = _mm256_broadcast_ps(&*(d.get_unchecked(b).as_ptr() as *const __m128));
            let ov = _mm256_loadu_ps(off.get_unchecked(b).as_ptr());
            let aq: [__m256i; TOKENS] = std::array::from_fn(|t| {
                _mm256_loadu_si256(a[t].get_unchecked(b).qs.as_ptr() as *const __m256i)
            });
            for r in 0..R {
                let blk = w[r].add(b * bs);
                // [d_w, m_w] (Q4_1) or [d_w, junk] as f32; the 4 bytes read are inside the block.
                let sc = _mm_cvtph_ps(_mm_cvtsi32_si128((blk as *const i32).read_unaligned()));
                let dw = _mm256_broadcastss_ps(sc);
                let qs = blk.add(quants_at(KIND));
                let p: [__m256i; TOKENS] = if KIND == 2 {
                    let wq = _mm256_loadu_si256(qs as *const __m256i);
                    let wabs = _mm256_sign_epi8(wq, wq);
                    std::array::from_fn(|t| {
                        let s = _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(aq[t], wq));
                        _mm256_madd_epi16(s, ones)
                    })
                } else {
                    let wq = nibbles(qs);
                    std::array::from_fn(|t| {
                        _mm256_madd_epi16(_mm256_maddubs_epi16(wq, aq[t]), ones)
                    })
                };
                let h =
                    _mm256_hadd_epi32(_mm256_hadd_epi32(p[0], p[1]), _mm256_hadd_epi32(p[2], p[3]));
                acc[r] = _mm256_fmadd_ps(_mm256_mul_ps(dw, da), _mm256_cvtepi32_ps(h), acc[r]);
                match KIND {
                    // Q4_1: + m_w · s_a.
                    1 => {
                        let mw = _mm256_broadcastss_ps(_mm_movehdup_ps(sc));
                        acc[r] = _mm256_fmadd_ps(mw, ov, acc[r]);
                    }
                    // Q4_0: the nibbles were taken unsigned; − 8 · d_w · (d_a · Σa).
                    0 => {
                        let m8 = _mm256_mul_ps(dw, _mm256_set1_ps(-8.0));
                        acc[r] = _mm256_fmadd_ps(m8, ov, acc[r]);
                    }
                    _ => {}
                }
            }
        }
        let mut out = [[0f32; R]; TOKENS];
        for r in 0..R {
            let s = _mm_add_ps(
                _mm256_castps256_ps128(acc[r]),
                _mm256_extractf128_ps(acc[r], 1),
            );
            let mut v = [0f32; TOKENS];
            _mm_storeu_ps(v.as_mut_ptr(), s);
            for t in 0..TOKENS {
                out[t][r] = v[t];
            }
        }
        out
    }
}
