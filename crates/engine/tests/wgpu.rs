//! The wgpu backend's greedy continuations against the CPU backend on the default model (or
//! QUIRE_PARITY_MODEL), with the CPU's attention accumulating in f32 as the wgpu kernel does
//! (`CpuOptions::attn_f16_accum = false`): on weights dequantized to f16 they part only at
//! near-ties (0.05) of the CPU's own log-probabilities. Runs on any adapter (CI: lavapipe).
//! The teacher-forced logits are held to the CPU oracle in tests/teacher_forced.rs, one body for
//! every backend.
//!
//! Needs an adapter: ignored unless QUIRE_REQUIRE_WGPU was set at build time (see
//! quire-testkit); the engine suites of tests/batching.rs and tests/reference.rs run on wgpu too.
#![cfg_attr(not(feature = "wgpu"), allow(dead_code, unused_imports))]

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::{Executor, KvCacheSpec, ModelWeights};
use quire_engine::runner::forward_single;
use quire_engine::sampler::log_sum_exp;
use quire_testkit::Backend;

mod common;
use common::{ids, reference};

fn model() -> quire_model::LoadedModel {
    let path = std::env::var_os("QUIRE_PARITY_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(quire_core::default_model::model_for_tests);
    quire_model::load_gguf(&path).expect("model loads")
}

fn kv(blocks: usize) -> KvCacheSpec {
    KvCacheSpec {
        num_blocks: blocks,
        block_size: 16,
    }
}

fn cpu(w: &ModelWeights, blocks: usize) -> Box<dyn Executor> {
    let opts = CpuOptions {
        attn_f16_accum: false,
        ..CpuOptions::default()
    };
    Box::new(CpuExecutor::new(w, kv(blocks), opts).unwrap())
}

quire_testkit::wgpu_test! {
    fn greedy_continuations_on_f16_weights_part_only_at_near_ties() {
        let m = model();
        let w16 = m.weights.dequantized_f16().unwrap();
        let vocab = m.weights.config.vocab_size;
        let mut gpu = Backend::Wgpu.executor(&w16, kv(64));
        let mut oracle = cpu(&w16, 64);
        let mut failures = vec![];
        for r in reference().iter().take(2) {
            let mut seq = ids(&r["prompt_tokens"]);
            for step in 0..8 {
                let last = [seq.len() as u32 - 1];
                let g = forward_single(gpu.as_mut(), &seq, &last).unwrap();
                let c = forward_single(oracle.as_mut(), &seq, &last).unwrap();
                let (tg, tc) = (quire_backend::argmax(&g), quire_backend::argmax(&c));
                if tg != tc {
                    let lse = log_sum_exp(&c[..vocab]);
                    let gap = (c[tc as usize] - lse) - (c[tg as usize] - lse);
                    eprintln!("parts at step {step}: the CPU's two choices {gap:.4} apart");
                    if gap > 0.05 {
                        failures.push(format!("{:?}: parts at {step}, gap {gap:.4}", r["prompt"]));
                    }
                    break;
                }
                seq.push(tc);
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }
}
