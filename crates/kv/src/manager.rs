//! `KvCacheManager`: per-sequence block tables on top of the shared [`BlockPool`].
//!
//! This is the only place the scheduler talks to about memory, modelled on vLLM v1's
//! `KVCacheManager`: ask for the longest cached prefix ([`KvCacheManager::get_computed_blocks`]),
//! then grow a sequence's block table by the tokens it will compute this step
//! ([`KvCacheManager::allocate_slots`]), all-or-nothing so the scheduler can preempt and retry.
//! Blocks that become full of known tokens are registered in the prefix cache at allocation time,
//! before their KV is written: like vLLM, a later request of the *same* step may hit them, so the
//! engine must write a layer's KV for all scheduled tokens before running that layer's attention.

use std::collections::HashMap;

use quire_core::{BlockId, SeqId, TokenId};

use crate::block_pool::BlockPool;
use crate::hash::{hash_block_tokens, BlockHash};
use crate::KvError;

/// Shape of the paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheConfig {
    pub num_blocks: usize,
    /// Token slots per block; a power of two ≥ 1.
    pub block_size: usize,
    pub enable_prefix_caching: bool,
}

impl KvCacheConfig {
    pub fn validate(&self) -> Result<(), KvError> {
        if !self.block_size.is_power_of_two() {
            return Err(KvError::InvalidConfig(format!(
                "block_size must be a power of two >= 1, got {}",
                self.block_size
            )));
        }
        if self.num_blocks == 0 || self.num_blocks >= u32::MAX as usize {
            return Err(KvError::InvalidConfig(format!(
                "num_blocks must be in 1..{}, got {}",
                u32::MAX,
                self.num_blocks
            )));
        }
        Ok(())
    }

    /// Total token slots of the cache.
    pub fn num_slots(&self) -> usize {
        self.num_blocks.saturating_mul(self.block_size)
    }
}

/// Cumulative counters. Prefix-cache counters are in **tokens** (as vLLM's `PrefixCacheStats`):
/// every [`KvCacheManager::get_computed_blocks`] call with caching enabled adds the length of the
/// queried token sequence to `prefix_cache_queries` and the number of tokens it found cached to
/// `prefix_cache_hits` (so hits / queries is a token hit rate).
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct KvCacheStats {
    pub prefix_cache_queries: u64,
    pub prefix_cache_hits: u64,
    /// Cached blocks whose hash entry was dropped because the block was reallocated.
    pub evictions: u64,
}

#[derive(Debug, Clone, Default)]
struct SeqBlocks {
    block_table: Vec<BlockId>,
    /// Chained hashes of the leading full blocks already offered to the prefix cache.
    block_hashes: Vec<BlockHash>,
}

/// One per engine: owns the [`BlockPool`] and every sequence's block table.
#[derive(Debug, Clone)]
pub struct KvCacheManager {
    config: KvCacheConfig,
    pool: BlockPool,
    seqs: HashMap<SeqId, SeqBlocks>,
    stats: KvCacheStats,
}

/// `ceil(a / b)`.
pub fn cdiv(a: usize, b: usize) -> usize {
    a.div_ceil(b)
}

impl KvCacheManager {
    /// # Panics
    /// If the config is invalid; see [`KvCacheManager::try_new`].
    pub fn new(config: KvCacheConfig) -> Self {
        Self::try_new(config).unwrap_or_else(|e| panic!("{e}"))
    }

    pub fn try_new(config: KvCacheConfig) -> Result<Self, KvError> {
        config.validate()?;
        Ok(Self {
            config,
            pool: BlockPool::new(config.num_blocks)?,
            seqs: HashMap::new(),
            stats: KvCacheStats::default(),
        })
    }

    pub fn config(&self) -> &KvCacheConfig {
        &self.config
    }

    pub fn num_blocks(&self) -> usize {
        self.pool.num_blocks()
    }

    pub fn block_size(&self) -> usize {
        self.config.block_size
    }

    /// Free blocks, counting free blocks that are still cached (they are evictable).
    pub fn num_free_blocks(&self) -> usize {
        self.pool.num_free_blocks()
    }

    pub fn num_used_blocks(&self) -> usize {
        self.num_blocks() - self.num_free_blocks()
    }

    /// Fraction of blocks referenced by some sequence, in `[0, 1]`.
    pub fn usage(&self) -> f32 {
        self.num_used_blocks() as f32 / self.num_blocks() as f32
    }

    pub fn stats(&self) -> KvCacheStats {
        KvCacheStats {
            evictions: self.pool.num_evictions(),
            ..self.stats
        }
    }

    pub fn pool(&self) -> &BlockPool {
        &self.pool
    }

    /// The sequence's blocks in token order (empty for an unknown sequence).
    pub fn block_table(&self, seq: SeqId) -> &[BlockId] {
        self.seqs.get(&seq).map_or(&[], |s| &s.block_table)
    }

    /// Number of sequences holding a block table.
    pub fn num_seqs(&self) -> usize {
        self.seqs.len()
    }

    /// Whether the sequence holds a block table (it was allocated and not freed since).
    pub fn contains_seq(&self, seq: SeqId) -> bool {
        self.seqs.contains_key(&seq)
    }

    /// Longest prefix of `tokens` made of cached full blocks, as (blocks, `num_computed_tokens`).
    ///
    /// Never the whole sequence: at most `(tokens.len() - 1) / block_size` blocks are returned, so
    /// at least one token (the last) is left to compute and the engine gets its logits. With a
    /// block-aligned length this drops the whole last block, as in vLLM. The returned blocks may be
    /// free-but-cached; pass them straight to [`KvCacheManager::allocate_slots`], which takes its
    /// references on them before it allocates (and so evicts) anything.
    pub fn get_computed_blocks(&mut self, tokens: &[TokenId]) -> (Vec<BlockId>, usize) {
        if !self.config.enable_prefix_caching || tokens.is_empty() {
            return (Vec::new(), 0);
        }
        let bs = self.config.block_size;
        let max_blocks = (tokens.len() - 1) / bs;
        let mut blocks = Vec::new();
        let mut parent = None;
        for chunk in tokens.chunks_exact(bs).take(max_blocks) {
            let h = hash_block_tokens(parent, chunk);
            match self.pool.get_cached_block(h) {
                Some(b) => blocks.push(b),
                None => break,
            }
            parent = Some(h);
        }
        let num_computed_tokens = blocks.len() * bs;
        self.stats.prefix_cache_queries += tokens.len() as u64;
        self.stats.prefix_cache_hits += num_computed_tokens as u64;
        (blocks, num_computed_tokens)
    }

    /// Makes `seq`'s block table cover `num_computed_tokens + new_computed_blocks.len() *
    /// block_size + num_new_tokens` tokens: first appends `new_computed_blocks` (prefix-cache hits,
    /// one more reference each), then fresh blocks from the head of the free list. Returns `false`,
    /// changing nothing, when there are not enough free blocks (hits that are themselves free
    /// count against the free blocks too).
    ///
    /// `tokens` are all known tokens of the sequence; with prefix caching on, every block that is
    /// full of known tokens within the covered range is then registered under its chained hash.
    ///
    /// `num_computed_tokens` are the tokens already computed into the existing table (0 for a
    /// sequence that holds no blocks).
    ///
    /// # Panics
    /// On caller bugs: `num_computed_tokens` beyond the existing table, hits appended to a table
    /// that does not end exactly at `num_computed_tokens`, or a "hit" block that is not cached.
    pub fn allocate_slots(
        &mut self,
        seq: SeqId,
        tokens: &[TokenId],
        num_computed_tokens: usize,
        num_new_tokens: usize,
        new_computed_blocks: &[BlockId],
    ) -> bool {
        let bs = self.config.block_size;
        let existing = self.seqs.get(&seq).map_or(0, |s| s.block_table.len());
        assert!(
            num_computed_tokens <= existing * bs,
            "{seq}: {num_computed_tokens} computed tokens but only {existing} blocks"
        );
        if !new_computed_blocks.is_empty() {
            assert_eq!(
                num_computed_tokens,
                existing * bs,
                "{seq}: prefix-cache hits must follow a full, fully computed block table"
            );
            for &b in new_computed_blocks {
                assert!(
                    self.pool.block_hash(b).is_some(),
                    "{seq}: hit block {b:?} is not in the prefix cache"
                );
            }
        }
        let total_computed = num_computed_tokens + new_computed_blocks.len() * bs;
        let num_required_blocks = cdiv(total_computed + num_new_tokens, bs);
        let num_fresh = num_required_blocks.saturating_sub(existing + new_computed_blocks.len());
        let num_free_hits = new_computed_blocks
            .iter()
            .filter(|&&b| self.pool.ref_cnt(b) == 0)
            .count();
        if num_fresh + num_free_hits > self.pool.num_free_blocks() {
            return false;
        }

        // Take the hits first so allocating fresh blocks cannot evict them.
        self.pool.touch(new_computed_blocks);
        let fresh = self
            .pool
            .get_new_blocks(num_fresh)
            .expect("free block count was checked above");
        let entry = self.seqs.entry(seq).or_default();
        entry.block_table.extend_from_slice(new_computed_blocks);
        entry.block_table.extend(fresh);

        if self.config.enable_prefix_caching {
            let num_tokens_to_cache = (total_computed + num_new_tokens).min(tokens.len());
            self.cache_full_blocks(seq, tokens, num_tokens_to_cache);
        }
        true
    }

    /// Registers the blocks of `seq` that are full within the first `num_tokens` tokens.
    fn cache_full_blocks(&mut self, seq: SeqId, tokens: &[TokenId], num_tokens: usize) {
        let bs = self.config.block_size;
        let Some(entry) = self.seqs.get_mut(&seq) else {
            return;
        };
        let num_full = (num_tokens / bs).min(entry.block_table.len());
        for i in entry.block_hashes.len()..num_full {
            let parent = i.checked_sub(1).map(|p| entry.block_hashes[p]);
            let h = hash_block_tokens(parent, &tokens[i * bs..(i + 1) * bs]);
            let block = entry.block_table[i];
            match self.pool.block_hash(block) {
                // A prefix-cache hit: already registered under this very hash.
                Some(existing) => debug_assert_eq!(existing, h, "{seq}: block {i} hash mismatch"),
                None => {
                    self.pool.cache_block(block, h);
                }
            }
            entry.block_hashes.push(h);
        }
    }

    /// Gives back the blocks of `seq` past the first `num_tokens` tokens (rejected speculative
    /// tokens): the table keeps `ceil(num_tokens / block_size)` blocks and the rest return to the
    /// pool, tail first. Blocks holding only unverified tokens were never hashed (only blocks full
    /// of *known* tokens are), so nothing rejected can reach the prefix cache. Returns the number
    /// of blocks freed; an unknown sequence frees nothing.
    pub fn truncate(&mut self, seq: SeqId, num_tokens: usize) -> usize {
        let bs = self.config.block_size;
        let Some(entry) = self.seqs.get_mut(&seq) else {
            return 0;
        };
        let keep = cdiv(num_tokens, bs);
        if entry.block_table.len() <= keep {
            return 0;
        }
        let dropped: Vec<BlockId> = entry.block_table.drain(keep..).collect();
        entry.block_hashes.truncate(num_tokens / bs);
        for &b in dropped.iter().rev() {
            // Cannot fail: the table held a reference on each.
            let _ = self.pool.free_block(b);
        }
        dropped.len()
    }

    /// Releases all of `seq`'s blocks, tail first, so that with caching on a sequence's last
    /// blocks are evicted before its (more shareable) first ones. Blocks that drop to no reference
    /// go to the free list and stay cached. Freeing an unknown (or already freed) sequence is an
    /// error and changes nothing.
    pub fn free(&mut self, seq: SeqId) -> Result<(), KvError> {
        let entry = self.seqs.remove(&seq).ok_or(KvError::UnknownSeq(seq))?;
        let mut first_err = None;
        for &b in entry.block_table.iter().rev() {
            if let Err(e) = self.pool.free_block(b) {
                first_err.get_or_insert(e);
            }
        }
        first_err.map_or(Ok(()), Err)
    }

    /// Everything [`BlockPool::check_invariants`] checks, plus: every block's reference count
    /// equals the number of block tables holding it, no table holds a block twice, and
    /// free + used = total.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.pool.check_invariants()?;
        let n = self.num_blocks();
        let mut refs = vec![0u64; n];
        for (seq, s) in &self.seqs {
            let mut mine = std::collections::HashSet::new();
            for &b in &s.block_table {
                if b.as_usize() >= n {
                    return Err(format!("{seq} holds out-of-range block {b:?}"));
                }
                if !mine.insert(b) {
                    return Err(format!("{seq} holds block {b:?} twice"));
                }
                refs[b.as_usize()] += 1;
            }
            if s.block_hashes.len() > s.block_table.len() {
                return Err(format!("{seq} has more block hashes than blocks"));
            }
        }
        for (i, &r) in refs.iter().enumerate() {
            let rc = u64::from(self.pool.ref_cnt(BlockId(i as u32)));
            if rc != r {
                return Err(format!(
                    "block {i}: ref_cnt {rc} but {r} block tables hold it"
                ));
            }
        }
        let used = refs.iter().filter(|&&r| r > 0).count();
        if used + self.num_free_blocks() != n {
            return Err(format!(
                "used {used} + free {} != total {n}",
                self.num_free_blocks()
            ));
        }
        if !self.config.enable_prefix_caching && self.pool.num_cached_blocks() != 0 {
            return Err("prefix caching is off but blocks are cached".into());
        }
        Ok(())
    }
}
