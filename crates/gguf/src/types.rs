//! ggml tensor element types and the tensor descriptors of a GGUF file.
//!
//! The numeric ids are ggml's (`enum ggml_type`) and are what GGUF stores, so
//! they must never be renumbered. Block sizes and byte sizes follow ggml's
//! `type_traits` table; [`TensorInfo`] uses them to turn a shape into a byte
//! size, which is how the reader bounds-checks tensor data.

use std::fmt;

/// A ggml tensor element type, by its GGUF id.
///
/// Ids 4 and 5 (the removed Q4_2/Q4_3) and the IQ/TQ families are not listed;
/// files using them are rejected with [`crate::GgufError::UnknownTensorType`].
#[allow(non_camel_case_types)]
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u32)]
pub enum GgmlType {
    F32 = 0,
    F16 = 1,
    Q4_0 = 2,
    Q4_1 = 3,
    Q5_0 = 6,
    Q5_1 = 7,
    Q8_0 = 8,
    Q8_1 = 9,
    Q2_K = 10,
    Q3_K = 11,
    Q4_K = 12,
    Q5_K = 13,
    Q6_K = 14,
    Q8_K = 15,
    I8 = 24,
    I16 = 25,
    I32 = 26,
    I64 = 27,
    F64 = 28,
    BF16 = 30,
}

impl GgmlType {
    /// Every type this crate knows, in id order.
    pub const ALL: [GgmlType; 20] = [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
        GgmlType::Q5_0,
        GgmlType::Q5_1,
        GgmlType::Q8_0,
        GgmlType::Q8_1,
        GgmlType::Q2_K,
        GgmlType::Q3_K,
        GgmlType::Q4_K,
        GgmlType::Q5_K,
        GgmlType::Q6_K,
        GgmlType::Q8_K,
        GgmlType::I8,
        GgmlType::I16,
        GgmlType::I32,
        GgmlType::I64,
        GgmlType::F64,
        GgmlType::BF16,
    ];

    /// The type with GGUF id `id`, or `None` for ids this crate does not know.
    pub fn from_u32(id: u32) -> Option<Self> {
        Self::ALL.into_iter().find(|t| *t as u32 == id)
    }

    /// Elements per block (1 for plain scalar types).
    pub fn block_size(self) -> usize {
        use GgmlType::*;
        match self {
            F32 | F16 | BF16 | F64 | I8 | I16 | I32 | I64 => 1,
            Q4_0 | Q4_1 | Q5_0 | Q5_1 | Q8_0 | Q8_1 => 32,
            Q2_K | Q3_K | Q4_K | Q5_K | Q6_K | Q8_K => 256,
        }
    }

    /// Bytes per block.
    pub fn type_size(self) -> usize {
        use GgmlType::*;
        match self {
            I8 => 1,
            F16 | BF16 | I16 => 2,
            F32 | I32 => 4,
            F64 | I64 => 8,
            Q4_0 => 18,
            Q4_1 => 20,
            Q5_0 => 22,
            Q5_1 => 24,
            Q8_0 => 34,
            // Current ggml: two f16 (d, s) + 32 quants. Python's `gguf` package
            // still lists 40 (the old two-f32 layout); Q8_1 never appears in
            // model files, it is an activation format.
            Q8_1 => 36,
            Q2_K => 84,
            Q3_K => 110,
            Q4_K => 144,
            Q5_K => 176,
            Q6_K => 210,
            Q8_K => 292,
        }
    }

    /// The conventional upper-case name, as printed by llama.cpp's tools and Python's `gguf`.
    pub fn name(self) -> &'static str {
        use GgmlType::*;
        match self {
            F32 => "F32",
            F16 => "F16",
            Q4_0 => "Q4_0",
            Q4_1 => "Q4_1",
            Q5_0 => "Q5_0",
            Q5_1 => "Q5_1",
            Q8_0 => "Q8_0",
            Q8_1 => "Q8_1",
            Q2_K => "Q2_K",
            Q3_K => "Q3_K",
            Q4_K => "Q4_K",
            Q5_K => "Q5_K",
            Q6_K => "Q6_K",
            Q8_K => "Q8_K",
            I8 => "I8",
            I16 => "I16",
            I32 => "I32",
            I64 => "I64",
            F64 => "F64",
            BF16 => "BF16",
        }
    }

    /// Whether quire can compute with this type (and [`crate::dequantize_row`] /
    /// [`crate::quantize_row`] handle it). Other known types parse fine; model
    /// loading rejects them.
    pub fn is_supported(self) -> bool {
        use GgmlType::*;
        matches!(
            self,
            F32 | F16 | BF16 | Q8_0 | Q4_0 | Q4_1 | Q4_K | Q5_K | Q6_K
        )
    }

    /// Bytes needed for a row of `n` elements, or `None` if `n` is not a whole
    /// number of blocks or the size overflows.
    pub fn row_size(self, n: u64) -> Option<u64> {
        let bs = self.block_size() as u64;
        if n % bs != 0 {
            return None;
        }
        (n / bs).checked_mul(self.type_size() as u64)
    }
}

impl fmt::Display for GgmlType {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.pad(self.name())
    }
}

/// One tensor's descriptor from the GGUF tensor-info table.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TensorInfo {
    pub name: String,
    /// ggml order: `dims[0]` is the contiguous row length (ne0).
    pub dims: Vec<u64>,
    pub dtype: GgmlType,
    /// Byte offset of the data, relative to [`crate::GgufFile::data_offset`].
    pub offset: u64,
}

impl TensorInfo {
    /// Product of the dims (1 for a 0-dimensional tensor). Saturates instead of
    /// overflowing; infos from a parsed file never need to.
    pub fn n_elements(&self) -> u64 {
        self.dims.iter().fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Bytes of data, or `None` if the shape is not a whole number of blocks per
    /// row or overflows. Parsed files have been checked for both.
    pub fn checked_size_bytes(&self) -> Option<u64> {
        let mut n = 1u64;
        for &d in &self.dims {
            n = n.checked_mul(d)?;
        }
        if self.row_len() % self.dtype.block_size() as u64 != 0 {
            return None;
        }
        self.dtype.row_size(n)
    }

    /// Bytes of data: `n_elements / block_size * type_size`. Saturates on
    /// overflow (impossible for infos from a parsed file).
    pub fn size_bytes(&self) -> u64 {
        (self.n_elements() / self.dtype.block_size() as u64)
            .saturating_mul(self.dtype.type_size() as u64)
    }

    /// Number of rows: the product of all dims but the first.
    pub fn rows(&self) -> u64 {
        self.dims
            .iter()
            .skip(1)
            .fold(1u64, |acc, &d| acc.saturating_mul(d))
    }

    /// Elements per row: `dims[0]` (1 for a 0-dimensional tensor).
    pub fn row_len(&self) -> u64 {
        self.dims.first().copied().unwrap_or(1)
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn ids_round_trip_and_unknown_ids_are_none() {
        for t in GgmlType::ALL {
            assert_eq!(GgmlType::from_u32(t as u32), Some(t));
        }
        for id in [4, 5, 16, 23, 29, 31, 39, u32::MAX] {
            assert_eq!(GgmlType::from_u32(id), None, "id {id}");
        }
    }

    #[test]
    fn sizes_match_ggml() {
        assert_eq!(GgmlType::Q4_0.row_size(64), Some(36));
        assert_eq!(GgmlType::Q8_0.row_size(33), None);
        assert_eq!(GgmlType::Q6_K.row_size(256), Some(210));
        assert_eq!(GgmlType::BF16.row_size(3), Some(6));
        let t = TensorInfo {
            name: "x".into(),
            dims: vec![64, 3],
            dtype: GgmlType::Q4_1,
            offset: 0,
        };
        assert_eq!((t.rows(), t.row_len(), t.n_elements()), (3, 64, 192));
        assert_eq!(t.size_bytes(), 6 * 20);
        assert_eq!(t.checked_size_bytes(), Some(120));
    }
}
