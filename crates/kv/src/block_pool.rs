//! The physical blocks: reference counts, the LRU free list and the prefix-cache map.
//!
//! Why a doubly linked list over block indices instead of a `VecDeque`: a prefix-cache hit must
//! pull a *free but still cached* block out of the middle of the free list ("touch") in O(1), while
//! allocation takes from the head and freeing appends to the tail. Freed blocks keep their hash, so
//! the least recently freed cached block is the first one evicted; its hash entry is dropped only
//! when the block is actually handed out again.

use std::collections::HashMap;

use quire_core::BlockId;

use crate::hash::BlockHash;
use crate::KvError;

const NIL: u32 = u32::MAX;

#[derive(Debug, Clone, Copy)]
struct Block {
    ref_cnt: u32,
    /// Set while the block is the prefix-cache entry for this hash (free or not).
    hash: Option<BlockHash>,
    prev: u32,
    next: u32,
    in_free_list: bool,
}

/// Every block of the KV cache. Blocks with `ref_cnt == 0` are exactly those in the free list.
#[derive(Debug, Clone)]
pub struct BlockPool {
    blocks: Vec<Block>,
    head: u32,
    tail: u32,
    num_free: usize,
    cached: HashMap<BlockHash, BlockId>,
    num_evictions: u64,
}

impl BlockPool {
    /// All blocks start free, in id order. `num_blocks` must be in `1..u32::MAX`.
    pub fn new(num_blocks: usize) -> Result<Self, KvError> {
        if num_blocks == 0 || num_blocks >= NIL as usize {
            return Err(KvError::InvalidConfig(format!(
                "num_blocks must be in 1..{NIL}, got {num_blocks}"
            )));
        }
        let blocks = (0..num_blocks as u32)
            .map(|i| Block {
                ref_cnt: 0,
                hash: None,
                prev: if i == 0 { NIL } else { i - 1 },
                next: if i + 1 == num_blocks as u32 {
                    NIL
                } else {
                    i + 1
                },
                in_free_list: true,
            })
            .collect();
        Ok(Self {
            blocks,
            head: 0,
            tail: num_blocks as u32 - 1,
            num_free: num_blocks,
            cached: HashMap::new(),
            num_evictions: 0,
        })
    }

    pub fn num_blocks(&self) -> usize {
        self.blocks.len()
    }

    /// Free blocks, including free blocks that are still prefix-cache hits.
    pub fn num_free_blocks(&self) -> usize {
        self.num_free
    }

    /// Number of full blocks currently findable by hash (free or in use).
    pub fn num_cached_blocks(&self) -> usize {
        self.cached.len()
    }

    /// How many cached blocks lost their hash because they were reallocated.
    pub fn num_evictions(&self) -> u64 {
        self.num_evictions
    }

    pub fn ref_cnt(&self, block: BlockId) -> u32 {
        self.blocks[block.as_usize()].ref_cnt
    }

    pub fn block_hash(&self, block: BlockId) -> Option<BlockHash> {
        self.blocks[block.as_usize()].hash
    }

    pub fn get_cached_block(&self, hash: BlockHash) -> Option<BlockId> {
        self.cached.get(&hash).copied()
    }

    /// Takes `n` blocks from the head of the free list (evicting their hashes), each with
    /// `ref_cnt = 1`. `None`, and nothing changed, if fewer than `n` are free.
    pub fn get_new_blocks(&mut self, n: usize) -> Option<Vec<BlockId>> {
        if n > self.num_free {
            return None;
        }
        let mut out = Vec::with_capacity(n);
        for _ in 0..n {
            let id = self.head;
            self.unlink(id);
            let b = &mut self.blocks[id as usize];
            b.ref_cnt = 1;
            if let Some(h) = b.hash.take() {
                self.cached.remove(&h);
                self.num_evictions += 1;
            }
            out.push(BlockId(id));
        }
        Some(out)
    }

    /// Takes one more reference on each block; a free (cached) block leaves the free list.
    pub fn touch(&mut self, blocks: &[BlockId]) {
        for &b in blocks {
            if self.blocks[b.as_usize()].ref_cnt == 0 {
                self.unlink(b.0);
            }
            let blk = &mut self.blocks[b.as_usize()];
            // Unreachable in practice: it would take 2^32 sequences sharing one block.
            blk.ref_cnt = blk
                .ref_cnt
                .checked_add(1)
                .expect("block ref count overflow");
        }
    }

    /// Drops one reference. At zero the block goes to the tail of the free list, keeping its hash.
    /// Freeing a block that has no reference is an error and changes nothing.
    pub fn free_block(&mut self, block: BlockId) -> Result<(), KvError> {
        let b = self
            .blocks
            .get_mut(block.as_usize())
            .ok_or(KvError::InvalidBlock(block))?;
        b.ref_cnt = b.ref_cnt.checked_sub(1).ok_or(KvError::DoubleFree(block))?;
        if b.ref_cnt == 0 {
            self.push_tail(block.0);
        }
        Ok(())
    }

    /// Makes `block` the prefix-cache entry for `hash`, unless it already has a hash or another
    /// block holds that hash (identical content computed twice: the first copy stays the entry,
    /// the second stays uncached so block tables never change). Returns whether it was inserted.
    pub fn cache_block(&mut self, block: BlockId, hash: BlockHash) -> bool {
        let b = &mut self.blocks[block.as_usize()];
        if b.hash.is_some() || self.cached.contains_key(&hash) {
            return false;
        }
        b.hash = Some(hash);
        self.cached.insert(hash, block);
        true
    }

    /// Free-list order, head (next to be allocated) first.
    pub fn free_list(&self) -> Vec<BlockId> {
        let mut out = Vec::with_capacity(self.num_free);
        let mut cur = self.head;
        while cur != NIL && out.len() <= self.blocks.len() {
            out.push(BlockId(cur));
            cur = self.blocks[cur as usize].next;
        }
        out
    }

    /// Structural checks: the free list is a well-formed list of exactly the blocks with no
    /// reference, without duplicates, and the hash map and the per-block hashes agree.
    pub fn check_invariants(&self) -> Result<(), String> {
        let n = self.blocks.len();
        let mut seen = vec![false; n];
        let mut count = 0usize;
        let mut prev = NIL;
        let mut cur = self.head;
        while cur != NIL {
            let i = cur as usize;
            if i >= n {
                return Err(format!("free list points at block {i} out of range"));
            }
            if seen[i] {
                return Err(format!("block {i} is twice in the free list (or a cycle)"));
            }
            seen[i] = true;
            count += 1;
            let b = &self.blocks[i];
            if b.prev != prev {
                return Err(format!("block {i}: prev link {} != {}", b.prev, prev));
            }
            if !b.in_free_list {
                return Err(format!("block {i} is in the free list but not marked so"));
            }
            if b.ref_cnt != 0 {
                return Err(format!("block {i} is free but has ref_cnt {}", b.ref_cnt));
            }
            prev = cur;
            cur = b.next;
        }
        if prev != self.tail {
            return Err(format!(
                "tail is {} but the list ends at {}",
                self.tail, prev
            ));
        }
        if count != self.num_free {
            return Err(format!(
                "free list has {count} blocks, counter says {}",
                self.num_free
            ));
        }
        for (i, b) in self.blocks.iter().enumerate() {
            if b.in_free_list != seen[i] {
                return Err(format!(
                    "block {i}: marked free={} but reachable={}",
                    b.in_free_list, seen[i]
                ));
            }
            if b.ref_cnt == 0 && !seen[i] {
                return Err(format!(
                    "block {i} has no reference but is not free (leaked)"
                ));
            }
            if let Some(h) = b.hash {
                if self.cached.get(&h) != Some(&BlockId(i as u32)) {
                    return Err(format!(
                        "block {i} has hash {h:?} that does not map back to it"
                    ));
                }
            }
        }
        for (h, b) in &self.cached {
            if self.blocks.get(b.as_usize()).and_then(|x| x.hash) != Some(*h) {
                return Err(format!(
                    "cache entry {h:?} -> {b:?} but the block disagrees"
                ));
            }
        }
        Ok(())
    }

    fn unlink(&mut self, id: u32) {
        let Block { prev, next, .. } = self.blocks[id as usize];
        debug_assert!(self.blocks[id as usize].in_free_list);
        if prev == NIL {
            self.head = next;
        } else {
            self.blocks[prev as usize].next = next;
        }
        if next == NIL {
            self.tail = prev;
        } else {
            self.blocks[next as usize].prev = prev;
        }
        let b = &mut self.blocks[id as usize];
        b.prev = NIL;
        b.next = NIL;
        b.in_free_list = false;
        self.num_free -= 1;
    }

    fn push_tail(&mut self, id: u32) {
        debug_assert!(!self.blocks[id as usize].in_free_list);
        let tail = self.tail;
        {
            let b = &mut self.blocks[id as usize];
            b.prev = tail;
            b.next = NIL;
            b.in_free_list = true;
        }
        if tail == NIL {
            self.head = id;
        } else {
            self.blocks[tail as usize].next = id;
        }
        self.tail = id;
        self.num_free += 1;
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::hash::hash_block_tokens;
    use quire_core::TokenId;

    #[test]
    fn lru_order_and_eviction() {
        let mut p = BlockPool::new(4).unwrap();
        let a = p.get_new_blocks(3).unwrap();
        assert_eq!(a, vec![BlockId(0), BlockId(1), BlockId(2)]);
        let h = hash_block_tokens(None, &[TokenId(7)]);
        assert!(p.cache_block(BlockId(1), h));
        assert!(!p.cache_block(BlockId(2), h), "second copy stays uncached");
        // Free in reverse: 2, 1, 0 go to the tail after the never-used 3.
        for b in a.iter().rev() {
            p.free_block(*b).unwrap();
        }
        assert_eq!(
            p.free_list(),
            vec![BlockId(3), BlockId(2), BlockId(1), BlockId(0)]
        );
        assert_eq!(p.get_cached_block(h), Some(BlockId(1)));
        // A hit pulls block 1 out of the middle.
        p.touch(&[BlockId(1)]);
        assert_eq!(p.free_list(), vec![BlockId(3), BlockId(2), BlockId(0)]);
        p.free_block(BlockId(1)).unwrap();
        // Allocating everything reaches block 1 last and evicts its hash then.
        let all = p.get_new_blocks(4).unwrap();
        assert_eq!(all, vec![BlockId(3), BlockId(2), BlockId(0), BlockId(1)]);
        assert_eq!(p.get_cached_block(h), None);
        assert_eq!(p.num_evictions(), 1);
        assert!(p.get_new_blocks(1).is_none());
        p.check_invariants().unwrap();
    }

    #[test]
    fn double_free_is_an_error() {
        let mut p = BlockPool::new(2).unwrap();
        let b = p.get_new_blocks(1).unwrap()[0];
        p.free_block(b).unwrap();
        assert_eq!(p.free_block(b), Err(KvError::DoubleFree(b)));
        assert_eq!(
            p.free_block(BlockId(9)),
            Err(KvError::InvalidBlock(BlockId(9)))
        );
        p.check_invariants().unwrap();
        assert_eq!(p.num_free_blocks(), 2);
    }
}
