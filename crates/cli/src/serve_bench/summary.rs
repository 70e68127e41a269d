//! The end of a run: statistics per phase, spikes and their steps, the /metrics cross-check, then
//! the outputs (markdown on stdout, `--json`, `--svg`).

use std::fmt::Write as _;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use quire_perf::stamp::RunStamp;
use serde_json::{json, Value};

use super::chart::{svg, ChartInput};
use super::client::{get_text, prometheus_sum, HttpClient};
use super::load::{LoadResult, RequestRecord};
use super::report::{markdown_table, Phase, Slo, Stats};
use super::spikes::spike_section;
use super::ServeBenchArgs;

/// Server-side counters read from /metrics.
#[derive(Debug, Clone)]
pub struct Counters {
    /// Which naming: "quire" or "vllm".
    pub scheme: &'static str,
    pub requests: f64,
    pub generation_tokens: f64,
    pub prompt_tokens: Option<f64>,
}

/// (scheme, finished requests, generation tokens, prompt tokens) counter names.
const SCHEMES: [(&str, &str, &str, &str); 2] = [
    (
        "quire",
        "quire_requests_total",
        "quire_generation_tokens_total",
        "quire_prompt_tokens_total",
    ),
    (
        "vllm",
        "vllm:request_success_total",
        "vllm:generation_tokens_total",
        "vllm:prompt_tokens_total",
    ),
];

/// GET /metrics and read the counters; Err says why not (never fatal).
pub async fn scrape_metrics(
    client: &HttpClient,
    base: &str,
    api_key: Option<&str>,
) -> Result<Counters, String> {
    let (status, text) = get_text(client, base, "/metrics", api_key, Duration::from_secs(10))
        .await
        .map_err(|e| format!("GET /metrics failed: {e:#}"))?;
    if !status.is_success() {
        return Err(format!("GET /metrics: HTTP {status}"));
    }
    for (scheme, req, gen, prompt) in SCHEMES {
        if let (Some(requests), Some(generation_tokens)) =
            (prometheus_sum(&text, req), prometheus_sum(&text, gen))
        {
            return Ok(Counters {
                scheme,
                requests,
                generation_tokens,
                prompt_tokens: prometheus_sum(&text, prompt),
            });
        }
    }
    Err("/metrics has no quire_ (or vllm:) request and token counters".into())
}

/// The cross-check as JSON and as a markdown line.
fn metrics_check(
    before: &Result<Counters, String>,
    after: &Result<Counters, String>,
    overall: &Stats,
    prompt_from_usage: bool,
) -> (Value, String) {
    let (b, a) = match (before, after) {
        (Ok(b), Ok(a)) => (b, a),
        (Err(e), _) | (_, Err(e)) => {
            return (
                json!({"available": false, "reason": e}),
                format!("Server metrics: skipped ({e})."),
            )
        }
    };
    let requests_delta = a.requests - b.requests;
    let generation_delta = a.generation_tokens - b.generation_tokens;
    let prompt_delta = a.prompt_tokens.zip(b.prompt_tokens).map(|(a, b)| a - b);
    let agrees = requests_delta == overall.completed as f64
        && generation_delta == overall.output_tokens as f64;
    let prompt_agrees = prompt_delta.map(|d| prompt_from_usage && d == overall.input_tokens as f64);
    let j = json!({
        "available": true,
        "scheme": a.scheme,
        "requests_delta": requests_delta,
        "generation_tokens_delta": generation_delta,
        "prompt_tokens_delta": prompt_delta,
        "expected_requests": overall.completed,
        "expected_generation_tokens": overall.output_tokens,
        "expected_prompt_tokens": overall.input_tokens,
        "agrees": agrees,
        "prompt_tokens_agree": prompt_agrees,
    });
    let mut line = format!(
        "Server metrics ({} counters, delta over the run): {requests_delta} requests, \
         {generation_delta} generation tokens",
        a.scheme
    );
    if let Some(p) = prompt_delta {
        let _ = write!(line, ", {p} prompt tokens");
    }
    if agrees {
        let _ = write!(
            line,
            " — **agrees** with serve-bench ({} completed, {} output tokens).",
            overall.completed, overall.output_tokens
        );
    } else {
        let _ = write!(
            line,
            " — **DISAGREES** with serve-bench ({} completed, {} output tokens){}.",
            overall.completed,
            overall.output_tokens,
            if overall.failed > 0 {
                "; failed requests may be counted by the server too"
            } else {
                "; was other traffic on the server?"
            }
        );
    }
    (j, line)
}

fn request_json(r: &RequestRecord) -> Value {
    json!({
        "index": r.index,
        "arrival_s": r.arrival_s,
        "send_s": r.send_s,
        "done_s": r.o.done_s,
        "ok": r.ok(),
        "error": r.o.error,
        "prompt_tokens": r.o.prompt_tokens,
        "prompt_words": r.prompt_words,
        "max_tokens": r.max_tokens,
        "output_tokens": r.o.output_tokens,
        "output_tokens_from_usage": r.o.usage,
        "queue_ms": r.queue_ms(),
        "ttft_ms": r.o.ttft_ms,
        "tpot_ms": r.tpot_ms(),
        "e2el_ms": r.e2e_ms(),
        "itl_ms": r.o.itl_ms,
    })
}

/// Computes everything, prints the markdown, writes the files. Fails (after writing) when every
/// request failed.
pub fn finish(
    a: &ServeBenchArgs,
    model: &str,
    res: &LoadResult,
    before: Result<Counters, String>,
    after: Result<Counters, String>,
) -> Result<()> {
    let stamp = RunStamp::collect();
    let slo = Slo {
        ttft_ms: a.slo_ttft_ms,
        tpot_ms: a.slo_tpot_ms,
        e2e_ms: a.slo_e2e_ms,
    };
    let recs = &res.records;
    let phases: Vec<Stats> = Phase::ALL
        .iter()
        .map(|&p| {
            Stats::compute(
                p.name(),
                clip(p.bounds(a.ramp_s(), a.duration, res.end_s), res.end_s),
                recs.iter()
                    .filter(|r| Phase::at(r.o.done_s, a.ramp_s(), a.duration) == p),
                &slo,
            )
        })
        .collect();
    // Overall: from the start to the last completion (vLLM's benchmark duration).
    let last = recs.iter().map(|r| r.o.done_s).fold(0.0, f64::max);
    let overall = Stats::compute("overall", (0.0, last), recs.iter(), &slo);
    let from_usage = recs.iter().filter(|r| r.ok() && r.o.usage).count();
    let prompt_from_usage = recs
        .iter()
        .filter(|r| r.ok())
        .all(|r| r.o.prompt_tokens.is_some());
    let (metrics_json, metrics_line) = metrics_check(&before, &after, &overall, prompt_from_usage);

    let (spikes_json, spikes_md, notes) = spike_section(
        recs,
        a.spike_factor,
        a.step_log.as_deref(),
        a.max_spikes,
        res.t0_unix,
    );

    let errors: Vec<String> = recs
        .iter()
        .filter_map(|r| Some(format!("request {}: {}", r.index, r.o.error.as_ref()?)))
        .take(10)
        .collect();
    let closed_loop = !a.effective_rate().is_finite();

    // Markdown on stdout.
    let mut md = String::new();
    let _ = writeln!(
        md,
        "## quire serve-bench: {}{} (model `{model}`)\n",
        a.url.trim_end_matches('/'),
        a.endpoint
    );
    let arrivals = if closed_loop {
        format!("closed loop, {} in flight", a.concurrency.unwrap_or(0))
    } else {
        let kind = if a.burstiness == 1.0 {
            "Poisson".to_string()
        } else {
            format!("gamma (burstiness {})", a.burstiness)
        };
        let cap = a
            .concurrency
            .map_or(String::new(), |c| format!(", at most {c} in flight"));
        format!("{kind} arrivals at {} req/s{cap}", a.effective_rate())
    };
    let prompts = match &a.dataset {
        Some(p) => format!(
            "prompts from {} (max_tokens from the file, else",
            p.display()
        ),
        None => format!("prompts of ~{} words (max_tokens", a.input_len),
    };
    let _ = writeln!(
        md,
        "{arrivals}; ramp {} s, arrivals until {} s, then drain (≤ {} s); {prompts} {}{}){}; seed {}. \
         A request counts in the phase in which it completed; latencies in ms, from the send.\n",
        a.ramp_s(), a.duration, a.drain_timeout, a.output_len,
        if a.range_ratio > 0.0 { format!(" ±{:.0}%", a.range_ratio * 100.0) } else { String::new() },
        if a.no_ignore_eos { "" } else { ", ignore_eos" },
        a.seed
    );
    let _ = writeln!(md, "Structured-output constraint: {}.\n", a.constraint());
    md.push_str(&markdown_table(&phases, &overall));
    let _ = writeln!(
        md,
        "\n{} requests sent: {} completed, {} failed{}{}. Output tokens from the server's usage for {} of {} completed.",
        res.issued,
        overall.completed,
        overall.failed,
        if res.aborted > 0 && !res.interrupted { format!(" ({} unfinished at the end of the drain)", res.aborted) } else { String::new() },
        if res.interrupted { format!("; interrupted by Ctrl-C at {:.1} s, {} unfinished requests left out", res.end_s, res.aborted) } else { String::new() },
        from_usage,
        overall.completed
    );
    if let (Some(q), Some(_)) = (&overall.queue, a.concurrency) {
        let _ = writeln!(
            md,
            "Queue time for a --concurrency slot (not in TTFT/E2E): mean {:.1} ms, p99 {:.1} ms.",
            q.mean,
            q.p(99.0)
        );
    }
    if slo.any() {
        let given: Vec<String> = [
            ("TTFT", slo.ttft_ms),
            ("TPOT", slo.tpot_ms),
            ("E2E", slo.e2e_ms),
        ]
        .iter()
        .filter_map(|&(n, v)| Some(format!("{n} ≤ {} ms", v?)))
        .collect();
        let _ = writeln!(md, "Goodput: share of the requests sent that completed within every SLO ({}), and their rate.", given.join(", "));
    }
    let _ = writeln!(md, "{metrics_line}\n");
    md.push_str(&spikes_md);
    for n in &notes {
        let _ = writeln!(md, "Note: {n}");
    }
    if !errors.is_empty() {
        let _ = writeln!(md, "\nErrors (first {}):", errors.len());
        for e in &errors {
            let _ = writeln!(md, "- {e}");
        }
    }
    let _ = writeln!(md, "\n{}", stamp.line());
    print!("{md}");

    if let Some(path) = &a.json {
        let mut j = json!({
            "date": stamp.date,
            "backend": if a.endpoint.contains("chat") { "openai-chat" } else { "openai" },
            "base_url": a.url.trim_end_matches('/'),
            "endpoint": a.endpoint,
            "model_id": model,
            "request_rate": if closed_loop { Value::Null } else { json!(a.effective_rate()) },
            "closed_loop": closed_loop,
            "burstiness": a.burstiness,
            "max_concurrency": a.concurrency,
            "num_prompts": res.issued,
            "constraint": a.constraint(),
        });
        let m = j.as_object_mut().expect("an object");
        m.extend(overall.to_json());
        m.insert("aborted".into(), json!(res.aborted));
        m.insert("interrupted".into(), json!(res.interrupted));
        m.insert("output_tokens_from_usage".into(), json!(from_usage));
        m.insert("errors".into(), json!(errors));
        m.insert(
            "phases".into(),
            Value::Object(
                phases
                    .iter()
                    .map(|p| (p.name.to_string(), Value::Object(p.to_json())))
                    .collect(),
            ),
        );
        m.insert("server_metrics".into(), metrics_json);
        m.insert("itl_spikes".into(), spikes_json);
        m.insert("notes".into(), json!(notes));
        // The settings as run (defaults resolved; an infinite rate is null, as JSON has no inf).
        let mut settings = serde_json::to_value(a)?;
        settings["rate"] = json!(a.effective_rate());
        settings["ramp"] = json!(a.ramp_s());
        m.insert("settings".into(), settings);
        m.insert("stamp".into(), serde_json::to_value(&stamp)?);
        if a.save_requests {
            m.insert("requests".into(), recs.iter().map(request_json).collect());
        }
        let text = serde_json::to_string_pretty(&j)?;
        std::fs::write(path, text + "\n")
            .with_context(|| format!("cannot write --json {}", path.display()))?;
    }
    if let Some(path) = &a.svg {
        let input = ChartInput {
            title: format!(
                "serve-bench {} ({model}), {}",
                a.url.trim_end_matches('/'),
                arrivals
            ),
            records: recs,
            ramp_s: a.ramp_s().min(res.end_s),
            duration_s: a.duration.min(res.end_s),
            end_s: res.end_s,
        };
        let s = svg(&input, 1100, 600)?;
        std::fs::write(path, s)
            .with_context(|| format!("cannot write --svg {}", path.display()))?;
    }
    if res.interrupted {
        bail!(
            "interrupted by Ctrl-C at {:.1} s; the results above cover the requests that finished",
            res.end_s
        );
    }
    if overall.completed == 0 && overall.failed > 0 {
        bail!(
            "all {} requests failed; the first: {}",
            overall.failed,
            errors.first().map_or("", String::as_str)
        );
    }
    Ok(())
}

/// A phase window cut at the end of the run (an interrupted run ends early).
fn clip((a, b): (f64, f64), end_s: f64) -> (f64, f64) {
    (a.min(end_s), b.min(end_s))
}
