//! `quire generate` (one prompt, streamed or as JSON; or a JSONL file of requests run together) and
//! `quire chat` (interactive).

use std::io::{BufRead, Write};
use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_core::{Constraint, FinishReason, SamplingParams, TokenId};
use quire_engine::{Engine, RequestTimings};
use quire_model::LoadedModel;
use quire_tokenizer::ChatMessage;
use serde::Deserialize;
use serde_json::json;

use crate::common::{build_engine, load_model, EngineArgs, ModelArgs};
use crate::spec_args::SpecArgs;

#[derive(Args, Debug, Clone)]
pub struct SamplingArgs {
    /// Most tokens to generate
    #[arg(long, short = 'n', default_value_t = 256)]
    pub max_tokens: usize,
    /// 0 = greedy
    #[arg(long, default_value_t = 0.0)]
    pub temperature: f32,
    /// Keep the k most likely tokens (0 = off)
    #[arg(long, default_value_t = 0)]
    pub top_k: usize,
    /// Keep the smallest set of tokens whose probability reaches p (1 = off)
    #[arg(long, default_value_t = 1.0)]
    pub top_p: f32,
    /// Drop tokens less likely than min_p × the most likely one (0 = off)
    #[arg(long, default_value_t = 0.0)]
    pub min_p: f32,
    /// Penalize tokens seen in the last --repeat-last-n tokens (1 = off)
    #[arg(long, default_value_t = 1.0)]
    pub repeat_penalty: f32,
    #[arg(long, default_value_t = 64)]
    pub repeat_last_n: usize,
    /// Random seed of the sampler
    #[arg(long)]
    pub seed: Option<u64>,
    /// Stop when this text appears (repeatable)
    #[arg(long)]
    pub stop: Vec<String>,
    /// Keep generating past end-of-sequence tokens
    #[arg(long)]
    pub ignore_eos: bool,
    /// Structured output: the text is a JSON value following the JSON Schema in FILE
    #[arg(long, value_name = "FILE", group = "structured")]
    pub json_schema: Option<PathBuf>,
    /// Structured output: the text is one JSON object
    #[arg(long, group = "structured")]
    pub json_object: bool,
    /// Structured output: the text matches this regular expression
    #[arg(long, value_name = "REGEX", group = "structured")]
    pub regex: Option<String>,
    /// Structured output: the text follows the grammar in FILE, in llguidance's Lark-like syntax
    /// (e.g. `start: "yes" | "no"`; see the README)
    #[arg(long, value_name = "FILE", group = "structured")]
    pub grammar: Option<PathBuf>,
}

impl SamplingArgs {
    pub fn params(&self) -> Result<SamplingParams> {
        let read = |p: &PathBuf| {
            std::fs::read_to_string(p).with_context(|| format!("cannot read {}", p.display()))
        };
        let constraint = if let Some(p) = &self.json_schema {
            Some(Constraint::JsonSchema(read(p)?))
        } else if self.json_object {
            Some(Constraint::JsonObject)
        } else if let Some(rx) = &self.regex {
            Some(Constraint::Regex(rx.clone()))
        } else if let Some(p) = &self.grammar {
            Some(Constraint::Lark(read(p)?))
        } else {
            None
        };
        Ok(SamplingParams {
            temperature: self.temperature,
            top_k: self.top_k,
            top_p: self.top_p,
            min_p: self.min_p,
            repetition_penalty: self.repeat_penalty,
            repeat_last_n: self.repeat_last_n,
            seed: self.seed,
            max_tokens: self.max_tokens,
            stop: self.stop.clone(),
            ignore_eos: self.ignore_eos,
            constraint,
            ..Default::default()
        })
    }
}

#[derive(Args, Debug)]
pub struct GenerateArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// The prompt (special tokens such as <|im_start|> are parsed as such)
    #[arg(long, short = 'p', conflicts_with = "prompts_file")]
    pub prompt: Option<String>,
    /// Apply the model's chat template to the prompt as one user message
    #[arg(long)]
    pub chat: bool,
    /// Print one JSON object on the last line of stdout instead of streaming text
    #[arg(long)]
    pub json: bool,
    /// JSONL of requests ({"prompt": ..} or {"messages": [..]}, plus max_tokens, temperature,
    /// top_p, top_k, min_p, seed, stop), run through the engine together. A line that cannot run
    /// (bad JSON, unknown field, a prompt longer than the context) is reported on stderr and as
    /// {"index": N, "error": ..} in the output; the others still run, and the exit status is 1
    /// when any line failed
    #[arg(long, requires = "output")]
    pub prompts_file: Option<PathBuf>,
    /// Where --prompts-file results go (JSONL, one line per input line, in input order)
    #[arg(long)]
    pub output: Option<PathBuf>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

#[derive(Args, Debug)]
pub struct ChatArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// System prompt (the template's default when absent)
    #[arg(long)]
    pub system: Option<String>,
    #[command(flatten)]
    pub sampling: SamplingArgs,
    #[command(flatten)]
    pub spec: SpecArgs,
    #[command(flatten)]
    pub engine: EngineArgs,
}

/// Renders messages with the model's chat template and tokenizes the result.
pub fn encode_chat(model: &LoadedModel, messages: &[ChatMessage]) -> Result<Vec<TokenId>> {
    Ok(quire_tokenizer::encode_chat(
        &model.tokenizer,
        &model.chat_template,
        messages,
    )?)
}

pub fn encode_prompt(model: &LoadedModel, prompt: &str) -> Result<Vec<TokenId>> {
    Ok(model.tokenizer.encode(prompt, true, true)?)
}

/// `proposer`: the engine's speculative proposer (`off`, `ngram` or `draft`).
fn timings_json(t: &RequestTimings, proposer: &str) -> serde_json::Value {
    json!({
        "spec_proposer": proposer,
        "prefill_tok_s": t.prefill_tok_s,
        "decode_tok_s": t.decode_tok_s,
        "ttft_ms": t.ttft_ms,
        "total_ms": t.total_ms,
        "spec_proposed_tokens": t.spec_proposed_tokens,
        "spec_accepted_tokens": t.spec_accepted_tokens,
    })
}

/// `, speculation: A/P accepted (R%)` when anything was proposed.
fn spec_summary(t: &RequestTimings) -> String {
    if t.spec_proposed_tokens == 0 {
        return String::new();
    }
    format!(
        ", speculation: {}/{} proposed tokens accepted ({:.0}%)",
        t.spec_accepted_tokens,
        t.spec_proposed_tokens,
        100.0 * t.spec_accepted_tokens as f64 / t.spec_proposed_tokens as f64
    )
}

pub fn run(a: GenerateArgs) -> Result<()> {
    let t_load = std::time::Instant::now();
    let model = load_model(&a.model)?;
    let file_ms = t_load.elapsed().as_secs_f64() * 1e3;
    if let Some(file) = &a.prompts_file {
        return run_file(
            &model,
            &a,
            file,
            a.output.as_ref().expect("clap requires --output"),
        );
    }
    let Some(prompt) = &a.prompt else {
        bail!("give --prompt TEXT (or --prompts-file IN.jsonl --output OUT.jsonl)");
    };
    let tokens = if a.chat {
        encode_chat(&model, &[ChatMessage::new("user", prompt.clone())])?
    } else {
        encode_prompt(&model, prompt)?
    };
    if tokens.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let t_engine = std::time::Instant::now();
    let mut engine = build_engine(&model, &a.model, &a.engine, 0)?;
    a.spec.apply(&mut engine, &a.model, &a.engine)?;
    // Reading the model and building the engine (weights on the device, KV cache).
    let load_ms = file_ms + t_engine.elapsed().as_secs_f64() * 1e3;
    let id = engine.add_request(tokens.clone(), a.sampling.params()?)?;
    let mut completion = Vec::new();
    let mut text = String::new();
    let stdout = std::io::stdout();
    let mut out = stdout.lock();
    loop {
        let outs = engine.step()?;
        for o in outs.into_iter().filter(|o| o.id == id) {
            completion.extend(o.tokens.iter().map(|t| t.token.0));
            text.push_str(&o.text_delta);
            if !a.json {
                out.write_all(o.text_delta.as_bytes())?;
                out.flush()?;
            }
            if let Some(reason) = o.finish_reason {
                let t = o.timings.unwrap_or_default();
                if a.json {
                    let j = json!({
                        "prompt_tokens": tokens.iter().map(|t| t.0).collect::<Vec<_>>(),
                        "completion_tokens": completion,
                        "text": text,
                        "finish_reason": reason.as_str(),
                        "timings": timings_json(&t, engine.stats().spec_proposer),
                        "load_ms": load_ms,
                        "peak_rss_bytes": quire_perf::mem::peak_rss_bytes(),
                        "peak_gpu_bytes": engine.executor().device_memory_peak(),
                    });
                    writeln!(out, "{j}")?;
                } else {
                    writeln!(out)?;
                    eprintln!(
                        "[{} prompt tokens, {} generated, finish: {}] prefill {:.1} tok/s, decode {:.1} tok/s, time to first token {:.1} ms{}",
                        tokens.len(),
                        completion.len(),
                        reason.as_str(),
                        t.prefill_tok_s,
                        t.decode_tok_s,
                        t.ttft_ms,
                        spec_summary(&t)
                    );
                }
                return Ok(());
            }
        }
        if !engine.has_unfinished() {
            bail!("the engine stopped without finishing the request");
        }
    }
}

#[derive(Deserialize)]
#[serde(deny_unknown_fields)]
struct FileRequest {
    prompt: Option<String>,
    messages: Option<Vec<ChatMessage>>,
    max_tokens: Option<usize>,
    temperature: Option<f32>,
    top_p: Option<f32>,
    top_k: Option<usize>,
    min_p: Option<f32>,
    seed: Option<u64>,
    stop: Option<StopField>,
}

#[derive(Deserialize)]
#[serde(untagged)]
enum StopField {
    One(String),
    Many(Vec<String>),
}

fn run_file(
    model: &LoadedModel,
    a: &GenerateArgs,
    input: &PathBuf,
    output: &PathBuf,
) -> Result<()> {
    let text = std::fs::read_to_string(input)
        .with_context(|| format!("cannot read {}", input.display()))?;
    let mut engine = build_engine(model, &a.model, &a.engine, 0)?;
    a.spec.apply(&mut engine, &a.model, &a.engine)?;
    let base = a.sampling.params()?;
    let mut ids = std::collections::HashMap::new();
    let mut prompts = Vec::new();
    // A bad line (JSON, fields, tokenization, a request the engine refuses) is reported on
    // stderr and in its output line; the other lines still run.
    let mut failed: Vec<(usize, String)> = Vec::new();
    for (index, line) in text
        .lines()
        .enumerate()
        .filter(|(_, l)| !l.trim().is_empty())
    {
        let added = file_request(model, line, &base).and_then(|(tokens, p)| {
            let id = engine.add_request(tokens.clone(), p)?;
            Ok((id, tokens))
        });
        let (id, tokens) = match added {
            Ok(x) => x,
            Err(e) => {
                let msg = format!("{e:#}").replace('\n', " ");
                eprintln!("{}:{}: {msg}", input.display(), index + 1);
                failed.push((index, msg));
                continue;
            }
        };
        ids.insert(id, prompts.len());
        prompts.push((
            index,
            tokens,
            Vec::<u32>::new(),
            String::new(),
            None::<FinishReason>,
            RequestTimings::default(),
        ));
    }
    let bar = indicatif::ProgressBar::new(prompts.len() as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} requests  {msg}")
            .expect("static template"),
    );
    let t0 = std::time::Instant::now();
    let mut generated = 0usize;
    while engine.has_unfinished() {
        for o in engine.step()? {
            let r = &mut prompts[ids[&o.id]];
            r.2.extend(o.tokens.iter().map(|t| t.token.0));
            generated += o.tokens.len();
            r.3.push_str(&o.text_delta);
            if let Some(f) = o.finish_reason {
                r.4 = Some(f);
                r.5 = o.timings.unwrap_or_default();
                bar.inc(1);
            }
        }
        bar.set_message(format!(
            "{:.1} tok/s",
            generated as f64 / t0.elapsed().as_secs_f64()
        ));
    }
    bar.finish_and_clear();
    let mut f = std::io::BufWriter::new(
        std::fs::File::create(output)
            .with_context(|| format!("cannot create {}", output.display()))?,
    );
    let proposer = engine.stats().spec_proposer;
    let mut lines: Vec<(usize, serde_json::Value)> = prompts
        .iter()
        .map(|(index, tokens, completion, text, finish, timings)| {
            let j = json!({
                "index": index,
                "prompt_tokens": tokens.iter().map(|t| t.0).collect::<Vec<_>>(),
                "completion_tokens": completion,
                "text": text,
                "finish_reason": finish.map(|f| f.as_str()),
                "timings": timings_json(timings, proposer),
            });
            (*index, j)
        })
        .collect();
    lines.extend(
        failed
            .iter()
            .map(|(index, msg)| (*index, json!({"index": index, "error": msg}))),
    );
    lines.sort_by_key(|(index, _)| *index);
    for (_, j) in &lines {
        writeln!(f, "{j}")?;
    }
    f.flush()?;
    eprintln!(
        "{} requests, {generated} tokens generated in {:.2} s ({:.1} tok/s aggregate) -> {}",
        prompts.len(),
        t0.elapsed().as_secs_f64(),
        generated as f64 / t0.elapsed().as_secs_f64(),
        output.display()
    );
    if !failed.is_empty() {
        bail!(
            "{} of {} requests in {} failed (each has an \"error\" line in {})",
            failed.len(),
            lines.len(),
            input.display(),
            output.display()
        );
    }
    Ok(())
}

/// One line of a prompts file → its prompt tokens and sampling parameters (`base` overridden by
/// the line's fields).
fn file_request(
    model: &LoadedModel,
    line: &str,
    base: &SamplingParams,
) -> Result<(Vec<TokenId>, SamplingParams)> {
    let r: FileRequest = serde_json::from_str(line).context("bad request")?;
    let tokens = match (&r.prompt, &r.messages) {
        (Some(p), None) => encode_prompt(model, p)?,
        (None, Some(m)) => encode_chat(model, m)?,
        _ => bail!("give exactly one of \"prompt\" or \"messages\""),
    };
    if tokens.is_empty() {
        bail!("the prompt is empty after tokenization");
    }
    let mut p = base.clone();
    if let Some(v) = r.max_tokens {
        p.max_tokens = v;
    }
    if let Some(v) = r.temperature {
        p.temperature = v;
    }
    if let Some(v) = r.top_p {
        p.top_p = v;
    }
    if let Some(v) = r.top_k {
        p.top_k = v;
    }
    if let Some(v) = r.min_p {
        p.min_p = v;
    }
    if r.seed.is_some() {
        p.seed = r.seed;
    }
    match r.stop {
        Some(StopField::One(s)) => p.stop = vec![s],
        Some(StopField::Many(v)) => p.stop = v,
        None => {}
    }
    Ok((tokens, p))
}

pub fn chat(a: ChatArgs) -> Result<()> {
    let model = load_model(&a.model)?;
    let mut engine: Engine = build_engine(&model, &a.model, &a.engine, 0)?;
    a.spec.apply(&mut engine, &a.model, &a.engine)?;
    let mut messages = Vec::new();
    if let Some(s) = &a.system {
        messages.push(ChatMessage::new("system", s.clone()));
    }
    let stdin = std::io::stdin();
    let mut out = std::io::stdout();
    eprintln!(
        "quire chat with {} — /exit or Ctrl-D to leave, /reset to start over",
        model.meta.file_name
    );
    loop {
        write!(out, "> ")?;
        out.flush()?;
        let mut line = String::new();
        if stdin.lock().read_line(&mut line)? == 0 {
            writeln!(out)?;
            return Ok(());
        }
        let line = line.trim_end_matches(['\n', '\r']);
        match line.trim() {
            "" => continue,
            "/exit" | "/quit" => return Ok(()),
            "/reset" => {
                messages.retain(|m: &ChatMessage| m.role == "system");
                continue;
            }
            _ => {}
        }
        messages.push(ChatMessage::new("user", line.to_string()));
        let tokens = encode_chat(&model, &messages)?;
        let id = match engine.add_request(tokens, a.sampling.params()?) {
            Ok(id) => id,
            Err(e) => {
                eprintln!("error: {e}");
                messages.pop();
                continue;
            }
        };
        let mut reply = String::new();
        'gen: while engine.has_unfinished() {
            for o in engine.step()? {
                if o.id != id {
                    continue;
                }
                out.write_all(o.text_delta.as_bytes())?;
                out.flush()?;
                reply.push_str(&o.text_delta);
                if o.finish_reason.is_some() {
                    break 'gen;
                }
            }
        }
        writeln!(out)?;
        messages.push(ChatMessage::new("assistant", reply));
    }
}
