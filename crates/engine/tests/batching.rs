//! Continuous batching on the default model: many requests stepped together through one paged
//! KV cache give exactly the tokens each gives alone, whatever the block size, with prefix caching
//! on or off, and when the cache is so small that requests are preempted and recomputed. Also:
//! a shared prompt prefix is computed once, and sampled requests draw the same tokens whether the
//! backend samples or the host does. Each test runs on every backend (quire-testkit's
//! `executor_test!`): exactly on the CPU oracle; on others greedy paths may part only at the
//! oracle's near-ties (`common::check_greedy`).

use std::sync::atomic::{AtomicUsize, Ordering};
use std::sync::Arc;

use quire_backend::{
    BackendError, Executor, ForwardBatch, KvCacheSpec, MaskFill, OpStat, SampleParams,
};
use quire_core::{FinishReason, SamplingParams, TokenId};
use quire_engine::{Engine, EngineConfig};
use quire_testkit::{executor_test, Backend};

mod common;
use common::{check_greedy, drain};

fn load() -> quire_model::LoadedModel {
    quire_model::load_gguf(&quire_core::default_model::model_for_tests())
        .expect("default model loads")
}

fn engine(
    b: Backend,
    m: &quire_model::LoadedModel,
    num_blocks: usize,
    block_size: usize,
    cfg: EngineConfig,
) -> Engine {
    let kv = KvCacheSpec {
        num_blocks,
        block_size,
    };
    Engine::new(b.executor(&m.weights, kv), m.tokenizer.clone(), cfg)
}

fn prompts(m: &quire_model::LoadedModel) -> Vec<Vec<TokenId>> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/smollm2-135m-q4_1.greedy.jsonl"
    );
    std::fs::read_to_string(path)
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            m.tokenizer
                .encode(v["prompt"].as_str().unwrap(), true, true)
                .unwrap()
        })
        .collect()
}

type Outcome = (Vec<u32>, FinishReason);

fn greedy(max_tokens: usize) -> SamplingParams {
    SamplingParams {
        max_tokens,
        ..Default::default()
    }
}

const MAX_TOKENS: [usize; 4] = [48, 7, 33, 16];

executor_test! {
    fn concurrent_requests_match_solo_runs(backend) {
        let m = load();
        let prompts = prompts(&m);
        let stops: Vec<u32> = m.tokenizer.stop_tokens().iter().map(|t| t.0).collect();
        let mut oracle = None;
        // Each prompt alone, with the longest max_tokens; shorter runs are its prefixes.
        let mut solo = Vec::new();
        for p in &prompts {
            let mut e = engine(backend, &m, 64, 16, EngineConfig::default());
            let id = e.add_request(p.clone(), greedy(48)).unwrap();
            solo.push(drain(&mut e).remove(&id).unwrap());
        }
        let expect = |i: usize, max_tokens: usize| -> Outcome {
            let (t, r) = &solo[i];
            if t.len() > max_tokens {
                (t[..max_tokens].to_vec(), FinishReason::Length)
            } else if t.len() == max_tokens && *r == FinishReason::Stop {
                // It would have stopped on the next token; with this budget it ends by length.
                (t.clone(), FinishReason::Length)
            } else {
                (t.clone(), *r)
            }
        };
        // (block size, blocks, prefix caching, expect preemption)
        let configs = [
            (16, 512, true, false),
            (16, 512, false, false),
            (32, 256, true, false),
            (32, 256, false, false),
            (64, 128, true, false),
            (64, 128, false, false),
            // 40 blocks of 16 = 640 slots for 32 requests of up to ~100 tokens: preemption.
            (16, 40, true, true),
            (16, 40, false, true),
        ];
        for (block_size, num_blocks, prefix, want_preempt) in configs {
            let cfg = EngineConfig {
                enable_prefix_caching: prefix,
                max_num_batched_tokens: 256,
                ..Default::default()
            };
            let mut e = engine(backend, &m, num_blocks, block_size, cfg);
            let mut ids = Vec::new();
            for (k, &mt) in MAX_TOKENS.iter().enumerate() {
                for (i, p) in prompts.iter().enumerate() {
                    ids.push((e.add_request(p.clone(), greedy(mt)).unwrap(), i, mt, k));
                }
            }
            let got = drain(&mut e);
            let label =
                format!("block size {block_size}, {num_blocks} blocks, prefix caching {prefix}");
            for (id, i, mt, _) in &ids {
                let prompt: Vec<u32> = prompts[*i].iter().map(|t| t.0).collect();
                let ctx = (prompt.as_slice(), stops.as_slice());
                if let Err(e) =
                    check_greedy(backend, &m.weights, &mut oracle, ctx, &got[id], &expect(*i, *mt))
                {
                    panic!("{label}: prompt {i}, max_tokens {mt}: {e}");
                }
            }
            let st = e.stats();
            assert_eq!(st.kv_blocks_used, 0, "{label}: blocks leaked");
            if want_preempt {
                assert!(
                    st.preemptions_total > 0,
                    "{label}: the small cache should have forced preemption"
                );
            } else {
                assert_eq!(st.preemptions_total, 0, "{label}");
            }
            if prefix && block_size <= 32 {
                // The same prompts arrive four times: copies admitted after the first computed a full
                // block hit the cache (no reference prompt fills a 64-token block).
                assert!(st.prefix_cache_hits > 0, "{label}: no prefix-cache hits");
            } else {
                assert_eq!(st.prefix_cache_hits, 0, "{label}");
            }
            eprintln!(
                "{label}: {} preemptions, {} prefix-cache hit tokens, {} steps",
                st.preemptions_total, st.prefix_cache_hits, st.steps
            );
        }
    }
}

executor_test! {
    fn shared_prefix_is_computed_once(backend) {
        let m = load();
        let text = std::fs::read_to_string(concat!(
            env!("CARGO_MANIFEST_DIR"),
            "/../../tests/data/REFERENCE.md"
        ))
        .unwrap();
        let all = m.tokenizer.encode(&text, false, false).unwrap();
        assert!(all.len() > 300);
        let prefix = all[..200].to_vec();
        let suffixes: Vec<Vec<TokenId>> = (0..8)
            .map(|i| {
                m.tokenizer
                    .encode(
                        &format!(" Question {i}: what is {}?", i * 7 + 3),
                        false,
                        false,
                    )
                    .unwrap()
            })
            .collect();
        let mut results = Vec::new();
        for caching in [true, false] {
            let cfg = EngineConfig {
                enable_prefix_caching: caching,
                ..Default::default()
            };
            let mut e = engine(backend, &m, 256, 16, cfg);
            let mut prompt_tokens = 0u64;
            let mut ids = Vec::new();
            let mut first = Vec::new();
            for (i, s) in suffixes.iter().enumerate() {
                let p: Vec<TokenId> = prefix.iter().chain(s).copied().collect();
                prompt_tokens += p.len() as u64;
                ids.push(e.add_request(p, greedy(1)).unwrap());
                if i == 0 {
                    // The first request's prompt is computed (and its blocks cached) before the rest arrive.
                    first = e.step().unwrap();
                }
            }
            let mut got = drain(&mut e);
            assert_eq!(first.len(), 1);
            let o = &first[0];
            let toks = o.tokens.iter().map(|t| t.token.0).collect();
            got.insert(
                o.id,
                (
                    toks,
                    o.finish_reason
                        .expect("max_tokens 1 ends at the first token"),
                ),
            );
            let computed = e.stats().computed_tokens_total;
            let shared = (200 / 16 * 16) as u64; // full blocks of the prefix
            if caching {
                assert_eq!(
                    computed,
                    prompt_tokens - 7 * shared,
                    "the shared prefix is computed once"
                );
                assert_eq!(e.stats().prefix_cache_hits, 7 * shared);
            } else {
                assert_eq!(computed, prompt_tokens);
            }
            eprintln!("prefix caching {caching}: {computed} of {prompt_tokens} prompt tokens computed");
            results.push(ids.iter().map(|id| got[id].clone()).collect::<Vec<_>>());
        }
        // Prefix caching changes no output (on backends other than the oracle, the cached
        // prompt's logits come from other chunk shapes: a first token may differ at a near-tie).
        let mut oracle = None;
        let stops: Vec<u32> = m.tokenizer.stop_tokens().iter().map(|t| t.0).collect();
        for (i, (with, without)) in results[0].iter().zip(&results[1]).enumerate() {
            let prompt: Vec<u32> = prefix.iter().chain(&suffixes[i]).map(|t| t.0).collect();
            let ctx = (prompt.as_slice(), stops.as_slice());
            if let Err(e) = check_greedy(backend, &m.weights, &mut oracle, ctx, with, without) {
                panic!("request {i}: prefix caching changes the output: {e}");
            }
        }
    }
}

/// Counts the executor calls that carry logits to the host and those that pick tokens in the
/// backend.
struct Counting {
    inner: Box<dyn Executor>,
    forwards: Arc<AtomicUsize>,
    samples: Arc<AtomicUsize>,
}

impl Executor for Counting {
    fn backend_name(&self) -> &'static str {
        "counting"
    }
    fn kv_spec(&self) -> KvCacheSpec {
        self.inner.kv_spec()
    }
    fn vocab_size(&self) -> usize {
        self.inner.vocab_size()
    }
    fn forward(&mut self, batch: &ForwardBatch) -> Result<&[f32], BackendError> {
        self.forwards.fetch_add(1, Ordering::Relaxed);
        self.inner.forward(batch)
    }
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        rows: &[SampleParams],
        masks: Option<&mut MaskFill>,
    ) -> Result<Vec<u32>, BackendError> {
        self.samples.fetch_add(1, Ordering::Relaxed);
        self.inner.forward_sample(batch, rows, masks)
    }
    fn forward_greedy(&mut self, batch: &ForwardBatch) -> Result<Vec<u32>, BackendError> {
        self.inner.forward_greedy(batch)
    }
    fn set_profiling(&mut self, on: bool) {
        self.inner.set_profiling(on);
    }
    fn take_profile(&mut self) -> Vec<OpStat> {
        self.inner.take_profile()
    }
}

executor_test! {
    fn sampling_in_the_backend_draws_what_the_host_sampler_draws(backend) {
        let m = load();
        let prompts = prompts(&m);
        let sampled = |i: usize, logprobs: bool| SamplingParams {
            temperature: 0.9,
            top_k: [0, 50][i % 2],
            top_p: 0.9,
            min_p: 0.02,
            seed: Some(100 + i as u64),
            max_tokens: 24,
            logprobs,
            ..Default::default()
        };
        // The same seeded requests (and one greedy one) with logprobs off, so the engine hands the
        // backend one SampleParams per row, and on, so the logits come to the host sampler.
        let mut runs = vec![];
        for logprobs in [false, true] {
            let (forwards, samples) = (Arc::default(), Arc::default());
            let kv = KvCacheSpec {
                num_blocks: 256,
                block_size: 16,
            };
            let exec = Counting {
                inner: backend.executor(&m.weights, kv),
                forwards: Arc::clone(&forwards),
                samples: Arc::clone(&samples),
            };
            let mut e = Engine::new(Box::new(exec), m.tokenizer.clone(), EngineConfig::default());
            let mut ids = vec![];
            for (i, p) in prompts.iter().take(6).enumerate() {
                ids.push(e.add_request(p.clone(), sampled(i, logprobs)).unwrap());
            }
            ids.push(e.add_request(prompts[0].clone(), greedy(24)).unwrap());
            let got = drain(&mut e);
            let (forwards, samples) = (
                forwards.load(Ordering::Relaxed),
                samples.load(Ordering::Relaxed),
            );
            if logprobs {
                assert_eq!(samples, 0, "logprobs need the logits on the host");
            } else {
                assert!(
                    samples > 0 && forwards == 0,
                    "{samples} backend samplings, {forwards} forwards"
                );
            }
            runs.push(ids.iter().map(|id| got[id].clone()).collect::<Vec<_>>());
        }
        if backend.is_oracle() {
            assert_eq!(runs[0], runs[1]);
        } else {
            // A backend that samples on the device sums probabilities in another order than the
            // host's f32 sorted sums, so a draw right at a top-p, min-p or u boundary may pick
            // another token (tests/cuda.rs holds such rows under 2% on the model's logits); a
            // request's two paths are comparable up to their first difference.
            let (mut draws, mut partings) = (0usize, 0usize);
            for (i, (dev, host)) in runs[0].iter().zip(&runs[1]).enumerate() {
                let n = dev.0.iter().zip(&host.0).take_while(|(a, b)| a == b).count();
                draws += n;
                if dev != host {
                    partings += 1;
                    draws += 1;
                    eprintln!("request {i}: device and host sampling part at token {n}");
                }
            }
            assert!(
                partings * 50 < draws,
                "{partings} of {draws} draws differ between device and host sampling"
            );
        }
        let distinct: std::collections::HashSet<_> = runs[0].iter().map(|r| &r.0).collect();
        assert!(distinct.len() > 1, "the requests should not all agree");
    }
}
