//! The HF folder loader's checks: every broken folder gives an error that names the problem (never
//! a panic), tensors land with the right ggml dims and values, misaligned tensors are copied,
//! Qwen3-MoE experts (per-expert or transformers 5's fused tensors) become the backends' stacks.

use std::path::Path;

use quire_model::hf_fixture::{self, Dtype, ManifestTensor};
use serde_json::{json, Value};

use quire_testkit::TempDir;

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

/// A tiny Qwen3-MoE (tests/hf/make_moe_model.py's shapes): 8 experts of 32, top 2.
fn moe_config() -> Value {
    json!({
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", "hidden_size": 64,
        "intermediate_size": 128, "moe_intermediate_size": 32, "num_experts": 8,
        "num_experts_per_tok": 2, "norm_topk_prob": true, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "hidden_act": "silu", "tie_word_embeddings": false,
        "eos_token_id": 319
    })
}

fn moe_tensors() -> Vec<ManifestTensor> {
    let c = quire_core::ModelConfig {
        arch: quire_core::Architecture::Qwen3Moe,
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
        tie_word_embeddings: false,
        attention_bias: false,
        qk_norm: true,
        sliding_window: None,
        moe: Some(quire_core::MoeConfig {
            num_experts: 8,
            num_experts_per_tok: 2,
            expert_intermediate_size: 32,
            norm_topk_prob: true,
        }),
    };
    hf_fixture::manifest_for(&c)
}

fn values_of(t: &[ManifestTensor], name: &str) -> Vec<f32> {
    t.iter()
        .find(|x| x.name == name)
        .unwrap_or_else(|| panic!("no {name}"))
        .values()
}

#[test]
fn moe_experts_are_stacked_per_expert() {
    let t = moe_tensors();
    let d = folder("moe", &moe_config(), &t);
    let m = quire_model::load(&d.0).unwrap();
    let c = &m.weights.config;
    assert_eq!(c.arch, quire_core::Architecture::Qwen3Moe);
    assert_eq!(c.moe.unwrap().num_experts, 8);
    assert_eq!(m.meta.arch, "qwen3moe");
    let quire_backend::FfnWeights::Moe(x) = &m.weights.layers[1].ffn else {
        panic!("experts expected");
    };
    assert_eq!(x.gate_inp.dims, vec![64, 8]);
    assert_eq!(x.gate_exps.dims, vec![64, 32, 8]);
    assert_eq!(x.up_exps.dims, vec![64, 32, 8]);
    assert_eq!(x.down_exps.dims, vec![32, 64, 8]);
    assert!((x.gate_exps.bytes.as_slice().as_ptr() as usize).is_multiple_of(8));
    let (gate, down) = (x.gate_exps.to_f32().unwrap(), x.down_exps.to_f32().unwrap());
    for e in [0, 3, 7] {
        let slab = |v: &[f32], n: usize| v[e * n..(e + 1) * n].to_vec();
        let p = format!("model.layers.1.mlp.experts.{e}.");
        assert_eq!(
            slab(&gate, 2048),
            values_of(&t, &format!("{p}gate_proj.weight"))
        );
        assert_eq!(
            slab(&down, 2048),
            values_of(&t, &format!("{p}down_proj.weight"))
        );
    }
    assert_eq!(
        x.gate_inp.to_f32().unwrap(),
        values_of(&t, "model.layers.1.mlp.gate.weight")
    );
    // And the CPU backend takes it.
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

/// transformers 5's fused layout: `gate_up_proj` [E, 2I, H] (gate rows then up rows per expert)
/// and `down_proj` [E, H, I] load to the same stacks as the per-expert tensors.
#[test]
fn moe_fused_v5_layout_loads_the_same_experts() {
    let t = moe_tensors();
    let per_expert = folder("moe-per", &moe_config(), &t);
    let fused = folder("moe-fused", &moe_config(), &[]);
    let mut all = Vec::new();
    for x in t.iter().filter(|x| !x.name.contains(".experts.")) {
        let b = hf_fixture::encode(&x.values(), Dtype::BF16).unwrap();
        all.push((x.name.clone(), Dtype::BF16, x.shape.clone(), b));
    }
    for l in 0..2 {
        let p = format!("model.layers.{l}.mlp.experts.");
        let (mut gu, mut down) = (Vec::new(), Vec::new());
        for e in 0..8 {
            gu.extend(values_of(&t, &format!("{p}{e}.gate_proj.weight")));
            gu.extend(values_of(&t, &format!("{p}{e}.up_proj.weight")));
            down.extend(values_of(&t, &format!("{p}{e}.down_proj.weight")));
        }
        for (name, shape, v) in [
            ("gate_up_proj", vec![8, 64, 64], gu),
            ("down_proj", vec![8, 64, 32], down),
        ] {
            let b = hf_fixture::encode(&v, Dtype::BF16).unwrap();
            all.push((format!("{p}{name}"), Dtype::BF16, shape, b));
        }
    }
    hf_fixture::write_safetensors(&fused.0.join("model.safetensors"), &all).unwrap();
    let _ = std::fs::remove_file(per_expert.0.join("model.safetensors"));
    hf_fixture::write_weights(&per_expert.0, &t, Dtype::BF16, 1).unwrap();
    let (a, b) = (
        quire_model::load(&per_expert.0).unwrap(),
        quire_model::load(&fused.0).unwrap(),
    );
    for l in 0..2 {
        let (quire_backend::FfnWeights::Moe(x), quire_backend::FfnWeights::Moe(y)) =
            (&a.weights.layers[l].ffn, &b.weights.layers[l].ffn)
        else {
            panic!("experts expected");
        };
        for (s, f) in [
            (&x.gate_exps, &y.gate_exps),
            (&x.up_exps, &y.up_exps),
            (&x.down_exps, &y.down_exps),
        ] {
            assert_eq!((&s.dims, s.dtype), (&f.dims, f.dtype), "{}", f.name);
            assert_eq!(s.bytes.as_slice(), f.bytes.as_slice(), "{}", f.name);
        }
    }

    // The fused layout without its down_proj.
    let broken: Vec<_> = all
        .into_iter()
        .filter(|x| x.0 != "model.layers.1.mlp.experts.down_proj")
        .collect();
    hf_fixture::write_safetensors(&fused.0.join("model.safetensors"), &broken).unwrap();
    assert!(load_err(&fused).contains("missing tensor model.layers.1.mlp.experts.down_proj"));
}

#[test]
fn moe_folders_give_clear_errors() {
    let t = moe_tensors();
    let cfg = moe_config();

    let without = |name: &str| -> Vec<ManifestTensor> {
        t.iter().filter(|x| x.name != name).cloned().collect()
    };
    let d = folder(
        "moe-missing",
        &cfg,
        &without("model.layers.1.mlp.experts.5.up_proj.weight"),
    );
    let e = load_err(&d);
    assert!(
        e.contains("missing tensor model.layers.1.mlp.experts.5.up_proj.weight"),
        "{e}"
    );
    let d = folder(
        "moe-router",
        &cfg,
        &without("model.layers.0.mlp.gate.weight"),
    );
    assert!(load_err(&d).contains("missing tensor model.layers.0.mlp.gate.weight"));

    // Dense layers among the sparse ones are refused by the key that asks for them.
    let mut only = cfg.clone();
    only["mlp_only_layers"] = json!([0]);
    let d = folder("moe-only", &only, &t);
    let e = load_err(&d);
    assert!(
        e.contains("mlp_only_layers [0]") && e.contains("not supported"),
        "{e}"
    );
    let mut step = cfg.clone();
    step["decoder_sparse_step"] = 2.into();
    let d = folder("moe-step", &step, &t);
    assert!(load_err(&d).contains("decoder_sparse_step 2"));

    // More experts stored than the config counts (the router says 7 too).
    let mut seven = cfg.clone();
    seven["num_experts"] = 7.into();
    let mut fewer_rows = t.clone();
    for x in fewer_rows
        .iter_mut()
        .filter(|x| x.name.ends_with("mlp.gate.weight"))
    {
        x.shape = vec![7, 64];
    }
    let d = folder("moe-extra", &seven, &fewer_rows);
    let e = load_err(&d);
    assert!(
        e.contains("experts.7.gate_proj.weight") && e.contains("more experts"),
        "{e}"
    );

    // Experts of one layer in different types.
    let d = folder("moe-types", &cfg, &[]);
    let all: Vec<_> = t
        .iter()
        .map(|x| {
            let dt = if x.name == "model.layers.0.mlp.experts.2.down_proj.weight" {
                Dtype::F16
            } else {
                Dtype::F32
            };
            let b = hf_fixture::encode(&x.values(), dt).unwrap();
            (x.name.clone(), dt, x.shape.clone(), b)
        })
        .collect();
    hf_fixture::write_safetensors(&d.0.join("model.safetensors"), &all).unwrap();
    let e = load_err(&d);
    assert!(
        e.contains("experts.2.down_proj.weight is stored as F16") && e.contains("share one type"),
        "{e}"
    );

    let mut wrong = t.clone();
    wrong
        .iter_mut()
        .find(|x| x.name == "model.layers.0.mlp.experts.0.down_proj.weight")
        .unwrap()
        .shape = vec![32, 64];
    let d = folder("moe-shape", &cfg, &wrong);
    assert!(load_err(&d).contains("experts.0.down_proj.weight has shape [32, 64]"));
}
