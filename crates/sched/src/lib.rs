//! Continuous-batching scheduler for quire (pure CPU, no model), after vLLM v1's `Scheduler`.
//!
//! There are no prefill and decode phases. Every request has its known tokens (prompt plus the
//! outputs so far) and `num_computed_tokens`; each [`Scheduler::schedule`] call hands out new
//! tokens to compute under a token budget (`max_num_batched_tokens`) and a cap on running requests
//! (`max_num_seqs`). A decode is simply a request with one uncomputed token; a long prompt is
//! computed in chunks over several steps (chunked prefill), so decodes never stall behind it.
//! When the KV cache runs out, the most recently admitted running request is preempted (its
//! blocks freed, to be recomputed later — with prefix caching, mostly from cache).
//!
//! Speculative decoding: the engine may attach up to K proposed tokens to a request in decode
//! ([`Scheduler::set_spec_tokens`]). Its next step then feeds the last known token plus the
//! proposals (1 + K tokens against the budget and the KV cache), the engine reports the accepted
//! proposals plus one token of its own ([`Scheduler::update_from_output_multi`]), and the blocks
//! past the accepted tokens go back to the pool. Proposals are never hashed into the prefix
//! cache: only blocks full of known tokens are.
//!
//! One step is: `schedule()` → the engine runs the model on the scheduled tokens and samples for
//! every [`ScheduledSeq`] with `samples == true` → `update_from_output()`. The engine must call
//! `update_from_output` before the next `schedule`.

mod request;
mod scheduler;

pub use request::RequestStatus;
pub use scheduler::Scheduler;

use quire_core::{BlockId, SeqId, TokenId};
use quire_kv::KvError;

/// Limits of the scheduler; the KV cache shape comes separately as a `quire_kv::KvCacheConfig`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SchedulerConfig {
    /// Most requests running (holding KV blocks) at once.
    pub max_num_seqs: usize,
    /// Token budget of one step, summed over all scheduled requests.
    pub max_num_batched_tokens: usize,
    /// Longest a sequence (prompt + outputs) may get; reaching it finishes with `Length`.
    pub max_model_len: usize,
    /// Optional cap on the tokens one request may compute in one step, so that a long prompt
    /// leaves budget to others even when the budget is large.
    pub long_prefill_token_threshold: Option<usize>,
}

impl SchedulerConfig {
    pub fn validate(&self) -> Result<(), SchedError> {
        let bad = |m: &str| Err(SchedError::InvalidConfig(m.to_string()));
        if self.max_num_seqs == 0 {
            return bad("max_num_seqs must be >= 1");
        }
        if self.max_num_batched_tokens == 0 {
            return bad("max_num_batched_tokens must be >= 1");
        }
        if self.max_model_len == 0 {
            return bad("max_model_len must be >= 1");
        }
        if self.long_prefill_token_threshold == Some(0) {
            return bad("long_prefill_token_threshold must be >= 1 (use None for no cap)");
        }
        Ok(())
    }
}

/// One request's share of a step.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct ScheduledSeq {
    pub seq_id: SeqId,
    /// Tokens already in the KV cache before this step (including prefix-cache hits).
    pub num_computed_tokens: usize,
    /// Tokens fed this step, proposals included.
    pub num_new_tokens: usize,
    /// The tokens to feed, at positions `num_computed_tokens..`: known tokens, then the
    /// `num_spec_tokens` proposals.
    pub token_ids: Vec<TokenId>,
    /// Proposed tokens at the end of `token_ids` (0 without speculation). The engine needs logits
    /// for the last `1 + num_spec_tokens` positions.
    pub num_spec_tokens: usize,
    /// The request's whole block table after this step's allocation.
    pub block_table: Vec<BlockId>,
    /// After this step every known token is computed: the engine samples the next token from the
    /// logits of the last fed position and reports it to `update_from_output`.
    pub samples: bool,
    /// First step after a preemption: the engine's per-request state (KV contents beyond the
    /// prefix-cache hit) must be rebuilt from these tokens.
    pub resumed_from_preemption: bool,
}

/// What one [`Scheduler::schedule`] call decided.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct SchedulerOutput {
    /// In order: running requests first (admission order), then newly admitted ones.
    pub scheduled: Vec<ScheduledSeq>,
    /// Requests preempted this step, in preemption order (their blocks are already freed).
    pub preempted: Vec<SeqId>,
    /// Sum of `num_new_tokens`; at most `max_num_batched_tokens`.
    pub num_batched_tokens: usize,
}

/// Cumulative counters of a [`Scheduler`].
#[derive(Debug, Clone, Copy, Default, PartialEq, Eq)]
pub struct SchedulerStats {
    pub num_steps: u64,
    pub num_preemptions: u64,
    /// Tokens queried against the prefix cache (see `quire_kv::KvCacheStats`).
    pub prefix_cache_queries: u64,
    /// Tokens found in the prefix cache.
    pub prefix_cache_hits: u64,
    /// Sum of `num_new_tokens` over every step so far (recomputation after preemption included).
    pub total_computed_tokens: u64,
}

#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum SchedError {
    #[error("invalid scheduler config: {0}")]
    InvalidConfig(String),
    #[error(transparent)]
    Kv(#[from] KvError),
    #[error("{0}: a request already has this id")]
    DuplicateSeq(SeqId),
    #[error("{0}: empty prompt")]
    EmptyPrompt(SeqId),
    #[error("{0}: max_tokens must be >= 1")]
    ZeroMaxTokens(SeqId),
    #[error(
        "{seq_id}: prompt of {prompt_len} tokens is longer than max_model_len {max_model_len}"
    )]
    PromptTooLong {
        seq_id: SeqId,
        prompt_len: usize,
        max_model_len: usize,
    },
    /// Even alone the request could not hold its KV: the prompt plus all but the last of its
    /// `max_tokens` outputs (capped by `max_model_len`) needs more slots than the whole cache has.
    /// Admitting it could only end in it preempting itself forever.
    #[error(
        "{seq_id}: needs KV for up to {num_tokens} tokens but the whole cache holds {num_slots}; \
         lower max_tokens or the prompt"
    )]
    NeverFits {
        seq_id: SeqId,
        num_tokens: usize,
        num_slots: usize,
    },
}
