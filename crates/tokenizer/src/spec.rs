//! The plain description of a tokenizer, as GGUF metadata states it. The model crate fills it from
//! the file, so this crate never depends on the GGUF reader at run time, and tests can build tiny
//! vocabularies by hand.

use serde::{Deserialize, Serialize};

/// Everything needed to build a [`crate::Tokenizer`]; one field per `tokenizer.ggml.*` key.
///
/// `Default` gives an empty spec (which [`crate::Tokenizer::from_spec`] rejects); use it with
/// struct-update syntax so that new fields added here later do not break callers.
#[derive(Debug, Clone, Default, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct TokenizerSpec {
    /// `tokenizer.ggml.model`: `"gpt2"` (byte-level BPE with merges) or `"llama"`
    /// (SentencePiece-style BPE driven by scores).
    pub model: String,
    /// `tokenizer.ggml.pre`: the pre-tokenizer (regex split) of a `"gpt2"` model, e.g. `"smollm"`,
    /// `"llama-bpe"`, `"qwen2"`, `"gpt-2"`, `"default"`. Ignored for `"llama"`.
    pub pre: Option<String>,
    /// `tokenizer.ggml.tokens`, indexed by token id.
    pub tokens: Vec<String>,
    /// `tokenizer.ggml.token_type`: 1 normal, 2 unknown, 3 control, 4 user-defined, 5 unused,
    /// 6 byte. Empty means "all normal"; otherwise it must be at least as long as `tokens`.
    pub token_types: Vec<i32>,
    /// `tokenizer.ggml.merges`: `"left right"` pairs, highest priority first (`"gpt2"` only).
    pub merges: Vec<String>,
    /// `tokenizer.ggml.scores` (`"llama"` only). Empty means all 0.0; otherwise it must be at
    /// least as long as `tokens`.
    pub scores: Vec<f32>,
    pub bos_token_id: Option<u32>,
    pub eos_token_id: Option<u32>,
    pub eot_token_id: Option<u32>,
    pub unknown_token_id: Option<u32>,
    pub padding_token_id: Option<u32>,
    /// Further end-of-generation ids (not a GGUF key: HF `generation_config.json` may list
    /// several `eos_token_id`s). Ids outside the vocabulary are ignored.
    pub eog_token_ids: Vec<u32>,
    /// `tokenizer.ggml.add_bos_token`. When the key is absent, use [`TokenizerSpec::default_add_bos`].
    pub add_bos_token: bool,
    /// `tokenizer.ggml.add_eos_token` (absent: false).
    pub add_eos_token: bool,
    /// `tokenizer.ggml.add_space_prefix` (`"llama"` only). When the key is absent, use
    /// [`TokenizerSpec::default_add_space_prefix`].
    pub add_space_prefix: bool,
}

impl TokenizerSpec {
    /// llama.cpp's value of `add_bos_token` when the GGUF key is absent: true for SentencePiece
    /// (`"llama"`) models and for the `"gpt2"` pre-tokenizers that llama.cpp marks so (Llama 3
    /// family, tekken, chameleon), false otherwise.
    pub fn default_add_bos(model: &str, pre: Option<&str>) -> bool {
        match model {
            "llama" => true,
            "gpt2" => matches!(
                pre,
                Some(
                    "llama3"
                        | "llama-v3"
                        | "llama-bpe"
                        | "falcon3"
                        | "falcon-h1"
                        | "pixtral"
                        | "midm-2.0"
                        | "lfm2"
                        | "jina-v5-nano"
                        | "tekken"
                        | "chameleon"
                )
            ),
            _ => false,
        }
    }

    /// llama.cpp's value of `add_space_prefix` when the GGUF key is absent: true for `"llama"`.
    pub fn default_add_space_prefix(model: &str) -> bool {
        model == "llama"
    }
}

/// The type of a token, from `tokenizer.ggml.token_type`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum TokenType {
    Normal,
    Unknown,
    Control,
    UserDefined,
    Unused,
    Byte,
    /// Any other value in the file (0 or out of range).
    Undefined,
}

impl TokenType {
    /// Maps the GGUF integer to a type; unknown integers become [`TokenType::Undefined`].
    pub fn from_gguf(value: i32) -> Self {
        match value {
            1 => Self::Normal,
            2 => Self::Unknown,
            3 => Self::Control,
            4 => Self::UserDefined,
            5 => Self::Unused,
            6 => Self::Byte,
            _ => Self::Undefined,
        }
    }
}
