//! [`GgufFile`]: a validated GGUF file together with the bytes it came from.
//!
//! Model weights are hundreds of megabytes to many gigabytes, so files are
//! memory-mapped rather than read; the parsed [`GgufHeader`] owns its strings
//! and the tensor data is handed out as slices of the map. Everything a slice
//! could point at was bounds-checked when the file was opened.

use std::fs::File;
use std::ops::Range;
use std::path::Path;

use memmap2::Mmap;

use crate::error::GgufError;
use crate::reader::GgufHeader;
use crate::types::TensorInfo;
use crate::value::Value;

enum Storage {
    Mmap(Mmap),
    Owned(Vec<u8>),
}

impl Storage {
    fn bytes(&self) -> &[u8] {
        match self {
            Storage::Mmap(m) => m,
            Storage::Owned(v) => v,
        }
    }
}

/// An open, validated GGUF file.
pub struct GgufFile {
    storage: Storage,
    header: GgufHeader,
}

impl std::fmt::Debug for GgufFile {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("GgufFile")
            .field("len", &self.bytes().len())
            .field("header", &self.header)
            .finish()
    }
}

impl GgufFile {
    /// Memory-maps and validates the file at `path`.
    ///
    /// The map is read-only; as with any mmap, another process truncating or
    /// rewriting the file while it is open is outside what this crate can
    /// guard against.
    pub fn open(path: impl AsRef<Path>) -> Result<GgufFile, GgufError> {
        let path = path.as_ref();
        let io = |error| GgufError::Io {
            path: path.to_owned(),
            error,
        };
        // Opening a FIFO would block until a writer appears: refuse anything but a regular file
        // before opening it.
        let meta = std::fs::metadata(path).map_err(io)?;
        if !meta.is_file() {
            return Err(io(std::io::Error::new(
                std::io::ErrorKind::InvalidInput,
                "not a regular file (a directory, FIFO or device cannot be a GGUF model)",
            )));
        }
        let file = File::open(path).map_err(io)?;
        let len = file.metadata().map_err(io)?.len();
        let storage = if len == 0 {
            // Mapping an empty file fails on some platforms; it is invalid anyway.
            Storage::Owned(Vec::new())
        } else {
            // SAFETY: the map is only read. The file must not be modified while
            // mapped (documented above); that is the usual mmap contract.
            Storage::Mmap(unsafe { Mmap::map(&file) }.map_err(io)?)
        };
        let header = GgufHeader::parse(storage.bytes())?;
        Ok(GgufFile { storage, header })
    }

    /// Validates an in-memory file (tests, downloads held in memory).
    pub fn from_bytes(bytes: Vec<u8>) -> Result<GgufFile, GgufError> {
        let header = GgufHeader::parse(&bytes)?;
        Ok(GgufFile {
            storage: Storage::Owned(bytes),
            header,
        })
    }

    /// Validates `bytes` as a whole GGUF file without taking ownership.
    pub fn parse(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
        GgufHeader::parse(bytes)
    }

    /// The parsed header (metadata and tensor infos).
    pub fn header(&self) -> &GgufHeader {
        &self.header
    }

    /// The whole file.
    pub fn bytes(&self) -> &[u8] {
        self.storage.bytes()
    }

    /// Whether the bytes are memory-mapped (as opposed to owned in memory).
    pub fn is_mmapped(&self) -> bool {
        matches!(self.storage, Storage::Mmap(_))
    }

    pub fn version(&self) -> u32 {
        self.header.version()
    }

    /// `general.alignment`, default 32; always a power of two.
    pub fn alignment(&self) -> u64 {
        self.header.alignment()
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        self.header.metadata()
    }

    pub fn get(&self, key: &str) -> Option<&Value> {
        self.header.get(key)
    }

    /// See [`GgufHeader::get_u32`].
    pub fn get_u32(&self, key: &str) -> Result<Option<u32>, GgufError> {
        self.header.get_u32(key)
    }

    pub fn get_u64(&self, key: &str) -> Result<Option<u64>, GgufError> {
        self.header.get_u64(key)
    }

    pub fn get_i64(&self, key: &str) -> Result<Option<i64>, GgufError> {
        self.header.get_i64(key)
    }

    pub fn get_f32(&self, key: &str) -> Result<Option<f32>, GgufError> {
        self.header.get_f32(key)
    }

    pub fn get_bool(&self, key: &str) -> Result<Option<bool>, GgufError> {
        self.header.get_bool(key)
    }

    pub fn get_str(&self, key: &str) -> Result<Option<&str>, GgufError> {
        self.header.get_str(key)
    }

    pub fn get_str_array(&self, key: &str) -> Result<Option<Vec<&str>>, GgufError> {
        self.header.get_str_array(key)
    }

    pub fn get_i32_array(&self, key: &str) -> Result<Option<Vec<i32>>, GgufError> {
        self.header.get_i32_array(key)
    }

    pub fn get_u32_array(&self, key: &str) -> Result<Option<Vec<u32>>, GgufError> {
        self.header.get_u32_array(key)
    }

    pub fn get_f32_array(&self, key: &str) -> Result<Option<Vec<f32>>, GgufError> {
        self.header.get_f32_array(key)
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        self.header.tensors()
    }

    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.header.tensor(name)
    }

    /// Absolute file offset of the tensor data section.
    pub fn data_offset(&self) -> u64 {
        self.header.data_offset()
    }

    fn data_range(&self, t: &TensorInfo) -> Option<Range<usize>> {
        let start = self.header.data_offset().checked_add(t.offset)?;
        let end = start.checked_add(t.checked_size_bytes()?)?;
        let range = usize::try_from(start).ok()?..usize::try_from(end).ok()?;
        (range.end <= self.bytes().len()).then_some(range)
    }

    /// The data of `t`, exactly `t.size_bytes()` bytes, or an error if `t`
    /// does not describe data inside this file (only possible for a
    /// `TensorInfo` that did not come from this file).
    pub fn try_tensor_data(&self, t: &TensorInfo) -> Result<&[u8], GgufError> {
        match self.data_range(t) {
            Some(r) => Ok(&self.bytes()[r]),
            None => {
                let start = u128::from(self.data_offset()) + u128::from(t.offset);
                Err(GgufError::TensorOutOfBounds {
                    name: t.name.clone(),
                    start,
                    end: start + u128::from(t.size_bytes()),
                    file_len: self.bytes().len() as u64,
                })
            }
        }
    }

    /// The data of `t`, exactly `t.size_bytes()` bytes.
    ///
    /// # Panics
    /// If `t` did not come from this file and lies outside it; infos from
    /// [`GgufFile::tensors`] were bounds-checked at open and never panic.
    pub fn tensor_data(&self, t: &TensorInfo) -> &[u8] {
        match self.try_tensor_data(t) {
            Ok(data) => data,
            Err(e) => panic!("GgufFile::tensor_data called with a foreign TensorInfo: {e}"),
        }
    }
}
