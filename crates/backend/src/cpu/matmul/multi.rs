//! The exact product of a few tokens (2 and up: a speculative verify step, batched decode, a
//! prompt) with Q4_0 / Q4_1 / Q8_0 weights, on AVX-512 (with VNNI) or AVX2.
//!
//! The one-token kernels (`quant::dot_row`, llama.cpp's AVX2 order) spend about ten instructions
//! on each 32-weight block and token: unpack, an 8-lane integer sum in two steps, its conversion
//! to f32, a scalar product of the two scales, a broadcast, an FMA, and for Q4_1 a scalar
//! multiply-add of the offset. Only the conversion, the scale product and the FMA belong to the
//! arithmetic llama.cpp defines; the rest is how the integers get there. Here a few weight rows
//! go together with up to 16 tokens, whose quantized activations are first laid out once per
//! product (`Packed`: each token's scale already spread over the 8 lanes it multiplies):
//!
//! - each weight block is unpacked, and its scales converted, once for all the tokens;
//! - AVX-512: two tokens share each 512-bit register (token `2p` in the low half, `2p + 1` in the
//!   high half; 4 rows for up to 8 tokens, else 2, so the accumulators stay in registers), and
//!   `vpdpbusd` forms the 8 integer lanes of both in one instruction (unsigned weights times
//!   signed activations; Q4_0's `− 8` and Q8_0's sign go into an integer start value `−8·Σa` /
//!   `−128·Σa` per lane, since the weights enter as `q` and `w + 128`);
//! - AVX2: one token per 256-bit register, 1 row × up to 8 tokens, the integer sums as the
//!   one-token kernel forms them (`vpmaddubsw`, `vpmaddwd`, the sign trick for Q4_0 and Q8_0);
//! - then the scale product `d_w × d_a`, the conversion and the FMA are one instruction each per
//!   register, and Q4_1's offset `m_w × s_a` one multiply and one add for 8 or 16 tokens.
//!
//! Every integer lane sum is exact and equals the one-token kernel's (the same 4 elements per
//! lane, no saturation: `vpdpbusd` does not saturate), and every f32 operation of every output
//! is the same as in `quant::dot_row`: the same products, the same FMA chain per lane, the same
//! horizontal sum, then `+ off`. So results are bit-identical to the one-token kernel, whatever
//! the batch (tested in crates/backend/tests/cpu_multi_matmul.rs), and `--cpu-math exact` stays
//! llama.cpp's arithmetic.

use quire_gguf::GgmlType;

use crate::cpu::quant::{has_avx2, BlockQ8A, QK};
use crate::cpu::team::{DisjointPtr, Parallel};

/// Tokens per group (8 pairs in 512-bit registers): one pass over the weights serves them all.
pub const TOKENS: usize = 16;

/// Whether this CPU can run the kernel (checked once): AVX-512 F/BW/VNNI plus the AVX2, FMA and
/// F16C the exact kernels need anyway.
pub fn has_avx512_vnni() -> bool {
    #[cfg(target_arch = "x86_64")]
    {
        use std::sync::OnceLock;
        static HAS: OnceLock<bool> = OnceLock::new();
        *HAS.get_or_init(|| {
            has_avx2()
                && is_x86_feature_detected!("avx512f")
                && is_x86_feature_detected!("avx512bw")
                && is_x86_feature_detected!("avx512vnni")
        })
    }
    #[cfg(not(target_arch = "x86_64"))]
    {
        false
    }
}

/// The instruction set of a kernel path. Both compute the same bits (those of `dot_row`).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    /// One token per 256-bit register, `vpmaddubsw` + `vpmaddwd` for the integer sums.
    Avx2,
    /// Two tokens per 512-bit register, `vpdpbusd`.
    Avx512,
}

impl Isa {
    /// The path this CPU runs (checked once): AVX-512 where it has F/BW/VNNI, else AVX2 (with
    /// FMA and F16C); `None` where only the scalar one-token kernels run (or `QUIRE_NO_SIMD`).
    pub fn detect() -> Option<Isa> {
        if has_avx512_vnni() {
            Some(Isa::Avx512)
        } else if has_avx2() {
            Some(Isa::Avx2)
        } else {
            None
        }
    }

    pub fn available(self) -> bool {
        match self {
            Isa::Avx2 => has_avx2(),
            Isa::Avx512 => has_avx512_vnni(),
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }

    /// The fewest tokens for which the path beats the one-token kernels (on AVX2, 2 and 3
    /// tokens go faster through `rows::dot_rows4` per token: `examples/multi_matmul_bench.rs`).
    pub fn min_tokens(self) -> usize {
        match self {
            Isa::Avx2 => 4,
            Isa::Avx512 => 2,
        }
    }

    /// Weight rows per kernel call for a group of `tokens` real tokens (the accumulators, rows ×
    /// token registers, must fit the register file: 32 on AVX-512, 16 on AVX2).
    pub fn rows_for(self, tokens: usize) -> usize {
        match self {
            Isa::Avx512 if tokens <= 8 => 4,
            Isa::Avx512 => 2,
            Isa::Avx2 => 1,
        }
    }
}

/// Whether the multi-token kernels handle `dtype` (on a CPU where [`Isa::detect`] finds one).
pub fn supports(dtype: GgmlType) -> bool {
    matches!(dtype, GgmlType::Q4_0 | GgmlType::Q4_1 | GgmlType::Q8_0)
}

/// The quantized activations of `n` tokens laid out for [`tile`], in groups of [`TOKENS`]
/// (the last group padded with zero tokens, whose results are never stored).
#[derive(Default)]
pub struct Packed {
    pub n: usize,
    nb: usize,
    /// [group][block][pair] 64 bytes: the pair's two tokens' 32 quants, one after the other.
    qs: Vec<[i8; 64]>,
    /// [group][block][pair] 16 lanes: the activation scale `d` of each lane's token.
    d: Vec<[f32; 16]>,
    /// [group][block][token] Q4_1's `s = d · Σq`.
    s: Vec<f32>,
    /// [group][block][pair] the integer start of each of the 16 lanes (Q4_0: `−8·Σ` of the
    /// lane's 4 quants; Q8_0: `−128·Σ`; Q4_1: unused).
    init: Vec<[i32; 16]>,
}

impl Packed {
    /// Lays out `xq` (`n` token rows of `nb` blocks) for weights of `dtype`; the groups of a
    /// long batch are laid out in parallel.
    pub fn pack(
        &mut self,
        par: &dyn Parallel,
        dtype: GgmlType,
        xq: &[BlockQ8A],
        nb: usize,
        n: usize,
    ) {
        let groups = n.div_ceil(TOKENS);
        let pairs = groups * nb * TOKENS / 2;
        self.n = n;
        self.nb = nb;
        // Padding tokens must be zero (their lanes add nothing and their scales are finite).
        self.qs.clear();
        self.qs.resize(pairs, [0; 64]);
        self.d.clear();
        self.d.resize(pairs, [0.0; 16]);
        let offset = match dtype {
            GgmlType::Q4_0 => 8,
            GgmlType::Q8_0 => 128,
            _ => 0,
        };
        self.s.clear();
        self.s.resize(if offset == 0 { 2 * pairs } else { 0 }, 0.0);
        self.init.clear();
        self.init
            .resize(if offset == 0 { 0 } else { pairs }, [0; 16]);
        let (qs, d) = (
            DisjointPtr::new(&mut self.qs),
            DisjointPtr::new(&mut self.d),
        );
        let (s, init) = (
            DisjointPtr::new(&mut self.s),
            DisjointPtr::new(&mut self.init),
        );
        let fill = |g: usize| {
            for t in g * TOKENS..((g + 1) * TOKENS).min(n) {
                for (b, a) in xq[t * nb..(t + 1) * nb].iter().enumerate() {
                    let slot = (g * nb + b) * TOKENS + t % TOKENS;
                    let (pair, half) = (slot / 2, slot % 2);
                    // SAFETY: slot (and its pair's half) belongs to token t of group g, which only
                    // this task fills; every index is below the sizes set above (s only for Q4_1,
                    // init only for Q4_0 / Q8_0).
                    unsafe {
                        let h = 32 * half;
                        (&mut *qs.at(pair))[h..h + 32].copy_from_slice(&a.qs);
                        (&mut *d.at(pair))[8 * half..8 * half + 8].fill(a.d);
                        if offset == 0 {
                            *s.at(slot) = a.s;
                        } else {
                            let dst = &mut *init.at(pair);
                            for (lane, q) in a.qs.chunks_exact(4).enumerate() {
                                let sum: i32 = q.iter().map(|&q| q as i32).sum();
                                dst[8 * half + lane] = -offset * sum;
                            }
                        }
                    }
                }
            }
        };
        // A few groups are quicker on this thread than a parallel section.
        if groups > 4 {
            par.run_tasks(groups, &fill);
        } else {
            (0..groups).for_each(fill);
        }
    }

    pub fn groups(&self) -> usize {
        self.n.div_ceil(TOKENS)
    }

    /// Tokens of group `g` that are real (the rest is padding).
    pub fn tokens_in(&self, g: usize) -> usize {
        (self.n - g * TOKENS).min(TOKENS)
    }
}

/// `out[t][r] = dot_row(dtype, w[r], x_t)` for token group `g` of `act` (its first
/// `act.tokens_in(g)` entries are real), bit for bit, by path `isa`; `R` rows, all with `act`'s
/// block count.
pub fn tile<const R: usize>(
    isa: Isa,
    dtype: GgmlType,
    w: [&[u8]; R],
    act: &Packed,
    g: usize,
) -> [[f32; R]; TOKENS] {
    assert!(
        isa.available() && supports(dtype),
        "no {} multi-token kernel for {dtype:?} here",
        isa.name()
    );
    let nb = act.nb;
    assert!(
        w.iter().all(|r| r.len() == nb * dtype.type_size()) && g < act.groups(),
        "weight rows and packed activations disagree"
    );
    let pairs = act.tokens_in(g).div_ceil(2);
    let base = g * nb * TOKENS / 2;
    let ptrs = Ptrs {
        qs: act.qs[base..].as_ptr() as *const u8,
        d: act.d[base..].as_ptr() as *const f32,
        s: act.s.get(2 * base..).unwrap_or(&[]).as_ptr(),
        init: act.init.get(base..).unwrap_or(&[]).as_ptr() as *const i32,
    };
    #[cfg(target_arch = "x86_64")]
    // SAFETY: the path's CPU features checked (`isa.available()`); every weight row holds `nb`
    // whole blocks of `dtype` (asserted), and the group's packed arrays hold `nb` blocks of
    // TOKENS / 2 pairs from `base` on (`pack` sized them for whole groups; `s` is present for
    // Q4_1 and `init` for Q4_0 / Q8_0, the only ones each kernel reads).
    unsafe {
        let w = w.map(|r| r.as_ptr());
        if isa == Isa::Avx2 {
            return avx2_group::<R>(dtype, w, nb, &ptrs, act.tokens_in(g));
        }
        macro_rules! by_pairs {
            ($kind:literal) => {
                match pairs {
                    1 => avx512::tile::<R, 1, $kind>(w, nb, &ptrs),
                    2 => avx512::tile::<R, 2, $kind>(w, nb, &ptrs),
                    3 => avx512::tile::<R, 3, $kind>(w, nb, &ptrs),
                    4 => avx512::tile::<R, 4, $kind>(w, nb, &ptrs),
                    5 => avx512::tile::<R, 5, $kind>(w, nb, &ptrs),
                    6 => avx512::tile::<R, 6, $kind>(w, nb, &ptrs),
                    7 => avx512::tile::<R, 7, $kind>(w, nb, &ptrs),
                    _ => avx512::tile::<R, 8, $kind>(w, nb, &ptrs),
                }
            };
        }
        match dtype {
            GgmlType::Q4_0 => by_pairs!(0),
            GgmlType::Q4_1 => by_pairs!(1),
            _ => by_pairs!(2),
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    unreachable!("no path is available off x86_64")
}

/// The AVX2 kernel over a group: its tokens 8 at a time.
#[cfg(target_arch = "x86_64")]
#[target_feature(enable = "avx2,fma,f16c")]
unsafe fn avx2_group<const R: usize>(
    dtype: GgmlType,
    w: [*const u8; R],
    nb: usize,
    a: &Ptrs,
    tokens: usize,
) -> [[f32; R]; TOKENS] {
    let mut out = [[0f32; R]; TOKENS];
    for first in (0..tokens).step_by(8) {
        let n = (tokens - first).min(8);
        macro_rules! by_tokens {
            ($kind:literal) => {
                match n {
                    1 => avx2::tile::<R, 1, $kind>(w, nb, a, first, &mut out),
                    2 => avx2::tile::<R, 2, $kind>(w, nb, a, first, &mut out),
                    3 => avx2::tile::<R, 3, $kind>(w, nb, a, first, &mut out),
                    4 => avx2::tile::<R, 4, $kind>(w, nb, a, first, &mut out),
                    5 => avx2::tile::<R, 5, $kind>(w, nb, a, first, &mut out),
                    6 => avx2::tile::<R, 6, $kind>(w, nb, a, first, &mut out),
                    7 => avx2::tile::<R, 7, $kind>(w, nb, a, first, &mut out),
                    _ => avx2::tile::<R, 8, $kind>(w, nb, a, first, &mut out),
                }
            };
        }
        match dtype {
            GgmlType::Q4_0 => by_tokens!(0),
            GgmlType::Q4_1 => by_tokens!(1),
            _ => by_tokens!(2),
        }
    }
    out
}

/// Where a group's packed activations start.
struct Ptrs {
    qs: *const u8,
    d: *const f32,
    s: *const f32,
    init: *const i32,
}

/// `quant::avx2::hsum`'s order over 8 lanes: `((l0+l4)+(l2+l6)) + ((l1+l5)+(l3+l7))`.
#[inline(always)]
fn hsum8(l: [f32; 8]) -> f32 {
    ((l[0] + l[4]) + (l[2] + l[6])) + ((l[1] + l[5]) + (l[3] + l[7]))
}

#[cfg(target_arch = "x86_64")]
mod avx512 {
    use super::*;
    use std::arch::x86_64::*;

    /// Block sizes in bytes: Q4_0, Q4_1, Q8_0; and where their quants start.
    const BLOCK: [usize; 3] = [18, 20, 34];
    const QUANTS: [usize; 3] = [2, 4, 2];

    /// The tile kernel; `KIND` 0 = Q4_0, 1 = Q4_1, 2 = Q8_0; `P` pairs of tokens.
    #[target_feature(enable = "avx512f,avx512bw,avx512vnni,avx2,fma,f16c")]
    pub unsafe fn tile<const R: usize, const P: usize, const KIND: u8>(
        w: [*const u8; R],
        nb: usize,
        a: &Ptrs,
    ) -> [[f32; R]; TOKENS] {
        let (bs, qo) = (BLOCK[KIND as usize], QUANTS[KIND as usize]);
        // Shifts that turn 4 copies of 16 nibble bytes into [low nibbles | high nibbles] twice.
        let shift = _mm512_setr_epi64(0, 0, 4, 4, 0, 0, 4, 4);
        let mut acc = [[_mm512_setzero_ps(); P]; R];
        // Q4_1: lane t is token t's offset sum.
        let mut off = [_mm512_setzero_ps(); R];
        for b in 0..nb {
            let qs = a.qs.add(b * TOKENS * 32);
            let d = a.d.add(b * TOKENS * 8);
            for r in 0..R {
                let blk = w[r].add(b * bs);
                // [d_w, m_w, …] (Q4_1) or [d_w, …] as f32: the 8 bytes read are inside the block
                // (18 bytes or more), and lanes past the scales are never used.
                let sc = _mm_cvtph_ps(_mm_loadl_epi64(blk as *const __m128i));
                let dw = _mm512_broadcastss_ps(sc);
                // The block's 32 quants as u8 in element order, in both halves.
                let q = if KIND == 2 {
                    let q = _mm512_broadcast_i64x4(_mm256_loadu_si256(blk.add(qo) as *const _));
                    _mm512_xor_si512(q, _mm512_set1_epi8(-128))
                } else {
                    let q = _mm512_broadcast_i32x4(_mm_loadu_si128(blk.add(qo) as *const _));
                    _mm512_and_si512(_mm512_srlv_epi64(q, shift), _mm512_set1_epi8(0x0F))
                };
                for (p, acc) in acc[r].iter_mut().enumerate() {
                    let aq = _mm512_loadu_si512(qs.add(p * 64) as *const _);
                    let start = if KIND == 1 {
                        _mm512_setzero_si512()
                    } else {
                        _mm512_loadu_si512(a.init.add((b * TOKENS / 2 + p) * 16) as *const _)
                    };
                    let i = _mm512_dpbusd_epi32(start, q, aq);
                    let scale = _mm512_mul_ps(dw, _mm512_loadu_ps(d.add(p * 16)));
                    *acc = _mm512_fmadd_ps(scale, _mm512_cvtepi32_ps(i), *acc);
                }
                if KIND == 1 {
                    let mw =
                        _mm512_permutexvar_ps(_mm512_set1_epi32(1), _mm512_castps128_ps512(sc));
                    let s = _mm512_loadu_ps(a.s.add(b * TOKENS));
                    off[r] = _mm512_add_ps(off[r], _mm512_mul_ps(mw, s));
                }
            }
        }
        let mut out = [[0f32; R]; TOKENS];
        for r in 0..R {
            let mut o = [0f32; TOKENS];
            _mm512_storeu_ps(o.as_mut_ptr(), off[r]);
            for (p, acc) in acc[r].iter().enumerate() {
                let mut l = [0f32; 16];
                _mm512_storeu_ps(l.as_mut_ptr(), *acc);
                for h in 0..2 {
                    let t = 2 * p + h;
                    let s = hsum8(std::array::from_fn(|i| l[8 * h + i]));
                    out[t][r] = if KIND == 1 { s + o[t] } else { s };
                }
            }
        }
        out
    }
}

#[cfg(target_arch = "x86_64")]
mod avx2 {
    use super::*;
    use std::arch::x86_64::*;

    /// Block sizes in bytes: Q4_0, Q4_1, Q8_0; and where their quants start.
    const BLOCK: [usize; 3] = [18, 20, 34];
    const QUANTS: [usize; 3] = [2, 4, 2];

    use crate::cpu::matmul::fast_gemm::avx2::nibbles;

    /// `T` tokens from slot `first` of the group, one per register; the integer sums as in
    /// `quant::avx2` (Q4_1: `q × a`; Q4_0 and Q8_0: `|w| × (a × sign(w))`, `w = q − 8` for Q4_0).
    /// Writes `out[first + t][r]`.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn tile<const R: usize, const T: usize, const KIND: u8>(
        w: [*const u8; R],
        nb: usize,
        a: &Ptrs,
        first: usize,
        out: &mut [[f32; R]; TOKENS],
    ) {
        let (bs, qo) = (BLOCK[KIND as usize], QUANTS[KIND as usize]);
        let ones = _mm256_set1_epi16(1);
        let mut acc = [[_mm256_setzero_ps(); T]; R];
        // Q4_1: lane t is token first + t's offset sum.
        let mut off = [_mm256_setzero_ps(); R];
        for b in 0..nb {
            let slot = b * TOKENS + first;
            let (qs, d) = (a.qs.add(slot * 32), a.d.add(slot * 8));
            for r in 0..R {
                let blk = w[r].add(b * bs);
                // As in the AVX-512 kernel: 8 bytes inside the block, lanes past the scales unused.
                let sc = _mm_cvtph_ps(_mm_loadl_epi64(blk as *const __m128i));
                let dw = _mm256_broadcastss_ps(sc);
                let wq = match KIND {
                    2 => _mm256_loadu_si256(blk.add(qo) as *const __m256i),
                    0 => _mm256_sub_epi8(nibbles(blk.add(qo)), _mm256_set1_epi8(8)),
                    _ => nibbles(blk.add(qo)),
                };
                let wabs = _mm256_sign_epi8(wq, wq);
                for (t, acc) in acc[r].iter_mut().enumerate() {
                    let aq = _mm256_loadu_si256(qs.add(t * 32) as *const __m256i);
                    let p16 = if KIND == 1 {
                        _mm256_maddubs_epi16(wq, aq)
                    } else {
                        _mm256_maddubs_epi16(wabs, _mm256_sign_epi8(aq, wq))
                    };
                    let i = _mm256_madd_epi16(p16, ones);
                    let scale = _mm256_mul_ps(dw, _mm256_loadu_ps(d.add(t * 8)));
                    *acc = _mm256_fmadd_ps(scale, _mm256_cvtepi32_ps(i), *acc);
                }
                if KIND == 1 {
                    let mw =
                        _mm256_permutevar8x32_ps(_mm256_castps128_ps256(sc), _mm256_set1_epi32(1));
                    let s = _mm256_loadu_ps(a.s.add(b * TOKENS + first));
                    off[r] = _mm256_add_ps(off[r], _mm256_mul_ps(mw, s));
                }
            }
        }
        for r in 0..R {
            let mut o = [0f32; 8];
            _mm256_storeu_ps(o.as_mut_ptr(), off[r]);
            for (t, acc) in acc[r].iter().enumerate() {
                let mut l = [0f32; 8];
                _mm256_storeu_ps(l.as_mut_ptr(), *acc);
                let s = hsum8(l);
                out[first + t][r] = if KIND == 1 { s + o[t] } else { s };
            }
        }
    }
}

/// Checks the layout constants against each other (a pair is 64 bytes of two 32-quant blocks).
const _: () = assert!(QK == 32 && TOKENS.is_multiple_of(2));
