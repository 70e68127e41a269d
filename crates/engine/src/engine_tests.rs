//! The engine keeps no copy of a request's tokens: the scheduler's list is the sampler's history.
//! These tests check that this one list stays right when the cache is so small that requests are
//! preempted and recomputed: it equals prompt + streamed tokens after every step, and requests
//! whose picks depend on it (repetition and presence penalties, sampled on the host) produce the
//! same tokens as when each runs alone.

use std::collections::HashMap;

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::KvCacheSpec;
use quire_core::{SamplingParams, SeqId, TokenId};

use super::{Engine, EngineConfig};

fn load() -> quire_model::LoadedModel {
    quire_model::load_gguf(&quire_core::default_model::model_for_tests())
        .expect("default model loads")
}

fn engine(m: &quire_model::LoadedModel, num_blocks: usize) -> Engine {
    let kv = KvCacheSpec {
        num_blocks,
        block_size: 16,
    };
    let exec = CpuExecutor::new(&m.weights, kv, CpuOptions::default()).unwrap();
    let cfg = EngineConfig {
        max_num_batched_tokens: 128,
        ..Default::default()
    };
    Engine::new(Box::new(exec), m.tokenizer.clone(), cfg)
}

/// Greedy with penalties: the pick depends on the whole history, so the host samples it.
fn penalised(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        repetition_penalty: 1.3,
        presence_penalty: 0.5,
        ignore_eos: true,
        ..Default::default()
    }
}

/// Steps until every request finished, checking after each step that the scheduler's tokens of
/// every unfinished request are its prompt followed by exactly the tokens streamed so far.
fn drain_checked(
    e: &mut Engine,
    prompts: &HashMap<SeqId, Vec<TokenId>>,
) -> HashMap<SeqId, Vec<u32>> {
    let mut streamed: HashMap<SeqId, Vec<TokenId>> = HashMap::new();
    let mut done = HashMap::new();
    let mut steps = 0;
    while e.has_unfinished() {
        steps += 1;
        assert!(steps < 20_000, "engine does not make progress");
        for o in e.step().unwrap() {
            let s = streamed.entry(o.id).or_default();
            s.extend(o.tokens.iter().map(|t| t.token));
            if o.finish_reason.is_some() {
                done.insert(o.id, s.iter().map(|t| t.0).collect());
            }
        }
        for (id, prompt) in prompts {
            let Some(history) = e.sched.all_token_ids(*id) else {
                continue; // finished
            };
            let mut want = prompt.clone();
            want.extend(streamed.get(id).into_iter().flatten());
            assert_eq!(history, &want[..], "{id}: history after step {steps}");
        }
    }
    done
}

#[test]
fn token_history_survives_preemption() {
    let m = load();
    let texts = [
        "The capital of France is",
        "Once upon a time, in a small village by the sea,",
        "List the planets of the solar system:",
        "def fibonacci(n):",
        "The quick brown fox",
        "In 1969, the first people to walk on the Moon",
    ];
    let prompts: Vec<Vec<TokenId>> = texts
        .iter()
        .map(|t| m.tokenizer.encode(t, true, true).unwrap())
        .collect();
    const MAX_TOKENS: usize = 40;
    let solo: Vec<Vec<u32>> = prompts
        .iter()
        .map(|p| {
            let mut e = engine(&m, 16);
            let id = e.add_request(p.clone(), penalised(MAX_TOKENS)).unwrap();
            let ids = HashMap::from([(id, p.clone())]);
            drain_checked(&mut e, &ids).remove(&id).unwrap()
        })
        .collect();
    // 12 blocks of 16 = 192 slots for six requests of ~50 tokens each (4 blocks each at the end).
    let mut e = engine(&m, 12);
    let mut ids = HashMap::new();
    let mut order = Vec::new();
    for p in &prompts {
        let id = e.add_request(p.clone(), penalised(MAX_TOKENS)).unwrap();
        ids.insert(id, p.clone());
        order.push(id);
    }
    let got = drain_checked(&mut e, &ids);
    assert!(
        e.stats().preemptions_total > 0,
        "the small cache should have forced preemption"
    );
    for (i, id) in order.iter().enumerate() {
        assert_eq!(got[id].len(), MAX_TOKENS, "prompt {i}");
        assert_eq!(
            got[id], solo[i],
            "prompt {i}: tokens differ from its solo run"
        );
    }
    assert_eq!(e.stats().kv_blocks_used, 0, "blocks leaked");
}

/// A grammar that admits no next token (here a matcher left in an error state, which has no
/// mask) ends its request with finish reason `grammar` and no further output, on the device path
/// (a plain greedy request: masks go to the executor) and on the host path (log-probabilities
/// asked), sampled or greedy; the plain request in the same batch runs to its length.
#[test]
fn a_grammar_that_admits_no_token_ends_its_request() {
    use quire_core::{Constraint, FinishReason};
    let m = load();
    let prompt = m.tokenizer.encode("A person as JSON:", true, true).unwrap();
    for (logprobs, temperature) in [(false, 0.0), (false, 1.0), (true, 0.0), (true, 1.0)] {
        let label = format!("logprobs {logprobs}, temperature {temperature}");
        let mut e = engine(&m, 64);
        let guided = SamplingParams {
            max_tokens: 16,
            logprobs,
            temperature,
            seed: Some(1),
            constraint: Some(Constraint::JsonObject),
            ..Default::default()
        };
        let g = e.add_request(prompt.clone(), guided).unwrap();
        let plain = SamplingParams {
            max_tokens: 6,
            ignore_eos: true,
            ..Default::default()
        };
        let p = e.add_request(prompt.clone(), plain).unwrap();
        // Poison the grammar: consume a token it refuses.
        let guide = e.requests.get_mut(&g).unwrap().guide.as_mut().unwrap();
        let mask = guide.mask().unwrap();
        let refused = (0..mask.len() as u32)
            .find(|&t| !mask.is_allowed(t))
            .unwrap();
        assert!(guide.consume(TokenId(refused)).is_err(), "{label}");
        assert!(
            guide.mask().is_err(),
            "{label}: an errored matcher has no mask"
        );
        let mut out: HashMap<SeqId, (Vec<TokenId>, Option<FinishReason>)> = HashMap::new();
        let mut steps = 0;
        while e.has_unfinished() {
            steps += 1;
            assert!(steps < 100, "{label}: no progress");
            for o in e.step().unwrap() {
                let r = out.entry(o.id).or_default();
                r.0.extend(o.tokens.iter().map(|t| t.token));
                r.1 = o.finish_reason;
            }
        }
        assert_eq!(out[&g], (vec![], Some(FinishReason::Grammar)), "{label}");
        assert_eq!(out[&p].0.len(), 6, "{label}");
        assert_eq!(out[&p].1, Some(FinishReason::Length), "{label}");
        assert_eq!(e.stats().kv_blocks_used, 0, "{label}: blocks leaked");
    }
}
