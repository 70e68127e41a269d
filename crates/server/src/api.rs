//! Request bodies of `/v1/completions` and `/v1/chat/completions`, and their checks. A body is
//! parsed in two passes: JSON syntax first (a malformed body is a 400 naming the position), then
//! the typed request (a wrong type is a 400 whose `param` is the field's path). Unknown fields are
//! ignored, as vLLM and llama.cpp do; features quire does not have are refused by name.

use quire_core::{Constraint, SamplingParams, TokenId, MAX_TOP_LOGPROBS};
use serde::Deserialize;
use serde_json::Value;

use crate::error::ApiError;

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum PromptInput {
    Text(String),
    Texts(Vec<String>),
    Tokens(Vec<u32>),
    TokenBatches(Vec<Vec<u32>>),
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum StopField {
    One(String),
    Many(Vec<String>),
}

#[derive(Debug, Deserialize)]
pub struct StreamOptions {
    pub include_usage: Option<bool>,
}

#[derive(Debug, Deserialize)]
pub struct ContentPart {
    #[serde(rename = "type")]
    pub kind: String,
    pub text: Option<String>,
}

#[derive(Debug, Deserialize)]
#[serde(untagged)]
pub enum ContentInput {
    Text(String),
    Parts(Vec<ContentPart>),
}

#[derive(Debug, Deserialize)]
pub struct MessageInput {
    pub role: String,
    pub content: Option<ContentInput>,
    /// An assistant turn's calls (OpenAI's shape, arguments as a JSON string).
    pub tool_calls: Option<Vec<Value>>,
    /// A `tool` turn: which call it answers.
    pub tool_call_id: Option<String>,
    pub name: Option<String>,
}

/// The fields of both endpoints; each endpoint reads its own.
#[derive(Debug, Default, Deserialize)]
pub struct GenRequest {
    pub model: Option<String>,
    pub prompt: Option<PromptInput>,
    pub messages: Option<Vec<MessageInput>>,
    pub max_tokens: Option<i64>,
    pub max_completion_tokens: Option<i64>,
    pub temperature: Option<f32>,
    pub top_p: Option<f32>,
    pub top_k: Option<i64>,
    pub min_p: Option<f32>,
    pub presence_penalty: Option<f32>,
    pub frequency_penalty: Option<f32>,
    pub repetition_penalty: Option<f32>,
    pub stop: Option<StopField>,
    pub seed: Option<i64>,
    pub stream: Option<bool>,
    pub stream_options: Option<StreamOptions>,
    /// Completions: how many alternatives (an integer). Chat: whether to return logprobs (a bool).
    pub logprobs: Option<Value>,
    pub top_logprobs: Option<i64>,
    pub n: Option<i64>,
    pub best_of: Option<i64>,
    pub echo: Option<bool>,
    pub ignore_eos: Option<bool>,
    /// Extra field: `false` opts this request out of speculative decoding (output unchanged).
    pub speculative: Option<bool>,
    pub suffix: Option<String>,
    pub logit_bias: Option<serde_json::Map<String, Value>>,
    pub tools: Option<Vec<Value>>,
    pub tool_choice: Option<Value>,
    pub parallel_tool_calls: Option<bool>,
    pub response_format: Option<Value>,
    /// Extra field (as vLLM's `guided_regex`): the output matches this regular expression.
    pub regex: Option<String>,
    /// Extra field: the output follows this grammar, in llguidance's Lark-like syntax (not
    /// llama.cpp's GBNF; see the README).
    pub grammar: Option<String>,
    pub user: Option<String>,
}

/// Most stop strings per request. OpenAI allows 4; vLLM and llama.cpp set no limit, so quire keeps
/// the 16 it has always allowed: with the length cap below the engine thread's work per token for
/// them stays small.
pub const MAX_STOP_STRINGS: usize = 16;

/// Longest stop string, in UTF-8 bytes. Stop strings are matched on the engine thread once per
/// token against the text's tail of this length; real ones ("\n\nUser:", "</answer>") are short.
pub const MAX_STOP_BYTES: usize = 256;

/// Parses a body: 400 on malformed JSON, on a non-object, or on a field of the wrong type.
pub fn parse_body(body: &[u8]) -> Result<GenRequest, ApiError> {
    let value: Value = serde_json::from_slice(body)
        .map_err(|e| ApiError::bad_request(format!("the body is not valid JSON: {e}")))?;
    if !value.is_object() {
        return Err(ApiError::bad_request("the body must be a JSON object"));
    }
    serde_path_to_error::deserialize(value).map_err(|e| {
        let path = e.path().to_string();
        ApiError::bad_request(format!("invalid value for `{path}`: {}", e.inner())).param(path)
    })
}

/// Which flavour of logprobs a request asked for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum LogprobsMode {
    None,
    /// `/v1/completions`: `tokens`, `token_logprobs`, `top_logprobs`, `text_offset`.
    Completion(usize),
    /// `/v1/chat/completions`: `content: [{token, logprob, bytes, top_logprobs}]`.
    Chat(usize),
}

/// Everything but the prompt, checked.
#[derive(Debug, Clone)]
pub struct CommonOptions {
    pub params: SamplingParams,
    /// `None`: the endpoint's default.
    pub max_tokens: Option<usize>,
    pub n: usize,
    pub stream: bool,
    pub include_usage: bool,
    pub logprobs: LogprobsMode,
    /// Chat with `tools`: how calls are asked for and read back (set by the chat endpoint).
    pub tools: Option<crate::tools::ToolSpec>,
}

fn range_f32(v: Option<f32>, name: &str, lo: f32, hi: f32) -> Result<Option<f32>, ApiError> {
    match v {
        Some(x) if !(x.is_finite() && x >= lo && x <= hi) => Err(ApiError::bad_request(format!(
            "`{name}` must be between {lo} and {hi}, got {x}"
        ))
        .param(name)),
        _ => Ok(v),
    }
}

fn unsupported(name: &str, why: &str) -> ApiError {
    ApiError::bad_request(format!("`{name}` is not supported: {why}")).param(name)
}

impl GenRequest {
    /// The structured-output request, if any: `response_format` (`text`, `json_object`, or
    /// `json_schema` with its `schema`), `regex` or `grammar` — at most one of them. The grammar
    /// itself is compiled (and refused, naming the field) when the engine admits the request.
    fn constraint(&self) -> Result<Option<Constraint>, ApiError> {
        let bad = |param: &str, why: String| ApiError::bad_request(why).param(param);
        let format = match &self.response_format {
            None | Some(Value::Null) => None,
            Some(f) => match f.get("type").and_then(Value::as_str) {
                Some("text") => None,
                Some("json_object") => Some(Constraint::JsonObject),
                Some("json_schema") => {
                    let Some(spec) = f.get("json_schema").filter(|v| v.is_object()) else {
                        return Err(bad(
                            "response_format.json_schema",
                            "`response_format.json_schema` must be an object with a `schema`".into(),
                        ));
                    };
                    match spec.get("schema") {
                        Some(schema) if schema.is_object() || schema.is_boolean() => {
                            Some(Constraint::JsonSchema(schema.to_string()))
                        }
                        // OpenAI lets `schema` be left out: any JSON object then.
                        None => Some(Constraint::JsonObject),
                        Some(_) => {
                            return Err(bad(
                                "response_format.json_schema.schema",
                                "`response_format.json_schema.schema` must be a JSON Schema object".into(),
                            ))
                        }
                    }
                }
                other => {
                    return Err(bad(
                        "response_format.type",
                        format!(
                            "`response_format.type` must be \"text\", \"json_object\" or \"json_schema\", got {}",
                            other.map_or("nothing".to_string(), |t| format!("{t:?}"))
                        ),
                    ))
                }
            },
        };
        let given = [
            format.map(|c| ("response_format", c)),
            self.regex.clone().map(|r| ("regex", Constraint::Regex(r))),
            self.grammar
                .clone()
                .map(|g| ("grammar", Constraint::Lark(g))),
        ];
        let mut given = given.into_iter().flatten();
        let first = given.next();
        if let Some((name, _)) = given.next() {
            return Err(bad(
                name,
                "give at most one of `response_format` (JSON), `regex` and `grammar`".into(),
            ));
        }
        Ok(first.map(|(_, c)| c))
    }

    /// Checks the fields shared by both endpoints; `chat` selects the logprobs flavour.
    pub fn common(&self, chat: bool) -> Result<CommonOptions, ApiError> {
        let mut p = SamplingParams::default();
        if let Some(t) = range_f32(self.temperature, "temperature", 0.0, 100.0)? {
            p.temperature = t;
        }
        if let Some(v) = self.top_p {
            if !(v > 0.0 && v <= 1.0) {
                return Err(
                    ApiError::bad_request(format!("`top_p` must be in (0, 1], got {v}"))
                        .param("top_p"),
                );
            }
            p.top_p = v;
        }
        match self.top_k {
            None | Some(-1) | Some(0) => {}
            Some(k) if k > 0 => p.top_k = k as usize,
            Some(k) => {
                return Err(ApiError::bad_request(format!(
                    "`top_k` must be -1 (off) or positive, got {k}"
                ))
                .param("top_k"))
            }
        }
        if let Some(v) = range_f32(self.min_p, "min_p", 0.0, 1.0)? {
            p.min_p = v;
        }
        if let Some(v) = range_f32(self.presence_penalty, "presence_penalty", -2.0, 2.0)? {
            p.presence_penalty = v;
        }
        if let Some(v) = range_f32(self.frequency_penalty, "frequency_penalty", -2.0, 2.0)? {
            p.frequency_penalty = v;
        }
        if let Some(v) = range_f32(self.repetition_penalty, "repetition_penalty", 0.01, 100.0)? {
            p.repetition_penalty = v;
        }
        p.seed = self.seed.map(|s| s as u64);
        p.ignore_eos = self.ignore_eos.unwrap_or(false);
        p.speculative = self.speculative.unwrap_or(true);
        p.stop = match &self.stop {
            None => Vec::new(),
            Some(StopField::One(s)) => vec![s.clone()],
            Some(StopField::Many(v)) => v.clone(),
        };
        p.stop.retain(|s| !s.is_empty());
        if p.stop.len() > MAX_STOP_STRINGS {
            return Err(ApiError::bad_request(format!(
                "`stop` takes at most {MAX_STOP_STRINGS} strings, got {}",
                p.stop.len()
            ))
            .param("stop"));
        }
        if let Some(long) = p.stop.iter().find(|s| s.len() > MAX_STOP_BYTES) {
            return Err(ApiError::bad_request(format!(
                "each `stop` string may be at most {MAX_STOP_BYTES} bytes, got one of {}",
                long.len()
            ))
            .param("stop"));
        }
        let max_tokens = match (self.max_tokens, self.max_completion_tokens) {
            (Some(_), Some(_)) if chat => {
                return Err(ApiError::bad_request(
                    "give `max_tokens` or `max_completion_tokens`, not both",
                )
                .param("max_completion_tokens"))
            }
            (a, b) => {
                let (name, v) = if b.is_some() {
                    ("max_completion_tokens", b)
                } else {
                    ("max_tokens", a)
                };
                match v {
                    None => None,
                    Some(v) if v >= 1 => Some(v as usize),
                    Some(v) => {
                        return Err(ApiError::bad_request(format!(
                            "`{name}` must be at least 1, got {v}"
                        ))
                        .param(name))
                    }
                }
            }
        };
        let n = match self.n {
            None => 1,
            Some(n) if (1..=16).contains(&n) => n as usize,
            Some(n) => {
                return Err(
                    ApiError::bad_request(format!("`n` must be between 1 and 16, got {n}"))
                        .param("n"),
                )
            }
        };
        if let Some(b) = self.best_of {
            if b as usize != n {
                return Err(unsupported("best_of", "only best_of = n is served"));
            }
        }
        if self.echo == Some(true) {
            return Err(unsupported("echo", "the prompt is not returned"));
        }
        if self.suffix.as_deref().is_some_and(|s| !s.is_empty()) {
            return Err(unsupported("suffix", "no insertion models are served"));
        }
        if self.logit_bias.as_ref().is_some_and(|m| !m.is_empty()) {
            return Err(unsupported("logit_bias", "not implemented"));
        }
        if !chat && self.tools.as_ref().is_some_and(|t| !t.is_empty()) {
            return Err(unsupported(
                "tools",
                "tool calls are served on /v1/chat/completions",
            ));
        }
        p.constraint = self.constraint()?;
        let logprobs = if chat {
            match &self.logprobs {
                None | Some(Value::Null) | Some(Value::Bool(false)) => {
                    if self.top_logprobs.is_some_and(|t| t > 0) {
                        return Err(
                            ApiError::bad_request("`top_logprobs` needs `logprobs: true`")
                                .param("top_logprobs"),
                        );
                    }
                    LogprobsMode::None
                }
                Some(Value::Bool(true)) => {
                    LogprobsMode::Chat(top_count(self.top_logprobs.unwrap_or(0), "top_logprobs")?)
                }
                Some(_) => {
                    return Err(
                        ApiError::bad_request("`logprobs` must be a boolean").param("logprobs")
                    )
                }
            }
        } else {
            match &self.logprobs {
                None | Some(Value::Null) => LogprobsMode::None,
                Some(Value::Number(n)) if n.as_i64().is_some() => {
                    LogprobsMode::Completion(top_count(n.as_i64().unwrap_or(0), "logprobs")?)
                }
                Some(_) => {
                    return Err(ApiError::bad_request(
                        "`logprobs` must be an integer (alternatives per token)",
                    )
                    .param("logprobs"))
                }
            }
        };
        p.logprobs = logprobs != LogprobsMode::None;
        p.top_logprobs = match logprobs {
            LogprobsMode::None => 0,
            LogprobsMode::Completion(k) | LogprobsMode::Chat(k) => k,
        };
        p.validate().map_err(ApiError::bad_request)?;
        let stream = self.stream.unwrap_or(false);
        let include_usage = self
            .stream_options
            .as_ref()
            .and_then(|o| o.include_usage)
            .unwrap_or(false);
        if self.stream_options.is_some() && !stream {
            return Err(ApiError::bad_request(
                "`stream_options` is only allowed with `stream: true`",
            )
            .param("stream_options"));
        }
        Ok(CommonOptions {
            params: p,
            max_tokens,
            n,
            stream,
            include_usage,
            logprobs,
            tools: None,
        })
    }

    /// The completions prompt(s): texts are tokenized by `encode`, token arrays checked later.
    pub fn prompts(
        &self,
        mut encode: impl FnMut(&str) -> Result<Vec<TokenId>, ApiError>,
    ) -> Result<Vec<Vec<TokenId>>, ApiError> {
        let ids = |v: &[u32]| v.iter().map(|&t| TokenId(t)).collect::<Vec<_>>();
        let prompts = match &self.prompt {
            None => {
                return Err(ApiError::bad_request("`prompt` is required").param("prompt"));
            }
            Some(PromptInput::Text(t)) => vec![encode(t)?],
            Some(PromptInput::Texts(v)) => v.iter().map(|t| encode(t)).collect::<Result<_, _>>()?,
            Some(PromptInput::Tokens(v)) => vec![ids(v)],
            Some(PromptInput::TokenBatches(v)) => v.iter().map(|t| ids(t)).collect(),
        };
        if prompts.is_empty() || prompts.len() > 64 {
            return Err(
                ApiError::bad_request("`prompt` must hold between 1 and 64 prompts")
                    .param("prompt"),
            );
        }
        if prompts.iter().any(Vec::is_empty) {
            return Err(ApiError::bad_request("the prompt is empty").param("prompt"));
        }
        Ok(prompts)
    }

    /// The chat messages as plain text content.
    pub fn chat_messages(&self) -> Result<Vec<quire_tokenizer::ChatMessage>, ApiError> {
        let Some(msgs) = &self.messages else {
            return Err(ApiError::bad_request("`messages` is required").param("messages"));
        };
        if msgs.is_empty() {
            return Err(ApiError::bad_request("`messages` must not be empty").param("messages"));
        }
        let mut out = Vec::with_capacity(msgs.len());
        for (i, m) in msgs.iter().enumerate() {
            if !matches!(
                m.role.as_str(),
                "system" | "user" | "assistant" | "developer" | "tool"
            ) {
                return Err(ApiError::bad_request(format!(
                    "unknown role `{}` in messages[{i}]",
                    m.role
                ))
                .param(format!("messages[{i}].role")));
            }
            let content = match &m.content {
                None => String::new(),
                Some(ContentInput::Text(t)) => t.clone(),
                Some(ContentInput::Parts(parts)) => {
                    let mut s = String::new();
                    for p in parts {
                        match (p.kind.as_str(), &p.text) {
                            ("text", Some(t)) => s.push_str(t),
                            (kind, _) => {
                                return Err(ApiError::bad_request(format!(
                                    "content part of type `{kind}` is not supported (text only)"
                                ))
                                .param(format!("messages[{i}].content")))
                            }
                        }
                    }
                    s
                }
            };
            let role = if m.role == "developer" {
                "system"
            } else {
                &m.role
            };
            let mut msg = quire_tokenizer::ChatMessage::new(role, content);
            if let Some(calls) = m.tool_calls.as_deref().filter(|c| !c.is_empty()) {
                if role != "assistant" {
                    return Err(ApiError::bad_request(format!(
                        "messages[{i}]: only assistant messages carry `tool_calls`"
                    ))
                    .param(format!("messages[{i}].tool_calls")));
                }
                msg.tool_calls = Some(crate::tools::message_tool_calls(
                    calls,
                    &format!("messages[{i}]"),
                )?);
            }
            if role == "tool" {
                msg.tool_call_id = m.tool_call_id.clone();
            }
            msg.name = m.name.clone();
            out.push(msg);
        }
        Ok(out)
    }
}

fn top_count(v: i64, name: &str) -> Result<usize, ApiError> {
    if (0..=MAX_TOP_LOGPROBS as i64).contains(&v) {
        Ok(v as usize)
    } else {
        Err(ApiError::bad_request(format!(
            "`{name}` must be between 0 and {MAX_TOP_LOGPROBS}, got {v}"
        ))
        .param(name))
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn malformed_and_mistyped_bodies_are_400_with_the_param() {
        let e = parse_body(b"{\"prompt\": ").unwrap_err();
        assert_eq!(e.status.as_u16(), 400);
        assert!(e.message.contains("not valid JSON"));
        let e = parse_body(b"[1,2]").unwrap_err();
        assert!(e.message.contains("object"));
        let e = parse_body(br#"{"prompt": "x", "temperature": "hot"}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("temperature"));
        let e =
            parse_body(br#"{"prompt": "x", "stream_options": {"include_usage": 3}}"#).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stream_options.include_usage"));
    }

    #[test]
    fn ranges_and_unsupported_features_are_refused_by_name() {
        let cases: &[(&str, &str)] = &[
            (r#"{"max_tokens": 0}"#, "max_tokens"),
            (r#"{"max_tokens": -5}"#, "max_tokens"),
            (r#"{"top_p": 0}"#, "top_p"),
            (r#"{"temperature": -1}"#, "temperature"),
            (r#"{"top_k": -3}"#, "top_k"),
            (r#"{"n": 0}"#, "n"),
            (r#"{"logprobs": 99}"#, "logprobs"),
            (r#"{"echo": true}"#, "echo"),
            (r#"{"logit_bias": {"1": 5}}"#, "logit_bias"),
            (
                r#"{"stop": ["a","b","c","d","e","f","g","h","i","j","k","l","m","n","o","p","q"]}"#,
                "stop",
            ),
            (
                r#"{"stream_options": {"include_usage": true}}"#,
                "stream_options",
            ),
        ];
        for (body, param) in cases {
            let r = parse_body(body.as_bytes()).unwrap();
            let e = r.common(false).unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(*param), "{body}: {}", e.message);
        }
        let r = parse_body(br#"{"logprobs": true, "top_logprobs": 21}"#).unwrap();
        assert_eq!(
            r.common(true).unwrap_err().param.as_deref(),
            Some("top_logprobs")
        );
    }

    #[test]
    fn structured_output_fields_become_constraints_or_are_refused_by_name() {
        let ok: &[(&str, Option<Constraint>)] = &[
            (r#"{}"#, None),
            (r#"{"response_format": {"type": "text"}}"#, None),
            (
                r#"{"response_format": {"type": "json_object"}}"#,
                Some(Constraint::JsonObject),
            ),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": {"type": "integer"}, "strict": true}}}"#,
                Some(Constraint::JsonSchema(r#"{"type":"integer"}"#.into())),
            ),
            (
                r#"{"regex": "[ab]+"}"#,
                Some(Constraint::Regex("[ab]+".into())),
            ),
            (
                r#"{"grammar": "start: \"x\""}"#,
                Some(Constraint::Lark("start: \"x\"".into())),
            ),
        ];
        for (body, want) in ok {
            let got = parse_body(body.as_bytes()).unwrap().common(true).unwrap();
            assert_eq!(&got.params.constraint, want, "{body}");
        }
        let bad: &[(&str, &str)] = &[
            (
                r#"{"response_format": {"type": "xml"}}"#,
                "response_format.type",
            ),
            (r#"{"response_format": {}}"#, "response_format.type"),
            (
                r#"{"response_format": {"type": "json_schema"}}"#,
                "response_format.json_schema",
            ),
            (
                r#"{"response_format": {"type": "json_schema", "json_schema": {"schema": 3}}}"#,
                "response_format.json_schema.schema",
            ),
            (
                r#"{"response_format": {"type": "json_object"}, "regex": "a"}"#,
                "regex",
            ),
            (r#"{"regex": "a", "grammar": "start: \"a\""}"#, "grammar"),
        ];
        for (body, param) in bad {
            let e = parse_body(body.as_bytes())
                .unwrap()
                .common(true)
                .unwrap_err();
            assert_eq!(e.status.as_u16(), 400, "{body}");
            assert_eq!(e.param.as_deref(), Some(*param), "{body}: {}", e.message);
        }
    }

    #[test]
    fn long_stop_strings_are_refused_by_name() {
        let ok = format!(r#"{{"stop": ["{}"]}}"#, "é".repeat(MAX_STOP_BYTES / 2));
        assert!(parse_body(ok.as_bytes()).unwrap().common(false).is_ok());
        let long = format!(r#"{{"stop": ["a", "{}"]}}"#, "x".repeat(MAX_STOP_BYTES + 1));
        let e = parse_body(long.as_bytes())
            .unwrap()
            .common(false)
            .unwrap_err();
        assert_eq!((e.status.as_u16(), e.param.as_deref()), (400, Some("stop")));
        assert!(e.message.contains("256 bytes"), "{}", e.message);
        let mb = format!(r#"{{"stop": "{}"}}"#, "x".repeat(1 << 20));
        let e = parse_body(mb.as_bytes()).unwrap().common(true).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("stop"));
    }

    #[test]
    fn options_map_to_sampling_params() {
        let r = parse_body(
            br#"{"temperature": 0.5, "top_k": 7, "top_p": 0.9, "min_p": 0.1, "seed": 3,
                 "stop": "END", "max_completion_tokens": 9, "n": 2, "logprobs": true,
                 "top_logprobs": 4, "stream": true, "stream_options": {"include_usage": true}}"#,
        )
        .unwrap();
        let c = r.common(true).unwrap();
        assert_eq!(c.params.temperature, 0.5);
        assert_eq!(c.params.top_k, 7);
        assert_eq!(c.params.seed, Some(3));
        assert_eq!(c.params.stop, vec!["END".to_string()]);
        assert_eq!(c.max_tokens, Some(9));
        assert_eq!((c.n, c.stream, c.include_usage), (2, true, true));
        assert_eq!(c.logprobs, LogprobsMode::Chat(4));
        assert_eq!(c.params.top_logprobs, 4);
    }

    #[test]
    fn prompts_in_every_shape() {
        let enc = |t: &str| Ok(t.bytes().map(|b| TokenId(b as u32)).collect());
        let r = parse_body(br#"{"prompt": "ab"}"#).unwrap();
        assert_eq!(
            r.prompts(enc).unwrap(),
            vec![vec![TokenId(97), TokenId(98)]]
        );
        let r = parse_body(br#"{"prompt": ["a", "b"]}"#).unwrap();
        assert_eq!(r.prompts(enc).unwrap().len(), 2);
        let r = parse_body(br#"{"prompt": [1, 2, 3]}"#).unwrap();
        assert_eq!(r.prompts(enc).unwrap()[0].len(), 3);
        let r = parse_body(br#"{"prompt": [[1], [2, 3]]}"#).unwrap();
        assert_eq!(r.prompts(enc).unwrap()[1].len(), 2);
        let r = parse_body(br#"{"prompt": ""}"#).unwrap();
        assert!(r.prompts(enc).is_err());
        let r = parse_body(br#"{"prompt": {"a": 1}}"#).unwrap_err();
        assert_eq!(r.param.as_deref(), Some("prompt"));
    }
}
