//! Chat templates: the Jinja template stored in `tokenizer.chat_template`, rendered with minijinja in
//! an environment set up like Hugging Face transformers' (`apply_chat_template`), because that is
//! what the templates were written for: `trim_blocks` and `lstrip_blocks` on, loop controls,
//! `raise_exception`, `strftime_now`, Python string/dict methods (`.strip()`, `.startswith()`,
//! `.items()` ...), and `tojson` as Python's `json.dumps` rather than Jinja's HTML-safe variant.

use minijinja::value::{Kwargs, Value};
use minijinja::{Environment, Error, ErrorKind};
use serde::{Deserialize, Serialize};

use crate::pyfns::{dumps, strftime_now, DumpOptions};
use crate::TokenizerError;

/// One message of a conversation. The tool fields are what Hugging Face chat templates read:
/// an assistant turn's `tool_calls` (`[{"type": "function", "function": {"name", "arguments"}}]`,
/// arguments as an object) and a `tool` turn's `tool_call_id` / `name`; absent fields are not
/// shown to the template at all.
#[derive(Debug, Clone, PartialEq, Eq, Serialize, Deserialize)]
pub struct ChatMessage {
    pub role: String,
    pub content: String,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_calls: Option<serde_json::Value>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub tool_call_id: Option<String>,
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub name: Option<String>,
}

impl ChatMessage {
    pub fn new(role: impl Into<String>, content: impl Into<String>) -> Self {
        Self {
            role: role.into(),
            content: content.into(),
            tool_calls: None,
            tool_call_id: None,
            name: None,
        }
    }
}

const TEMPLATE_NAME: &str = "chat_template";

/// The work one render may do, in minijinja fuel: about one unit per instruction and one per 64
/// bytes of data created, so this bounds a render to roughly 2 million instructions (well under a
/// second) and 128 MB. Real templates use a few units per message plus the content's size / 64;
/// a template with nested `range(10000)` loops or a string doubled 60 times stops here instead
/// of spinning forever or exhausting memory.
pub const TEMPLATE_FUEL: u64 = 2_000_000;

/// Marks where message `i`'s content goes when finding content in the rendered text: characters
/// from Unicode's private use plane that templates do not write.
const MARK: char = '\u{10FFFD}';

#[derive(Clone)]
enum Inner {
    Jinja {
        env: Box<Environment<'static>>,
        bos_token: String,
        eos_token: String,
    },
    /// Rendered in Rust, so that the fallback can never fail to compile.
    ChatMl,
}

/// A compiled chat template.
#[derive(Clone)]
pub struct ChatTemplate {
    inner: Inner,
}

impl std::fmt::Debug for ChatTemplate {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        match &self.inner {
            Inner::Jinja { .. } => f.write_str("ChatTemplate(jinja)"),
            Inner::ChatMl => f.write_str("ChatTemplate(chatml)"),
        }
    }
}

/// `raise_exception(message)`: aborts rendering with the template's message.
fn raise_exception(message: String) -> Result<Value, Error> {
    Err(Error::new(ErrorKind::InvalidOperation, message))
}

/// `value | tojson(indent=None, ensure_ascii=False, separators=None, sort_keys=False)`.
fn tojson(value: &Value, indent: Option<Value>, kwargs: Kwargs) -> Result<Value, Error> {
    let bad = |what: &str| Error::new(ErrorKind::InvalidOperation, format!("tojson: {what}"));
    let json = serde_json::to_value(value)
        .map_err(|e| bad("value cannot be serialized").with_source(e))?;
    let mut opts = DumpOptions::default();
    let indent = match indent {
        Some(v) => Some(v),
        None => kwargs.get::<Option<Value>>("indent")?,
    };
    if let Some(indent) = indent.filter(|v| !v.is_none() && !v.is_undefined()) {
        opts.indent = Some(match indent.as_str() {
            Some(s) => s.to_string(),
            None => {
                let n = i64::try_from(indent).map_err(|_| bad("indent must be int or str"))?;
                " ".repeat(usize::try_from(n).unwrap_or(0).min(64))
            }
        });
        // Python's default item separator drops its space when indenting.
        opts.item_sep = ",".into();
    }
    if let Some(b) = kwargs.get::<Option<bool>>("ensure_ascii")? {
        opts.ensure_ascii = b;
    }
    if let Some(b) = kwargs.get::<Option<bool>>("sort_keys")? {
        opts.sort_keys = b;
    }
    if let Some(seps) = kwargs.get::<Option<Value>>("separators")? {
        if !seps.is_none() {
            let item = seps.get_item(&Value::from(0))?;
            let key = seps.get_item(&Value::from(1))?;
            match (item.as_str(), key.as_str()) {
                (Some(i), Some(k)) => {
                    opts.item_sep = i.to_string();
                    opts.key_sep = k.to_string();
                }
                _ => return Err(bad("separators must be a pair of strings")),
            }
        }
    }
    kwargs.assert_all_used()?;
    Ok(Value::from_safe_string(dumps(&json, &opts)))
}

/// Rewrites HF's `{% generation %}` / `{% endgeneration %}` tags (which only mark assistant text for
/// training masks) into an always-true `if`, keeping any whitespace-control dashes.
fn strip_generation_tags(source: &str) -> String {
    let mut out = String::with_capacity(source.len());
    let mut rest = source;
    while let Some(at) = rest.find("{%") {
        out.push_str(&rest[..at]);
        let tag = &rest[at..];
        let Some(end) = tag.find("%}") else {
            out.push_str(tag);
            return out;
        };
        let inner = &tag[2..end];
        let (lead, body) = match inner.strip_prefix(['-', '+']) {
            Some(b) => (&inner[..1], b),
            None => ("", inner),
        };
        let (body, trail) = match body.strip_suffix(['-', '+']) {
            Some(b) => (b, &body[body.len() - 1..]),
            None => (body, ""),
        };
        match body.trim() {
            "generation" => out.push_str(&format!("{{%{lead} if true {trail}%}}")),
            "endgeneration" => out.push_str(&format!("{{%{lead} endif {trail}%}}")),
            _ => out.push_str(&tag[..end + 2]),
        }
        rest = &tag[end + 2..];
    }
    out.push_str(rest);
    out
}

impl ChatTemplate {
    /// Compiles `source` once; `bos_token` and `eos_token` are the texts the template sees.
    pub fn new(source: &str, bos_token: &str, eos_token: &str) -> Result<Self, TokenizerError> {
        let mut env = Environment::new();
        let syntax = minijinja::syntax::SyntaxConfig::builder()
            .trim_blocks(true)
            .lstrip_blocks(true)
            .build()?;
        env.set_syntax(syntax);
        env.set_auto_escape_callback(|_| minijinja::AutoEscape::None);
        env.set_unknown_method_callback(minijinja_contrib::pycompat::unknown_method_callback);
        env.add_function("raise_exception", raise_exception);
        env.add_function("strftime_now", |fmt: String| strftime_now(&fmt));
        env.add_filter("tojson", tojson);
        env.set_fuel(Some(TEMPLATE_FUEL));
        env.add_template_owned(TEMPLATE_NAME, strip_generation_tags(source))?;
        Ok(Self {
            inner: Inner::Jinja {
                env: Box::new(env),
                bos_token: bos_token.to_string(),
                eos_token: eos_token.to_string(),
            },
        })
    }

    /// Whether the template's source mentions `word` (e.g. `tools`, `<tool_call>`): how a caller
    /// tells which tool-call convention a model was trained with. The ChatML fallback mentions
    /// nothing.
    pub fn mentions(&self, word: &str) -> bool {
        match &self.inner {
            Inner::Jinja { env, .. } => env
                .get_template(TEMPLATE_NAME)
                .is_ok_and(|t| t.source().contains(word)),
            Inner::ChatMl => false,
        }
    }

    /// A ChatML template (`<|im_start|>role\ncontent<|im_end|>\n` per message) for models that ship
    /// none.
    pub fn chatml_fallback() -> Self {
        Self {
            inner: Inner::ChatMl,
        }
    }

    /// Renders a conversation; `add_generation_prompt` appends the opening of an assistant turn.
    pub fn render(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
    ) -> Result<String, TokenizerError> {
        self.render_with(messages, add_generation_prompt, serde_json::Map::new())
    }

    /// As [`render`](Self::render), with extra template variables (e.g. `tools`,
    /// `enable_thinking`); the standard variables win over extras of the same name.
    pub fn render_with(
        &self,
        messages: &[ChatMessage],
        add_generation_prompt: bool,
        extra: serde_json::Map<String, serde_json::Value>,
    ) -> Result<String, TokenizerError> {
        match &self.inner {
            Inner::ChatMl => {
                let mut out = String::new();
                for m in messages {
                    out.push_str("<|im_start|>");
                    out.push_str(&m.role);
                    out.push('\n');
                    out.push_str(&m.content);
                    out.push_str("<|im_end|>\n");
                }
                if add_generation_prompt {
                    out.push_str("<|im_start|>assistant\n");
                }
                Ok(out)
            }
            Inner::Jinja {
                env,
                bos_token,
                eos_token,
            } => {
                let mut ctx = extra;
                let messages = serde_json::to_value(messages).map_err(|e| {
                    Error::new(ErrorKind::BadSerialization, "messages").with_source(e)
                })?;
                ctx.insert("messages".into(), messages);
                ctx.insert("add_generation_prompt".into(), add_generation_prompt.into());
                ctx.insert("bos_token".into(), bos_token.clone().into());
                ctx.insert("eos_token".into(), eos_token.clone().into());
                let template = env.get_template(TEMPLATE_NAME)?;
                template
                    .render(Value::from(minijinja::value::Serde(&ctx)))
                    .map_err(|e| match e.kind() {
                        ErrorKind::OutOfFuel => TokenizerError::TemplateLimit {
                            fuel: TEMPLATE_FUEL,
                        },
                        _ => e.into(),
                    })
            }
        }
    }
}

/// Renders `messages` with the template (plus the generation prompt) and tokenizes the text. The
/// template's own markup is parsed for special tokens; message content is tokenized as plain text,
/// so a user who types `<|im_start|>system` cannot forge a turn (see [`encode_chat_opts`]).
pub fn encode_chat(
    tokenizer: &crate::Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
) -> Result<Vec<crate::TokenId>, TokenizerError> {
    encode_chat_opts(tokenizer, template, messages, ChatOptions::default())
}

/// How [`encode_chat_opts`] treats a conversation.
#[derive(Debug, Clone, Default)]
pub struct ChatOptions {
    /// Extra template variables (e.g. `tools`), as [`ChatTemplate::render_with`] takes them.
    pub extra: serde_json::Map<String, serde_json::Value>,
    /// Special-token text inside message content becomes control tokens, as in llama.cpp and
    /// vLLM. Off: content is plain text and only the template's own markup is special.
    pub content_special: bool,
    /// Refuse a rendered chat longer than this many bytes before tokenizing it.
    pub max_rendered_bytes: Option<usize>,
}

/// As [`encode_chat`], with [`ChatOptions`]. A BOS is added only when the template did not
/// already write one.
pub fn encode_chat_opts(
    tokenizer: &crate::Tokenizer,
    template: &ChatTemplate,
    messages: &[ChatMessage],
    opts: ChatOptions,
) -> Result<Vec<crate::TokenId>, TokenizerError> {
    let text = template.render_with(messages, true, opts.extra.clone())?;
    if let Some(max) = opts.max_rendered_bytes.filter(|&m| text.len() > m) {
        return Err(TokenizerError::RenderedTooLong {
            len: text.len(),
            max,
        });
    }
    let bos = tokenizer
        .bos()
        .and_then(|b| tokenizer.token_str(b).map(str::to_string));
    let has_bos = bos.is_some_and(|b| !b.is_empty() && text.starts_with(&b));
    // Only content that holds special-token text needs separating; all else tokenizes the same.
    let risky: Vec<usize> = if opts.content_special {
        Vec::new()
    } else {
        messages
            .iter()
            .enumerate()
            .filter(|(_, m)| tokenizer.control_text_in(&m.content).is_some())
            .map(|(i, _)| i)
            .collect()
    };
    if risky.is_empty() {
        return tokenizer.encode(&text, !has_bos, true);
    }
    let segments =
        content_segments(template, messages, &risky, &text, &opts.extra).ok_or_else(|| {
            let index = risky[0];
            TokenizerError::ContentNotSeparable {
                index,
                token: tokenizer
                    .control_text_in(&messages[index].content)
                    .unwrap_or_default()
                    .to_string(),
            }
        })?;
    tokenizer.encode_segments(&segments, !has_bos)
}

/// Splits `text` (the render of `messages`) into `(piece, parse_special)` segments, with the
/// content of the messages in `risky` as plain-text segments. The template is rendered again
/// with those contents replaced by markers; where the markers, replaced back by the contents,
/// give exactly `text`, the markers show where each content lies. `None` when they do not (the
/// template transforms or inspects the content).
fn content_segments<'a>(
    template: &ChatTemplate,
    messages: &'a [ChatMessage],
    risky: &[usize],
    text: &'a str,
    extra: &serde_json::Map<String, serde_json::Value>,
) -> Option<Vec<(&'a str, bool)>> {
    let mut marked = messages.to_vec();
    for &i in risky {
        marked[i].content = format!("{MARK}{i}{MARK}");
    }
    let skeleton = template.render_with(&marked, true, extra.clone()).ok()?;
    let mut segments = Vec::new();
    let mut pos = 0; // in `text`
    let mut rest = skeleton.as_str();
    while let Some(at) = rest.find(MARK) {
        let markup = &rest[..at];
        let after = &rest[at + MARK.len_utf8()..];
        let end = after.find(MARK)?;
        let index: usize = after[..end].parse().ok()?;
        let content = &messages.get(index)?.content;
        if !risky.contains(&index) || !text[pos..].starts_with(markup) {
            return None;
        }
        segments.push((&text[pos..pos + markup.len()], true));
        pos += markup.len();
        if !text[pos..].starts_with(content.as_str()) {
            return None;
        }
        segments.push((&text[pos..pos + content.len()], false));
        pos += content.len();
        rest = &after[end + MARK.len_utf8()..];
    }
    if &text[pos..] != rest {
        return None;
    }
    segments.push((&text[pos..], true));
    Some(segments)
}

#[cfg(test)]
mod tests {
    use super::strip_generation_tags;

    #[test]
    fn generation_tags_become_if_true() {
        assert_eq!(
            strip_generation_tags("a{%- generation -%}b{% endgeneration %}c{% if x %}"),
            "a{%- if true -%}b{% endif %}c{% if x %}"
        );
        assert_eq!(strip_generation_tags("x {% unclosed"), "x {% unclosed");
    }
}
