//! Speculative decoding on every executor (quire-testkit's `executor_test!`), the CPU being the
//! oracle: greedy outputs with speculation on equal those with it off, for the n-gram proposer
//! and for a draft model equal to the target, in one batch that mixes speculating and plain
//! requests. `spec.rs` tests the rest (preemption, sampling, other drafts) on the CPU.
//!
//! Why the bound off the CPU: a verify step computes K + 1 positions of a sequence in one
//! forward, a plain step one; the CPU's kernels give the same numbers whatever the batch's shape,
//! so there the outputs must be identical. GPU backends pick kernels by shape and sum in other
//! orders, so a verify step's logits may differ from a one-token step's in the last bits, and a
//! greedy path may part where the two best tokens are nearly tied: there the outputs may part
//! only where the oracle's two choices are within `common::NEAR_TIE` (as `batching.rs` bounds
//! batched against solo runs), and the draft's acceptance stays high (a draft equal to the target
//! disagrees with the verify step only at such ties).
//!
//! The engine is built here directly, the draft included (not through the CLI, which refuses a
//! draft on CUDA with graphs on): on the GPU machine these tests show whether CUDA's graphs
//! replay a draft's steps correctly. The wgpu form runs on lavapipe in CI, so it takes a few
//! short prompts.

use quire_backend::KvCacheSpec;
use quire_core::{FinishReason, SamplingParams, SeqId, TokenId};
use quire_engine::{Engine, EngineConfig, EngineStats, SpecConfig};
use quire_testkit::{executor_test, Backend};

mod common;
use common::{check_greedy, drain};

fn load() -> quire_model::LoadedModel {
    quire_model::load_gguf(&quire_core::default_model::model_for_tests())
        .expect("default model loads")
}

const KV: KvCacheSpec = KvCacheSpec {
    num_blocks: 192,
    block_size: 16,
};

/// An engine on `b` proposing up to `k` tokens per step (0: speculation off).
fn engine(b: Backend, m: &quire_model::LoadedModel, k: usize) -> Engine {
    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        ..Default::default()
    };
    let mut e = Engine::new(b.executor(&m.weights, KV), m.tokenizer.clone(), cfg);
    e.set_speculation(SpecConfig {
        num_tokens: k,
        ..SpecConfig::default()
    })
    .unwrap();
    e
}

/// A passage the model is asked to repeat: prompt lookup finds long matches in it.
const PASSAGE: &str = "The old lighthouse stood on the northern cliff for two hundred years. \
Every night its keeper climbed the spiral stairs, trimmed the wick and polished the great lens, \
so that the fishing boats could find their way home through fog and storm.";

/// Prompts and output length: on the slow lavapipe adapter, two passage prompts and one plain one
/// of 24 tokens; elsewhere three passage prompts and five reference ones of 48.
fn workload(b: Backend, m: &quire_model::LoadedModel) -> (Vec<Vec<TokenId>>, usize) {
    let mut texts = vec![
        format!("Repeat the following passage exactly.\n\n{PASSAGE}\n\nRepeated passage:\n\n"),
        format!("{PASSAGE}\n\n{PASSAGE}\n\n"),
    ];
    let reference = common::reference();
    let (plain, n) = if b == Backend::Wgpu { (1, 24) } else { (5, 48) };
    if b != Backend::Wgpu {
        texts.push(format!(
            "Copy this text, replacing 'lighthouse' with 'tower':\n{PASSAGE}\nCopy:\n"
        ));
    }
    texts.extend(
        reference
            .iter()
            .take(plain)
            .map(|r| r["prompt"].as_str().unwrap().to_string()),
    );
    let prompts = texts
        .iter()
        .map(|t| m.tokenizer.encode(t, true, true).unwrap())
        .collect();
    (prompts, n)
}

type Outcome = (Vec<u32>, FinishReason);

/// Every prompt in one batch, greedy, `n` tokens at most; every third request opts out of
/// speculation, so speculating and plain rows share steps. Outcomes in prompt order.
fn run(mut e: Engine, prompts: &[Vec<TokenId>], n: usize) -> (Vec<Outcome>, EngineStats) {
    let ids: Vec<SeqId> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let params = SamplingParams {
                max_tokens: n,
                speculative: i % 3 != 1,
                ..Default::default()
            };
            e.add_request(p.clone(), params).unwrap()
        })
        .collect();
    let mut done = drain(&mut e);
    let outcomes = ids.iter().map(|id| done.remove(id).unwrap()).collect();
    (outcomes, e.stats())
}

/// Speculation's outputs against plain ones, prompt by prompt (`check_greedy`: identical on the
/// oracle, parting only at near-ties elsewhere); `what` names the run in failures.
fn check_all(
    b: Backend,
    m: &quire_model::LoadedModel,
    prompts: &[Vec<TokenId>],
    spec: &[Outcome],
    plain: &[Outcome],
    what: &str,
) {
    let stops: Vec<u32> = m.tokenizer.stop_tokens().iter().map(|t| t.0).collect();
    let mut oracle = None;
    for (i, ((p, got), want)) in prompts.iter().zip(spec).zip(plain).enumerate() {
        let prompt: Vec<u32> = p.iter().map(|t| t.0).collect();
        let ctx = (prompt.as_slice(), stops.as_slice());
        if let Err(e) = check_greedy(b, &m.weights, &mut oracle, ctx, got, want) {
            panic!("{}, {what}: prompt {i}: {e}", b.name());
        }
    }
}

executor_test! {
    fn greedy_is_unchanged_by_ngram_speculation(backend) {
        let m = load();
        let (prompts, n) = workload(backend, &m);
        let (plain, _) = run(engine(backend, &m, 0), &prompts, n);
        let (spec, stats) = run(engine(backend, &m, 4), &prompts, n);
        eprintln!("{}: n-gram K = 4: {stats:?}", backend.name());
        check_all(backend, &m, &prompts, &spec, &plain, "n-gram K = 4");
        assert!(stats.spec_verify_steps > 0, "nothing was proposed: {stats:?}");
        assert!(
            stats.spec_accepted_tokens * 4 > stats.spec_verify_steps,
            "acceptance is implausibly low on repeat prompts: {stats:?}"
        );
        assert!(stats.spec_accepted_tokens <= stats.spec_proposed_tokens);
        assert_eq!(stats.kv_blocks_used, 0, "blocks leaked: {stats:?}");
    }
}

executor_test! {
    fn greedy_is_unchanged_by_a_draft_equal_to_the_target(backend) {
        let m = load();
        let (prompts, n) = workload(backend, &m);
        let (plain, _) = run(engine(backend, &m, 0), &prompts, n);
        let mut e = engine(backend, &m, 4);
        e.set_draft_model(backend.executor(&m.weights, KV), &m.tokenizer)
            .unwrap();
        let (spec, stats) = run(e, &prompts, n);
        let rate = stats.spec_accepted_tokens as f64 / stats.spec_proposed_tokens.max(1) as f64;
        eprintln!("{}: draft = target, K = 4: acceptance {rate:.3} ({stats:?})", backend.name());
        check_all(backend, &m, &prompts, &spec, &plain, "draft = target");
        assert_eq!(stats.spec_proposer, "draft");
        assert!(
            stats.spec_proposed_tokens as usize > 4 * prompts.len(),
            "too little was proposed: {stats:?}"
        );
        // The draft is the target: on the oracle it disagrees with the verify step only after a
        // request ended (a proposal past its last token); elsewhere also at near-ties, which are
        // rare. A draft whose own steps go wrong (a stale cache or graph) is accepted far less.
        let floor = if backend.is_oracle() { 0.95 } else { 0.9 };
        assert!(
            rate >= floor,
            "acceptance {rate:.3} with the target as its own draft: {stats:?}"
        );
        assert_eq!(stats.spec_draft_no_room, 0, "{stats:?}");
        assert_eq!(stats.spec_draft_kv_blocks_used, 0, "draft blocks leaked: {stats:?}");
        assert_eq!(stats.kv_blocks_used, 0, "blocks leaked: {stats:?}");
    }
}
