//! `quire bench --spec ngram:K[,K..]`: what speculative decoding buys on prompts that ask the
//! model to repeat or lightly edit a passage of 200+ tokens (where prompt lookup finds long
//! matches). Each prompt runs alone (batch 1, greedy) with speculation off and with every K, and
//! the table shows decode tok/s, the speedup over off, and the acceptance rate.

use anyhow::{bail, Context, Result};
use clap::Parser;
use quire_engine::SpecConfig;
use quire_tokenizer::ChatMessage;

use crate::bench::BenchArgs;
use crate::common::{build_engine, load_model, EngineArgs, ModelArgs};

/// About 250 tokens of plain prose.
const PASSAGE: &str = "The old lighthouse stood on the northern cliff for two hundred years. \
Every night its keeper climbed the spiral stairs, trimmed the wick and polished the great lens, \
so that the fishing boats could find their way home through fog and storm. When the keeper grew \
old, his daughter took over the work, and she kept the light burning for forty more winters. \
The village below depended on that light. Fishermen left the harbour before dawn and came back \
after dark, and on winter evenings the sea turned grey and wild within minutes. More than once \
the beam was the only thing that told a crew where the rocks were. In the spring of the great \
flood the keeper's daughter stayed awake for three nights, feeding the lamp with the last of \
the oil, while the water rose around the foot of the tower. When the weather finally cleared, \
every boat had returned, and the villagers climbed the hill to thank her. Today the lighthouse \
is a museum, and children who visit it can still climb the spiral stairs and look out over the \
water that the light once guarded.";

fn prompts() -> Vec<(&'static str, String)> {
    vec![
        (
            "repeat",
            format!("Repeat the following passage word for word.\n\n{PASSAGE}"),
        ),
        (
            "edit",
            format!(
                "Rewrite the following passage, replacing 'lighthouse' with 'tower' and \
                 changing nothing else.\n\n{PASSAGE}"
            ),
        ),
        (
            "continue",
            format!("{PASSAGE}\n\nNow write the passage above again:\n\n"),
        ),
    ]
}

/// `ngram:4,6,8` → [4, 6, 8].
pub fn parse_spec(s: &str) -> Result<Vec<usize>> {
    let Some(ks) = s.strip_prefix("ngram:") else {
        bail!("--spec wants ngram:K[,K..] (e.g. ngram:4,8), got {s:?}");
    };
    let ks = ks
        .split(',')
        .map(|k| k.trim().parse::<usize>())
        .collect::<Result<Vec<_>, _>>()
        .with_context(|| format!("--spec: K must be integers, got {s:?}"))?;
    if ks.is_empty() || ks.contains(&0) {
        bail!("--spec: every K must be at least 1, got {s:?}");
    }
    Ok(ks)
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
}

pub fn run(a: &BenchArgs, spec: &str) -> Result<()> {
    let ks = parse_spec(spec)?;
    let (min, max) = crate::spec_args::parse_range(&a.spec_ngram)?;
    let margs = ModelArgs {
        model: a.models.first().cloned(),
        backend: a.backend.clone(),
        threads: a.threads.first().copied(),
        gpu_memory_utilization: 0.9,
        gpu_weights: a.gpu_weights.clone(),
        adapter: a.adapter.clone(),
        cpu_math: a.cpu_math.clone(),
        tensor_parallel_size: a.tensor_parallel_size,
    };
    let model = load_model(&margs)?;
    let mut eargs = Defaults::try_parse_from(["quire"])?.engine;
    eargs.block_size = a.block_size;
    let n_gen = a
        .n_gen
        .first()
        .and_then(|n| n.parse::<usize>().ok())
        .unwrap_or(256);
    let mut engine = build_engine(&model, &margs, &eargs, 0)?;
    println!("| prompt | K | decode tok/s | speedup | accepted / proposed | tokens per step |");
    println!("|---|---:|---:|---:|---:|---:|");
    for (name, text) in prompts() {
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
            if let Some(b) = &base {
                if b.tokens != r.tokens {
                    bail!("{name}, K = {k}: the greedy output differs from speculation off");
                }
            }
            let (acc, per_step) = if r.proposed > 0 {
                let steps = r.tokens.len().max(1) as f64;
                (
                    format!(
                        "{}/{} ({:.0}%)",
                        r.accepted,
                        r.proposed,
                        100.0 * r.accepted as f64 / r.proposed as f64
                    ),
                    format!("{:.2}", steps / (steps - r.accepted as f64).max(1.0)),
                )
            } else {
                ("-".into(), "1.00".into())
            };
            println!(
                "| {name} ({} prompt, {} generated) | {k} | {:.1} | {speedup:.2}x | {acc} | {per_step} |",
                tokens.len(),
                r.tokens.len(),
                r.decode_tok_s
            );
            if k == 0 {
                base = Some(r);
            }
        }
    }
    Ok(())
}

/// One greedy request alone through the engine.
fn one(engine: &mut quire_engine::Engine, prompt: &[quire_core::TokenId], n: usize) -> Result<Run> {
    let params = quire_core::SamplingParams {
        max_tokens: n,
        ..Default::default()
    };
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
                });
            }
        }
        if !engine.has_unfinished() {
            bail!("the engine stopped without finishing the request");
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn spec_option_parses_or_explains() {
        assert_eq!(parse_spec("ngram:4,6,8").unwrap(), vec![4, 6, 8]);
        assert!(parse_spec("draft:4").is_err());
        assert!(parse_spec("ngram:0").is_err());
        assert!(parse_spec("ngram:x").is_err());
    }
}
