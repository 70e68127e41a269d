//! The HF folder loader's checks: every broken folder gives an error that names the problem (never
//! a panic), tensors land with the right ggml dims and values, misaligned tensors are copied.

use std::path::{Path, PathBuf};

use quire_model::hf_fixture::{self, Dtype, ManifestTensor};
use serde_json::{json, Value};

struct TempDir(PathBuf);

impl TempDir {
    fn new(tag: &str) -> Self {
        use std::sync::atomic::{AtomicUsize, Ordering};
        static N: AtomicUsize = AtomicUsize::new(0);
        let p = std::env::temp_dir().join(format!(
            "quire-hfl-{tag}-{}-{}",
            std::process::id(),
            N.fetch_add(1, Ordering::Relaxed)
        ));
        let _ = std::fs::remove_dir_all(&p);
        std::fs::create_dir_all(&p).unwrap();
        Self(p)
    }
}

impl Drop for TempDir {
    fn drop(&mut self) {
        let _ = std::fs::remove_dir_all(&self.0);
    }
}

fn config() -> Value {
    json!({
        "architectures": ["Qwen2ForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": true, "eos_token_id": 317
    })
}

fn tensors() -> Vec<ManifestTensor> {
    let c = quire_core::ModelConfig {
        arch: quire_core::Architecture::Qwen2,
        hidden_size: 64,
        intermediate_size: 128,
        num_layers: 2,
        num_heads: 4,
        num_kv_heads: 2,
        head_dim: 16,
        vocab_size: 320,
        max_position_embeddings: 256,
        rms_norm_eps: 1e-6,
        rope_theta: 1e4,
        rope_dim: 16,
        rope_style: quire_core::RopeStyle::Neox,
        tie_word_embeddings: true,
        attention_bias: true,
        qk_norm: false,
        sliding_window: None,
        moe: None,
    };
    hf_fixture::manifest_for(&c)
}

fn folder(tag: &str, cfg: &Value, t: &[ManifestTensor]) -> TempDir {
    let d = TempDir::new(tag);
    std::fs::write(d.0.join("config.json"), cfg.to_string()).unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf/fixtures/qwen2");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fx.join(f), d.0.join(f)).unwrap();
    }
    hf_fixture::write_weights(&d.0, t, Dtype::F32, 1).unwrap();
    d
}

fn load_err(d: &TempDir) -> String {
    match quire_model::load(&d.0) {
        Ok(_) => panic!("{} loaded", d.0.display()),
        Err(e) => e.to_string(),
    }
}

#[test]
fn loads_with_ggml_dims_and_generator_values() {
    let t = tensors();
    let d = folder("ok", &config(), &t);
    let m = quire_model::load(&d.0).unwrap();
    let c = &m.weights.config;
    assert!(c.tie_word_embeddings && c.attention_bias && !c.qk_norm);
    assert_eq!(c.sliding_window, None);
    assert!(m.weights.output.is_none());
    let l0 = &m.weights.layers[0];
    // HF [out, in] = ggml [in, out].
    assert_eq!(l0.wk.dims, vec![64, 32]);
    let quire_backend::FfnWeights::Dense { w_down, .. } = &l0.ffn else {
        panic!("dense FFN expected");
    };
    assert_eq!(w_down.dims, vec![128, 64]);
    assert_eq!(m.weights.tok_embd.dims, vec![64, 320]);
    let want = t
        .iter()
        .find(|x| x.name == "model.layers.0.self_attn.k_proj.weight")
        .unwrap();
    assert_eq!(l0.wk.to_f32().unwrap(), want.values());
    assert_eq!(m.meta.arch, "qwen2");
    assert_eq!(m.meta.weight_type, "F32");
    assert!(m.meta.model_type.starts_with("qwen2 "));
    // EOS from config.json joins the end-of-generation set; tokenizer_config's EOS stays EOS.
    assert!(m.tokenizer.stop_tokens().iter().any(|t| t.0 == 317));
    assert_eq!(m.tokenizer.eos().map(|t| t.0), Some(319));
    assert!(m
        .chat_template
        .render(&[quire_tokenizer::ChatMessage::new("user", "x")], true)
        .unwrap()
        .contains("<|im_start|>assistant"));
}

/// A safetensors file with the tensors in the given order (the `safetensors` writer sorts them by
/// alignment, which hides misalignment).
fn write_raw(path: &Path, tensors: &[(String, &str, Vec<usize>, Vec<u8>)]) {
    let mut header = serde_json::Map::new();
    let mut data = Vec::new();
    for (name, dtype, shape, bytes) in tensors {
        header.insert(
            name.clone(),
            json!({"dtype": dtype, "shape": shape, "data_offsets": [data.len(), data.len() + bytes.len()]}),
        );
        data.extend_from_slice(bytes);
    }
    let mut h = Value::Object(header).to_string().into_bytes();
    while !h.len().is_multiple_of(8) {
        h.push(b' ');
    }
    let mut out = (h.len() as u64).to_le_bytes().to_vec();
    out.extend(h);
    out.extend(data);
    std::fs::write(path, out).unwrap();
}

#[test]
fn misaligned_tensors_are_copied_aligned() {
    // A 3-element BF16 tensor first puts every following F32 tensor at an odd 2-byte offset.
    let t = tensors();
    let d = folder("align", &config(), &t);
    let mut all = vec![(
        "aaa.extra".to_string(),
        "BF16",
        vec![3],
        hf_fixture::encode(&[1.0, 2.0, 3.0], Dtype::BF16).unwrap(),
    )];
    for x in &t {
        all.push((
            x.name.clone(),
            "F32",
            x.shape.clone(),
            hf_fixture::encode(&x.values(), Dtype::F32).unwrap(),
        ));
    }
    write_raw(&d.0.join("model.safetensors"), &all);
    let m = quire_model::load(&d.0).unwrap();
    let wq = &m.weights.layers[1].wq;
    assert!((wq.bytes.as_slice().as_ptr() as usize).is_multiple_of(4));
    let want = t
        .iter()
        .find(|x| x.name == "model.layers.1.self_attn.q_proj.weight")
        .unwrap();
    assert_eq!(wq.to_f32().unwrap(), want.values());
    // And the model runs (the CPU backend reads f32 rows in place).
    let exec = quire_backend::cpu::CpuExecutor::new(
        &m.weights,
        quire_backend::KvCacheSpec {
            num_blocks: 4,
            block_size: 16,
        },
        quire_backend::cpu::CpuOptions::default(),
    );
    assert!(exec.is_ok());
}

#[test]
fn broken_folders_give_clear_errors() {
    let t = tensors();
    let cfg = config();

    let d = folder("nocfg", &cfg, &t);
    std::fs::remove_file(d.0.join("config.json")).unwrap();
    assert!(load_err(&d).contains("config.json"), "{}", load_err(&d));

    let d = folder("badjson", &cfg, &t);
    std::fs::write(d.0.join("config.json"), "{\"hidden_size\": ").unwrap();
    let e = load_err(&d);
    assert!(e.contains("config.json") && e.contains("bad JSON"), "{e}");

    let d = folder("noweights", &cfg, &t);
    std::fs::remove_file(d.0.join("model.safetensors")).unwrap();
    assert!(load_err(&d).contains("no model.safetensors"));

    let d = folder("notok", &cfg, &t);
    std::fs::remove_file(d.0.join("tokenizer.json")).unwrap();
    assert!(load_err(&d).contains("tokenizer.json"));

    let d = folder("badtok", &cfg, &t);
    std::fs::write(d.0.join("tokenizer.json"), "[1,").unwrap();
    assert!(load_err(&d).contains("tokenizer.json: bad JSON"));

    let missing: Vec<_> = t
        .iter()
        .filter(|x| x.name != "model.layers.1.mlp.up_proj.weight")
        .cloned()
        .collect();
    let d = folder("missing", &cfg, &missing);
    assert!(load_err(&d).contains("missing tensor model.layers.1.mlp.up_proj.weight"));

    let missing_bias: Vec<_> = t
        .iter()
        .filter(|x| x.name != "model.layers.0.self_attn.v_proj.bias")
        .cloned()
        .collect();
    let d = folder("bias", &cfg, &missing_bias);
    assert!(load_err(&d).contains("v_proj.bias"));

    let mut wrong = t.clone();
    wrong
        .iter_mut()
        .find(|x| x.name == "model.layers.0.self_attn.o_proj.weight")
        .unwrap()
        .shape = vec![64, 32];
    let d = folder("shape", &cfg, &wrong);
    let e = load_err(&d);
    assert!(
        e.contains("o_proj.weight has shape [64, 32]") && e.contains("[64, 64]"),
        "{e}"
    );

    let d = folder("dtype", &cfg, &t);
    let mut all: Vec<(String, Dtype, Vec<usize>, Vec<u8>)> = t
        .iter()
        .map(|x| {
            (
                x.name.clone(),
                Dtype::F32,
                x.shape.clone(),
                hf_fixture::encode(&x.values(), Dtype::F32).unwrap(),
            )
        })
        .collect();
    let norm = all.iter_mut().find(|x| x.0 == "model.norm.weight").unwrap();
    norm.1 = Dtype::I32;
    hf_fixture::write_safetensors(&d.0.join("model.safetensors"), &all).unwrap();
    let e = load_err(&d);
    assert!(e.contains("model.norm.weight has type I32"), "{e}");

    let d = folder("truncated", &cfg, &t);
    let p = d.0.join("model.safetensors");
    let bytes = std::fs::read(&p).unwrap();
    std::fs::write(&p, &bytes[..bytes.len() - 100]).unwrap();
    assert!(load_err(&d).contains("bad safetensors file"));

    let mut more_layers = cfg.clone();
    more_layers["num_hidden_layers"] = 3.into();
    let d = folder("layers", &more_layers, &t);
    assert!(load_err(&d).contains("missing tensor model.layers.2."));
    let mut fewer = cfg.clone();
    fewer["num_hidden_layers"] = 1.into();
    let d = folder("fewer", &fewer, &t);
    assert!(load_err(&d).contains("more layers"));

    let mut arch = cfg.clone();
    arch["architectures"] = json!(["Gemma2ForCausalLM"]);
    let d = folder("arch", &arch, &t);
    assert!(load_err(&d).contains("Gemma2ForCausalLM"));

    let mut small_vocab = cfg.clone();
    small_vocab["vocab_size"] = 300.into();
    let d = folder("vocab", &small_vocab, &t);
    assert!(load_err(&d).contains("embed_tokens.weight has shape [320, 64]"));
}

#[test]
fn sharded_index_errors() {
    let t = tensors();
    let d = folder("shards", &config(), &[]);
    let _ = std::fs::remove_file(d.0.join("model.safetensors"));
    hf_fixture::write_weights(&d.0, &t, Dtype::F32, 3).unwrap();
    assert!(quire_model::load(&d.0).is_ok());

    std::fs::remove_file(d.0.join("model-00002-of-00003.safetensors")).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("model-00002-of-00003.safetensors") && e.contains("does not exist"),
        "{e}"
    );

    std::fs::write(
        d.0.join("model.safetensors.index.json"),
        "{\"weight_map\": 5}",
    )
    .unwrap();
    assert!(load_err(&d).contains("weight_map"));
    std::fs::write(
        d.0.join("model.safetensors.index.json"),
        "{\"weight_map\": {\"a\": \"../../etc/passwd\"}}",
    )
    .unwrap();
    assert!(load_err(&d).contains("not a plain file name"));
}

#[test]
fn a_directory_without_config_is_not_a_model() {
    let d = TempDir::new("empty");
    assert!(load_err(&d).contains("not an HF model folder"));
}
