//! The random paged batch every attention test builds its inputs from, so the CPU and GPU
//! kernels are tested on the same kind of data: sequences whose blocks are scattered through the
//! cache by a seeded shuffle (block tables are never contiguous runs, and spare blocks sit
//! between them), and every cache slot that holds no key or value poisoned with NaN, so a kernel
//! that reads outside a sequence's table, past its length or before its window fails the test.
//!
//! The caller chooses the sequences' lengths (odd ones, chunks on top of cached contexts, fresh
//! prompts and decode rows in one batch) and the storage type of the cache (f32 or f16); keys and
//! values are uniform in [-1, 1] and rounded through the storage type, so the dense copies the
//! reference reads hold exactly what the cache holds.

use half::f16;
use quire_core::BlockId;
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::Rng;

/// A KV-cache element type.
pub trait CacheElem: Copy {
    fn from_f32(x: f32) -> Self;
    fn to_f32(self) -> f32;
}

impl CacheElem for f32 {
    fn from_f32(x: f32) -> Self {
        x
    }
    fn to_f32(self) -> f32 {
        self
    }
}

impl CacheElem for f16 {
    fn from_f32(x: f32) -> Self {
        f16::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        f16::to_f32(self)
    }
}

/// What to generate.
#[derive(Debug, Clone)]
pub struct PagedCase {
    pub block_size: usize,
    /// Elements of one token's K (or V) row: KV heads × head dim.
    pub kv_row: usize,
    /// (tokens already cached, new tokens) of each sequence; new > 0.
    pub seqs: Vec<(usize, usize)>,
    /// Blocks beyond those the sequences need: they stay poisoned, shuffled among the others.
    pub spare_blocks: usize,
    /// With a sliding window, cached keys before the first one the batch's first query of a
    /// sequence attends are left NaN: a kernel must never read them.
    pub window: Option<usize>,
    /// Write the new tokens' K/V into the cache too (tests of attention over a filled cache);
    /// otherwise their slots stay NaN for the kernel's own write.
    pub new_in_cache: bool,
}

impl PagedCase {
    /// `seqs` with 5 spare blocks, no window, new tokens' slots left for the kernel.
    pub fn new(block_size: usize, kv_row: usize, seqs: &[(usize, usize)]) -> Self {
        Self {
            block_size,
            kv_row,
            seqs: seqs.to_vec(),
            spare_blocks: 5,
            window: None,
            new_in_cache: false,
        }
    }
}

/// One sequence of a [`PagedBatch`].
#[derive(Debug, Clone)]
pub struct PagedSeq {
    /// Index of its first new token in the flat batch.
    pub query_start: usize,
    pub query_len: usize,
    /// Tokens in the cache after the step (cached + new).
    pub seq_len: usize,
    /// Its blocks, in logical order.
    pub block_table: Vec<BlockId>,
    /// Keys and values of positions `0..seq_len`, `[seq_len, kv_row]`, as the cache stores them.
    pub keys: Vec<f32>,
    pub values: Vec<f32>,
}

/// The generated batch (build a `quire_backend::SeqBatch` per [`PagedSeq`] from it).
#[derive(Debug, Clone)]
pub struct PagedBatch<T> {
    pub num_blocks: usize,
    pub seqs: Vec<PagedSeq>,
    /// Position and cache slot of each new token, in batch order.
    pub positions: Vec<u32>,
    pub slot_mapping: Vec<u32>,
    /// The new tokens' K and V rows, `[tokens, kv_row]`, in batch order.
    pub k_new: Vec<f32>,
    pub v_new: Vec<f32>,
    /// `[num_blocks * block_size, kv_row]`: the cached tokens' rows; every other slot NaN.
    pub k_cache: Vec<T>,
    pub v_cache: Vec<T>,
}

impl<T> PagedBatch<T> {
    /// New tokens in the batch.
    pub fn tokens(&self) -> usize {
        self.positions.len()
    }
}

impl PagedCase {
    pub fn generate<T: CacheElem>(&self, rng: &mut StdRng) -> PagedBatch<T> {
        let (bs, row) = (self.block_size, self.kv_row);
        assert!(
            bs > 0 && self.seqs.iter().all(|s| s.1 > 0),
            "bad case {self:?}"
        );
        let needed: usize = self.seqs.iter().map(|(a, b)| (a + b).div_ceil(bs)).sum();
        let num_blocks = needed + self.spare_blocks;
        let mut ids: Vec<u32> = (0..num_blocks as u32).collect();
        ids.shuffle(rng);
        let nan = T::from_f32(f32::NAN);
        let mut b = PagedBatch {
            num_blocks,
            seqs: Vec::with_capacity(self.seqs.len()),
            positions: vec![],
            slot_mapping: vec![],
            k_new: vec![],
            v_new: vec![],
            k_cache: vec![nan; num_blocks * bs * row],
            v_cache: vec![nan; num_blocks * bs * row],
        };
        let (mut next, mut start) = (0, 0);
        for &(cached, new) in &self.seqs {
            let len = cached + new;
            let n = len.div_ceil(bs);
            let block_table: Vec<BlockId> =
                ids[next..next + n].iter().map(|&i| BlockId(i)).collect();
            next += n;
            let mut draw = || -> Vec<f32> {
                (0..len * row)
                    .map(|_| T::from_f32(rng.random_range(-1.0..1.0)).to_f32())
                    .collect()
            };
            let (keys, values) = (draw(), draw());
            let first = self.window.map_or(0, |w| (cached + 1).saturating_sub(w));
            let last = if self.new_in_cache { len } else { cached };
            for pos in first..last {
                let slot = quire_core::slot(&block_table, pos, bs);
                for i in 0..row {
                    b.k_cache[slot * row + i] = T::from_f32(keys[pos * row + i]);
                    b.v_cache[slot * row + i] = T::from_f32(values[pos * row + i]);
                }
            }
            for pos in cached..len {
                b.positions.push(pos as u32);
                let slot = quire_core::slot(&block_table, pos, bs);
                b.slot_mapping.push(slot as u32);
            }
            b.k_new.extend_from_slice(&keys[cached * row..]);
            b.v_new.extend_from_slice(&values[cached * row..]);
            b.seqs.push(PagedSeq {
                query_start: start,
                query_len: new,
                seq_len: len,
                block_table,
                keys,
                values,
            });
            start += new;
        }
        b
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::SeedableRng;

    #[test]
    fn tables_are_scattered_and_unused_slots_are_nan() {
        let case = PagedCase {
            window: Some(40),
            ..PagedCase::new(16, 3, &[(100, 1), (0, 37), (63, 13)])
        };
        let mut rng = StdRng::seed_from_u64(1);
        let b: PagedBatch<f16> = case.generate(&mut rng);
        let all: Vec<u32> = b
            .seqs
            .iter()
            .flat_map(|s| s.block_table.iter().map(|x| x.0))
            .collect();
        let mut sorted = all.clone();
        sorted.sort_unstable();
        sorted.dedup();
        assert_eq!(sorted.len(), all.len(), "a block is shared");
        assert_ne!(
            all,
            (0..all.len() as u32).collect::<Vec<_>>(),
            "tables are contiguous"
        );
        // Written: seq 0 positions 61..100 (window 40 before position 100), seq 2 positions
        // 24..63; nothing of seq 1 (a fresh prompt) nor any new token's slot.
        let written = (100 - 61) + (63 - 24);
        let finite = b.k_cache.iter().filter(|x| x.is_finite()).count();
        assert_eq!(finite, written * 3);
        assert_eq!(b.tokens(), 1 + 37 + 13);
        assert_eq!(b.k_new.len(), b.tokens() * 3);
        for (s, (&pos, &slot)) in b.positions.iter().zip(&b.slot_mapping).enumerate().take(1) {
            let t = &b.seqs[0].block_table;
            assert_eq!(slot, t[pos as usize / 16].0 * 16 + pos % 16, "token {s}");
        }
        // Values are exactly what the f16 cache stores.
        let s0 = &b.seqs[0];
        let slot = s0.block_table[70 / 16].as_usize() * 16 + 70 % 16;
        assert_eq!(b.k_cache[slot * 3 + 1].to_f32(), s0.keys[70 * 3 + 1]);
        // Seeded: the same case gives the same batch.
        let again: PagedBatch<f16> = case.generate(&mut StdRng::seed_from_u64(1));
        assert_eq!(again.slot_mapping, b.slot_mapping);
        assert_eq!(again.seqs[2].values, b.seqs[2].values);
    }
}
