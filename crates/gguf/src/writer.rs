//! GGUF writer.
//!
//! Used to produce test fixtures and converted/quantized models. It validates
//! everything the reader would reject (duplicate names, bad shapes, wrong data
//! lengths, mixed-type arrays, over-deep nesting) when an item is added, so
//! that whatever it writes can be read back by [`crate::GgufFile`], llama.cpp
//! and Python's `gguf` package. Layout: header, metadata, tensor infos,
//! padding to the alignment, then each tensor's data padded to the alignment,
//! in the order the tensors were added.

use std::collections::HashSet;
use std::fs::File;
use std::io::{BufWriter, Write};
use std::path::Path;

use crate::error::GgufError;
use crate::reader::{
    check_shape, ALIGNMENT_KEY, DEFAULT_ALIGNMENT, GGUF_MAGIC, MAX_ARRAY_DEPTH, MAX_DIMS,
};
use crate::types::{GgmlType, TensorInfo};
use crate::value::{type_id, Value};

struct PendingTensor {
    /// `offset` is filled in at write time.
    info: TensorInfo,
    data: Vec<u8>,
}

/// Builds a GGUF file in memory and writes it out.
pub struct GgufWriter {
    version: u32,
    alignment: u64,
    metadata: Vec<(String, Value)>,
    keys: HashSet<String>,
    tensors: Vec<PendingTensor>,
    names: HashSet<String>,
}

impl std::fmt::Debug for GgufWriter {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let tensors: Vec<&TensorInfo> = self.tensors.iter().map(|t| &t.info).collect();
        f.debug_struct("GgufWriter")
            .field("version", &self.version)
            .field("alignment", &self.alignment)
            .field("metadata", &self.metadata)
            .field("tensors", &tensors)
            .finish()
    }
}

impl Default for GgufWriter {
    fn default() -> Self {
        Self::new()
    }
}

fn writer_err(msg: String) -> GgufError {
    GgufError::Writer(msg)
}

/// Checks that arrays are homogeneous and not nested deeper than the reader accepts.
fn check_value(key: &str, v: &Value, depth: usize) -> Result<(), GgufError> {
    let Value::Array(items) = v else {
        return Ok(());
    };
    if depth >= MAX_ARRAY_DEPTH {
        return Err(writer_err(format!(
            "key {key:?}: arrays nested deeper than {MAX_ARRAY_DEPTH} levels"
        )));
    }
    if let Some(first) = items.first() {
        if let Some(odd) = items.iter().find(|i| i.type_id() != first.type_id()) {
            return Err(writer_err(format!(
                "key {key:?}: array mixes {} and {} elements",
                first.type_name(),
                odd.type_name()
            )));
        }
    }
    items
        .iter()
        .try_for_each(|i| check_value(key, i, depth + 1))
}

/// Counts bytes so padding can be computed while streaming.
struct Counting<W> {
    inner: W,
    pos: u64,
}

impl<W: Write> Counting<W> {
    fn put(&mut self, bytes: &[u8]) -> Result<(), GgufError> {
        self.inner.write_all(bytes).map_err(GgufError::Write)?;
        self.pos += bytes.len() as u64;
        Ok(())
    }

    fn u32(&mut self, v: u32) -> Result<(), GgufError> {
        self.put(&v.to_le_bytes())
    }

    fn u64(&mut self, v: u64) -> Result<(), GgufError> {
        self.put(&v.to_le_bytes())
    }

    fn string(&mut self, s: &str) -> Result<(), GgufError> {
        self.u64(s.len() as u64)?;
        self.put(s.as_bytes())
    }

    fn pad_to(&mut self, alignment: u64) -> Result<(), GgufError> {
        let target = self.pos.next_multiple_of(alignment);
        const ZEROS: [u8; 64] = [0; 64];
        while self.pos < target {
            let n = (target - self.pos).min(ZEROS.len() as u64) as usize;
            self.put(&ZEROS[..n])?;
        }
        Ok(())
    }

    /// A value without its type id (the caller writes that).
    fn value(&mut self, v: &Value) -> Result<(), GgufError> {
        match v {
            Value::U8(x) => self.put(&x.to_le_bytes()),
            Value::I8(x) => self.put(&x.to_le_bytes()),
            Value::U16(x) => self.put(&x.to_le_bytes()),
            Value::I16(x) => self.put(&x.to_le_bytes()),
            Value::U32(x) => self.put(&x.to_le_bytes()),
            Value::I32(x) => self.put(&x.to_le_bytes()),
            Value::U64(x) => self.put(&x.to_le_bytes()),
            Value::I64(x) => self.put(&x.to_le_bytes()),
            Value::F32(x) => self.put(&x.to_le_bytes()),
            Value::F64(x) => self.put(&x.to_le_bytes()),
            Value::Bool(x) => self.put(&[u8::from(*x)]),
            Value::String(s) => self.string(s),
            Value::Array(items) => {
                // An empty array has no element to take the type from; u8 is
                // as good as any and costs nothing.
                let elem = items.first().map_or(type_id::U8, Value::type_id);
                self.u32(elem)?;
                self.u64(items.len() as u64)?;
                items.iter().try_for_each(|i| self.value(i))
            }
        }
    }
}

impl GgufWriter {
    /// An empty version-3 file with the default alignment (32).
    pub fn new() -> Self {
        GgufWriter {
            version: 3,
            alignment: DEFAULT_ALIGNMENT,
            metadata: Vec::new(),
            keys: HashSet::new(),
            tensors: Vec::new(),
            names: HashSet::new(),
        }
    }

    /// Selects GGUF version 2 or 3 (the layout is identical for little-endian files).
    pub fn set_version(&mut self, version: u32) -> Result<&mut Self, GgufError> {
        if version != 2 && version != 3 {
            return Err(writer_err(format!(
                "cannot write GGUF version {version}, only 2 and 3"
            )));
        }
        self.version = version;
        Ok(self)
    }

    /// Sets the tensor data alignment, recording it as `general.alignment`
    /// (a `u32`, as llama.cpp requires); must be a power of two.
    pub fn set_alignment(&mut self, alignment: u64) -> Result<&mut Self, GgufError> {
        let a = u32::try_from(alignment)
            .ok()
            .filter(|a| a.is_power_of_two())
            .ok_or_else(|| {
                writer_err(format!(
                    "alignment {alignment} is not a power of two that fits in u32"
                ))
            })?;
        self.alignment = alignment;
        if let Some(entry) = self.metadata.iter_mut().find(|(k, _)| k == ALIGNMENT_KEY) {
            entry.1 = Value::U32(a);
        } else {
            self.keys.insert(ALIGNMENT_KEY.to_owned());
            self.metadata
                .push((ALIGNMENT_KEY.to_owned(), Value::U32(a)));
        }
        Ok(self)
    }

    /// Adds a metadata entry. Keys must be unique; arrays must not mix element
    /// types. `general.alignment` must be a `Value::U32` power of two and acts
    /// like [`GgufWriter::set_alignment`].
    pub fn add_metadata(
        &mut self,
        key: impl Into<String>,
        value: impl Into<Value>,
    ) -> Result<&mut Self, GgufError> {
        let key = key.into();
        let value = value.into();
        if self.keys.contains(&key) {
            return Err(writer_err(format!("duplicate metadata key {key:?}")));
        }
        if key == ALIGNMENT_KEY {
            let Value::U32(a) = value else {
                return Err(writer_err(format!(
                    "{ALIGNMENT_KEY} must be a u32, got {}",
                    value.type_name()
                )));
            };
            return self.set_alignment(a.into());
        }
        check_value(&key, &value, 0)?;
        self.keys.insert(key.clone());
        self.metadata.push((key, value));
        Ok(self)
    }

    /// Adds a tensor. `dims` are in ggml order (`dims[0]` is the row length);
    /// `data` must be exactly the encoded size of that shape in `dtype`.
    pub fn add_tensor(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        dtype: GgmlType,
        data: impl Into<Vec<u8>>,
    ) -> Result<&mut Self, GgufError> {
        let name = name.into();
        if self.names.contains(&name) {
            return Err(writer_err(format!("duplicate tensor name {name:?}")));
        }
        if dims.len() > MAX_DIMS {
            return Err(writer_err(format!(
                "tensor {name:?} has {} dims, at most {MAX_DIMS} allowed",
                dims.len()
            )));
        }
        let info = TensorInfo {
            name,
            dims: dims.to_vec(),
            dtype,
            offset: 0,
        };
        check_shape(&info)?;
        let data = data.into();
        let expected = info.size_bytes();
        if data.len() as u64 != expected {
            return Err(GgufError::LengthMismatch {
                what: format!("data of tensor {:?} ({dtype} {dims:?})", info.name),
                expected,
                got: data.len() as u64,
                unit: "bytes",
            });
        }
        self.names.insert(info.name.clone());
        self.tensors.push(PendingTensor { info, data });
        Ok(self)
    }

    /// Writes the file to `w`.
    pub fn write_to(&self, w: impl Write) -> Result<(), GgufError> {
        let mut out = Counting { inner: w, pos: 0 };
        out.put(&GGUF_MAGIC)?;
        out.u32(self.version)?;
        out.u64(self.tensors.len() as u64)?;
        out.u64(self.metadata.len() as u64)?;
        for (key, value) in &self.metadata {
            out.string(key)?;
            out.u32(value.type_id())?;
            out.value(value)?;
        }
        let mut offset = 0u64;
        for t in &self.tensors {
            out.string(&t.info.name)?;
            out.u32(t.info.dims.len() as u32)?;
            for &d in &t.info.dims {
                out.u64(d)?;
            }
            out.u32(t.info.dtype as u32)?;
            out.u64(offset)?;
            offset = (t.data.len() as u64)
                .checked_next_multiple_of(self.alignment)
                .and_then(|n| offset.checked_add(n))
                .ok_or_else(|| writer_err("tensor data offsets overflow u64".to_owned()))?;
        }
        out.pad_to(self.alignment)?;
        for t in &self.tensors {
            out.put(&t.data)?;
            out.pad_to(self.alignment)?;
        }
        out.inner.flush().map_err(GgufError::Write)
    }

    /// The whole file as bytes.
    pub fn to_bytes(&self) -> Result<Vec<u8>, GgufError> {
        let mut v = Vec::new();
        self.write_to(&mut v)?;
        Ok(v)
    }

    /// Writes the file to `path` (created or truncated).
    pub fn write_file(&self, path: impl AsRef<Path>) -> Result<(), GgufError> {
        let path = path.as_ref();
        let io = |source| GgufError::Io {
            path: path.to_owned(),
            source,
        };
        let file = File::create(path).map_err(io)?;
        let mut w = BufWriter::new(file);
        self.write_to(&mut w).map_err(|e| match e {
            GgufError::Write(source) => io(source),
            e => e,
        })?;
        w.into_inner().map_err(|e| io(e.into_error()))?;
        Ok(())
    }
}
