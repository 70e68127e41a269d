//! quire's OpenAI-compatible HTTP server. axum handlers parse and check requests, tokenize them,
//! and hand them to the engine thread (`engine_loop`), which owns the engine and the metrics; the
//! answers come back over per-request channels (`generate`). Clients are not trusted: connections,
//! their timeouts and body sizes are limited (`conn`, [`Limits`]), and prompts are checked and
//! tokenized off the async workers (`prep`). Shutdown on SIGINT/SIGTERM stops accepting, lets
//! in-flight requests finish within a grace period, then aborts what is left.

pub mod api;
pub mod conn;
pub mod engine_loop;
pub mod error;
pub mod generate;
pub mod metrics;
pub mod prep;
pub mod tools;

use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Body;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use quire_engine::Engine;
use quire_tokenizer::{ChatTemplate, Tokenizer};
use serde_json::json;
use tokio::sync::{oneshot, watch, Semaphore};

use crate::engine_loop::{Cmd, LoopConfig};
use crate::error::ApiError;
use crate::generate::Kind;

#[derive(Debug, thiserror::Error)]
pub enum ServerError {
    #[error("cannot listen on {addr}")]
    Bind {
        addr: String,
        source: std::io::Error,
    },
    #[error("{0}")]
    Io(#[from] std::io::Error),
}

/// What one client may use. The defaults suit a public deployment: slow or idle sockets are
/// closed within seconds and cannot use up the process's file descriptors.
#[derive(Debug, Clone, Copy)]
pub struct Limits {
    /// Time to send a request's headers; also how long a keep-alive connection may stay idle.
    pub header_timeout: Duration,
    /// Time to send a request's body once its headers are in.
    pub body_timeout: Duration,
    /// Most connections open at once (lowered to fit the open-file limit); more wait to be
    /// accepted.
    pub max_connections: usize,
    /// Largest request body, in bytes (413 beyond).
    pub max_body_bytes: usize,
}

impl Default for Limits {
    fn default() -> Self {
        Self {
            header_timeout: Duration::from_secs(10),
            body_timeout: Duration::from_secs(30),
            max_connections: 512,
            // OpenAI's own limit on a request body is far larger than any prompt here needs.
            max_body_bytes: 16 << 20,
        }
    }
}

pub struct ServerConfig {
    pub host: String,
    pub port: u16,
    /// The id clients pass as `model` (and `/v1/models` lists).
    pub model_id: String,
    pub api_key: Option<String>,
    pub max_waiting: usize,
    /// After SIGINT/SIGTERM, how long in-flight requests may run before they are aborted.
    pub shutdown_grace: Duration,
    pub step_log: Option<Box<dyn std::io::Write + Send>>,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: ChatTemplate,
    pub limits: Limits,
    /// Special-token text inside chat message content becomes control tokens (llama.cpp's and
    /// vLLM's behaviour). Off by default, so a user cannot forge a system turn.
    pub special_tokens_in_content: bool,
}

/// What every handler shares (read-only but for two atomics).
pub struct AppState {
    pub engine: Sender<Cmd>,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: ChatTemplate,
    pub model_id: String,
    pub max_model_len: usize,
    pub api_key: Option<String>,
    pub created: u64,
    pub fingerprint: String,
    pub limits: Limits,
    pub special_tokens_in_content: bool,
    /// The longest token text of the vocabulary, in bytes.
    pub max_token_bytes: usize,
    /// `max_model_len * max_token_bytes`: a longer prompt text cannot fit the context.
    pub max_prompt_bytes: usize,
    /// Permits for prompt preparation (template rendering, tokenizing) on blocking threads.
    pub prep: Semaphore,
    draining: AtomicBool,
    next_id: AtomicU64,
}

impl AppState {
    pub fn is_draining(&self) -> bool {
        self.draining.load(Ordering::Relaxed)
    }

    pub fn new_id(&self, kind: Kind) -> String {
        let n = self.next_id.fetch_add(1, Ordering::Relaxed);
        let prefix = if kind == Kind::Chat {
            "chatcmpl"
        } else {
            "cmpl"
        };
        format!("{prefix}-{:x}{n:06x}", self.created)
    }

    fn check_auth(&self, headers: &HeaderMap) -> Result<(), ApiError> {
        let Some(key) = &self.api_key else {
            return Ok(());
        };
        let given = headers
            .get(header::AUTHORIZATION)
            .and_then(|v| v.to_str().ok())
            .and_then(|v| v.strip_prefix("Bearer "))
            .map(str::trim);
        if given == Some(key.as_str()) {
            Ok(())
        } else {
            Err(ApiError::unauthorized())
        }
    }

    fn check_model(&self, model: Option<&str>) -> Result<(), ApiError> {
        match model {
            None => Ok(()),
            Some(m) if m == self.model_id || m.is_empty() => Ok(()),
            Some(m) => Err(ApiError::bad_request(format!(
                "the model `{m}` does not exist; this server runs `{}`",
                self.model_id
            ))
            .param("model")
            .code("model_not_found")),
        }
    }

    async fn ask<T>(&self, make: impl FnOnce(oneshot::Sender<T>) -> Cmd) -> Result<T, ApiError> {
        let (tx, rx) = oneshot::channel();
        self.engine
            .send(make(tx))
            .map_err(|_| ApiError::unavailable("the engine has stopped"))?;
        rx.await
            .map_err(|_| ApiError::unavailable("the engine has stopped"))
    }
}

fn unix_secs() -> u64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .map(|d| d.as_secs())
        .unwrap_or(0)
}

async fn completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    st.check_auth(&headers)?;
    let body = prep::read_body(&st, &headers, body).await?;
    let req = api::parse_body(&body)?;
    st.check_model(req.model.as_deref())?;
    let opts = req.common(false)?;
    let prompts = prep::completion_prompts(&st, req).await?;
    generate::run(st, Kind::Completion, prompts, opts, arrival).await
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Body,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    st.check_auth(&headers)?;
    let body = prep::read_body(&st, &headers, body).await?;
    let req = api::parse_body(&body)?;
    st.check_model(req.model.as_deref())?;
    let mut opts = req.common(true)?;
    let mut messages = req.chat_messages()?;
    let mut extra = serde_json::Map::new();
    opts.tools = tools::ToolSpec::parse(
        req.tools.as_deref(),
        req.tool_choice.as_ref(),
        req.parallel_tool_calls,
        &st.chat_template,
    )?;
    if let Some(spec) = &opts.tools {
        if let Some(c) = spec.constraint() {
            if opts.params.constraint.is_some() {
                return Err(ApiError::bad_request(
                    "a required or named `tool_choice` constrains the reply itself: \
                     give it or `response_format`/`regex`/`grammar`, not both",
                )
                .param("tool_choice"));
            }
            opts.params.constraint = Some(c);
        }
        if spec.describe_in_system {
            match messages.first_mut().filter(|m| m.role == "system") {
                Some(sys) => sys.content = format!("{}\n\n{}", sys.content, spec.system_prompt()),
                None => messages.insert(
                    0,
                    quire_tokenizer::ChatMessage::new("system", spec.system_prompt()),
                ),
            }
        } else {
            extra.insert("tools".into(), spec.template_tools());
        }
    }
    let prompt = prep::chat_prompt(&st, messages, extra).await?;
    generate::run(st, Kind::Chat, vec![prompt], opts, arrival).await
}

async fn models(State(st): State<Arc<AppState>>, headers: HeaderMap) -> Result<Response, ApiError> {
    st.check_auth(&headers)?;
    Ok(axum::Json(json!({
        "object": "list",
        "data": [{
            "id": st.model_id,
            "object": "model",
            "created": st.created,
            "owned_by": "quire",
            "max_model_len": st.max_model_len,
        }]
    }))
    .into_response())
}

async fn health(State(st): State<Arc<AppState>>) -> Response {
    if st.is_draining() {
        (
            StatusCode::SERVICE_UNAVAILABLE,
            axum::Json(json!({"status": "shutting down"})),
        )
            .into_response()
    } else {
        axum::Json(json!({"status": "ok"})).into_response()
    }
}

async fn metrics(State(st): State<Arc<AppState>>) -> Result<Response, ApiError> {
    let text = st.ask(Cmd::Metrics).await?;
    Ok((
        [(
            header::CONTENT_TYPE,
            "text/plain; version=0.0.4; charset=utf-8",
        )],
        text,
    )
        .into_response())
}

async fn not_found() -> ApiError {
    ApiError::not_found("no such endpoint; see /v1/models, /v1/completions, /v1/chat/completions, /health, /metrics")
}

async fn method_not_allowed() -> ApiError {
    ApiError::method_not_allowed()
}

pub fn router(st: Arc<AppState>) -> Router {
    let gen_routes = Router::new()
        .route("/v1/completions", post(completions))
        .route("/v1/chat/completions", post(chat_completions))
        .method_not_allowed_fallback(method_not_allowed);
    Router::new()
        .route("/v1/models", get(models))
        .route("/health", get(health))
        .route("/metrics", get(metrics))
        .merge(gen_routes)
        .fallback(not_found)
        .method_not_allowed_fallback(method_not_allowed)
        .with_state(st)
}

async fn shutdown_signal() {
    let ctrl_c = async {
        let _ = tokio::signal::ctrl_c().await;
    };
    #[cfg(unix)]
    let term = async {
        match tokio::signal::unix::signal(tokio::signal::unix::SignalKind::terminate()) {
            Ok(mut s) => {
                s.recv().await;
            }
            Err(_) => std::future::pending::<()>().await,
        }
    };
    #[cfg(not(unix))]
    let term = std::future::pending::<()>();
    tokio::select! {
        _ = ctrl_c => {},
        _ = term => {},
    }
}

/// Runs the server until SIGINT/SIGTERM; returns once it has shut down.
pub fn run(cfg: ServerConfig, engine: Engine) -> Result<(), ServerError> {
    let rt = tokio::runtime::Builder::new_multi_thread()
        .enable_all()
        .thread_name("quire-http")
        .build()?;
    rt.block_on(serve(cfg, engine))
}

async fn serve(cfg: ServerConfig, engine: Engine) -> Result<(), ServerError> {
    let addr = format!("{}:{}", cfg.host, cfg.port);
    let listener = tokio::net::TcpListener::bind(&addr)
        .await
        .map_err(|source| ServerError::Bind {
            addr: addr.clone(),
            source,
        })?;
    let local: SocketAddr = listener.local_addr()?;
    let max_model_len = engine.config().max_model_len;
    let kv = engine.stats();
    let (tx, engine_thread) = engine_loop::spawn(
        engine,
        LoopConfig {
            max_waiting: cfg.max_waiting,
            step_log: cfg.step_log,
            model_name: cfg.model_id.clone(),
        },
    );
    let created = unix_secs();
    let max_token_bytes = cfg.tokenizer.max_token_bytes().max(1);
    let prep_threads = std::thread::available_parallelism().map_or(2, |n| n.get());
    let max_connections = conn::effective_max_connections(cfg.limits.max_connections);
    if max_connections < cfg.limits.max_connections {
        eprintln!(
            "quire serve: at most {max_connections} connections (not {}), to stay within the \
             open-file limit",
            cfg.limits.max_connections
        );
    }
    let st = Arc::new(AppState {
        engine: tx.clone(),
        tokenizer: cfg.tokenizer,
        chat_template: cfg.chat_template,
        model_id: cfg.model_id,
        max_model_len,
        api_key: cfg.api_key,
        created,
        fingerprint: format!("quire-{}", env!("CARGO_PKG_VERSION")),
        limits: cfg.limits,
        special_tokens_in_content: cfg.special_tokens_in_content,
        max_token_bytes,
        max_prompt_bytes: max_model_len.saturating_mul(max_token_bytes),
        prep: Semaphore::new(prep_threads),
        draining: AtomicBool::new(false),
        next_id: AtomicU64::new(0),
    });
    eprintln!(
        "quire serve: {} on http://{local} (max_model_len {max_model_len}, {} KV blocks){}",
        st.model_id,
        kv.kv_blocks_total,
        if st.api_key.is_some() {
            ", API key required"
        } else {
            ""
        }
    );
    let (signalled_tx, signalled_rx) = oneshot::channel::<()>();
    let (stop_tx, stop_rx) = watch::channel(false);
    let st_sig = st.clone();
    tokio::spawn(async move {
        shutdown_signal().await;
        st_sig.draining.store(true, Ordering::Relaxed);
        let _ = stop_tx.send(true);
        let _ = signalled_tx.send(());
    });
    let limits = conn::ConnLimits {
        header_timeout: cfg.limits.header_timeout,
        max_connections,
    };
    let server = tokio::spawn(conn::serve(listener, router(st.clone()), limits, stop_rx));
    let grace = cfg.shutdown_grace;
    let mut server = server;
    tokio::select! {
        r = &mut server => {
            // The server ended on its own: still shut the engine down.
            if let Err(e) = r {
                eprintln!("server error: {e}");
            }
        }
        _ = signalled_rx => {
            let stats = st.ask(Cmd::Stats).await.ok();
            eprintln!(
                "shutting down: no new requests; {} in flight get up to {:.0} s to finish",
                stats.map_or(0, |s| s.running + s.waiting),
                grace.as_secs_f64()
            );
            if tokio::time::timeout(grace, &mut server).await.is_err() {
                eprintln!("grace period over: aborting the requests still running");
                let _ = tx.send(Cmd::AbortAll);
                // Aborted streams end at once; a client that stops reading cannot hold us.
                let _ = tokio::time::timeout(Duration::from_secs(5), &mut server).await;
            }
        }
    }
    let _ = tx.send(Cmd::Shutdown);
    drop(tx);
    drop(st);
    let _ = tokio::task::spawn_blocking(move || engine_thread.join()).await;
    eprintln!("quire serve: stopped");
    Ok(())
}
