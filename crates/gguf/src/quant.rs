//! ggml block formats and scalar reference (de)quantizers.
//!
//! The block structs are `#[repr(C)]` copies of ggml's `block_q4_0` etc., so
//! compute kernels can view tensor bytes as `&[BlockQ4_0]` through
//! [`cast_blocks`] (which checks length and alignment instead of trusting
//! them). The row functions are deliberately plain scalar code: they are the
//! reference that faster kernels are tested against, and the quantizers follow
//! ggml's `quantize_row_*_ref` rounding rules exactly so that files written by
//! quire match what llama.cpp would produce for the same input.

use half::{bf16, f16};

use crate::error::GgufError;
use crate::kquant::{self, BlockQ4K, BlockQ5K, BlockQ6K, QK_K};
use crate::types::GgmlType;

/// Elements per block of the 32-element formats.
pub const QK: usize = 32;

/// 4-bit symmetric: `x = d * ((q & 0xF) - 8)`. Byte `j` of `qs` holds element
/// `j` in its low nibble and element `j + 16` in its high nibble.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4_0 {
    pub d: f16,
    pub qs: [u8; QK / 2],
}

/// 4-bit affine: `x = d * q + m`, nibble order as in [`BlockQ4_0`].
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ4_1 {
    pub d: f16,
    pub m: f16,
    pub qs: [u8; QK / 2],
}

/// 8-bit symmetric: `x = d * q`.
#[repr(C)]
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct BlockQ8_0 {
    pub d: f16,
    pub qs: [i8; QK],
}

const _: () = assert!(std::mem::size_of::<BlockQ4_0>() == 18);
const _: () = assert!(std::mem::size_of::<BlockQ4_1>() == 20);
const _: () = assert!(std::mem::size_of::<BlockQ8_0>() == 34);
const _: () = assert!(std::mem::align_of::<BlockQ8_0>() == 2);

impl BlockQ4_0 {
    pub fn dequantize(&self) -> [f32; QK] {
        let d = self.d.to_f32();
        let mut out = [0f32; QK];
        for (j, &q) in self.qs.iter().enumerate() {
            out[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
            out[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
        }
        out
    }
}

impl BlockQ4_1 {
    pub fn dequantize(&self) -> [f32; QK] {
        let (d, m) = (self.d.to_f32(), self.m.to_f32());
        let mut out = [0f32; QK];
        for (j, &q) in self.qs.iter().enumerate() {
            out[j] = (q & 0x0F) as f32 * d + m;
            out[j + QK / 2] = (q >> 4) as f32 * d + m;
        }
        out
    }
}

impl BlockQ8_0 {
    pub fn dequantize(&self) -> [f32; QK] {
        let d = self.d.to_f32();
        self.qs.map(|q| q as f32 * d)
    }
}

mod sealed {
    pub trait Sealed {}
}

/// Types that any properly sized and aligned byte slice can be viewed as:
/// no padding, no invalid bit patterns. Sealed; implemented for the block
/// structs and the plain scalar element types.
pub trait Pod: sealed::Sealed + Copy + 'static {}

macro_rules! pod {
    ($($t:ty),*) => {$(
        impl sealed::Sealed for $t {}
        impl Pod for $t {}
    )*};
}
pod!(
    BlockQ4_0, BlockQ4_1, BlockQ8_0, BlockQ4K, BlockQ5K, BlockQ6K, u8, i8, u16, i16, u32, i32, u64,
    i64, f32, f64, f16, bf16
);

/// Views `bytes` as a slice of `T` (e.g. `cast_blocks::<BlockQ4_0>(tensor_data)`).
///
/// Errors, rather than invoking undefined behaviour, when the length is not a
/// multiple of `size_of::<T>()`, the start is not aligned for `T`, or the host
/// is big-endian (GGUF data is little-endian). Tensor data of a parsed file
/// starts at a multiple of the file alignment (at least 1, normally 32) from
/// the start of the map, which is page-aligned, so the 2-byte alignment of
/// the block structs holds for any file with an even alignment.
pub fn cast_blocks<T: Pod>(bytes: &[u8]) -> Result<&[T], GgufError> {
    let size = std::mem::size_of::<T>();
    let fail = |reason| GgufError::BadCast {
        ty: std::any::type_name::<T>(),
        len: bytes.len(),
        addr: bytes.as_ptr() as usize,
        reason,
    };
    if cfg!(target_endian = "big") {
        return Err(fail(
            "GGUF data is little-endian and this host is big-endian",
        ));
    }
    if bytes.len() % size != 0 {
        return Err(fail("length is not a multiple of the element size"));
    }
    if (bytes.as_ptr() as usize) % std::mem::align_of::<T>() != 0 {
        return Err(fail("start address is not aligned for the element type"));
    }
    // SAFETY: `T: Pod` (sealed) has no padding and no invalid bit patterns;
    // the pointer is non-null, aligned for `T` (checked), and the slice covers
    // exactly `bytes.len()` bytes (length checked), borrowed for the same lifetime.
    Ok(unsafe { std::slice::from_raw_parts(bytes.as_ptr().cast::<T>(), bytes.len() / size) })
}

/// The bytes of a slice of `T` (e.g. blocks to hand to [`crate::GgufWriter`]).
pub fn blocks_as_bytes<T: Pod>(blocks: &[T]) -> &[u8] {
    // SAFETY: `T: Pod` has no padding, so every byte is initialized; u8 has
    // alignment 1 and the length is exactly the size of the slice.
    unsafe {
        std::slice::from_raw_parts(blocks.as_ptr().cast::<u8>(), std::mem::size_of_val(blocks))
    }
}

/// f32 to bf16 as ggml does it: round to nearest even, NaN made quiet.
pub fn f32_to_bf16(x: f32) -> bf16 {
    let u = x.to_bits();
    if x.is_nan() {
        return bf16::from_bits(((u >> 16) | 64) as u16);
    }
    let rounded = u.wrapping_add(0x7FFF + ((u >> 16) & 1));
    bf16::from_bits((rounded >> 16) as u16)
}

fn check_blocks(op: &'static str, dtype: GgmlType, n: usize) -> Result<usize, GgufError> {
    let block_size = dtype.block_size();
    if n % block_size != 0 {
        return Err(GgufError::NotBlockMultiple {
            op,
            dtype,
            n,
            block_size,
        });
    }
    Ok(n / block_size)
}

/// Copies one `T` out of `b` (exactly its size), whatever the alignment of `b`.
fn read_block<T: Pod>(b: &[u8]) -> T {
    assert_eq!(b.len(), std::mem::size_of::<T>(), "block size");
    // SAFETY: `T: Pod` accepts any bit pattern; `b` holds exactly `size_of::<T>()` readable bytes;
    // `read_unaligned` needs no alignment.
    unsafe { std::ptr::read_unaligned(b.as_ptr().cast::<T>()) }
}

fn f16_at(b: &[u8], i: usize) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[i], b[i + 1]])).to_f32()
}

/// Decodes `dst.len()` elements of type `dtype` from `src`, which must be
/// exactly their encoded size. Implemented for the supported types
/// ([`GgmlType::is_supported`]).
pub fn dequantize_row(dtype: GgmlType, src: &[u8], dst: &mut [f32]) -> Result<(), GgufError> {
    let n_blocks = check_blocks("dequantize", dtype, dst.len())?;
    let expected = n_blocks as u64 * dtype.type_size() as u64;
    if src.len() as u64 != expected {
        return Err(GgufError::LengthMismatch {
            what: format!("dequantize {dtype}: source for {} elements", dst.len()),
            expected,
            got: src.len() as u64,
            unit: "bytes",
        });
    }
    let ts = dtype.type_size();
    let chunks = src.chunks_exact(ts);
    match dtype {
        GgmlType::F32 => {
            for (o, b) in dst.iter_mut().zip(chunks) {
                *o = f32::from_le_bytes([b[0], b[1], b[2], b[3]]);
            }
        }
        GgmlType::F16 => {
            for (o, b) in dst.iter_mut().zip(chunks) {
                *o = f16_at(b, 0);
            }
        }
        GgmlType::BF16 => {
            for (o, b) in dst.iter_mut().zip(chunks) {
                *o = f32::from_bits(u32::from(u16::from_le_bytes([b[0], b[1]])) << 16);
            }
        }
        GgmlType::Q8_0 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(chunks) {
                let d = f16_at(b, 0);
                for (o, &q) in out.iter_mut().zip(&b[2..]) {
                    *o = q as i8 as f32 * d;
                }
            }
        }
        GgmlType::Q4_0 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(chunks) {
                let d = f16_at(b, 0);
                for (j, &q) in b[2..].iter().enumerate() {
                    out[j] = ((q & 0x0F) as i32 - 8) as f32 * d;
                    out[j + QK / 2] = ((q >> 4) as i32 - 8) as f32 * d;
                }
            }
        }
        GgmlType::Q4_1 => {
            for (out, b) in dst.chunks_exact_mut(QK).zip(chunks) {
                let (d, m) = (f16_at(b, 0), f16_at(b, 2));
                for (j, &q) in b[4..].iter().enumerate() {
                    out[j] = (q & 0x0F) as f32 * d + m;
                    out[j + QK / 2] = (q >> 4) as f32 * d + m;
                }
            }
        }
        GgmlType::Q4_K => {
            for (out, b) in dst.chunks_exact_mut(QK_K).zip(chunks) {
                read_block::<BlockQ4K>(b).dequantize(out);
            }
        }
        GgmlType::Q5_K => {
            for (out, b) in dst.chunks_exact_mut(QK_K).zip(chunks) {
                read_block::<BlockQ5K>(b).dequantize(out);
            }
        }
        GgmlType::Q6_K => {
            for (out, b) in dst.chunks_exact_mut(QK_K).zip(chunks) {
                read_block::<BlockQ6K>(b).dequantize(out);
            }
        }
        _ => {
            return Err(GgufError::Unsupported {
                dtype,
                op: "dequantize_row",
            })
        }
    }
    Ok(())
}

/// Encodes `src` as `dtype`, appending to `dst`. Implemented for the
/// supported types; Q8_0/Q4_0/Q4_1 round exactly as ggml's
/// `quantize_row_{q8_0,q4_0,q4_1}_ref`, the K-quants use quire's own
/// scale search (see `kquant`).
pub fn quantize_row(dtype: GgmlType, src: &[f32], dst: &mut Vec<u8>) -> Result<(), GgufError> {
    let n_blocks = check_blocks("quantize", dtype, src.len())?;
    dst.reserve(n_blocks * dtype.type_size());
    match dtype {
        GgmlType::F32 => src.iter().for_each(|x| dst.extend(x.to_le_bytes())),
        GgmlType::F16 => src
            .iter()
            .for_each(|&x| dst.extend(f16::from_f32(x).to_bits().to_le_bytes())),
        GgmlType::BF16 => src
            .iter()
            .for_each(|&x| dst.extend(f32_to_bf16(x).to_bits().to_le_bytes())),
        GgmlType::Q8_0 => src.chunks_exact(QK).for_each(|x| quantize_q8_0(x, dst)),
        GgmlType::Q4_0 => src.chunks_exact(QK).for_each(|x| quantize_q4_0(x, dst)),
        GgmlType::Q4_1 => src.chunks_exact(QK).for_each(|x| quantize_q4_1(x, dst)),
        GgmlType::Q4_K => src
            .chunks_exact(QK_K)
            .for_each(|x| kquant::quantize_q4_k(x, dst)),
        GgmlType::Q5_K => src
            .chunks_exact(QK_K)
            .for_each(|x| kquant::quantize_q5_k(x, dst)),
        GgmlType::Q6_K => src
            .chunks_exact(QK_K)
            .for_each(|x| kquant::quantize_q6_k(x, dst)),
        _ => {
            return Err(GgufError::Unsupported {
                dtype,
                op: "quantize_row",
            })
        }
    }
    Ok(())
}

/// The reciprocal used by ggml: `1/d`, or 0 for an all-zero block.
fn inverse(d: f32) -> f32 {
    if d != 0.0 {
        1.0 / d
    } else {
        0.0
    }
}

/// `d = amax / 127`, `q = round(x / d)` (half away from zero, like `roundf`).
fn quantize_q8_0(x: &[f32], dst: &mut Vec<u8>) {
    let amax = x.iter().fold(0f32, |m, v| m.max(v.abs()));
    let d = amax / 127.0;
    let id = inverse(d);
    dst.extend(f16::from_f32(d).to_bits().to_le_bytes());
    // `as i8` saturates (and maps NaN to 0) where C would be undefined.
    dst.extend(x.iter().map(|&v| (v * id).round() as i8 as u8));
}

/// `d = max / -8` where `max` is the element of largest magnitude (the first
/// one on ties), `q = min(15, trunc(x / d + 8.5))`.
fn quantize_q4_0(x: &[f32], dst: &mut Vec<u8>) {
    let (mut amax, mut max) = (0f32, 0f32);
    for &v in x {
        if amax < v.abs() {
            amax = v.abs();
            max = v;
        }
    }
    let d = max / -8.0;
    let id = inverse(d);
    dst.extend(f16::from_f32(d).to_bits().to_le_bytes());
    let q = |v: f32| ((v * id + 8.5) as i8).clamp(0, 15) as u8;
    dst.extend((0..QK / 2).map(|j| q(x[j]) | (q(x[j + QK / 2]) << 4)));
}

/// `d = (max - min) / 15`, `m = min`, `q = min(15, trunc((x - min) / d + 0.5))`.
fn quantize_q4_1(x: &[f32], dst: &mut Vec<u8>) {
    let (mut min, mut max) = (f32::MAX, -f32::MAX);
    for &v in x {
        if v < min {
            min = v;
        }
        if v > max {
            max = v;
        }
    }
    let d = (max - min) / 15.0;
    let id = inverse(d);
    dst.extend(f16::from_f32(d).to_bits().to_le_bytes());
    dst.extend(f16::from_f32(min).to_bits().to_le_bytes());
    let q = |v: f32| (((v - min) * id + 0.5) as i8).clamp(0, 15) as u8;
    dst.extend((0..QK / 2).map(|j| q(x[j]) | (q(x[j + QK / 2]) << 4)));
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn cast_checks_length_and_alignment() {
        let buf = vec![0u16; 64];
        let bytes = blocks_as_bytes(&buf);
        assert_eq!(cast_blocks::<BlockQ4_0>(&bytes[..36]).unwrap().len(), 2);
        assert!(cast_blocks::<BlockQ4_0>(&bytes[..35]).is_err());
        let err = cast_blocks::<BlockQ4_0>(&bytes[1..19]).unwrap_err();
        assert!(err.to_string().contains("aligned"), "{err}");
        assert!(cast_blocks::<u8>(&bytes[1..4]).is_ok());
    }

    #[test]
    fn bf16_rounding_matches_ggml() {
        // 1 + 2^-8 is exactly halfway between two bf16 values: ties to even (down).
        assert_eq!(f32_to_bf16(1.0 + 1.0 / 256.0).to_bits(), 0x3F80);
        // 1 + 3*2^-8 is halfway too, and rounds up to the even neighbour.
        assert_eq!(f32_to_bf16(1.0 + 3.0 / 256.0).to_bits(), 0x3F82);
        assert!(f32_to_bf16(f32::NAN).to_f32().is_nan());
        assert_eq!(f32_to_bf16(-2.5).to_f32(), -2.5);
    }
}
