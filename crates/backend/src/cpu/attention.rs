//! Paged attention on the CPU, with the step's new K and V written into their cache slots by the
//! same call (the fused KV write). K and V are read through each sequence's block table, one block
//! at a time, with an online softmax, so no score buffer grows with the context. All query heads
//! of a KV group are handled together so each K/V row is read once per group.

use half::f16;
use rayon::prelude::*;

use crate::SeqBatch;

/// Storage type of the KV cache; math is always f32.
pub trait KvElem: Copy + Send + Sync + 'static {
    fn to_f32(self) -> f32;
    fn from_f32(v: f32) -> Self;
    const NAME: &'static str;
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
}

/// Largest block size × GQA group the stack score buffer holds.
const MAX_SCORES: usize = 128 * 16;

/// Writes the new K/V rows into their slots, then attends every query token to its sequence's
/// cached tokens `0..=pos` (causal).
// q: [num_tokens, q_stride] with heads at q[.., 0..num_heads*head_dim]
// k_new, v_new: [num_tokens, kv_stride] with heads at [.., 0..num_kv_heads*head_dim]
// k_cache, v_cache: [num_blocks * block_size, num_kv_heads, head_dim]
// out: [num_tokens, num_heads * head_dim]
#[allow(clippy::too_many_arguments)]
pub fn paged_attention<T: KvElem>(
    pool: &rayon::ThreadPool,
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
    assert!(
        p.block_size * group <= MAX_SCORES,
        "block_size × GQA group too large"
    );
    let q_row = p.num_heads * p.head_dim;
    let k_cache: &[T] = k_cache;
    let v_cache: &[T] = v_cache;
    // One work item per (token, kv head): it owns `group` contiguous heads of `out`.
    pool.install(|| {
        out.par_chunks_mut(group * p.head_dim)
            .enumerate()
            .for_each(|(item, o)| {
                let t = item / p.num_kv_heads;
                let kvh = item % p.num_kv_heads;
                let seq = seqs
                    .iter()
                    .find(|s| t >= s.query_start && t < s.query_start + s.query_len)
                    .expect("validated batch");
                let pos = seq.seq_len - seq.query_len + (t - seq.query_start);
                let qh = &q[t * q_stride + kvh * group * p.head_dim..][..group * p.head_dim];
                if p.f16_accum {
                    attend_group_f16_accum(p, qh, seq.block_table, pos + 1, kvh, k_cache, v_cache, o);
                } else {
                    attend_group(p, qh, seq.block_table, pos + 1, kvh, k_cache, v_cache, o);
                }
            });
    });
    debug_assert_eq!(out.len(), slot_mapping.len() * q_row);
}

/// Attention of `group` query heads (sharing KV head `kvh`) over the first `ctx` cached tokens.
#[allow(clippy::too_many_arguments)]
#[inline]
fn attend_group<T: KvElem>(
    p: &AttnParams,
    q: &[f32], // [group, head_dim]
    block_table: &[quire_core::BlockId],
    ctx: usize,
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
    let nblocks = ctx.div_ceil(p.block_size);
    for (bi, block) in block_table[..nblocks].iter().enumerate() {
        let n = (ctx - bi * p.block_size).min(p.block_size);
        let base = block.as_usize() * p.block_size;
        for j in 0..n {
            let k = &k_cache[(base + j) * kv_row + kvh * d..][..d];
            for g in 0..group {
                let qg = &q[g * d..(g + 1) * d];
                let mut s = 0f32;
                for (a, b) in qg.iter().zip(k) {
                    s += a * b.to_f32();
                }
                scores[g * p.block_size + j] = s * p.scale;
            }
        }
        for g in 0..group {
            let sc = &mut scores[g * p.block_size..g * p.block_size + n];
            let bmax = sc.iter().fold(f32::NEG_INFINITY, |a, &b| a.max(b));
            let new_m = m[g].max(bmax);
            let corr = (m[g] - new_m).exp();
            let og = &mut out[g * d..(g + 1) * d];
            if corr != 1.0 {
                og.iter_mut().for_each(|v| *v *= corr);
            }
            l[g] *= corr;
            for (j, s) in sc.iter_mut().enumerate() {
                let w = (*s - new_m).exp();
                l[g] += w;
                let v = &v_cache[(base + j) * kv_row + kvh * d..][..d];
                for (o, vv) in og.iter_mut().zip(v) {
                    *o += w * vv.to_f32();
                }
            }
            m[g] = new_m;
        }
    }
    for g in 0..group {
        let inv = 1.0 / l[g];
        out[g * d..(g + 1) * d].iter_mut().for_each(|v| *v *= inv);
    }
}

/// The f16-accumulator variant: token by token, each query head's running maximum `m`, sum `l`
/// and output accumulator (kept in f16, rounded after every scale and multiply-add) are updated
/// in the order ggml's one-chunk flash attention uses, with Q rounded to f16 first.
#[allow(clippy::too_many_arguments)]
fn attend_group_f16_accum<T: KvElem>(
    p: &AttnParams,
    q: &[f32], // [group, head_dim]
    block_table: &[quire_core::BlockId],
    ctx: usize,
    kvh: usize,
    k_cache: &[T],
    v_cache: &[T],
    out: &mut [f32], // [group, head_dim]
) {
    const MAX_D: usize = 256;
    let d = p.head_dim;
    assert!(d <= MAX_D, "head_dim above {MAX_D}");
    let group = q.len() / d;
    let kv_row = p.num_kv_heads * d;
    let mut q16 = [0f32; MAX_D];
    let mut acc = [f16::ZERO; MAX_D];
    let mut acc32 = [0f32; MAX_D];
    let mut v32 = [0f32; MAX_D];
    let mut k32 = [0f32; MAX_D];
    for g in 0..group {
        for (a, &b) in q16[..d].iter_mut().zip(&q[g * d..(g + 1) * d]) {
            *a = f16::from_f32(b).to_f32();
        }
        acc[..d].fill(f16::ZERO);
        let (mut m, mut l) = (f32::NEG_INFINITY, 0f32);
        for j in 0..ctx {
            let slot = block_table[j / p.block_size].as_usize() * p.block_size + j % p.block_size;
            let row = slot * kv_row + kvh * d;
            for (a, b) in k32[..d].iter_mut().zip(&k_cache[row..row + d]) {
                *a = b.to_f32();
            }
            let s = dot8(&q16[..d], &k32[..d]) * p.scale;
            let (mut ms, mut vs) = (1f32, 1f32);
            if s > m {
                ms = (m - s).exp();
                m = s;
                for a in acc[..d].iter_mut() {
                    *a = f16::from_f32(a.to_f32() * ms);
                }
            } else {
                vs = (s - m).exp();
            }
            for (a, b) in v32[..d].iter_mut().zip(&v_cache[row..row + d]) {
                *a = b.to_f32();
            }
            for ((a, &v), a32) in acc[..d].iter_mut().zip(&v32[..d]).zip(acc32.iter_mut()) {
                *a32 = v.mul_add(vs, a.to_f32());
                *a = f16::from_f32(*a32);
            }
            l = l * ms + vs;
        }
        let inv = if l == 0.0 { 0.0 } else { 1.0 / l };
        for (o, a) in out[g * d..(g + 1) * d].iter_mut().zip(&acc[..d]) {
            *o = a.to_f32() * inv;
        }
    }
}

/// f32 dot product with eight interleaved partial sums (the summation order of 256-bit SIMD).
#[inline(always)]
fn dot8(a: &[f32], b: &[f32]) -> f32 {
    let mut acc = [0f32; 8];
    let chunks = a.len() / 8;
    for c in 0..chunks {
        for i in 0..8 {
            acc[i] = a[c * 8 + i].mul_add(b[c * 8 + i], acc[i]);
        }
    }
    let mut s = (acc[0] + acc[4]) + (acc[1] + acc[5]) + (acc[2] + acc[6]) + (acc[3] + acc[7]);
    for i in chunks * 8..a.len() {
        s += a[i] * b[i];
    }
    s
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
        for h in 0..p.num_heads {
            let kvh = h / group;
            let qh = &q[(t * p.num_heads + h) * d..][..d];
            let scores: Vec<f64> = (0..ctx)
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
            for (j, wj) in w.iter().enumerate() {
                let vj = &v[(j * p.num_kv_heads + kvh) * d..][..d];
                for (oo, &vv) in o.iter_mut().zip(vj) {
                    *oo += wj / z * vv as f64;
                }
            }
        }
    }
    out
}

#[cfg(test)]
mod tests;
