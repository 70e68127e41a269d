//! K-quants (Q4_K, Q5_K, Q6_K): dequantization bit for bit on random blocks against (a) a plain
//! per-element reference written here from ggml's formulas and (b) the `gguf` Python package's
//! numpy dequantizers (an independent implementation); round-trip error bounds of the quantizers.
//!
//! (b) needs a Python with `gguf` and `numpy` (tests/python/requirements.txt), named by
//! `QUIRE_PYTHON` (default `python3`); it is listed as ignored unless `QUIRE_REQUIRE_PY` was set
//! at build time (CI sets it), and then fails where the packages are missing.

use std::process::{Command, Stdio};

use half::f16;
use quire_gguf::{dequantize_row, quantize_row, GgmlType, QK_K};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

const KQUANTS: [GgmlType; 3] = [GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K];

/// A finite f16 scale's bytes: mostly normal magnitudes, sometimes subnormal or zero, either sign.
fn rand_scale(rng: &mut StdRng) -> [u8; 2] {
    let v = match rng.random_range(0..10) {
        0 => 0.0,
        1 => rng.random_range(-1e-6f32..1e-6),
        _ => rng.random_range(-0.1f32..0.1),
    };
    f16::from_f32(v).to_bits().to_le_bytes()
}

/// `n` random blocks of `dtype`: random code and scale bytes, finite f16 super-block scales.
fn rand_blocks(rng: &mut StdRng, dtype: GgmlType, n: usize) -> Vec<u8> {
    let ts = dtype.type_size();
    let mut out = Vec::with_capacity(n * ts);
    for _ in 0..n {
        let mut b: Vec<u8> = (0..ts).map(|_| rng.random()).collect();
        match dtype {
            GgmlType::Q6_K => b[208..210].copy_from_slice(&rand_scale(rng)),
            _ => {
                b[0..2].copy_from_slice(&rand_scale(rng));
                b[2..4].copy_from_slice(&rand_scale(rng));
            }
        }
        out.extend(b);
    }
    out
}

fn f16_le(b: &[u8]) -> f32 {
    f16::from_bits(u16::from_le_bytes([b[0], b[1]])).to_f32()
}

/// ggml's `get_scale_min_k4`, written out again byte by byte for the reference.
fn ref_scale_min(j: usize, s: &[u8]) -> (f32, f32) {
    let (sc, m) = if j < 4 {
        (s[j] & 0x3F, s[j + 4] & 0x3F)
    } else {
        (
            (s[j + 4] & 0x0F) | ((s[j - 4] >> 6) << 4),
            (s[j + 4] >> 4) | ((s[j] >> 6) << 4),
        )
    };
    (sc as f32, m as f32)
}

/// Element `i` of one block, straight from the formulas of ggml's `dequantize_row_q{4,5,6}_K`:
/// Q4_K/Q5_K `y = (d * sc) * q - (dmin * m)`, Q6_K `y = (d * sc) * (q - 32)`.
fn reference_element(dtype: GgmlType, b: &[u8], i: usize) -> f32 {
    match dtype {
        GgmlType::Q4_K | GgmlType::Q5_K => {
            let (d, dmin) = (f16_le(&b[0..]), f16_le(&b[2..]));
            let scales = &b[4..16];
            let (qh, qs) = if dtype == GgmlType::Q5_K {
                (&b[16..48], &b[48..176])
            } else {
                (&[][..], &b[16..144])
            };
            let j = i / 32; // sub-block
            let (sc, m) = ref_scale_min(j, scales);
            let byte = qs[32 * (i / 64) + i % 32];
            let mut q = if j % 2 == 0 { byte & 0x0F } else { byte >> 4 } as u32;
            if dtype == GgmlType::Q5_K && (qh[i % 32] >> j) & 1 == 1 {
                q += 16;
            }
            d * sc * q as f32 - dmin * m
        }
        GgmlType::Q6_K => {
            let (ql, qh, sc, d) = (&b[0..128], &b[128..192], &b[192..208], f16_le(&b[208..]));
            let (half, k, l) = (i / 128, (i % 128) / 32, i % 32);
            let lbyte = ql[64 * half + 32 * (k % 2) + l];
            let low = if k < 2 { lbyte & 0x0F } else { lbyte >> 4 } as i32;
            let high = ((qh[32 * half + l] >> (2 * k)) & 3) as i32;
            let q = (low | (high << 4)) - 32;
            d * (sc[i / 16] as i8) as f32 * q as f32
        }
        _ => unreachable!(),
    }
}

fn dequantize(dtype: GgmlType, bytes: &[u8]) -> Vec<f32> {
    let n = bytes.len() / dtype.type_size() * dtype.block_size();
    let mut out = vec![f32::NAN; n];
    dequantize_row(dtype, bytes, &mut out).unwrap();
    out
}

#[test]
fn dequantize_is_bit_exact_against_the_formula() {
    let mut rng = StdRng::seed_from_u64(1);
    for dtype in KQUANTS {
        let nb = 37;
        let bytes = rand_blocks(&mut rng, dtype, nb);
        let got = dequantize(dtype, &bytes);
        for (bi, b) in bytes.chunks_exact(dtype.type_size()).enumerate() {
            for i in 0..QK_K {
                let want = reference_element(dtype, b, i);
                let g = got[bi * QK_K + i];
                assert_eq!(
                    g.to_bits(),
                    want.to_bits(),
                    "{dtype} block {bi} element {i}: {g} vs {want}"
                );
            }
        }
    }
}

/// The Python with `gguf` and `numpy`, or None (skipped with a note) when absent.
fn python() -> String {
    let py = std::env::var("QUIRE_PYTHON").unwrap_or_else(|_| "python3".into());
    let ok = Command::new(&py)
        .args(["-c", "import gguf.quants, numpy"])
        .stderr(Stdio::null())
        .status()
        .is_ok_and(|s| s.success());
    if ok {
        return py;
    }
    let msg = format!(
        "{py} lacks the gguf/numpy packages: pip install -r tests/python/requirements.txt and set \
         QUIRE_PYTHON (.ci/run does)"
    );
    panic!("{msg}")
}

/// Reads raw blocks of the type named by argv[1] from argv[2], writes the f32 dequantization
/// (little-endian) to argv[3].
const PY_DEQUANT: &str = r#"
import sys, numpy as np
from gguf import GGMLQuantizationType
from gguf.quants import dequantize, GGML_QUANT_SIZES
qt = GGMLQuantizationType[sys.argv[1]]
_, size = GGML_QUANT_SIZES[qt]
raw = np.fromfile(sys.argv[2], dtype=np.uint8).reshape(-1, size)
dequantize(raw, qt).astype('<f4').tofile(sys.argv[3])
"#;

quire_testkit::py_test! {
fn dequantize_is_bit_exact_against_gguf_python() {
    let py = python();
    let dir = std::env::temp_dir().join(format!("quire-kquant-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    let mut rng = StdRng::seed_from_u64(2);
    for dtype in KQUANTS {
        let bytes = rand_blocks(&mut rng, dtype, 101);
        let (src, dst) = (dir.join("blocks.bin"), dir.join("out.bin"));
        std::fs::write(&src, &bytes).unwrap();
        let out = Command::new(&py)
            .args(["-c", PY_DEQUANT, dtype.name()])
            .arg(&src)
            .arg(&dst)
            .output()
            .unwrap();
        assert!(
            out.status.success(),
            "{}",
            String::from_utf8_lossy(&out.stderr)
        );
        let theirs = std::fs::read(&dst).unwrap();
        let ours = dequantize(dtype, &bytes);
        assert_eq!(theirs.len(), ours.len() * 4, "{dtype}");
        for (i, (t, o)) in theirs.chunks_exact(4).zip(&ours).enumerate() {
            let t = u32::from_le_bytes([t[0], t[1], t[2], t[3]]);
            assert_eq!(
                t,
                o.to_bits(),
                "{dtype} element {i}: gguf-py {} vs {o}",
                f32::from_bits(t)
            );
        }
    }
    let _ = std::fs::remove_dir_all(&dir);
}
}

fn rmse(a: &[f32], b: &[f32]) -> f64 {
    let s: f64 = a
        .iter()
        .zip(b)
        .map(|(&x, &y)| ((x - y) as f64).powi(2))
        .sum();
    (s / a.len() as f64).sqrt()
}

fn round_trip(dtype: GgmlType, x: &[f32]) -> Vec<f32> {
    let mut q = Vec::new();
    quantize_row(dtype, x, &mut q).unwrap();
    assert_eq!(q.len(), x.len() / dtype.block_size() * dtype.type_size());
    dequantize(dtype, &q)
}

/// Relative RMS error (error RMS / signal RMS) on rows of uniform and of Gaussian-like data with
/// a scale that varies per sub-block, as weights do. Bounds are what 4, 5 and 6 bits per weight
/// allow with some room (uniform error of a step of range/(2^bits - 1)); the ordering checks that
/// each extra bit pays, and Q4_K must be no worse than Q4_1 by more than its scale quantization.
#[test]
fn round_trip_error_is_bounded() {
    let mut rng = StdRng::seed_from_u64(3);
    let n = 64 * QK_K;
    let uniform: Vec<f32> = (0..n).map(|_| rng.random_range(-1.0f32..1.0)).collect();
    let gauss: Vec<f32> = (0..n)
        .map(|i| {
            let s = 0.01 + 0.05 * ((i / 32) % 7) as f32;
            let u: f32 = (0..4).map(|_| rng.random_range(-1.0f32..1.0)).sum();
            s * u
        })
        .collect();
    for (name, x) in [("uniform", &uniform), ("gauss", &gauss)] {
        let sig = (x.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / n as f64).sqrt();
        let rel = |t: GgmlType| rmse(x, &round_trip(t, x)) / sig;
        let (q4, q5, q6, q41) = (
            rel(GgmlType::Q4_K),
            rel(GgmlType::Q5_K),
            rel(GgmlType::Q6_K),
            rel(GgmlType::Q4_1),
        );
        eprintln!("{name}: rel rmse Q4_K {q4:.4} Q5_K {q5:.4} Q6_K {q6:.4} (Q4_1 {q41:.4})");
        assert!(q4 < 0.075, "{name} Q4_K {q4}");
        assert!(q5 < 0.038, "{name} Q5_K {q5}");
        assert!(q6 < 0.02, "{name} Q6_K {q6}");
        assert!(q6 < q5 && q5 < q4, "{name}: {q6} {q5} {q4}");
        assert!(q4 < 1.15 * q41, "{name}: Q4_K {q4} vs Q4_1 {q41}");
    }
}

/// Per element, the error is at most one quantization step of its sub-block (half a step from
/// rounding, the rest from the clamped fit), and zero rows stay exactly zero.
#[test]
fn round_trip_elementwise_and_edge_cases() {
    let mut rng = StdRng::seed_from_u64(4);
    let x: Vec<f32> = (0..8 * QK_K)
        .map(|_| rng.random_range(-3.0f32..2.0))
        .collect();
    for dtype in KQUANTS {
        let y = round_trip(dtype, &x);
        let sub = if dtype == GgmlType::Q6_K { 16 } else { 32 };
        let levels = match dtype {
            GgmlType::Q4_K => 15.0,
            GgmlType::Q5_K => 31.0,
            _ => 63.0,
        };
        for (xs, ys) in x.chunks(sub).zip(y.chunks(sub)) {
            let lo = xs.iter().fold(0f32, |a, &v| a.min(v));
            let hi = xs.iter().fold(0f32, |a, &v| a.max(v));
            let step = (hi - lo) / levels;
            for (&a, &b) in xs.iter().zip(ys) {
                assert!(
                    (a - b).abs() <= 1.01 * step,
                    "{dtype}: {a} -> {b} step {step}"
                );
            }
        }
        assert!(round_trip(dtype, &vec![0.0; QK_K])
            .iter()
            .all(|&v| v == 0.0));
        // Constant, single-spike and non-finite blocks do not panic.
        let _ = round_trip(dtype, &vec![0.25; QK_K]);
        let mut spike = vec![0.0; QK_K];
        spike[77] = -5.0;
        let s = round_trip(dtype, &spike);
        assert!((s[77] + 5.0).abs() < 0.05 && s[0].abs() < 0.05, "{dtype}");
        let mut bad = vec![1.0; QK_K];
        bad[3] = f32::NAN;
        bad[9] = f32::INFINITY;
        let mut q = Vec::new();
        quantize_row(dtype, &bad, &mut q).unwrap();
        assert!(quantize_row(dtype, &[0.0; 128], &mut q).is_err());
    }
}
