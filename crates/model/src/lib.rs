//! Models as quire loads them: the architecture's config, its weights as host tensors (still in
//! their stored types, memory-mapped), its tokenizer and chat template. Backends consume
//! `ModelWeights`; the engine consumes the tokenizer and template.

pub mod gguf_loader;
pub mod hf;
pub mod hf_fixture;

pub use gguf_loader::{load_gguf, LoadedModel, ModelMeta};
pub use hf::{is_hf_folder, load_hf};
pub use quire_core::default_model::{
    default_model_path, resolve_model_path, DEFAULT_MODEL_FILE, DEFAULT_MODEL_SHA256,
};

/// Loads a model from a GGUF file or an HF model folder (a directory with `config.json`).
pub fn load(path: &std::path::Path) -> Result<LoadedModel, ModelError> {
    if !path.is_dir() {
        regular_file(path)?;
    }
    if path.is_dir() {
        if !is_hf_folder(path) {
            return Err(ModelError::Io {
                path: path.display().to_string(),
                msg: "a directory without config.json is not an HF model folder".into(),
            });
        }
        load_hf(path)
    } else {
        load_gguf(path)
    }
}

/// `Ok` when `path` is a regular file, else an error naming it and what it is (a FIFO would
/// block the open forever). Every model file, shard, tokenizer and config is checked first.
pub fn regular_file(path: &std::path::Path) -> Result<(), ModelError> {
    quire_core::fs::regular_file(path).map_err(|e| ModelError::Io {
        path: path.display().to_string(),
        msg: e.to_string(),
    })
}

/// Wrapped errors are either `transparent` (their message and causes are the inner error's) or
/// carry the inner message in their own text without exposing it as `source()`: a caller printing
/// the chain of causes (anyhow's `{:#}`) then shows each cause once.
#[derive(Debug, thiserror::Error)]
pub enum ModelError {
    #[error(transparent)]
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
    Tokenizer(quire_tokenizer::TokenizerError),
    #[error(transparent)]
    Backend(#[from] quire_backend::BackendError),
    #[error(transparent)]
    Fetch(#[from] quire_core::default_model::FetchError),
}

impl From<quire_tokenizer::TokenizerError> for ModelError {
    fn from(e: quire_tokenizer::TokenizerError) -> Self {
        ModelError::Tokenizer(e)
    }
}
