//! The generation endpoints: a checked request becomes one engine request per choice (`n` ×
//! prompts); outputs come back on per-choice channels and are merged into one response, or into
//! server-sent events in OpenAI's chunk format ending with `data: [DONE]`. Dropping the response
//! (the client went away) drops the channels, and the engine thread then aborts the requests.

use std::convert::Infallible;
use std::sync::Arc;
use std::time::Instant;

use axum::response::sse::{Event as SseEvent, Sse};
use axum::response::{IntoResponse, Response};
use futures_util::stream::{self, BoxStream, SelectAll, StreamExt};
use quire_core::{FinishReason, TokenId};
use quire_engine::{RequestOutput, Sampled};
use serde_json::{json, Value};
use tokio::sync::{mpsc, oneshot};

use crate::api::{CommonOptions, LogprobsMode};
use crate::engine_loop::{AddRequest, Cmd, Event};
use crate::error::ApiError;
use crate::tools::{self, ToolCall};
use crate::AppState;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Kind {
    Completion,
    Chat,
}

/// One choice's accumulated result.
#[derive(Default)]
struct Choice {
    text: String,
    finish: Option<FinishReason>,
    completion_tokens: usize,
    /// Completion logprobs: running text offset of the next token.
    offset: usize,
    logprobs: Vec<Value>,
    error: Option<String>,
    /// Chat with tools, streamed: bytes of `text` sent as content so far.
    streamed: usize,
}

/// Turns prompts into engine requests and answers (streamed or whole).
pub async fn run(
    st: Arc<AppState>,
    kind: Kind,
    prompts: Vec<Vec<TokenId>>,
    opts: CommonOptions,
    arrival: Instant,
) -> Result<Response, ApiError> {
    if st.is_draining() {
        return Err(ApiError::unavailable("the server is shutting down"));
    }
    let mut receivers = Vec::new();
    let mut requests = Vec::new();
    let mut prompt_tokens = Vec::new();
    for prompt in &prompts {
        let max_tokens = resolve_max_tokens(&st, kind, prompt.len(), opts.max_tokens)?;
        for c in 0..opts.n {
            let mut params = opts.params.clone();
            params.max_tokens = max_tokens;
            // Distinct choices of one request draw from distinct streams.
            params.seed = params.seed.map(|s| s.wrapping_add(c as u64));
            let (tx, rx) = mpsc::unbounded_channel();
            requests.push(AddRequest {
                prompt: prompt.clone(),
                params,
                arrival,
                events: tx,
            });
            receivers.push(rx);
        }
        prompt_tokens.push(prompt.len());
    }
    // One command for the whole fan-out: the engine thread admits all of it or none.
    let (reply, answer) = oneshot::channel();
    st.engine
        .send(Cmd::Add { requests, reply })
        .map_err(|_| ApiError::unavailable("the engine has stopped"))?;
    answer
        .await
        .map_err(|_| ApiError::unavailable("the engine has stopped"))??;
    let id = st.new_id(kind);
    if opts.stream {
        Ok(stream_response(st, kind, id, receivers, prompt_tokens, opts).into_response())
    } else {
        whole_response(st, kind, id, receivers, prompt_tokens, opts).await
    }
}

fn resolve_max_tokens(
    st: &AppState,
    kind: Kind,
    prompt_len: usize,
    asked: Option<usize>,
) -> Result<usize, ApiError> {
    let ctx = st.max_model_len;
    if prompt_len >= ctx {
        return Err(ApiError::bad_request(format!(
            "this model's maximum context length is {ctx} tokens, and the prompt has {prompt_len}"
        ))
        .param(if kind == Kind::Chat {
            "messages"
        } else {
            "prompt"
        })
        .code("context_length_exceeded"));
    }
    let room = ctx - prompt_len;
    match asked {
        Some(m) if m > room => Err(ApiError::bad_request(format!(
            "this model's maximum context length is {ctx} tokens; the prompt has {prompt_len} \
             and max_tokens asks for {m} more (at most {room})"
        ))
        .param("max_tokens")
        .code("context_length_exceeded")),
        Some(m) => Ok(m),
        // OpenAI's legacy completions default to 16 tokens; chat runs to the context's end.
        None if kind == Kind::Completion => Ok(16.min(room)),
        None => Ok(room),
    }
}

fn finish_str(f: Option<FinishReason>) -> Value {
    f.map_or(Value::Null, |f| Value::from(f.as_str()))
}

/// A finished chat choice's content and tool calls (read back from its text when the request
/// had tools), and its finish reason: `tool_calls` when calls ended the reply.
fn chat_reply(opts: &CommonOptions, c: &Choice) -> (String, Vec<ToolCall>, Value) {
    let Some(spec) = &opts.tools else {
        return (c.text.clone(), Vec::new(), finish_str(c.finish));
    };
    let (content, calls) = spec.extract(&c.text);
    let finish = if !calls.is_empty() && c.finish == Some(FinishReason::Stop) {
        Value::from("tool_calls")
    } else {
        finish_str(c.finish)
    };
    (content, calls, finish)
}

fn chat_message(opts: &CommonOptions, id: &str, index: usize, c: &Choice) -> (Value, Value) {
    let (content, calls, finish) = chat_reply(opts, c);
    if calls.is_empty() {
        return (json!({"role": "assistant", "content": content}), finish);
    }
    let content = if content.trim().is_empty() {
        Value::Null
    } else {
        Value::from(content)
    };
    let message = json!({
        "role": "assistant",
        "content": content,
        "tool_calls": tools::calls_json(&calls, id, index, false),
    });
    (message, finish)
}

impl Choice {
    fn absorb(&mut self, st: &AppState, mode: LogprobsMode, o: &RequestOutput) -> Option<Value> {
        self.text.push_str(&o.text_delta);
        if o.finish_reason.is_some() {
            self.finish = o.finish_reason;
        }
        // An abort notice carries no counts; keep what the last output said.
        if o.num_prompt_tokens > 0 {
            self.completion_tokens = o.num_output_tokens;
        }
        let lp = logprobs_json(st, mode, &o.tokens, &mut self.offset);
        if let Some(l) = &lp {
            self.logprobs.push(l.clone());
        }
        lp
    }
}

fn token_text(st: &AppState, t: TokenId) -> (String, Vec<u8>) {
    let bytes = st.tokenizer.token_bytes(t).unwrap_or_default();
    (String::from_utf8_lossy(&bytes).into_owned(), bytes)
}

/// Logprobs of `tokens` in the endpoint's shape; `None` when not asked for.
fn logprobs_json(
    st: &AppState,
    mode: LogprobsMode,
    tokens: &[Sampled],
    offset: &mut usize,
) -> Option<Value> {
    match mode {
        LogprobsMode::None => None,
        LogprobsMode::Completion(k) => {
            let mut toks = Vec::new();
            let mut lps = Vec::new();
            let mut tops = Vec::new();
            let mut offs = Vec::new();
            for s in tokens {
                let (text, _) = token_text(st, s.token);
                offs.push(*offset);
                *offset += text.len();
                toks.push(Value::from(text));
                lps.push(json!(s.logprob));
                let mut m = serde_json::Map::new();
                for (t, lp) in s.top.iter().take(k) {
                    m.insert(token_text(st, *t).0, json!(lp));
                }
                tops.push(Value::Object(m));
            }
            Some(json!({
                "tokens": toks,
                "token_logprobs": lps,
                "top_logprobs": tops,
                "text_offset": offs,
            }))
        }
        LogprobsMode::Chat(k) => {
            let content: Vec<Value> = tokens
                .iter()
                .map(|s| {
                    let (text, bytes) = token_text(st, s.token);
                    let top: Vec<Value> = s
                        .top
                        .iter()
                        .take(k)
                        .map(|(t, lp)| {
                            let (tt, tb) = token_text(st, *t);
                            json!({"token": tt, "logprob": lp, "bytes": tb})
                        })
                        .collect();
                    json!({"token": text, "logprob": s.logprob, "bytes": bytes, "top_logprobs": top})
                })
                .collect();
            Some(json!({ "content": content, "refusal": null }))
        }
    }
}

/// Joins per-request logprob pieces into one object of the same shape.
fn merge_logprobs(mode: LogprobsMode, parts: &[Value]) -> Value {
    match mode {
        LogprobsMode::None => Value::Null,
        LogprobsMode::Chat(_) => {
            let content: Vec<Value> = parts
                .iter()
                .flat_map(|p| p["content"].as_array().cloned().unwrap_or_default())
                .collect();
            json!({ "content": content, "refusal": null })
        }
        LogprobsMode::Completion(_) => {
            let mut merged =
                json!({"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []});
            for key in ["tokens", "token_logprobs", "top_logprobs", "text_offset"] {
                let all: Vec<Value> = parts
                    .iter()
                    .flat_map(|p| p[key].as_array().cloned().unwrap_or_default())
                    .collect();
                merged[key] = Value::Array(all);
            }
            merged
        }
    }
}

/// `prompt_lens`: one entry per prompt (its `n` choices share it, as OpenAI counts).
fn usage_json(choices: &[Choice], prompt_lens: &[usize]) -> Value {
    let prompt: usize = prompt_lens.iter().sum();
    let completion: usize = choices.iter().map(|c| c.completion_tokens).sum();
    json!({
        "prompt_tokens": prompt,
        "completion_tokens": completion,
        "total_tokens": prompt + completion,
    })
}

fn envelope(st: &AppState, kind: Kind, id: &str, stream: bool) -> serde_json::Map<String, Value> {
    let object = match (kind, stream) {
        (Kind::Completion, _) => "text_completion",
        (Kind::Chat, false) => "chat.completion",
        (Kind::Chat, true) => "chat.completion.chunk",
    };
    let mut m = serde_json::Map::new();
    m.insert("id".into(), Value::from(id));
    m.insert("object".into(), Value::from(object));
    m.insert("created".into(), Value::from(st.created));
    m.insert("model".into(), Value::from(st.model_id.clone()));
    m.insert(
        "system_fingerprint".into(),
        Value::from(st.fingerprint.clone()),
    );
    m
}

/// The choices' channels as one stream of (choice index, event).
fn merge(
    receivers: Vec<mpsc::UnboundedReceiver<Event>>,
) -> SelectAll<BoxStream<'static, (usize, Event)>> {
    stream::select_all(receivers.into_iter().enumerate().map(|(index, rx)| {
        stream::unfold(rx, move |mut rx| async move {
            rx.recv().await.map(|e| ((index, e), rx))
        })
        .boxed()
    }))
}

async fn whole_response(
    st: Arc<AppState>,
    kind: Kind,
    id: String,
    receivers: Vec<mpsc::UnboundedReceiver<Event>>,
    prompt_tokens: Vec<usize>,
    opts: CommonOptions,
) -> Result<Response, ApiError> {
    let mut choices: Vec<Choice> = (0..receivers.len()).map(|_| Choice::default()).collect();
    let mut merged = merge(receivers);
    while let Some((i, ev)) = merged.next().await {
        match ev {
            Event::Output(o) => {
                choices[i].absorb(&st, opts.logprobs, &o);
            }
            Event::Error(e) => choices[i].error = Some(e),
        }
    }
    if let Some(e) = choices.iter().find_map(|c| c.error.clone()) {
        return Err(ApiError::internal(e));
    }
    let mut body = envelope(&st, kind, &id, false);
    let list: Vec<Value> = choices
        .iter()
        .enumerate()
        .map(|(i, c)| {
            let logprobs = merge_logprobs(opts.logprobs, &c.logprobs);
            match kind {
                Kind::Completion => json!({
                    "index": i, "text": c.text, "logprobs": logprobs,
                    "finish_reason": finish_str(c.finish),
                }),
                Kind::Chat => {
                    let (message, finish) = chat_message(&opts, &id, i, c);
                    json!({
                        "index": i,
                        "message": message,
                        "logprobs": logprobs,
                        "finish_reason": finish,
                    })
                }
            }
        })
        .collect();
    body.insert("choices".into(), Value::Array(list));
    body.insert("usage".into(), usage_json(&choices, &prompt_tokens));
    Ok(axum::Json(Value::Object(body)).into_response())
}

struct StreamState {
    st: Arc<AppState>,
    kind: Kind,
    id: String,
    merged: SelectAll<BoxStream<'static, (usize, Event)>>,
    choices: Vec<Choice>,
    prompt_tokens: Vec<usize>,
    opts: CommonOptions,
    done: bool,
}

fn sse_json(v: Value) -> SseEvent {
    SseEvent::default().data(v.to_string())
}

impl StreamState {
    fn chunk(&self, choices: Vec<Value>) -> Value {
        let mut m = envelope(&self.st, self.kind, &self.id, true);
        m.insert("choices".into(), Value::Array(choices));
        if self.opts.include_usage {
            m.insert("usage".into(), Value::Null);
        }
        Value::Object(m)
    }

    fn on_event(&mut self, i: usize, ev: Event) -> Vec<SseEvent> {
        let o = match ev {
            Event::Output(o) => o,
            Event::Error(e) => {
                self.choices[i].error = Some(e.clone());
                self.choices[i].finish = Some(FinishReason::Abort);
                return vec![sse_json(ApiError::internal(e).body())];
            }
        };
        let lp = self.choices[i].absorb(&self.st, self.opts.logprobs, &o);
        if o.text_delta.is_empty() && o.finish_reason.is_none() && lp.is_none() {
            return Vec::new();
        }
        let lp = lp.unwrap_or(Value::Null);
        let c = match self.kind {
            Kind::Completion => json!({
                "index": i, "text": o.text_delta, "logprobs": lp,
                "finish_reason": finish_str(o.finish_reason),
            }),
            Kind::Chat if self.opts.tools.is_some() => return self.tool_chunks(i, lp),
            Kind::Chat => {
                let delta = if o.text_delta.is_empty() {
                    json!({})
                } else {
                    json!({"content": o.text_delta})
                };
                json!({"index": i, "delta": delta, "logprobs": lp,
                       "finish_reason": finish_str(o.finish_reason)})
            }
        };
        vec![sse_json(self.chunk(vec![c]))]
    }

    /// A chat choice with tools, streamed: content goes out as long as it cannot be the start of
    /// a call (and without trailing whitespace, which a call after it would trim); at the end the
    /// rest of the content, then every call in one `tool_calls` delta, so the chunks assemble to
    /// the non-streamed message.
    fn tool_chunks(&mut self, i: usize, lp: Value) -> Vec<SseEvent> {
        let spec = self.opts.tools.as_ref().expect("checked by the caller");
        let c = &self.choices[i];
        let mut out = Vec::new();
        let delta_of = |delta: Value, lp: Value, finish: Value| json!({"index": i, "delta": delta, "logprobs": lp, "finish_reason": finish});
        if c.finish.is_none() {
            let safe = spec.safe_prefix(&c.text);
            let delta = if safe > c.streamed {
                json!({"content": c.text[c.streamed..safe]})
            } else {
                json!({})
            };
            if safe > c.streamed || !lp.is_null() {
                out.push(delta_of(delta, lp, Value::Null));
            }
            self.choices[i].streamed = safe.max(c.streamed);
        } else {
            let (content, calls, finish) = chat_reply(&self.opts, c);
            let sent = &c.text[..c.streamed];
            let rest = content.strip_prefix(sent).unwrap_or_default();
            let mut delta = serde_json::Map::new();
            if !rest.is_empty() {
                delta.insert("content".into(), Value::from(rest));
            }
            if !calls.is_empty() {
                delta.insert(
                    "tool_calls".into(),
                    tools::calls_json(&calls, &self.id, i, true),
                );
            }
            out.push(delta_of(Value::Object(delta), lp, finish));
        }
        out.into_iter()
            .map(|c| sse_json(self.chunk(vec![c])))
            .collect()
    }

    /// The usage chunk (when asked for) and `[DONE]`.
    fn finale(&mut self) -> Vec<SseEvent> {
        self.done = true;
        let mut out = Vec::new();
        if self.opts.include_usage {
            let mut m = envelope(&self.st, self.kind, &self.id, true);
            m.insert("choices".into(), json!([]));
            m.insert(
                "usage".into(),
                usage_json(&self.choices, &self.prompt_tokens),
            );
            out.push(sse_json(Value::Object(m)));
        }
        out.push(SseEvent::default().data("[DONE]"));
        out
    }
}

fn stream_response(
    st: Arc<AppState>,
    kind: Kind,
    id: String,
    receivers: Vec<mpsc::UnboundedReceiver<Event>>,
    prompt_tokens: Vec<usize>,
    opts: CommonOptions,
) -> impl IntoResponse {
    let n = receivers.len();
    let state = StreamState {
        st,
        kind,
        id,
        merged: merge(receivers),
        choices: (0..n).map(|_| Choice::default()).collect(),
        prompt_tokens,
        opts,
        done: false,
    };
    // Chat streams open each choice with the assistant's role.
    let opening: Vec<SseEvent> = if kind == Kind::Chat {
        (0..n)
            .map(|i| {
                sse_json(state.chunk(vec![json!({
                    "index": i, "delta": {"role": "assistant", "content": ""},
                    "logprobs": null, "finish_reason": null,
                })]))
            })
            .collect()
    } else {
        Vec::new()
    };
    let body = stream::unfold(state, |mut s| async move {
        if s.done {
            return None;
        }
        let events = match s.merged.next().await {
            Some((i, ev)) => {
                let mut evs = s.on_event(i, ev);
                if s.choices.iter().all(|c| c.finish.is_some()) {
                    evs.extend(s.finale());
                }
                evs
            }
            // Every channel closed: the engine is gone or all choices ended.
            None => s.finale(),
        };
        Some((events, s))
    });
    let events = stream::iter(opening)
        .chain(body.flat_map(stream::iter))
        .map(Ok::<_, Infallible>);
    Sse::new(events)
}
