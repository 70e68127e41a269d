//! `quire bench --json-schema FILE -b 16`: what structured outputs cost. B requests decode
//! together through the engine — the same engine step, grammar masks and sampling that
//! `quire serve` runs for a `response_format` request — once without a constraint and once with
//! the schema, in alternating rounds so that drift and other load hit both alike; the medians are
//! compared. In process, so no HTTP or client time blurs the difference.
//!
//! Both modes get the same prompts (a chat asking for JSON following the schema) and the same
//! `max_tokens`; unconstrained requests ignore end-of-sequence so that both keep B rows for the
//! whole run. Decode tok/s counts only steps without prompt tokens (every request decoding), so
//! the prompt's length (the schema is in it) does not dilute the comparison; end-to-end tok/s
//! (output tokens over the whole run, prefill and grammar compilation included) is shown too.

use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_core::{Constraint, FinishReason, SamplingParams, SeqId, TokenId};
use quire_engine::Engine;
use quire_perf::RunStamp;
use quire_tokenizer::ChatMessage;

use crate::bench::BenchArgs;
use crate::common::{build_engine, load_model};

/// The structured-output overhead test's options (part of `quire bench`).
#[derive(Args, Debug, Clone, Default)]
pub struct JsonBenchArgs {
    /// Structured-output overhead instead of the kernel tests: -b requests (default 16) decode -n
    /// tokens each through the engine, unconstrained and constrained by this JSON Schema
    /// (a bare schema, or an OpenAI `response_format` object of type json_schema), in -r
    /// alternating rounds; prints both medians and the tok/s lost
    #[arg(long, value_name = "FILE")]
    pub json_schema: Option<PathBuf>,
}

/// Topics the requests ask about, so that the B requests are not copies of one another.
const TOPICS: [&str; 8] = [
    "European cities",
    "kitchen tools",
    "famous novels",
    "garden plants",
    "sports teams",
    "chemical elements",
    "musical instruments",
    "mountain ranges",
];

/// The schema in `path`: a JSON Schema, or a `response_format` object holding one.
pub fn read_schema(path: &Path) -> Result<String> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --json-schema {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--json-schema {}: not JSON", path.display()))?;
    let schema = match v.get("type").and_then(|t| t.as_str()) {
        Some("json_schema") => v
            .get("json_schema")
            .and_then(|j| j.get("schema"))
            .with_context(|| {
                format!(
                    "--json-schema {}: a response_format of type json_schema needs \
                     json_schema.schema",
                    path.display()
                )
            })?,
        _ => &v,
    };
    if !schema.is_object() {
        bail!(
            "--json-schema {}: a JSON Schema must be an object",
            path.display()
        );
    }
    Ok(schema.to_string())
}

/// One run of B requests in one mode.
struct Run {
    /// Output tokens of steps without prompt tokens, over those steps' seconds.
    decode_tok_s: f64,
    /// All output tokens over the run's seconds (adding requests included).
    e2e_tok_s: f64,
    tokens: usize,
    /// Requests that ended because their grammar was complete (constrained runs).
    complete: usize,
    /// Of those, outputs that parse as JSON.
    parsed: usize,
    /// Requests that ended any other way than by length or a complete grammar.
    other: usize,
    /// Mean milliseconds per decode step.
    step_ms: f64,
    /// Per step that computed grammar masks, milliseconds: the mask task's work, the engine
    /// thread's wait for it after the forward, the engine thread's work on the rows after it.
    mask_ms: f64,
    wait_ms: f64,
    host_ms: f64,
}

pub fn run(a: &BenchArgs, schema_path: &Path) -> Result<()> {
    let schema = read_schema(schema_path)?;
    let margs = crate::spec_bench::model_args(a);
    let model = load_model(&margs)?;
    let n_gen = match a.n_gen.first().map(|n| n.parse::<usize>()) {
        Some(Ok(n)) if n > 0 => n,
        Some(_) => bail!("--json-schema: -n must be one positive number of tokens"),
        None => 256,
    };
    let batches = if a.batch.is_empty() {
        vec![16]
    } else {
        a.batch.clone()
    };
    if batches.contains(&0) || a.reps == 0 {
        bail!("--json-schema: -b and -r must be at least 1");
    }
    let mut eargs = crate::spec_bench::engine_args(a)?;
    let bmax = batches.iter().copied().max().unwrap_or(1);
    eargs.max_num_seqs = Some(eargs.max_num_seqs(&margs.backend).max(bmax));
    let mut engine = build_engine(&model, &margs, &eargs, 0)?;
    let prompts: Vec<Vec<TokenId>> = TOPICS
        .iter()
        .map(|topic| {
            let text = format!(
                "Reply with JSON only, following this JSON Schema:\n{schema}\nFill it with {topic}."
            );
            quire_tokenizer::encode_chat(
                &model.tokenizer,
                &model.chat_template,
                &[ChatMessage::new("user", text)],
            )
        })
        .collect::<Result<_, _>>()?;
    let constraint = Constraint::JsonSchema(schema);
    // Compiles the schema once (a bad one fails here, not in the middle of a round) and builds
    // the engine's token trie, which the first guided request pays for.
    one_run(&mut engine, &prompts, 1, 4, Some(&constraint))?;
    one_run(&mut engine, &prompts, 1, 4, None)?;

    let stamp = RunStamp::collect();
    if let Some(w) = stamp.busy_warning() {
        eprintln!("{w}");
    }
    println!(
        "structured-output overhead on {} ({}), -n {n_gen} tokens per request, median of {} \
         alternating rounds",
        model.meta.file_name,
        engine.executor().backend_name(),
        a.reps
    );
    println!("constraint: json_schema from {}", schema_path.display());
    println!("| batch | constraint | decode tok/s | e2e tok/s | output tokens | ended |");
    println!("|---:|---|---:|---:|---:|---|");
    for &b in &batches {
        let (mut free, mut guided) = (Vec::new(), Vec::new());
        for round in 0..a.reps {
            // Alternate which mode goes first, so neither always runs on a warmer machine.
            let order = if round % 2 == 0 {
                [false, true]
            } else {
                [true, false]
            };
            for on in order {
                let c = on.then_some(&constraint);
                let r = one_run(&mut engine, &prompts, b, n_gen, c)?;
                eprintln!(
                    "round {}/{}, batch {b}, constraint {}: {:.1} decode tok/s",
                    round + 1,
                    a.reps,
                    if on { "json_schema" } else { "none" },
                    r.decode_tok_s
                );
                if on { &mut guided } else { &mut free }.push(r);
            }
        }
        let (f, g) = (median_run(&mut free), median_run(&mut guided));
        for (on, r) in [(false, &f), (true, &g)] {
            let ended = if on {
                format!(
                    "{} complete ({} parse as JSON), {} by length{}",
                    r.complete,
                    r.parsed,
                    b - r.complete - r.other,
                    other_note(r.other)
                )
            } else {
                format!("{} by length{}", b - r.other, other_note(r.other))
            };
            println!(
                "| {b} | {} | {:.1} | {:.1} | {} | {ended} |",
                if on { "json_schema" } else { "none" },
                r.decode_tok_s,
                r.e2e_tok_s,
                r.tokens
            );
        }
        println!(
            "batch {b}: the constraint costs {:.1}% of decode tok/s ({:.1}% end to end)",
            100.0 * (1.0 - g.decode_tok_s / f.decode_tok_s),
            100.0 * (1.0 - g.e2e_tok_s / f.e2e_tok_s)
        );
        println!(
            "batch {b}: a decode step takes {:.1} ms unconstrained, {:.1} ms constrained; per \
             constrained step the masks take {:.2} ms on rayon's threads during the forward \
             ({:.2} ms waited for after it), the engine thread's work on the guided rows after \
             the picks (advancing the grammars; where the host samples, masking and sampling \
             too) {:.2} ms",
            f.step_ms, g.step_ms, g.mask_ms, g.wait_ms, g.host_ms
        );
    }
    println!("{}", stamp.line());
    Ok(())
}

fn other_note(n: usize) -> String {
    if n == 0 {
        String::new()
    } else {
        format!(", {n} otherwise")
    }
}

/// The run with the median decode tok/s.
fn median_run(runs: &mut Vec<Run>) -> Run {
    runs.sort_by(|x, y| x.decode_tok_s.total_cmp(&y.decode_tok_s));
    runs.swap_remove(runs.len() / 2)
}

/// `b` requests (prompts in turn) of `n` greedy tokens, all added at once, stepped until done.
fn one_run(
    engine: &mut Engine,
    prompts: &[Vec<TokenId>],
    b: usize,
    n: usize,
    constraint: Option<&Constraint>,
) -> Result<Run> {
    let t0 = Instant::now();
    let st0 = engine.stats();
    let mut ids: Vec<SeqId> = Vec::with_capacity(b);
    for i in 0..b {
        let params = SamplingParams {
            max_tokens: n,
            ignore_eos: constraint.is_none(),
            constraint: constraint.cloned(),
            ..Default::default()
        };
        ids.push(engine.add_request(prompts[i % prompts.len()].clone(), params)?);
    }
    let mut text: std::collections::HashMap<SeqId, String> = Default::default();
    let (mut tokens, mut decode_tokens, mut decode_s) = (0usize, 0usize, 0f64);
    let mut decode_steps = 0usize;
    let (mut complete, mut parsed, mut other) = (0, 0, 0);
    let mut left = b;
    while left > 0 {
        let s0 = Instant::now();
        let outs = engine.step()?;
        let dt = s0.elapsed().as_secs_f64();
        let st = engine.stats();
        let step_tokens: usize = outs.iter().map(|o| o.tokens.len()).sum();
        tokens += step_tokens;
        if st.prompt_tokens_last_step == 0 && step_tokens > 0 {
            decode_tokens += step_tokens;
            decode_s += dt;
            decode_steps += 1;
        }
        for o in outs {
            text.entry(o.id).or_default().push_str(&o.text_delta);
            match o.finish_reason {
                None => continue,
                Some(FinishReason::Length) => {}
                Some(FinishReason::Stop) if constraint.is_some() => {
                    complete += 1;
                    let t = text.get(&o.id).map_or("", |s| s.as_str());
                    parsed += usize::from(serde_json::from_str::<serde_json::Value>(t).is_ok());
                }
                Some(_) => other += 1,
            }
            left -= 1;
        }
        if left > 0 && !engine.has_unfinished() {
            bail!("the engine stopped with {left} requests unfinished");
        }
    }
    if decode_s == 0.0 {
        bail!("no step decoded without prompt tokens: -n {n} is too short to measure");
    }
    let st = engine.stats();
    let per_step = |x: f64| 1e3 * x / (st.guided_steps - st0.guided_steps).max(1) as f64;
    Ok(Run {
        step_ms: 1e3 * decode_s / decode_steps as f64,
        mask_ms: per_step(st.guided_mask_s - st0.guided_mask_s),
        wait_ms: per_step(st.guided_wait_s - st0.guided_wait_s),
        host_ms: per_step(st.guided_host_s - st0.guided_host_s),
        decode_tok_s: decode_tokens as f64 / decode_s,
        e2e_tok_s: tokens as f64 / t0.elapsed().as_secs_f64(),
        tokens,
        complete,
        parsed,
        other,
    })
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn schema_file_is_a_schema_or_a_response_format() {
        let dir = std::env::temp_dir().join(format!("quire-json-bench-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, body: &str| {
            let p = dir.join(name);
            std::fs::write(&p, body).unwrap();
            p
        };
        let bare = write("bare.json", r#"{"type": "object"}"#);
        assert_eq!(read_schema(&bare).unwrap(), r#"{"type":"object"}"#);
        let rf = write(
            "rf.json",
            r#"{"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array"}}}"#,
        );
        assert_eq!(read_schema(&rf).unwrap(), r#"{"type":"array"}"#);
        let err = |p: &Path| read_schema(p).unwrap_err().to_string();
        assert!(err(&write("no.json", r#"{"type": "json_schema"}"#)).contains("json_schema.schema"));
        assert!(err(&write("bad.json", "{")).contains("not JSON"));
        assert!(err(&write("num.json", "3")).contains("must be an object"));
        assert!(err(&dir.join("missing.json")).contains("cannot read"));
        std::fs::remove_dir_all(&dir).unwrap();
    }
}
