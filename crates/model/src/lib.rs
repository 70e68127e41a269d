//! Models as quire loads them: the architecture's config, its weights as host tensors (still in
//! their stored types, memory-mapped), its tokenizer and chat template. Backends consume
//! `ModelWeights`; the engine consumes the tokenizer and template.

pub mod gguf_loader;

pub use gguf_loader::{load_gguf, LoadedModel, ModelMeta};
pub use quire_core::default_model::{
    default_model_path, resolve_model_path, DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256,
};

#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error("{0}")]
    Gguf(#[from] quire_gguf::GgufError),
    #[error("{path}: {msg}")]
    Io { path: String, msg: String },
    #[error("unsupported architecture '{0}' (supported: llama, qwen2, qwen3, qwen3moe, mistral)")]
    UnsupportedArch(String),
    #[error("missing metadata key {0}")]
    MissingKey(String),
    #[error("missing tensor {0}")]
    MissingTensor(String),
    #[error("bad model: {0}")]
    Invalid(String),
    #[error("tokenizer: {0}")]
    Tokenizer(#[from] quire_tokenizer::TokenizerError),
    #[error("{0}")]
    Backend(#[from] quire_backend::BackendError),
    #[error("{0}")]
    Fetch(#[from] quire_core::default_model::FetchError),
}
