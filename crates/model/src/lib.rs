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
