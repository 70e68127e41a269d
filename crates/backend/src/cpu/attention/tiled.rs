//! The tiled f16-accumulator kernel: several query rows (consecutive tokens of one sequence × the
//! query heads of one KV group) against each K/V row, which is converted from f16 once per tile
//! instead of once per token. Every query row goes through exactly the steps of the one-row path
//! (`attend_group_f16_accum`): Q rounded to f16, each score summed in ggml's order and scaled, the
//! running maximum, `expf` of the same arguments, the accumulator scaled and multiply-added with an
//! f16 rounding after each step, and `l = fma(l, ms, vs)`, key after key. Only the interleaving of
//! independent rows changes, so the outputs are bit-identical to the one-row path and do not depend
//! on how a prompt was chunked or batched.
//!
//! Keys are taken in chunks of `CHUNK`: their K and V rows are converted to f32 into a stack
//! buffer, then for each row of the tile the chunk's scores are computed (eight keys at a time,
//! with one transposed horizontal sum whose additions are those of `simd::dot`), the running
//! maximum and the `expf` arguments are scanned, and the accumulator, kept in registers for the
//! whole chunk, absorbs the chunk's V rows. Causality: row `r` sees keys `0..ctx_r`, so in the last
//! chunks of a tile the earlier tokens' rows stop short of the later ones.

#![cfg(target_arch = "x86_64")]

use std::arch::x86_64::*;

use half::f16;
use quire_core::BlockId;

use super::{expf, AttnParams};

/// Query rows (tokens × heads of the group) per tile.
pub(super) const TILE_ROWS: usize = 16;
/// Keys converted per chunk.
const CHUNK: usize = 32;

/// Tokens per tile for a GQA group of `group` heads.
pub(super) fn tile_tokens(group: usize) -> usize {
    (TILE_ROWS / group).max(1)
}

/// Whether the tiled kernel handles this head dim (`attend_tile` is instantiated for it).
pub(super) fn supports(head_dim: usize) -> bool {
    matches!(head_dim, 32 | 64 | 128 | 256) && crate::cpu::quant::has_avx2()
}

/// One tile: `ntok` consecutive query tokens of a sequence (from batch token `t0`) and query heads
/// `g0..g0 + ng` of the group of KV head `kvh`.
pub(super) struct Tile<'a> {
    /// Q of the batch: token `t` at `t * q_stride`, its heads at `0..num_heads * head_dim`.
    pub q: &'a [f32],
    pub q_stride: usize,
    pub t0: usize,
    pub ntok: usize,
    pub g0: usize,
    pub ng: usize,
    /// Keys seen by the first token (`pos + 1`); token `i` sees `ctx0 + i`.
    pub ctx0: usize,
    pub block_table: &'a [BlockId],
    pub kvh: usize,
}

/// Runs one tile; `out` points at the batch's output (token `t` at `t * out_stride`), of which the
/// tile writes its own heads of its own tokens only.
///
/// # Safety
/// `supports(p.head_dim)` must hold, and `out` must be valid for those writes.
pub(super) unsafe fn attend_tile(
    p: &AttnParams,
    t: &Tile,
    k_cache: &[f16],
    v_cache: &[f16],
    out: *mut f32,
    out_stride: usize,
) {
    match p.head_dim {
        32 => tile::<4>(p, t, k_cache, v_cache, out, out_stride),
        64 => tile::<8>(p, t, k_cache, v_cache, out, out_stride),
        128 => tile::<16>(p, t, k_cache, v_cache, out, out_stride),
        256 => tile::<32>(p, t, k_cache, v_cache, out, out_stride),
        d => unreachable!("tiled attention for head_dim {d}"),
    }
}

#[inline(always)]
unsafe fn round16(x: __m256) -> __m256 {
    _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
}

/// `simd::dot`'s four accumulators of one (row, key) pair, folded (0+2)+(1+3).
#[inline(always)]
unsafe fn dot_lanes<const NV: usize>(q: &[__m256; NV], k: &[__m256; NV]) -> __m256 {
    let mut a = [_mm256_setzero_ps(); 4];
    for i in 0..NV / 4 {
        for (j, aj) in a.iter_mut().enumerate() {
            *aj = _mm256_fmadd_ps(q[4 * i + j], k[4 * i + j], *aj);
        }
    }
    _mm256_add_ps(_mm256_add_ps(a[0], a[2]), _mm256_add_ps(a[1], a[3]))
}

/// The horizontal sums of eight folded dot vectors, lane `i` from `r[i]`, with the additions of
/// `simd::dot`: `t = lo + hi`, then `(t0 + t1) + (t2 + t3)`.
#[inline(always)]
unsafe fn hsum8(r: &[__m256; 8]) -> __m256 {
    let pair = |a: __m256, b: __m256| {
        _mm256_add_ps(
            _mm256_permute2f128_ps::<0x20>(a, b),
            _mm256_permute2f128_ps::<0x31>(a, b),
        )
    };
    // Lanes of hadd(hadd(T0, T1), hadd(T2, T3)) come out as [x0, x2, x4, x6, x1, x3, x5, x7] of
    // the pairs' inputs (x0, x1), (x2, x3), ...; pairing (r0, r4), (r1, r5), ... puts r[i] at i.
    let t0 = pair(r[0], r[4]);
    let t1 = pair(r[1], r[5]);
    let t2 = pair(r[2], r[6]);
    let t3 = pair(r[3], r[7]);
    _mm256_hadd_ps(_mm256_hadd_ps(t0, t1), _mm256_hadd_ps(t2, t3))
}

// Rows, keys and lanes index several parallel arrays at once.
#[allow(clippy::needless_range_loop)]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn tile<const NV: usize>(
    p: &AttnParams,
    t: &Tile,
    k_cache: &[f16],
    v_cache: &[f16],
    out: *mut f32,
    out_stride: usize,
) {
    let d = NV * 8;
    debug_assert_eq!(d, p.head_dim);
    let group = p.num_heads / p.num_kv_heads;
    let rows = t.ntok * t.ng;
    assert!((1..=TILE_ROWS).contains(&rows) && t.g0 + t.ng <= group && t.ctx0 >= 1);
    let kv_row = p.num_kv_heads * d;
    let bs = p.block_size;
    let zero = _mm256_setzero_ps();
    let mut q16 = [[zero; NV]; TILE_ROWS];
    let mut acc = [[zero; NV]; TILE_ROWS];
    let mut m = [f32::NEG_INFINITY; TILE_ROWS];
    let mut l = [0f32; TILE_ROWS];
    for r in 0..rows {
        let (tok, g) = (t.t0 + r / t.ng, t.g0 + r % t.ng);
        let src = &t.q[tok * t.q_stride + (t.kvh * group + g) * d..][..d];
        for (v, qv) in q16[r].iter_mut().enumerate() {
            *qv = round16(_mm256_loadu_ps(src.as_ptr().add(8 * v)));
        }
    }
    let mut kbuf = [[zero; NV]; CHUNK];
    let mut vbuf = [[zero; NV]; CHUNK];
    let ctx_max = t.ctx0 + t.ntok - 1;
    let scale = _mm256_set1_ps(p.scale);
    let fast_exp = expf::usable();
    let mut c = 0;
    while c < ctx_max {
        let n = CHUNK.min(ctx_max - c);
        for j in 0..n {
            let pos = c + j;
            let slot = quire_core::slot(t.block_table, pos, bs);
            let row = slot * kv_row + t.kvh * d;
            let (k, v) = (&k_cache[row..row + d], &v_cache[row..row + d]);
            for i in 0..NV {
                kbuf[j][i] = _mm256_cvtph_ps(_mm_loadu_si128(k.as_ptr().add(8 * i).cast()));
                vbuf[j][i] = _mm256_cvtph_ps(_mm_loadu_si128(v.as_ptr().add(8 * i).cast()));
            }
        }
        // Per row: the chunk's scores, the running maximum and the expf of each step.
        let mut e = [[0f32; CHUNK]; TILE_ROWS];
        let mut new_max = [[false; CHUNK]; TILE_ROWS];
        let mut nrs = [0usize; TILE_ROWS];
        for r in 0..rows {
            let ctx = t.ctx0 + r / t.ng;
            if ctx <= c {
                continue;
            }
            let nr = n.min(ctx - c);
            nrs[r] = nr;
            let mut s = [0f32; CHUNK];
            for j0 in (0..nr).step_by(8) {
                let mut lanes = [zero; 8];
                for (j, lane) in lanes.iter_mut().enumerate().take(nr - j0) {
                    *lane = dot_lanes(&q16[r], &kbuf[j0 + j]);
                }
                let sc = _mm256_mul_ps(hsum8(&lanes), scale);
                _mm256_storeu_ps(s.as_mut_ptr().add(j0), sc);
            }
            // The expf arguments of the one-row path, then the expf of all of them.
            let mut mr = m[r];
            let mut arg = [0f32; CHUNK];
            for j in 0..nr {
                let sj = s[j];
                if sj > mr {
                    arg[j] = mr - sj;
                    new_max[r][j] = true;
                    mr = sj;
                } else {
                    arg[j] = sj - mr;
                }
            }
            m[r] = mr;
            if fast_exp {
                for j0 in (0..nr).step_by(8) {
                    let x = _mm256_loadu_ps(arg.as_ptr().add(j0));
                    _mm256_storeu_ps(e[r].as_mut_ptr().add(j0), expf::exp8(x));
                }
            } else {
                for j in 0..nr {
                    e[r][j] = arg[j].exp();
                }
            }
        }
        // The accumulators absorb the chunk's V rows, two rows at a time where they can.
        let mut r = 0;
        while r < rows {
            let nr = nrs[r];
            if r + 1 < rows && nrs[r + 1] == nr {
                absorb2(
                    &mut acc[r..r + 2],
                    &mut l[r..r + 2],
                    [&e[r][..nr], &e[r + 1][..nr]],
                    [&new_max[r][..nr], &new_max[r + 1][..nr]],
                    &vbuf,
                );
                r += 2;
            } else {
                absorb(
                    &mut acc[r],
                    &mut l[r],
                    &e[r][..nr],
                    &new_max[r][..nr],
                    &vbuf,
                );
                r += 1;
            }
        }
        c += n;
    }
    for r in 0..rows {
        let (tok, g) = (t.t0 + r / t.ng, t.g0 + r % t.ng);
        let inv = _mm256_set1_ps(if l[r] == 0.0 { 0.0 } else { 1.0 / l[r] });
        let dst = out.add(tok * out_stride + (t.kvh * group + g) * d);
        for (v, &av) in acc[r].iter().enumerate() {
            _mm256_storeu_ps(dst.add(8 * v), _mm256_mul_ps(av, inv));
        }
    }
}

/// One row's accumulator and sum over a chunk's V rows: `acc = f16(acc * ms)` when the maximum
/// moved, then `acc = f16(v * vs + acc)` and `l = fma(l, ms, vs)`, as `attend_group_f16_accum`.
#[inline(always)]
unsafe fn absorb<const NV: usize>(
    acc: &mut [__m256; NV],
    l: &mut f32,
    e: &[f32],
    new_max: &[bool],
    vbuf: &[[__m256; NV]; CHUNK],
) {
    let one = _mm256_set1_ps(1.0);
    let mut a = *acc;
    let mut lr = *l;
    for (j, (&ej, &nm)) in e.iter().zip(new_max).enumerate() {
        let (ms, vs) = if nm { (ej, 1.0) } else { (1.0, ej) };
        if nm {
            let ev = _mm256_set1_ps(ms);
            for av in a.iter_mut() {
                *av = round16(_mm256_mul_ps(*av, ev));
            }
        }
        let vv = if nm { one } else { _mm256_set1_ps(vs) };
        for (av, &v) in a.iter_mut().zip(&vbuf[j]) {
            *av = round16(_mm256_fmadd_ps(v, vv, *av));
        }
        lr = lr.mul_add(ms, vs);
    }
    *acc = a;
    *l = lr;
}

/// `absorb` for two rows with the same keys, interleaved (two independent chains).
#[inline(always)]
unsafe fn absorb2<const NV: usize>(
    acc: &mut [[__m256; NV]],
    l: &mut [f32],
    e: [&[f32]; 2],
    new_max: [&[bool]; 2],
    vbuf: &[[__m256; NV]; CHUNK],
) {
    let mut a = [acc[0], acc[1]];
    let mut lr = [l[0], l[1]];
    for (j, v) in vbuf.iter().enumerate().take(e[0].len()) {
        for x in 0..2 {
            let (ej, nm) = (e[x][j], new_max[x][j]);
            let (ms, vs) = if nm { (ej, 1.0) } else { (1.0, ej) };
            if nm {
                let ev = _mm256_set1_ps(ms);
                for av in a[x].iter_mut() {
                    *av = round16(_mm256_mul_ps(*av, ev));
                }
            }
            let vv = _mm256_set1_ps(vs);
            for (av, &vj) in a[x].iter_mut().zip(v) {
                *av = round16(_mm256_fmadd_ps(vj, vv, *av));
            }
            lr[x] = lr[x].mul_add(ms, vs);
        }
    }
    acc[0] = a[0];
    acc[1] = a[1];
    l[0] = lr[0];
    l[1] = lr[1];
}
