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

quire_testkit::wgpu_test! {
    /// Chain decode (K greedy steps in one submission, each step's argmax copied into the next
    /// step's token ids on the device) gives the tokens of K single greedy steps, for two rows
    /// of different lengths (K small: lavapipe runs about one step a second).
    fn chain_decode_matches_step_by_step() {
        use quire_backend::{chain, ForwardBatch, SeqBatch};
        use quire_core::BlockId;
        const STEPS: usize = 4;
        let m = model();
        let vocab = m.weights.config.vocab_size as u32;
        let per = 4usize; // blocks of 16 per sequence: 64 tokens
        let tables: Vec<Vec<BlockId>> = (0..2)
            .map(|i| (0..per).map(|b| BlockId((b * 2 + i) as u32)).collect())
            .collect();
        let prompts: Vec<Vec<u32>> = (0..2u32)
            .map(|i| (0..9 + 14 * i).map(|j| (j * 131 + 17 * i + 5) % vocab).collect())
            .collect();
        let slot = |t: &[BlockId], q: u32| t[q as usize / 16].0 * 16 + q % 16;
        let mut got = Vec::new();
        for use_chain in [true, false] {
            let mut e = Backend::Wgpu.executor(&m.weights, kv(2 * per));
            let mut first = Vec::new();
            for (p, t) in prompts.iter().zip(&tables) {
                let pos: Vec<u32> = (0..p.len() as u32).collect();
                let slots: Vec<u32> = pos.iter().map(|&q| slot(t, q)).collect();
                let seqs = [SeqBatch { query_start: 0, query_len: p.len(), seq_len: p.len(), block_table: t }];
                let batch = ForwardBatch {
                    token_ids: p, positions: &pos, slot_mapping: &slots, seqs: &seqs,
                    logits_indices: &[p.len() as u32 - 1],
                };
                first.push(e.forward_greedy(&batch).unwrap()[0]);
            }
            let pos: Vec<u32> = prompts.iter().map(|p| p.len() as u32).collect();
            let slots: Vec<u32> = pos.iter().zip(&tables).map(|(&q, t)| slot(t, q)).collect();
            let seqs: Vec<SeqBatch> = (0..2)
                .map(|i| SeqBatch { query_start: i, query_len: 1, seq_len: pos[i] as usize + 1, block_table: &tables[i] })
                .collect();
            let batch = ForwardBatch {
                token_ids: &first, positions: &pos, slot_mapping: &slots, seqs: &seqs,
                logits_indices: &[0, 1],
            };
            let toks = if use_chain {
                e.forward_greedy_chain(&batch, STEPS).unwrap()
            } else {
                chain::by_steps(e.as_mut(), &batch, STEPS).unwrap()
            };
            assert_eq!(toks.len(), STEPS * 2);
            got.push(toks);
        }
        assert_eq!(got[0], got[1], "chain vs step by step");
        eprintln!("chain decode: {STEPS} steps of 2 rows equal: {:?}", got[0]);
    }
}

/// Fused and unfused one-token steps sum in different orders (the norm's squares, where RoPE
/// runs), and every later step reads K/V that the prompt's GEMM summed in its own order (split
/// over columns where its tiles are few): on lavapipe their logits part by 4e-6 to 1.9e-4 (rel
/// L2) over the default model's 30 layers, a step to step spread of 40×, while a wrong fusion
/// (a norm scale, a rotated pair) moves them by 1e-2 or more.
const FUSED_BOUND: f64 = 1e-3;

quire_testkit::wgpu_test! {
    /// A one-token step fuses its RMSNorms, RoPE and SwiGLU into its GEMVs (three dispatches
    /// fewer per layer): over a prompt and four decode steps on f16 weights (fixed tokens, a
    /// scattered block table), each step's logits match the unfused executor's within f32
    /// rounding ([`FUSED_BOUND`]), and its top token is the CPU's or parts from it only at a near-tie (0.05).
    fn fused_decode_steps_match_unfused_steps_and_the_cpu() {
        use quire_backend::wgpu::{WgpuExecutor, WgpuOptions};
        use quire_backend::{ForwardBatch, SeqBatch};
        use quire_core::BlockId;
        let m = model();
        let w16 = m.weights.dequantized_f16().unwrap();
        let (layers, vocab) = (w16.config.num_layers, w16.config.vocab_size);
        let opts = WgpuOptions { adapter: std::env::var("QUIRE_WGPU_ADAPTER").ok() };
        let table: Vec<BlockId> = (0..4).map(|b| BlockId(3 - b)).collect();
        let toks: Vec<u32> = (0..15u32).map(|j| (j * 131 + 5) % vocab as u32).collect();
        let steps = [(0usize, 11usize), (11, 1), (12, 1), (13, 1), (14, 1)];
        let mut fused = WgpuExecutor::new(&w16, kv(4), &opts).unwrap();
        let mut unfused = WgpuExecutor::new(&w16, kv(4), &opts).unwrap();
        unfused.set_fusions(false);
        let mut oracle = cpu(&w16, 4);
        for (start, len) in steps {
            let pos: Vec<u32> = (start as u32..(start + len) as u32).collect();
            let slots: Vec<u32> = pos.iter().map(|&q| table[q as usize / 16].0 * 16 + q % 16).collect();
            let seqs = [SeqBatch { query_start: 0, query_len: len, seq_len: start + len, block_table: &table }];
            let batch = ForwardBatch {
                token_ids: &toks[start..start + len], positions: &pos, slot_mapping: &slots,
                seqs: &seqs, logits_indices: &[len as u32 - 1],
            };
            let f = fused.forward(&batch).unwrap().to_vec();
            let u = unfused.forward(&batch).unwrap().to_vec();
            let c = oracle.forward(&batch).unwrap().to_vec();
            let e = quire_testkit::metric::rel_l2(&f, &u);
            eprintln!(
                "step at {start}: fused vs unfused rel L2 {e:.2e}, fused vs the CPU {:.2e}",
                quire_testkit::metric::rel_l2(&f, &c)
            );
            assert!(e < FUSED_BOUND, "step at {start} (+{len}): fused vs unfused rel L2 {e:e}");
            let (tf, tc) = (quire_backend::argmax(&f), quire_backend::argmax(&c));
            let lse = log_sum_exp(&c[..vocab]);
            let gap = (c[tc as usize] - lse) - (c[tf as usize] - lse);
            assert!(tf == tc || gap < 0.05, "step at {start}: top {tf} vs the CPU's {tc}, gap {gap}");
        }
        let (df, du) = (fused.last_dispatches(), unfused.last_dispatches());
        assert!(du >= df + 3 * layers, "dispatches of a decode step: fused {df}, unfused {du}");
        eprintln!("decode step dispatches: fused {df}, unfused {du} ({layers} layers)");
    }
}
