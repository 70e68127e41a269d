//! Paged attention on the CPU, with the step's new K and V written into their cache slots by the
//! same call (the fused KV write). K and V are read through each sequence's block table, one block
//! at a time, with an online softmax, so no score buffer grows with the context. All query heads
//! of a KV group are handled together so each K/V row is read once per group.

use half::f16;

use super::CpuMath;
use crate::SeqBatch;

/// Storage type of the KV cache; math is always f32.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    const NAME: &'static str;
    /// The slice as f16, when that is its storage (the SIMD path of the f16 accumulator).
    fn as_f16(s: &[Self]) -> Option<&[f16]>;
    /// The slice as f32, when that is its storage.
    fn as_f32(_: &[Self]) -> Option<&[f32]> {
        None
    }
}

impl KvElem for f32 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        v
    }
    const NAME: &'static str = "f32";
    fn as_f16(_: &[Self]) -> Option<&[f16]> {
        None
    }
    fn as_f32(s: &[Self]) -> Option<&[f32]> {
        Some(s)
    }
}

impl KvElem for f16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        f16::from_f32(v)
    }
    const NAME: &'static str = "f16";
    fn as_f16(s: &[Self]) -> Option<&[f16]> {
        Some(s)
    }
}

#[derive(Debug, Clone, Copy)]
pub struct AttnParams {
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub block_size: usize,
    pub scale: f32,
    /// Round Q and the V accumulator to f16 after every step, as llama.cpp's CPU flash attention
    /// does with an f16 cache for decode and short prompts (`ggml_compute_forward_flash_attn_ext_f16_one_chunk`).
    /// Less exact than f32 math, but it makes greedy paths track llama.cpp's at near-ties.
    pub f16_accum: bool,
    /// Sliding window (Mistral): a query at position `p` attends keys at positions `j` with
    /// `p - w < j <= p` only. This is transformers' convention for Mistral and Qwen2
    /// (`masking_utils.sliding_window_overlay`: `kv_idx > q_idx - sliding_window`; before that,
    /// `_prepare_4d_causal_attention_mask_with_sliding_window` masked `j <= p - w`). `None`: all
    /// keys `0..=p`.
    pub sliding_window: Option<usize>,
}

impl AttnParams {
    /// First key position a query at `pos` attends.
    #[inline]
    pub fn first_key(&self, pos: usize) -> usize {
        self.sliding_window
            .map_or(0, |w| (pos + 1).saturating_sub(w))
    }
}

/// Largest block size × GQA group the stack score buffer holds.
const MAX_SCORES: usize = 128 * 16;

/// Writes the new K/V rows into their slots, then attends every query token to its sequence's
/// cached tokens `0..=pos` (causal; `first_key(pos)..=pos` with a sliding window).
// q: [num_tokens, q_stride] with heads at q[.., 0..num_heads*head_dim]
// k_new, v_new: [num_tokens, kv_stride] with heads at [.., 0..num_kv_heads*head_dim]
// k_cache, v_cache: [num_blocks * block_size, num_kv_heads, head_dim]
// out: [num_tokens, num_heads * head_dim]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: KvElem>(
    par: &dyn super::team::Parallel,
    p: &AttnParams,
    q: &[f32],
    q_stride: usize,
    k_new: &[f32],
    v_new: &[f32],
    kv_stride: usize,
    slot_mapping: &[u32],
    seqs: &[SeqBatch],
    k_cache: &mut [T],
    v_cache: &mut [T],
    out: &mut [f32],
) {
    paged_attention_math(
        par,
        CpuMath::Exact,
        p,
        q,
        q_stride,
        k_new,
        v_new,
        kv_stride,
        slot_mapping,
        seqs,
        k_cache,
        v_cache,
        out,
    )
}

/// `paged_attention` in arithmetic mode `math`: with `CpuMath::Fast` every query row (decode
/// steps and prompt chunks alike) goes through the fast one-row kernel (`fast`); with
/// `CpuMath::Exact`, through the llama.cpp-equal kernels.
#[allow(clippy::too_many_arguments)]
pub fn paged_attention_math<T: KvElem>(
    par: &dyn super::team::Parallel,
    math: CpuMath,
    p: &AttnParams,
    q: &[f32],
    q_stride: usize,
    k_new: &[f32],
    v_new: &[f32],
    kv_stride: usize,
    slot_mapping: &[u32],
    seqs: &[SeqBatch],
    k_cache: &mut [T],
    v_cache: &mut [T],
    out: &mut [f32],
) {
    let kv_row = p.num_kv_heads * p.head_dim;
    // The fused KV write.
    for (t, &slot) in slot_mapping.iter().enumerate() {
        let dst = slot as usize * kv_row;
        for i in 0..kv_row {
            k_cache[dst + i] = T::from_f32(k_new[t * kv_stride + i]);
            v_cache[dst + i] = T::from_f32(v_new[t * kv_stride + i]);
        }
    }
    let group = p.num_heads / p.num_kv_heads;
    assert!(p.head_dim <= 256, "head_dim above 256");
    assert!(
        p.block_size * group <= MAX_SCORES,
        "block_size × GQA group too large"
    );
    let q_row = p.num_heads * p.head_dim;
    debug_assert_eq!(out.len(), slot_mapping.len() * q_row);
    let k_cache: &[T] = k_cache;
    let v_cache: &[T] = v_cache;
    let isa = fast::Isa::detect();
    let isa = if isa.supports(p.head_dim) {
        isa
    } else {
        fast::Isa::Scalar
    };
    if math == CpuMath::Fast && p.head_dim <= 256 {
        // Every query row, of a prompt chunk or of a decode step, goes through the same one-row
        // kernel: a row's result then depends only on its query and its keys, not on how the
        // scheduler cut the prompt (a prefix-cache hit can leave a prompt's last token alone in
        // its step) nor on what else is in the batch.
        let rows: Vec<SeqBatch> = seqs
            .iter()
            .flat_map(|s| {
                (0..s.query_len).map(move |i| SeqBatch {
                    query_start: s.query_start + i,
                    query_len: 1,
                    seq_len: s.seq_len - s.query_len + i + 1,
                    block_table: s.block_table,
                })
            })
            .collect();
        fast::decode_attention(par, isa, p, q, q_stride, &rows, k_cache, v_cache, out);
        return;
    }
    #[cfg(target_arch = "x86_64")]
    if p.f16_accum && p.sliding_window.is_none() && tiled::supports(p.head_dim) {
        if let (Some(k), Some(v)) = (T::as_f16(k_cache), T::as_f16(v_cache)) {
            attend_tiled(par, p, q, q_stride, seqs, k, v, out);
            return;
        }
    }
    attend_one_row(
        par,
        p,
        q,
        q_stride,
        slot_mapping.len(),
        seqs,
        k_cache,
        v_cache,
        out,
    );
}

/// Every query token × KV group by `attend_group` or `attend_group_f16_accum`: the reference the
/// tiled kernel is tested against, and the path for what it does not handle.
#[allow(clippy::too_many_arguments)]
fn attend_one_row<T: KvElem>(
    par: &dyn super::team::Parallel,
    p: &AttnParams,
    q: &[f32],
    q_stride: usize,
    num_tokens: usize,
    seqs: &[SeqBatch],
    k_cache: &[T],
    v_cache: &[T],
    out: &mut [f32],
) {
    let group = p.num_heads / p.num_kv_heads;
    // One work item per (token, kv head): it owns `group` contiguous heads of `out`. Tasks take
    // runs of items; a decode's few items go one per task.
    let items = num_tokens * p.num_kv_heads;
    let per_task = items.div_ceil(par.threads() * 8).max(1);
    let o = super::team::DisjointPtr::new(out);
    let width = group * p.head_dim;
    par.run_tasks(items.div_ceil(per_task), &|task| {
        for item in task * per_task..((task + 1) * per_task).min(items) {
            // SAFETY: each item writes only its own `width` slice; item < items so it is inside `out`.
            let o = unsafe { std::slice::from_raw_parts_mut(o.at(item * width), width) };
            let t = item / p.num_kv_heads;
            let kvh = item % p.num_kv_heads;
            // Tokens of no listed sequence were computed by the fast decode kernel.
            let Some(seq) = seqs
                .iter()
                .find(|s| t >= s.query_start && t < s.query_start + s.query_len)
            else {
                continue;
            };
            let pos = seq.seq_len - seq.query_len + (t - seq.query_start);
            let qh = &q[t * q_stride + kvh * group * p.head_dim..][..group * p.head_dim];
            let keys = p.first_key(pos)..pos + 1;
            if p.f16_accum {
                attend_group_f16_accum(p, qh, seq.block_table, keys, kvh, k_cache, v_cache, o);
            } else {
                attend_group(p, qh, seq.block_table, keys, kvh, k_cache, v_cache, o);
            }
        }
    });
}

/// The f16-accumulator path by tiles (`tiled`): each sequence's new tokens in runs of
/// `tile_tokens`, per KV head. A lone decode token is split further, one tile per query head, so
/// that a single sequence still spreads over the threads. Tiles go to the threads largest first
/// (cost ∝ rows × keys), one per task, which balances a causal prefill's growing rows.
#[cfg(target_arch = "x86_64")]
#[allow(clippy::too_many_arguments)]
fn attend_tiled(
    par: &dyn super::team::Parallel,
    p: &AttnParams,
    q: &[f32],
    q_stride: usize,
    seqs: &[SeqBatch],
    k_cache: &[f16],
    v_cache: &[f16],
    out: &mut [f32],
) {
    let group = p.num_heads / p.num_kv_heads;
    let per_tile = tiled::tile_tokens(group);
    // (cost, seq, first token of the tile in the sequence's chunk, tokens, first head, heads)
    let mut tiles: Vec<(usize, usize, usize, usize, usize, usize)> = Vec::new();
    let tokens: usize = seqs.iter().map(|s| s.query_len).sum();
    let split_heads = tokens * p.num_kv_heads < 2 * par.threads();
    for (si, s) in seqs.iter().enumerate() {
        let past = s.seq_len - s.query_len;
        for i0 in (0..s.query_len).step_by(per_tile) {
            let n = per_tile.min(s.query_len - i0);
            let cost = n * (past + i0 + n);
            for kvh in 0..p.num_kv_heads {
                if split_heads {
                    for g in 0..group {
                        tiles.push((cost, si, i0, n, kvh * group + g, 1));
                    }
                } else {
                    tiles.push((cost * group, si, i0, n, kvh * group, group));
                }
            }
        }
    }
    tiles.sort_by_key(|t| std::cmp::Reverse(t.0));
    let o = super::team::DisjointPtr::new(out);
    let q_row = p.num_heads * p.head_dim;
    par.run_tasks(tiles.len(), &|task| {
        let (_, si, i0, n, h0, nh) = tiles[task];
        let s = &seqs[si];
        let t = tiled::Tile {
            q,
            q_stride,
            t0: s.query_start + i0,
            ntok: n,
            g0: h0 % group,
            ng: nh,
            ctx0: s.seq_len - s.query_len + i0 + 1,
            block_table: s.block_table,
            kvh: h0 / group,
        };
        // SAFETY: `attend_tiled` is only called when `tiled::supports` holds; each tile writes
        // only its own heads of its own tokens, rows inside `out`.
        unsafe { tiled::attend_tile(p, &t, k_cache, v_cache, o.at(0), q_row) };
    });
}

/// Attention of `group` query heads (sharing KV head `kvh`) over the cached tokens at positions
/// `keys` (`0..ctx`, or a sliding window's tail of it).
#[allow(clippy::too_many_arguments)]
#[inline]
fn attend_group<T: KvElem>(
    p: &AttnParams,
    q: &[f32], // [group, head_dim]
    block_table: &[quire_core::BlockId],
    keys: std::ops::Range<usize>,
    kvh: usize,
    k_cache: &[T],
    v_cache: &[T],
    out: &mut [f32], // [group, head_dim]
) {
    let d = p.head_dim;
    let group = q.len() / d;
    let kv_row = p.num_kv_heads * d;
    let mut m = [f32::NEG_INFINITY; 16];
    let mut l = [0f32; 16];
    out.fill(0.0);
    let mut scores = [0f32; MAX_SCORES];
    let ctx = keys.end;
    let nblocks = ctx.div_ceil(p.block_size);
    let simd = super::quant::has_avx2() && d.is_multiple_of(32);
    let mut buf = [0f32; 256];
    let first_block = keys.start / p.block_size;
    for (bi, block) in block_table[..nblocks].iter().enumerate().skip(first_block) {
        let n = (ctx - bi * p.block_size).min(p.block_size);
        // Keys before the window in the window's first block.
        let j0 = keys.start.saturating_sub(bi * p.block_size);
        let base = block.as_usize() * p.block_size;
        for j in j0..n {
            let row = (base + j) * kv_row + kvh * d;
            let k = row_f32(&k_cache[row..row + d], &mut buf, simd);
            for g in 0..group {
                let qg = &q[g * d..(g + 1) * d];
                let s = if simd {
                    // SAFETY: features checked; d is a multiple of 32.
                    unsafe { simd::dot(qg, k) }
                } else {
                    dot_ggml_order(qg, k)
                };
                scores[g * p.block_size + j] = s * p.scale;
            }
        }
        for g in 0..group {
            let sc = &scores[g * p.block_size + j0..g * p.block_size + n];
            let bmax = sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let new_m = m[g].max(bmax);
            let corr = (m[g] - new_m).exp();
            if corr != 1.0 {
                out[g * d..(g + 1) * d].iter_mut().for_each(|v| *v *= corr);
            }
            l[g] *= corr;
            m[g] = new_m;
        }
        for j in j0..n {
            let row = (base + j) * kv_row + kvh * d;
            let v = row_f32(&v_cache[row..row + d], &mut buf, simd);
            for g in 0..group {
                let w = (scores[g * p.block_size + j] - m[g]).exp();
                l[g] += w;
                for (o, &vv) in out[g * d..(g + 1) * d].iter_mut().zip(v) {
                    *o += w * vv;
                }
            }
        }
    }
    for g in 0..group {
        let inv = 1.0 / l[g];
        out[g * d..(g + 1) * d].iter_mut().for_each(|v| *v *= inv);
    }
}

/// A cache row as f32: the row itself when stored in f32, else converted into `buf`.
#[inline(always)]
fn row_f32<'a, T: KvElem>(row: &'a [T], buf: &'a mut [f32; 256], simd: bool) -> &'a [f32] {
    if let Some(f) = T::as_f32(row) {
        return f;
    }
    let d = row.len();
    match T::as_f16(row) {
        // SAFETY: `simd` means AVX2/F16C are present and d is a multiple of 32.
        Some(h) if simd => unsafe { simd::f16_to_f32(h, &mut buf[..d]) },
        _ => {
            for (a, b) in buf[..d].iter_mut().zip(row) {
                *a = b.to_f32();
            }
        }
    }
    &buf[..d]
}

/// The f16-accumulator variant: token by token, each query head's running maximum `m`, sum `l`
/// and output accumulator (f16 values, rounded after every scale and multiply-add) are updated in
/// the order ggml's one-chunk flash attention uses, with Q rounded to f16 first.
#[allow(clippy::too_many_arguments)]
fn attend_group_f16_accum<T: KvElem>(
    p: &AttnParams,
    q: &[f32], // [group, head_dim]
    block_table: &[quire_core::BlockId],
    keys: std::ops::Range<usize>,
    kvh: usize,
    k_cache: &[T],
    v_cache: &[T],
    out: &mut [f32], // [group, head_dim]
) {
    const MAX_D: usize = 256;
    const MAX_G: usize = 16;
    let d = p.head_dim;
    assert!(d <= MAX_D, "head_dim above {MAX_D}");
    let group = q.len() / d;
    let kv_row = p.num_kv_heads * d;
    let mut q16 = [0f32; MAX_G * MAX_D];
    let mut acc = [0f32; MAX_G * MAX_D]; // always holds f16-representable values
    let mut k32 = [0f32; MAX_D];
    let mut v32 = [0f32; MAX_D];
    for (a, &b) in q16[..group * d].iter_mut().zip(q) {
        *a = f16::from_f32(b).to_f32();
    }
    let mut m = [f32::NEG_INFINITY; MAX_G];
    let mut l = [0f32; MAX_G];
    let simd = super::quant::has_avx2() && d.is_multiple_of(32);
    for j in keys {
        let slot = block_table[j / p.block_size].as_usize() * p.block_size + j % p.block_size;
        let row = slot * kv_row + kvh * d;
        match (
            T::as_f16(&k_cache[row..row + d]),
            T::as_f16(&v_cache[row..row + d]),
        ) {
            (Some(k), Some(v)) if simd => {
                // SAFETY: `has_avx2()` checked AVX2, FMA and F16C.
                unsafe {
                    simd::f16_to_f32(k, &mut k32[..d]);
                    simd::f16_to_f32(v, &mut v32[..d]);
                }
            }
            _ => {
                for (a, b) in k32[..d].iter_mut().zip(&k_cache[row..row + d]) {
                    *a = b.to_f32();
                }
                for (a, b) in v32[..d].iter_mut().zip(&v_cache[row..row + d]) {
                    *a = b.to_f32();
                }
            }
        }
        for g in 0..group {
            let qg = &q16[g * d..(g + 1) * d];
            let ag = &mut acc[g * d..(g + 1) * d];
            let s = if simd {
                // SAFETY: as above; d is a multiple of 32.
                unsafe { simd::dot(qg, &k32[..d]) }
            } else {
                dot_ggml_order(qg, &k32[..d])
            } * p.scale;
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > m[g] {
                ms = (m[g] - s).exp();
                m[g] = s;
                if simd {
                    // SAFETY: as above.
                    unsafe { simd::scale_round(ag, ms) };
                } else {
                    ag.iter_mut()
                        .for_each(|a| *a = f16::from_f32(*a * ms).to_f32());
                }
            } else {
                vs = (s - m[g]).exp();
            }
            if simd {
                // SAFETY: as above.
                unsafe { simd::mad_round(ag, &v32[..d], vs) };
            } else {
                for (a, &v) in ag.iter_mut().zip(&v32[..d]) {
                    *a = f16::from_f32(v.mul_add(vs, *a)).to_f32();
                }
            }
            l[g] = l[g].mul_add(ms, vs); // contracted, as GCC compiles ggml's `S*ms + vs`
        }
    }
    for g in 0..group {
        let inv = if l[g] == 0.0 { 0.0 } else { 1.0 / l[g] };
        for (o, a) in out[g * d..(g + 1) * d]
            .iter_mut()
            .zip(&acc[g * d..(g + 1) * d])
        {
            *o = a * inv;
        }
    }
}

/// f32 dot product summed as ggml's AVX2 `ggml_vec_dot_f16` does: four 8-lane accumulators over
/// steps of 32, folded (0+2, 1+3, 0+1), then the 8 lanes pairwise.
fn dot_ggml_order(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [[0f32; 8]; 4];
    let np = a.len() / 32 * 32;
    for i in (0..np).step_by(32) {
        for (j, accj) in acc.iter_mut().enumerate() {
            for (l, v) in accj.iter_mut().enumerate() {
                *v = a[i + j * 8 + l].mul_add(b[i + j * 8 + l], *v);
            }
        }
    }
    let mut r = [0f32; 8];
    for l in 0..8 {
        r[l] = (acc[0][l] + acc[2][l]) + (acc[1][l] + acc[3][l]);
    }
    let t: [f32; 4] = [r[0] + r[4], r[1] + r[5], r[2] + r[6], r[3] + r[7]];
    let mut s = (t[0] + t[1]) + (t[2] + t[3]);
    for i in np..a.len() {
        s += a[i] * b[i];
    }
    s
}

#[cfg(target_arch = "x86_64")]
mod simd {
    use half::f16;
    use std::arch::x86_64::*;

    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn f16_to_f32(src: &[f16], dst: &mut [f32]) {
        for i in (0..dst.len()).step_by(8) {
            let h = _mm_loadu_si128(src.as_ptr().add(i) as *const __m128i);
            _mm256_storeu_ps(dst.as_mut_ptr().add(i), _mm256_cvtph_ps(h));
        }
    }

    #[inline(always)]
    unsafe fn round16(x: __m256) -> __m256 {
        _mm256_cvtph_ps(_mm256_cvtps_ph::<_MM_FROUND_TO_NEAREST_INT>(x))
    }

    /// `acc = f16(acc * s)`
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn scale_round(acc: &mut [f32], s: f32) {
        let sv = _mm256_set1_ps(s);
        for i in (0..acc.len()).step_by(8) {
            let p = acc.as_mut_ptr().add(i);
            _mm256_storeu_ps(p, round16(_mm256_mul_ps(_mm256_loadu_ps(p), sv)));
        }
    }

    /// `acc = f16(v * s + acc)` with one rounding for the multiply-add.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn mad_round(acc: &mut [f32], v: &[f32], s: f32) {
        let sv = _mm256_set1_ps(s);
        for i in (0..acc.len()).step_by(8) {
            let p = acc.as_mut_ptr().add(i);
            let r = _mm256_fmadd_ps(_mm256_loadu_ps(v.as_ptr().add(i)), sv, _mm256_loadu_ps(p));
            _mm256_storeu_ps(p, round16(r));
        }
    }

    /// The same summation order as `dot_ggml_order`; `a.len()` a multiple of 32.
    #[target_feature(enable = "avx2,fma,f16c")]
    pub unsafe fn dot(a: &[f32], b: &[f32]) -> f32 {
        let mut s = [_mm256_setzero_ps(); 4];
        for i in (0..a.len()).step_by(32) {
            for (j, sj) in s.iter_mut().enumerate() {
                let x = _mm256_loadu_ps(a.as_ptr().add(i + j * 8));
                let y = _mm256_loadu_ps(b.as_ptr().add(i + j * 8));
                *sj = _mm256_fmadd_ps(x, y, *sj);
            }
        }
        let r = _mm256_add_ps(_mm256_add_ps(s[0], s[2]), _mm256_add_ps(s[1], s[3]));
        let t = _mm_add_ps(_mm256_castps256_ps128(r), _mm256_extractf128_ps::<1>(r));
        let h = _mm_hadd_ps(t, t);
        _mm_cvtss_f32(_mm_hadd_ps(h, h))
    }
}

#[cfg(not(target_arch = "x86_64"))]
mod simd {
    use half::f16;
    pub unsafe fn f16_to_f32(_: &[f16], _: &mut [f32]) {}
    pub unsafe fn scale_round(_: &mut [f32], _: f32) {}
    pub unsafe fn mad_round(_: &mut [f32], _: &[f32], _: f32) {}
    pub unsafe fn dot(_: &[f32], _: &[f32]) -> f32 {
        0.0
    }
}

/// Dense f64 attention of one sequence, the reference for the parity tests and `attn-bench`.
// q: [query_len, num_heads, head_dim]; k, v: [seq_len, num_kv_heads, head_dim]
// returns [query_len, num_heads, head_dim]
pub fn dense_reference(
    p: &AttnParams,
    q: &[f32],
    k: &[f32],
    v: &[f32],
    seq_len: usize,
) -> Vec<f64> {
    let d = p.head_dim;
    let group = p.num_heads / p.num_kv_heads;
    let query_len = q.len() / (p.num_heads * d);
    let mut out = vec![0f64; q.len()];
    for t in 0..query_len {
        let ctx = seq_len - query_len + t + 1;
        let lo = p.first_key(ctx - 1);
        for h in 0..p.num_heads {
            let kvh = h / group;
            let qh = &q[(t * p.num_heads + h) * d..][..d];
            let scores: Vec<f64> = (lo..ctx)
                .map(|j| {
                    let kj = &k[(j * p.num_kv_heads + kvh) * d..][..d];
                    qh.iter()
                        .zip(kj)
                        .map(|(&a, &b)| a as f64 * b as f64)
                        .sum::<f64>()
                        * p.scale as f64
                })
                .collect();
            let mx = scores.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
            let w: Vec<f64> = scores.iter().map(|s| (s - mx).exp()).collect();
            let z: f64 = w.iter().sum();
            let o = &mut out[(t * p.num_heads + h) * d..][..d];
            for (j, wj) in (lo..ctx).zip(&w) {
                let vj = &v[(j * p.num_kv_heads + kvh) * d..][..d];
                for (oo, &vv) in o.iter_mut().zip(vj) {
                    *oo += wj / z * vv as f64;
                }
            }
        }
    }
    out
}

#[cfg(target_arch = "x86_64")]
mod expf;
pub mod fast;
#[cfg(test)]
mod tests;
#[cfg(target_arch = "x86_64")]
mod tiled;
#[cfg(all(test, target_arch = "x86_64"))]
mod tiled_tests;
