//! Property test: random allocate / free traffic over many sequences, with and without prefix
//! caching, against a shadow model of what each block holds.
//!
//! Checked after every operation: the manager's own invariants (free + used = total, no block both
//! free and referenced, ref counts = block-table membership, no free-list duplicates); a failed
//! allocation changes nothing; a second free is an error, not a panic; a prefix hit only returns
//! blocks whose shadow contents equal the queried tokens; nobody writes into a shared block.
//! Speculative steps write `k` unverified tokens past the known ones, then roll back to the
//! accepted ones: rejected slots hold a token no plan contains, so a prefix hit on a block that
//! was hashed with rejected contents fails the shadow comparison.
//! At the end, after freeing everything, every block is free.

use proptest::prelude::*;
use quire_core::{BlockId, SeqId, TokenId};
use quire_kv::{cdiv, KvCacheConfig, KvCacheManager, KvError};

#[derive(Debug, Clone)]
enum Op {
    /// Compute up to `chunk` more tokens of sequence `seq` (admitting it if it holds no blocks).
    Step {
        seq: usize,
        chunk: usize,
    },
    Free {
        seq: usize,
    },
    /// A decode of sequence `seq` with `k` proposed tokens of which the first `accept` match.
    Spec {
        seq: usize,
        k: usize,
        accept: usize,
    },
}

/// What rejected proposals write: no plan holds it.
const REJECTED: TokenId = TokenId(99);

const NUM_SEQS: usize = 6;

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0..NUM_SEQS, 1usize..12).prop_map(|(seq, chunk)| Op::Step { seq, chunk }),
        1 => (0..NUM_SEQS).prop_map(|seq| Op::Free { seq }),
        2 => (0..NUM_SEQS, 1usize..9, 0usize..9)
            .prop_map(|(seq, k, accept)| Op::Spec { seq, k, accept: accept.min(k) }),
    ]
}

struct Seq {
    /// Every token this sequence will ever have; `known` of them are known so far.
    plan: Vec<TokenId>,
    known: usize,
    /// `Some(num_computed_tokens)` while it holds blocks.
    computed: Option<usize>,
}

fn plans() -> impl Strategy<Value = Vec<Vec<TokenId>>> {
    // Two shared prefixes so that prefix caching has something to find.
    let prefix = prop::collection::vec(0u32..4, 0..20);
    (
        prefix.clone(),
        prefix,
        prop::collection::vec((0usize..3, prop::collection::vec(0u32..4, 1..30)), NUM_SEQS),
    )
        .prop_map(|(p0, p1, tails)| {
            tails
                .into_iter()
                .map(|(which, tail)| {
                    let mut v = match which {
                        0 => p0.clone(),
                        1 => p1.clone(),
                        _ => Vec::new(),
                    };
                    v.extend(tail);
                    v.into_iter().map(TokenId).collect()
                })
                .collect()
        })
}

fn run(
    num_blocks: usize,
    block_size: usize,
    caching: bool,
    plans: Vec<Vec<TokenId>>,
    ops: Vec<Op>,
) {
    let mut m = KvCacheManager::new(KvCacheConfig {
        num_blocks,
        block_size,
        enable_prefix_caching: caching,
    });
    let mut shadow: Vec<Vec<Option<TokenId>>> = vec![vec![None; block_size]; num_blocks];
    let mut seqs: Vec<Seq> = plans
        .into_iter()
        .map(|plan| Seq {
            known: plan.len().min(1 + plan.len() / 2),
            plan,
            computed: None,
        })
        .collect();

    for op in ops {
        match op {
            Op::Step { seq, chunk } => {
                let id = SeqId(seq as u64);
                let s = &mut seqs[seq];
                let (start, hits) = match s.computed {
                    None => {
                        let (hits, n) = m.get_computed_blocks(&s.plan[..s.known]);
                        assert_eq!(n, hits.len() * block_size);
                        assert!(n < s.known, "a hit never covers every known token");
                        for (i, b) in hits.iter().enumerate() {
                            let want = &s.plan[i * block_size..(i + 1) * block_size];
                            let have: Vec<_> =
                                shadow[b.as_usize()].iter().map(|t| t.unwrap()).collect();
                            assert_eq!(
                                have, want,
                                "prefix hit returned a block with other contents"
                            );
                        }
                        (n, hits)
                    }
                    Some(c) => {
                        if c == s.known && s.known < s.plan.len() {
                            s.known += 1; // "sampled" a token
                        }
                        (c, Vec::new())
                    }
                };
                let tokens = &s.plan[..s.known];
                let num_new = chunk.min(tokens.len() - start);
                if num_new == 0 {
                    continue;
                }
                let before_table = m.block_table(id).to_vec();
                let before_free = m.num_free_blocks();
                let computed_before = s.computed.unwrap_or(0);
                if m.allocate_slots(id, tokens, computed_before, num_new, &hits) {
                    let c = start + num_new;
                    s.computed = Some(c);
                    let table = m.block_table(id).to_vec();
                    assert_eq!(table.len(), cdiv(c, block_size));
                    for pos in start..c {
                        let b = table[pos / block_size];
                        assert_eq!(m.pool().ref_cnt(b), 1, "writing into a shared block");
                        shadow[b.as_usize()][pos % block_size] = Some(tokens[pos]);
                    }
                } else {
                    assert_eq!(m.block_table(id), &before_table[..]);
                    assert_eq!(m.num_free_blocks(), before_free);
                }
            }
            Op::Spec { seq, k, accept } => {
                spec_step(
                    &mut m,
                    &mut shadow,
                    &mut seqs[seq],
                    SeqId(seq as u64),
                    k,
                    accept,
                );
            }
            Op::Free { seq } => {
                let id = SeqId(seq as u64);
                let s = &mut seqs[seq];
                if s.computed.take().is_some() {
                    m.free(id).unwrap();
                } else {
                    assert_eq!(m.free(id), Err(KvError::UnknownSeq(id)));
                }
                assert!(m.block_table(id).is_empty());
            }
        }
        m.check_invariants().unwrap();
        assert_eq!(m.num_free_blocks() + m.num_used_blocks(), m.num_blocks());
    }

    for (i, s) in seqs.iter_mut().enumerate() {
        if s.computed.take().is_some() {
            m.free(SeqId(i as u64)).unwrap();
        }
        m.check_invariants().unwrap();
    }
    assert_eq!(m.num_free_blocks(), num_blocks);
    assert_eq!(m.num_used_blocks(), 0);
    for b in 0..num_blocks {
        assert_eq!(m.pool().ref_cnt(BlockId(b as u32)), 0);
    }
    let st = m.stats();
    assert!(st.prefix_cache_hits <= st.prefix_cache_queries);
}

/// One verify step: the last known token plus `k` proposals are computed, the first `accept`
/// proposals (the plan's next tokens) are kept and the rest rolled back with `truncate`.
fn spec_step(
    m: &mut KvCacheManager,
    shadow: &mut [Vec<Option<TokenId>>],
    s: &mut Seq,
    id: SeqId,
    k: usize,
    accept: usize,
) {
    let bs = m.block_size();
    // Only a sequence in decode (every known token but the last computed) speculates.
    let Some(c) = s.computed else { return };
    if c == s.known && s.known < s.plan.len() {
        s.known += 1;
    }
    if c + 1 != s.known {
        return;
    }
    let accept = accept.min(s.plan.len() - s.known);
    let known = &s.plan[..s.known];
    let before_free = m.num_free_blocks();
    let before_table = m.block_table(id).to_vec();
    if !m.allocate_slots(id, known, c, 1 + k, &[]) {
        assert_eq!(m.block_table(id), &before_table[..]);
        assert_eq!(m.num_free_blocks(), before_free);
        return;
    }
    let table = m.block_table(id).to_vec();
    assert_eq!(table.len(), cdiv(c + 1 + k, bs));
    for pos in c..c + 1 + k {
        let b = table[pos / bs];
        assert_eq!(m.pool().ref_cnt(b), 1, "writing into a shared block");
        let accepted = pos <= c + accept;
        shadow[b.as_usize()][pos % bs] = Some(if accepted { s.plan[pos] } else { REJECTED });
    }
    m.check_invariants().unwrap();
    let kept = c + 1 + accept;
    let freed = m.truncate(id, kept);
    assert_eq!(freed, table.len() - cdiv(kept, bs));
    assert_eq!(m.block_table(id), &table[..cdiv(kept, bs)]);
    assert_eq!(
        m.num_free_blocks(),
        before_free + before_table.len() + freed - table.len()
    );
    s.known += accept;
    s.computed = Some(kept);
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn blocks_are_conserved(
        num_blocks in 1usize..24,
        bs_log in 0u32..4,
        caching in any::<bool>(),
        plans in plans(),
        ops in prop::collection::vec(op(), 1..120),
    ) {
        run(num_blocks, 1 << bs_log, caching, plans, ops);
    }
}
