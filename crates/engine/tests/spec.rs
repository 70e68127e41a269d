//! Speculative decoding on the default model (CPU): greedy outputs are token-identical with the
//! n-gram proposer on and off — on many prompts, with speculative and plain requests in one
//! batch, stop strings and short `max_tokens`, and in a KV cache so small that requests are
//! preempted — and sampled outputs follow the target's own distribution (a chi-square test of a
//! token produced by a verify step against the probabilities the target gives it). The draft-model
//! proposer: the default model as its own draft is accepted nearly always, a scrambled 2-layer
//! draft nearly never, a draft KV pool too small for the requests proposes nothing for them, and
//! in every case greedy outputs equal those of speculation off; a draft of another vocabulary is
//! refused.

use std::collections::HashMap;

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::KvCacheSpec;
use quire_core::{FinishReason, SamplingParams, SeqId, TokenId};
use quire_engine::{Engine, EngineConfig, Sampler, SpecConfig};

fn load() -> quire_model::LoadedModel {
    quire_model::load_gguf(&quire_core::default_model::model_for_tests())
        .expect("default model loads")
}

fn engine(m: &quire_model::LoadedModel, num_blocks: usize, spec: usize) -> Engine {
    let kv = KvCacheSpec {
        num_blocks,
        block_size: 16,
    };
    let exec = CpuExecutor::new(&m.weights, kv, CpuOptions::default()).unwrap();
    let cfg = EngineConfig {
        max_num_batched_tokens: 256,
        ..Default::default()
    };
    let mut e = Engine::new(Box::new(exec), m.tokenizer.clone(), cfg);
    e.set_speculation(SpecConfig {
        num_tokens: spec,
        ..SpecConfig::default()
    })
    .unwrap();
    e
}

/// A passage the model is asked to repeat: n-gram lookup finds long matches.
const PASSAGE: &str = "The old lighthouse stood on the northern cliff for two hundred years. \
Every night its keeper climbed the spiral stairs, trimmed the wick and polished the great lens, \
so that the fishing boats could find their way home through fog and storm. When the keeper grew \
old, his daughter took over the work, and she kept the light burning for forty more winters.";

fn prompts(m: &quire_model::LoadedModel) -> Vec<Vec<TokenId>> {
    let mut texts: Vec<String> = reference_prompts();
    texts.push(format!(
        "Repeat the following passage exactly.\n\n{PASSAGE}\n\nRepeated passage:\n\n"
    ));
    texts.push(format!("{PASSAGE}\n\n{PASSAGE}\n\n"));
    texts.push(format!(
        "Copy this text, replacing 'lighthouse' with 'tower':\n{PASSAGE}\nCopy:\n"
    ));
    texts
        .iter()
        .map(|t| m.tokenizer.encode(t, true, true).unwrap())
        .collect()
}

fn reference_prompts() -> Vec<String> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/smollm2-135m-q4_1.greedy.jsonl"
    );
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            v["prompt"].as_str().unwrap().to_string()
        })
        .collect()
}

type Outcome = (Vec<u32>, String, FinishReason);

/// Steps until every request finished; returns each request's tokens, text and finish reason.
fn drain(e: &mut Engine) -> HashMap<SeqId, Outcome> {
    let mut acc: HashMap<SeqId, (Vec<u32>, String)> = HashMap::new();
    let mut done = HashMap::new();
    let mut steps = 0;
    while e.has_unfinished() {
        steps += 1;
        assert!(steps < 100_000, "engine does not make progress");
        for o in e.step().unwrap() {
            let a = acc.entry(o.id).or_default();
            a.0.extend(o.tokens.iter().map(|t| t.token.0));
            a.1.push_str(&o.text_delta);
            if let Some(r) = o.finish_reason {
                let (t, s) = acc.remove(&o.id).unwrap_or_default();
                done.insert(o.id, (t, s, r));
            }
        }
    }
    done
}

/// Request `i`'s parameters: varied lengths, one with a stop string, every third opted out.
fn params(i: usize) -> SamplingParams {
    SamplingParams {
        max_tokens: [96, 5, 40, 64][i % 4],
        stop: if i % 5 == 2 {
            vec![" the".into()]
        } else {
            Vec::new()
        },
        speculative: i % 3 != 1,
        ..Default::default()
    }
}

/// Runs every prompt in one batch; returns outcomes in prompt order and the engine's stats.
fn run_batch(
    m: &quire_model::LoadedModel,
    prompts: &[Vec<TokenId>],
    num_blocks: usize,
    spec: usize,
) -> (Vec<Outcome>, quire_engine::EngineStats) {
    let mut e = engine(m, num_blocks, spec);
    let ids: Vec<SeqId> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| e.add_request(p.clone(), params(i)).unwrap())
        .collect();
    let mut out = drain(&mut e);
    let outcomes = ids.iter().map(|id| out.remove(id).unwrap()).collect();
    (outcomes, e.stats())
}

#[test]
fn greedy_is_token_identical_with_speculation_on_and_off() {
    let m = load();
    let prompts = prompts(&m);
    let (plain, _) = run_batch(&m, &prompts, 256, 0);
    for k in [3, 8] {
        let (spec, stats) = run_batch(&m, &prompts, 256, k);
        for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
            assert_eq!(a, b, "prompt {i}, K = {k}");
        }
        assert!(stats.spec_verify_steps > 0, "K = {k}: nothing was proposed");
        assert!(
            stats.spec_accepted_tokens * 4 > stats.spec_verify_steps,
            "K = {k}: acceptance is implausibly low on repeat prompts: {stats:?}"
        );
        assert!(stats.spec_accepted_tokens <= stats.spec_proposed_tokens);
    }
}

#[test]
fn greedy_is_token_identical_when_speculation_meets_preemption() {
    let m = load();
    let prompts = prompts(&m);
    // 24 blocks of 16 tokens for 11 requests of up to ~190 tokens: preemption.
    let (plain, _) = run_batch(&m, &prompts, 24, 0);
    let (spec, stats) = run_batch(&m, &prompts, 24, 6);
    assert!(
        stats.preemptions_total > 0,
        "the cache was not tight: {stats:?}"
    );
    assert!(stats.spec_accepted_tokens > 0);
    assert_eq!(stats.kv_blocks_used, 0, "blocks leaked: {stats:?}");
    for (i, (a, b)) in plain.iter().zip(&spec).enumerate() {
        assert_eq!(a, b, "prompt {i}");
    }
}

/// Upper 0.1% point of the chi-square distribution with `df` degrees of freedom
/// (Wilson–Hilferty approximation).
fn chi2_critical(df: f64) -> f64 {
    let z = 3.09;
    let a = 2.0 / (9.0 * df);
    df * (1.0 - a + z * a.sqrt()).powi(3)
}

/// Chi-square statistic of `counts` against `probs` (token → probability), with tokens whose
/// expected count is below 5 pooled into one bucket; returns (statistic, degrees of freedom).
fn chi2(counts: &HashMap<u32, usize>, probs: &[(u32, f64)], n: usize) -> (f64, f64) {
    let (mut stat, mut buckets) = (0.0, 0usize);
    let (mut rest_obs, mut rest_exp) = (0usize, 0.0);
    for &(id, p) in probs {
        let exp = p * n as f64;
        let obs = counts.get(&id).copied().unwrap_or(0);
        if exp >= 5.0 {
            stat += (obs as f64 - exp).powi(2) / exp;
            buckets += 1;
        } else {
            rest_obs += obs;
            rest_exp += exp;
        }
    }
    let known: std::collections::HashSet<u32> = probs.iter().map(|e| e.0).collect();
    rest_obs += counts
        .iter()
        .filter(|(id, _)| !known.contains(id))
        .map(|e| e.1)
        .sum::<usize>();
    if rest_exp > 0.0 {
        stat += (rest_obs as f64 - rest_exp).powi(2) / rest_exp;
        buckets += 1;
    } else {
        assert_eq!(
            rest_obs, 0,
            "tokens the target gives no probability were drawn"
        );
    }
    (stat, (buckets - 1) as f64)
}

#[test]
fn sampled_tokens_follow_the_target_distribution() {
    let m = load();
    // The first output token is sampled from the prompt (no proposals yet); the second comes out
    // of a verify step. Condition on the first being the likely one, then compare the second's
    // counts with the target's probabilities after prompt + that token.
    let prompt = m
        .tokenizer
        .encode(&format!("{PASSAGE}\n\n{PASSAGE}\n\n{PASSAGE}"), true, true)
        .unwrap();
    let temperature = 1.0;
    // Room for the proposals: a request never speculates past its max_tokens.
    let sampling = |seed: u64, spec: usize| SamplingParams {
        temperature,
        max_tokens: 2 + spec,
        ignore_eos: true,
        seed: Some(seed),
        ..Default::default()
    };
    let draws = 400;
    let mut firsts = Vec::new();
    for (spec, seed0) in [(0usize, 0u64), (3, 1_000_000)] {
        let mut e = engine(&m, 512, spec);
        let ids: Vec<SeqId> = (0..draws)
            .map(|i| {
                e.add_request(prompt.clone(), sampling(seed0 + i as u64, spec))
                    .unwrap()
            })
            .collect();
        let out = drain(&mut e);
        let stats = e.stats();
        // The test means something only if many second tokens came out of verify steps.
        if spec > 0 {
            assert!(stats.spec_verify_steps as usize > draws / 4, "{stats:?}");
        }
        firsts.push((
            ids.iter().map(|id| out[id].0.clone()).collect::<Vec<_>>(),
            stats,
        ));
    }
    // The most common first token, and the target's distribution of the second after it.
    let mut count0: HashMap<u32, usize> = HashMap::new();
    for (toks, _) in &firsts {
        for t in toks {
            *count0.entry(t[0]).or_default() += 1;
        }
    }
    let (&first, _) = count0.iter().max_by_key(|e| *e.1).unwrap();
    let mut seq: Vec<u32> = prompt.iter().map(|t| t.0).collect();
    seq.push(first);
    let mut exec = CpuExecutor::new(
        &m.weights,
        KvCacheSpec {
            num_blocks: seq.len().div_ceil(16),
            block_size: 16,
        },
        CpuOptions::default(),
    )
    .unwrap();
    let logits =
        quire_engine::runner::forward_single(&mut exec, &seq, &[seq.len() as u32 - 1]).unwrap();
    let sampler = Sampler::new(sampling(0, 0));
    let probs = sampler.target_probs(&logits);
    for (spec, (toks, _)) in [0, 3].iter().zip(&firsts) {
        let mut counts: HashMap<u32, usize> = HashMap::new();
        let mut n = 0;
        for t in toks.iter().filter(|t| t[0] == first) {
            *counts.entry(t[1]).or_default() += 1;
            n += 1;
        }
        assert!(
            n > draws / 4,
            "too few draws with the likely first token: {n}"
        );
        let (stat, df) = chi2(&counts, &probs, n);
        let crit = chi2_critical(df);
        eprintln!("K = {spec}: n = {n}, chi2 = {stat:.1}, df = {df}, critical {crit:.1}");
        assert!(
            stat < crit,
            "K = {spec}: second token does not follow the target (chi2 {stat:.1} >= {crit:.1})"
        );
    }
}

/// A draft on the CPU with its own cache of `blocks` blocks of 16 tokens, set on `e`.
fn with_draft(
    mut e: Engine,
    draft: &quire_backend::ModelWeights,
    blocks: usize,
    m: &quire_model::LoadedModel,
) -> Engine {
    let kv = KvCacheSpec {
        num_blocks: blocks,
        block_size: 16,
    };
    let exec = CpuExecutor::new(draft, kv, CpuOptions::default()).unwrap();
    e.set_draft_model(Box::new(exec), &m.tokenizer).unwrap();
    e
}

/// A few prompts (three reference ones and two passage ones) with short outputs, for runs that
/// pay for a draft model as large as the target.
fn few_prompts(m: &quire_model::LoadedModel) -> Vec<Vec<TokenId>> {
    let all = prompts(m);
    let n = all.len();
    let mut few: Vec<Vec<TokenId>> = all[..3].to_vec();
    few.extend_from_slice(&all[n - 3..n - 1]);
    few
}

/// Runs `prompts` in one batch on `e` (requests as `params`, at most 32 tokens each; every
/// third opts out of speculation, so the batch mixes speculating and plain rows). With `sampled`,
/// one more request samples (temperature 0.8): it speculates too, and takes the batch's
/// verification to the host, where greedy rows are verified from whole logits rows.
fn run_draft_batch(
    mut e: Engine,
    prompts: &[Vec<TokenId>],
    sampled: bool,
) -> (Vec<Outcome>, quire_engine::EngineStats) {
    let extra = sampled.then(|| {
        let p = SamplingParams {
            temperature: 0.8,
            seed: Some(7),
            max_tokens: 16,
            ignore_eos: true,
            ..Default::default()
        };
        e.add_request(prompts[0].clone(), p).unwrap()
    });
    let ids: Vec<SeqId> = prompts
        .iter()
        .enumerate()
        .map(|(i, p)| {
            let mut sp = params(i);
            sp.max_tokens = sp.max_tokens.min(32);
            e.add_request(p.clone(), sp).unwrap()
        })
        .collect();
    let mut out = drain(&mut e);
    if let Some(id) = extra {
        let (toks, _, reason) = out.remove(&id).unwrap();
        assert_eq!((toks.len(), reason), (16, FinishReason::Length));
    }
    let outcomes = ids.iter().map(|id| out.remove(id).unwrap()).collect();
    (outcomes, e.stats())
}

fn plain_outcomes(m: &quire_model::LoadedModel, prompts: &[Vec<TokenId>]) -> Vec<Outcome> {
    run_draft_batch(engine(m, 256, 0), prompts, false).0
}

/// The default model with two layers and its token embeddings (tied to the output) shuffled:
/// a model of the same vocabulary whose guesses are unrelated to the target's.
fn scrambled_draft(m: &quire_model::LoadedModel) -> quire_backend::ModelWeights {
    let mut w = m.weights.clone();
    w.layers.truncate(2);
    w.config.num_layers = 2;
    assert!(
        w.output.is_none(),
        "the default model ties its output to the embeddings"
    );
    let vocab = w.config.vocab_size;
    let bytes = w.tok_embd.bytes.as_slice();
    let row = bytes.len() / vocab;
    let mut shuffled = vec![0u8; bytes.len()];
    for i in 0..vocab {
        let j = (i * 7919 + 13) % vocab; // 7919 is prime and does not divide 49152: a permutation
        shuffled[i * row..(i + 1) * row].copy_from_slice(&bytes[j * row..(j + 1) * row]);
    }
    w.tok_embd.bytes = quire_backend::TensorBytes::owned(shuffled);
    w
}

fn assert_same(plain: &[Outcome], spec: &[Outcome], what: &str) {
    for (i, (a, b)) in plain.iter().zip(spec).enumerate() {
        assert_eq!(a, b, "prompt {i}, {what}");
    }
}

#[test]
fn draft_equal_to_the_target_is_accepted_and_changes_nothing_in_a_mixed_batch() {
    let m = load();
    let prompts = few_prompts(&m);
    let plain = plain_outcomes(&m, &prompts);
    let (spec, stats) = run_draft_batch(
        with_draft(engine(&m, 256, 4), &m.weights, 256, &m),
        &prompts,
        false,
    );
    assert_same(&plain, &spec, "draft = target");
    assert_eq!(stats.spec_proposer, "draft");
    assert!(
        stats.spec_proposed_tokens > 50,
        "too little was proposed: {stats:?}"
    );
    let rate = stats.spec_accepted_tokens as f64 / stats.spec_proposed_tokens as f64;
    eprintln!("draft = target: acceptance {rate:.3} ({stats:?})");
    assert!(
        rate >= 0.95,
        "acceptance {rate:.3} with the target as its own draft: {stats:?}"
    );
    assert_eq!(stats.spec_draft_no_room, 0);
    assert_eq!(
        stats.spec_draft_kv_blocks_used, 0,
        "draft blocks leaked: {stats:?}"
    );
    assert_eq!(stats.kv_blocks_used, 0);
}

#[test]
fn scrambled_draft_is_rejected_and_changes_nothing_beside_a_sampled_request() {
    let m = load();
    let prompts = few_prompts(&m);
    let plain = plain_outcomes(&m, &prompts);
    let draft = scrambled_draft(&m);
    let (spec, stats) = run_draft_batch(
        with_draft(engine(&m, 256, 3), &draft, 256, &m),
        &prompts,
        true,
    );
    assert_same(&plain, &spec, "scrambled draft");
    assert!(
        stats.spec_proposed_tokens > 50,
        "too little was proposed: {stats:?}"
    );
    let rate = stats.spec_accepted_tokens as f64 / stats.spec_proposed_tokens as f64;
    eprintln!("scrambled draft: acceptance {rate:.3} ({stats:?})");
    assert!(
        rate < 0.1,
        "acceptance {rate:.3} from an unrelated draft: {stats:?}"
    );
    assert_eq!(
        stats.spec_draft_kv_blocks_used, 0,
        "draft blocks leaked: {stats:?}"
    );
}

#[test]
fn draft_without_room_proposes_nothing_and_changes_nothing() {
    let m = load();
    let prompts = few_prompts(&m);
    let plain = plain_outcomes(&m, &prompts);
    // 6 blocks of 16 tokens: room for one short request's draft at a time, none for the passages.
    let (spec, stats) = run_draft_batch(
        with_draft(engine(&m, 256, 4), &m.weights, 6, &m),
        &prompts,
        false,
    );
    assert_same(&plain, &spec, "tiny draft pool");
    assert!(
        stats.spec_draft_no_room > 0,
        "the draft pool was not tight: {stats:?}"
    );
    assert_eq!(stats.spec_draft_kv_blocks_total, 6);
    assert_eq!(
        stats.spec_draft_kv_blocks_used, 0,
        "draft blocks leaked: {stats:?}"
    );
}

#[test]
fn draft_with_another_vocabulary_is_refused() {
    let m = load();
    let spec = quire_tokenizer::TokenizerSpec {
        model: "llama".into(),
        tokens: ["<unk>", "a", "b", "c"].map(String::from).to_vec(),
        ..Default::default()
    };
    let other = quire_tokenizer::Tokenizer::from_spec(spec).unwrap();
    let kv = KvCacheSpec {
        num_blocks: 4,
        block_size: 16,
    };
    let exec = CpuExecutor::new(&m.weights, kv, CpuOptions::default()).unwrap();
    let mut e = engine(&m, 64, 4);
    let err = e
        .set_draft_model(Box::new(exec), &other)
        .unwrap_err()
        .to_string();
    let n = m.tokenizer.vocab_size();
    assert!(
        err.contains("4 tokens") && err.contains(&format!("{n}")),
        "{err}"
    );
    assert_eq!(
        e.stats().spec_proposer,
        "ngram",
        "a refused draft must not replace the proposer"
    );
}
