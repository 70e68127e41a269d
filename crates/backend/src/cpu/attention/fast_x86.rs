//! The AVX2 and AVX-512 primitives of the fast decode kernel (`fast.rs`): the same algorithm as
//! its scalar path, 8 or 16 lanes at a time. Row lengths are multiples of the vector width
//! (`Isa::supports`); the exponential is `exp_poly`'s steps lane by lane.

use super::{Kernels, Online, C, CHUNK, EXP_MIN, LN2_HI, LN2_LO, LOG2E};

pub(super) mod avx2 {
    use super::*;
    use half::f16;
    use std::arch::x86_64::*;

    pub(in super::super) struct Avx2;
    pub(in super::super) static K: Avx2 = Avx2;

    impl Kernels for Avx2 {
        fn scores(&self, q: &[f32], k: &[f32], s: &mut [f32]) {
            // SAFETY: this path is only chosen when AVX2/FMA/F16C are present (`Isa::available`).
            unsafe { scores(q, k, s) }
        }
        fn exp(&self, x: &mut [f32]) {
            // SAFETY: as above.
            unsafe { exp(x) }
        }
        fn axpy(&self, acc: &mut [f32], w: &[f32], v: &[f32]) {
            // SAFETY: as above.
            unsafe { axpy(acc, w, v) }
        }
    }

    /// Rows `rows[i] + off ..` of `src`, `d = dst.len() / rows.len()` long, in f32 into `dst`.
    ///
    /// # Safety
    /// AVX2/F16C present; `d` a multiple of 8.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub(in super::super) unsafe fn rows_f16_to_f32(
        src: &[f16],
        rows: &[usize],
        off: usize,
        dst: &mut [f32],
    ) {
        let d = dst.len() / rows.len().max(1);
        assert!(d.is_multiple_of(8));
        for (&r, o) in rows.iter().zip(dst.chunks_exact_mut(d)) {
            let s = &src[r + off..][..d];
            for i in (0..d).step_by(8) {
                let h = _mm_loadu_si128(s.as_ptr().add(i).cast());
                _mm256_storeu_ps(o.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
            }
        }
    }

    #[inline(always)]
    unsafe fn hsum(v: __m256) -> f32 {
        let t = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps::<1>(v));
        let t = _mm_add_ps(t, _mm_movehl_ps(t, t));
        _mm_cvtss_f32(_mm_add_ss(t, _mm_movehdup_ps(t)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn scores(q: &[f32], k: &[f32], s: &mut [f32]) {
        let d = q.len();
        assert!(d.is_multiple_of(8) && k.len() >= s.len() * d);
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        for (i, si) in s.iter_mut().enumerate() {
            let kr = kp.add(i * d);
            let (mut a0, mut a1) = (_mm256_setzero_ps(), _mm256_setzero_ps());
            let mut c = 0;
            while c + 16 <= d {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(kr.add(c)), a0);
                a1 = _mm256_fmadd_ps(
                    _mm256_loadu_ps(qp.add(c + 8)),
                    _mm256_loadu_ps(kr.add(c + 8)),
                    a1,
                );
                c += 16;
            }
            if c < d {
                a0 = _mm256_fmadd_ps(_mm256_loadu_ps(qp.add(c)), _mm256_loadu_ps(kr.add(c)), a0);
            }
            *si = hsum(_mm256_add_ps(a0, a1));
        }
    }

    #[inline(always)]
    unsafe fn exp8(x: __m256) -> __m256 {
        let low = _mm256_cmp_ps::<_CMP_LT_OQ>(x, _mm256_set1_ps(EXP_MIN));
        let xc = _mm256_max_ps(x, _mm256_set1_ps(EXP_MIN));
        let n = _mm256_round_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm256_mul_ps(xc, _mm256_set1_ps(LOG2E)),
        );
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_HI), xc);
        let r = _mm256_fnmadd_ps(n, _mm256_set1_ps(LN2_LO), r);
        let mut p = _mm256_set1_ps(C[7]);
        for c in C[..7].iter().rev() {
            p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(*c));
        }
        let e = _mm256_slli_epi32::<23>(_mm256_add_epi32(
            _mm256_cvtps_epi32(n),
            _mm256_set1_epi32(127),
        ));
        _mm256_andnot_ps(low, _mm256_mul_ps(p, _mm256_castsi256_ps(e)))
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn exp(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(8);
        for c in &mut chunks {
            _mm256_storeu_ps(c.as_mut_ptr(), exp8(_mm256_loadu_ps(c.as_ptr())));
        }
        for v in chunks.into_remainder() {
            *v = super::super::exp_poly(*v);
        }
    }

    /// 64 floats of the accumulator in registers while every key's row goes past.
    #[inline(always)]
    unsafe fn axpy64(acc: *mut f32, w: &[f32], v: *const f32, d: usize) {
        let mut a: [__m256; 8] = [_mm256_setzero_ps(); 8];
        for (r, ar) in a.iter_mut().enumerate() {
            *ar = _mm256_loadu_ps(acc.add(8 * r));
        }
        for (i, &wi) in w.iter().enumerate() {
            let wv = _mm256_set1_ps(wi);
            let vr = v.add(i * d);
            for (r, ar) in a.iter_mut().enumerate() {
                *ar = _mm256_fmadd_ps(wv, _mm256_loadu_ps(vr.add(8 * r)), *ar);
            }
        }
        for (r, ar) in a.iter().enumerate() {
            _mm256_storeu_ps(acc.add(8 * r), *ar);
        }
    }

    #[target_feature(enable = "avx2,fma,f16c")]
    unsafe fn axpy(acc: &mut [f32], w: &[f32], v: &[f32]) {
        let d = acc.len();
        assert!(d.is_multiple_of(8) && v.len() >= w.len() * d);
        let mut c = 0;
        while c + 64 <= d {
            axpy64(acc.as_mut_ptr().add(c), w, v.as_ptr().add(c), d);
            c += 64;
        }
        while c < d {
            let mut a = _mm256_loadu_ps(acc.as_ptr().add(c));
            for (i, &wi) in w.iter().enumerate() {
                let vr = _mm256_loadu_ps(v.as_ptr().add(i * d + c));
                a = _mm256_fmadd_ps(_mm256_set1_ps(wi), vr, a);
            }
            _mm256_storeu_ps(acc.as_mut_ptr().add(c), a);
            c += 8;
        }
    }
}

pub(super) mod avx512 {
    use super::*;
    use half::f16;
    use std::arch::x86_64::*;

    pub(in super::super) struct Avx512;
    pub(in super::super) static K: Avx512 = Avx512;

    impl Kernels for Avx512 {
        fn scores(&self, q: &[f32], k: &[f32], s: &mut [f32]) {
            // SAFETY: this path is only chosen when AVX-512F is present (`Isa::available`).
            unsafe { scores(q, k, s) }
        }
        fn exp(&self, x: &mut [f32]) {
            // SAFETY: as above.
            unsafe { exp(x) }
        }
        fn max(&self, x: &[f32; CHUNK]) -> f32 {
            // SAFETY: as above.
            unsafe { max(x) }
        }
        fn exp_sum(&self, x: &mut [f32; CHUNK], m: f32) -> f32 {
            // SAFETY: as above.
            unsafe { exp_sum(x, m) }
        }
        fn axpy(&self, acc: &mut [f32], w: &[f32], v: &[f32]) {
            // SAFETY: as above.
            unsafe { axpy(acc, w, v) }
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn max(x: &[f32; CHUNK]) -> f32 {
        // An index loop: an iterator adapter here (`chunks_exact(16).skip(1)`) was not inlined
        // into this AVX-512 function but called, a `vzeroupper` each time.
        let mut a = _mm512_loadu_ps(x.as_ptr());
        let mut c = 16;
        while c < CHUNK {
            a = _mm512_max_ps(a, _mm512_loadu_ps(x.as_ptr().add(c)));
            c += 16;
        }
        _mm512_reduce_max_ps(a)
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn exp_sum(x: &mut [f32; CHUNK], m: f32) -> f32 {
        let mv = _mm512_set1_ps(m);
        let mut sum = _mm512_setzero_ps();
        for c in x.chunks_exact_mut(16) {
            let e = exp16(_mm512_sub_ps(_mm512_loadu_ps(c.as_ptr()), mv));
            _mm512_storeu_ps(c.as_mut_ptr(), e);
            sum = _mm512_add_ps(sum, e);
        }
        _mm512_reduce_add_ps(sum)
    }

    /// Rows `rows[i] + off ..` of `src`, `d = dst.len() / rows.len()` long, in f32 into `dst`.
    ///
    /// # Safety
    /// AVX-512F present; `d` a multiple of 16.
    #[target_feature(enable = "avx512f")]
    pub(in super::super) unsafe fn rows_f16_to_f32(
        src: &[f16],
        rows: &[usize],
        off: usize,
        dst: &mut [f32],
    ) {
        let d = dst.len() / rows.len().max(1);
        assert!(d.is_multiple_of(16));
        for (&r, o) in rows.iter().zip(dst.chunks_exact_mut(d)) {
            let s = &src[r + off..][..d];
            for i in (0..d).step_by(16) {
                let h = _mm256_loadu_si256(s.as_ptr().add(i).cast());
                _mm512_storeu_ps(o.as_mut_ptr().add(i), _mm512_cvtph_ps(h));
            }
        }
    }

    /// The dot product of `q` and the row at `kr` (both `d` long) as 16 partial sums.
    #[inline(always)]
    unsafe fn dot16(qp: *const f32, kr: *const f32, d: usize) -> __m512 {
        let mut a = _mm512_mul_ps(_mm512_loadu_ps(qp), _mm512_loadu_ps(kr));
        let mut c = 16;
        while c < d {
            a = _mm512_fmadd_ps(_mm512_loadu_ps(qp.add(c)), _mm512_loadu_ps(kr.add(c)), a);
            c += 16;
        }
        a
    }

    /// Adds pairs of neighbouring elements of `a` and `b` within each 128-bit lane: lane `L` of
    /// the result is `[a0+a2, b0+b2, a1+a3, b1+b3]` of the inputs' lane `L`.
    #[inline(always)]
    unsafe fn fold2(a: __m512, b: __m512) -> __m512 {
        _mm512_add_ps(_mm512_unpacklo_ps(a, b), _mm512_unpackhi_ps(a, b))
    }

    /// Two `fold2` results `x` (keys a, b) and `y` (keys c, d) to one: lane `L` holds the sums of
    /// keys a, b, c, d over that lane's 4 elements.
    #[inline(always)]
    unsafe fn fold4(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_ps::<0b01_00_01_00>(x, y),
            _mm512_shuffle_ps::<0b11_10_11_10>(x, y),
        )
    }

    /// Adds 128-bit lanes 0+1 and 2+3 of `x`, then of `y`: `[x01, x23, y01, y23]`.
    #[inline(always)]
    unsafe fn fold_lanes(x: __m512, y: __m512) -> __m512 {
        _mm512_add_ps(
            _mm512_shuffle_f32x4::<0b10_00_10_00>(x, y),
            _mm512_shuffle_f32x4::<0b11_01_11_01>(x, y),
        )
    }

    /// The horizontal sums of 16 vectors, in order, as one vector (a transposing add tree: 45
    /// shuffles and adds where 16 separate reductions take about 150).
    #[inline(always)]
    unsafe fn hsum16(v: &[__m512; 16]) -> __m512 {
        let mut w = [_mm512_setzero_ps(); 4];
        for (j, wj) in w.iter_mut().enumerate() {
            let b = 4 * j;
            *wj = fold4(fold2(v[b], v[b + 1]), fold2(v[b + 2], v[b + 3]));
        }
        fold_lanes(fold_lanes(w[0], w[1]), fold_lanes(w[2], w[3]))
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn scores(q: &[f32], k: &[f32], s: &mut [f32]) {
        let d = q.len();
        assert!(d.is_multiple_of(16) && d > 0 && k.len() >= s.len() * d);
        let (qp, kp) = (q.as_ptr(), k.as_ptr());
        let mut i = 0;
        // 16 keys at a time, their sums reduced together.
        while i + 16 <= s.len() {
            let mut v = [_mm512_setzero_ps(); 16];
            for (r, vr) in v.iter_mut().enumerate() {
                *vr = dot16(qp, kp.add((i + r) * d), d);
            }
            _mm512_storeu_ps(s.as_mut_ptr().add(i), hsum16(&v));
            i += 16;
        }
        while i < s.len() {
            s[i] = _mm512_reduce_add_ps(dot16(qp, kp.add(i * d), d));
            i += 1;
        }
    }

    #[inline(always)]
    unsafe fn exp16(x: __m512) -> __m512 {
        let ok = _mm512_cmp_ps_mask::<_CMP_GE_OQ>(x, _mm512_set1_ps(EXP_MIN));
        let xc = _mm512_max_ps(x, _mm512_set1_ps(EXP_MIN));
        let n = _mm512_roundscale_ps::<{ _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC }>(
            _mm512_mul_ps(xc, _mm512_set1_ps(LOG2E)),
        );
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_HI), xc);
        let r = _mm512_fnmadd_ps(n, _mm512_set1_ps(LN2_LO), r);
        let mut p = _mm512_set1_ps(C[7]);
        for c in C[..7].iter().rev() {
            p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(*c));
        }
        let e = _mm512_slli_epi32::<23>(_mm512_add_epi32(
            _mm512_cvtps_epi32(n),
            _mm512_set1_epi32(127),
        ));
        _mm512_maskz_mov_ps(ok, _mm512_mul_ps(p, _mm512_castsi512_ps(e)))
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn exp(x: &mut [f32]) {
        let mut chunks = x.chunks_exact_mut(16);
        for c in &mut chunks {
            _mm512_storeu_ps(c.as_mut_ptr(), exp16(_mm512_loadu_ps(c.as_ptr())));
        }
        for v in chunks.into_remainder() {
            *v = super::super::exp_poly(*v);
        }
    }

    /// `16 * N` floats of the accumulator in registers while every key's row goes past.
    #[inline(always)]
    unsafe fn axpy_regs<const N: usize>(acc: *mut f32, w: &[f32], v: *const f32, d: usize) {
        let mut a: [__m512; N] = [_mm512_setzero_ps(); N];
        for (r, ar) in a.iter_mut().enumerate() {
            *ar = _mm512_loadu_ps(acc.add(16 * r));
        }
        for (i, &wi) in w.iter().enumerate() {
            let wv = _mm512_set1_ps(wi);
            let vr = v.add(i * d);
            for (r, ar) in a.iter_mut().enumerate() {
                *ar = _mm512_fmadd_ps(wv, _mm512_loadu_ps(vr.add(16 * r)), *ar);
            }
        }
        for (r, ar) in a.iter().enumerate() {
            _mm512_storeu_ps(acc.add(16 * r), *ar);
        }
    }

    #[target_feature(enable = "avx512f")]
    unsafe fn axpy(acc: &mut [f32], w: &[f32], v: &[f32]) {
        let d = acc.len();
        assert!(d.is_multiple_of(16) && v.len() >= w.len() * d);
        let (ap, vp) = (acc.as_mut_ptr(), v.as_ptr());
        let mut c = 0;
        while c + 128 <= d {
            axpy_regs::<8>(ap.add(c), w, vp.add(c), d);
            c += 128;
        }
        // The rest (below 128 floats) in one pass.
        match (d - c) / 16 {
            0 => {}
            1 => axpy_regs::<1>(ap.add(c), w, vp.add(c), d),
            2 => axpy_regs::<2>(ap.add(c), w, vp.add(c), d),
            3 => axpy_regs::<3>(ap.add(c), w, vp.add(c), d),
            4 => axpy_regs::<4>(ap.add(c), w, vp.add(c), d),
            5 => axpy_regs::<5>(ap.add(c), w, vp.add(c), d),
            6 => axpy_regs::<6>(ap.add(c), w, vp.add(c), d),
            _ => axpy_regs::<7>(ap.add(c), w, vp.add(c), d),
        }
    }

    /// One chunk of keys for the query heads of one KV head, read straight from an f16 cache: each
    /// key's K row is converted once into registers and serves every head of the group, and so is
    /// its V row; nothing goes through a converted copy in memory. The same operations in the same
    /// order as `scores`, the softmax steps and `axpy` over converted rows, so the same bits.
    /// Rows of 64 and 128 only (`has_fused_chunk`).
    ///
    /// While it reads row `i` of K (and of V), it asks for row `next[i]` of the next chunk into
    /// L2: spread so, the requests overlap the arithmetic instead of stalling it (all of a
    /// chunk's requests at once fill the core's miss buffers, and the kernel waits for them).
    /// Decode at depth 8192 over 64 sequences (384 MiB of cache, more than L3; `quire attn-bench
    /// --batch 64 --q-heads 9 --kv-heads 3 --head-dim 64 --block-size 16 --max-blocks 512
    /// --active-blocks 512`): 1.12–1.20× the speed of asking for the whole chunk at once (PERF.md).
    ///
    /// `q`: [group, d] prescaled; `rows[i] + off`: the first element of key i's row of this head
    /// in `k` and `v` (`next[i] + off` likewise); `part`: scratch of at least group × CHUNK × 17
    /// floats.
    ///
    /// # Safety
    /// AVX-512F present; every `rows[i] + off + d` and `next[i] + off + d` within `k` and `v`; at
    /// most `CHUNK` rows.
    #[target_feature(enable = "avx512f")]
    pub(in super::super) unsafe fn chunk_f16(
        q: &[f32],
        kv: (&[f16], &[f16]),
        (rows, next): (&[usize], &[usize]),
        off: usize,
        st: &mut Online,
        part: &mut [f32],
    ) {
        let group = st.m.len();
        let d = q.len() / group;
        match d {
            64 => chunk_nv::<4>(q, kv, (rows, next), off, st, part),
            128 => chunk_nv::<8>(q, kv, (rows, next), off, st, part),
            _ => unreachable!("the fused chunk takes rows of 64 and 128 (has_fused_chunk)"),
        }
    }

    /// Asks for the `NV / 2` cache lines of an f16 row of `16 * NV` at `p` (and the line of its
    /// last byte, as rows need not start on a line) into L2.
    #[inline(always)]
    unsafe fn prefetch_l2<const NV: usize>(p: *const f16) {
        let b = p.cast::<i8>();
        for l in 0..NV / 2 {
            _mm_prefetch::<_MM_HINT_T1>(b.add(64 * l));
        }
        _mm_prefetch::<_MM_HINT_T1>(b.add(32 * NV - 1));
    }

    #[inline(always)]
    unsafe fn load_f16<const NV: usize>(p: *const f16) -> [__m512; NV] {
        let mut r = [_mm512_setzero_ps(); NV];
        for (j, rj) in r.iter_mut().enumerate() {
            *rj = _mm512_cvtph_ps(_mm256_loadu_si256(p.add(16 * j).cast()));
        }
        r
    }

    #[inline(always)]
    unsafe fn chunk_nv<const NV: usize>(
        q: &[f32],
        (k, v): (&[f16], &[f16]),
        (rows, next): (&[usize], &[usize]),
        off: usize,
        st: &mut Online,
        part: &mut [f32],
    ) {
        let d = 16 * NV;
        let group = st.m.len();
        let n = rows.len();
        assert!(n <= CHUNK && q.len() == group * d && part.len() >= group * CHUNK * 17);
        assert!(rows
            .iter()
            .chain(next)
            .all(|&r| r + off + d <= k.len() && r + off + d <= v.len()));
        // The scores: part's last `group × CHUNK` floats (a local array of MAX_H rows was zeroed,
        // 2 KB, on every call; every score is written before it is read).
        let (part, s) = part.split_at_mut(group * CHUNK * 16);
        let s = s.as_chunks_mut::<CHUNK>().0;
        let (qp, pp) = (q.as_ptr(), part.as_mut_ptr());
        // Each key's dot products with every head as 16 partial sums: part[i][g] (a key's heads
        // side by side: with a head's keys side by side, the stores of one key were 2 KB apart).
        // Two keys at a time: their chains of dependent FMAs interleave.
        let mut i = 0;
        while i < n {
            let two = i + 1 < n;
            for x in i..(i + 2).min(n) {
                if let Some(&nr) = next.get(x) {
                    prefetch_l2::<NV>(k.as_ptr().add(nr + off));
                }
            }
            let ka = load_f16::<NV>(k.as_ptr().add(rows[i] + off));
            let kb = if two {
                load_f16::<NV>(k.as_ptr().add(rows[i + 1] + off))
            } else {
                ka
            };
            for g in 0..group {
                let qg = qp.add(g * d);
                let q0 = _mm512_loadu_ps(qg);
                let mut a = _mm512_mul_ps(q0, ka[0]);
                let mut b = _mm512_mul_ps(q0, kb[0]);
                for j in 1..NV {
                    let qj = _mm512_loadu_ps(qg.add(16 * j));
                    a = _mm512_fmadd_ps(qj, ka[j], a);
                    b = _mm512_fmadd_ps(qj, kb[j], b);
                }
                _mm512_storeu_ps(pp.add((i * group + g) * 16), a);
                if two {
                    _mm512_storeu_ps(pp.add(((i + 1) * group + g) * 16), b);
                }
            }
            i += 2;
        }
        for (g, sg) in s[..group].iter_mut().enumerate() {
            let pg = pp.add(g * 16);
            let stride = group * 16;
            let mut i = 0;
            while i + 16 <= n {
                let mut w = [_mm512_setzero_ps(); 16];
                for (t, wt) in w.iter_mut().enumerate() {
                    *wt = _mm512_loadu_ps(pg.add((i + t) * stride));
                }
                _mm512_storeu_ps(sg.as_mut_ptr().add(i), hsum16(&w));
                i += 16;
            }
            while i < n {
                sg[i] = _mm512_reduce_add_ps(_mm512_loadu_ps(pg.add(i * stride)));
                i += 1;
            }
            // The online softmax step, as in `attend_range`.
            sg[n..].fill(f32::NEG_INFINITY);
            let cmax = max(sg);
            if cmax > st.m[g] {
                let corr = super::super::exp_poly(st.m[g] - cmax);
                st.acc[g * d..(g + 1) * d]
                    .iter_mut()
                    .for_each(|a| *a *= corr);
                st.l[g] *= corr;
                st.m[g] = cmax;
            }
            st.l[g] += exp_sum(sg, st.m[g]);
        }
        // V: the heads' accumulators in registers, a few heads at a time (the first pass asks
        // for the next chunk's V rows).
        let vo = &v[off..];
        let mut g = 0;
        while g < group {
            let left = group - g;
            let (w, acc) = (&s[g..], &mut st.acc[g * d..]);
            let ahead = if g == 0 { next } else { &[] };
            g += match NV {
                4 if left >= 4 => vsum::<NV, 4>(vo, (rows, ahead), w, acc),
                4 if left == 3 => vsum::<NV, 3>(vo, (rows, ahead), w, acc),
                _ if left >= 2 => vsum::<NV, 2>(vo, (rows, ahead), w, acc),
                _ => vsum::<NV, 1>(vo, (rows, ahead), w, acc),
            };
        }
    }

    /// `acc[h] += Σ_i w[h][i] · v_i` for the `GB` heads from `acc`'s start (`w`: their weights),
    /// with every V row converted once, asking for row `next[i]` into L2 beside row `i`; returns
    /// `GB`.
    #[inline(always)]
    unsafe fn vsum<const NV: usize, const GB: usize>(
        v: &[f16],
        (rows, next): (&[usize], &[usize]),
        w: &[[f32; CHUNK]],
        acc: &mut [f32],
    ) -> usize {
        let d = 16 * NV;
        assert!(w.len() >= GB && acc.len() >= GB * d);
        let ap = acc.as_mut_ptr();
        let mut a = [[_mm512_setzero_ps(); NV]; GB];
        for (h, ah) in a.iter_mut().enumerate() {
            for (j, aj) in ah.iter_mut().enumerate() {
                *aj = _mm512_loadu_ps(ap.add(h * d + 16 * j));
            }
        }
        for (i, &r) in rows.iter().enumerate() {
            if let Some(&nr) = next.get(i) {
                prefetch_l2::<NV>(v.as_ptr().add(nr));
            }
            let vr = load_f16::<NV>(v.as_ptr().add(r));
            for (h, ah) in a.iter_mut().enumerate() {
                let wv = _mm512_set1_ps(w[h][i]);
                for (j, aj) in ah.iter_mut().enumerate() {
                    *aj = _mm512_fmadd_ps(wv, vr[j], *aj);
                }
            }
        }
        for (h, ah) in a.iter().enumerate() {
            for (j, aj) in ah.iter().enumerate() {
                _mm512_storeu_ps(ap.add(h * d + 16 * j), *aj);
            }
        }
        GB
    }
}
