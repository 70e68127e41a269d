//! Shared vocabulary of quire: ids as newtypes (so a block id can never be passed where a token id is
//! expected), sampling parameters and the reasons a sequence stops. Every other crate depends on this
//! one and it depends on nothing heavy.

use serde::{Deserialize, Serialize};

pub mod config;
pub mod default_model;
pub mod fs;
pub use config::{Architecture, ModelConfig, MoeConfig, RopeStyle};

/// A token id in the model's vocabulary.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[repr(transparent)]
pub struct TokenId(pub u32);

/// A physical block of the paged KV cache.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[repr(transparent)]
pub struct BlockId(pub u32);

/// A sequence (request) known to the engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash, PartialOrd, Ord, Serialize, Deserialize)]
#[serde(transparent)]
#[repr(transparent)]
pub struct SeqId(pub u64);

impl TokenId {
    pub fn as_usize(self) -> usize {
        self.0 as usize
    }
}

impl BlockId {
    pub fn as_usize(self) -> usize {
        self.0 as usize
    }
}

/// The KV-cache slot of token position `pos` of a sequence whose blocks are `block_table`, each
/// holding `block_size` tokens: the one place that maps logical positions to physical slots
/// (vLLM's `slot_mapping`), shared by the engine, the backends and the toolkit.
///
/// Panics if `block_table` does not cover `pos`; callers check coverage first
/// (`ForwardBatch::validate` does for batches).
#[inline]
pub fn slot(block_table: &[BlockId], pos: usize, block_size: usize) -> usize {
    block_table[pos / block_size].as_usize() * block_size + pos % block_size
}

impl std::fmt::Display for SeqId {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "seq{}", self.0)
    }
}

/// Most alternatives a request may ask for per token (OpenAI's limit).
pub const MAX_TOP_LOGPROBS: usize = 20;

/// How the next token is chosen. Defaults are greedy (temperature 0) with no penalties.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(default)]
pub struct SamplingParams {
    /// 0 means greedy (argmax).
    pub temperature: f32,
    /// 0 means disabled.
    pub top_k: usize,
    /// 1.0 means disabled.
    pub top_p: f32,
    /// 0.0 means disabled.
    pub min_p: f32,
    /// 1.0 means disabled; applied llama.cpp-style to the last `repeat_last_n` tokens.
    pub repetition_penalty: f32,
    pub repeat_last_n: usize,
    pub presence_penalty: f32,
    pub frequency_penalty: f32,
    /// Seed of this request's own random stream; `None` picks one from the clock.
    pub seed: Option<u64>,
    pub max_tokens: usize,
    pub stop: Vec<String>,
    pub ignore_eos: bool,
    /// Report each sampled token's log-probability (costs an exp over the vocabulary per token).
    pub logprobs: bool,
    /// Most likely alternatives to report with each token's log-probability (0 = none, at most 20).
    pub top_logprobs: usize,
    /// Structured output: every sampled token keeps the text a prefix of this grammar's language
    /// (the engine masks the other tokens out before sampling).
    pub constraint: Option<Constraint>,
    /// Let the engine speculate for this request when it has speculative decoding on (false opts
    /// out; outputs are the same either way, only the speed differs).
    pub speculative: bool,
}

/// A grammar the output must follow (OpenAI's `response_format`, and the regex and grammar forms
/// of vLLM and llama.cpp). Compiled by the engine against the model's vocabulary.
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(tag = "type", content = "value", rename_all = "snake_case")]
pub enum Constraint {
    /// Any JSON object (`{"type": "json_object"}`).
    JsonObject,
    /// A JSON Schema, as JSON text.
    JsonSchema(String),
    /// A regular expression the whole output matches.
    Regex(String),
    /// A grammar in llguidance's Lark-like syntax (a superset of Lark; see the README).
    Lark(String),
}

impl Constraint {
    /// The request field it came from, for error messages.
    pub fn field(&self) -> &'static str {
        match self {
            Constraint::JsonObject | Constraint::JsonSchema(_) => "response_format",
            Constraint::Regex(_) => "regex",
            Constraint::Lark(_) => "grammar",
        }
    }
}

impl Default for SamplingParams {
    fn default() -> Self {
        Self {
            temperature: 0.0,
            top_k: 0,
            top_p: 1.0,
            min_p: 0.0,
            repetition_penalty: 1.0,
            repeat_last_n: 64,
            presence_penalty: 0.0,
            frequency_penalty: 0.0,
            seed: None,
            max_tokens: 256,
            stop: Vec::new(),
            ignore_eos: false,
            logprobs: false,
            top_logprobs: 0,
            constraint: None,
            speculative: true,
        }
    }
}

impl SamplingParams {
    pub fn is_greedy(&self) -> bool {
        self.temperature <= 0.0
    }

    /// Checks ranges; the message names the offending field.
    pub fn validate(&self) -> Result<(), String> {
        if !(self.temperature.is_finite() && self.temperature >= 0.0) {
            return Err(format!(
                "temperature must be >= 0, got {}",
                self.temperature
            ));
        }
        if !(self.top_p > 0.0 && self.top_p <= 1.0) {
            return Err(format!("top_p must be in (0, 1], got {}", self.top_p));
        }
        if !(self.min_p >= 0.0 && self.min_p <= 1.0) {
            return Err(format!("min_p must be in [0, 1], got {}", self.min_p));
        }
        if !(self.repetition_penalty.is_finite() && self.repetition_penalty > 0.0) {
            return Err(format!(
                "repetition_penalty must be > 0, got {}",
                self.repetition_penalty
            ));
        }
        if !self.presence_penalty.is_finite() || !self.frequency_penalty.is_finite() {
            return Err("presence/frequency penalties must be finite".into());
        }
        if self.top_logprobs > MAX_TOP_LOGPROBS {
            return Err(format!(
                "top_logprobs must be at most {MAX_TOP_LOGPROBS}, got {}",
                self.top_logprobs
            ));
        }
        Ok(())
    }
}

/// Why a sequence stopped.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum FinishReason {
    /// End-of-sequence token or a stop string.
    Stop,
    /// `max_tokens` reached, or the context is full.
    Length,
    /// Aborted by the caller.
    Abort,
    /// The request's grammar admits no further token and does not accept the output as complete
    /// (a dead end: the output is a prefix of the grammar's language that cannot be finished).
    Grammar,
}

impl FinishReason {
    pub fn as_str(self) -> &'static str {
        match self {
            FinishReason::Stop => "stop",
            FinishReason::Length => "length",
            FinishReason::Abort => "abort",
            FinishReason::Grammar => "grammar",
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn slot_maps_positions_through_the_block_table() {
        let table = [BlockId(7), BlockId(2), BlockId(5)];
        // Block size 4: positions 0..4 in block 7, 4..8 in block 2, 8..12 in block 5.
        let got: Vec<usize> = (0..12).map(|p| slot(&table, p, 4)).collect();
        assert_eq!(got, [28, 29, 30, 31, 8, 9, 10, 11, 20, 21, 22, 23]);
        // Block size 1: the table itself.
        assert_eq!(slot(&table, 2, 1), 5);
        // Every position of a table of distinct blocks lands in a distinct slot of its block.
        let bs = 16;
        let table: Vec<BlockId> = [3u32, 0, 9, 1].map(BlockId).to_vec();
        let mut seen = std::collections::HashSet::new();
        for p in 0..table.len() * bs {
            let s = slot(&table, p, bs);
            assert_eq!(s / bs, table[p / bs].as_usize());
            assert!(seen.insert(s), "slot {s} used twice");
        }
    }

    #[test]
    #[should_panic]
    fn slot_past_the_table_panics() {
        slot(&[BlockId(0)], 16, 16);
    }

    #[test]
    fn validate_rejects_bad_ranges() {
        let ok = SamplingParams::default();
        assert!(ok.validate().is_ok());
        let bad = SamplingParams {
            top_p: 0.0,
            ..ok.clone()
        };
        assert!(bad.validate().unwrap_err().contains("top_p"));
        let bad = SamplingParams {
            temperature: f32::NAN,
            ..ok
        };
        assert!(bad.validate().unwrap_err().contains("temperature"));
    }
}
