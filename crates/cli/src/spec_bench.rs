//! `quire bench --spec ngram:K[,K..]` / `draft:FILE,K[,K..]`: what speculative decoding buys on
//! prompts that ask the model to repeat or lightly edit a passage of 200+ tokens (where prompt
//! lookup finds long matches). Each prompt runs alone (batch 1, greedy) with speculation off and
//! with every K, and the table shows decode tok/s, the speedup over off, the acceptance rate and
//! the mean accepted length (tokens per verify step).
//!
//! `quire bench --spec verify:K[,K..]` measures what decides whether speculation can pay at all:
//! the time of one verify step (K + 1 new tokens per sequence, logits for each) against one plain
//! decode step (one token), on the executor alone, at each `-d` depth and `-b` batch. With a
//! verify step costing `r` plain steps, speculation gains only when a step emits more than `r`
//! tokens on average (and a draft model's own steps come on top).

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Parser;
use quire_backend::{Executor, ForwardBatch, SeqBatch};
use quire_engine::SpecConfig;
use quire_tokenizer::ChatMessage;

use crate::bench::BenchArgs;
use crate::common::{build_engine, load_model, EngineArgs, ModelArgs};
use crate::stepper::{fresh_seqs, BenchSeq, Stepper};

/// What `--spec` asks for.
#[derive(Debug, Clone, PartialEq)]
pub enum SpecBench {
    /// Prompt lookup with each K.
    Ngram(Vec<usize>),
    /// A draft model (the file) with each K.
    Draft(PathBuf, Vec<usize>),
    /// The cost of a verify step of K + 1 tokens against a plain step, for each K.
    Verify(Vec<usize>),
}

/// `ngram:4,6,8`, `draft:small.gguf,4,8` or `verify:1,4,8`.
pub fn parse_spec(s: &str) -> Result<SpecBench> {
    let usage = "--spec wants ngram:K[,K..], draft:FILE,K[,K..] or verify:K[,K..] (e.g. ngram:4,8)";
    let ks = |list: &str| -> Result<Vec<usize>> {
        let ks = list
            .split(',')
            .map(|k| k.trim().parse::<usize>())
            .collect::<Result<Vec<_>, _>>()
            .with_context(|| format!("--spec: K must be integers, got {s:?}"))?;
        if ks.is_empty() || ks.contains(&0) || ks.iter().any(|&k| k > 64) {
            bail!("--spec: every K must be in 1..=64, got {s:?}");
        }
        Ok(ks)
    };
    if let Some(list) = s.strip_prefix("ngram:") {
        return Ok(SpecBench::Ngram(ks(list)?));
    }
    if let Some(list) = s.strip_prefix("verify:") {
        return Ok(SpecBench::Verify(ks(list)?));
    }
    if let Some(rest) = s.strip_prefix("draft:") {
        let Some((file, list)) = rest.split_once(',') else {
            bail!("--spec draft: wants the draft model and K, e.g. draft:small.gguf,4 (got {s:?})");
        };
        if file.is_empty() {
            bail!("--spec draft: the draft model file is missing (got {s:?})");
        }
        return Ok(SpecBench::Draft(PathBuf::from(file), ks(list)?));
    }
    bail!("{usage}, got {s:?}")
}

/// Engine options at their command-line defaults.
#[derive(Parser)]
struct Defaults {
    #[command(flatten)]
    engine: EngineArgs,
}

struct Run {
    decode_tok_s: f64,
    tokens: Vec<u32>,
    proposed: usize,
    accepted: usize,
    /// Verify steps of this run (the engine's counter, before and after).
    verify_steps: u64,
}

pub fn run(a: &BenchArgs, spec: &str) -> Result<()> {
    let (draft, ks) = match parse_spec(spec)? {
        SpecBench::Ngram(ks) => (None, ks),
        SpecBench::Draft(file, ks) => (Some(file), ks),
        SpecBench::Verify(ks) => return verify_cost(a, &ks),
    };
    let (min, max) = crate::spec_args::parse_range(&a.spec_ngram)?;
    let margs = model_args(a);
    let model = load_model(&margs)?;
    let n_gen = a
        .n_gen
        .first()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(256);
    let mut eargs = engine_args(a)?;
    // One request at a time: a pool for the longest prompt (under 1,024 tokens) and -n more,
    // so that on a GPU the memory the target leaves can hold a draft model.
    eargs.num_blocks = Some((1024 + n_gen).div_ceil(a.block_size.max(1)));
    let mut engine = build_engine(&model, &margs, &eargs, 0)?;
    if let Some(file) = &draft {
        crate::spec_args::attach_draft(&mut engine, file, &margs, &eargs)?;
        println!("proposer: draft model {}", file.display());
    } else {
        println!("proposer: n-gram prompt lookup, n = {min}..={max}");
    }
    println!(
        "| prompt | K | decode tok/s | speedup | accepted / proposed | mean accepted length | output as off |"
    );
    println!("|---|---:|---:|---:|---:|---:|---|");
    let mut parted = false;
    for (name, text) in quire_engine::spec_prompts::prompts() {
        let tokens = quire_tokenizer::encode_chat(
            &model.tokenizer,
            &model.chat_template,
            &[ChatMessage::new("user", text)],
        )?;
        let mut base: Option<Run> = None;
        for k in std::iter::once(0).chain(ks.iter().copied()) {
            engine.set_speculation(SpecConfig {
                num_tokens: k,
                ngram_min: min,
                ngram_max: max,
            })?;
            let mut runs = Vec::new();
            for _ in 0..a.reps.max(1) {
                runs.push(one(&mut engine, &tokens, n_gen)?);
            }
            runs.sort_by(|x, y| x.decode_tok_s.total_cmp(&y.decode_tok_s));
            let r = runs.swap_remove(runs.len() / 2);
            let speedup = base
                .as_ref()
                .map_or(1.0, |b| r.decode_tok_s / b.decode_tok_s);
            // Where the greedy output first parts from speculation off (None: identical).
            let parts = base.as_ref().and_then(|b| {
                let at = b.tokens.iter().zip(&r.tokens).position(|(x, y)| x != y);
                at.or((b.tokens.len() != r.tokens.len())
                        .then(|| b.tokens.len().min(r.tokens.len())))
            });
            parted |= parts.is_some();
            let (acc, mean_len) = if r.proposed > 0 {
                (
                    format!(
                        "{}/{} ({:.0}%)",
                        r.accepted,
                        r.proposed,
                        100.0 * r.accepted as f64 / r.proposed as f64
                    ),
                    format!(
                        "{:.2}",
                        1.0 + r.accepted as f64 / r.verify_steps.max(1) as f64
                    ),
                )
            } else {
                ("-".into(), "1.00".into())
            };
            let same = match (k, parts) {
                (0, _) => "-".to_string(),
                (_, None) => "yes".to_string(),
                (_, Some(i)) => format!("**parts at token {i}**"),
            };
            println!(
                "| {name} ({} prompt, {} generated) | {k} | {:.1} | {speedup:.2}x | {acc} | {mean_len} | {same} |",
                tokens.len(),
                r.tokens.len(),
                r.decode_tok_s
            );
            if k == 0 {
                base = Some(r);
            }
        }
    }
    if parted {
        eprintln!(
            "note: a row's greedy output parted from speculation off. A verify step scores K + 1 \
             tokens in one forward, which sums in another order than a one-token step; on \
             random-weight files, whose top logits are near ties at almost every step, that alone \
             moves tokens. On a trained model a parting this early points at a bug."
        );
    }
    Ok(())
}

pub(crate) fn model_args(a: &BenchArgs) -> ModelArgs {
    ModelArgs {
        model: a.models.first().cloned(),
        backend: a.backend.clone(),
        threads: a.threads.first().copied(),
        gpu_memory_utilization: 0.9,
        gpu_weights: a.gpu_weights.clone(),
        adapter: a.adapter.clone(),
        cpu_math: a.cpu_math.clone(),
        tensor_parallel_size: a.tensor_parallel_size,
    }
}

/// Engine options at their defaults, with the bench's block size and KV type.
pub(crate) fn engine_args(a: &BenchArgs) -> Result<EngineArgs> {
    let mut e = Defaults::try_parse_from(["quire"])?.engine;
    e.block_size = a.block_size;
    e.kv_dtype = a.kv_dtype.clone();
    Ok(e)
}

/// One greedy request alone through the engine.
fn one(engine: &mut quire_engine::Engine, prompt: &[quire_core::TokenId], n: usize) -> Result<Run> {
    let params = quire_core::SamplingParams {
        max_tokens: n,
        ..Default::default()
    };
    let steps0 = engine.stats().spec_verify_steps;
    let id = engine.add_request(prompt.to_vec(), params)?;
    let mut tokens = Vec::new();
    loop {
        for o in engine.step()? {
            if o.id != id {
                continue;
            }
            tokens.extend(o.tokens.iter().map(|t| t.token.0));
            if o.finish_reason.is_some() {
                let t = o.timings.unwrap_or_default();
                return Ok(Run {
                    decode_tok_s: t.decode_tok_s,
                    tokens,
                    proposed: t.spec_proposed_tokens,
                    accepted: t.spec_accepted_tokens,
                    verify_steps: engine.stats().spec_verify_steps - steps0,
                });
            }
        }
        if !engine.has_unfinished() {
            bail!("the engine stopped without finishing the request");
        }
    }
}

/// `--spec verify:K[,K..]`: the median time of one verify step (K + 1 new tokens per sequence,
/// logits for each, greedy picks) against one plain decode step, on the executor alone, at every
/// `-d` depth and `-b` batch (default 1). The steps alternate within each round so drift hits
/// both alike; two warm-up rounds first.
fn verify_cost(a: &BenchArgs, ks: &[usize]) -> Result<()> {
    let margs = model_args(a);
    let model = load_model(&margs)?;
    let eargs = engine_args(a)?;
    let mut engine = build_engine(&model, &margs, &eargs, 0)?;
    let exec = engine.executor();
    let kmax = ks.iter().copied().max().unwrap_or(1);
    let batches = if a.batch.is_empty() {
        vec![1]
    } else {
        a.batch.clone()
    };
    let rounds = a.reps.max(1) * 4;
    println!(
        "verify cost on {} ({}), median of {rounds} alternating rounds",
        model.meta.file_name,
        exec.backend_name()
    );
    println!(
        "| depth | batch | K | plain step ms | verify step ms (K+1 tokens) | verify / plain |"
    );
    println!("|---:|---:|---:|---:|---:|---:|");
    for &depth in &a.depth {
        for &b in &batches {
            let budget = eargs.max_num_batched_tokens(&margs.backend);
            if b == 0 || b * (kmax + 1) > budget {
                bail!(
                    "--spec verify: batch {b} x (K + 1 = {}) tokens must be in 1..={budget} (the step budget)",
                    kmax + 1,
                );
            }
            let ctx = Filled::fill(exec, depth, b, kmax, a.seed)?;
            let shapes: Vec<usize> = std::iter::once(1).chain(ks.iter().map(|k| k + 1)).collect();
            let mut times = vec![Vec::with_capacity(rounds); shapes.len()];
            for round in 0..rounds + 2 {
                for (i, &n) in shapes.iter().enumerate() {
                    let t = ctx.step(exec, n)?;
                    if round >= 2 {
                        times[i].push(t);
                    }
                }
            }
            let ms: Vec<f64> = times
                .iter()
                .map(|t| quire_perf::stats::median(t) * 1e3)
                .collect();
            for (i, &k) in ks.iter().enumerate() {
                println!(
                    "| {depth} | {b} | {k} | {:.3} | {:.3} | {:.2} |",
                    ms[0],
                    ms[i + 1],
                    ms[i + 1] / ms[0]
                );
            }
        }
    }
    println!(
        "A verify step costing r plain steps pays only when a step emits more than r tokens on \
         average (mean accepted length), before any draft model's own cost."
    );
    Ok(())
}

/// `batch` sequences of `depth` random tokens in the cache, each with blocks for `kmax + 1` more.
struct Filled {
    depth: usize,
    block_size: usize,
    seqs: Vec<BenchSeq>,
    vocab: u32,
}

impl Filled {
    fn fill(
        exec: &mut dyn Executor,
        depth: usize,
        batch: usize,
        kmax: usize,
        seed: u64,
    ) -> Result<Self> {
        use rand::SeedableRng;
        let kv = exec.kv_spec();
        let per_seq = (depth + kmax + 1).div_ceil(kv.block_size);
        if per_seq * batch > kv.num_blocks {
            bail!(
                "--spec verify: {batch} sequences of {} tokens need {} KV blocks, the cache has {}",
                depth + kmax + 1,
                per_seq * batch,
                kv.num_blocks
            );
        }
        let mut seqs = fresh_seqs(batch, depth + kmax + 1, kv.block_size);
        let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
        let mut stepper = Stepper::default();
        for s in &mut seqs {
            stepper.prefill(exec, s, depth, &mut rng)?;
        }
        Ok(Self {
            depth,
            block_size: kv.block_size,
            seqs,
            vocab: exec.vocab_size() as u32,
        })
    }

    /// One step of `n` new tokens per sequence after the context, logits for all of them, greedy
    /// picks on the host side of the call (as the engine's verify step): seconds.
    fn step(&self, exec: &mut dyn Executor, n: usize) -> Result<f64> {
        let (mut tokens, mut positions, mut slots, mut seqs) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new());
        for (s, table) in self.seqs.iter().map(|q| &q.table).enumerate() {
            for j in 0..n {
                let p = self.depth + j;
                tokens.push(((s * 7 + j * 13 + 1) as u32) % self.vocab);
                positions.push(p as u32);
                slots.push(quire_core::slot(table, p, self.block_size) as u32);
            }
            seqs.push(SeqBatch {
                query_start: s * n,
                query_len: n,
                seq_len: self.depth + n,
                block_table: table,
            });
        }
        let logits: Vec<u32> = (0..tokens.len() as u32).collect();
        let t0 = Instant::now();
        let ids = exec.forward_greedy(&ForwardBatch {
            token_ids: &tokens,
            positions: &positions,
            slot_mapping: &slots,
            seqs: &seqs,
            logits_indices: &logits,
        })?;
        let t = t0.elapsed().as_secs_f64();
        if ids.len() != tokens.len() {
            bail!(
                "the executor returned {} picks for {} rows",
                ids.len(),
                tokens.len()
            );
        }
        Ok(t)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_option_parses_or_explains() {
        assert_eq!(
            parse_spec("ngram:4,6,8").unwrap(),
            SpecBench::Ngram(vec![4, 6, 8])
        );
        assert_eq!(
            parse_spec("draft:small.gguf,4,8").unwrap(),
            SpecBench::Draft("small.gguf".into(), vec![4, 8])
        );
        assert_eq!(
            parse_spec("verify:1,4").unwrap(),
            SpecBench::Verify(vec![1, 4])
        );
        let err = |s: &str| parse_spec(s).unwrap_err().to_string();
        assert!(
            err("draft:4").contains("the draft model and K"),
            "{}",
            err("draft:4")
        );
        assert!(err("draft:,4").contains("file is missing"));
        assert!(err("ngram:0").contains("1..=64"));
        assert!(err("verify:65").contains("1..=64"));
        assert!(err("ngram:x").contains("integers"));
        assert!(err("lookup:4").contains("draft:FILE,K"));
    }
}
