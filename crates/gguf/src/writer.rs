//! GGUF writer.
//!
//! Used to produce test fixtures and converted/quantized models. It validates
//! everything the reader would reject (duplicate names, bad shapes, wrong data
//! lengths, mixed-type arrays, over-deep nesting) when an item is added, so
//! that whatever it writes can be read back by [`crate::GgufFile`], llama.cpp
//! and Python's `gguf` package. Layout: header, metadata, tensor infos,
//! padding to the alignment, then each tensor's data padded to the alignment,
//! in the order the tensors were added.
//!
//! Tensors are either held in memory ([`GgufWriter::add_tensor`]) or only
//! described ([`GgufWriter::add_tensor_streamed`]) and their bytes produced by
//! a callback at write time ([`GgufWriter::write_to_with`]), so that a
//! multi-gigabyte model never has to exist in memory. The callback's output is
//! counted: too few or too many bytes for the shape is an error, not a corrupt
//! file.

use std::collections::HashSet;
use std::fs::File;
use std::io::{self, BufWriter, Write};
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
    /// `None` for a streamed tensor: its bytes come from the write callback.
    data: Option<Vec<u8>>,
}

/// What [`GgufWriter::write_to_with`] calls for each streamed tensor: write
/// exactly the tensor's [`TensorInfo::size_bytes`] to the given writer. The
/// info's `offset` is its final offset from the start of the data section.
type TensorFill<'a> = dyn FnMut(&TensorInfo, &mut dyn Write) -> io::Result<()> + 'a;

/// The writer handed to a fill callback: counts bytes and refuses any beyond
/// the tensor's size, so that a wrong callback cannot shift later tensors.
struct TensorSink<'a> {
    inner: &'a mut dyn Write,
    written: u64,
    limit: u64,
    overflow: bool,
}

impl Write for TensorSink<'_> {
    fn write(&mut self, buf: &[u8]) -> io::Result<usize> {
        if self.written + buf.len() as u64 > self.limit {
            self.overflow = true;
            return Err(io::Error::other("more bytes than the tensor's size"));
        }
        let n = self.inner.write(buf)?;
        self.written += n as u64;
        Ok(n)
    }

    fn write_all(&mut self, buf: &[u8]) -> io::Result<()> {
        if self.written + buf.len() as u64 > self.limit {
            self.overflow = true;
            return Err(io::Error::other("more bytes than the tensor's size"));
        }
        self.inner.write_all(buf)?;
        self.written += buf.len() as u64;
        Ok(())
    }

    fn flush(&mut self) -> io::Result<()> {
        self.inner.flush()
    }
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

    /// The descriptor of a new tensor, after the checks every tensor gets.
    fn new_tensor_info(
        &self,
        name: String,
        dims: &[u64],
        dtype: GgmlType,
    ) -> Result<TensorInfo, GgufError> {
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
        Ok(info)
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
        let info = self.new_tensor_info(name.into(), dims, dtype)?;
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
        self.tensors.push(PendingTensor {
            info,
            data: Some(data),
        });
        Ok(self)
    }

    /// Adds a tensor whose bytes are not held here but written at write time
    /// by the callback of [`GgufWriter::write_to_with`] /
    /// [`GgufWriter::write_file_with`]. Same checks as [`GgufWriter::add_tensor`].
    pub fn add_tensor_streamed(
        &mut self,
        name: impl Into<String>,
        dims: &[u64],
        dtype: GgmlType,
    ) -> Result<&mut Self, GgufError> {
        let info = self.new_tensor_info(name.into(), dims, dtype)?;
        self.names.insert(info.name.clone());
        self.tensors.push(PendingTensor { info, data: None });
        Ok(self)
    }

    /// Each tensor's offset from the start of the data section, and the
    /// data section's total size (padding included).
    fn layout(&self) -> Result<(Vec<u64>, u64), GgufError> {
        let mut offsets = Vec::with_capacity(self.tensors.len());
        let mut offset = 0u64;
        for t in &self.tensors {
            offsets.push(offset);
            offset = t
                .info
                .size_bytes()
                .checked_next_multiple_of(self.alignment)
                .and_then(|n| offset.checked_add(n))
                .ok_or_else(|| writer_err("tensor data offsets overflow u64".to_owned()))?;
        }
        Ok((offsets, offset))
    }

    /// Header, metadata, tensor infos and the padding after them.
    fn write_head<W: Write>(
        &self,
        out: &mut Counting<W>,
        offsets: &[u64],
    ) -> Result<(), GgufError> {
        out.put(&GGUF_MAGIC)?;
        out.u32(self.version)?;
        out.u64(self.tensors.len() as u64)?;
        out.u64(self.metadata.len() as u64)?;
        for (key, value) in &self.metadata {
            out.string(key)?;
            out.u32(value.type_id())?;
            out.value(value)?;
        }
        for (t, &offset) in self.tensors.iter().zip(offsets) {
            out.string(&t.info.name)?;
            out.u32(t.info.dims.len() as u32)?;
            for &d in &t.info.dims {
                out.u64(d)?;
            }
            out.u32(t.info.dtype as u32)?;
            out.u64(offset)?;
        }
        out.pad_to(self.alignment)
    }

    /// The size in bytes of the file this writer would write now.
    pub fn file_size(&self) -> Result<u64, GgufError> {
        let (offsets, data) = self.layout()?;
        let mut head = Counting {
            inner: io::sink(),
            pos: 0,
        };
        self.write_head(&mut head, &offsets)?;
        head.pos
            .checked_add(data)
            .ok_or_else(|| writer_err("file size overflows u64".to_owned()))
    }

    /// Writes the file to `w`. Every tensor must have been added with its data
    /// ([`GgufWriter::add_tensor`]); for streamed ones use [`GgufWriter::write_to_with`].
    pub fn write_to(&self, w: impl Write) -> Result<(), GgufError> {
        if let Some(t) = self.tensors.iter().find(|t| t.data.is_none()) {
            return Err(writer_err(format!(
                "tensor {:?} was added without data: write it with write_to_with",
                t.info.name
            )));
        }
        self.write_to_with(w, |info, _| {
            Err(io::Error::other(format!(
                "no data for tensor {:?}",
                info.name
            )))
        })
    }

    /// Writes the file to `w`, calling `fill` in file order for each tensor
    /// added with [`GgufWriter::add_tensor_streamed`]; it must write exactly
    /// that tensor's size in bytes ([`GgufError::LengthMismatch`] otherwise).
    /// Its I/O errors come back as [`GgufError::Write`]. `w` is flushed at the end.
    pub fn write_to_with<W, F>(&self, w: W, mut fill: F) -> Result<(), GgufError>
    where
        W: Write,
        F: FnMut(&TensorInfo, &mut dyn Write) -> io::Result<()>,
    {
        self.write_impl(w, &mut fill)
    }

    fn write_impl<W: Write>(&self, w: W, fill: &mut TensorFill<'_>) -> Result<(), GgufError> {
        let (offsets, _) = self.layout()?;
        let mut out = Counting { inner: w, pos: 0 };
        self.write_head(&mut out, &offsets)?;
        for (t, &offset) in self.tensors.iter().zip(&offsets) {
            match &t.data {
                Some(data) => out.put(data)?,
                None => {
                    let info = TensorInfo {
                        offset,
                        ..t.info.clone()
                    };
                    let expected = info.size_bytes();
                    let mut sink = TensorSink {
                        inner: &mut out.inner,
                        written: 0,
                        limit: expected,
                        overflow: false,
                    };
                    let result = fill(&info, &mut sink);
                    let (written, overflow) = (sink.written, sink.overflow);
                    out.pos += written;
                    if overflow || (result.is_ok() && written != expected) {
                        return Err(GgufError::LengthMismatch {
                            what: format!(
                                "streamed data of tensor {:?} ({} {:?}){}",
                                info.name,
                                info.dtype,
                                info.dims,
                                if overflow { ", at least" } else { "" }
                            ),
                            expected,
                            got: written + u64::from(overflow),
                            unit: "bytes",
                        });
                    }
                    result.map_err(GgufError::Write)?;
                }
            }
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
        let io = |error| GgufError::Io {
            path: path.to_owned(),
            error,
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

    /// Writes the file to `path` (created or truncated) through a large
    /// buffer, streamed tensors coming from `fill` as in
    /// [`GgufWriter::write_to_with`]. I/O errors, the callback's included,
    /// name the path.
    pub fn write_file_with<F>(&self, path: impl AsRef<Path>, fill: F) -> Result<(), GgufError>
    where
        F: FnMut(&TensorInfo, &mut dyn Write) -> io::Result<()>,
    {
        let path = path.as_ref();
        let io = |error| GgufError::Io {
            path: path.to_owned(),
            error,
        };
        let file = File::create(path).map_err(io)?;
        let mut w = BufWriter::with_capacity(STREAM_BUFFER, file);
        self.write_to_with(&mut w, fill).map_err(|e| match e {
            GgufError::Write(source) => io(source),
            e => e,
        })?;
        w.into_inner().map_err(|e| io(e.into_error()))?;
        Ok(())
    }
}

/// Buffer of [`GgufWriter::write_file_with`]: large writes go to the OS in few calls.
const STREAM_BUFFER: usize = 8 << 20;

#[cfg(test)]
mod tests {
    use super::*;
    use crate::GgufFile;

    fn sample(streamed: bool) -> GgufWriter {
        let mut w = GgufWriter::new();
        w.add_metadata("general.architecture", Value::String("llama".into()))
            .unwrap();
        let a: Vec<u8> = (0..6 * 4).map(|i| i as u8).collect();
        let b: Vec<u8> = (0..34 * 2).map(|i| (i * 7) as u8).collect();
        if streamed {
            w.add_tensor_streamed("a", &[3, 2], GgmlType::F32).unwrap();
            w.add_tensor("b", &[64], GgmlType::Q8_0, b).unwrap();
            w.add_tensor_streamed("c", &[5], GgmlType::I8).unwrap();
        } else {
            w.add_tensor("a", &[3, 2], GgmlType::F32, a).unwrap();
            w.add_tensor("b", &[64], GgmlType::Q8_0, b).unwrap();
            w.add_tensor("c", &[5], GgmlType::I8, vec![9u8; 5]).unwrap();
        }
        w
    }

    fn fill(info: &TensorInfo, out: &mut dyn Write) -> io::Result<()> {
        match info.name.as_str() {
            "a" => {
                // In pieces, as a streaming caller would.
                let a: Vec<u8> = (0..6 * 4).map(|i| i as u8).collect();
                out.write_all(&a[..5])?;
                out.write_all(&a[5..])
            }
            _ => out.write_all(&[9u8; 5]),
        }
    }

    #[test]
    fn streamed_tensors_give_the_same_bytes_as_in_memory_ones() {
        let mem = sample(false).to_bytes().unwrap();
        let mut streamed = Vec::new();
        let w = sample(true);
        let mut seen = Vec::new();
        w.write_to_with(&mut streamed, |info, out| {
            seen.push((info.name.clone(), info.offset));
            fill(info, out)
        })
        .unwrap();
        assert_eq!(mem, streamed);
        assert_eq!(w.file_size().unwrap(), streamed.len() as u64);
        // File order and final offsets (a: 24 bytes, b: 68, each padded to 32) reach the callback.
        assert_eq!(seen, [("a".to_owned(), 0), ("c".to_owned(), 128)]);
        let f = GgufFile::from_bytes(streamed).unwrap();
        assert_eq!(f.tensor("c").unwrap().offset, 128);
    }

    #[test]
    fn a_callback_writing_the_wrong_length_is_an_error() {
        let w = sample(true);
        let short = w.write_to_with(Vec::new(), |info, out| {
            let n = info.size_bytes() as usize - 1;
            out.write_all(&vec![0; n])
        });
        assert!(
            matches!(
                short,
                Err(GgufError::LengthMismatch {
                    expected: 24,
                    got: 23,
                    ..
                })
            ),
            "{short:?}"
        );
        let long = w.write_to_with(Vec::new(), |info, out| {
            let n = info.size_bytes() as usize;
            out.write_all(&vec![0; n])?;
            out.write_all(&[0])
        });
        assert!(
            matches!(
                long,
                Err(GgufError::LengthMismatch {
                    expected: 24,
                    got: 25,
                    ..
                })
            ),
            "{long:?}"
        );
        let failing = w.write_to_with(Vec::new(), |_, _| Err(io::Error::other("disk full")));
        assert!(matches!(failing, Err(GgufError::Write(_))), "{failing:?}");
    }

    #[test]
    fn write_to_refuses_tensors_without_data() {
        let err = sample(true).to_bytes().unwrap_err().to_string();
        assert!(
            err.contains("\"a\"") && err.contains("write_to_with"),
            "{err}"
        );
    }

    #[test]
    fn write_file_with_names_the_path_on_error() {
        let path = std::env::temp_dir()
            .join(format!("quire-gguf-writer-{}", std::process::id()))
            .join("missing-dir")
            .join("x.gguf");
        let err = sample(true).write_file_with(&path, fill).unwrap_err();
        assert!(
            matches!(&err, GgufError::Io { path: p, .. } if *p == path),
            "{err:?}"
        );
    }
}
