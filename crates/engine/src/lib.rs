//! The engine: requests in, streamed tokens and text out. One thread owns all of its state (the
//! scheduler, the executor with its KV cache, each request's sampler and detokenizer); the server
//! talks to that thread over channels. `runner` turns a scheduler step into a backend batch.

pub mod constrain;
pub mod draft;
pub mod engine;
pub mod lookup;
pub mod proposer;
pub mod runner;
pub mod sampler;
pub mod spec;
pub mod spec_prompts;
pub mod stop;

pub use draft::DraftModel;
pub use engine::{Engine, EngineConfig, EngineStats, RequestOutput, RequestTimings};
pub use proposer::{NgramProposer, ProposalRow, Proposer, ProposerStats};
pub use sampler::{Sampled, Sampler};
pub use spec::SpecConfig;

#[derive(Debug, thiserror::Error)]
pub enum EngineError {
    #[error("{0}")]
    Backend(#[from] quire_backend::BackendError),
    #[error("{0}")]
    Sched(#[from] quire_sched::SchedError),
    #[error("invalid request: {0}")]
    InvalidRequest(String),
    /// A request's grammar (`response_format`, `regex` or `grammar`) is refused.
    #[error("invalid `{field}`: {message}")]
    Constraint {
        field: &'static str,
        message: String,
    },
    /// The draft model of speculative decoding cannot be used with this target.
    #[error("draft model: {0}")]
    Draft(String),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] quire_tokenizer::TokenizerError),
}
