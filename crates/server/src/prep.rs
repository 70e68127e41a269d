//! Turning a request into prompt tokens without letting one client stall the others: the body is
//! read under a size and a time limit, a prompt is refused by its byte length before it is
//! tokenized (a text longer than the context times the longest token cannot fit), and chat
//! templates are rendered and prompts tokenized on blocking threads, a few at a time, so the
//! async workers stay free to answer `/health` and stream tokens.

use std::error::Error as StdError;
use std::sync::Arc;

use axum::body::{Body, Bytes};
use axum::http::{header, HeaderMap};
use futures_util::StreamExt;
use quire_core::TokenId;
use quire_tokenizer::{ChatMessage, ChatOptions, TokenizerError};

use crate::api::GenRequest;
use crate::error::ApiError;
use crate::AppState;

/// An error and its causes as one line, each cause once (a wrapper often repeats its source).
pub fn cause_chain(e: &(dyn StdError + 'static)) -> String {
    let mut out = e.to_string();
    let mut src = e.source();
    while let Some(s) = src {
        let text = s.to_string();
        if !text.is_empty() && !out.contains(&text) {
            out.push_str(": ");
            out.push_str(&text);
        }
        src = s.source();
    }
    out
}

/// Reads the whole body: 413 past the size limit (before reading, when Content-Length says so),
/// 408 when it does not arrive within the body timeout, 400 when it is malformed (a bad chunk).
pub async fn read_body(st: &AppState, headers: &HeaderMap, body: Body) -> Result<Bytes, ApiError> {
    let limit = st.limits.max_body_bytes;
    let declared = headers
        .get(header::CONTENT_LENGTH)
        .and_then(|v| v.to_str().ok())
        .and_then(|v| v.trim().parse::<u64>().ok());
    if declared.is_some_and(|n| n > limit as u64) {
        return Err(ApiError::payload_too_large(limit));
    }
    let collect = async {
        let mut stream = body.into_data_stream();
        let mut buf = Vec::with_capacity(declared.unwrap_or(0) as usize);
        while let Some(chunk) = stream.next().await {
            let chunk = chunk.map_err(|e| {
                ApiError::bad_request(format!(
                    "the request body could not be read: {}",
                    cause_chain(&e)
                ))
            })?;
            if buf.len() + chunk.len() > limit {
                return Err(ApiError::payload_too_large(limit));
            }
            buf.extend_from_slice(&chunk);
        }
        Ok(Bytes::from(buf))
    };
    let timeout = st.limits.body_timeout;
    tokio::time::timeout(timeout, collect)
        .await
        .map_err(|_| ApiError::body_timeout(timeout.as_secs_f64()))?
}

/// Runs `f` on a blocking thread, at most `AppState::prep` of them at once.
async fn blocking<T: Send + 'static>(
    st: &AppState,
    f: impl FnOnce() -> T + Send + 'static,
) -> Result<T, ApiError> {
    let _permit = st
        .prep
        .acquire()
        .await
        .map_err(|_| ApiError::unavailable("the server is shutting down"))?;
    tokio::task::spawn_blocking(f)
        .await
        .map_err(|e| ApiError::internal(format!("preparing the prompt failed: {e}")))
}

fn too_long(st: &AppState, what: &str, len: usize, param: &str) -> ApiError {
    ApiError::bad_request(format!(
        "{what} is {len} bytes; this model's context of {} tokens holds at most {} bytes \
         ({} bytes for its longest token)",
        st.max_model_len, st.max_prompt_bytes, st.max_token_bytes
    ))
    .param(param)
    .code("context_length_exceeded")
}

/// The completions prompts as tokens (texts checked by length, then tokenized off the workers).
pub async fn completion_prompts(
    st: &Arc<AppState>,
    req: GenRequest,
) -> Result<Vec<Vec<TokenId>>, ApiError> {
    let texts: Vec<usize> = match &req.prompt {
        Some(crate::api::PromptInput::Text(t)) => vec![t.len()],
        Some(crate::api::PromptInput::Texts(v)) => v.iter().map(String::len).collect(),
        _ => Vec::new(),
    };
    if let Some(&len) = texts.iter().find(|&&l| l > st.max_prompt_bytes) {
        return Err(too_long(st, "the prompt", len, "prompt"));
    }
    let tok = st.tokenizer.clone();
    blocking(st, move || {
        req.prompts(|t| {
            tok.encode(t, true, true)
                .map_err(|e| ApiError::bad_request(format!("cannot tokenize the prompt: {e}")))
        })
    })
    .await?
}

/// The chat rendered with the template and tokenized (content checked by length first).
pub async fn chat_prompt(
    st: &Arc<AppState>,
    messages: Vec<ChatMessage>,
    extra: serde_json::Map<String, serde_json::Value>,
) -> Result<Vec<TokenId>, ApiError> {
    let content: usize = messages.iter().map(|m| m.content.len()).sum();
    if content > st.max_prompt_bytes {
        return Err(too_long(st, "the messages' content", content, "messages"));
    }
    let opts = ChatOptions {
        content_special: st.special_tokens_in_content,
        max_rendered_bytes: Some(st.max_prompt_bytes),
        extra,
    };
    let st2 = st.clone();
    let res = blocking(st, move || {
        quire_tokenizer::encode_chat_opts(&st2.tokenizer, &st2.chat_template, &messages, opts)
    })
    .await?;
    let prompt = res.map_err(|e| match e {
        TokenizerError::RenderedTooLong { len, .. } => {
            too_long(st, "the rendered chat", len, "messages")
        }
        TokenizerError::TemplateLimit { .. } => ApiError::bad_request(e.to_string())
            .param("messages")
            .code("chat_template_limit"),
        e => ApiError::bad_request(e.to_string()).param("messages"),
    })?;
    if prompt.is_empty() {
        return Err(ApiError::bad_request("the rendered chat is empty").param("messages"));
    }
    Ok(prompt)
}
