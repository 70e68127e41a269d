//! Tokenizers and chat templates for quire, built from GGUF metadata.
//!
//! The model crate reads the `tokenizer.ggml.*` keys into a plain [`TokenizerSpec`], so this crate
//! does not depend on the GGUF reader. Two tokenizer families are implemented, matching llama.cpp
//! (whose outputs are the reference quire is checked against):
//!
//! - `"gpt2"`: byte-level BPE built at run time with the `tokenizers` crate, with the regex
//!   pre-tokenizer that llama.cpp uses for the file's `tokenizer.ggml.pre`;
//! - `"llama"`: SentencePiece-style BPE driven by token scores, with byte fallback.
//!
//! Special tokens are cut out of the text first (llama.cpp's rules), the end-of-generation set is
//! llama.cpp's, and [`ChatTemplate`] renders `tokenizer.chat_template` as Hugging Face does.

mod bpe;
mod chat;
mod error;
pub mod hf;
mod pyfns;
mod spec;
mod spm;
mod stream;
mod tokenizer;
mod vocab;

pub use chat::{
    encode_chat, encode_chat_opts, ChatMessage, ChatOptions, ChatTemplate, TEMPLATE_FUEL,
};
pub use error::TokenizerError;
pub use quire_core::TokenId;
pub use spec::{TokenType, TokenizerSpec};
pub use stream::StreamDecoder;
pub use tokenizer::Tokenizer;
