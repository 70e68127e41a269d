//! The token table shared by both tokenizer families: texts, attributes, the special-token ids, the
//! end-of-generation set and the splitting of raw text around special tokens.
//!
//! Everything here follows llama.cpp's `llama_vocab::impl::load` and `tokenizer_st_partition`
//! (src/llama-vocab.cpp), because the reference tokenizations come from llama.cpp: which tokens count
//! as special, the order in which they are matched (longest token text first, each splitting all
//! remaining text), and the end-of-generation set detected from token texts.

use std::collections::HashMap;

use crate::spec::{TokenType, TokenizerSpec};
use crate::TokenizerError;

/// Attribute bits of a token (llama.cpp's `llama_token_attr`, reduced to what we use).
pub(crate) mod attr {
    pub const NORMAL: u8 = 1 << 0;
    pub const UNKNOWN: u8 = 1 << 1;
    pub const CONTROL: u8 = 1 << 2;
    pub const USER_DEFINED: u8 = 1 << 3;
    pub const UNUSED: u8 = 1 << 4;
    pub const BYTE: u8 = 1 << 5;
    /// Tokens hidden when decoding with `skip_special` (llama.cpp: `special == false`).
    pub const HIDDEN: u8 = UNKNOWN | CONTROL;
}

/// Token texts that llama.cpp treats as end of generation (`special_eog_ids`), detected by text
/// because converters do not always record them in the metadata.
const EOG_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<|return|>",
    "<|call|>",
    "<|flush|>",
    "<|calls|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "</s>",
    "<|eom_id|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "[EOS]",
    "<|end_of_text|>",
    "<end_of_utterance>",
    "<eos>",
    "<turn|>",
    "<|tool_response>",
    "<｜end▁of▁sentence｜>",
    "[e~[",
];

/// End-of-turn candidates (llama.cpp's EOT auto-detection when `eot_token_id` is absent).
const EOT_TEXTS: &[&str] = &[
    "<|eot_id|>",
    "<|im_end|>",
    "<|end|>",
    "<end_of_turn>",
    "<|endoftext|>",
    "<|end_of_text|>",
    "<EOT>",
    "_<EOT>",
    "[EOT]",
    "<｜end▁of▁sentence｜>",
    "<end_of_utterance>",
];

/// Fill-in-the-middle tokens that llama.cpp detects by text and marks as control. The last three
/// groups (pad, repo, file separator) are also end of generation.
const FIM_TEXTS: &[(&[&str], bool)] = &[
    (
        &[
            "<|fim_prefix|>",
            "<fim-prefix>",
            "<fim_prefix>",
            "<｜fim▁begin｜>",
            "<PRE>",
            "▁<PRE>",
            "<|code_prefix|>",
            "<|prefix|>",
        ],
        false,
    ),
    (
        &[
            "<|fim_suffix|>",
            "<fim-suffix>",
            "<fim_suffix>",
            "<｜fim▁hole｜>",
            "<SUF>",
            "▁<SUF>",
            "<|code_suffix|>",
            "<|suffix|>",
        ],
        false,
    ),
    (
        &[
            "<|fim_middle|>",
            "<fim-middle>",
            "<fim_middle>",
            "<｜fim▁end｜>",
            "<MID>",
            "▁<MID>",
            "<|code_middle|>",
            "<|middle|>",
        ],
        false,
    ),
    (
        &["<|fim_pad|>", "<fim-pad>", "<fim_pad>", "<PAD>", "[PAD]"],
        true,
    ),
    (
        &[
            "<|fim_repo|>",
            "<|repo_name|>",
            "<fim-repo>",
            "<REPO>",
            "<reponame>",
        ],
        true,
    ),
    (&["<|file_sep|>"], true),
];

/// A piece of input text after special tokens were cut out of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum Fragment<'a> {
    Text(&'a str),
    Token(u32),
}

/// The vocabulary with llama.cpp's derived data.
#[derive(Debug)]
pub(crate) struct Vocab {
    pub tokens: Vec<String>,
    pub attrs: Vec<u8>,
    pub scores: Vec<f32>,
    pub token_to_id: HashMap<String, u32>,
    /// Control, user-defined and unknown tokens, longest text first (ties: lower id first).
    pub specials: Vec<u32>,
    /// End-of-generation ids, ascending.
    pub eog: Vec<u32>,
    pub bos: Option<u32>,
    pub eos: Option<u32>,
    pub eot: Option<u32>,
    pub unk: Option<u32>,
    pub pad: Option<u32>,
}

impl Vocab {
    pub fn from_spec(spec: &TokenizerSpec) -> Result<Self, TokenizerError> {
        let n = spec.tokens.len();
        if n == 0 {
            return Err(TokenizerError::InvalidSpec(
                "the vocabulary is empty".into(),
            ));
        }
        if u32::try_from(n).is_err() {
            return Err(TokenizerError::InvalidSpec(format!(
                "{n} tokens do not fit in u32 ids"
            )));
        }
        if !spec.token_types.is_empty() && spec.token_types.len() < n {
            return Err(TokenizerError::InvalidSpec(format!(
                "{} token types for {n} tokens",
                spec.token_types.len()
            )));
        }
        if !spec.scores.is_empty() && spec.scores.len() < n {
            return Err(TokenizerError::InvalidSpec(format!(
                "{} scores for {n} tokens",
                spec.scores.len()
            )));
        }

        let mut tokens = Vec::with_capacity(n);
        let mut token_to_id = HashMap::with_capacity(n);
        for (i, text) in spec.tokens.iter().enumerate() {
            // llama.cpp renames empty tokens so they can never match (and never loop) anywhere.
            let text = if text.is_empty() {
                format!("[EMPTY_{i}]")
            } else {
                text.clone()
            };
            // Duplicates: the first id keeps the text (llama.cpp refuses such files).
            token_to_id.entry(text.clone()).or_insert(i as u32);
            tokens.push(text);
        }

        let mut attrs: Vec<u8> = (0..n)
            .map(|i| {
                let ty = spec
                    .token_types
                    .get(i)
                    .map_or(TokenType::Normal, |&t| TokenType::from_gguf(t));
                match ty {
                    TokenType::Normal => attr::NORMAL,
                    TokenType::Unknown => attr::UNKNOWN,
                    TokenType::Control => attr::CONTROL,
                    TokenType::UserDefined => attr::USER_DEFINED,
                    TokenType::Unused => attr::UNUSED,
                    TokenType::Byte => attr::BYTE,
                    TokenType::Undefined => 0,
                }
            })
            .collect();

        let scores: Vec<f32> = (0..n)
            .map(|i| {
                let s = spec.scores.get(i).copied().unwrap_or(0.0);
                // -0.0 -> 0.0 so that ties compare as in C++; NaN would break the merge order.
                if s.is_nan() {
                    f32::NEG_INFINITY
                } else {
                    s + 0.0
                }
            })
            .collect();

        let in_range = |id: Option<u32>| id.filter(|&id| (id as usize) < n);
        let lookup = |text: &str| token_to_id.get(text).copied();

        fn mark_control(attrs: &mut [u8], id: u32) {
            attrs[id as usize] |= attr::CONTROL;
        }
        let mut eog: Vec<u32> = Vec::new();
        let mut eot = in_range(spec.eot_token_id);
        if eot.is_none() {
            eot = EOT_TEXTS.iter().filter_map(|t| lookup(t)).min();
            if let Some(id) = eot {
                mark_control(&mut attrs, id);
            }
        }
        for (texts, is_eog) in FIM_TEXTS {
            if let Some(id) = texts.iter().filter_map(|t| lookup(t)).min() {
                mark_control(&mut attrs, id);
                if *is_eog {
                    eog.push(id);
                }
            }
        }
        for text in EOG_TEXTS {
            if let Some(id) = lookup(text) {
                mark_control(&mut attrs, id);
                eog.push(id);
            }
        }
        // gpt-oss: these structural tokens are always rendered and always parsed.
        for text in ["<|channel|>", "<|message|>", "<|start|>", "<|constrain|>"] {
            if let Some(id) = lookup(text) {
                attrs[id as usize] = attr::USER_DEFINED;
            }
        }
        let eos = in_range(spec.eos_token_id);
        eog.extend(eos);
        eog.extend(eot);
        for &id in &spec.eog_token_ids {
            if let Some(id) = in_range(Some(id)) {
                mark_control(&mut attrs, id);
                eog.push(id);
            }
        }
        eog.sort_unstable();
        eog.dedup();

        // o200k_harmony / solar-open: "<|end|>" ends a message, not the generation.
        let has = |eog: &[u32], text: &str| lookup(text).is_some_and(|id| eog.contains(&id));
        if let Some(end) = lookup("<|end|>").filter(|id| eog.contains(id)) {
            let harmony = has(&eog, "<|return|>") && has(&eog, "<|call|>");
            let solar = has(&eog, "<|calls|>") && has(&eog, "<|flush|>");
            if harmony || solar {
                eog.retain(|&id| id != end);
                attrs[end as usize] = attr::USER_DEFINED;
            }
        }
        // gemma4: "</s>" is not an end of generation when "<|tool_response>" exists.
        if has(&eog, "<|tool_response>") {
            if let Some(s) = lookup("</s>").filter(|id| eog.contains(id)) {
                eog.retain(|&id| id != s);
                attrs[s as usize] = attr::NORMAL;
            }
        }

        let mut specials: Vec<u32> = (0..n as u32)
            .filter(|&id| {
                attrs[id as usize] & (attr::CONTROL | attr::USER_DEFINED | attr::UNKNOWN) != 0
            })
            .collect();
        specials.sort_by(|&a, &b| {
            let (la, lb) = (tokens[a as usize].len(), tokens[b as usize].len());
            lb.cmp(&la).then(a.cmp(&b))
        });

        Ok(Self {
            tokens,
            attrs,
            scores,
            token_to_id,
            specials,
            eog,
            bos: in_range(spec.bos_token_id),
            eos,
            eot,
            unk: in_range(spec.unknown_token_id),
            pad: in_range(spec.padding_token_id),
        })
    }

    pub fn len(&self) -> usize {
        self.tokens.len()
    }

    pub fn attr(&self, id: u32) -> u8 {
        self.attrs.get(id as usize).copied().unwrap_or(0)
    }

    pub fn token_type(&self, id: u32) -> Option<TokenType> {
        let a = *self.attrs.get(id as usize)?;
        Some(if a & attr::CONTROL != 0 {
            TokenType::Control
        } else if a & attr::UNKNOWN != 0 {
            TokenType::Unknown
        } else if a & attr::USER_DEFINED != 0 {
            TokenType::UserDefined
        } else if a & attr::BYTE != 0 {
            TokenType::Byte
        } else if a & attr::UNUSED != 0 {
            TokenType::Unused
        } else if a & attr::NORMAL != 0 {
            TokenType::Normal
        } else {
            TokenType::Undefined
        })
    }

    pub fn lookup(&self, text: &str) -> Option<u32> {
        self.token_to_id.get(text).copied()
    }

    /// Cuts special tokens out of `text` the way llama.cpp's `tokenizer_st_partition` does: each
    /// special token, longest first, splits every text fragment left at each of its occurrences.
    /// User-defined tokens are always cut out; control and unknown ones only with `parse_special`.
    pub fn partition<'a>(&self, text: &'a str, parse_special: bool) -> Vec<Fragment<'a>> {
        let mut frags = Vec::new();
        if text.is_empty() {
            return frags;
        }
        frags.push(Fragment::Text(text));
        for &id in &self.specials {
            if !parse_special && self.attr(id) & (attr::CONTROL | attr::UNKNOWN) != 0 {
                continue;
            }
            let needle = self.tokens[id as usize].as_str();
            let hit = frags
                .iter()
                .any(|f| matches!(f, Fragment::Text(t) if t.contains(needle)));
            if !hit {
                continue;
            }
            let mut next = Vec::with_capacity(frags.len() + 2);
            for frag in frags {
                let Fragment::Text(mut rest) = frag else {
                    next.push(frag);
                    continue;
                };
                while let Some(at) = rest.find(needle) {
                    if at > 0 {
                        next.push(Fragment::Text(&rest[..at]));
                    }
                    next.push(Fragment::Token(id));
                    rest = &rest[at + needle.len()..];
                }
                if !rest.is_empty() {
                    next.push(Fragment::Text(rest));
                }
            }
            frags = next;
        }
        frags
    }
}
