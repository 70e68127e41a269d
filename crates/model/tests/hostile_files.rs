//! Hostile model inputs end in an error that names the problem, never a panic, an abort on a huge
//! allocation or a hang: sizes of 0 or 2^31 / 2^63 in config.json or GGUF metadata, and FIFOs in
//! place of the model file, a shard, config.json or tokenizer.json.

use std::path::Path;
use std::sync::mpsc;
use std::time::Duration;

use quire_model::hf_fixture::{self, Dtype, ManifestTensor};
use serde_json::{json, Value};

use quire_testkit::TempDir;

fn config() -> Value {
    json!({
        "architectures": ["LlamaForCausalLM"], "hidden_size": 64, "intermediate_size": 128,
        "num_hidden_layers": 2, "num_attention_heads": 4, "num_key_value_heads": 2,
        "vocab_size": 320, "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": true, "max_position_embeddings": 256
    })
}

fn tensors() -> Vec<ManifestTensor> {
    let c = quire_core::ModelConfig {
        arch: quire_core::Architecture::Llama,
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
        attention_bias: false,
        qk_norm: false,
        sliding_window: None,
        moe: None,
    };
    hf_fixture::manifest_for(&c)
}

fn folder(tag: &str, cfg: &Value) -> TempDir {
    let d = TempDir::new(tag);
    std::fs::write(d.0.join("config.json"), cfg.to_string()).unwrap();
    let fx = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf/fixtures/qwen2");
    for f in ["tokenizer.json", "tokenizer_config.json"] {
        std::fs::copy(fx.join(f), d.0.join(f)).unwrap();
    }
    hf_fixture::write_weights(&d.0, &tensors(), Dtype::F32, 1).unwrap();
    d
}

/// Loads `path` on another thread and returns its error text; fails the test (instead of hanging
/// it) when loading takes more than 20 s, and when it succeeds.
fn load_err(path: &Path) -> String {
    let (tx, rx) = mpsc::channel();
    let p = path.to_path_buf();
    std::thread::spawn(move || {
        let _ = tx.send(quire_model::load(&p).map(|_| ()).map_err(|e| e.to_string()));
    });
    match rx.recv_timeout(Duration::from_secs(20)) {
        Ok(Ok(())) => panic!("{} loaded", path.display()),
        Ok(Err(e)) => e,
        Err(_) => panic!("loading {} hangs", path.display()),
    }
}

fn with(edits: &[(&str, Value)]) -> Value {
    let mut c = config();
    for (k, v) in edits {
        c[*k] = v.clone();
    }
    c
}

#[test]
fn the_fixture_folder_loads() {
    let d = folder("ok", &config());
    quire_model::load(&d.0).unwrap();
}

#[test]
fn zero_context_length_in_config_json_is_an_error() {
    let d = folder("ctx0", &with(&[("max_position_embeddings", 0.into())]));
    let e = load_err(&d.0);
    assert!(e.contains("max_position_embeddings must be > 0"), "{e}");
}

#[test]
fn huge_head_dim_in_config_json_is_an_error_naming_it() {
    let llama3 = json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
        "high_freq_factor": 4.0, "original_max_position_embeddings": 64});
    for head_dim in [1u64 << 31, 1 << 63, u64::MAX] {
        // With Llama 3 RoPE scaling the loader builds a table of head_dim / 2 divisors.
        for scaling in [Value::Null, llama3.clone()] {
            let d = folder(
                "headdim",
                &with(&[("head_dim", head_dim.into()), ("rope_scaling", scaling)]),
            );
            let e = load_err(&d.0);
            assert!(
                e.contains(&format!("head_dim {head_dim} is implausibly large")),
                "{head_dim}: {e}"
            );
        }
    }
    let d = folder("vocab", &with(&[("vocab_size", (1u64 << 40).into())]));
    assert!(load_err(&d.0).contains("vocab_size"));
    let d = folder(
        "layers",
        &with(&[("num_hidden_layers", (1u64 << 62).into())]),
    );
    assert!(load_err(&d.0).contains("num_layers"));
}

/// The default model with its `llama.context_length` value overwritten by 0.
#[test]
fn zero_context_length_in_gguf_metadata_is_an_error() {
    let mut bytes = std::fs::read(quire_core::default_model::model_for_tests()).unwrap();
    let key = b"llama.context_length";
    let at = bytes
        .windows(key.len())
        .position(|w| w == key)
        .expect("the default model has llama.context_length")
        + key.len();
    // Type tag (u32 4 = UINT32), then the value.
    assert_eq!(bytes[at..at + 4], 4u32.to_le_bytes());
    bytes[at + 4..at + 8].copy_from_slice(&0u32.to_le_bytes());
    let d = TempDir::new("gguf-ctx0");
    let p = d.0.join("ctx0.gguf");
    std::fs::write(&p, bytes).unwrap();
    let e = load_err(&p);
    assert!(e.contains("max_position_embeddings must be > 0"), "{e}");
}

#[cfg(unix)]
fn mkfifo(path: &Path) {
    let _ = std::fs::remove_file(path);
    let st = std::process::Command::new("mkfifo")
        .arg(path)
        .status()
        .expect("run mkfifo");
    assert!(st.success());
}

#[cfg(unix)]
#[test]
fn fifos_are_refused_not_opened() {
    let d = TempDir::new("fifo");
    let f = d.0.join("model.gguf");
    mkfifo(&f);
    let e = load_err(&f);
    assert!(e.contains("model.gguf") && e.contains("FIFO"), "{e}");
    let e = quire_gguf::GgufFile::open(&f).unwrap_err().to_string();
    assert!(e.contains("not a regular file"), "{e}");

    for name in [
        "config.json",
        "model.safetensors",
        "tokenizer.json",
        "tokenizer_config.json",
    ] {
        let d = folder("fifo-hf", &config());
        mkfifo(&d.0.join(name));
        let e = load_err(&d.0);
        assert!(e.contains(name) && e.contains("FIFO"), "{name}: {e}");
    }
    // A shard named by the index.
    let d = folder("fifo-shard", &config());
    std::fs::remove_file(d.0.join("model.safetensors")).unwrap();
    hf_fixture::write_weights(&d.0, &tensors(), Dtype::F32, 2).unwrap();
    let shard = d.0.join("model-00002-of-00002.safetensors");
    mkfifo(&shard);
    let e = load_err(&d.0);
    assert!(
        e.contains("model-00002-of-00002") && e.contains("FIFO"),
        "{e}"
    );
}
