//! Hand-computed scenarios: every expectation below was worked out on paper from the rules in
//! the crate docs (block ids follow the free list: fresh blocks in id order, freed ones appended
//! tail-first).

use quire_core::{BlockId, FinishReason, SeqId, TokenId};
use quire_kv::KvCacheConfig;
use quire_sched::{
    RequestStatus, SchedError, ScheduledSeq, Scheduler, SchedulerConfig, SchedulerOutput,
};

const A: SeqId = SeqId(1);
const B: SeqId = SeqId(2);
const C: SeqId = SeqId(3);

fn toks(r: std::ops::Range<u32>) -> Vec<TokenId> {
    r.map(TokenId).collect()
}

fn blocks(ids: &[u32]) -> Vec<BlockId> {
    ids.iter().copied().map(BlockId).collect()
}

struct Cfg {
    max_num_seqs: usize,
    budget: usize,
    max_model_len: usize,
    threshold: Option<usize>,
    num_blocks: usize,
    block_size: usize,
    caching: bool,
}

impl Default for Cfg {
    fn default() -> Self {
        Self {
            max_num_seqs: 8,
            budget: 100,
            max_model_len: 64,
            threshold: None,
            num_blocks: 64,
            block_size: 4,
            caching: false,
        }
    }
}

fn sched(c: Cfg) -> Scheduler {
    Scheduler::new(
        SchedulerConfig {
            max_num_seqs: c.max_num_seqs,
            max_num_batched_tokens: c.budget,
            max_model_len: c.max_model_len,
            long_prefill_token_threshold: c.threshold,
        },
        KvCacheConfig {
            num_blocks: c.num_blocks,
            block_size: c.block_size,
            enable_prefix_caching: c.caching,
        },
    )
}

#[allow(clippy::too_many_arguments)]
fn seq(
    seq_id: SeqId,
    num_computed_tokens: usize,
    token_ids: Vec<TokenId>,
    block_table: &[u32],
    samples: bool,
    resumed_from_preemption: bool,
) -> ScheduledSeq {
    ScheduledSeq {
        seq_id,
        num_computed_tokens,
        num_new_tokens: token_ids.len(),
        token_ids,
        num_spec_tokens: 0,
        block_table: blocks(block_table),
        samples,
        resumed_from_preemption,
    }
}

/// Schedules, checks invariants, and returns the output.
fn step(s: &mut Scheduler) -> SchedulerOutput {
    let out = s.schedule();
    s.check_invariants().unwrap();
    out
}

fn update(
    s: &mut Scheduler,
    out: &SchedulerOutput,
    sampled: &[(SeqId, u32)],
) -> Vec<(SeqId, FinishReason)> {
    let sampled: Vec<_> = sampled.iter().map(|&(id, t)| (id, TokenId(t))).collect();
    let fin = s.update_from_output(out, &sampled);
    s.check_invariants().unwrap();
    fin
}

#[test]
fn budget_is_split_between_decodes_and_a_prompt_chunk() {
    let mut s = sched(Cfg {
        budget: 10,
        ..Cfg::default()
    });
    s.add_request(A, toks(0..6), 5).unwrap();
    s.add_request(B, toks(10..13), 5).unwrap();

    let out = step(&mut s);
    assert_eq!(
        out.scheduled,
        vec![
            seq(A, 0, toks(0..6), &[0, 1], true, false),
            seq(B, 0, toks(10..13), &[2], true, false),
        ]
    );
    assert_eq!(out.num_batched_tokens, 9);
    assert!(update(&mut s, &out, &[(A, 100), (B, 101)]).is_empty());

    // Two decodes take 1 token each; the 20-token prompt gets the other 8.
    s.add_request(C, toks(20..40), 5).unwrap();
    let out = step(&mut s);
    assert_eq!(
        out.scheduled,
        vec![
            seq(A, 6, vec![TokenId(100)], &[0, 1], true, false),
            seq(B, 3, vec![TokenId(101)], &[2], true, false),
            seq(C, 0, toks(20..28), &[3, 4], false, false),
        ]
    );
    assert_eq!(out.num_batched_tokens, 10);
    // A token "sampled" for C mid-prompt is ignored.
    update(&mut s, &out, &[(A, 102), (B, 103), (C, 999)]);
    assert_eq!(s.all_token_ids(C).unwrap().len(), 20);
    assert_eq!(s.num_computed_tokens(C), Some(8));

    let out = step(&mut s);
    assert_eq!(
        out.scheduled,
        vec![
            seq(A, 7, vec![TokenId(102)], &[0, 1], true, false),
            seq(B, 4, vec![TokenId(103)], &[2, 5], true, false),
            seq(C, 8, toks(28..36), &[3, 4, 6, 7], false, false),
        ]
    );
    update(&mut s, &out, &[(A, 104), (B, 105)]);

    // C's last 4 prompt tokens: it samples this step.
    let out = step(&mut s);
    assert_eq!(
        out.scheduled,
        vec![
            seq(A, 8, vec![TokenId(104)], &[0, 1, 8], true, false),
            seq(B, 5, vec![TokenId(105)], &[2, 5], true, false),
            seq(C, 16, toks(36..40), &[3, 4, 6, 7, 9], true, false),
        ]
    );
    assert_eq!(out.num_batched_tokens, 6);
    assert_eq!(s.stats().total_computed_tokens, 9 + 10 + 10 + 6);
}

#[test]
fn long_prompt_is_chunked_across_steps_by_the_threshold() {
    let mut s = sched(Cfg {
        threshold: Some(6),
        ..Cfg::default()
    });
    s.add_request(A, toks(0..20), 3).unwrap();
    s.add_request(B, toks(50..53), 3).unwrap();
    let mut plan = vec![];
    for _ in 0..4 {
        let out = step(&mut s);
        plan.push(
            out.scheduled
                .iter()
                .map(|x| (x.seq_id, x.num_computed_tokens, x.num_new_tokens, x.samples))
                .collect::<Vec<_>>(),
        );
        let sampled: Vec<_> = out
            .scheduled
            .iter()
            .filter(|x| x.samples)
            .map(|x| (x.seq_id, 7))
            .collect();
        update(&mut s, &out, &sampled);
    }
    assert_eq!(
        plan,
        vec![
            vec![(A, 0, 6, false), (B, 0, 3, true)],
            vec![(A, 6, 6, false), (B, 3, 1, true)],
            // B got its 3rd output token after this step's update: finished (Length).
            vec![(A, 12, 6, false), (B, 4, 1, true)],
            vec![(A, 18, 2, true)],
        ]
    );
    assert_eq!(s.status(B), None);
}

#[test]
fn max_num_seqs_caps_running_requests() {
    let mut s = sched(Cfg {
        max_num_seqs: 2,
        ..Cfg::default()
    });
    for (id, base) in [(A, 0), (B, 10), (C, 20)] {
        s.add_request(id, toks(base..base + 4), 10).unwrap();
    }
    let out = step(&mut s);
    let ids = |o: &SchedulerOutput| o.scheduled.iter().map(|x| x.seq_id).collect::<Vec<_>>();
    assert_eq!(ids(&out), vec![A, B]);
    assert_eq!((s.num_running(), s.num_waiting()), (2, 1));
    update(&mut s, &out, &[(A, 1), (B, 1)]);
    let out = step(&mut s);
    assert_eq!(
        ids(&out),
        vec![A, B],
        "C still waits although budget remains"
    );
    update(&mut s, &out, &[(A, 1), (B, 1)]);
    assert!(s.finish(A, FinishReason::Stop));
    let out = step(&mut s);
    assert_eq!(ids(&out), vec![B, C]);
    // Step 2 gave A block 2 and B block 3 (5th token); A's freed blocks 2, 0 went to the tail of
    // the free list, behind the never-used 4.., so C gets block 4.
    assert_eq!(out.scheduled[1], seq(C, 0, toks(20..24), &[4], true, false));
}

#[test]
fn preemption_evicts_the_latest_admitted_and_requeues_it_first() {
    let mut s = sched(Cfg {
        num_blocks: 4,
        ..Cfg::default()
    });
    s.add_request(A, toks(0..8), 8).unwrap();
    s.add_request(B, toks(100..108), 8).unwrap();
    let out = step(&mut s);
    assert_eq!(
        out.scheduled,
        vec![
            seq(A, 0, toks(0..8), &[0, 1], true, false),
            seq(B, 0, toks(100..108), &[2, 3], true, false),
        ]
    );
    update(&mut s, &out, &[(A, 50), (B, 51)]);
    s.add_request(C, toks(200..204), 1).unwrap();

    // A needs a third block, none is free: B (admitted last) is preempted; B's blocks are freed
    // tail first (3, then 2) so A gets block 3. No admission in a step with a preemption.
    let out = step(&mut s);
    assert_eq!(
        out.scheduled,
        vec![seq(A, 8, vec![TokenId(50)], &[0, 1, 3], true, false)]
    );
    assert_eq!(out.preempted, vec![B]);
    assert_eq!(out.num_batched_tokens, 1);
    assert_eq!(s.waiting_seq_ids(), vec![B, C]);
    assert_eq!(s.status(B), Some(RequestStatus::Waiting));
    assert_eq!(s.num_computed_tokens(B), Some(0));
    assert_eq!(
        s.all_token_ids(B).unwrap().len(),
        9,
        "the sampled token is kept"
    );
    assert_eq!(s.stats().num_preemptions, 1);
    assert_eq!(s.kv().num_free_blocks(), 1);
    update(&mut s, &out, &[(A, 52)]);

    // B (9 tokens, 3 blocks) does not fit in the one free block and C may not overtake it.
    let out = step(&mut s);
    assert_eq!(
        out.scheduled,
        vec![seq(A, 9, vec![TokenId(52)], &[0, 1, 3], true, false)]
    );
    assert!(out.preempted.is_empty());
    assert_eq!(s.waiting_seq_ids(), vec![B, C]);
    update(&mut s, &out, &[(A, 53)]);

    // A's blocks come back as 3, 1, 0 after the free block 2: B gets 2, 3, 1 and C gets 0.
    assert!(s.finish(A, FinishReason::Stop));
    let out = step(&mut s);
    let mut b_tokens = toks(100..108);
    b_tokens.push(TokenId(51));
    assert_eq!(
        out.scheduled,
        vec![
            seq(B, 0, b_tokens, &[2, 3, 1], true, true),
            seq(C, 0, toks(200..204), &[0], true, false),
        ]
    );
    assert_eq!(out.num_batched_tokens, 13);
    assert_eq!(s.stats().num_preemptions, 1);
}

#[test]
fn a_request_that_cannot_grow_preempts_itself_and_stops_the_step() {
    let mut s = sched(Cfg {
        num_blocks: 3,
        ..Cfg::default()
    });
    s.add_request(A, toks(0..3), 4).unwrap();
    s.add_request(B, toks(10..18), 4).unwrap();
    let out = step(&mut s);
    update(&mut s, &out, &[(A, 50), (B, 51)]);
    // A's 4th token fits in block 0; B's 9th needs a block: B is the last admitted, so B itself.
    let out = step(&mut s);
    assert_eq!(
        out.scheduled,
        vec![seq(A, 3, vec![TokenId(50)], &[0], true, false)]
    );
    assert_eq!(out.preempted, vec![B]);
    assert_eq!(
        (s.running_seq_ids(), s.waiting_seq_ids()),
        (&[A][..], vec![B])
    );
    assert_eq!(s.kv().num_free_blocks(), 2);
}

/// 8 requests share a 200-token prefix (12 full blocks of 16 = 192 tokens) plus 10 own tokens.
/// The first computes all 210; each other one hits the 12 shared blocks and computes 18.
#[test]
fn shared_prefix_is_computed_once() {
    for caching in [true, false] {
        let mut s = sched(Cfg {
            budget: 4096,
            max_model_len: 1024,
            num_blocks: 200,
            block_size: 16,
            caching,
            ..Cfg::default()
        });
        let prefix = toks(1000..1200);
        for i in 0..8u32 {
            let mut p = prefix.clone();
            p.extend(toks(i * 10..i * 10 + 10));
            s.add_request(SeqId(u64::from(i)), p, 3).unwrap();
        }
        let out = step(&mut s);
        assert_eq!(out.scheduled.len(), 8);
        if caching {
            assert_eq!(out.num_batched_tokens, 210 + 7 * 18);
            let first = &out.scheduled[0];
            for x in &out.scheduled[1..] {
                assert_eq!((x.num_computed_tokens, x.num_new_tokens), (192, 18));
                assert_eq!(x.block_table[..12], first.block_table[..12]);
                assert_eq!(x.block_table.len(), 14);
            }
            // 14 blocks for the first, 2 own blocks for each other one.
            assert_eq!(s.kv().num_used_blocks(), 14 + 7 * 2);
            let st = s.stats();
            assert_eq!(
                (st.prefix_cache_queries, st.prefix_cache_hits),
                (8 * 210, 7 * 192)
            );
        } else {
            assert_eq!(out.num_batched_tokens, 8 * 210);
            assert_eq!(s.kv().num_used_blocks(), 8 * 14);
        }
        // Run to completion: 3 outputs each = 2 more fed tokens each.
        let mut out = out;
        let mut finished = 0;
        while s.has_unfinished() {
            let sampled: Vec<_> = out.scheduled.iter().map(|x| (x.seq_id, 5)).collect();
            finished += update(&mut s, &out, &sampled).len();
            out = step(&mut s);
        }
        assert_eq!(finished, 8);
        let expected = if caching { 210 + 7 * 18 } else { 8 * 210 } + 8 * 2;
        assert_eq!(s.stats().total_computed_tokens, expected);
        assert_eq!(s.kv().num_free_blocks(), 200);
    }
}

#[test]
fn abort_frees_blocks_at_once() {
    let mut s = sched(Cfg {
        max_num_seqs: 1,
        ..Cfg::default()
    });
    s.add_request(A, toks(0..10), 5).unwrap();
    s.add_request(B, toks(20..30), 5).unwrap();
    let out = step(&mut s);
    assert_eq!(s.kv().num_used_blocks(), 3);
    assert!(s.abort(A));
    assert_eq!(s.kv().num_used_blocks(), 0);
    assert!(!s.abort(A));
    s.check_invariants().unwrap();
    // The stale output and a sample for the aborted request are ignored.
    assert!(update(&mut s, &out, &[(A, 1)]).is_empty());
    assert!(s.abort(B), "waiting requests can be aborted too");
    assert_eq!(
        (s.num_running(), s.num_waiting(), s.has_unfinished()),
        (0, 0, false)
    );
    assert_eq!(s.schedule(), SchedulerOutput::default());
}

#[test]
fn length_finish_by_max_tokens_and_max_model_len() {
    let mut s = sched(Cfg {
        max_model_len: 10,
        ..Cfg::default()
    });
    s.add_request(A, toks(0..8), 100).unwrap(); // capped by max_model_len: 2 outputs
    s.add_request(B, toks(10..13), 2).unwrap();
    s.add_request(C, toks(20..30), 5).unwrap(); // prompt == max_model_len: 1 output
    let out = step(&mut s);
    let fin = update(&mut s, &out, &[(A, 1), (B, 1), (C, 1)]);
    assert_eq!(fin, vec![(C, FinishReason::Length)]);
    let out = step(&mut s);
    let fin = update(&mut s, &out, &[(A, 2), (B, 2)]);
    assert_eq!(
        fin,
        vec![(A, FinishReason::Length), (B, FinishReason::Length)]
    );
    assert!(!s.has_unfinished());
    assert_eq!(s.kv().num_free_blocks(), 64);
}

#[test]
fn add_request_rejects_what_can_never_run() {
    let mut s = sched(Cfg {
        num_blocks: 2,
        max_model_len: 100,
        ..Cfg::default()
    });
    s.add_request(A, toks(0..4), 5).unwrap(); // 4 + 4 tokens of KV = 8 slots: fits
    assert_eq!(
        s.add_request(A, toks(0..4), 1),
        Err(SchedError::DuplicateSeq(A))
    );
    assert_eq!(s.add_request(B, vec![], 1), Err(SchedError::EmptyPrompt(B)));
    assert_eq!(
        s.add_request(B, toks(0..4), 0),
        Err(SchedError::ZeroMaxTokens(B))
    );
    assert_eq!(
        s.add_request(B, toks(0..101), 1),
        Err(SchedError::PromptTooLong {
            seq_id: B,
            prompt_len: 101,
            max_model_len: 100
        })
    );
    let never = SchedError::NeverFits {
        seq_id: B,
        num_tokens: 9,
        num_slots: 8,
    };
    assert_eq!(s.add_request(B, toks(0..9), 1), Err(never.clone()));
    assert_eq!(s.add_request(B, toks(0..4), 6), Err(never));
    // max_model_len caps the growth: 7 tokens of KV at most.
    let mut s = sched(Cfg {
        num_blocks: 2,
        max_model_len: 8,
        ..Cfg::default()
    });
    s.add_request(B, toks(0..4), 1000).unwrap();
    assert!(Scheduler::try_new(
        SchedulerConfig {
            max_num_seqs: 0,
            max_num_batched_tokens: 1,
            max_model_len: 1,
            long_prefill_token_threshold: None
        },
        KvCacheConfig {
            num_blocks: 1,
            block_size: 1,
            enable_prefix_caching: false
        }
    )
    .is_err());
}

#[test]
fn speculative_step_feeds_proposals_and_rolls_back_rejected_blocks() {
    let mut s = sched(Cfg {
        budget: 6,
        caching: true,
        ..Cfg::default()
    });
    // Prompt of 6 tokens: blocks 0, 1 (block size 4).
    s.add_request(A, toks(0..6), 10).unwrap();
    let out = step(&mut s);
    assert_eq!(out.scheduled[0].num_new_tokens, 6);
    update(&mut s, &out, &[(A, 50)]);
    // Known 7 tokens, 6 computed. Five proposals: the budget (6) leaves room for all of them.
    assert!(s.set_spec_tokens(A, toks(60..65)));
    let out = step(&mut s);
    let a = &out.scheduled[0];
    assert_eq!(a.num_spec_tokens, 5);
    assert_eq!(a.num_new_tokens, 6);
    assert_eq!(a.token_ids, [vec![TokenId(50)], toks(60..65)].concat());
    // Positions 6..12 need blocks 0, 1, 2.
    assert_eq!(a.block_table, blocks(&[0, 1, 2]));
    assert!(a.samples);
    assert_eq!(out.num_batched_tokens, 6);
    // Two proposals accepted (60, 61), then the target's own token 99.
    let fin = s.update_from_output_multi(&out, &[(A, vec![TokenId(60), TokenId(61), TokenId(99)])]);
    s.check_invariants().unwrap();
    assert!(fin.is_empty());
    assert_eq!(
        s.all_token_ids(A).unwrap(),
        &[
            toks(0..6),
            vec![TokenId(50), TokenId(60), TokenId(61), TokenId(99)]
        ]
        .concat()[..]
    );
    // 6 prompt + 50 + 60 + 61 computed; 99 is not.
    assert_eq!(s.num_computed_tokens(A), Some(9));
    assert_eq!(s.kv().block_table(A), &blocks(&[0, 1, 2])[..]);
    // All rejected: back to 1 + 0 accepted; block 2 holds position 9 still (kept).
    assert!(s.set_spec_tokens(A, toks(70..75)));
    let out = step(&mut s);
    assert_eq!(out.scheduled[0].num_spec_tokens, 5);
    assert_eq!(out.scheduled[0].block_table, blocks(&[0, 1, 2, 3]));
    s.update_from_output_multi(&out, &[(A, vec![TokenId(98)])]);
    s.check_invariants().unwrap();
    assert_eq!(s.num_computed_tokens(A), Some(10));
    // Block 3 held only rejected tokens: freed.
    assert_eq!(s.kv().block_table(A), &blocks(&[0, 1, 2])[..]);
    assert_eq!(s.kv().num_used_blocks(), 3);
}

#[test]
fn proposals_never_pass_max_tokens_or_the_budget() {
    let mut s = sched(Cfg {
        budget: 3,
        ..Cfg::default()
    });
    s.add_request(A, toks(0..3), 4).unwrap();
    let out = step(&mut s);
    update(&mut s, &out, &[(A, 7)]);
    // One output so far, at most 4: room for 2 proposals plus the target's token; the budget of
    // 3 allows 2 as well.
    s.set_spec_tokens(A, toks(60..70));
    let out = step(&mut s);
    assert_eq!(out.scheduled[0].num_spec_tokens, 2);
    let fin = s.update_from_output_multi(&out, &[(A, vec![TokenId(60), TokenId(61), TokenId(5)])]);
    assert_eq!(fin, vec![(A, FinishReason::Length)]);
    s.check_invariants().unwrap();
    assert_eq!(s.kv().num_used_blocks(), 0);
    // A request still in its prompt ignores proposals.
    s.add_request(B, toks(0..8), 4).unwrap();
    assert!(!s.set_spec_tokens(B, toks(60..62)));
}
