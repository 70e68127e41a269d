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
    pub block_size: usize,
    /// Elements of one token's K (or V) row.
    pub kv_row: usize,
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

impl<T: Copy> PagedBatch<T> {
    /// The same batch laid out without paging's scatter: each sequence's blocks consecutive and in
    /// logical order, sequence after sequence, and no spare blocks. Every slot keeps its content
    /// (poisoned ones stay NaN), so a kernel run over both layouts reads the same data and the
    /// difference in time is the cost of the scattered tables alone (the benches' "dense" run).
    pub fn contiguous(&self) -> PagedBatch<T> {
        let (bs, row) = (self.block_size, self.kv_row);
        let num_blocks: usize = self.seqs.iter().map(|s| s.block_table.len()).sum();
        let (mut k_cache, mut v_cache) = (Vec::new(), Vec::new());
        let mut seqs = Vec::with_capacity(self.seqs.len());
        let mut slot_mapping = Vec::with_capacity(self.tokens());
        let mut first = 0;
        for s in &self.seqs {
            for b in &s.block_table {
                let blk = b.as_usize() * bs * row..(b.as_usize() + 1) * bs * row;
                k_cache.extend_from_slice(&self.k_cache[blk.clone()]);
                v_cache.extend_from_slice(&self.v_cache[blk]);
            }
            let block_table: Vec<BlockId> = (first..first + s.block_table.len())
                .map(|i| BlockId(i as u32))
                .collect();
            first += s.block_table.len();
            let positions = &self.positions[s.query_start..s.query_start + s.query_len];
            slot_mapping.extend(
                positions
                    .iter()
                    .map(|&p| quire_core::slot(&block_table, p as usize, bs) as u32),
            );
            seqs.push(PagedSeq {
                block_table,
                ..s.clone()
            });
        }
        PagedBatch {
            num_blocks,
            block_size: bs,
            kv_row: row,
            seqs,
            positions: self.positions.clone(),
            slot_mapping,
            k_new: self.k_new.clone(),
            v_new: self.v_new.clone(),
            k_cache,
            v_cache,
        }
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
            block_size: bs,
            kv_row: row,
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

    #[test]
    fn contiguous_layout_holds_the_same_rows_in_order() {
        let case = PagedCase {
            new_in_cache: true,
            ..PagedCase::new(4, 2, &[(5, 2), (0, 3), (9, 1)])
        };
        let b: PagedBatch<f32> = case.generate(&mut StdRng::seed_from_u64(7));
        let d = b.contiguous();
        // Tables 0..2, 2..3, 3..6: consecutive, sequence after sequence, no spare blocks.
        let tables: Vec<Vec<u32>> = d
            .seqs
            .iter()
            .map(|s| s.block_table.iter().map(|x| x.0).collect())
            .collect();
        assert_eq!(tables, [vec![0, 1], vec![2], vec![3, 4, 5]]);
        assert_eq!((d.num_blocks, d.k_cache.len()), (6, 6 * 4 * 2));
        assert_eq!(d.positions, b.positions);
        // Every position of every sequence reads the same K/V (NaN stays NaN) in both layouts,
        // and each new token's slot is where its position now lives.
        for (sb, sd) in b.seqs.iter().zip(&d.seqs) {
            for pos in 0..sb.block_table.len() * 4 {
                let (ps, ds) = (
                    quire_core::slot(&sb.block_table, pos, 4),
                    quire_core::slot(&sd.block_table, pos, 4),
                );
                for i in 0..2 {
                    let (x, y) = (b.v_cache[ps * 2 + i], d.v_cache[ds * 2 + i]);
                    assert_eq!(x.to_bits(), y.to_bits(), "pos {pos}");
                    assert_eq!(
                        b.k_cache[ps * 2 + i].to_bits(),
                        d.k_cache[ds * 2 + i].to_bits()
                    );
                }
            }
            for t in sd.query_start..sd.query_start + sd.query_len {
                let pos = d.positions[t] as usize;
                let slot = quire_core::slot(&sd.block_table, pos, 4) as u32;
                assert_eq!(d.slot_mapping[t], slot, "token {t}");
            }
        }
        assert_eq!(d.k_cache[(2 * 4) * 2..(2 * 4 + 3) * 2], b.seqs[1].keys[..]);
    }
}
