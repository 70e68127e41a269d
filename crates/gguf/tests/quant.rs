//! Quantize/dequantize: exact hand-computed blocks (rounding rules of ggml's
//! reference quantizers), error bounds on random data, agreement between the
//! byte-level reference and the `#[repr(C)]` block structs, and errors.

use half::f16;
use quire_gguf::{
    cast_blocks, dequantize_row, quantize_row, BlockQ4_0, BlockQ4_1, BlockQ8_0, GgmlType,
    GgufError, QK,
};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn quantize(dtype: GgmlType, x: &[f32]) -> Vec<u8> {
    let mut out = Vec::new();
    quantize_row(dtype, x, &mut out).unwrap();
    assert_eq!(out.len(), x.len() / dtype.block_size() * dtype.type_size());
    out
}

fn dequantize(dtype: GgmlType, bytes: &[u8], n: usize) -> Vec<f32> {
    let mut out = vec![f32::NAN; n];
    dequantize_row(dtype, bytes, &mut out).unwrap();
    out
}

/// A block of 32 with the given leading values and zeros after.
fn block(head: &[(usize, f32)]) -> Vec<f32> {
    let mut x = vec![0f32; QK];
    for &(i, v) in head {
        x[i] = v;
    }
    x
}

#[test]
fn q8_0_hand_computed() {
    // amax 127 -> d = 1, q = round(x), halves away from zero.
    let a = block(&[
        (0, 0.5),
        (1, -0.5),
        (2, 1.5),
        (3, 2.5),
        (4, -2.5),
        (5, 127.0),
        (6, -126.4),
    ]);
    // amax 63.5 -> d = 0.5, q = round(2x).
    let b = block(&[(0, 63.5), (1, -0.25), (2, 0.3), (31, -31.9)]);
    let zero = vec![0f32; QK];
    let x: Vec<f32> = [a, b, zero].concat();
    let bytes = quantize(GgmlType::Q8_0, &x);

    let mut want = vec![0x00, 0x3C, 1, 0xFF, 2, 3, 0xFD, 127, 0x82];
    want.resize(34, 0);
    want.extend([0x00, 0x38, 127, 0xFF, 1]);
    want.resize(34 + 33, 0);
    want.push(0xC0); // round(-63.8) = -64
    want.resize(3 * 34, 0); // all-zero block: d = 0, q = 0
    assert_eq!(bytes, want);

    let y = dequantize(GgmlType::Q8_0, &bytes, 3 * QK);
    assert_eq!(&y[..7], &[1.0, -1.0, 2.0, 3.0, -3.0, 127.0, -126.0]);
    assert_eq!(&y[32..35], &[63.5, -0.5, 0.5]);
    assert_eq!(y[63], -32.0);
    assert!(y[64..].iter().all(|&v| v == 0.0));
}

#[test]
fn q4_0_hand_computed() {
    // Largest magnitude is -8: d = -8 / -8 = 1, q = min(15, trunc(x + 8.5)).
    let a = block(&[
        (0, -8.0),
        (1, 7.0),
        (2, 7.4),
        (3, -0.5),
        (4, -0.51),
        (5, 3.5),
        (16, 2.0),
        (17, -1.2),
    ]);
    // Largest magnitude is +4: d = -0.5, q = trunc(-2x + 8.5); -4 would need
    // q = 16 and is clamped to 15, i.e. dequantizes to -3.5.
    let b = block(&[(0, 4.0), (1, -4.0), (2, 1.0), (3, 0.3)]);
    let x: Vec<f32> = [a, b].concat();
    let bytes = quantize(GgmlType::Q4_0, &x);

    let mut want = vec![0x00, 0x3C, 0xA0, 0x7F, 0x8F, 0x88, 0x87, 0x8C];
    want.resize(18, 0x88);
    want.extend([0x00, 0xB8, 0x80, 0x8F, 0x86, 0x87]);
    want.resize(36, 0x88);
    assert_eq!(bytes, want);

    let y = dequantize(GgmlType::Q4_0, &bytes, 2 * QK);
    assert_eq!(&y[..6], &[-8.0, 7.0, 7.0, 0.0, -1.0, 4.0]);
    assert_eq!(&y[16..18], &[2.0, -1.0]);
    assert_eq!(&y[32..36], &[4.0, -3.5, 1.0, 0.5]);
    assert!(y[36..48].iter().all(|&v| v == 0.0));
}

#[test]
fn q4_1_hand_computed() {
    // min -1, max 14: d = 1, m = -1, q = min(15, trunc(x + 1 + 0.5)).
    let a = block(&[
        (0, -1.0),
        (1, 14.0),
        (2, 2.4),
        (3, 2.5),
        (4, 13.9),
        (20, 6.0),
    ]);
    // A constant block: d = 0, m = the constant, q = 0.
    let b = vec![3.0f32; QK];
    let x: Vec<f32> = [a, b].concat();
    let bytes = quantize(GgmlType::Q4_1, &x);

    // Elements 16..32 are 0 (q = 1) except element 20 (q = 7).
    let mut want = vec![0x00, 0x3C, 0x00, 0xBC, 0x10, 0x1F, 0x13, 0x14, 0x7F];
    want.resize(20, 0x11);
    want.extend([0x00, 0x00, 0x00, 0x42]);
    want.resize(40, 0x00);
    assert_eq!(bytes, want);

    let y = dequantize(GgmlType::Q4_1, &bytes, 2 * QK);
    assert_eq!(&y[..5], &[-1.0, 14.0, 2.0, 3.0, 14.0]);
    assert_eq!(y[20], 6.0);
    assert!(y[32..].iter().all(|&v| v == 3.0));
}

#[test]
fn float_types_round_trip() {
    let x: Vec<f32> = vec![0.0, -0.0, 1.0, -2.5, 65504.0, 1e-3, 3.0e38, f32::INFINITY];
    let y = dequantize(GgmlType::F32, &quantize(GgmlType::F32, &x), x.len());
    assert_eq!(x, y);
    let y = dequantize(GgmlType::F16, &quantize(GgmlType::F16, &x), x.len());
    assert_eq!(&y[..5], &x[..5]);
    assert_eq!(y[5], f16::from_f32(1e-3).to_f32());
    assert_eq!(y[6], f32::INFINITY, "f16 overflow");
    let y = dequantize(GgmlType::BF16, &quantize(GgmlType::BF16, &x), x.len());
    assert_eq!(&y[..4], &x[..4]);
    assert_eq!(y[4], 65536.0, "bf16 rounds 65504 up");
    assert!((y[6] - 3.0e38).abs() / 3.0e38 < 1.0 / 256.0);
}

/// Random blocks at several scales, including one-signed and tiny ones.
fn random_rows(seed: u64) -> Vec<Vec<f32>> {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut rows = Vec::new();
    for &(lo, hi) in &[
        (-1.0f32, 1.0f32),
        (-1e4, 1e4),
        (0.0, 3.0),
        (-5.0, -4.0),
        (-1e-4, 1e-4),
    ] {
        for _ in 0..20 {
            rows.push((0..4 * QK).map(|_| rng.random_range(lo..hi)).collect());
        }
    }
    rows
}

/// Checks every element against `bound(block)`, the largest error that
/// ggml's rounding rules allow for that block.
fn check_bound(dtype: GgmlType, bound: impl Fn(&[f32]) -> f32) {
    let mut worst = 0f32;
    for row in random_rows(dtype as u64) {
        let y = dequantize(dtype, &quantize(dtype, &row), row.len());
        for (xb, yb) in row.chunks(QK).zip(y.chunks(QK)) {
            let b = bound(xb);
            for (a, q) in xb.iter().zip(yb) {
                let err = (a - q).abs();
                assert!(err <= b, "{dtype}: {a} -> {q}, error {err} > bound {b}");
                worst = worst.max(err / b);
            }
        }
    }
    // The bound is not so loose that it could never be hit.
    assert!(
        worst > 0.3,
        "{dtype}: worst error only {worst} of the bound"
    );
}

/// Largest error of rounding `v` to f16: half an ulp relative (2^-11), or
/// half the subnormal spacing (2^-25) for tiny values.
fn f16_err(v: f32) -> f32 {
    (v.abs() / 2048.0).max(1.0 / (1u32 << 25) as f32)
}

fn amax(x: &[f32]) -> f32 {
    x.iter().fold(0f32, |m, v| m.max(v.abs()))
}

#[test]
fn q8_0_error_bound() {
    // Half a step, plus 127 steps' worth of f16 rounding of d.
    check_bound(GgmlType::Q8_0, |x| {
        let d = amax(x) / 127.0;
        (d * 0.5 + 127.0 * f16_err(d)) * 1.0001
    });
}

#[test]
fn q4_0_error_bound() {
    // Half a step normally; a whole step for the clamped value opposite the
    // extreme (q would be 16); plus 8 steps' worth of f16 rounding of d.
    check_bound(GgmlType::Q4_0, |x| {
        let d = amax(x) / 8.0;
        (d + 8.0 * f16_err(d)) * 1.0001
    });
}

#[test]
fn q4_1_error_bound() {
    // Half a step, plus f16 rounding of d (times up to 15) and of m.
    check_bound(GgmlType::Q4_1, |x| {
        let min = x.iter().copied().fold(f32::MAX, f32::min);
        let max = x.iter().copied().fold(f32::MIN, f32::max);
        let d = (max - min) / 15.0;
        (d * 0.5 + 15.0 * f16_err(d) + f16_err(min)) * 1.0001
    });
}

#[test]
fn block_structs_agree_with_reference() {
    let rows = random_rows(99);
    let x: Vec<f32> = rows.concat();
    let n = x.len();
    // Copy into u16 storage so the bytes are 2-aligned like mmap'd tensor data.
    let aligned = |bytes: Vec<u8>| -> Vec<u16> {
        bytes
            .chunks(2)
            .map(|c| u16::from_ne_bytes([c[0], c[1]]))
            .collect()
    };
    let as_bytes = |v: &[u16]| quire_gguf::blocks_as_bytes(v).to_vec();

    let q = aligned(quantize(GgmlType::Q8_0, &x));
    let bytes = as_bytes(&q);
    let blocks: &[BlockQ8_0] = cast_blocks(quire_gguf::blocks_as_bytes(&q)).unwrap();
    let via_structs: Vec<f32> = blocks.iter().flat_map(|b| b.dequantize()).collect();
    assert_eq!(via_structs, dequantize(GgmlType::Q8_0, &bytes, n));

    let q = aligned(quantize(GgmlType::Q4_0, &x));
    let bytes = as_bytes(&q);
    let blocks: &[BlockQ4_0] = cast_blocks(quire_gguf::blocks_as_bytes(&q)).unwrap();
    let via_structs: Vec<f32> = blocks.iter().flat_map(|b| b.dequantize()).collect();
    assert_eq!(via_structs, dequantize(GgmlType::Q4_0, &bytes, n));

    let q = aligned(quantize(GgmlType::Q4_1, &x));
    let bytes = as_bytes(&q);
    let blocks: &[BlockQ4_1] = cast_blocks(quire_gguf::blocks_as_bytes(&q)).unwrap();
    let via_structs: Vec<f32> = blocks.iter().flat_map(|b| b.dequantize()).collect();
    assert_eq!(via_structs, dequantize(GgmlType::Q4_1, &bytes, n));
    assert_eq!(
        blocks[0].m,
        f16::from_f32(rows[0][..QK].iter().copied().fold(f32::MAX, f32::min))
    );
}

#[test]
fn errors_are_reported() {
    let mut out = vec![0f32; 32];
    let e = dequantize_row(GgmlType::Q8_0, &[0u8; 33], &mut out).unwrap_err();
    assert!(
        matches!(
            e,
            GgufError::LengthMismatch {
                expected: 34,
                got: 33,
                ..
            }
        ),
        "{e}"
    );
    let e = dequantize_row(GgmlType::Q4_0, &[0u8; 18], &mut out[..16]).unwrap_err();
    assert!(
        matches!(e, GgufError::NotBlockMultiple { n: 16, .. }),
        "{e}"
    );
    let e = dequantize_row(GgmlType::Q3_K, &[0u8; 110], &mut [0f32; 256]).unwrap_err();
    assert!(matches!(e, GgufError::Unsupported { .. }), "{e}");
    let mut bytes = Vec::new();
    assert!(quantize_row(GgmlType::Q4_1, &[0.0; 31], &mut bytes).is_err());
    assert!(quantize_row(GgmlType::Q5_0, &[0.0; 32], &mut bytes).is_err());
    assert!(quantize_row(GgmlType::I32, &[0.0; 1], &mut bytes).is_err());
    // Non-finite input does not panic.
    let x = block(&[(0, f32::NAN), (1, f32::INFINITY), (2, -1.0)]);
    for t in [GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1] {
        quantize_row(t, &x, &mut bytes).unwrap();
    }
}
