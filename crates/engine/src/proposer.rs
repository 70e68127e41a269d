//! The proposer interface of speculative decoding. The engine step asks one proposer for guesses
//! for every row that may speculate and verifies whatever comes back the same way, so it does not
//! care whether the guesses come from prompt lookup ([`NgramProposer`]) or from a smaller model
//! ([`crate::draft::DraftModel`]). Both propose a single token per position (a point mass), which is
//! what the rejection sampling in [`crate::spec`] assumes.

use std::collections::HashMap;

use quire_core::{SeqId, TokenId};

use crate::lookup::CopyTracker;
use crate::spec::SpecConfig;
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

/// Prompt lookup: the continuation of the earlier text the output is copying, followed per
/// sequence across steps ([`CopyTracker`]: it resumes past an edited span and proposes fewer
/// tokens after a miss).
#[derive(Debug, Default)]
pub struct NgramProposer {
    copies: HashMap<SeqId, CopyTracker>,
    /// Every row proposes its full K ([`CopyTracker::new`]).
    full_guesses: bool,
}

impl NgramProposer {
    /// The proposer for an executor named `backend`. On the CPU a wider verify step costs more
    /// (9 tokens ~3 one-token steps on the default model), so a copy proposes one more token
    /// than half of those it has predicted right in a row; on a GPU a step of up to 17 tokens costs about what
    /// one token does (the weights are read once either way), so a wasted guess costs nothing
    /// and it proposes the full K (on an H100 the default model's edit prompt reached 1.78x
    /// with the shorter guesses against 1.83x with the full K of a stateless lookup).
    pub fn for_backend(backend: &str) -> Self {
        Self {
            copies: HashMap::new(),
            full_guesses: backend != "cpu",
        }
    }
}

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
            .map(|r| {
                let full_guesses = self.full_guesses;
                self.copies
                    .entry(r.id)
                    .or_insert_with(|| CopyTracker::new(full_guesses))
                    .propose(r.tokens, spec.ngram_min, spec.ngram_max, spec.num_tokens)
            })
            .collect())
    }

    fn release(&mut self, id: SeqId) {
        self.copies.remove(&id);
    }

    fn retain(&mut self, live: &[SeqId]) {
        self.copies.retain(|id, _| live.contains(id));
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn copy_state_is_kept_per_sequence_and_released() {
        let mut p = NgramProposer::default();
        let spec = SpecConfig {
            num_tokens: 4,
            ..SpecConfig::default()
        };
        let a: Vec<TokenId> = [1, 2, 3, 4, 5, 1].map(TokenId).to_vec();
        let b: Vec<TokenId> = [7, 8, 9, 7].map(TokenId).to_vec();
        let rows = [
            ProposalRow {
                id: SeqId(1),
                tokens: &a,
            },
            ProposalRow {
                id: SeqId(2),
                tokens: &b,
            },
        ];
        let got = p.propose(&rows, &spec).unwrap();
        // A fresh one-token match: a streak of 3, half of it plus one proposed.
        assert_eq!(got[0], [2, 3].map(TokenId).to_vec());
        assert_eq!(got[1], [8, 9].map(TokenId).to_vec());
        assert_eq!(p.copies.len(), 2);
        p.retain(&[SeqId(2), SeqId(3)]);
        assert_eq!(p.copies.keys().copied().collect::<Vec<_>>(), vec![SeqId(2)]);
        p.release(SeqId(2));
        assert!(p.copies.is_empty());
    }
}
