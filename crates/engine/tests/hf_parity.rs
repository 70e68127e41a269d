//! HF model folders against references: (1) on every backend (quire-testkit's `executor_test!`),
//! tiny models of each architecture (f32 and bf16 files, one file or shards) against a plain f64
//! forward pass, by the testkit's relative L2 error: the CPU in f32 within 1e-5, other backends
//! (f16 weights and activations) within `LOGITS_F16_WEIGHTS`, greedy tokens equal or parting at a
//! near-tie of the f64 logits; (2) on the CPU, against transformers, from the fixtures that
//! tests/hf/make_models.py and make_moe_model.py (Qwen3-MoE) wrote (tokenization, transformers'
//! logits of every position, 32 greedy tokens, the chat template; the weights are re-created here
//! from the portable generator); (3) that Mistral's sliding window is applied and matters. The
//! CUDA backend against transformers on larger bf16 folders is `hf_cuda.rs`.

use quire_backend::cpu::{CpuExecutor, CpuOptions, KvDtype};
use quire_backend::{Executor, KvCacheSpec};
use quire_core::SamplingParams;
use quire_engine::runner::forward_single;
use quire_engine::{Engine, EngineConfig};
use quire_model::hf_fixture::Dtype;
use quire_testkit::metric::LOGITS_F16_WEIGHTS;
use quire_testkit::{executor_test, Backend};
use serde_json::Value;

mod hf_common;
use hf_common::*;

/// `m` on `backend`: the CPU with an f32 KV cache (every step in f32), others as they come.
fn on(backend: Backend, m: &quire_model::LoadedModel) -> Box<dyn Executor> {
    let kv = KvCacheSpec {
        num_blocks: 16,
        block_size: 16,
    };
    if backend != Backend::Cpu {
        return backend.executor(&m.weights, kv);
    }
    Box::new(
        CpuExecutor::new(
            &m.weights,
            KvCacheSpec {
                num_blocks: 16,
                block_size: 16,
            },
            CpuOptions {
                kv_dtype: KvDtype::F32,
                ..CpuOptions::default()
            },
        )
        .unwrap(),
    )
}

/// `m` on `backend`, or why the backend does not take such a model: the wgpu backend refuses
/// what it has no kernels for at load (mixture-of-experts layers), and the test skips that model
/// on it, printing the loader's reason. Any other failure fails the test.
fn on_or_skip(backend: Backend, m: &quire_model::LoadedModel) -> Result<Box<dyn Executor>, String> {
    if backend != Backend::Wgpu {
        return Ok(on(backend, m));
    }
    let kv = KvCacheSpec {
        num_blocks: 16,
        block_size: 16,
    };
    let opts = quire_backend::wgpu::WgpuOptions {
        adapter: std::env::var("QUIRE_WGPU_ADAPTER").ok(),
    };
    match quire_backend::wgpu::executor(&m.weights, kv, &opts) {
        Ok(ex) => Ok(ex),
        Err(e @ quire_backend::BackendError::UnsupportedType { .. }) => Err(e.to_string()),
        Err(e) => quire_testkit::missing(backend, &e),
    }
}

fn all_logits(m: &quire_model::LoadedModel, tokens: &[u32]) -> Vec<f32> {
    all_logits_on(Backend::Cpu, m, tokens)
}

fn all_logits_on(b: Backend, m: &quire_model::LoadedModel, tokens: &[u32]) -> Vec<f32> {
    let rows: Vec<u32> = (0..tokens.len() as u32).collect();
    forward_single(on(b, m).as_mut(), tokens, &rows).unwrap()
}

/// `n` greedy tokens after `prompt` through the engine (EOS ignored, as the script's loop).
fn greedy(m: &quire_model::LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    greedy_on(Backend::Cpu, m, prompt, n)
}

fn greedy_on(b: Backend, m: &quire_model::LoadedModel, prompt: &[u32], n: usize) -> Vec<u32> {
    let mut engine = Engine::new(on(b, m), m.tokenizer.clone(), EngineConfig::default());
    let id = engine
        .add_request(
            prompt.iter().map(|&t| quire_core::TokenId(t)).collect(),
            SamplingParams {
                max_tokens: n,
                ignore_eos: true,
                ..Default::default()
            },
        )
        .unwrap();
    let mut out = Vec::new();
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            assert_eq!(o.id, id);
            out.extend(o.tokens.iter().map(|t| t.token.0));
        }
    }
    out
}

/// The token sequence the f64 tests use: the fixture text's ids (quire's tokenizer), BOS first.
fn test_tokens(m: &quire_model::LoadedModel) -> Vec<u32> {
    let text = "The quick brown fox jumps over the lazy dog, and the theory said: it's 2024!\n\
                Hello  world\t<|im_end|> model token quire 12345.";
    let mut t = vec![317];
    t.extend(
        m.tokenizer
            .encode(text, false, true)
            .unwrap()
            .iter()
            .map(|t| t.0),
    );
    t
}

/// Where a backend other than the CPU may part from the f64 reference's greedy tokens: where the
/// f64 logits of the two choices are within this (tiny random models have logits of order 1, and
/// f16 rounding moves them by ~1e-3 each).
const NEAR_TIE_LOGIT: f64 = 0.05;

/// A mixture's router margin (f64 logits of the last chosen expert and the first left out)
/// below which an f16 rounding of the router's input (2^-11 relative, on logits of order 1) may
/// choose another expert. Measured on the tiny Qwen3-MoE: the bf16 file has margins of 1.0e-4
/// and 6.2e-4, where the CUDA backend's logits part from the f64 pass (rel L2 1.1e-2 over all
/// positions, 7e-4 for the f32 file, whose smallest margin is 1.8e-3).
const ROUTER_NEAR_TIE: f64 = 1e-3;

executor_test! {
    fn tiny_models_match_the_f64_reference(backend) {
        // The CPU in f32 lies within ~1e-6 of the f64 pass (measured: 3e-7 to 9e-7).
        let bound = if backend == Backend::Cpu { 1e-5 } else { LOGITS_F16_WEIGHTS };
        let (mut compared, mut skipped) = (0, 0);
        for arch in ARCHS {
            let cfg = tiny_config(arch);
            let tensors = tiny_manifest(arch, &cfg);
            for (dtype, shards) in [(Dtype::F32, 1), (Dtype::BF16, 1), (Dtype::F32, 3)] {
                let dir = TempDir::new(arch);
                write_folder(&dir.0, arch, &cfg, &tensors, dtype, shards);
                let m = quire_model::load(&dir.0).unwrap();
                assert_eq!(m.weights.tok_embd.dtype.name(), format!("{dtype:?}"));
                let tokens = test_tokens(&m);
                assert!(tokens.len() > 30, "{}", tokens.len());
                let mut ex = match on_or_skip(backend, &m) {
                    Ok(ex) => ex,
                    Err(why) => {
                        eprintln!("SKIPPED {} {arch} {dtype:?} x{shards}: {why}", backend.name());
                        skipped += 1;
                        continue;
                    }
                };
                compared += 1;
                let rows: Vec<u32> = (0..tokens.len() as u32).collect();
                let got = forward_single(ex.as_mut(), &tokens, &rows).unwrap();
                drop(ex);
                let round: &dyn Fn(f32) -> f32 = if dtype == Dtype::BF16 {
                    &bf16_round
                } else {
                    &|v| v
                };
                let (want, margins) = reference_logits_and_margins(&cfg, &tensors, &tokens, round);
                // Positions where a mixture's router is at a near-tie may take another expert
                // on a backend that rounds the router's input to f16 (they count on the CPU).
                let vocab = want[0].len();
                let (mut kept_got, mut kept_want, mut ties) = (vec![], vec![], 0);
                for (t, w) in want.iter().enumerate() {
                    if backend != Backend::Cpu && margins[t] < ROUTER_NEAR_TIE {
                        ties += 1;
                        continue;
                    }
                    kept_got.extend_from_slice(&got[t * vocab..(t + 1) * vocab]);
                    kept_want.push(w.clone());
                }
                let rel = rel_err(&kept_got, &kept_want);
                eprintln!(
                    "{} {arch} {dtype:?} x{shards}: rel L2 {rel:.2e} over {} positions \
                     ({ties} left out: router near-ties), all {:.2e}",
                    backend.name(),
                    kept_want.len(),
                    rel_err(&got, &want)
                );
                assert!(rel < bound, "{arch} {dtype:?} x{shards}: rel L2 {rel:e} (bound {bound:e})");
                if dtype == Dtype::F32 && shards == 1 {
                    // Greedy: the engine's 32 tokens equal the reference's argmax chain.
                    let prompt = &tokens[..8];
                    let mut seq = prompt.to_vec();
                    for _ in 0..32 {
                        let l = reference_logits(&cfg, &tensors, &seq, &|v| v);
                        seq.push(argmax(l.last().unwrap()));
                    }
                    let g = greedy_on(backend, &m, prompt, 32);
                    let agree = g.iter().zip(&seq[8..]).take_while(|(a, b)| a == b).count();
                    if agree < 32 {
                        assert!(backend != Backend::Cpu, "{arch} greedy: {g:?} vs {:?}", &seq[8..]);
                        let ctx = &seq[..8 + agree];
                        let l = reference_logits(&cfg, &tensors, ctx, &|v| v);
                        let l = l.last().unwrap();
                        let gap = l[seq[8 + agree] as usize] - l[g[agree] as usize];
                        eprintln!("{arch}: greedy parts at {agree}, f64 logits {gap:.4} apart");
                        assert!(gap <= NEAR_TIE_LOGIT, "{arch} greedy parts at {agree}: f64 gap {gap:.4}");
                    }
                }
            }
        }
        eprintln!("{}: {compared} models compared, {skipped} skipped", backend.name());
        assert!(compared > 0, "{} compared no model ({skipped} skipped)", backend.name());
    }
}

#[test]
fn sharded_equals_single_file_bit_for_bit() {
    // Qwen3-MoE: a layer's experts spread over shards.
    for (arch, shards) in [("qwen2", 2), ("qwen3_moe", 4)] {
        let cfg = tiny_config(arch);
        let tensors = tiny_manifest(arch, &cfg);
        let one = TempDir::new("one");
        let many = TempDir::new("many");
        write_folder(&one.0, arch, &cfg, &tensors, Dtype::F32, 1);
        write_folder(&many.0, arch, &cfg, &tensors, Dtype::F32, shards);
        let last = format!("model-{shards:05}-of-{shards:05}.safetensors");
        assert!(many.0.join(last).exists());
        assert!(!many.0.join("model.safetensors").exists());
        let (a, b) = (
            quire_model::load(&one.0).unwrap(),
            quire_model::load(&many.0).unwrap(),
        );
        let tokens = test_tokens(&a);
        assert_eq!(all_logits(&a, &tokens), all_logits(&b, &tokens), "{arch}");
    }
}

#[test]
fn mistral_sliding_window_is_applied_and_matters() {
    let arch = "mistral";
    let cfg = tiny_config(arch);
    let tensors = tiny_manifest(arch, &cfg);
    let dir = TempDir::new(arch);
    write_folder(&dir.0, arch, &cfg, &tensors, Dtype::F32, 1);
    let m = quire_model::load(&dir.0).unwrap();
    assert_eq!(m.weights.config.sliding_window, Some(8));
    let tokens = test_tokens(&m);
    let got = all_logits(&m, &tokens);
    let mut no_window = cfg.clone();
    no_window["sliding_window"] = Value::Null;
    let dense = reference_logits(&no_window, &tensors, &tokens, &|v| v);
    let windowed = reference_logits(&cfg, &tensors, &tokens, &|v| v);
    // Up to the window the two agree; beyond it they part, and quire follows the windowed one.
    assert!(rel_err(&got[..8 * 320], &dense[..8]) < 1e-4);
    assert!(rel_err(&got, &dense) > 1e-2, "the window changes nothing?");
    assert!(rel_err(&got, &windowed) < 1e-4);
}

/// transformers' outputs (tests/hf/fixtures, written by make_models.py and make_moe_model.py with
/// transformers 5.17 / torch 2.11): tokenization, logits of all 61 positions (relative error < 1e-4), 32 greedy tokens,
/// the chat template's rendering.
#[test]
fn matches_transformers_fixtures() {
    for arch in ARCHS {
        let fx = fixture_dir(arch);
        let reference: Value = serde_json::from_str(
            &std::fs::read_to_string(fx.join("reference.json"))
                .unwrap_or_else(|e| panic!("{arch}: reference.json: {e}")),
        )
        .unwrap();
        let ids = |k: &str| -> Vec<u32> {
            reference[k]
                .as_array()
                .unwrap()
                .iter()
                .map(|v| v.as_u64().unwrap() as u32)
                .collect()
        };
        let tensors = quire_model::hf_fixture::read_manifest(&fx.join("manifest.json")).unwrap();
        let config: Value =
            serde_json::from_str(&std::fs::read_to_string(fx.join("config.json")).unwrap())
                .unwrap();
        let dir = TempDir::new(arch);
        write_folder(&dir.0, arch, &config, &tensors, Dtype::F32, 1);
        let m = quire_model::load(&dir.0).unwrap();

        // Tokenizer: the text's ids as the `tokenizers` library gave them.
        let text = reference["text"].as_str().unwrap();
        let ours: Vec<u32> = m
            .tokenizer
            .encode(text, false, true)
            .unwrap()
            .iter()
            .map(|t| t.0)
            .collect();
        assert_eq!(ours, ids("text_ids"), "{arch}: tokenization");

        // Logits of every position.
        let input = ids("input_ids");
        let bytes = std::fs::read(fx.join("logits.f32.bin")).unwrap();
        let theirs: Vec<f64> = bytes
            .chunks_exact(4)
            .map(|c| f32::from_le_bytes(c.try_into().unwrap()) as f64)
            .collect();
        let vocab = m.weights.config.vocab_size;
        assert_eq!(theirs.len(), input.len() * vocab, "{arch}: logits size");
        let want: Vec<Vec<f64>> = theirs.chunks(vocab).map(<[f64]>::to_vec).collect();
        let got = all_logits(&m, &input);
        let rel = rel_err(&got, &want);
        eprintln!(
            "{arch}: rel err vs transformers {rel:.2e} over {} positions",
            input.len()
        );
        assert!(rel < 1e-4, "{arch}: rel err {rel:e}");
        // The f64 reference of the other tests agrees with transformers too.
        let f64_ref = reference_logits(&config, &tensors, &input, &|v| v);
        let flat: Vec<f32> = f64_ref.iter().flatten().map(|&v| v as f32).collect();
        let rel_ref = rel_err(&flat, &want);
        eprintln!("{arch}: f64 reference vs transformers {rel_ref:.2e}");
        assert!(rel_ref < 1e-5, "{arch}: f64 reference rel err {rel_ref:e}");

        // 32 greedy tokens.
        let g = greedy(&m, &ids("prompt_ids"), 32);
        assert_eq!(g, ids("greedy_ids"), "{arch}: greedy tokens");

        // The chat template renders as transformers rendered it.
        if let Some(want) = reference["chat_template_render"].as_str() {
            let msgs = [
                quire_tokenizer::ChatMessage::new("system", "Be brief."),
                quire_tokenizer::ChatMessage::new("user", "Hello"),
            ];
            assert_eq!(m.chat_template.render(&msgs, true).unwrap(), want, "{arch}");
        }
    }
}
