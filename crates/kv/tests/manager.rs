//! Hand-computed scenarios for `KvCacheManager`: allocation, prefix hits, LRU eviction, frees.

use quire_core::{BlockId, SeqId, TokenId};
use quire_kv::{KvCacheConfig, KvCacheManager, KvError};

fn toks(range: std::ops::Range<u32>) -> Vec<TokenId> {
    range.map(TokenId).collect()
}

fn mgr(num_blocks: usize, block_size: usize, caching: bool) -> KvCacheManager {
    KvCacheManager::new(KvCacheConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: caching,
    })
}

#[test]
fn config_is_validated() {
    for (n, bs) in [(0, 16), (4, 0), (4, 12)] {
        let cfg = KvCacheConfig {
            num_blocks: n,
            block_size: bs,
            enable_prefix_caching: true,
        };
        assert!(matches!(
            KvCacheManager::try_new(cfg),
            Err(KvError::InvalidConfig(_))
        ));
    }
    let m = mgr(3, 1, false);
    assert_eq!(
        (m.num_blocks(), m.block_size(), m.num_free_blocks()),
        (3, 1, 3)
    );
}

#[test]
fn allocate_grows_table_and_fails_atomically() {
    let mut m = mgr(4, 4, false);
    let s = SeqId(1);
    let t = toks(0..10);
    assert!(m.allocate_slots(s, &t, 0, 10, &[]));
    assert_eq!(m.block_table(s), &[BlockId(0), BlockId(1), BlockId(2)]);
    assert_eq!((m.num_used_blocks(), m.num_free_blocks()), (3, 1));
    assert_eq!(m.usage(), 0.75);
    // 10 -> 12 tokens fit in block 2; 13 needs a fourth block; 17 would need a fifth.
    assert!(m.allocate_slots(s, &t, 10, 2, &[]));
    assert_eq!(m.block_table(s).len(), 3);
    assert!(!m.allocate_slots(s, &t, 12, 5, &[]));
    assert_eq!(
        m.block_table(s).len(),
        3,
        "failed allocation changes nothing"
    );
    assert!(m.allocate_slots(s, &t, 12, 4, &[]));
    assert_eq!(m.num_free_blocks(), 0);
    m.check_invariants().unwrap();
    m.free(s).unwrap();
    assert_eq!(m.free(s), Err(KvError::UnknownSeq(s)));
    assert_eq!(m.num_free_blocks(), 4);
    // Tail first: 3, 2, 1, 0 are appended in that order.
    assert_eq!(
        m.pool().free_list(),
        vec![BlockId(3), BlockId(2), BlockId(1), BlockId(0)]
    );
    m.check_invariants().unwrap();
}

#[test]
fn prefix_hit_never_covers_whole_prompt() {
    let mut m = mgr(8, 4, true);
    let a = toks(0..8); // exactly two full blocks
    assert_eq!(m.get_computed_blocks(&a), (vec![], 0));
    assert!(m.allocate_slots(SeqId(1), &a, 0, 8, &[]));
    assert_eq!(m.pool().num_cached_blocks(), 2);
    // Same 8 tokens: only the first block may be reused, the last is recomputed.
    let (hit, n) = m.get_computed_blocks(&a);
    assert_eq!((hit.clone(), n), (vec![BlockId(0)], 4));
    // 9 tokens: both blocks hit.
    let b = toks(0..9);
    assert_eq!(m.get_computed_blocks(&b), (vec![BlockId(0), BlockId(1)], 8));
    assert!(m.allocate_slots(SeqId(2), &b, 0, 1, &[BlockId(0), BlockId(1)]));
    assert_eq!(
        m.block_table(SeqId(2)),
        &[BlockId(0), BlockId(1), BlockId(2)]
    );
    assert_eq!(m.pool().ref_cnt(BlockId(0)), 2);
    // queries: 8 + 8 + 9 tokens; hits: 0 + 4 + 8 tokens.
    let st = m.stats();
    assert_eq!((st.prefix_cache_queries, st.prefix_cache_hits), (25, 12));
    // Different first token: no hit at all (hashes are chained from the first block).
    let mut c = toks(0..9);
    c[0] = TokenId(99);
    assert_eq!(m.get_computed_blocks(&c).1, 0);
    m.check_invariants().unwrap();
}

#[test]
fn freed_blocks_stay_cached_until_reallocated() {
    let mut m = mgr(3, 2, true);
    let a = toks(0..5); // blocks [0,1] [2,3] [4]
    assert!(m.allocate_slots(SeqId(1), &a, 0, 5, &[]));
    m.free(SeqId(1)).unwrap();
    // Reverse free: block 2 (partial), then 1, then 0 -> free list 2, 1, 0.
    assert_eq!(
        m.pool().free_list(),
        vec![BlockId(2), BlockId(1), BlockId(0)]
    );
    assert_eq!(m.pool().num_cached_blocks(), 2);
    // A hit on the free cached blocks 0 and 1 counts against free space: 2 hits + 1 fresh = 3.
    let (hit, n) = m.get_computed_blocks(&a);
    assert_eq!((hit.clone(), n), (vec![BlockId(0), BlockId(1)], 4));
    assert!(m.allocate_slots(SeqId(2), &a, 0, 1, &hit));
    assert_eq!(
        m.block_table(SeqId(2)),
        &[BlockId(0), BlockId(1), BlockId(2)]
    );
    assert_eq!(m.stats().evictions, 0);
    m.free(SeqId(2)).unwrap();
    // A new unrelated sequence needing 2 blocks takes 2 then 1 (the tail block of the old
    // sequence first) and evicts block 1's hash; block 0 stays cached.
    let other = toks(100..104);
    assert!(m.allocate_slots(SeqId(3), &other, 0, 4, &[]));
    assert_eq!(m.block_table(SeqId(3)), &[BlockId(2), BlockId(1)]);
    assert_eq!(m.stats().evictions, 1);
    assert_eq!(m.get_computed_blocks(&a), (vec![BlockId(0)], 2));
    m.check_invariants().unwrap();
}

#[test]
fn decode_registers_block_when_it_fills() {
    let mut m = mgr(4, 4, true);
    let s = SeqId(7);
    let mut t = toks(0..3);
    assert!(m.allocate_slots(s, &t, 0, 3, &[]));
    assert_eq!(m.pool().num_cached_blocks(), 0);
    t.push(TokenId(3)); // sampled token, fed next step
    assert!(m.allocate_slots(s, &t, 3, 1, &[]));
    assert_eq!(
        m.pool().num_cached_blocks(),
        1,
        "block full of known tokens is cached"
    );
    t.push(TokenId(4));
    assert!(m.allocate_slots(s, &t, 4, 1, &[]));
    assert_eq!(m.block_table(s), &[BlockId(0), BlockId(1)]);
    let mut q = toks(0..5);
    q.push(TokenId(50));
    assert_eq!(m.get_computed_blocks(&q), (vec![BlockId(0)], 4));
    m.check_invariants().unwrap();
}

#[test]
fn caching_disabled_never_hits() {
    let mut m = mgr(4, 2, false);
    let a = toks(0..5);
    assert!(m.allocate_slots(SeqId(1), &a, 0, 5, &[]));
    assert_eq!(m.get_computed_blocks(&a), (vec![], 0));
    assert_eq!(m.stats().prefix_cache_queries, 0);
    m.check_invariants().unwrap();
}
