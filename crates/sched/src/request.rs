//! A request as the scheduler tracks it: its tokens and how far its KV has been computed.

use quire_core::TokenId;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum RequestStatus {
    /// In the waiting queue; holds no KV blocks and `num_computed_tokens == 0`.
    Waiting,
    /// Admitted; holds a block table covering `num_computed_tokens`.
    Running,
}

#[derive(Debug, Clone)]
pub(crate) struct Request {
    /// Prompt followed by the outputs so far.
    pub all_token_ids: Vec<TokenId>,
    pub num_prompt_tokens: usize,
    pub max_tokens: usize,
    pub num_computed_tokens: usize,
    pub status: RequestStatus,
    /// Preempted and not admitted again since.
    pub preempted: bool,
    /// Proposed continuation (speculative decoding) to verify in the next decode step; not
    /// known tokens until the engine accepts them.
    pub spec_token_ids: Vec<TokenId>,
}

impl Request {
    pub fn new(prompt: Vec<TokenId>, max_tokens: usize) -> Self {
        Self {
            num_prompt_tokens: prompt.len(),
            all_token_ids: prompt,
            max_tokens,
            num_computed_tokens: 0,
            status: RequestStatus::Waiting,
            preempted: false,
            spec_token_ids: Vec::new(),
        }
    }

    pub fn num_tokens(&self) -> usize {
        self.all_token_ids.len()
    }

    pub fn num_output_tokens(&self) -> usize {
        self.num_tokens() - self.num_prompt_tokens
    }

    /// Known tokens whose KV is not computed yet.
    pub fn num_uncomputed_tokens(&self) -> usize {
        self.num_tokens() - self.num_computed_tokens
    }
}
