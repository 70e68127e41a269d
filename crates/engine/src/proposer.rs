//! The proposer interface of speculative decoding. The engine step asks one proposer for guesses
//! for every row that may speculate and verifies whatever comes back the same way, so it does not
//! care whether the guesses come from prompt lookup ([`NgramProposer`]) or from a smaller model
//! ([`crate::draft::DraftModel`]). Both propose a single token per position (a point mass), which is
//! what the rejection sampling in [`crate::spec`] assumes.

use quire_core::{SeqId, TokenId};

use crate::spec::{ngram_propose, SpecConfig};
use crate::EngineError;

/// One request in decode that may speculate: all its known tokens (prompt and output so far).
pub struct ProposalRow<'a> {
    pub id: SeqId,
    pub tokens: &'a [TokenId],
}

/// What a proposer reports for metrics.
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct ProposerStats {
    /// KV blocks of the proposer's own cache in use and in all (a draft model; 0 otherwise).
    pub kv_blocks_used: usize,
    pub kv_blocks_total: usize,
    /// Rows that proposed nothing because the proposer's KV pool had no room for them.
    pub no_room: u64,
}

pub trait Proposer: Send {
    /// `"ngram"` or `"draft"`: named in metrics and `generate --json`.
    fn name(&self) -> &'static str;
    /// Up to `spec.num_tokens` guesses per row, in row order (an empty guess for a row is fine).
    fn propose(
        &mut self,
        rows: &[ProposalRow],
        spec: &SpecConfig,
    ) -> Result<Vec<Vec<TokenId>>, EngineError>;
    /// Forgets `id` (finished, aborted or preempted) and frees what it held.
    fn release(&mut self, _id: SeqId) {}
    /// Forgets every sequence not in `live`.
    fn retain(&mut self, _live: &[SeqId]) {}
    fn stats(&self) -> ProposerStats {
        ProposerStats::default()
    }
}

/// Prompt lookup: the continuation of the latest earlier occurrence of the last few tokens.
#[derive(Debug, Default)]
pub struct NgramProposer;

impl Proposer for NgramProposer {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn propose(
        &mut self,
        rows: &[ProposalRow],
        spec: &SpecConfig,
    ) -> Result<Vec<Vec<TokenId>>, EngineError> {
        Ok(rows
            .iter()
            .map(|r| ngram_propose(r.tokens, spec.ngram_min, spec.ngram_max, spec.num_tokens))
            .collect())
    }
}
