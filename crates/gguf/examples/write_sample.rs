//! Dev tool: writes a GGUF file exercising every metadata value type and every
//! supported tensor dtype, for checking with Python's `gguf` package
//! (`scripts/check_python_gguf.py`). Usage: `write_sample OUT.gguf [VERSION] [ALIGNMENT]`.
//!
//! Each quantized tensor `<dtype>` has an F32 companion `<dtype>.src` holding
//! the input it was quantized from, so the script can re-quantize with
//! `gguf.quants` and compare bytes.

use quire_gguf::{quantize_row, GgmlType, GgufWriter, Value};

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let mut args = std::env::args().skip(1);
    let out = args
        .next()
        .ok_or("usage: write_sample OUT.gguf [VERSION] [ALIGNMENT]")?;
    let version: u32 = args.next().map_or(Ok(3), |s| s.parse())?;
    let alignment: Option<u64> = args.next().map(|s| s.parse()).transpose()?;

    let mut w = GgufWriter::new();
    w.set_version(version)?;
    if let Some(a) = alignment {
        w.set_alignment(a)?;
    }
    w.add_metadata("general.architecture", "llama")?
        .add_metadata("t.u8", 250u8)?
        .add_metadata("t.i8", -120i8)?
        .add_metadata("t.u16", 65_000u16)?
        .add_metadata("t.i16", -32_000i16)?
        .add_metadata("t.u32", 4_000_000_000u32)?
        .add_metadata("t.i32", -2_000_000_000i32)?
        .add_metadata("t.u64", u64::MAX - 1)?
        .add_metadata("t.i64", i64::MIN + 1)?
        .add_metadata("t.f32", 0.5f32)?
        .add_metadata("t.f64", 0.25f64)?
        .add_metadata("t.bool", true)?
        .add_metadata("t.string", "héllo \u{1F980}")?
        .add_metadata("t.strings", vec!["a", "", "ü"])?
        .add_metadata("t.i32s", vec![1i32, -2, 3])?
        .add_metadata(
            "t.nested",
            Value::Array(vec![Value::from(vec![1u16, 2]), Value::from(vec![3u16])]),
        )?;

    // Deterministic, irregular input (no rand dependency outside tests).
    let src: Vec<f32> = (0..256)
        .map(|i| ((i * 7919 % 257) as f32 - 128.0) / 37.0 * if i % 32 == 5 { 9.0 } else { 1.0 })
        .collect();
    for dtype in [
        GgmlType::F32,
        GgmlType::F16,
        GgmlType::BF16,
        GgmlType::Q8_0,
        GgmlType::Q4_0,
        GgmlType::Q4_1,
    ] {
        let mut data = Vec::new();
        quantize_row(dtype, &src, &mut data)?;
        w.add_tensor(dtype.name(), &[64, 4], dtype, data)?;
    }
    let src_bytes: Vec<u8> = src.iter().flat_map(|x| x.to_le_bytes()).collect();
    w.add_tensor("src", &[64, 4], GgmlType::F32, src_bytes)?;
    w.write_file(&out)?;
    println!("wrote {out}");
    Ok(())
}
