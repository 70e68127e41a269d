//! Decode attention for the `fast` arithmetic mode (`CpuMath::Fast`). The exact path evaluates
//! `expf` once per (key, head) in scalar code and rounds its accumulator to f16 after every key so
//! that it equals llama.cpp's AVX2 build bit for bit; at long contexts that scalar work, not the
//! memory, bounds decode. This kernel gives up bit-equality for speed:
//!
//! - keys go in chunks of `CHUNK`: their K and V rows (f16 or f32 in the cache) are converted to
//!   f32 once per chunk (F16C / AVX-512 `vcvtph2ps`) and shared by all query heads of the group
//!   (on AVX-512 an f16 row goes straight into registers, `fast_x86::avx512::chunk_f16`: the
//!   conversion through memory had made decode compute-bound on this kind of 2-core VM);
//! - scores are f32 dot products with vector accumulators, Q prescaled by the softmax scale;
//! - the softmax is online in f32, its exponentials by `exp_poly` (below) a vector at a time;
//! - V is accumulated in f32 with the accumulator held in registers over a chunk;
//! - the keys of each sequence are cut into fixed ranges of `SPLIT_KEYS` (absolute positions, so
//!   the result does not depend on the thread count or the batch), each range × KV head is one
//!   task, and the ranges' partial (max, sum, accumulator) are merged in range order. So one
//!   sequence at batch 1 spreads over every thread;
//! - the rows of a prompt chunk share the ranges they all have whole: one task walks such a range
//!   once for several rows (`fast_plan.rs`), each row's partial unchanged.
//!
//! The instruction set is picked once by `Isa::detect` (AVX-512F, else AVX2+FMA+F16C, else
//! scalar); every path runs the same algorithm, and each is tested against the dense f64
//! reference and against the scalar path (crates/backend/tests/cpu_fast_attention.rs).

use std::cell::RefCell;
use std::ops::Range;
use std::sync::OnceLock;

use super::{AttnParams, KvElem};
use crate::cpu::team::{DisjointPtr, Parallel};
use crate::SeqBatch;
use plan::Plan;

/// Keys per task: each sequence's keys are cut at multiples of this (absolute positions).
pub const SPLIT_KEYS: usize = 256;
/// Keys converted to f32 at a time.
const CHUNK: usize = 32;
// The vector paths take a chunk in whole 16-lane vectors.
const _: () = assert!(CHUNK.is_multiple_of(16));
const MAX_D: usize = 256;
const MAX_G: usize = 16;
/// Query heads one task feeds from a chunk (rows × GQA group) at most.
const MAX_H: usize = 16;

/// The instruction set a kernel path uses.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Isa {
    Scalar,
    Avx2,
    Avx512,
}

impl Isa {
    /// The best path this CPU runs (checked once). `QUIRE_NO_SIMD` forces scalar, as it does for
    /// the exact kernels.
    pub fn detect() -> Isa {
        static ISA: OnceLock<Isa> = OnceLock::new();
        *ISA.get_or_init(|| {
            if std::env::var_os("QUIRE_NO_SIMD").is_some() {
                Isa::Scalar
            } else if Isa::Avx512.available() {
                Isa::Avx512
            } else if Isa::Avx2.available() {
                Isa::Avx2
            } else {
                Isa::Scalar
            }
        })
    }

    /// Whether this CPU can run the path.
    pub fn available(self) -> bool {
        match self {
            Isa::Scalar => true,
            #[cfg(target_arch = "x86_64")]
            Isa::Avx2 => {
                is_x86_feature_detected!("avx2")
                    && is_x86_feature_detected!("fma")
                    && is_x86_feature_detected!("f16c")
            }
            #[cfg(target_arch = "x86_64")]
            Isa::Avx512 => is_x86_feature_detected!("avx512f"),
            #[cfg(not(target_arch = "x86_64"))]
            _ => false,
        }
    }

    /// Whether the path handles rows of `head_dim` (its vector width must divide them).
    pub fn supports(self, head_dim: usize) -> bool {
        head_dim <= MAX_D
            && match self {
                Isa::Scalar => true,
                Isa::Avx2 => head_dim.is_multiple_of(8),
                Isa::Avx512 => head_dim.is_multiple_of(16),
            }
    }

    pub fn name(self) -> &'static str {
        match self {
            Isa::Scalar => "scalar",
            Isa::Avx2 => "avx2",
            Isa::Avx512 => "avx512",
        }
    }
}

/// `e^x` for `x ≤ 0` (the softmax's arguments), the algorithm every path uses: `n = round(x ·
/// log2 e)`, `r = x − n · ln 2` in two parts (Cody and Waite's split, `ln2_hi` exact in 9 bits),
/// the degree-7 Taylor polynomial of `e^r` on |r| ≤ ln2/2 (truncation error below 5.2e-9), times
/// `2^n` built in the exponent bits. Arguments below −87.33 (where `2^n` leaves the normal range)
/// give 0, as do −∞. Measured maximum relative error against f64 `exp` over [−87, 0]: below
/// 7.2e-8, held below `EXP_MAX_REL_ERR` = 1.2e-7, one f32 epsilon (test `fast_exp_error_is_bounded`).
#[inline(always)]
pub fn exp_poly(x: f32) -> f32 {
    if x < EXP_MIN || x.is_nan() {
        return if x.is_nan() { x } else { 0.0 };
    }
    let n = (x * LOG2E).round_ties_even();
    let r = n.mul_add(-LN2_HI, x);
    let r = n.mul_add(-LN2_LO, r);
    let mut p = C[7];
    for c in C[..7].iter().rev() {
        p = p.mul_add(r, *c);
    }
    p * f32::from_bits((((n as i32) + 127) as u32) << 23)
}

/// `exp_poly` of every element on `isa`'s vector path (which must be available): for the tests.
pub fn exp_in_place(isa: Isa, x: &mut [f32]) {
    assert!(isa.available(), "{isa:?} cannot run here");
    for c in x.chunks_mut(CHUNK) {
        kernels(isa).exp(c);
    }
}

/// The bound the test holds `exp_poly` (every path) to: relative error against f64 `exp`.
pub const EXP_MAX_REL_ERR: f64 = 1.2e-7;
const EXP_MIN: f32 = -87.33654;
const LOG2E: f32 = std::f32::consts::LOG2_E;
const LN2_HI: f32 = 0.693_359_4;
const LN2_LO: f32 = -2.121_944_4e-4;
/// 1/k! for k = 0..=7.
const C: [f32; 8] = [
    1.0,
    1.0,
    0.5,
    1.0 / 6.0,
    1.0 / 24.0,
    1.0 / 120.0,
    1.0 / 720.0,
    1.0 / 5040.0,
];

/// Decode attention of `seqs` (each one query token: `query_len == 1`) on `isa`, which must be
/// available and support `p.head_dim`. Their K/V rows must already be in the cache. Writes each
/// sequence's row of `out` (row `query_start`, `num_heads * head_dim` wide).
#[allow(clippy::too_many_arguments)]
pub fn decode_attention<T: KvElem>(
    par: &dyn Parallel,
    isa: Isa,
    p: &AttnParams,
    q: &[f32],
    q_stride: usize,
    seqs: &[SeqBatch],
    k_cache: &[T],
    v_cache: &[T],
    out: &mut [f32],
) {
    assert!(
        isa.available() && isa.supports(p.head_dim),
        "{isa:?} cannot run here"
    );
    let d = p.head_dim;
    let group = p.num_heads / p.num_kv_heads;
    assert!(group <= MAX_G, "GQA group above {MAX_G}");
    let part = group * (d + 2);
    // Consecutive rows of a sequence share a task where their key ranges agree: as many rows as
    // the fused pass holds query heads for.
    let plan = Plan::new(p, seqs, par.threads(), (MAX_H / group).max(1));
    let heads = plan.heads;
    let mut partials = vec![0f32; plan.offsets[plan.tasks.len()] * part];
    let dst = DisjointPtr::new(&mut partials);
    par.run_tasks(plan.tasks.len(), &|i| {
        let t = &plan.tasks[i];
        let (a, b) = (plan.offsets[i] * part, plan.offsets[i + 1] * part);
        // SAFETY: task `i` writes only its own partials, `a..b`, inside `partials`.
        let pt = unsafe { std::slice::from_raw_parts_mut(dst.at(a), b - a) };
        let work = Work {
            q,
            q_stride,
            rows: &seqs[t.rows.clone()],
            keys: t.keys.clone(),
            kvh: t.kvh0..t.kvh0 + heads,
        };
        attend_range(isa, p, &work, k_cache, v_cache, pt);
    });
    let q_row = p.num_heads * d;
    let mut parts: Vec<&[f32]> = Vec::new();
    for (row, kvh, rr) in &plan.groups {
        let o = &mut out[seqs[*row].query_start * q_row + kvh * group * d..][..group * d];
        parts.clear();
        parts.extend(
            plan.refs[rr.clone()]
                .iter()
                .map(|&x| &partials[x * part..][..part]),
        );
        merge(&parts, group, d, o);
    }
}

/// One task's work: key range `keys` for the query rows `rows` (one sequence, consecutive
/// positions; `q` and `q_stride` locate their queries), KV heads `kvh`.
struct Work<'a> {
    q: &'a [f32],
    q_stride: usize,
    rows: &'a [SeqBatch<'a>],
    keys: Range<usize>,
    kvh: Range<usize>,
}

/// Combines partials `[m[group] | l[group] | acc[group * d]]`, in order, into `out`.
fn merge(parts: &[&[f32]], group: usize, d: usize, out: &mut [f32]) {
    for g in 0..group {
        let mx = parts
            .iter()
            .map(|pt| pt[g])
            .fold(f32::NEG_INFINITY, f32::max);
        let o = &mut out[g * d..(g + 1) * d];
        o.fill(0.0);
        let mut l = 0f32;
        for pt in parts {
            if pt[g] == f32::NEG_INFINITY {
                continue;
            }
            let w = exp_poly(pt[g] - mx);
            l += w * pt[group + g];
            let acc = &pt[2 * group + g * d..][..d];
            for (a, &b) in o.iter_mut().zip(acc) {
                *a += w * b;
            }
        }
        let inv = if l > 0.0 { 1.0 / l } else { 0.0 };
        o.iter_mut().for_each(|v| *v *= inv);
    }
}

/// Online softmax of the query heads of `w.kvh`'s KV heads, for each of `w.rows`, over `w.keys`:
/// leaves each (row, KV head)'s partial `[m[group] | l[group] | acc[group * d]]` (running
/// maxima, sums of exponentials, unnormalized outputs) in `parts`, `[row][head]`. The keys go in
/// chunks of `CHUNK`, every KV head of a chunk before the next chunk, so a task reads its rows of
/// the cache front to back; each chunk serves every row's query heads of a KV head at once.
fn attend_range<T: KvElem>(
    isa: Isa,
    p: &AttnParams,
    w: &Work,
    k_cache: &[T],
    v_cache: &[T],
    parts: &mut [f32],
) {
    let d = p.head_dim;
    let heads = w.kvh.len();
    let group = p.num_heads / p.num_kv_heads;
    // Query heads per KV head: every row's group.
    let hq = w.rows.len() * group;
    let part = group * (d + 2);
    let kv_row = p.num_kv_heads * d;
    let block_table = w.rows[0].block_table;
    // The first element of the slot of position `pos` (its KV heads side by side).
    let slot_of = |pos: usize| {
        let slot = block_table[pos / p.block_size].as_usize() * p.block_size + pos % p.block_size;
        slot * kv_row
    };
    // The slots of this chunk's keys and of the next one's, each looked up once.
    let mut slots = [0usize; CHUNK];
    let mut next = [0usize; CHUNK];
    for (i, slot) in slots.iter_mut().enumerate() {
        *slot = slot_of((w.keys.start + i).min(w.keys.end - 1));
    }
    // The span of a slot's row this task reads: its KV heads, contiguous.
    let (span0, span) = (w.kvh.start * d, heads * d);
    let k = kernels(isa);
    let fused = has_fused_chunk::<T>(isa, d);
    SCRATCH.with_borrow_mut(|buf| {
        // Reused from task to task: zeroing ~80 KB of stack arrays per task showed in profiles.
        let need = heads * hq * (2 * d + 2) + 2 * CHUNK * d + hq * CHUNK * 17;
        if buf.len() < need {
            buf.resize(need, 0.0);
        }
        let (qs, rest) = buf.split_at_mut(heads * hq * d);
        let (ms, rest) = rest.split_at_mut(heads * hq);
        let (ls, rest) = rest.split_at_mut(heads * hq);
        let (accs, rest) = rest.split_at_mut(heads * hq * d);
        let (kbuf, rest) = rest.split_at_mut(CHUNK * d);
        let (vbuf, fused_part) = rest.split_at_mut(CHUNK * d);
        // Every query head, `[kv head][row][group][d]`, prescaled once for the whole range.
        for hi in 0..heads {
            for (ri, row) in w.rows.iter().enumerate() {
                let src = &w.q[row.query_start * w.q_stride + (w.kvh.start + hi) * group * d..];
                let dst = &mut qs[(hi * hq + ri * group) * d..][..group * d];
                for (a, &b) in dst.iter_mut().zip(src) {
                    *a = b * p.scale;
                }
            }
        }
        ms.fill(f32::NEG_INFINITY);
        ls.fill(0.0);
        accs.fill(0.0);
        let mut s = [0f32; CHUNK];
        let mut j = w.keys.start;
        while j < w.keys.end {
            let n = CHUNK.min(w.keys.end - j);
            // The next chunk's rows are requested while this one is worked on: the blocks lie
            // anywhere, so the hardware prefetchers do not see them coming (at depth 8192 the
            // conversion's first load was a third of the kernel's time without this). The fused
            // chunk asks for them into L2 a row at a time between its own rows; the other paths
            // ask for them all at once here.
            let nn = CHUNK.min(w.keys.end.saturating_sub(j + n));
            for (i, slot) in next[..nn].iter_mut().enumerate() {
                *slot = slot_of(j + n + i);
                if !fused {
                    prefetch_row(&k_cache[*slot + span0..][..span]);
                    prefetch_row(&v_cache[*slot + span0..][..span]);
                }
            }
            for hi in 0..heads {
                let h = w.kvh.start + hi;
                let qh = &qs[hi * hq * d..][..hq * d];
                let mut st = Online {
                    m: &mut ms[hi * hq..][..hq],
                    l: &mut ls[hi * hq..][..hq],
                    acc: &mut accs[hi * hq * d..][..hq * d],
                };
                if fused {
                    fused_chunk(
                        qh,
                        (k_cache, v_cache),
                        (&slots[..n], &next[..nn]),
                        h * d,
                        &mut st,
                        fused_part,
                    );
                    continue;
                }
                rows_to_f32(isa, k_cache, &slots[..n], h * d, &mut kbuf[..n * d]);
                rows_to_f32(isa, v_cache, &slots[..n], h * d, &mut vbuf[..n * d]);
                for g in 0..hq {
                    let ag = &mut st.acc[g * d..(g + 1) * d];
                    k.scores(&qh[g * d..(g + 1) * d], &kbuf[..n * d], &mut s[..n]);
                    // The padding past `n` adds nothing to the maximum or (as exp(−∞) = 0) the
                    // sum.
                    s[n..].fill(f32::NEG_INFINITY);
                    let cmax = k.max(&s);
                    if cmax > st.m[g] {
                        let corr = exp_poly(st.m[g] - cmax);
                        ag.iter_mut().for_each(|a| *a *= corr);
                        st.l[g] *= corr;
                        st.m[g] = cmax;
                    }
                    st.l[g] += k.exp_sum(&mut s, st.m[g]);
                    k.axpy(ag, &s[..n], &vbuf[..n * d]);
                }
            }
            std::mem::swap(&mut slots, &mut next);
            j += n;
        }
        // Each (row, head)'s partial to its place.
        for hi in 0..heads {
            for ri in 0..w.rows.len() {
                let pt = &mut parts[(ri * heads + hi) * part..][..part];
                let at = hi * hq + ri * group;
                pt[..group].copy_from_slice(&ms[at..at + group]);
                pt[group..2 * group].copy_from_slice(&ls[at..at + group]);
                pt[2 * group..].copy_from_slice(&accs[at * d..(at + group) * d]);
            }
        }
    });
}

thread_local! {
    /// `attend_range`'s scratch on each thread: prescaled queries, a chunk's K and V rows in f32.
    static SCRATCH: RefCell<Vec<f32>> = const { RefCell::new(Vec::new()) };
}

/// Asks for the cache lines of `row` to be brought into the cache (a hint: no effect on results).
#[inline(always)]
fn prefetch_row<T>(row: &[T]) {
    #[cfg(target_arch = "x86_64")]
    {
        use std::arch::x86_64::{_mm_prefetch, _MM_HINT_T0};
        let bytes = std::mem::size_of_val(row);
        let base = row.as_ptr().cast::<i8>();
        for off in (0..bytes).step_by(64) {
            // SAFETY: SSE is part of x86_64; the address is inside `row`, and a prefetch never
            // faults or changes memory.
            unsafe { _mm_prefetch::<_MM_HINT_T0>(base.add(off)) };
        }
    }
    #[cfg(not(target_arch = "x86_64"))]
    let _ = row;
}

/// One head group's running softmax over the keys so far: maxima and sums `[group]`,
/// unnormalized outputs `acc` `[group, d]`.
struct Online<'a> {
    m: &'a mut [f32],
    l: &'a mut [f32],
    acc: &'a mut [f32],
}

/// Whether path `isa` has a one-pass kernel for chunks of an f16 cache with rows of `d`
/// ([`fused_chunk`]: AVX-512, rows of 64 or 128).
fn has_fused_chunk<T: KvElem>(isa: Isa, d: usize) -> bool {
    cfg!(target_arch = "x86_64")
        && isa == Isa::Avx512
        && T::as_f16(&[]).is_some()
        && matches!(d, 64 | 128)
}

/// The chunk step of `attend_range` for head offset `off` in one pass over the f16 cache rows
/// `rows` (`has_fused_chunk` said yes); the rows `next` of the next chunk are asked into L2 on
/// the way.
#[inline]
fn fused_chunk<T: KvElem>(
    q: &[f32],
    (k_cache, v_cache): (&[T], &[T]),
    (rows, next): (&[usize], &[usize]),
    off: usize,
    st: &mut Online,
    part: &mut [f32],
) {
    #[cfg(target_arch = "x86_64")]
    if let (Some(k), Some(v)) = (T::as_f16(k_cache), T::as_f16(v_cache)) {
        // SAFETY: `has_fused_chunk` checked the path available; the rows are slots of the cache
        // (and `chunk_f16` checks their bounds).
        unsafe { x86::avx512::chunk_f16(q, (k, v), (rows, next), off, st, part) };
        return;
    }
    let _ = (q, k_cache, v_cache, rows, next, off, st, part);
    unreachable!("fused_chunk called where has_fused_chunk is false");
}

/// Rows `rows[i] + off .. + d` of `cache` in f32, one after the other in `dst` (`rows.len() × d`):
/// one call per chunk and head, so that the f16 loop runs inside the vector path.
#[inline]
fn rows_to_f32<T: KvElem>(isa: Isa, cache: &[T], rows: &[usize], off: usize, dst: &mut [f32]) {
    let d = dst.len() / rows.len().max(1);
    if let Some(f) = T::as_f32(cache) {
        for (&r, o) in rows.iter().zip(dst.chunks_exact_mut(d)) {
            o.copy_from_slice(&f[r + off..][..d]);
        }
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if let Some(h) = T::as_f16(cache) {
        match isa {
            // SAFETY: the path was checked available; `supports` makes d a multiple of the width.
            Isa::Avx512 => return unsafe { x86::avx512::rows_f16_to_f32(h, rows, off, dst) },
            // SAFETY: as above.
            Isa::Avx2 => return unsafe { x86::avx2::rows_f16_to_f32(h, rows, off, dst) },
            Isa::Scalar => {}
        }
    }
    let _ = isa;
    for (&r, o) in rows.iter().zip(dst.chunks_exact_mut(d)) {
        for (a, b) in o.iter_mut().zip(&cache[r + off..][..d]) {
            *a = b.to_f32();
        }
    }
}

/// The per-path primitives.
trait Kernels {
    /// `s[i] = q · k[i]` for the keys (rows of `q.len()`) in `k`.
    fn scores(&self, q: &[f32], k: &[f32], s: &mut [f32]);
    /// `x = exp_poly(x)` for every element.
    fn exp(&self, x: &mut [f32]);
    /// The largest element of `x` (`CHUNK` long).
    fn max(&self, x: &[f32; CHUNK]) -> f32 {
        x.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b))
    }
    /// `x = exp_poly(x − m)` for every element of `x` (`CHUNK` long); returns their sum.
    fn exp_sum(&self, x: &mut [f32; CHUNK], m: f32) -> f32 {
        x.iter_mut().for_each(|v| *v -= m);
        self.exp(x);
        x.iter().sum()
    }
    /// `acc += Σ_i w[i] · v[i]` (rows of `acc.len()`).
    fn axpy(&self, acc: &mut [f32], w: &[f32], v: &[f32]);
}

struct Scalar;

impl Kernels for Scalar {
    fn scores(&self, q: &[f32], k: &[f32], s: &mut [f32]) {
        for (si, kr) in s.iter_mut().zip(k.chunks_exact(q.len())) {
            *si = q.iter().zip(kr).fold(0.0, |a, (&x, &y)| x.mul_add(y, a));
        }
    }
    fn exp(&self, x: &mut [f32]) {
        x.iter_mut().for_each(|v| *v = exp_poly(*v));
    }
    fn axpy(&self, acc: &mut [f32], w: &[f32], v: &[f32]) {
        for (&wi, vr) in w.iter().zip(v.chunks_exact(acc.len())) {
            for (a, &b) in acc.iter_mut().zip(vr) {
                *a = wi.mul_add(b, *a);
            }
        }
    }
}

fn kernels(isa: Isa) -> &'static dyn Kernels {
    match isa {
        #[cfg(target_arch = "x86_64")]
        Isa::Avx2 => &x86::avx2::K,
        #[cfg(target_arch = "x86_64")]
        Isa::Avx512 => &x86::avx512::K,
        _ => &Scalar,
    }
}

#[cfg(target_arch = "x86_64")]
#[path = "fast_x86.rs"]
mod x86;

#[path = "fast_plan.rs"]
mod plan;
