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

    /// Rendering a chat template used up its work budget (instructions and data created). Model
    /// files are untrusted: a template that loops or builds huge strings stops here.
    #[error(
        "the chat template exceeded its work limit ({fuel} units, about {fuel} instructions or \
         {mb} MB of data) and was stopped",
        mb = (fuel * 64) >> 20
    )]
    TemplateLimit { fuel: u64 },

    /// The rendered chat is longer than the caller allows (checked before tokenizing it).
    #[error("the rendered chat is {len} bytes, more than the {max} that can fit the context")]
    RenderedTooLong { len: usize, max: usize },

    /// Message content holds special-token text and the template rewrites the content, so the
    /// content's bytes cannot be found in the rendered text to keep them as plain text.
    #[error(
        "message {index} contains special-token text (such as `{token}`) and the chat template \
         changes message content, so it cannot be kept as plain text; remove that text"
    )]
    ContentNotSeparable { index: usize, token: String },
}
