//! `quire-gguf`: reading and writing GGUF model files, and the ggml block
//! formats their tensors are stored in.
//!
//! GGUF is the single-file format of llama.cpp: a header, typed key/value
//! metadata, a table of tensor descriptors, then aligned tensor data. quire
//! loads models from it, so this crate is the trust boundary for everything a
//! downloaded file claims: [`GgufFile::open`] validates the whole header and
//! bounds-checks every tensor before handing out any data, and bad input is
//! an error ([`GgufError`]), never a panic. See `reader.rs` for the rules.
//!
//! Layout: `reader` (parsing and validation), `getters` (typed metadata
//! access), `file` (the mmap-owning [`GgufFile`]), `value` (metadata values),
//! `types` (ggml types and [`TensorInfo`]), `quant` (block structs and the
//! reference (de)quantizers), `kquant` (the Q4_K/Q5_K/Q6_K super-block formats), `writer` ([`GgufWriter`]).

mod error;
mod file;
mod getters;
mod kquant;
mod quant;
mod reader;
mod types;
mod value;
mod writer;

pub use error::GgufError;
pub use file::GgufFile;
pub use kquant::{scale_min_k4, BlockQ4K, BlockQ5K, BlockQ6K, K_SCALE_SIZE, QK_K};
pub use quant::{
    blocks_as_bytes, cast_blocks, dequantize_row, f32_to_bf16, quantize_row, BlockQ4_0, BlockQ4_1,
    BlockQ8_0, Pod, QK,
};
pub use reader::{
    GgufHeader, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS,
};
pub use types::{GgmlType, TensorInfo};
pub use value::Value;
pub use writer::GgufWriter;
