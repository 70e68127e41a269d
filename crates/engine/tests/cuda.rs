//! The CUDA backend against the CPU backend on the default model (or QUIRE_PARITY_MODEL).
//!
//! CUDA computes with f16 weights and unquantized activations; the CPU backend, like llama.cpp,
//! quantizes activations to 8 bits for Q4/Q8 weights, which alone moves this model's logits by
//! ~3.5% (relative, mean; `cargo run --release -p quire-engine --example act_quant_effect`). So
//! the yardstick is the CPU backend on the same weights dequantized to f16 (f32 activations):
//! teacher-forced logits within 1e-2, and greedy continuations that part only at near-ties of
//! that reference. The distance to the CPU backend on the stored weights is printed beside it.
//! Needs a GPU; skipped without one unless QUIRE_REQUIRE_GPU is set.
#![cfg(feature = "cuda")]

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::cuda::{CudaExecutor, CudaOptions};
use quire_backend::{Executor, KvCacheSpec, ModelWeights};
use quire_core::SamplingParams;
use quire_engine::runner::forward_single;
use quire_engine::sampler::log_sum_exp;
use quire_engine::{Engine, EngineConfig};

mod common;
use common::{ids, reference};

fn model() -> quire_model::LoadedModel {
    let path = std::env::var_os("QUIRE_PARITY_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(quire_core::default_model::model_for_tests);
    quire_model::load_gguf(&path).expect("model loads")
}

fn gpu_present() -> bool {
    match quire_backend::cuda::gpu::Gpu::new(0) {
        Ok(_) => true,
        Err(e) if std::env::var_os("QUIRE_REQUIRE_GPU").is_some() => panic!("{e}"),
        Err(e) => {
            eprintln!("SKIPPED (no GPU): {e}");
            false
        }
    }
}

fn cuda(m: &quire_model::LoadedModel, blocks: usize) -> Box<dyn Executor> {
    let opts = CudaOptions {
        num_blocks: Some(blocks),
        block_size: 16,
        ..Default::default()
    };
    CudaExecutor::new(&m.weights, opts).unwrap()
}

fn cpu(w: &ModelWeights, blocks: usize) -> Box<dyn Executor> {
    let kv = KvCacheSpec {
        num_blocks: blocks,
        block_size: 16,
    };
    Box::new(CpuExecutor::new(w, kv, CpuOptions::default()).unwrap())
}

fn rel_err(a: &[f32], b: &[f32]) -> f64 {
    let (mut num, mut den) = (0f64, 0f64);
    for (&x, &y) in a.iter().zip(b) {
        num += ((x - y) as f64).powi(2);
        den += (y as f64).powi(2);
    }
    (num / den).sqrt()
}

#[test]
fn teacher_forced_logits_match_the_cpu_backend() {
    if !gpu_present() {
        return;
    }
    let m = model();
    let mut gpu = cuda(&m, 64);
    let mut cpu16 = cpu(&m.weights.dequantized_f16().unwrap(), 64);
    let mut cpu_q = cpu(&m.weights, 64);
    let vocab = gpu.vocab_size();
    let (mut worst, mut sum, mut worst_q, mut sum_q, mut rows_total) =
        (0f64, 0f64, 0f64, 0f64, 0usize);
    for r in reference() {
        let seq: Vec<u32> = ids(&r["prompt_tokens"])
            .into_iter()
            .chain(ids(&r["completion_tokens"]))
            .collect();
        let rows: Vec<u32> = (0..seq.len() as u32).collect();
        let want = forward_single(cpu16.as_mut(), &seq, &rows).unwrap();
        let stored = forward_single(cpu_q.as_mut(), &seq, &rows).unwrap();
        let got = forward_single(gpu.as_mut(), &seq, &rows).unwrap();
        for i in 0..seq.len() {
            let row = i * vocab..(i + 1) * vocab;
            let e = rel_err(&got[row.clone()], &want[row.clone()]);
            let eq = rel_err(&got[row.clone()], &stored[row]);
            worst = worst.max(e);
            sum += e;
            worst_q = worst_q.max(eq);
            sum_q += eq;
            rows_total += 1;
        }
    }
    let n = rows_total as f64;
    eprintln!("CUDA vs CPU on f16-dequantized weights: mean relative error {:.2e}, worst {worst:.2e} over {rows_total} rows", sum / n);
    eprintln!(
        "CUDA vs CPU on the stored weights (8-bit activations): mean {:.2e}, worst {worst_q:.2e}",
        sum_q / n
    );
    assert!(worst < 1e-2, "worst row relative error {worst:.2e}");
}

/// Greedy continuations of every reference prompt, all submitted to one engine.
fn greedy(
    exec: Box<dyn Executor>,
    m: &quire_model::LoadedModel,
    prompts: &[Vec<u32>],
    budget: usize,
) -> Vec<Vec<u32>> {
    let cfg = EngineConfig {
        max_num_batched_tokens: budget,
        ..EngineConfig::default()
    };
    let mut engine = Engine::new(exec, m.tokenizer.clone(), cfg);
    let ids: Vec<_> = prompts
        .iter()
        .map(|p| {
            engine
                .add_request(
                    p.iter().map(|&t| quire_core::TokenId(t)).collect(),
                    SamplingParams {
                        max_tokens: 48,
                        ..Default::default()
                    },
                )
                .unwrap()
        })
        .collect();
    let mut out = vec![vec![]; prompts.len()];
    while engine.has_unfinished() {
        for o in engine.step().unwrap() {
            let i = ids.iter().position(|id| *id == o.id).unwrap();
            out[i].extend(o.tokens.iter().map(|t| t.token.0));
        }
    }
    out
}

#[test]
fn greedy_continuations_part_only_at_near_ties() {
    if !gpu_present() {
        return;
    }
    let m = model();
    let w16 = m.weights.dequantized_f16().unwrap();
    let prompts: Vec<Vec<u32>> = reference()
        .iter()
        .map(|r| ids(&r["prompt_tokens"]))
        .collect();
    // Batched with small prefill chunks (mixed steps, CUDA graphs for the decode steps) and solo.
    let batched = greedy(cuda(&m, 512), &m, &prompts, 32);
    let want = greedy(cpu(&w16, 512), &m, &prompts, 512);
    let mut cpu16 = cpu(&w16, 64);
    let vocab = m.weights.config.vocab_size;
    let (mut agree_total, mut total, mut failures) = (0, 0, vec![]);
    for (i, p) in prompts.iter().enumerate() {
        let solo = greedy(cuda(&m, 64), &m, std::slice::from_ref(p), 512).remove(0);
        for (name, got) in [("batched", &batched[i]), ("solo", &solo)] {
            let agree = got.iter().zip(&want[i]).take_while(|(a, b)| a == b).count();
            agree_total += agree;
            total += want[i].len();
            if agree < want[i].len().min(got.len()) {
                // The reference's own log-probability gap between the two choices there.
                let seq: Vec<u32> = p.iter().chain(&want[i][..agree]).copied().collect();
                let l = forward_single(cpu16.as_mut(), &seq, &[seq.len() as u32 - 1]).unwrap();
                let lse = log_sum_exp(&l[..vocab]);
                let gap = (l[want[i][agree] as usize] - lse) - (l[got[agree] as usize] - lse);
                eprintln!("{name} prompt {i}: parts at {agree}, the reference's two choices {gap:.4} apart");
                if gap > 0.05 {
                    failures.push(format!(
                        "{name} prompt {i}: parts at {agree} where the choices are {gap:.4} apart"
                    ));
                }
            }
        }
    }
    eprintln!("CUDA greedy: {agree_total}/{total} tokens agree with the CPU reference on f16-dequantized weights");
    assert!(failures.is_empty(), "{failures:#?}");
}
