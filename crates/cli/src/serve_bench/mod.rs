//! `quire serve-bench`: open-loop load against an OpenAI-compatible server (quire's own, llama.cpp's
//! llama-server, vLLM): arrivals scheduled from the clock at a rate that ramps up, holds, then stops
//! while in-flight requests drain; latency and throughput per phase; ITL spikes attributed to the
//! server's steps; a cross-check of the server's /metrics counters.
//!
//! Modules: `workload` (arrivals, lengths, prompts), `client` (HTTP, SSE, Prometheus text),
//! `load` (the request loop), `report` (statistics), `spikes` (ITL spikes and the step log),
//! `summary` (JSON and markdown), `chart` (SVG).

mod chart;
mod client;
mod load;
mod report;
mod spikes;
mod summary;
mod workload;

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;
use serde::Serialize;

use client::{get_text, new_client, Target};
use load::{run_load, LoadConfig};
use workload::{load_dataset, Workload};

const EXAMPLES: &str = "\
Phases: the arrival rate rises linearly from 0 to --rate over --ramp seconds (ramp), holds until \
--duration seconds (steady), then arrivals stop and in-flight requests drain for up to \
--drain-timeout seconds (tail). A request counts in the phase in which it completed.

Timing: TTFT = send → first chunk with text; ITL = gaps between content chunks; TPOT = (E2E − TTFT) \
/ (output tokens − 1); E2E = send → [DONE]. All are measured from the send, like vLLM; with \
--concurrency, the wait for a slot (scheduled arrival → send) is reported separately as queue time.

Examples:
  quire serve-bench --url http://127.0.0.1:8080 --rate 8 --duration 120 --ramp 20 --json run.json --svg run.svg
  quire serve-bench --concurrency 16 --duration 60          # closed loop: 16 requests always in flight
  quire serve-bench --rate 10 --burstiness 0.5 --slo-ttft-ms 500 --slo-tpot-ms 50
  quire serve-bench --dataset prompts.jsonl --endpoint /v1/chat/completions
  quire serve --step-log steps.jsonl &  quire serve-bench --step-log steps.jsonl
  quire serve-bench --concurrency 16 --rate inf --response-format rf.json   # structured outputs";

#[derive(Args, Debug, Clone, Serialize)]
#[command(after_long_help = EXAMPLES)]
pub struct ServeBenchArgs {
    /// Base URL of the server (http://host:port, no TLS); the endpoint, /v1/models and /metrics are
    /// appended to it.
    #[arg(long, default_value = "http://127.0.0.1:8080", help_heading = "Target")]
    pub url: String,
    /// Request path: /v1/completions sends `prompt`, /v1/chat/completions one user message.
    #[arg(
        long,
        value_name = "PATH",
        default_value = "/v1/completions",
        help_heading = "Target"
    )]
    pub endpoint: String,
    /// Model name sent with each request [default: the first id from GET /v1/models, else
    /// "default"].
    #[arg(long, value_name = "NAME", help_heading = "Target")]
    pub model: Option<String>,
    /// API key, sent as `Authorization: Bearer KEY` (never written to the results).
    #[arg(long, value_name = "KEY", help_heading = "Target")]
    #[serde(skip)]
    pub api_key: Option<String>,

    /// Mean arrival rate in requests/s once the ramp is over. `inf` with --concurrency: closed loop
    /// (a new request as soon as one finishes) [default: 4, or inf when only --concurrency is given].
    #[arg(long, value_name = "REQ_PER_S", help_heading = "Load")]
    pub rate: Option<f64>,
    /// Shape of the gamma distribution of the gaps between arrivals: 1 = Poisson, below 1 burstier,
    /// above 1 more regular (as vLLM's --burstiness).
    #[arg(
        long,
        value_name = "SHAPE",
        default_value_t = 1.0,
        help_heading = "Load"
    )]
    pub burstiness: f64,
    /// At most N requests in flight; arrivals beyond wait for a slot (their wait is reported as
    /// queue time, not inside TTFT/E2E).
    #[arg(long, value_name = "N", help_heading = "Load")]
    pub concurrency: Option<usize>,
    /// Arrival window in seconds, ramp included; then the tail drains what is in flight.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 60.0,
        help_heading = "Load"
    )]
    pub duration: f64,
    /// Seconds over which the arrival rate rises linearly from 0 to --rate (0: full rate at once)
    /// [default: 10, at most half of --duration].
    #[arg(long, value_name = "SECONDS", help_heading = "Load")]
    pub ramp: Option<f64>,
    /// Seconds the tail waits for in-flight requests; those unfinished then count as failed.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 120.0,
        help_heading = "Load"
    )]
    pub drain_timeout: f64,
    /// Seconds one request may take, send to last byte, before it counts as failed.
    #[arg(
        long,
        value_name = "SECONDS",
        default_value_t = 300.0,
        help_heading = "Load"
    )]
    pub request_timeout: f64,

    /// Mean prompt length in words of random common English (about one token per word; the
    /// report uses the server's own prompt token counts).
    #[arg(
        long,
        value_name = "WORDS",
        default_value_t = 128,
        help_heading = "Workload"
    )]
    pub input_len: usize,
    /// Mean output length in tokens (max_tokens of each request).
    #[arg(
        long,
        value_name = "TOKENS",
        default_value_t = 64,
        help_heading = "Workload"
    )]
    pub output_len: usize,
    /// Lengths drawn uniformly from [mean × (1 − R), mean × (1 + R)]; 0 = every request the same.
    #[arg(
        long,
        value_name = "R",
        default_value_t = 0.0,
        help_heading = "Workload"
    )]
    pub range_ratio: f64,
    /// JSONL prompts instead of random text: one object per line with "prompt" and optional
    /// "max_tokens" or "output_len" (else --output-len); shuffled by --seed, reused in a cycle.
    #[arg(long, value_name = "FILE", help_heading = "Workload")]
    pub dataset: Option<PathBuf>,
    /// Do not send "ignore_eos": true (then outputs may stop early at end-of-sequence).
    #[arg(long, help_heading = "Workload")]
    pub no_ignore_eos: bool,
    /// A JSON file holding an OpenAI `response_format` object (e.g. `{"type": "json_schema",
    /// "json_schema": {"name": "x", "schema": {...}}}` or `{"type": "json_object"}`), sent with
    /// every request: run once with it and once without to measure what structured outputs cost.
    /// The summary says which constraint was on.
    #[arg(long, value_name = "FILE", help_heading = "Workload")]
    pub response_format: Option<PathBuf>,
    /// Seed for the arrivals, lengths, prompt words and dataset order.
    #[arg(long, value_name = "N", default_value_t = 0, help_heading = "Workload")]
    pub seed: u64,

    /// SLO on time to first token, ms (goodput = completed requests meeting every given SLO).
    #[arg(long, value_name = "MS", help_heading = "SLOs and spikes")]
    pub slo_ttft_ms: Option<f64>,
    /// SLO on time per output token after the first, ms.
    #[arg(long, value_name = "MS", help_heading = "SLOs and spikes")]
    pub slo_tpot_ms: Option<f64>,
    /// SLO on end-to-end latency, ms.
    #[arg(long, value_name = "MS", help_heading = "SLOs and spikes")]
    pub slo_e2e_ms: Option<f64>,
    /// An inter-token gap above K × the median ITL is a spike, listed with its time and request.
    #[arg(
        long,
        value_name = "K",
        default_value_t = 3.0,
        help_heading = "SLOs and spikes"
    )]
    pub spike_factor: f64,
    /// The server's step log (JSONL with Unix start/end times per engine step, as `quire serve
    /// --step-log FILE` writes): each spike is attributed to the step overlapping it.
    #[arg(long, value_name = "FILE", help_heading = "SLOs and spikes")]
    pub step_log: Option<PathBuf>,
    /// How many spikes the markdown summary lists (the largest; the JSON keeps up to 1000).
    #[arg(
        long,
        value_name = "N",
        default_value_t = 10,
        help_heading = "SLOs and spikes"
    )]
    pub max_spikes: usize,

    /// Write the results as JSON (vllm bench serve's field names, plus phases and checks).
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    pub json: Option<PathBuf>,
    /// With --json: also every request's timings and ITLs under "requests".
    #[arg(long, help_heading = "Output")]
    pub save_requests: bool,
    /// Write an SVG chart of latency over time (TTFT, E2E, ITL points; phases shaded).
    #[arg(long, value_name = "FILE", help_heading = "Output")]
    pub svg: Option<PathBuf>,
    /// No progress bar on stderr (it is also hidden when stderr is not a terminal).
    #[arg(long, help_heading = "Output")]
    pub no_progress: bool,
}

impl ServeBenchArgs {
    /// The arrival rate: --rate, else inf with --concurrency alone, else 4.
    fn effective_rate(&self) -> f64 {
        match (self.rate, self.concurrency) {
            (Some(r), _) => r,
            (None, Some(_)) => f64::INFINITY,
            (None, None) => 4.0,
        }
    }

    /// The run's constraint as the summary states it.
    fn constraint(&self) -> String {
        match &self.response_format {
            Some(p) => format!("response_format from {}", p.display()),
            None => "none".into(),
        }
    }

    /// --ramp, else 10 s but at most half the arrival window.
    fn ramp_s(&self) -> f64 {
        self.ramp.unwrap_or((self.duration / 2.0).min(10.0))
    }

    fn validate(&self) -> Result<()> {
        let rate = self.effective_rate();
        if rate.is_nan() || rate <= 0.0 {
            bail!("--rate must be positive (requests/s), got {rate}");
        }
        if rate.is_infinite() && self.concurrency.is_none() {
            bail!("--rate inf needs --concurrency N (a closed loop of N requests in flight)");
        }
        if self.concurrency == Some(0) {
            bail!("--concurrency must be at least 1");
        }
        if !(self.burstiness > 0.0 && self.burstiness.is_finite()) {
            bail!("--burstiness must be positive, got {}", self.burstiness);
        }
        if !(self.duration > 0.0 && self.duration.is_finite()) {
            bail!("--duration must be positive seconds, got {}", self.duration);
        }
        if !(0.0..=self.duration).contains(&self.ramp_s()) {
            bail!(
                "--ramp must be between 0 and --duration ({} s), got {}",
                self.duration,
                self.ramp_s()
            );
        }
        for (flag, v) in [
            ("--drain-timeout", self.drain_timeout),
            ("--request-timeout", self.request_timeout),
        ] {
            if !(v > 0.0 && v <= 1e7) {
                bail!("{flag} must be positive seconds, got {v}");
            }
        }
        if self.input_len == 0 || self.output_len == 0 {
            bail!("--input-len and --output-len must be at least 1");
        }
        if !(0.0..1.0).contains(&self.range_ratio) {
            bail!("--range-ratio must be in [0, 1), got {}", self.range_ratio);
        }
        if self.spike_factor.is_nan() || self.spike_factor <= 0.0 {
            bail!("--spike-factor must be positive, got {}", self.spike_factor);
        }
        if !self.endpoint.starts_with('/') {
            bail!("--endpoint must start with '/', e.g. /v1/completions");
        }
        let u = self.url.trim_end_matches('/');
        if u.starts_with("https://") {
            bail!("--url {u}: https is not supported (no TLS client); use http://");
        }
        let Some(rest) = u.strip_prefix("http://") else {
            bail!("--url {u}: expected http://host:port");
        };
        if rest.is_empty() || rest.parse::<hyper::Uri>().is_err() {
            bail!("--url {u}: not a valid http://host:port URL");
        }
        Ok(())
    }
}

pub fn run(a: ServeBenchArgs) -> Result<()> {
    a.validate()?;
    let dataset = a.dataset.as_deref().map(load_dataset).transpose()?;
    let response_format = a
        .response_format
        .as_deref()
        .map(load_response_format)
        .transpose()?;
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .build()
        .context("cannot start the async runtime")?;
    rt.block_on(run_async(a, dataset, response_format))
}

/// The `response_format` object in `path`: JSON, an object with a string `type`.
fn load_response_format(path: &std::path::Path) -> Result<serde_json::Value> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --response-format {}", path.display()))?;
    let v: serde_json::Value = serde_json::from_str(&text)
        .with_context(|| format!("--response-format {}: not JSON", path.display()))?;
    if !v.get("type").is_some_and(|t| t.is_string()) {
        bail!(
            "--response-format {}: expected an OpenAI response_format object with a \"type\" \
             (\"json_object\" or \"json_schema\")",
            path.display()
        );
    }
    Ok(v)
}

async fn run_async(
    a: ServeBenchArgs,
    dataset: Option<Vec<workload::DatasetEntry>>,
    response_format: Option<serde_json::Value>,
) -> Result<()> {
    let base = a.url.trim_end_matches('/').to_string();
    let client = new_client(Duration::from_secs_f64(a.request_timeout.min(10.0)));
    let probe_timeout = Duration::from_secs_f64(a.request_timeout.min(15.0));

    // Reachability and the model name in one request.
    let models = get_text(
        &client,
        &base,
        "/v1/models",
        a.api_key.as_deref(),
        probe_timeout,
    )
    .await
    .with_context(|| format!("cannot reach the server at {base}"))?;
    let model = match &a.model {
        Some(m) => m.clone(),
        None => first_model_id(&models.1)
            .filter(|_| models.0.is_success())
            .unwrap_or_else(|| "default".into()),
    };
    let before = summary::scrape_metrics(&client, &base, a.api_key.as_deref()).await;

    let target = Target {
        base: base.clone(),
        endpoint: a.endpoint.clone(),
        api_key: a.api_key.clone(),
        model: model.clone(),
        chat: a.endpoint.contains("chat"),
        ignore_eos: !a.no_ignore_eos,
        response_format,
    };
    let workload = Workload::new(a.seed, a.input_len, a.output_len, a.range_ratio, dataset);
    let cfg = LoadConfig {
        rate: a.effective_rate(),
        burstiness: a.burstiness,
        concurrency: a.concurrency,
        ramp_s: a.ramp_s(),
        duration_s: a.duration,
        drain_timeout_s: a.drain_timeout,
        request_timeout_s: a.request_timeout,
        seed: a.seed,
        progress: !a.no_progress,
    };
    let result = run_load(client.clone(), target, workload, &cfg).await;

    let after = match &before {
        Ok(_) => {
            // Let the server finish its bookkeeping of the last requests.
            tokio::time::sleep(Duration::from_millis(200)).await;
            summary::scrape_metrics(&client, &base, a.api_key.as_deref()).await
        }
        Err(e) => Err(e.clone()),
    };
    summary::finish(&a, &model, &result, before, after)
}

/// `data[0].id` of a /v1/models answer.
fn first_model_id(body: &str) -> Option<String> {
    let v: serde_json::Value = serde_json::from_str(body).ok()?;
    Some(v.get("data")?.get(0)?.get("id")?.as_str()?.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use clap::Parser;

    #[derive(Parser)]
    struct Cli {
        #[command(flatten)]
        a: ServeBenchArgs,
    }

    fn parse(args: &[&str]) -> ServeBenchArgs {
        Cli::parse_from(std::iter::once("x").chain(args.iter().copied())).a
    }

    #[test]
    fn defaults_and_validation() {
        let a = parse(&[]);
        assert_eq!(
            (a.effective_rate(), a.duration, a.ramp_s()),
            (4.0, 60.0, 10.0)
        );
        assert_eq!(parse(&["--duration", "5"]).ramp_s(), 2.5);
        assert_eq!((a.input_len, a.output_len), (128, 64));
        a.validate().unwrap();
        assert!(parse(&["--concurrency", "4"])
            .effective_rate()
            .is_infinite());
        assert!(parse(&["--rate", "inf"]).validate().is_err());
        assert!(parse(&["--rate", "inf", "--concurrency", "2"])
            .validate()
            .is_ok());
        assert!(parse(&["--ramp", "70"]).validate().is_err());
        assert!(parse(&["--url", "https://x:1"]).validate().is_err());
        assert!(parse(&["--range-ratio", "1"]).validate().is_err());
        assert!(parse(&["--endpoint", "v1/completions"]).validate().is_err());
    }

    #[test]
    fn response_format_file_is_checked() {
        let dir = std::env::temp_dir().join(format!("quire-sb-rf-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let write = |name: &str, body: &str| {
            let p = dir.join(name);
            std::fs::write(&p, body).unwrap();
            p
        };
        let ok = write("ok.json", r#"{"type": "json_object"}"#);
        assert_eq!(load_response_format(&ok).unwrap()["type"], "json_object");
        let err = |p: &std::path::Path| load_response_format(p).unwrap_err().to_string();
        assert!(err(&write("bare.json", r#"{"schema": {}}"#)).contains("\"type\""));
        assert!(err(&write("bad.json", "{")).contains("not JSON"));
        assert!(err(&dir.join("missing.json")).contains("cannot read"));
        let a = parse(&["--response-format", "rf.json"]);
        assert_eq!(a.constraint(), "response_format from rf.json");
        assert_eq!(parse(&[]).constraint(), "none");
        std::fs::remove_dir_all(&dir).unwrap();
    }

    #[test]
    fn model_id_from_listing() {
        let body = r#"{"object":"list","data":[{"id":"smollm2","object":"model"}]}"#;
        assert_eq!(first_model_id(body).as_deref(), Some("smollm2"));
        assert_eq!(first_model_id("not json"), None);
        assert_eq!(first_model_id(r#"{"data":[]}"#), None);
    }
}
