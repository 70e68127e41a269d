//! Errors of this crate. One enum so callers (the model loader, the server) can map every failure of
//! building a tokenizer, encoding, decoding or rendering a chat template to a single type.

use thiserror::Error;

/// Anything that can go wrong while building or using a [`crate::Tokenizer`] or a
/// [`crate::ChatTemplate`].
#[derive(Debug, Error)]
pub enum TokenizerError {
    /// `tokenizer.ggml.model` names a tokenizer family this crate does not implement.
    #[error("unsupported tokenizer model '{0}' (supported: \"gpt2\", \"llama\")")]
    UnsupportedModel(String),

    /// The spec is inconsistent (empty vocabulary, arrays of different lengths, ...).
    #[error("invalid tokenizer spec: {0}")]
    InvalidSpec(String),

    /// A token id passed to decoding is not in the vocabulary.
    #[error("token id {id} is out of range (vocabulary size {vocab_size})")]
    InvalidTokenId { id: u32, vocab_size: usize },

    /// The `tokenizers` crate failed to build or run the byte-level BPE model.
    #[error("byte-level BPE error: {0}")]
    Bpe(#[source] Box<dyn std::error::Error + Send + Sync>),

    /// A chat template failed to compile or to render (including `raise_exception` in the template).
    #[error("chat template error: {0}")]
    Template(#[from] minijinja::Error),
}
