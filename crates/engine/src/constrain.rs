//! Structured outputs: a request's grammar (a JSON Schema, any JSON object, a regular expression
//! or a Lark-like grammar) becomes, before each token, the set of tokens that keep the output a
//! prefix of the grammar's language; the engine sets every other logit to −∞ before sampling.
//!
//! The grammar work is llguidance's (the library llama.cpp, vLLM and mistral.rs use). What lives
//! here is the bridge to quire's tokenizer: the token trie llguidance walks is built from the
//! tokenizer's own byte strings (special tokens carry llguidance's 0xFF marker so no text grammar
//! can produce them), and the model's end-of-generation tokens all count as the grammar's EOS.

use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use quire_core::{Constraint, TokenId};
use quire_tokenizer::Tokenizer;

use crate::EngineError;

/// The tokenizer as llguidance sees it.
struct QuireTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for QuireTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Used for tokens the grammar forces: the tokenizer's own encoding where the bytes are text,
    /// the trie's greedy split where they are not.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false, false) {
                Ok(ids) => ids.into_iter().map(|t| t.0).collect(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars against one tokenizer. Building it walks the whole vocabulary (tens of
/// milliseconds for 50k tokens), so an engine makes one, the first time a request needs it.
pub struct Grammars {
    factory: ParserFactory,
    /// Every token that ends generation (the tokenizer's stop tokens): allowed wherever the
    /// grammar allows its EOS.
    stop_tokens: Vec<TokenId>,
}

impl Grammars {
    pub fn new(tokenizer: &Arc<Tokenizer>) -> Result<Self, EngineError> {
        let vocab = tokenizer.vocab_size();
        let stop_tokens = tokenizer.stop_tokens();
        let eos = stop_tokens
            .first()
            .or(tokenizer.eos().as_ref())
            .map_or(0, |t| t.0);
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let id = TokenId(id);
                match tokenizer.token_bytes(id) {
                    Some(b) if !tokenizer.is_special(id) && !b.is_empty() => b,
                    _ => {
                        // A control or unknown token: a name no text can spell.
                        let name = tokenizer.token_str(id).unwrap_or("<unk>");
                        let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                        w.extend_from_slice(format!("{name}[{}]", id.0).as_bytes());
                        w
                    }
                }
            })
            .collect();
        let info = TokRxInfo {
            tok_eos: eos,
            tok_bos: tokenizer.bos().map(|t| t.0),
            tok_pad: tokenizer.pad().map(|t| t.0),
            tok_unk: tokenizer.unk().map(|t| t.0),
            tok_end_of_turn: tokenizer.eot().map(|t| t.0),
            ..TokRxInfo::new(vocab as u32, eos)
        };
        let env: TokEnv = Arc::new(QuireTokEnv {
            trie: TokTrie::from(&info, &words),
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| EngineError::Constraint {
            field: "grammar",
            message: format!("the tokenizer could not be prepared for grammars: {e}"),
        })?;
        factory.quiet();
        Ok(Self {
            factory,
            stop_tokens,
        })
    }

    /// A fresh matcher for `c`, or the reason the grammar is refused (naming the request field).
    pub fn compile(&self, c: &Constraint) -> Result<Guide, EngineError> {
        let refuse = |message: String| EngineError::Constraint {
            field: c.field(),
            message,
        };
        let grammar = match c {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            Constraint::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| refuse(format!("the JSON schema is not valid JSON: {e}")))?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(refuse("a JSON schema is an object or a boolean".into()));
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| refuse(format!("the grammar is not accepted: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(refuse(format!("the grammar is not accepted: {e}")));
        }
        Ok(Guide { matcher })
    }

    /// Sets every logit the mask forbids to −∞ (tokens past the tokenizer's vocabulary, which a
    /// padded output layer may have, included); the grammar's EOS allows every stop token.
    /// Returns how many tokens stay allowed.
    pub fn apply(&self, mask: &SimpleVob, logits: &mut [f32]) -> usize {
        let eos_ok = self
            .stop_tokens
            .first()
            .is_some_and(|t| mask.is_allowed(t.0));
        let kept: Vec<(usize, f32)> = if eos_ok {
            self.stop_tokens
                .iter()
                .filter_map(|t| Some((t.as_usize(), *logits.get(t.as_usize())?)))
                .collect()
        } else {
            Vec::new()
        };
        let known = mask.len().min(logits.len());
        let mut allowed = 0;
        for (i, l) in logits[..known].iter_mut().enumerate() {
            if mask.is_allowed(i as u32) {
                allowed += 1;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        logits[known..].fill(f32::NEG_INFINITY);
        for (i, v) in kept {
            if logits[i] == f32::NEG_INFINITY {
                allowed += 1;
            }
            logits[i] = v;
        }
        allowed
    }

    pub fn is_stop_token(&self, t: TokenId) -> bool {
        self.stop_tokens.contains(&t)
    }
}

/// One request's grammar state.
#[derive(Clone)]
pub struct Guide {
    matcher: Matcher,
}

impl Guide {
    /// The tokens allowed next, or why there are none (the grammar's own error).
    pub fn mask(&mut self) -> Result<SimpleVob, String> {
        self.matcher.compute_mask().map_err(|e| e.to_string())
    }

    /// Advances past a sampled token.
    pub fn consume(&mut self, t: TokenId) -> Result<(), String> {
        self.matcher.consume_token(t.0).map_err(|e| e.to_string())
    }

    /// The grammar is complete and admits nothing more (only EOS would follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }
}
