//! The real default model (SmolLM2-135M-Instruct, Q4_1, written by llama.cpp's
//! Python converter): known facts about it, every tensor reachable and
//! decodable, and a byte-identical rewrite through `GgufWriter`.

mod common;

use quire_gguf::{cast_blocks, dequantize_row, BlockQ8_0, GgmlType, GgufFile, GgufWriter, Value};

#[test]
fn known_facts() {
    let f = GgufFile::open(common::model_path()).unwrap();
    assert!(f.is_mmapped());
    assert_eq!(f.version(), 3);
    assert_eq!(f.alignment(), 32);
    assert_eq!(f.tensors().len(), 272);
    assert_eq!(f.get_str("general.architecture").unwrap(), Some("llama"));
    assert_eq!(f.get_u32("llama.embedding_length").unwrap(), Some(576));
    assert_eq!(f.get_u32("llama.block_count").unwrap(), Some(30));
    let eps = f
        .get_f32("llama.attention.layer_norm_rms_epsilon")
        .unwrap()
        .unwrap();
    assert!(eps > 0.0 && eps < 1e-3, "{eps}");

    let emb = f.tensor("token_embd.weight").unwrap();
    assert_eq!(emb.dtype, GgmlType::Q8_0);
    assert_eq!(emb.dims, vec![576, 49152]);
    assert_eq!((emb.row_len(), emb.rows()), (576, 49152));
    assert_eq!(emb.size_bytes(), 49152 * 576 / 32 * 34);

    let tokens = f.get_str_array("tokenizer.ggml.tokens").unwrap().unwrap();
    assert_eq!(tokens.len(), 49152);
    assert_eq!(
        f.get_i32_array("tokenizer.ggml.token_type")
            .unwrap()
            .unwrap()
            .len(),
        49152
    );
    assert_eq!(
        f.get_str_array("tokenizer.ggml.merges")
            .unwrap()
            .unwrap()
            .len(),
        48900
    );
    let bos = f.get_u32("tokenizer.ggml.bos_token_id").unwrap().unwrap();
    assert!((bos as usize) < tokens.len());
    // Typed access to the wrong type is an error naming the key.
    let e = f.get_u32("general.architecture").unwrap_err().to_string();
    assert!(e.contains("general.architecture"), "{e}");

    let dtypes: std::collections::BTreeMap<&str, usize> =
        f.tensors().iter().fold(Default::default(), |mut m, t| {
            *m.entry(t.dtype.name()).or_default() += 1;
            m
        });
    assert_eq!(
        dtypes.into_iter().collect::<Vec<_>>(),
        [("F32", 61), ("Q4_1", 210), ("Q8_0", 1)]
    );
}

#[test]
fn every_tensor_is_in_bounds_and_decodes() {
    let f = GgufFile::open(common::model_path()).unwrap();
    assert_eq!(f.data_offset() % f.alignment(), 0);
    let mut end = 0;
    for t in f.tensors() {
        assert!(t.dtype.is_supported(), "{}", t.name);
        let data = f.tensor_data(t);
        assert_eq!(data.len() as u64, t.size_bytes(), "{}", t.name);
        end = end.max(f.data_offset() + t.offset + t.size_bytes());
        // Decode the first and last rows; weights of a trained model are finite and small.
        let row_bytes = t.dtype.row_size(t.row_len()).unwrap() as usize;
        let mut row = vec![0f32; t.row_len() as usize];
        for r in [0, t.rows() as usize - 1] {
            let src = &data[r * row_bytes..(r + 1) * row_bytes];
            dequantize_row(t.dtype, src, &mut row).unwrap();
            assert!(
                row.iter().all(|v| v.is_finite() && v.abs() < 1e3),
                "{} row {r}",
                t.name
            );
        }
    }
    assert!(end <= f.bytes().len() as u64);

    // The mmap'd Q8_0 data can be viewed as blocks directly.
    let emb = f.tensor("token_embd.weight").unwrap();
    let blocks: &[BlockQ8_0] = cast_blocks(f.tensor_data(emb)).unwrap();
    assert_eq!(blocks.len(), 49152 * 576 / 32);
    let mut row = vec![0f32; 576];
    dequantize_row(GgmlType::Q8_0, &f.tensor_data(emb)[..18 * 34], &mut row).unwrap();
    let via_blocks: Vec<f32> = blocks[..18].iter().flat_map(|b| b.dequantize()).collect();
    assert_eq!(row, via_blocks);
}

#[test]
fn rewrite_is_byte_identical() {
    let f = GgufFile::open(common::model_path()).unwrap();
    let mut w = GgufWriter::new();
    w.set_version(f.version()).unwrap();
    for (k, v) in f.metadata() {
        w.add_metadata(k.clone(), v.clone()).unwrap();
    }
    for t in f.tensors() {
        w.add_tensor(t.name.clone(), &t.dims, t.dtype, f.tensor_data(t))
            .unwrap();
    }
    let bytes = w.to_bytes().unwrap();
    assert_eq!(bytes.len(), f.bytes().len());
    assert!(bytes == f.bytes(), "rewritten file differs");
    assert!(matches!(
        f.get("general.architecture"),
        Some(Value::String(_))
    ));
}
