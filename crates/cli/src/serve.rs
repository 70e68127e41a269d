//! `quire serve`: the OpenAI-compatible HTTP server (crates/server) over one engine.

use std::path::PathBuf;
use std::time::Duration;

use anyhow::{bail, Context, Result};
use clap::Args;

use crate::common::{build_engine, load_model, EngineArgs, ModelArgs};

#[derive(Args, Debug)]
#[command(
    after_help = "Endpoints: POST /v1/completions, POST /v1/chat/completions (both with \
\"stream\": true for server-sent events), GET /v1/models, GET /health, GET /metrics (Prometheus).\n\n\
Limits against hostile clients (defaults suit a public address): --header-timeout, --body-timeout, \
--max-connections, --max-body-bytes; `stop` takes at most 16 strings of 256 bytes; a prompt longer \
than the context times the longest token's bytes is refused before tokenizing; chat templates \
run with a work budget.\n\n\
Example:\n  quire serve --port 8080 &\n  curl http://127.0.0.1:8080/v1/chat/completions \
-H 'Content-Type: application/json' \\\n    -d '{\"messages\": [{\"role\": \"user\", \"content\": \"Hi\"}], \"max_tokens\": 32}'"
)]
pub struct ServeArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Address to listen on (127.0.0.1: this machine only; 0.0.0.0: every interface)
    #[arg(long, default_value = "127.0.0.1")]
    pub host: String,
    /// Port to listen on (0 picks a free one, printed at start)
    #[arg(long, default_value_t = 8080)]
    pub port: u16,
    /// Require `Authorization: Bearer KEY` on /v1/* (401 otherwise)
    #[arg(long, env = "QUIRE_API_KEY", hide_env_values = true)]
    pub api_key: Option<String>,
    /// The model id clients send as "model" [default: the file name without .gguf]
    #[arg(long)]
    pub served_model_name: Option<String>,
    /// Most requests waiting for a place in the batch; more get 429
    #[arg(long, default_value_t = 256)]
    pub max_waiting: usize,
    /// Seconds in-flight requests get to finish after SIGINT/SIGTERM before they are aborted
    #[arg(long, default_value_t = 30.0)]
    pub shutdown_grace: f64,
    /// Seconds a client has to send a request's headers, from when it connects or its previous
    /// response ended; so also how long an idle keep-alive connection stays open
    #[arg(long, default_value_t = 10.0)]
    pub header_timeout: f64,
    /// Seconds a client has to send a request's body once the headers are in (408 after)
    #[arg(long, default_value_t = 30.0)]
    pub body_timeout: f64,
    /// Most client connections open at once; more wait to be accepted. Lowered at start to
    /// leave a quarter of the open-file limit (`ulimit -n`) for the rest of the server
    #[arg(long, default_value_t = 512)]
    pub max_connections: usize,
    /// Largest request body in bytes (413 beyond)
    #[arg(long, default_value_t = 16 << 20)]
    pub max_body_bytes: usize,
    /// Let special-token text in chat message content (e.g. `<|im_start|>`) become control
    /// tokens, as llama.cpp and vLLM do. By default content is tokenized as plain text and only
    /// the chat template's own markup is special, so a user cannot forge a system turn. Only
    /// for trusted clients
    #[arg(long)]
    pub special_tokens_in_content: bool,
    /// Write one JSON line per engine step here (step, start/end unix time, duration_ms,
    /// prompt_tokens, decode_tokens, preemptions, running, waiting, kv_blocks_used)
    #[arg(long)]
    pub step_log: Option<PathBuf>,
    #[command(flatten)]
    pub engine: EngineArgs,
    #[command(flatten)]
    pub spec: crate::spec_args::SpecArgs,
}

pub fn run(a: ServeArgs) -> Result<()> {
    if !(a.shutdown_grace.is_finite() && a.shutdown_grace >= 0.0) {
        bail!("--shutdown-grace must be a number of seconds >= 0");
    }
    for (name, v) in [
        ("--header-timeout", a.header_timeout),
        ("--body-timeout", a.body_timeout),
    ] {
        if !(v.is_finite() && v > 0.0 && v <= 86_400.0) {
            bail!("{name} must be a number of seconds in (0, 86400], got {v}");
        }
    }
    if a.max_connections == 0 {
        bail!("--max-connections must be at least 1");
    }
    if a.max_body_bytes == 0 {
        bail!("--max-body-bytes must be at least 1");
    }
    if a.api_key.as_deref().is_some_and(str::is_empty) {
        bail!("--api-key must not be empty");
    }
    let step_log: Option<Box<dyn std::io::Write + Send>> = match &a.step_log {
        Some(p) => Some(Box::new(std::io::BufWriter::new(
            std::fs::File::create(p)
                .with_context(|| format!("cannot create the step log {}", p.display()))?,
        ))),
        None => None,
    };
    let t_load = std::time::Instant::now();
    let model = load_model(&a.model)?;
    let mut engine = build_engine(&model, &a.model, &a.engine, 0)?;
    a.spec.apply(&mut engine, &a.model, &a.engine)?;
    eprintln!(
        "model loaded in {:.0} ms, peak host RSS {}, peak GPU memory {}; steps of at most {} sequences and {} tokens",
        t_load.elapsed().as_secs_f64() * 1e3,
        quire_perf::mem::fmt_mib(quire_perf::mem::peak_rss_bytes()),
        quire_perf::mem::fmt_mib(engine.executor().device_memory_peak()),
        a.engine.max_num_seqs(&a.model.backend),
        a.engine.max_num_batched_tokens(&a.model.backend),
    );
    let model_id = a.served_model_name.clone().unwrap_or_else(|| {
        model
            .meta
            .file_name
            .strip_suffix(".gguf")
            .unwrap_or(&model.meta.file_name)
            .to_string()
    });
    quire_server::run(
        quire_server::ServerConfig {
            host: a.host.clone(),
            port: a.port,
            model_id,
            api_key: a.api_key.clone(),
            max_waiting: a.max_waiting,
            shutdown_grace: Duration::from_secs_f64(a.shutdown_grace),
            step_log,
            tokenizer: model.tokenizer.clone(),
            chat_template: model.chat_template.clone(),
            limits: quire_server::Limits {
                header_timeout: Duration::from_secs_f64(a.header_timeout),
                body_timeout: Duration::from_secs_f64(a.body_timeout),
                max_connections: a.max_connections,
                max_body_bytes: a.max_body_bytes,
            },
            special_tokens_in_content: a.special_tokens_in_content,
        },
        engine,
    )?;
    Ok(())
}
