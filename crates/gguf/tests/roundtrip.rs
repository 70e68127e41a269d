//! Writer -> reader round trips: every metadata value type, versions 2 and 3,
//! custom alignments, and tensors of every supported dtype (plus a few known
//! but unsupported ones, which must parse fine).

mod common;

use quire_gguf::{quantize_row, GgmlType, GgufError, GgufFile, GgufWriter, Value};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

fn all_value_kinds() -> Vec<(&'static str, Value)> {
    vec![
        ("t.u8", Value::U8(250)),
        ("t.i8", Value::I8(-120)),
        ("t.u16", Value::U16(65_000)),
        ("t.i16", Value::I16(-32_000)),
        ("t.u32", Value::U32(4_000_000_000)),
        ("t.i32", Value::I32(-2_000_000_000)),
        ("t.u64", Value::U64(u64::MAX - 1)),
        ("t.i64", Value::I64(i64::MIN + 1)),
        ("t.f32", Value::F32(-1.5e-7)),
        ("t.f64", Value::F64(std::f64::consts::PI)),
        ("t.bool", Value::Bool(true)),
        ("t.false", Value::Bool(false)),
        ("t.string", Value::from("héllo\nwörld \u{1F980}")),
        ("t.empty_string", Value::from("")),
        ("t.strings", Value::from(vec!["a", "", "ü", "<|im_start|>"])),
        ("t.i32s", Value::from(vec![1i32, -2, 3])),
        ("t.f32s", Value::from(vec![0.5f32, -0.25])),
        ("t.bools", Value::from(vec![true, false, true])),
        ("t.u8s", Value::from(vec![0u8, 255])),
        ("t.f64s", Value::from(vec![1e300f64])),
        ("t.empty_array", Value::Array(vec![])),
        (
            "t.nested",
            Value::Array(vec![
                Value::from(vec!["x", "y"]),
                Value::from(vec!["z"]),
                Value::Array(vec![]),
            ]),
        ),
        (
            "t.nested3",
            Value::Array(vec![Value::Array(vec![Value::from(vec![7u64, 8])])]),
        ),
    ]
}

/// (name, dims, dtype) for tensors whose data comes from `quantize_row`.
const SUPPORTED: &[(&str, &[u64], GgmlType)] = &[
    ("f32.1d", &[7], GgmlType::F32),
    ("f16.2d", &[5, 3], GgmlType::F16),
    ("bf16.3d", &[4, 3, 2], GgmlType::BF16),
    ("q8_0.2d", &[64, 3], GgmlType::Q8_0),
    ("q4_0.4d", &[32, 2, 2, 2], GgmlType::Q4_0),
    ("q4_1.2d", &[96, 2], GgmlType::Q4_1),
    ("q4_k.2d", &[256, 2], GgmlType::Q4_K),
    ("q5_k.2d", &[512, 1], GgmlType::Q5_K),
    ("q6_k.2d", &[256, 3], GgmlType::Q6_K),
];

fn build(version: u32, alignment: Option<u64>, seed: u64) -> (GgufWriter, Vec<(String, Vec<u8>)>) {
    let mut rng = StdRng::seed_from_u64(seed);
    let mut w = GgufWriter::new();
    w.set_version(version).unwrap();
    w.add_metadata("general.architecture", "llama").unwrap();
    if let Some(a) = alignment {
        w.set_alignment(a).unwrap();
    }
    for (k, v) in all_value_kinds() {
        w.add_metadata(k, v).unwrap();
    }
    let mut expected = Vec::new();
    for &(name, dims, dtype) in SUPPORTED {
        let n: u64 = dims.iter().product();
        let src: Vec<f32> = (0..n).map(|_| rng.random_range(-2.0..2.0)).collect();
        let mut data = Vec::new();
        quantize_row(dtype, &src, &mut data).unwrap();
        w.add_tensor(name, dims, dtype, data.clone()).unwrap();
        expected.push((name.to_owned(), data));
    }
    // Known but unsupported: must be written and parsed like any other.
    let q3k: Vec<u8> = (0..2 * 110).map(|i| i as u8).collect();
    w.add_tensor("q3_k", &[256, 2], GgmlType::Q3_K, q3k.clone())
        .unwrap();
    expected.push(("q3_k".to_owned(), q3k));
    w.add_tensor("empty", &[0, 4], GgmlType::F32, Vec::new())
        .unwrap();
    expected.push(("empty".to_owned(), Vec::new()));
    (w, expected)
}

fn check(f: &GgufFile, version: u32, alignment: u64, tensors: &[(String, Vec<u8>)]) {
    assert_eq!(f.version(), version);
    assert_eq!(f.alignment(), alignment);
    assert_eq!(f.data_offset() % alignment, 0);
    assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
    // Metadata comes back in order and with identical types and values.
    let mut want: Vec<(String, Value)> = vec![("general.architecture".into(), "llama".into())];
    if alignment != 32 {
        want.push(("general.alignment".into(), Value::U32(alignment as u32)));
    }
    want.extend(
        all_value_kinds()
            .into_iter()
            .map(|(k, v)| (k.to_owned(), v)),
    );
    assert_eq!(f.metadata(), &want[..]);

    assert_eq!(f.tensors().len(), tensors.len());
    for (info, (name, data)) in f.tensors().iter().zip(tensors) {
        assert_eq!(&info.name, name);
        assert_eq!(info.offset % alignment, 0, "{name}");
        assert_eq!(info.size_bytes(), data.len() as u64, "{name}");
        assert_eq!(f.tensor_data(info), &data[..], "{name}");
        assert_eq!(f.tensor(name), Some(info));
    }
    let t = f.tensor("q4_0.4d").unwrap();
    assert_eq!(
        (t.dims.as_slice(), t.dtype, t.rows(), t.row_len()),
        (&[32u64, 2, 2, 2][..], GgmlType::Q4_0, 8, 32)
    );
    assert!(!f.tensor("q3_k").unwrap().dtype.is_supported());
}

#[test]
fn round_trip_versions_and_alignments() {
    for (version, alignment) in [
        (3, None),
        (2, None),
        (3, Some(64)),
        (2, Some(1)),
        (3, Some(4096)),
    ] {
        let (w, tensors) = build(version, alignment, 7);
        let bytes = w.to_bytes().unwrap();
        let f = GgufFile::from_bytes(bytes).unwrap();
        check(&f, version, alignment.unwrap_or(32), &tensors);
    }
}

#[test]
fn round_trip_through_a_file_uses_mmap() {
    let (w, tensors) = build(3, Some(128), 11);
    let path = common::temp_path("roundtrip");
    w.write_file(&path).unwrap();
    let f = GgufFile::open(&path).unwrap();
    assert!(f.is_mmapped());
    check(&f, 3, 128, &tensors);
    assert_eq!(f.bytes(), &w.to_bytes().unwrap()[..]);
    drop(f);
    std::fs::remove_file(&path).unwrap();
}

#[test]
fn typed_getters_convert_and_reject() {
    let (w, _) = build(3, None, 1);
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.get_u32("t.u8").unwrap(), Some(250));
    assert_eq!(f.get_u32("t.u16").unwrap(), Some(65_000));
    assert_eq!(f.get_u64("t.u64").unwrap(), Some(u64::MAX - 1));
    assert_eq!(f.get_i64("t.i8").unwrap(), Some(-120));
    assert_eq!(f.get_f32("t.f64").unwrap(), Some(std::f32::consts::PI));
    assert_eq!(f.get_f32("t.i16").unwrap(), Some(-32_000.0));
    assert_eq!(f.get_bool("t.bool").unwrap(), Some(true));
    assert_eq!(f.get_str("missing").unwrap(), None);
    assert_eq!(f.get_u32("missing").unwrap(), None);
    assert_eq!(
        f.get_str_array("t.strings").unwrap(),
        Some(vec!["a", "", "ü", "<|im_start|>"])
    );
    assert_eq!(f.get_i32_array("t.i32s").unwrap(), Some(vec![1, -2, 3]));
    assert_eq!(f.get_i32_array("t.u8s").unwrap(), Some(vec![0, 255]));
    assert_eq!(f.get_f32_array("t.f32s").unwrap(), Some(vec![0.5, -0.25]));
    assert_eq!(f.get_str_array("t.empty_array").unwrap(), Some(vec![]));

    let err = |e: GgufError| e.to_string();
    // Negative, too large, wrong kind: errors that name the key.
    let e = err(f.get_u32("t.i8").unwrap_err());
    assert!(e.contains("\"t.i8\"") && e.contains("u32"), "{e}");
    let e = err(f.get_u32("t.u64").unwrap_err());
    assert!(e.contains("\"t.u64\"") && e.contains("does not fit"), "{e}");
    let e = err(f.get_u32("t.string").unwrap_err());
    assert!(e.contains("\"t.string\"") && e.contains("string"), "{e}");
    assert!(f.get_bool("t.u8").is_err());
    assert!(f.get_str("t.strings").is_err());
    assert!(f.get_f32("t.bool").is_err());
    let e = err(f.get_str_array("t.i32s").unwrap_err());
    assert!(
        e.contains("array<i32>") && e.contains("array<string>"),
        "{e}"
    );
    assert!(f.get_i32_array("t.u16").is_err());
    assert!(f.get_i32_array("t.strings").is_err());
    let e = err(f.get_u32_array("t.i32s").unwrap_err());
    assert!(e.contains("-2"), "{e}");
}

#[test]
fn writer_rejects_what_the_reader_would() {
    let mut w = GgufWriter::new();
    w.add_metadata("k", 1u32).unwrap();
    assert!(w.add_metadata("k", 2u32).is_err(), "duplicate key");
    assert!(w.set_version(1).is_err());
    assert!(w.set_alignment(48).is_err());
    assert!(w.set_alignment(1 << 32).is_err());
    assert!(
        w.add_metadata("general.alignment", 64u64).is_err(),
        "must be u32"
    );
    assert!(w.add_metadata("general.alignment", 24u32).is_err());
    let mixed = Value::Array(vec![Value::U8(1), Value::I8(1)]);
    assert!(w.add_metadata("mixed", mixed).is_err());
    let mut deep = Value::from(vec![1u8]);
    for _ in 0..quire_gguf::MAX_ARRAY_DEPTH {
        deep = Value::Array(vec![deep]);
    }
    let e = w.add_metadata("deep", deep).unwrap_err().to_string();
    assert!(e.contains("nested"), "{e}");

    w.add_tensor("t", &[32], GgmlType::Q8_0, vec![0u8; 34])
        .unwrap();
    assert!(w
        .add_tensor("t", &[32], GgmlType::Q8_0, vec![0u8; 34])
        .is_err());
    let e = w
        .add_tensor("u", &[32], GgmlType::Q8_0, vec![0u8; 33])
        .unwrap_err();
    assert!(e.to_string().contains("\"u\""), "{e}");
    assert!(
        w.add_tensor("v", &[16], GgmlType::Q4_0, vec![0u8; 9])
            .is_err(),
        "partial block"
    );
    assert!(w
        .add_tensor("w", &[1, 1, 1, 1, 1], GgmlType::F32, vec![0u8; 4])
        .is_err());
    assert!(w
        .add_tensor("x", &[u64::MAX, 2], GgmlType::I8, vec![])
        .is_err());
    // Nothing invalid was recorded: the result still reads back.
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.metadata().len(), 1);
    assert_eq!(f.tensors().len(), 1);
}

#[test]
fn alignment_set_via_metadata_key() {
    let mut w = GgufWriter::new();
    w.add_metadata("general.alignment", 256u32).unwrap();
    w.add_tensor("a", &[3], GgmlType::F32, vec![1u8; 12])
        .unwrap();
    w.add_tensor("b", &[3], GgmlType::F32, vec![2u8; 12])
        .unwrap();
    let f = GgufFile::from_bytes(w.to_bytes().unwrap()).unwrap();
    assert_eq!(f.alignment(), 256);
    assert_eq!(f.tensor("b").unwrap().offset, 256);
    assert_eq!(f.tensor_data(f.tensor("b").unwrap()), &[2u8; 12]);
}
