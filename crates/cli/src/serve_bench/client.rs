//! The HTTP side: one pooled hyper client, plain GETs (/v1/models, /metrics), the streaming
//! completion request with its SSE parsing and timing, and the Prometheus text parser.

use std::sync::atomic::{AtomicU64, Ordering};
use std::time::{Duration, Instant};

use anyhow::{anyhow, bail, Result};
use bytes::Bytes;
use http_body_util::{BodyExt, Full};
use hyper::{Method, Request, StatusCode};
use hyper_util::client::legacy::connect::HttpConnector;
use hyper_util::client::legacy::Client;
use hyper_util::rt::{TokioExecutor, TokioTimer};
use serde_json::{json, Value};

pub type HttpClient = Client<HttpConnector, Full<Bytes>>;

/// One client for the whole run: HTTP/1.1 keep-alive pool, no Nagle delay.
pub fn new_client(connect_timeout: Duration) -> HttpClient {
    let mut conn = HttpConnector::new();
    conn.set_nodelay(true);
    conn.set_connect_timeout(Some(connect_timeout));
    Client::builder(TokioExecutor::new())
        .pool_timer(TokioTimer::new())
        .pool_idle_timeout(Duration::from_secs(30))
        .build(conn)
}

/// Where requests go and how they are authorized.
#[derive(Clone, Debug)]
pub struct Target {
    /// Base URL without a trailing slash, e.g. `http://127.0.0.1:8080`.
    pub base: String,
    pub endpoint: String,
    pub api_key: Option<String>,
    pub model: String,
    pub chat: bool,
    pub ignore_eos: bool,
    /// Sent as `response_format` with every request (structured outputs).
    pub response_format: Option<Value>,
}

/// An error and all its causes on one line ("client error (Connect): tcp connect error: ...").
pub fn error_chain(e: &(dyn std::error::Error + 'static)) -> String {
    let mut s = e.to_string();
    let mut cur = e.source();
    while let Some(c) = cur {
        let m = c.to_string();
        if !s.contains(&m) {
            s.push_str(": ");
            s.push_str(&m);
        }
        cur = c.source();
    }
    s
}

fn request(
    method: Method,
    url: &str,
    api_key: Option<&str>,
    body: Option<Vec<u8>>,
) -> Result<Request<Full<Bytes>>> {
    let mut b = Request::builder().method(method).uri(url);
    if let Some(k) = api_key {
        b = b.header("authorization", format!("Bearer {k}"));
    }
    if body.is_some() {
        b = b.header("content-type", "application/json");
    }
    b.body(Full::new(Bytes::from(body.unwrap_or_default())))
        .map_err(|e| anyhow!("bad request URL {url}: {e}"))
}

/// GET `{base}{path}`: the status and the body as text, all within `timeout`.
pub async fn get_text(
    client: &HttpClient,
    base: &str,
    path: &str,
    api_key: Option<&str>,
    timeout: Duration,
) -> Result<(StatusCode, String)> {
    let url = format!("{base}{path}");
    let req = request(Method::GET, &url, api_key, None)?;
    let fut = async {
        let resp = client
            .request(req)
            .await
            .map_err(|e| anyhow!("{}", error_chain(&e)))?;
        let status = resp.status();
        let body = resp
            .into_body()
            .collect()
            .await
            .map_err(|e| anyhow!("reading the body: {}", error_chain(&e)))?
            .to_bytes();
        Ok((status, String::from_utf8_lossy(&body).into_owned()))
    };
    match tokio::time::timeout(timeout, fut).await {
        Ok(r) => r,
        Err(_) => bail!("no answer within {:.0} s", timeout.as_secs_f64()),
    }
}

/// Splits a byte stream into SSE `data:` payloads (one per line; other fields and comments are
/// ignored, `\r\n` is accepted).
#[derive(Default)]
pub struct SseParser {
    buf: Vec<u8>,
}

impl SseParser {
    pub fn push(&mut self, bytes: &[u8]) -> Vec<String> {
        self.buf.extend_from_slice(bytes);
        let mut out = Vec::new();
        while let Some(nl) = self.buf.iter().position(|&b| b == b'\n') {
            let line: Vec<u8> = self.buf.drain(..=nl).collect();
            let line = String::from_utf8_lossy(&line);
            let line = line.trim_end_matches(['\n', '\r']);
            if let Some(data) = line.strip_prefix("data:") {
                out.push(data.strip_prefix(' ').unwrap_or(data).to_string());
            }
        }
        out
    }

    /// What is left after the stream ended (a last line without its newline).
    pub fn finish(&mut self) -> Vec<String> {
        if self.buf.is_empty() {
            return Vec::new();
        }
        self.buf.push(b'\n');
        self.push(&[])
    }
}

/// The text of a streamed chunk: `choices[0].text` (completions) or `choices[0].delta.content`
/// (chat).
pub fn chunk_text(v: &Value) -> Option<&str> {
    let c = v.get("choices")?.get(0)?;
    c.get("text")
        .and_then(|t| t.as_str())
        .or_else(|| c.get("delta")?.get("content")?.as_str())
}

/// What one request measured. Times are seconds since the benchmark start.
#[derive(Debug, Clone, Default)]
pub struct Outcome {
    pub error: Option<String>,
    pub done_s: f64,
    pub ttft_ms: Option<f64>,
    /// Gaps between successive content chunks, ms.
    pub itl_ms: Vec<f64>,
    /// Arrival time of each content chunk.
    pub chunk_s: Vec<f64>,
    pub output_tokens: u64,
    pub prompt_tokens: Option<u64>,
    /// Whether `output_tokens` came from the server's `usage` (else: content chunks counted).
    pub usage: bool,
}

/// The JSON body of one request.
pub fn request_body(t: &Target, prompt: &str, max_tokens: usize) -> Value {
    let mut b = json!({
        "model": t.model,
        "max_tokens": max_tokens,
        "stream": true,
        "stream_options": {"include_usage": true},
        "temperature": 0,
    });
    if t.chat {
        b["messages"] = json!([{"role": "user", "content": prompt}]);
    } else {
        b["prompt"] = json!(prompt);
    }
    if t.ignore_eos {
        b["ignore_eos"] = json!(true);
    }
    if let Some(rf) = &t.response_format {
        b["response_format"] = rf.clone();
    }
    b
}

/// Sends one streaming request and times it. Never fails: errors end up in `Outcome::error`.
/// `t0` is the benchmark start; `live_tokens` counts content chunks as they arrive (progress bar).
pub async fn stream_request(
    client: &HttpClient,
    t: &Target,
    prompt: &str,
    max_tokens: usize,
    t0: Instant,
    timeout: Duration,
    live_tokens: &AtomicU64,
) -> Outcome {
    let send = Instant::now();
    let mut o = Outcome::default();
    let res = tokio::time::timeout(
        timeout,
        stream_inner(client, t, prompt, max_tokens, send, t0, &mut o, live_tokens),
    )
    .await;
    let now = Instant::now();
    o.done_s = (now - t0).as_secs_f64();
    match res {
        Ok(Ok(())) => {
            if !o.usage {
                o.output_tokens = o.chunk_s.len() as u64;
            }
        }
        Ok(Err(e)) => o.error = Some(format!("{e:#}")),
        Err(_) => {
            o.error = Some(format!(
                "timed out after {:.0} s (--request-timeout)",
                timeout.as_secs_f64()
            ))
        }
    }
    o
}

#[allow(clippy::too_many_arguments)]
async fn stream_inner(
    client: &HttpClient,
    t: &Target,
    prompt: &str,
    max_tokens: usize,
    send: Instant,
    t0: Instant,
    o: &mut Outcome,
    live_tokens: &AtomicU64,
) -> Result<()> {
    let body = serde_json::to_vec(&request_body(t, prompt, max_tokens))?;
    let url = format!("{}{}", t.base, t.endpoint);
    let req = request(Method::POST, &url, t.api_key.as_deref(), Some(body))?;
    let resp = client
        .request(req)
        .await
        .map_err(|e| anyhow!("{}", error_chain(&e)))?;
    let status = resp.status();
    let mut body = resp.into_body();
    if !status.is_success() {
        let text = body
            .collect()
            .await
            .map(|b| String::from_utf8_lossy(&b.to_bytes()).into_owned())
            .unwrap_or_default();
        let text: String = text.split_whitespace().collect::<Vec<_>>().join(" ");
        let text: String = text.chars().take(300).collect();
        if text.is_empty() {
            bail!("HTTP {status}");
        }
        bail!("HTTP {status}: {text}");
    }
    let mut sse = SseParser::default();
    let mut last: Option<Instant> = None;
    let (mut done, mut ended) = (false, false);
    loop {
        let payloads = match body.frame().await {
            Some(Ok(frame)) => match frame.into_data() {
                Ok(data) => sse.push(&data),
                Err(_) => continue, // trailers
            },
            Some(Err(e)) => bail!("stream broken: {}", error_chain(&e)),
            None => {
                ended = true;
                sse.finish()
            }
        };
        let now = Instant::now();
        for p in payloads {
            let p = p.trim();
            if p == "[DONE]" {
                done = true;
                break;
            }
            if p.is_empty() {
                continue;
            }
            let v: Value = serde_json::from_str(p)
                .map_err(|e| anyhow!("bad stream chunk ({e}): {}", clip(p)))?;
            if let Some(err) = v.get("error") {
                let msg = err
                    .get("message")
                    .and_then(|m| m.as_str())
                    .map(str::to_string)
                    .unwrap_or_else(|| err.to_string());
                bail!("error in stream: {msg}");
            }
            if let Some(u) = v.get("usage").filter(|u| u.is_object()) {
                if let Some(n) = u.get("completion_tokens").and_then(|n| n.as_u64()) {
                    o.output_tokens = n;
                    o.usage = true;
                }
                if let Some(n) = u.get("prompt_tokens").and_then(|n| n.as_u64()) {
                    o.prompt_tokens = Some(n);
                }
            }
            if chunk_text(&v).is_some_and(|s| !s.is_empty()) {
                match last {
                    None => o.ttft_ms = Some((now - send).as_secs_f64() * 1e3),
                    Some(prev) => o.itl_ms.push((now - prev).as_secs_f64() * 1e3),
                }
                last = Some(now);
                o.chunk_s.push((now - t0).as_secs_f64());
                live_tokens.fetch_add(1, Ordering::Relaxed);
            }
        }
        if done {
            return Ok(());
        }
        if ended {
            // Ended cleanly without [DONE]: accepted when something was streamed.
            if o.chunk_s.is_empty() && !o.usage {
                bail!("stream ended without any content or [DONE]");
            }
            return Ok(());
        }
    }
}

fn clip(s: &str) -> String {
    s.chars().take(200).collect()
}

/// Counter sums from Prometheus text exposition: `name{labels} value [timestamp]` lines,
/// `#` lines skipped, values of one name summed over its label sets.
pub fn prometheus_sum(text: &str, name: &str) -> Option<f64> {
    let mut sum = None;
    for line in text.lines() {
        let line = line.trim();
        if line.is_empty() || line.starts_with('#') {
            continue;
        }
        let (metric, rest) = match line.find(['{', ' ', '\t']) {
            Some(i) => line.split_at(i),
            None => continue,
        };
        if metric != name {
            continue;
        }
        let rest = match rest.strip_prefix('{') {
            Some(r) => match r.rfind('}') {
                Some(j) => &r[j + 1..],
                None => continue,
            },
            None => rest,
        };
        if let Some(v) = rest
            .split_whitespace()
            .next()
            .and_then(|v| v.parse::<f64>().ok())
        {
            *sum.get_or_insert(0.0) += v;
        }
    }
    sum
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn sse_lines_split_across_reads() {
        let mut p = SseParser::default();
        assert!(p.push(b"data: {\"a\":").is_empty());
        assert_eq!(p.push(b"1}\r\n\r\nda"), vec!["{\"a\":1}"]);
        assert_eq!(
            p.push(b"ta:[DONE]\n\n: comment\nevent: x\n"),
            vec!["[DONE]"]
        );
        assert!(p.push(b"data: tail").is_empty());
        assert_eq!(p.finish(), vec!["tail"]);
    }

    #[test]
    fn chunk_text_for_both_endpoints() {
        let c: Value = serde_json::from_str(r#"{"choices":[{"text":"hi","index":0}]}"#).unwrap();
        assert_eq!(chunk_text(&c), Some("hi"));
        let c: Value = serde_json::from_str(r#"{"choices":[{"delta":{"content":"yo"}}]}"#).unwrap();
        assert_eq!(chunk_text(&c), Some("yo"));
        let c: Value = serde_json::from_str(r#"{"choices":[],"usage":{}}"#).unwrap();
        assert_eq!(chunk_text(&c), None);
    }

    #[test]
    fn prometheus_sums_over_labels() {
        let t = "# HELP quire_requests_total Requests.\n# TYPE quire_requests_total counter\n\
                 quire_requests_total{finish_reason=\"stop\"} 3\n\
                 quire_requests_total{finish_reason=\"length\",x=\"a}b\"} 4 1700000000\n\
                 quire_requests_total_created 99\n\
                 quire_generation_tokens_total 120\n\
                 vllm:prompt_tokens_total{model_name=\"m\"} 1.5e3\n";
        assert_eq!(prometheus_sum(t, "quire_requests_total"), Some(7.0));
        assert_eq!(
            prometheus_sum(t, "quire_generation_tokens_total"),
            Some(120.0)
        );
        assert_eq!(prometheus_sum(t, "vllm:prompt_tokens_total"), Some(1500.0));
        assert_eq!(prometheus_sum(t, "quire_prompt_tokens_total"), None);
    }

    #[test]
    fn body_has_the_extensions() {
        let t = Target {
            base: "http://x".into(),
            endpoint: "/v1/chat/completions".into(),
            api_key: None,
            model: "m".into(),
            chat: true,
            ignore_eos: false,
            response_format: None,
        };
        let b = request_body(&t, "hello", 5);
        assert_eq!(b["messages"][0]["content"], "hello");
        assert_eq!(b["stream_options"]["include_usage"], true);
        assert!(b.get("ignore_eos").is_none() && b.get("prompt").is_none());
        assert!(b.get("response_format").is_none());
        let rf = json!({"type": "json_schema", "json_schema": {"name": "x", "schema": {}}});
        let t = Target {
            response_format: Some(rf.clone()),
            ..t
        };
        assert_eq!(request_body(&t, "hello", 5)["response_format"], rf);
    }
}
