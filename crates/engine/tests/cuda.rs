//! The CUDA backend's engine-level paths against the CPU backend on the default model (or
//! QUIRE_PARITY_MODEL), with the CPU's attention accumulating in f32 as the CUDA kernel does
//! (`CpuOptions::attn_f16_accum = false`): greedy continuations part only at near-ties of the
//! CPU's own log-probabilities (0.05 on f16-dequantized weights, 0.25 on stored weights with
//! 8-bit activations), chained greedy decode equals step-by-step decode, and device sampling
//! matches the host sampler on the model's logits. The teacher-forced logits are held to the
//! CPU oracle in tests/teacher_forced.rs, one body for every backend.
//!
//! Needs a GPU: ignored without one (see quire-testkit); the engine-level tests of
//! tests/batching.rs and tests/reference.rs also run on CUDA there.
// Without the `cuda` feature the test bodies are compiled out (each test then fails if run).
#![cfg_attr(not(feature = "cuda"), allow(dead_code, unused_imports))]

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::cuda::CudaOptions;
use quire_backend::{Executor, KvCacheSpec, ModelWeights};
use quire_core::SamplingParams;
use quire_engine::runner::forward_single;
use quire_engine::sampler::log_sum_exp;
use quire_engine::{Engine, EngineConfig};
use quire_testkit::Backend;

mod common;
use common::{ids, reference};

fn model() -> quire_model::LoadedModel {
    let path = std::env::var_os("QUIRE_PARITY_MODEL")
        .map(std::path::PathBuf::from)
        .unwrap_or_else(quire_core::default_model::model_for_tests);
    quire_model::load_gguf(&path).expect("model loads")
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
    Backend::Cuda.cuda(
        &m.weights,
        KvCacheSpec {
            num_blocks: blocks,
            block_size: 16,
        },
        opts,
    )
}

/// The CPU backend with f32 attention accumulation (the CUDA kernel's numerics).
fn cpu(w: &ModelWeights, blocks: usize) -> Box<dyn Executor> {
    let kv = KvCacheSpec {
        num_blocks: blocks,
        block_size: 16,
    };
    let opts = CpuOptions {
        attn_f16_accum: false,
        ..CpuOptions::default()
    };
    Box::new(CpuExecutor::new(w, kv, opts).unwrap())
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

quire_testkit::gpu_test! {
    fn greedy_continuations_part_only_at_near_ties() {
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
                        let near_tie = if quantized { 0.25 } else { 0.05 };
                        if gap > near_tie {
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
}

quire_testkit::gpu_test! {
    /// Chain decode (16 steps in one graph, each step's argmax fed to the next on the device) gives
    /// the tokens of step-by-step greedy decoding on the same executor kind, for one sequence and for
    /// three (a padded bucket of four), on stored and on f16 weights, also when a second chain of
    /// the same shape has longer block tables than the one that captured the graph.
    fn chain_decode_matches_step_by_step() {
        use quire_backend::{chain, ForwardBatch, SeqBatch};
        use quire_core::BlockId;
        let m = model();
        let vocab = m.weights.config.vocab_size as u32;
        let per = 16usize; // blocks per sequence: 256 tokens
        let tables: Vec<Vec<BlockId>> = (0..3)
            .map(|i| {
                (i * per..(i + 1) * per)
                    .map(|b| BlockId(b as u32))
                    .collect()
            })
            .collect();
        let prompts: Vec<Vec<u32>> = (0..3u32)
            .map(|i| {
                (0..20 + 7 * i)
                    .map(|j| (j * 131 + 17 * i + 5) % vocab)
                    .collect()
            })
            .collect();
        for quantized in [true, false] {
            for rows in [1usize, 3] {
                let mut got = Vec::new();
                for use_chain in [true, false] {
                    let mut e = cuda(&m, 3 * per + 1, quantized);
                    // Prefill every prompt; its argmax is the chain's first input.
                    let mut first = Vec::new();
                    for (p, t) in prompts.iter().zip(&tables).take(rows) {
                        let pos: Vec<u32> = (0..p.len() as u32).collect();
                        let slots: Vec<u32> = pos
                            .iter()
                            .map(|&q| t[q as usize / 16].0 * 16 + q % 16)
                            .collect();
                        let seqs = [SeqBatch {
                            query_start: 0,
                            query_len: p.len(),
                            seq_len: p.len(),
                            block_table: t,
                        }];
                        let ids = e
                            .forward_greedy(&ForwardBatch {
                                token_ids: p,
                                positions: &pos,
                                slot_mapping: &slots,
                                seqs: &seqs,
                                logits_indices: &[p.len() as u32 - 1],
                            })
                            .unwrap();
                        first.push(ids[0]);
                    }
                    let pos: Vec<u32> = prompts[..rows].iter().map(|p| p.len() as u32).collect();
                    let slots: Vec<u32> = pos
                        .iter()
                        .zip(&tables)
                        .map(|(&q, t)| t[q as usize / 16].0 * 16 + q % 16)
                        .collect();
                    let seqs: Vec<SeqBatch> = (0..rows)
                        .map(|i| SeqBatch {
                            query_start: i,
                            query_len: 1,
                            seq_len: pos[i] as usize + 1,
                            block_table: &tables[i],
                        })
                        .collect();
                    let li: Vec<u32> = (0..rows as u32).collect();
                    let batch = ForwardBatch {
                        token_ids: &first,
                        positions: &pos,
                        slot_mapping: &slots,
                        seqs: &seqs,
                        logits_indices: &li,
                    };
                    let toks = if use_chain {
                        // First a chain whose block tables hold only the blocks it needs, then
                        // the same chain with the whole tables: the two pack their steps'
                        // metadata at different strides, and the second must not replay the
                        // first one's graph with the first one's stride.
                        let short: Vec<&[BlockId]> = (0..rows)
                            .map(|i| &tables[i][..(pos[i] as usize + 16).div_ceil(16)])
                            .collect();
                        let short_seqs: Vec<SeqBatch> = seqs
                            .iter()
                            .zip(&short)
                            .map(|(s, t)| SeqBatch {
                                block_table: t,
                                ..*s
                            })
                            .collect();
                        let a = e
                            .forward_greedy_chain(
                                &ForwardBatch {
                                    seqs: &short_seqs,
                                    ..batch
                                },
                                16,
                            )
                            .unwrap();
                        let b = e.forward_greedy_chain(&batch, 16).unwrap();
                        assert_eq!(a, b, "chain with short vs whole block tables (rows {rows})");
                        b
                    } else {
                        chain::by_steps(e.as_mut(), &batch, 16).unwrap()
                    };
                    assert_eq!(toks.len(), 16 * rows);
                    got.push(toks);
                }
                assert_eq!(
                    got[0], got[1],
                    "chain vs step by step (rows {rows}, quantized {quantized})"
                );
                eprintln!("chain decode: rows {rows}, quantized {quantized}: 16 steps equal");
            }
        }
    }
}

quire_testkit::gpu_test! {
    /// The CUDA executor's `forward_sample` (parameters uploaded per row, `sample_rows` on the
    /// device) against the host sampler on the same logits rows (the model's, teacher-forced over a
    /// reference sequence). The host's f32 sums can move a rare pick at a top-p boundary, so a few
    /// differing rows are allowed; a wiring error (rows or parameters out of step) moves most.
    fn device_sampling_matches_the_host_sampler_on_the_model_logits() {
        use quire_backend::{sample_row, ForwardBatch, SampleParams, SeqBatch};
        use quire_core::BlockId;
        use rand::{Rng, SeedableRng};
        let m = model();
        let vocab = m.weights.config.vocab_size;
        let mut exec = cuda(&m, 64, true);
        let r = &reference()[0];
        let seq: Vec<u32> = ids(&r["prompt_tokens"])
            .into_iter()
            .chain(ids(&r["completion_tokens"]))
            .collect();
        let rows: Vec<u32> = (0..seq.len() as u32).collect();
        let logits = forward_single(exec.as_mut(), &seq, &rows).unwrap();
        let table: Vec<BlockId> = (0..seq.len().div_ceil(16) as u32).map(BlockId).collect();
        let seqs = [SeqBatch {
            query_start: 0,
            query_len: seq.len(),
            seq_len: seq.len(),
            block_table: &table,
        }];
        let batch = ForwardBatch {
            token_ids: &seq,
            positions: &rows,
            slot_mapping: &rows,
            seqs: &seqs,
            logits_indices: &rows,
        };
        let mut rng = rand::rngs::StdRng::seed_from_u64(4);
        let (mut total, mut differ) = (0usize, 0usize);
        for _ in 0..6 {
            let params: Vec<SampleParams> = rows
                .iter()
                .map(|_| SampleParams {
                    temperature: [0.0, 0.5, 1.0, 1.7][rng.random_range(0..4)],
                    top_k: [0, 1, 40, 1000][rng.random_range(0..4)],
                    top_p: [1.0, 0.95, 0.8, 0.3][rng.random_range(0..4)],
                    min_p: [0.0, 0.0, 0.05, 0.2][rng.random_range(0..4)],
                    u: rng.random(),
                })
                .collect();
            let got = exec.forward_sample(&batch, &params, None).unwrap();
            assert_eq!(got.len(), rows.len());
            for ((row, p), g) in logits.chunks_exact(vocab).zip(&params).zip(&got) {
                let host = sample_row(row, p);
                total += 1;
                if *g != host {
                    differ += 1;
                    eprintln!("{p:?}: device {g}, host {host}");
                    assert!(p.temperature > 0.0, "greedy rows must agree");
                }
            }
        }
        eprintln!("{differ} of {total} rows differ from the host sampler");
        assert!(differ * 50 < total, "{differ} of {total} rows differ");
    }
}
