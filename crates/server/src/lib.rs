//! quire's OpenAI-compatible HTTP server. axum handlers parse and check requests, tokenize them,
//! and hand them to the engine thread (`engine_loop`), which owns the engine and the metrics; the
//! answers come back over per-request channels (`generate`). Shutdown on SIGINT/SIGTERM stops
//! accepting, lets in-flight requests finish within a grace period, then aborts what is left.

pub mod api;
pub mod engine_loop;
pub mod error;
pub mod generate;
pub mod metrics;

use std::future::IntoFuture;
use std::net::SocketAddr;
use std::sync::atomic::{AtomicBool, AtomicU64, Ordering};
use std::sync::mpsc::Sender;
use std::sync::Arc;
use std::time::{Duration, Instant, SystemTime, UNIX_EPOCH};

use axum::body::Bytes;
use axum::extract::State;
use axum::http::{header, HeaderMap, StatusCode};
use axum::response::{IntoResponse, Response};
use axum::routing::{get, post};
use axum::Router;
use quire_engine::Engine;
use quire_tokenizer::{ChatTemplate, Tokenizer};
use serde_json::json;
use tokio::sync::oneshot;

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
    body: Bytes,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    st.check_auth(&headers)?;
    let req = api::parse_body(&body)?;
    st.check_model(req.model.as_deref())?;
    let opts = req.common(false)?;
    let tok = st.tokenizer.clone();
    let prompts = req.prompts(|t| {
        tok.encode(t, true, true)
            .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))
    })?;
    generate::run(st, Kind::Completion, prompts, opts, arrival).await
}

async fn chat_completions(
    State(st): State<Arc<AppState>>,
    headers: HeaderMap,
    body: Bytes,
) -> Result<Response, ApiError> {
    let arrival = Instant::now();
    st.check_auth(&headers)?;
    let req = api::parse_body(&body)?;
    st.check_model(req.model.as_deref())?;
    let opts = req.common(true)?;
    let messages = req.chat_messages()?;
    let prompt = quire_tokenizer::encode_chat(&st.tokenizer, &st.chat_template, &messages)
        .map_err(|e| {
            ApiError::bad_request(format!("cannot apply the chat template: {e}")).param("messages")
        })?;
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the rendered chat is empty").param("messages"));
    }
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
        // OpenAI's own limit on a request body is far larger than any prompt here needs.
        .layer(axum::extract::DefaultBodyLimit::max(16 << 20))
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
    let st = Arc::new(AppState {
        engine: tx.clone(),
        tokenizer: cfg.tokenizer,
        chat_template: cfg.chat_template,
        model_id: cfg.model_id,
        max_model_len,
        api_key: cfg.api_key,
        created,
        fingerprint: format!("quire-{}", env!("CARGO_PKG_VERSION")),
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
    let st_sig = st.clone();
    let graceful = async move {
        shutdown_signal().await;
        st_sig.draining.store(true, Ordering::Relaxed);
        let _ = signalled_tx.send(());
    };
    let server = tokio::spawn(
        axum::serve(listener, router(st.clone()))
            .with_graceful_shutdown(graceful)
            .into_future(),
    );
    let grace = cfg.shutdown_grace;
    let mut server = server;
    tokio::select! {
        r = &mut server => {
            // The server ended on its own (an accept error): still shut the engine down.
            if let Ok(Err(e)) = r {
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
