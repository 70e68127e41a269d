//! The CUDA backend against the CPU backend on the default model (or QUIRE_PARITY_MODEL).
//!
//! Held to the bounds (teacher-forced logits within 1e-2; greedy continuations that part only at
//! near-ties of the CPU's own log-probabilities), with the CPU's attention accumulating in f32 as
//! the CUDA kernel does (`CpuOptions::attn_f16_accum = false`):
//! - the stored Q4_1/Q8_0 weights, which both backends multiply with 8-bit activation blocks
//!   (CUDA's dp4a kernels, every prompt on that path);
//! - the weights dequantized to f16 (CUDA: cuBLAS on f16 rows; CPU: f32 activations).
//!
//! Reported beside them: the CPU's default attention (Q and the V accumulator rounded to f16, as
//! llama.cpp's CPU flash attention) and CUDA's default options (64+ token prompts through f16
//! cuBLAS). With 8-bit activations a small difference upstream moves some values across a
//! rounding step, so those pairings sit near the distance between 8-bit and f32 activations
//! (~3.5e-2 on this model) by design.
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

/// `quantized`: Q4_0/Q4_1/Q8_0 weights kept as stored with 8-bit activations (the CPU's
/// numerics) for every batch size; otherwise every weight dequantized to f16 for cuBLAS.
fn cuda(m: &quire_model::LoadedModel, blocks: usize, quantized: bool) -> Box<dyn Executor> {
    let opts = CudaOptions {
        num_blocks: Some(blocks),
        block_size: 16,
        quantized_weights: quantized,
        dequant_gemm_tokens: usize::MAX,
        ..Default::default()
    };
    CudaExecutor::new(&m.weights, opts).unwrap()
}

/// The CPU backend with f32 attention accumulation (the CUDA kernel's numerics).
fn cpu(w: &ModelWeights, blocks: usize) -> Box<dyn Executor> {
    cpu_with(w, blocks, false)
}

fn cpu_with(w: &ModelWeights, blocks: usize, attn_f16_accum: bool) -> Box<dyn Executor> {
    let kv = KvCacheSpec {
        num_blocks: blocks,
        block_size: 16,
    };
    let opts = CpuOptions {
        attn_f16_accum,
        ..CpuOptions::default()
    };
    Box::new(CpuExecutor::new(w, kv, opts).unwrap())
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
    // Stored (quantized) weights on both backends, and both on the weights dequantized to f16.
    let w16 = m.weights.dequantized_f16().unwrap();
    // The default options too: prompts of 64+ tokens then go through f16 cuBLAS GEMMs (reported,
    // not held to the bound: unquantized activations differ from the CPU's by design).
    let default_opts = CudaOptions {
        num_blocks: Some(64),
        ..Default::default()
    };
    let mut pairs = [
        ("stored weights", cuda(&m, 64, true), cpu(&m.weights, 64)),
        (
            "f16-dequantized weights",
            cuda(&m, 64, false),
            cpu(&w16, 64),
        ),
        (
            "stored weights, the CPU's f16 attention accumulation (report only)",
            cuda(&m, 64, true),
            cpu_with(&m.weights, 64, true),
        ),
        (
            "stored weights, default options (report only)",
            CudaExecutor::new(&m.weights, default_opts).unwrap(),
            cpu(&m.weights, 64),
        ),
    ];
    let vocab = m.weights.config.vocab_size;
    let mut failures = vec![];
    for (name, gpu, cpu) in pairs.iter_mut() {
        let (mut worst, mut sum, mut rows_total) = (0f64, 0f64, 0usize);
        for r in reference() {
            let seq: Vec<u32> = ids(&r["prompt_tokens"])
                .into_iter()
                .chain(ids(&r["completion_tokens"]))
                .collect();
            let rows: Vec<u32> = (0..seq.len() as u32).collect();
            let want = forward_single(cpu.as_mut(), &seq, &rows).unwrap();
            let got = forward_single(gpu.as_mut(), &seq, &rows).unwrap();
            for i in 0..seq.len() {
                let row = i * vocab..(i + 1) * vocab;
                let e = rel_err(&got[row.clone()], &want[row]);
                worst = worst.max(e);
                sum += e;
                rows_total += 1;
            }
        }
        eprintln!(
            "CUDA vs CPU on {name}: mean relative error {:.2e}, worst {worst:.2e} over {rows_total} rows",
            sum / rows_total as f64
        );
        if worst >= 1e-2 && !name.contains("report only") {
            failures.push(format!("{name}: worst row relative error {worst:.2e}"));
        }
    }
    assert!(failures.is_empty(), "{failures:#?}");
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
    let vocab = m.weights.config.vocab_size;
    let mut failures = vec![];
    for (name, quantized, w) in [("stored", true, &m.weights), ("f16", false, &w16)] {
        // Batched with small prefill chunks (mixed steps, CUDA graphs for the decode steps) and solo.
        let batched = greedy(cuda(&m, 512, quantized), &m, &prompts, 32);
        let want = greedy(cpu(w, 512), &m, &prompts, 512);
        let mut reference_exec = cpu(w, 64);
        let (mut agree_total, mut total) = (0, 0);
        for (i, p) in prompts.iter().enumerate() {
            let solo = greedy(cuda(&m, 64, quantized), &m, std::slice::from_ref(p), 512).remove(0);
            for (run, got) in [("batched", &batched[i]), ("solo", &solo)] {
                let agree = got.iter().zip(&want[i]).take_while(|(a, b)| a == b).count();
                agree_total += agree;
                total += want[i].len();
                if agree < want[i].len().min(got.len()) {
                    // The reference's own log-probability gap between the two choices there.
                    let seq: Vec<u32> = p.iter().chain(&want[i][..agree]).copied().collect();
                    let last = [seq.len() as u32 - 1];
                    let l = forward_single(reference_exec.as_mut(), &seq, &last).unwrap();
                    let lse = log_sum_exp(&l[..vocab]);
                    let gap = (l[want[i][agree] as usize] - lse) - (l[got[agree] as usize] - lse);
                    eprintln!("{name} weights, {run} prompt {i}: parts at {agree}, the reference's two choices {gap:.4} apart");
                    if gap > 0.05 {
                        failures.push(format!(
                            "{name} weights, {run} prompt {i}: parts at {agree} where the choices are {gap:.4} apart"
                        ));
                    }
                }
            }
        }
        eprintln!("CUDA greedy on {name} weights: {agree_total}/{total} tokens agree with the CPU backend on the same weights");
    }
    assert!(failures.is_empty(), "{failures:#?}");
}
