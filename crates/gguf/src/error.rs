//! The one error type of this crate.
//!
//! GGUF files come from the network and from third-party converters, so every
//! problem is reported rather than panicked on. Each message is a single line
//! that names what is wrong and where: a byte offset into the file, a metadata
//! key or a tensor name. Strings taken from the file (keys, tensor names) are
//! printed with `{:?}` so that control characters in a corrupt file cannot
//! break a message over several lines.

use std::path::PathBuf;

use crate::types::GgmlType;

/// Everything that can go wrong reading, validating, writing or converting GGUF data.
#[derive(Debug, thiserror::Error)]
#[non_exhaustive]
pub enum GgufError {
    /// The file could not be opened, mapped, read or written, or is not a regular file. The
    /// message carries the I/O error's text; it is not also exposed as `source()`, so a chain of
    /// causes printed by the caller does not repeat it.
    #[error("I/O error on {path:?}: {error}")]
    Io {
        path: PathBuf,
        error: std::io::Error,
    },

    /// Writing to a caller-supplied sink failed (the I/O error's text is in the message only).
    #[error("I/O error while writing GGUF data: {0}")]
    Write(std::io::Error),

    /// The first four bytes are not `GGUF`.
    #[error("not a GGUF file: magic at offset 0 is {found:02x?}, expected \"GGUF\"")]
    BadMagic { found: [u8; 4] },

    /// A version other than 2 or 3 (version 1 used 32-bit counts and is obsolete).
    #[error("unsupported GGUF version {version} at offset 4 (supported: 2, 3){hint}")]
    UnsupportedVersion { version: u32, hint: &'static str },

    /// The data ends before a field it promises.
    #[error(
        "file truncated at offset {offset}: {what} needs {needed} bytes, only {available} left"
    )]
    Truncated {
        offset: u64,
        needed: u64,
        available: u64,
        what: String,
    },

    /// A count or length that cannot possibly fit in the bytes that remain.
    #[error(
        "{what} at offset {offset} claims {count} items needing at least {min_bytes} bytes, \
         only {available} left"
    )]
    CountTooLarge {
        offset: u64,
        count: u64,
        min_bytes: u128,
        available: u64,
        what: String,
    },

    /// A string (key, value or tensor name) that is not valid UTF-8.
    #[error("invalid UTF-8 in {what} at offset {offset}")]
    InvalidUtf8 { offset: u64, what: String },

    /// A metadata value type id outside 0..=12.
    #[error("unknown metadata value type {type_id} for key {key:?} at offset {offset}")]
    UnknownValueType {
        offset: u64,
        type_id: u32,
        key: String,
    },

    /// A bool stored as a byte other than 0 or 1.
    #[error("metadata key {key:?}: invalid bool byte {byte} at offset {offset}")]
    InvalidBool { offset: u64, key: String, byte: u8 },

    /// Arrays of arrays deeper than [`crate::MAX_ARRAY_DEPTH`].
    #[error("metadata key {key:?}: arrays nested deeper than {max} levels at offset {offset}")]
    NestingTooDeep {
        offset: u64,
        key: String,
        max: usize,
    },

    /// The same metadata key twice.
    #[error("duplicate metadata key {key:?} at offset {offset}")]
    DuplicateKey { offset: u64, key: String },

    /// The same tensor name twice.
    #[error("duplicate tensor name {name:?} at offset {offset}")]
    DuplicateTensor { offset: u64, name: String },

    /// `general.alignment` is zero, not a power of two, or not a `u32`.
    #[error("invalid general.alignment {value}: {reason}")]
    BadAlignment { value: String, reason: &'static str },

    /// A typed metadata getter found a value of another type.
    #[error("metadata key {key:?} has type {found}, expected {expected}")]
    WrongType {
        key: String,
        expected: &'static str,
        found: String,
    },

    /// A typed metadata getter found an integer that does not fit the requested type.
    #[error("metadata key {key:?}: value {value} does not fit in {expected}")]
    OutOfRange {
        key: String,
        value: String,
        expected: &'static str,
    },

    /// More than four dimensions.
    #[error("tensor {name:?} at offset {offset}: {n_dims} dimensions, at most {max} supported")]
    TooManyDims {
        offset: u64,
        name: String,
        n_dims: u32,
        max: usize,
    },

    /// A tensor type id that ggml does not define (or this crate does not know).
    #[error("tensor {name:?} at offset {offset}: unknown ggml type id {type_id}")]
    UnknownTensorType {
        offset: u64,
        name: String,
        type_id: u32,
    },

    /// Negative-as-signed dims, an element count overflowing 63 bits, or a row
    /// length that is not a multiple of the type's block size.
    #[error("tensor {name:?}: invalid shape {dims:?} for {dtype}: {reason}")]
    BadShape {
        name: String,
        dims: Vec<u64>,
        dtype: GgmlType,
        reason: &'static str,
    },

    /// A tensor data offset that is not a multiple of the file alignment.
    #[error(
        "tensor {name:?}: data offset {offset} is not a multiple of the alignment {alignment}"
    )]
    MisalignedTensor {
        name: String,
        offset: u64,
        alignment: u64,
    },

    /// Tensor data that does not lie inside the file.
    #[error(
        "tensor {name:?}: data at file bytes {start}..{end} lies outside the file ({file_len} bytes)"
    )]
    TensorOutOfBounds {
        name: String,
        start: u128,
        end: u128,
        file_len: u64,
    },

    /// The header is valid but the data section start overflows.
    #[error("data section offset overflows: tensor infos end at {end}, alignment {alignment}")]
    DataOffsetOverflow { end: u64, alignment: u64 },

    /// An operation (quantize, dequantize, ...) that is not implemented for a type.
    #[error("{op} is not implemented for {dtype}")]
    Unsupported { dtype: GgmlType, op: &'static str },

    /// A buffer of the wrong size for the requested operation.
    #[error("{what}: expected {expected} {unit}, got {got}")]
    LengthMismatch {
        what: String,
        expected: u64,
        got: u64,
        unit: &'static str,
    },

    /// An element count that is not a whole number of blocks.
    #[error("{op} {dtype}: {n} elements is not a multiple of the block size {block_size}")]
    NotBlockMultiple {
        op: &'static str,
        dtype: GgmlType,
        n: usize,
        block_size: usize,
    },

    /// A byte slice that cannot be viewed as a slice of blocks.
    #[error("cannot view {len} bytes at address {addr:#x} as [{ty}]: {reason}")]
    BadCast {
        ty: &'static str,
        len: usize,
        addr: usize,
        reason: &'static str,
    },

    /// Invalid input to [`crate::GgufWriter`].
    #[error("GGUF writer: {0}")]
    Writer(String),
}

impl GgufError {
    pub(crate) fn truncated(offset: usize, needed: u64, available: usize, what: &str) -> Self {
        GgufError::Truncated {
            offset: offset as u64,
            needed,
            available: available as u64,
            what: what.to_owned(),
        }
    }
}
