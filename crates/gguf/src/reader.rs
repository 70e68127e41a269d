//! Validating parser for the GGUF header, metadata and tensor-info table.
//!
//! Input is untrusted: model files are downloaded, and a corrupt or hostile
//! file must produce an error, never a panic or an allocation sized by a
//! number the file made up. The rules followed throughout:
//!
//! * every read goes through [`Cursor`], which checks the bytes remaining;
//! * every count is checked against the bytes remaining (count x the smallest
//!   possible encoding of one item) before anything is allocated for it;
//! * all offset and size arithmetic is checked (or done in `u128`);
//! * recursion (arrays of arrays) is bounded by [`MAX_ARRAY_DEPTH`].
//!
//! The result, [`GgufHeader`], owns its strings, so it can be produced from a
//! borrowed slice (the fuzz test) or from a memory map that is then kept
//! alongside it ([`crate::GgufFile`]).

use std::collections::HashMap;

use crate::error::GgufError;
use crate::types::{GgmlType, TensorInfo};
use crate::value::{type_id, Value};

/// The four bytes every GGUF file starts with.
pub const GGUF_MAGIC: [u8; 4] = *b"GGUF";
/// Tensor data alignment when `general.alignment` is absent.
pub const DEFAULT_ALIGNMENT: u64 = 32;
/// ggml's `GGML_MAX_DIMS`.
pub const MAX_DIMS: usize = 4;
/// Deepest nesting of metadata arrays accepted (an array of arrays is depth 2).
pub const MAX_ARRAY_DEPTH: usize = 8;
/// The metadata key that sets the tensor data alignment.
pub const ALIGNMENT_KEY: &str = "general.alignment";

/// Smallest encoding of one kv pair: key length, empty key, type id, 1-byte value.
const MIN_KV_BYTES: u64 = 8 + 4 + 1;
/// Smallest encoding of one tensor info: name length, n_dims, type id, offset.
const MIN_TENSOR_INFO_BYTES: u64 = 8 + 4 + 4 + 8;

/// Everything before the tensor data, parsed and validated against the length
/// of the file it came from.
#[derive(Debug, Clone)]
pub struct GgufHeader {
    pub(crate) version: u32,
    pub(crate) alignment: u64,
    pub(crate) metadata: Vec<(String, Value)>,
    pub(crate) key_index: HashMap<String, usize>,
    pub(crate) tensors: Vec<TensorInfo>,
    pub(crate) tensor_index: HashMap<String, usize>,
    pub(crate) data_offset: u64,
}

/// Bounds-checked little-endian reader over the file bytes.
struct Cursor<'a> {
    bytes: &'a [u8],
    pos: usize,
}

impl<'a> Cursor<'a> {
    fn remaining(&self) -> usize {
        self.bytes.len() - self.pos
    }

    fn take(&mut self, n: u64, what: &dyn Fn() -> String) -> Result<&'a [u8], GgufError> {
        let available = self.remaining();
        match usize::try_from(n) {
            Ok(n) if n <= available => {
                let out = &self.bytes[self.pos..self.pos + n];
                self.pos += n;
                Ok(out)
            }
            _ => Err(GgufError::truncated(self.pos, n, available, &what())),
        }
    }

    fn array<const N: usize>(&mut self, what: &dyn Fn() -> String) -> Result<[u8; N], GgufError> {
        let b = self.take(N as u64, what)?;
        let mut out = [0u8; N];
        out.copy_from_slice(b);
        Ok(out)
    }

    fn u8(&mut self, what: &dyn Fn() -> String) -> Result<u8, GgufError> {
        Ok(self.array::<1>(what)?[0])
    }

    fn u16(&mut self, what: &dyn Fn() -> String) -> Result<u16, GgufError> {
        self.array(what).map(u16::from_le_bytes)
    }

    fn u32(&mut self, what: &dyn Fn() -> String) -> Result<u32, GgufError> {
        self.array(what).map(u32::from_le_bytes)
    }

    fn u64(&mut self, what: &dyn Fn() -> String) -> Result<u64, GgufError> {
        self.array(what).map(u64::from_le_bytes)
    }

    /// A GGUF string: u64 byte length, then UTF-8 bytes (no terminator).
    fn string(&mut self, what: &dyn Fn() -> String) -> Result<String, GgufError> {
        let len = self.u64(&|| format!("length of {}", what()))?;
        let at = self.pos;
        let bytes = self.take(len, what)?;
        match std::str::from_utf8(bytes) {
            Ok(s) => Ok(s.to_owned()),
            Err(_) => Err(GgufError::InvalidUtf8 {
                offset: at as u64,
                what: what(),
            }),
        }
    }

    /// Fails unless `count` items of at least `min_each` bytes can still fit.
    fn check_count(
        &self,
        count: u64,
        min_each: u64,
        at: usize,
        what: &dyn Fn() -> String,
    ) -> Result<usize, GgufError> {
        let min_bytes = u128::from(count) * u128::from(min_each);
        if min_bytes > self.remaining() as u128 {
            return Err(GgufError::CountTooLarge {
                offset: at as u64,
                count,
                min_bytes,
                available: self.remaining() as u64,
                what: what(),
            });
        }
        // Fits in the remaining bytes, hence in usize.
        Ok(count as usize)
    }
}

/// Smallest on-disk size of one value of type `ty`, or `None` for unknown types.
fn min_value_bytes(ty: u32) -> Option<u64> {
    Some(match ty {
        type_id::U8 | type_id::I8 | type_id::BOOL => 1,
        type_id::U16 | type_id::I16 => 2,
        type_id::U32 | type_id::I32 | type_id::F32 => 4,
        type_id::U64 | type_id::I64 | type_id::F64 => 8,
        type_id::STRING => 8,
        type_id::ARRAY => 12,
        _ => return None,
    })
}

/// Reads one value of type `ty` for metadata key `key`; `depth` counts the
/// arrays enclosing it.
fn read_value(c: &mut Cursor<'_>, ty: u32, key: &str, depth: usize) -> Result<Value, GgufError> {
    let what = &|| format!("value of key {key:?}");
    Ok(match ty {
        type_id::U8 => Value::U8(c.u8(what)?),
        type_id::I8 => Value::I8(c.u8(what)? as i8),
        type_id::U16 => Value::U16(c.u16(what)?),
        type_id::I16 => Value::I16(c.u16(what)? as i16),
        type_id::U32 => Value::U32(c.u32(what)?),
        type_id::I32 => Value::I32(c.u32(what)? as i32),
        type_id::U64 => Value::U64(c.u64(what)?),
        type_id::I64 => Value::I64(c.u64(what)? as i64),
        type_id::F32 => Value::F32(f32::from_bits(c.u32(what)?)),
        type_id::F64 => Value::F64(f64::from_bits(c.u64(what)?)),
        type_id::BOOL => {
            let at = c.pos;
            match c.u8(what)? {
                0 => Value::Bool(false),
                1 => Value::Bool(true),
                byte => {
                    return Err(GgufError::InvalidBool {
                        offset: at as u64,
                        key: key.to_owned(),
                        byte,
                    })
                }
            }
        }
        type_id::STRING => Value::String(c.string(what)?),
        type_id::ARRAY => {
            let at = c.pos;
            if depth >= MAX_ARRAY_DEPTH {
                return Err(GgufError::NestingTooDeep {
                    offset: at as u64,
                    key: key.to_owned(),
                    max: MAX_ARRAY_DEPTH,
                });
            }
            let elem_ty = c.u32(&|| format!("array element type of key {key:?}"))?;
            let min_each = min_value_bytes(elem_ty).ok_or_else(|| GgufError::UnknownValueType {
                offset: at as u64,
                type_id: elem_ty,
                key: key.to_owned(),
            })?;
            let count_at = c.pos;
            let count = c.u64(&|| format!("array length of key {key:?}"))?;
            let n = c.check_count(count, min_each, count_at, &|| {
                format!("array length of key {key:?}")
            })?;
            let mut items = Vec::with_capacity(n);
            for _ in 0..n {
                items.push(read_value(c, elem_ty, key, depth + 1)?);
            }
            Value::Array(items)
        }
        _ => {
            return Err(GgufError::UnknownValueType {
                offset: c.pos.saturating_sub(4) as u64,
                type_id: ty,
                key: key.to_owned(),
            })
        }
    })
}

/// Reads `general.alignment`: absent means 32; otherwise it must be a `u32`
/// power of two (llama.cpp and Python's `gguf` both insist on the type).
fn alignment_of(
    metadata: &[(String, Value)],
    index: &HashMap<String, usize>,
) -> Result<u64, GgufError> {
    let Some(&i) = index.get(ALIGNMENT_KEY) else {
        return Ok(DEFAULT_ALIGNMENT);
    };
    match metadata[i].1 {
        Value::U32(a) if a.is_power_of_two() => Ok(a.into()),
        Value::U32(a) => Err(GgufError::BadAlignment {
            value: a.to_string(),
            reason: "must be a non-zero power of two",
        }),
        ref other => Err(GgufError::BadAlignment {
            value: other.to_string(),
            reason: "must be stored as u32",
        }),
    }
}

fn read_tensor_info(c: &mut Cursor<'_>, i: usize, alignment: u64) -> Result<TensorInfo, GgufError> {
    let name = c.string(&|| format!("name of tensor #{i}"))?;
    let what = &|| format!("info of tensor {name:?}");
    let dims_at = c.pos;
    let n_dims = c.u32(what)?;
    if n_dims as usize > MAX_DIMS {
        return Err(GgufError::TooManyDims {
            offset: dims_at as u64,
            name,
            n_dims,
            max: MAX_DIMS,
        });
    }
    let mut dims = Vec::with_capacity(n_dims as usize);
    for _ in 0..n_dims {
        dims.push(c.u64(what)?);
    }
    let type_at = c.pos;
    let type_id = c.u32(what)?;
    let offset = c.u64(what)?;
    let Some(dtype) = GgmlType::from_u32(type_id) else {
        return Err(GgufError::UnknownTensorType {
            offset: type_at as u64,
            name,
            type_id,
        });
    };
    let info = TensorInfo {
        name,
        dims,
        dtype,
        offset,
    };
    check_shape(&info)?;
    if offset % alignment != 0 {
        return Err(GgufError::MisalignedTensor {
            name: info.name,
            offset,
            alignment,
        });
    }
    Ok(info)
}

/// ggml keeps dims and element counts in `int64_t`; anything larger, or a row
/// that is not a whole number of blocks, cannot be a real tensor.
pub(crate) fn check_shape(t: &TensorInfo) -> Result<(), GgufError> {
    let bad = |reason| GgufError::BadShape {
        name: t.name.clone(),
        dims: t.dims.clone(),
        dtype: t.dtype,
        reason,
    };
    let mut n: u64 = 1;
    for &d in &t.dims {
        n = n
            .checked_mul(d)
            .filter(|&n| n <= i64::MAX as u64)
            .ok_or_else(|| bad("element count overflows i64"))?;
    }
    if t.row_len() % t.dtype.block_size() as u64 != 0 {
        return Err(bad("row length is not a multiple of the block size"));
    }
    if t.checked_size_bytes().is_none() {
        return Err(bad("byte size overflows u64"));
    }
    Ok(())
}

impl GgufHeader {
    /// Parses and validates `bytes`, a whole GGUF file (the tensor data is only
    /// bounds-checked, not read).
    pub fn parse(bytes: &[u8]) -> Result<GgufHeader, GgufError> {
        let mut c = Cursor { bytes, pos: 0 };
        let magic: [u8; 4] = c.array(&|| "magic".to_owned())?;
        if magic != GGUF_MAGIC {
            return Err(GgufError::BadMagic { found: magic });
        }
        let version = c.u32(&|| "version".to_owned())?;
        if version != 2 && version != 3 {
            let hint = if version.swap_bytes() == 2 || version.swap_bytes() == 3 {
                "; this is a big-endian file, only little-endian is supported"
            } else {
                ""
            };
            return Err(GgufError::UnsupportedVersion { version, hint });
        }
        let tensor_count_at = c.pos;
        let tensor_count = c.u64(&|| "tensor count".to_owned())?;
        let kv_count_at = c.pos;
        let kv_count = c.u64(&|| "metadata kv count".to_owned())?;
        // Both tables follow; each must fit in what is left.
        let n_tensors = c.check_count(
            tensor_count,
            MIN_TENSOR_INFO_BYTES,
            tensor_count_at,
            &|| "tensor count".to_owned(),
        )?;
        let n_kv = c.check_count(kv_count, MIN_KV_BYTES, kv_count_at, &|| {
            "metadata kv count".to_owned()
        })?;
        let both = u128::from(tensor_count) * u128::from(MIN_TENSOR_INFO_BYTES)
            + u128::from(kv_count) * u128::from(MIN_KV_BYTES);
        if both > c.remaining() as u128 {
            return Err(GgufError::CountTooLarge {
                offset: tensor_count_at as u64,
                count: tensor_count.saturating_add(kv_count),
                min_bytes: both,
                available: c.remaining() as u64,
                what: "tensor count + metadata kv count".to_owned(),
            });
        }

        let mut metadata = Vec::with_capacity(n_kv);
        let mut key_index = HashMap::with_capacity(n_kv);
        for i in 0..n_kv {
            let key_at = c.pos;
            let key = c.string(&|| format!("key of metadata entry #{i}"))?;
            if key_index.contains_key(&key) {
                return Err(GgufError::DuplicateKey {
                    offset: key_at as u64,
                    key,
                });
            }
            let ty = c.u32(&|| format!("value type of key {key:?}"))?;
            let value = read_value(&mut c, ty, &key, 0)?;
            key_index.insert(key.clone(), metadata.len());
            metadata.push((key, value));
        }
        let alignment = alignment_of(&metadata, &key_index)?;

        let mut tensors = Vec::with_capacity(n_tensors);
        let mut tensor_index = HashMap::with_capacity(n_tensors);
        for i in 0..n_tensors {
            let info_at = c.pos;
            let info = read_tensor_info(&mut c, i, alignment)?;
            if tensor_index.contains_key(&info.name) {
                return Err(GgufError::DuplicateTensor {
                    offset: info_at as u64,
                    name: info.name,
                });
            }
            tensor_index.insert(info.name.clone(), tensors.len());
            tensors.push(info);
        }

        let end = c.pos as u64;
        let data_offset = end
            .checked_next_multiple_of(alignment)
            .ok_or(GgufError::DataOffsetOverflow { end, alignment })?;
        let file_len = bytes.len() as u64;
        for t in &tensors {
            // u128: neither sum can overflow.
            let start = u128::from(data_offset) + u128::from(t.offset);
            let size = t.checked_size_bytes().unwrap_or(u64::MAX);
            let stop = start + u128::from(size);
            if stop > u128::from(file_len) {
                return Err(GgufError::TensorOutOfBounds {
                    name: t.name.clone(),
                    start,
                    end: stop,
                    file_len,
                });
            }
        }
        Ok(GgufHeader {
            version,
            alignment,
            metadata,
            key_index,
            tensors,
            tensor_index,
            data_offset,
        })
    }

    /// The GGUF version (2 or 3).
    pub fn version(&self) -> u32 {
        self.version
    }

    /// Tensor data alignment in bytes (`general.alignment`, default 32).
    pub fn alignment(&self) -> u64 {
        self.alignment
    }

    /// All metadata, in file order.
    pub fn metadata(&self) -> &[(String, Value)] {
        &self.metadata
    }

    /// The value of metadata key `key`.
    pub fn get(&self, key: &str) -> Option<&Value> {
        self.key_index.get(key).map(|&i| &self.metadata[i].1)
    }

    /// All tensor infos, in file order.
    pub fn tensors(&self) -> &[TensorInfo] {
        &self.tensors
    }

    /// The tensor named `name`.
    pub fn tensor(&self, name: &str) -> Option<&TensorInfo> {
        self.tensor_index.get(name).map(|&i| &self.tensors[i])
    }

    /// Absolute file offset where tensor data starts (a multiple of the alignment).
    pub fn data_offset(&self) -> u64 {
        self.data_offset
    }
}
