//! Hugging Face `tokenizer.json` (+ `tokenizer_config.json`) → [`TokenizerSpec`], so that HF model
//! folders get the same tokenizer implementation (and llama.cpp-compatible special-token handling)
//! as GGUF files.
//!
//! Only byte-level BPE is converted (GPT-2, Llama 3, Qwen 2/3 style): the pre-tokenizer's `Split`
//! regex is matched against the known HF regexes and mapped to the spec's `pre` name, whose
//! llama.cpp regex list splits text the same way. Anything else (SentencePiece-style `Metaspace`
//! files, unknown regexes, other normalizers) is refused with an error that names what was found.

use serde_json::Value;

use crate::spec::TokenizerSpec;
use crate::TokenizerError;

/// Llama 3's split as HF writes it (the contractions as one case-insensitive group).
const HF_LLAMA3: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2 / 2.5 / 3: as Llama 3 but one digit per piece.
const HF_QWEN2: &str = r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";

/// Known `Split` regexes → the spec's `pre` name.
const KNOWN_SPLITS: &[(&str, &str)] = &[(HF_LLAMA3, "llama-bpe"), (HF_QWEN2, "qwen2")];

/// What an HF folder's tokenizer files give: the spec, the chat template source and the BOS/EOS
/// texts the template sees.
#[derive(Debug, Clone)]
pub struct HfTokenizer {
    pub spec: TokenizerSpec,
    pub chat_template: Option<String>,
    pub bos_token: String,
    pub eos_token: String,
}

fn invalid(msg: impl Into<String>) -> TokenizerError {
    TokenizerError::InvalidSpec(msg.into())
}

fn parse(what: &str, text: &str) -> Result<Value, TokenizerError> {
    serde_json::from_str(text).map_err(|e| invalid(format!("{what}: bad JSON: {e}")))
}

/// The `pre` name of a pre-tokenizer object, or an error naming what is not understood.
fn pre_name(pre: &Value) -> Result<String, TokenizerError> {
    let ty = pre.get("type").and_then(Value::as_str).unwrap_or("");
    let byte_level_no_regex = |p: &Value| {
        p.get("type").and_then(Value::as_str) == Some("ByteLevel")
            && p.get("use_regex").and_then(Value::as_bool) == Some(false)
    };
    match ty {
        // ByteLevel alone splits with GPT-2's regex (`use_regex` defaults to true).
        "ByteLevel" if pre.get("use_regex").and_then(Value::as_bool) != Some(false) => {
            Ok("gpt-2".into())
        }
        "Sequence" => {
            let parts = pre
                .get("pretokenizers")
                .and_then(Value::as_array)
                .ok_or_else(|| invalid("tokenizer.json: Sequence pre-tokenizer without a list"))?;
            match parts.as_slice() {
                [split, bl] if byte_level_no_regex(bl) => split_name(split),
                [bl] if bl.get("type").and_then(Value::as_str) == Some("ByteLevel") => pre_name(bl),
                _ => Err(invalid(format!(
                    "tokenizer.json: unsupported pre-tokenizer sequence {}",
                    Value::Array(parts.clone())
                ))),
            }
        }
        "Metaspace" => Err(invalid(
            "tokenizer.json: SentencePiece-style (Metaspace) tokenizers are not supported for HF \
             folders yet; use a GGUF of this model",
        )),
        other => Err(invalid(format!(
            "tokenizer.json: unsupported pre-tokenizer type '{other}'"
        ))),
    }
}

fn split_name(split: &Value) -> Result<String, TokenizerError> {
    let regex = split
        .get("pattern")
        .and_then(|p| p.get("Regex"))
        .and_then(Value::as_str);
    let behavior = split.get("behavior").and_then(Value::as_str);
    let invert = split
        .get("invert")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if split.get("type").and_then(Value::as_str) != Some("Split")
        || behavior != Some("Isolated")
        || invert
    {
        return Err(invalid(format!(
            "tokenizer.json: unsupported pre-tokenizer step {split}"
        )));
    }
    let regex = regex.ok_or_else(|| invalid("tokenizer.json: Split without a Regex pattern"))?;
    KNOWN_SPLITS
        .iter()
        .find(|(r, _)| *r == regex)
        .map(|(_, name)| name.to_string())
        .ok_or_else(|| {
            invalid(format!(
                "tokenizer.json: unknown pre-tokenizer regex {regex:?} (known: Llama 3, Qwen 2)"
            ))
        })
}

/// A token given as a string or as an AddedToken object (`{"content": ...}`).
fn token_text(v: Option<&Value>) -> Option<String> {
    match v? {
        Value::String(s) => Some(s.clone()),
        Value::Object(o) => o.get("content").and_then(Value::as_str).map(str::to_string),
        _ => None,
    }
}

/// Builds the spec from `tokenizer.json` and (optionally) `tokenizer_config.json`.
///
/// BOS/EOS come from `tokenizer_config.json`'s `bos_token`/`eos_token`; `add_bos_token` from there
/// too, else from a `TemplateProcessing` post-processor that starts with the BOS token. The model
/// loader may add end-of-generation ids from `generation_config.json` / `config.json`.
pub fn from_hf_files(
    tokenizer_json: &str,
    tokenizer_config: Option<&str>,
) -> Result<HfTokenizer, TokenizerError> {
    let tj = parse("tokenizer.json", tokenizer_json)?;
    let tc = tokenizer_config
        .map(|t| parse("tokenizer_config.json", t))
        .transpose()?
        .unwrap_or(Value::Null);

    let model = tj
        .get("model")
        .ok_or_else(|| invalid("tokenizer.json: no \"model\""))?;
    let mtype = model.get("type").and_then(Value::as_str).unwrap_or("BPE");
    if mtype != "BPE" {
        return Err(invalid(format!(
            "tokenizer.json: model type '{mtype}' is not supported (only byte-level BPE)"
        )));
    }
    if model.get("byte_fallback").and_then(Value::as_bool) == Some(true) {
        return Err(invalid(
            "tokenizer.json: byte_fallback BPE (SentencePiece-style) is not supported for HF \
             folders yet; use a GGUF of this model",
        ));
    }
    match tj.get("normalizer") {
        None | Some(Value::Null) => {}
        // Qwen's NFC: llama.cpp does not normalize either, and quire's reference is llama.cpp.
        Some(n) if n.get("type").and_then(Value::as_str) == Some("NFC") => {}
        Some(n) => {
            return Err(invalid(format!(
                "tokenizer.json: unsupported normalizer {n}"
            )))
        }
    }
    let pre = pre_name(
        tj.get("pre_tokenizer")
            .ok_or_else(|| invalid("tokenizer.json: no pre_tokenizer (not byte-level BPE)"))?,
    )?;
    let ignore_merges = model
        .get("ignore_merges")
        .and_then(Value::as_bool)
        .unwrap_or(false);
    if ignore_merges != (pre == "llama-bpe") {
        return Err(invalid(format!(
            "tokenizer.json: ignore_merges={ignore_merges} does not fit the {pre} pre-tokenizer"
        )));
    }

    // Tokens: model.vocab plus added_tokens, by id; gaps become empty (never-matching) tokens.
    let vocab = model
        .get("vocab")
        .and_then(Value::as_object)
        .ok_or_else(|| invalid("tokenizer.json: model.vocab is not an object"))?;
    let mut entries: Vec<(u32, String, i32)> = Vec::with_capacity(vocab.len());
    for (text, id) in vocab {
        let id = id
            .as_u64()
            .and_then(|i| u32::try_from(i).ok())
            .ok_or_else(|| invalid(format!("tokenizer.json: bad id for token {text:?}")))?;
        entries.push((id, text.clone(), 1));
    }
    for t in tj
        .get("added_tokens")
        .and_then(Value::as_array)
        .into_iter()
        .flatten()
    {
        let id = t
            .get("id")
            .and_then(Value::as_u64)
            .and_then(|i| u32::try_from(i).ok());
        let text = t.get("content").and_then(Value::as_str);
        let (Some(id), Some(text)) = (id, text) else {
            return Err(invalid(format!("tokenizer.json: bad added token {t}")));
        };
        let special = t.get("special").and_then(Value::as_bool).unwrap_or(false);
        // Control tokens (3) are cut out of text only with parse_special; user-defined (4) always.
        entries.push((id, text.to_string(), if special { 3 } else { 4 }));
    }
    let n = entries.iter().map(|e| e.0 as usize + 1).max().unwrap_or(0);
    if n > 1 << 24 {
        return Err(invalid(format!(
            "tokenizer.json: token id {} is implausible",
            n - 1
        )));
    }
    let mut tokens = vec![String::new(); n];
    let mut token_types = vec![5; n]; // unused until filled
    for (id, text, ty) in entries {
        // An added token repeating a vocab entry keeps the id and takes the added token's type.
        tokens[id as usize] = text;
        token_types[id as usize] = ty;
    }

    let merges = model
        .get("merges")
        .and_then(Value::as_array)
        .map(|ms| {
            ms.iter()
                .map(|m| match m {
                    Value::String(s) => Ok(s.clone()),
                    Value::Array(p) => match p.as_slice() {
                        [Value::String(a), Value::String(b)] => Ok(format!("{a} {b}")),
                        _ => Err(invalid(format!("tokenizer.json: bad merge {m}"))),
                    },
                    _ => Err(invalid(format!("tokenizer.json: bad merge {m}"))),
                })
                .collect::<Result<Vec<_>, _>>()
        })
        .transpose()?
        .unwrap_or_default();

    let lookup = |text: &str| tokens.iter().position(|t| t == text).map(|i| i as u32);
    let bos_token = token_text(tc.get("bos_token"));
    let eos_token = token_text(tc.get("eos_token"));
    let bos_token_id = bos_token.as_deref().and_then(lookup);
    let eos_token_id = eos_token.as_deref().and_then(lookup);
    let unknown_token_id = token_text(tc.get("unk_token")).as_deref().and_then(lookup);
    let padding_token_id = token_text(tc.get("pad_token")).as_deref().and_then(lookup);

    // add_bos: the config's flag, else whether the post-processor puts BOS first.
    let post_adds_bos = || {
        let pp = tj.get("post_processor")?;
        let first = pp.get("single")?.as_array()?.first()?;
        let id = first.get("SpecialToken")?.get("id")?.as_str()?;
        Some(Some(id) == bos_token.as_deref())
    };
    let add_bos_token = tc
        .get("add_bos_token")
        .and_then(Value::as_bool)
        .or_else(post_adds_bos)
        .unwrap_or(false);
    let add_eos_token = tc
        .get("add_eos_token")
        .and_then(Value::as_bool)
        .unwrap_or(false);

    let chat_template = match tc.get("chat_template") {
        None | Some(Value::Null) => None,
        Some(Value::String(s)) => Some(s.clone()),
        // A list of named templates: the "default" one.
        Some(Value::Array(list)) => list
            .iter()
            .find(|t| t.get("name").and_then(Value::as_str) == Some("default"))
            .and_then(|t| t.get("template").and_then(Value::as_str))
            .map(str::to_string),
        Some(other) => {
            return Err(invalid(format!(
                "tokenizer_config.json: chat_template is neither a string nor a list: {other}"
            )))
        }
    };

    Ok(HfTokenizer {
        spec: TokenizerSpec {
            model: "gpt2".into(),
            pre: Some(pre),
            tokens,
            token_types,
            merges,
            bos_token_id,
            eos_token_id,
            unknown_token_id,
            padding_token_id,
            add_bos_token,
            add_eos_token,
            ..Default::default()
        },
        chat_template,
        bos_token: bos_token.unwrap_or_default(),
        eos_token: eos_token.unwrap_or_default(),
    })
}

#[cfg(test)]
mod tests;
