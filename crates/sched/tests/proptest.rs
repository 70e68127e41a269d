//! Property test: random add / schedule+update / abort / finish traffic on small KV caches (so
//! preemption is frequent), checked against a mirror of what the engine knows.
//!
//! After every operation the scheduler's (and the KV manager's) invariants hold. Every scheduled
//! batch respects the budget and `max_num_seqs`, feeds exactly the mirror's next tokens, and
//! `samples` exactly when all known tokens get computed. No request is lost: stepping on after the
//! random phase finishes every accepted request, and then every block is free.

use std::collections::{HashMap, HashSet};

use proptest::prelude::*;
use quire_core::{FinishReason, SeqId, TokenId};
use quire_kv::{cdiv, KvCacheConfig};
use quire_sched::{SchedError, Scheduler, SchedulerConfig, SchedulerOutput};

#[derive(Debug, Clone)]
enum Op {
    Add {
        prefix: usize,
        tail: Vec<u32>,
        max_tokens: usize,
    },
    /// Schedule, then update with a random token for every sampling request; `stop` picks
    /// requests (if any) the "engine" then finishes with `Stop`.
    Step {
        tokens: Vec<u32>,
        stop: Option<u8>,
    },
    Abort {
        pick: usize,
    },
    Finish {
        pick: usize,
    },
}

fn op() -> impl Strategy<Value = Op> {
    prop_oneof![
        4 => (0usize..3, prop::collection::vec(0u32..4, 1..10), 1usize..12)
            .prop_map(|(prefix, tail, max_tokens)| Op::Add { prefix, tail, max_tokens }),
        6 => (prop::collection::vec(0u32..4, 8), prop::option::weighted(0.15, any::<u8>()))
            .prop_map(|(tokens, stop)| Op::Step { tokens, stop }),
        1 => any::<usize>().prop_map(|pick| Op::Abort { pick }),
        1 => any::<usize>().prop_map(|pick| Op::Finish { pick }),
    ]
}

#[derive(Debug, Clone, Copy)]
struct Params {
    num_blocks: usize,
    block_size: usize,
    caching: bool,
    budget: usize,
    max_num_seqs: usize,
    max_model_len: usize,
    threshold: Option<usize>,
}

fn params() -> impl Strategy<Value = Params> {
    (
        2usize..14,
        0u32..3,
        any::<bool>(),
        1usize..32,
        1usize..6,
        4usize..40,
        prop::option::of(1usize..10),
    )
        .prop_map(
            |(num_blocks, bs_log, caching, budget, max_num_seqs, max_model_len, threshold)| {
                Params {
                    num_blocks,
                    block_size: 1 << bs_log,
                    caching,
                    budget,
                    max_num_seqs,
                    max_model_len,
                    threshold,
                }
            },
        )
}

/// What the engine knows about a live request.
struct Mirror {
    tokens: Vec<TokenId>,
    /// Preempted since it was last scheduled from the waiting queue.
    preempted: bool,
}

struct Harness {
    p: Params,
    s: Scheduler,
    live: HashMap<SeqId, Mirror>,
    /// Live ids in insertion order, for picking.
    order: Vec<SeqId>,
    next_id: u64,
}

impl Harness {
    fn new(p: Params) -> Self {
        let s = Scheduler::new(
            SchedulerConfig {
                max_num_seqs: p.max_num_seqs,
                max_num_batched_tokens: p.budget,
                max_model_len: p.max_model_len,
                long_prefill_token_threshold: p.threshold,
            },
            KvCacheConfig {
                num_blocks: p.num_blocks,
                block_size: p.block_size,
                enable_prefix_caching: p.caching,
            },
        );
        Self {
            p,
            s,
            live: HashMap::new(),
            order: Vec::new(),
            next_id: 0,
        }
    }

    fn remove(&mut self, id: SeqId) {
        assert!(
            self.live.remove(&id).is_some(),
            "{id} finished twice or never added"
        );
        self.order.retain(|&x| x != id);
    }

    fn pick(&self, pick: usize) -> SeqId {
        if self.order.is_empty() || pick.is_multiple_of(5) {
            SeqId(10_000 + pick as u64 % 7) // unknown id
        } else {
            self.order[pick % self.order.len()]
        }
    }

    fn add(&mut self, prompt: Vec<TokenId>, max_tokens: usize) {
        let id = SeqId(self.next_id);
        self.next_id += 1;
        match self.s.add_request(id, prompt.clone(), max_tokens) {
            Ok(()) => {
                self.live.insert(
                    id,
                    Mirror {
                        tokens: prompt,
                        preempted: false,
                    },
                );
                self.order.push(id);
            }
            Err(SchedError::NeverFits {
                num_tokens,
                num_slots,
                ..
            }) => {
                assert!(num_tokens > num_slots);
                assert!(cdiv(num_tokens, self.p.block_size) > self.p.num_blocks);
            }
            Err(SchedError::PromptTooLong { .. }) => assert!(prompt.len() > self.p.max_model_len),
            Err(e) => panic!("unexpected {e}"),
        }
    }

    fn check_output(&mut self, out: &SchedulerOutput) {
        let p = self.p;
        assert!(out.num_batched_tokens <= p.budget);
        assert_eq!(
            out.num_batched_tokens,
            out.scheduled
                .iter()
                .map(|x| x.num_new_tokens)
                .sum::<usize>()
        );
        assert!(out.scheduled.len() <= p.max_num_seqs);
        let mut seen = HashSet::new();
        for id in &out.preempted {
            self.live
                .get_mut(id)
                .expect("preempted a live request")
                .preempted = true;
        }
        for x in &out.scheduled {
            assert!(seen.insert(x.seq_id), "{} scheduled twice", x.seq_id);
            assert!(
                !out.preempted.contains(&x.seq_id),
                "scheduled and preempted"
            );
            let m = self
                .live
                .get_mut(&x.seq_id)
                .expect("scheduled a live request");
            assert!(x.num_new_tokens >= 1);
            if let Some(t) = p.threshold {
                assert!(x.num_new_tokens <= t);
            }
            let end = x.num_computed_tokens + x.num_new_tokens;
            assert_eq!(x.token_ids, m.tokens[x.num_computed_tokens..end]);
            assert_eq!(x.samples, end == m.tokens.len());
            assert!(x.block_table.len() * p.block_size >= end);
            assert!(end <= p.max_model_len);
            assert_eq!(x.resumed_from_preemption, std::mem::take(&mut m.preempted));
        }
        // Preempted requests sit at the front of the waiting queue, earliest admitted first.
        let waiting = self.s.waiting_seq_ids();
        let mut front: Vec<_> = out.preempted.clone();
        front.reverse();
        assert_eq!(waiting[..front.len()], front[..]);
    }

    fn step(&mut self, tokens: &[u32], stop: Option<u8>) {
        let stop = stop.unwrap_or(0);
        let out = self.s.schedule();
        self.s.check_invariants().unwrap();
        self.check_output(&out);
        let sampled: Vec<_> = out
            .scheduled
            .iter()
            .filter(|x| x.samples)
            .enumerate()
            .map(|(i, x)| (x.seq_id, TokenId(tokens[i % tokens.len()])))
            .collect();
        for &(id, t) in &sampled {
            self.live.get_mut(&id).unwrap().tokens.push(t);
        }
        let finished = self.s.update_from_output(&out, &sampled);
        self.s.check_invariants().unwrap();
        for (id, reason) in finished {
            assert_eq!(reason, FinishReason::Length);
            self.remove(id);
        }
        for (i, &(id, _)) in sampled.iter().enumerate() {
            if stop & (1 << (i % 8)) != 0 && self.live.contains_key(&id) {
                assert!(self.s.finish(id, FinishReason::Stop));
                self.remove(id);
            }
        }
    }

    fn finish(&mut self, pick: usize, abort: bool) {
        let id = self.pick(pick);
        let known = self.live.contains_key(&id);
        let done = if abort {
            self.s.abort(id)
        } else {
            self.s.finish(id, FinishReason::Stop)
        };
        assert_eq!(done, known);
        if known {
            self.remove(id);
            assert!(
                self.s.kv().block_table(id).is_empty(),
                "blocks freed at once"
            );
        }
    }
}

fn prefixes() -> [Vec<TokenId>; 3] {
    [
        Vec::new(),
        (0..9).map(|i| TokenId(i % 4)).collect(),
        (0..5).map(|i| TokenId(3 - i % 4)).collect(),
    ]
}

fn run(p: Params, ops: Vec<Op>) {
    let mut h = Harness::new(p);
    let prefixes = prefixes();
    for op in ops {
        match op {
            Op::Add {
                prefix,
                tail,
                max_tokens,
            } => {
                let mut prompt = prefixes[prefix].clone();
                prompt.extend(tail.into_iter().map(TokenId));
                h.add(prompt, max_tokens);
            }
            Op::Step { tokens, stop } => h.step(&tokens, stop),
            Op::Abort { pick } => h.finish(pick, true),
            Op::Finish { pick } => h.finish(pick, false),
        }
        h.s.check_invariants().unwrap();
        assert_eq!(h.s.num_running() + h.s.num_waiting(), h.live.len());
        let kv = h.s.kv();
        assert_eq!(kv.num_free_blocks() + kv.num_used_blocks(), kv.num_blocks());
    }
    // Drain: no stop tokens, so only Length finishes; each step computes at least one token.
    let mut steps = 0;
    while h.s.has_unfinished() {
        h.step(&[1, 2, 3], None);
        steps += 1;
        assert!(steps < 20_000, "requests are stuck: {} left", h.live.len());
    }
    assert!(
        h.live.is_empty(),
        "lost requests: {:?}",
        h.live.keys().collect::<Vec<_>>()
    );
    assert_eq!(h.s.kv().num_free_blocks(), p.num_blocks);
    assert_eq!(h.s.kv().num_used_blocks(), 0);
    h.s.check_invariants().unwrap();
}

proptest! {
    #![proptest_config(ProptestConfig::with_cases(1024))]

    #[test]
    fn scheduler_never_loses_requests_or_blocks(p in params(), ops in prop::collection::vec(op(), 1..100)) {
        run(p, ops);
    }
}
