//! The safetensors files of an HF folder (`model.safetensors`, or shards listed by
//! `model.safetensors.index.json`), memory-mapped, with a name → tensor table. Tensors become
//! [`HostTensor`]s that borrow the mapping: no copy at load time.

use std::collections::BTreeMap;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use quire_backend::{ByteOwner, HostTensor, TensorBytes};
use quire_gguf::GgmlType;
use safetensors::{Dtype, SafeTensors};

use crate::ModelError;

/// One memory-mapped safetensors file.
pub struct MappedFile {
    pub path: PathBuf,
    map: memmap2::Mmap,
}

impl ByteOwner for MappedFile {
    fn bytes(&self) -> &[u8] {
        &self.map
    }
}

/// Where one tensor lies.
#[derive(Debug, Clone)]
pub struct TensorEntry {
    /// Index into [`Shards::files`].
    pub file: usize,
    /// The stored type, e.g. "BF16".
    pub dtype: Dtype,
    /// HF (PyTorch) order: `shape[last]` is contiguous.
    pub shape: Vec<usize>,
    /// Absolute byte range in the file.
    pub start: usize,
    pub len: usize,
}

pub struct Shards {
    pub files: Vec<Arc<MappedFile>>,
    pub tensors: BTreeMap<String, TensorEntry>,
}

fn io_err(path: &Path, e: impl std::fmt::Display) -> ModelError {
    ModelError::Io {
        path: path.display().to_string(),
        msg: e.to_string(),
    }
}

fn map(path: &Path) -> Result<Arc<MappedFile>, ModelError> {
    crate::regular_file(path)?;
    let f = std::fs::File::open(path).map_err(|e| io_err(path, e))?;
    // SAFETY: the file is opened read-only; as with any memory-mapped model, a concurrent writer
    // would change the weights under us, which the user is told not to do.
    let map = unsafe { memmap2::Mmap::map(&f) }.map_err(|e| io_err(path, e))?;
    Ok(Arc::new(MappedFile {
        path: path.to_path_buf(),
        map,
    }))
}

/// The shard file names of a folder: those of the index (in order of first mention), else
/// `model.safetensors`.
fn shard_names(dir: &Path) -> Result<Vec<String>, ModelError> {
    let index = dir.join("model.safetensors.index.json");
    if index.exists() {
        crate::regular_file(&index)?;
        let text = std::fs::read_to_string(&index).map_err(|e| io_err(&index, e))?;
        let v: serde_json::Value =
            serde_json::from_str(&text).map_err(|e| io_err(&index, format!("bad JSON: {e}")))?;
        let map = v
            .get("weight_map")
            .and_then(|m| m.as_object())
            .ok_or_else(|| io_err(&index, "no \"weight_map\" object"))?;
        let mut names: Vec<String> = Vec::new();
        for (tensor, file) in map {
            let file = file.as_str().ok_or_else(|| {
                io_err(&index, format!("weight_map[{tensor}] is not a file name"))
            })?;
            // Shards must be plain names inside the folder.
            if file.contains('/') || file.contains('\\') || file.starts_with('.') {
                return Err(io_err(
                    &index,
                    format!("shard name {file:?} is not a plain file name"),
                ));
            }
            if !names.iter().any(|n| n == file) {
                names.push(file.to_string());
            }
        }
        if names.is_empty() {
            return Err(io_err(&index, "weight_map is empty"));
        }
        return Ok(names);
    }
    if dir.join("model.safetensors").exists() {
        return Ok(vec!["model.safetensors".into()]);
    }
    Err(io_err(
        dir,
        "no model.safetensors or model.safetensors.index.json (is this an HF model folder?)",
    ))
}

impl Shards {
    pub fn open(dir: &Path) -> Result<Self, ModelError> {
        let mut files = Vec::new();
        let mut tensors = BTreeMap::new();
        for (i, name) in shard_names(dir)?.into_iter().enumerate() {
            let path = dir.join(&name);
            if !path.exists() {
                return Err(io_err(&path, "shard listed in the index does not exist"));
            }
            let file = map(&path)?;
            let (n, meta) = SafeTensors::read_metadata(&file.map)
                .map_err(|e| io_err(&path, format!("bad safetensors file: {e}")))?;
            let data_start = 8 + n;
            for (tname, info) in meta.tensors() {
                let (a, b) = info.data_offsets;
                let entry = TensorEntry {
                    file: i,
                    dtype: info.dtype,
                    shape: info.shape.clone(),
                    start: data_start + a,
                    len: b - a,
                };
                if tensors.insert(tname.clone(), entry).is_some() {
                    return Err(io_err(
                        &path,
                        format!("tensor {tname} appears in two shards"),
                    ));
                }
            }
            files.push(file);
        }
        Ok(Self { files, tensors })
    }

    pub fn has(&self, name: &str) -> bool {
        self.tensors.contains_key(name)
    }

    pub fn total_bytes(&self) -> u64 {
        self.files.iter().map(|f| f.map.len() as u64).sum()
    }

    /// The stored type and bytes of tensor `name` (borrowing the mapping, whatever their
    /// alignment), its shape checked against `want` (ggml order: the HF shape reversed, e.g.
    /// `[in, out]` for a Linear weight stored `[out, in]`).
    pub fn raw(&self, name: &str, want: &[usize]) -> Result<(GgmlType, &[u8]), ModelError> {
        let e = self
            .tensors
            .get(name)
            .ok_or_else(|| ModelError::MissingTensor(name.into()))?;
        let dtype = ggml_type(e.dtype).ok_or_else(|| {
            ModelError::Invalid(format!(
                "tensor {name} has type {:?}; supported: F32, F16, BF16",
                e.dtype
            ))
        })?;
        if !e.shape.iter().rev().eq(want) {
            return Err(ModelError::Invalid(format!(
                "tensor {name} has shape {:?}, the config needs {:?}",
                e.shape,
                want.iter().rev().collect::<Vec<_>>()
            )));
        }
        let bytes = e
            .start
            .checked_add(e.len)
            .and_then(|end| self.files[e.file].map.get(e.start..end))
            .filter(|b| b.len() == want.iter().product::<usize>() * dtype.type_size())
            .ok_or_else(|| {
                ModelError::Invalid(format!(
                    "tensor {name} lies outside its file or has a bad size"
                ))
            })?;
        Ok((dtype, bytes))
    }

    /// The tensor in ggml dimension order (reversed HF shape), checked against `want` (also ggml
    /// order, e.g. `[in, out]` for a Linear weight stored `[out, in]`).
    pub fn tensor(&self, name: &str, want: &[usize]) -> Result<HostTensor, ModelError> {
        let (dtype, _) = self.raw(name, want)?;
        let e = &self.tensors[name];
        let owner: Arc<dyn ByteOwner> = self.files[e.file].clone();
        let mut bytes = TensorBytes::new(owner, e.start, e.len)
            .ok_or_else(|| ModelError::Invalid(format!("tensor {name} lies outside its file")))?;
        // safetensors only aligns the data section to 8 bytes; a tensor after one with an odd
        // number of 2-byte elements is misaligned for f32. Backends read rows in place, so such
        // a tensor is copied to an aligned buffer.
        if !(bytes.as_slice().as_ptr() as usize).is_multiple_of(dtype.type_size()) {
            let mut copy = AlignedBuf::zeroed(e.len);
            copy.bytes_mut().copy_from_slice(bytes.as_slice());
            bytes = copy.into_tensor_bytes();
        }
        Ok(HostTensor {
            name: name.to_string(),
            dtype,
            dims: want.to_vec(),
            bytes,
        })
    }

    pub fn opt_tensor(&self, name: &str, want: &[usize]) -> Result<Option<HostTensor>, ModelError> {
        if self.has(name) {
            self.tensor(name, want).map(Some)
        } else {
            Ok(None)
        }
    }
}

/// Zero-initialized bytes in 8-byte-aligned storage (a `Vec<u8>` promises no alignment, and
/// backends read f32 rows in place): the target of misaligned tensors' copies and of stacked
/// experts.
pub struct AlignedBuf {
    words: Vec<u64>,
    len: usize,
}

impl AlignedBuf {
    pub fn zeroed(len: usize) -> Self {
        Self {
            words: vec![0u64; len.div_ceil(8)],
            len,
        }
    }

    pub fn bytes_mut(&mut self) -> &mut [u8] {
        // SAFETY: `words` holds at least `len` initialized bytes, borrowed mutably through
        // `self`; u8 has no alignment needs and every bit pattern is a valid u64.
        unsafe { std::slice::from_raw_parts_mut(self.words.as_mut_ptr() as *mut u8, self.len) }
    }

    pub fn into_tensor_bytes(self) -> TensorBytes {
        let len = self.len;
        TensorBytes::new(Arc::new(self), 0, len).expect("the whole buffer is in range")
    }
}

impl ByteOwner for AlignedBuf {
    fn bytes(&self) -> &[u8] {
        // SAFETY: `words` holds at least `len` initialized bytes; u8 has no alignment needs.
        unsafe { std::slice::from_raw_parts(self.words.as_ptr() as *const u8, self.len) }
    }
}

pub fn ggml_type(d: Dtype) -> Option<GgmlType> {
    match d {
        Dtype::F32 => Some(GgmlType::F32),
        Dtype::F16 => Some(GgmlType::F16),
        Dtype::BF16 => Some(GgmlType::BF16),
        _ => None,
    }
}
