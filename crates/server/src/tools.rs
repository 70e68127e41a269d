//! Tool calls on `/v1/chat/completions`: the request's `tools` go to the chat template (as
//! Hugging Face templates expect them), and the model's reply is read back into OpenAI's
//! `message.tool_calls`.
//!
//! Models write calls in the convention they were trained on, which their template shows:
//! - **Hermes** (Qwen 2/2.5/3, Hermes, SmolLM3 …: the template mentions `<tool_call>`): each call
//!   is `<tool_call>{"name": …, "arguments": {…}}</tool_call>`, several in a row when parallel.
//! - **Llama 3** (the template mentions `"parameters"` and `ipython`): one bare JSON object
//!   `{"name": …, "parameters": {…}}`, optionally after `<|python_tag|>`.
//! - A template that does not mention `tools` at all (the default model's): the tools are
//!   described in a system message in the Hermes convention, and read back the same way.
//!
//! `tool_choice: "required"` or a named function turns the call format into a grammar (section 2
//! of structured outputs: a JSON Schema per function inside the call markup), so the reply always
//! parses; `auto` leaves the model free and reads calls back where it wrote them.

use quire_core::Constraint;
use quire_tokenizer::ChatTemplate;
use serde_json::{json, Value};

use crate::error::ApiError;

const HERMES_OPEN: &str = "<tool_call>";
const PYTHON_TAG: &str = "<|python_tag|>";

/// How a model writes its calls.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum CallFormat {
    Hermes,
    Llama3,
}

#[derive(Debug, Clone, PartialEq)]
pub enum ToolChoice {
    Auto,
    Required,
    Named(String),
}

#[derive(Debug, Clone)]
pub struct Function {
    pub name: String,
    pub description: Option<String>,
    /// The arguments' JSON Schema (an object schema; `{"type": "object"}` when not given).
    pub parameters: Value,
}

/// A request's tools, checked. `None` from [`ToolSpec::parse`] means no tool handling at all
/// (no tools, or `tool_choice: "none"`).
#[derive(Debug, Clone)]
pub struct ToolSpec {
    pub functions: Vec<Function>,
    pub choice: ToolChoice,
    pub parallel: bool,
    pub format: CallFormat,
    /// The template does not take `tools`: they are described in a system message instead.
    pub describe_in_system: bool,
}

/// One call read from the reply.
#[derive(Debug, Clone, PartialEq)]
pub struct ToolCall {
    pub name: String,
    /// The arguments as JSON text (OpenAI's `function.arguments` is a string).
    pub arguments: String,
}

fn bad(param: impl Into<String>, why: impl Into<String>) -> ApiError {
    ApiError::bad_request(why.into()).param(param)
}

impl ToolSpec {
    /// Checks `tools`, `tool_choice` and `parallel_tool_calls` against OpenAI's shapes; the call
    /// format comes from the template.
    pub fn parse(
        tools: Option<&[Value]>,
        tool_choice: Option<&Value>,
        parallel: Option<bool>,
        template: &ChatTemplate,
    ) -> Result<Option<Self>, ApiError> {
        let tools = tools.unwrap_or_default();
        let mut functions = Vec::with_capacity(tools.len());
        for (i, t) in tools.iter().enumerate() {
            let at = format!("tools[{i}]");
            if t.get("type").and_then(Value::as_str) != Some("function") {
                return Err(bad(&at, format!("`{at}.type` must be \"function\"")));
            }
            let f = t
                .get("function")
                .filter(|f| f.is_object())
                .ok_or_else(|| bad(&at, format!("`{at}.function` must be an object")))?;
            let name = f
                .get("name")
                .and_then(Value::as_str)
                .filter(|n| !n.is_empty())
                .ok_or_else(|| {
                    bad(
                        format!("{at}.function.name"),
                        format!("`{at}.function.name` must be a non-empty string"),
                    )
                })?;
            let parameters = match f.get("parameters") {
                None | Some(Value::Null) => json!({"type": "object"}),
                Some(p) if p.is_object() => p.clone(),
                Some(_) => {
                    return Err(bad(
                        format!("{at}.function.parameters"),
                        format!("`{at}.function.parameters` must be a JSON Schema object"),
                    ))
                }
            };
            if functions.iter().any(|g: &Function| g.name == name) {
                return Err(bad(&at, format!("two tools are named `{name}`")));
            }
            functions.push(Function {
                name: name.to_string(),
                description: f
                    .get("description")
                    .and_then(Value::as_str)
                    .map(str::to_string),
                parameters,
            });
        }
        let choice = match tool_choice {
            None | Some(Value::Null) => ToolChoice::Auto,
            Some(Value::String(s)) => match s.as_str() {
                "none" => return Ok(None),
                "auto" => ToolChoice::Auto,
                "required" => ToolChoice::Required,
                other => {
                    return Err(bad(
                        "tool_choice",
                        format!("`tool_choice` must be \"none\", \"auto\", \"required\" or a function, got {other:?}"),
                    ))
                }
            },
            Some(v) => {
                let name = v
                    .get("function")
                    .and_then(|f| f.get("name"))
                    .and_then(Value::as_str)
                    .filter(|_| v.get("type").and_then(Value::as_str) == Some("function"))
                    .ok_or_else(|| {
                        bad("tool_choice", "a named `tool_choice` is {\"type\": \"function\", \"function\": {\"name\": …}}")
                    })?;
                if !functions.iter().any(|f| f.name == name) {
                    return Err(bad("tool_choice", format!("`tool_choice` names `{name}`, which is not in `tools`")));
                }
                ToolChoice::Named(name.to_string())
            }
        };
        if functions.is_empty() {
            return match choice {
                ToolChoice::Auto => Ok(None),
                _ => Err(bad(
                    "tool_choice",
                    "`tool_choice` asks for a call but `tools` is empty",
                )),
            };
        }
        let uses_tools = template.mentions("tools");
        let format = if uses_tools
            && !template.mentions("<tool_call>")
            && template.mentions("\"parameters\"")
            && template.mentions("ipython")
        {
            CallFormat::Llama3
        } else {
            CallFormat::Hermes
        };
        Ok(Some(Self {
            functions,
            choice,
            // Llama 3's form is one call per reply.
            parallel: parallel.unwrap_or(true) && format == CallFormat::Hermes,
            format,
            describe_in_system: !uses_tools,
        }))
    }

    /// The `tools` template variable: OpenAI's list, as HF templates read it.
    pub fn template_tools(&self) -> Value {
        Value::Array(
            self.functions
                .iter()
                .map(|f| {
                    let mut fun = json!({"name": f.name, "parameters": f.parameters});
                    if let Some(d) = &f.description {
                        fun["description"] = Value::from(d.clone());
                    }
                    json!({"type": "function", "function": fun})
                })
                .collect(),
        )
    }

    /// For templates without tool support: a system message that lists the tools and the
    /// Hermes call format.
    pub fn system_prompt(&self) -> String {
        let mut s = String::from(
            "You may call one or more functions to assist with the user query. The available \
             functions, as JSON signatures:\n<tools>\n",
        );
        for t in self.template_tools().as_array().into_iter().flatten() {
            s.push_str(&t.to_string());
            s.push('\n');
        }
        s.push_str(
            "</tools>\nFor each function call, return a JSON object with the function name and \
             arguments inside <tool_call></tool_call> tags:\n<tool_call>\n{\"name\": \
             <function-name>, \"arguments\": <args-json-object>}\n</tool_call>",
        );
        s
    }

    /// How much of an unfinished reply can go out as content: everything before what could be
    /// the start of a call, less trailing whitespace (which [`ToolSpec::extract`] trims before a
    /// call).
    pub fn safe_prefix(&self, text: &str) -> usize {
        let end = match self.format {
            CallFormat::Hermes => match text.find(HERMES_OPEN) {
                Some(at) => at,
                None => {
                    let partial = (1..HERMES_OPEN.len().min(text.len() + 1))
                        .rev()
                        .find(|&k| text.ends_with(&HERMES_OPEN[..k]))
                        .unwrap_or(0);
                    text.len() - partial
                }
            },
            CallFormat::Llama3 => {
                let t = text.trim_start();
                let maybe_call = t.is_empty()
                    || t.starts_with('{')
                    || t.starts_with(PYTHON_TAG)
                    || PYTHON_TAG.starts_with(t);
                if maybe_call {
                    0
                } else {
                    text.len()
                }
            }
        };
        text[..end].trim_end().len()
    }

    /// The grammar a `required` or named choice puts on the reply, so it always parses.
    pub fn constraint(&self) -> Option<Constraint> {
        let chosen: Vec<&Function> = match &self.choice {
            ToolChoice::Auto => return None,
            ToolChoice::Required => self.functions.iter().collect(),
            ToolChoice::Named(n) => self.functions.iter().filter(|f| &f.name == n).collect(),
        };
        let args_key = match self.format {
            CallFormat::Hermes => "arguments",
            CallFormat::Llama3 => "parameters",
        };
        let variants: Vec<Value> = chosen
            .iter()
            .map(|f| {
                json!({
                    "type": "object",
                    "properties": {"name": {"const": f.name}, args_key: f.parameters},
                    "required": ["name", args_key],
                    "additionalProperties": false,
                })
            })
            .collect();
        let schema = if variants.len() == 1 {
            variants[0].clone()
        } else {
            json!({"anyOf": variants})
        };
        let grammar = match self.format {
            CallFormat::Hermes => {
                let more = if self.parallel {
                    " (\"\\n\" call)*"
                } else {
                    ""
                };
                format!("start: call{more}\ncall: \"<tool_call>\\n\" %json {schema} \"\\n</tool_call>\"\n")
            }
            CallFormat::Llama3 => format!("start: %json {schema}\n"),
        };
        Some(Constraint::Lark(grammar))
    }

    /// Splits a finished reply into its text and its calls. Text that only looks like a call
    /// (unclosed, not JSON, an unknown function) stays text.
    pub fn extract(&self, text: &str) -> (String, Vec<ToolCall>) {
        match self.format {
            CallFormat::Hermes => self.extract_hermes(text),
            CallFormat::Llama3 => {
                let body = text.trim().trim_start_matches(PYTHON_TAG).trim();
                match self.call_of(body, "parameters") {
                    Some(c) => (String::new(), vec![c]),
                    None => (text.to_string(), Vec::new()),
                }
            }
        }
    }

    fn extract_hermes(&self, text: &str) -> (String, Vec<ToolCall>) {
        const OPEN: &str = HERMES_OPEN;
        const CLOSE: &str = "</tool_call>";
        let mut calls = Vec::new();
        let mut content = String::new();
        let mut rest = text;
        while let Some(at) = rest.find(OPEN) {
            let after = &rest[at + OPEN.len()..];
            let Some(end) = after.find(CLOSE) else { break };
            match self.call_of(after[..end].trim(), "arguments") {
                Some(c) if self.parallel || calls.is_empty() => {
                    content.push_str(&rest[..at]);
                    calls.push(c);
                }
                _ => content.push_str(&rest[..at + OPEN.len() + end + CLOSE.len()]),
            }
            rest = &after[end + CLOSE.len()..];
        }
        content.push_str(rest);
        (content.trim().to_string(), calls)
    }

    fn call_of(&self, json_text: &str, args_key: &str) -> Option<ToolCall> {
        let v: Value = serde_json::from_str(json_text).ok()?;
        let name = v.get("name")?.as_str()?;
        if !self.functions.iter().any(|f| f.name == name) {
            return None;
        }
        let args = v
            .get(args_key)
            .or_else(|| v.get("arguments"))
            .cloned()
            .unwrap_or_else(|| json!({}));
        if !args.is_object() {
            return None;
        }
        Some(ToolCall {
            name: name.to_string(),
            arguments: args.to_string(),
        })
    }
}

/// OpenAI's `tool_calls` list; ids are the response id's suffix plus the call's index, unique
/// within the server's life.
pub fn calls_json(calls: &[ToolCall], id: &str, choice: usize, with_index: bool) -> Value {
    Value::Array(
        calls
            .iter()
            .enumerate()
            .map(|(k, c)| {
                let mut v = json!({
                    "id": format!("call_{}_{choice}_{k}", id.rsplit('-').next().unwrap_or(id)),
                    "type": "function",
                    "function": {"name": c.name, "arguments": c.arguments},
                });
                if with_index {
                    v["index"] = Value::from(k);
                }
                v
            })
            .collect(),
    )
}

/// An assistant message's `tool_calls` from a request, as templates read them (arguments parsed
/// from OpenAI's string into an object).
pub fn message_tool_calls(calls: &[Value], at: &str) -> Result<Value, ApiError> {
    let mut out = Vec::with_capacity(calls.len());
    for (k, c) in calls.iter().enumerate() {
        let f = c.get("function").filter(|f| f.is_object()).ok_or_else(|| {
            bad(
                format!("{at}.tool_calls[{k}]"),
                format!("`{at}.tool_calls[{k}].function` must be an object"),
            )
        })?;
        let name = f.get("name").and_then(Value::as_str).unwrap_or_default();
        let args = match f.get("arguments") {
            Some(Value::String(s)) => {
                serde_json::from_str(s).unwrap_or_else(|_| Value::from(s.clone()))
            }
            Some(v) => v.clone(),
            None => json!({}),
        };
        let mut v = json!({"type": "function", "function": {"name": name, "arguments": args}});
        if let Some(id) = c.get("id") {
            v["id"] = id.clone();
        }
        out.push(v);
    }
    Ok(Value::Array(out))
}

#[cfg(test)]
#[path = "tools_tests.rs"]
mod tests;
