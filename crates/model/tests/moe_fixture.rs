//! Qwen3-MoE against transformers: the tiny random-weight Qwen3MoeForCausalLM of
//! tests/hf/make_moe_model.py, rebuilt here from its manifest with the same portable generator,
//! written as a `qwen3moe` GGUF (llama.cpp's tensor names and keys) with `GgufWriter`, loaded by
//! `load_gguf` and run on the CPU backend in f32: logits on transformers' input tokens within a
//! relative error of 1e-4, and transformers' 32 greedy tokens reproduced exactly.

use std::path::PathBuf;

use quire_backend::cpu::{CpuExecutor, CpuOptions, KvDtype};
use quire_backend::{Executor, ForwardBatch, KvCacheSpec, SeqBatch};
use quire_gguf::{GgmlType, GgufWriter, Value};
use serde_json::Value as Json;

const SEED: u64 = 0x5155495245;
const GOLDEN: u64 = 0x9E3779B97F4A7C15;

fn splitmix64(z: u64) -> u64 {
    let mut z = z.wrapping_add(GOLDEN);
    z = (z ^ (z >> 30)).wrapping_mul(0xBF58476D1CE4E5B9);
    z = (z ^ (z >> 27)).wrapping_mul(0x94D049BB133111EB);
    z ^ (z >> 31)
}

fn fnv1a64(s: &str) -> u64 {
    s.bytes().fold(0xCBF29CE484222325, |h, b| {
        (h ^ u64::from(b)).wrapping_mul(0x100000001B3)
    })
}

/// tests/hf/make_models.py `gen_values`: offset + scale * (2u - 1) in f64, rounded once to f32.
fn gen_values(name: &str, n: usize, offset: f64, scale: f64) -> Vec<f32> {
    let key = splitmix64(SEED ^ fnv1a64(name));
    (0..n as u64)
        .map(|i| {
            let u = (splitmix64(key.wrapping_add(i)) >> 40) as f64 / 16777216.0;
            (offset + scale * (2.0 * u - 1.0)) as f32
        })
        .collect()
}

fn fixture_dir() -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf/fixtures/qwen3_moe")
}

fn read_json(name: &str) -> Json {
    let path = fixture_dir().join(name);
    let text = std::fs::read_to_string(&path).unwrap_or_else(|e| {
        panic!(
            "{}: {e} (run tests/hf/make_moe_model.py to create the fixture)",
            path.display()
        )
    });
    serde_json::from_str(&text).unwrap()
}

fn f32_bytes(v: &[f32]) -> Vec<u8> {
    v.iter().flat_map(|x| x.to_le_bytes()).collect()
}

fn usize_of(j: &Json, key: &str) -> usize {
    j[key]
        .as_u64()
        .unwrap_or_else(|| panic!("config key {key}")) as usize
}

/// The HF checkpoint as llama.cpp's converter would write it: per-expert matrices stacked into
/// `[row_len, rows, experts]` tensors, HF `[out, in]` weights as ggml `[in, out]` (same bytes),
/// no Q/K permutation (Neox RoPE).
fn write_gguf(path: &std::path::Path) {
    let cfg = read_json("config.json");
    let manifest = read_json("manifest.json");
    let tok = read_json("tokenizer.json");
    let mut tensors = std::collections::HashMap::new();
    for t in manifest["tensors"].as_array().unwrap() {
        let name = t["name"].as_str().unwrap();
        let shape: Vec<usize> = t["shape"]
            .as_array()
            .unwrap()
            .iter()
            .map(|d| d.as_u64().unwrap() as usize)
            .collect();
        let n = shape.iter().product();
        let v = gen_values(
            name,
            n,
            t["offset"].as_f64().unwrap(),
            t["scale"].as_f64().unwrap(),
        );
        tensors.insert(name.to_string(), (shape, v));
    }
    let get = |name: &str| {
        tensors
            .get(name)
            .unwrap_or_else(|| panic!("manifest lacks {name}"))
    };
    let (hd, layers, heads, kv_heads, head_dim, vocab) = (
        usize_of(&cfg, "hidden_size"),
        usize_of(&cfg, "num_hidden_layers"),
        usize_of(&cfg, "num_attention_heads"),
        usize_of(&cfg, "num_key_value_heads"),
        usize_of(&cfg, "head_dim"),
        usize_of(&cfg, "vocab_size"),
    );
    let (experts, used, ff) = (
        // transformers v5 writes num_local_experts, v4 num_experts.
        cfg["num_experts"]
            .as_u64()
            .or_else(|| cfg["num_local_experts"].as_u64())
            .expect("num_experts") as usize,
        usize_of(&cfg, "num_experts_per_tok"),
        usize_of(&cfg, "moe_intermediate_size"),
    );
    let theta = cfg["rope_theta"]
        .as_f64()
        .or_else(|| cfg["rope_parameters"]["rope_theta"].as_f64())
        .unwrap() as f32;
    let mut w = GgufWriter::new();
    let k = |s: &str| format!("qwen3moe.{s}");
    w.add_metadata("general.architecture", "qwen3moe")
        .unwrap()
        .add_metadata(
            k("context_length"),
            usize_of(&cfg, "max_position_embeddings") as u32,
        )
        .unwrap()
        .add_metadata(k("embedding_length"), hd as u32)
        .unwrap()
        .add_metadata(k("block_count"), layers as u32)
        .unwrap()
        .add_metadata(
            k("feed_forward_length"),
            usize_of(&cfg, "intermediate_size") as u32,
        )
        .unwrap()
        .add_metadata(k("attention.head_count"), heads as u32)
        .unwrap()
        .add_metadata(k("attention.head_count_kv"), kv_heads as u32)
        .unwrap()
        .add_metadata(k("attention.key_length"), head_dim as u32)
        .unwrap()
        .add_metadata(k("attention.value_length"), head_dim as u32)
        .unwrap()
        .add_metadata(
            k("attention.layer_norm_rms_epsilon"),
            cfg["rms_norm_eps"].as_f64().unwrap() as f32,
        )
        .unwrap()
        .add_metadata(k("rope.freq_base"), theta)
        .unwrap()
        .add_metadata(k("expert_count"), experts as u32)
        .unwrap()
        .add_metadata(k("expert_used_count"), used as u32)
        .unwrap()
        .add_metadata(k("expert_feed_forward_length"), ff as u32)
        .unwrap()
        .add_metadata(
            k("expert_weights_norm"),
            cfg["norm_topk_prob"].as_bool().unwrap(),
        )
        .unwrap();
    // Tokenizer: the fixture's byte-level BPE (vocabulary by id, merges, specials as control).
    let mut tokens = vec![String::new(); vocab];
    let mut types = vec![1i32; vocab];
    for (s, id) in tok["model"]["vocab"].as_object().unwrap() {
        tokens[id.as_u64().unwrap() as usize] = s.clone();
    }
    for a in tok["added_tokens"].as_array().unwrap() {
        let id = a["id"].as_u64().unwrap() as usize;
        tokens[id] = a["content"].as_str().unwrap().to_string();
        types[id] = 3;
    }
    let merges: Vec<Value> = tok["model"]["merges"]
        .as_array()
        .unwrap()
        .iter()
        .map(|m| match m {
            Json::String(s) => Value::String(s.clone()),
            pair => Value::String(format!(
                "{} {}",
                pair[0].as_str().unwrap(),
                pair[1].as_str().unwrap()
            )),
        })
        .collect();
    w.add_metadata("tokenizer.ggml.model", "gpt2")
        .unwrap()
        .add_metadata("tokenizer.ggml.pre", "qwen2")
        .unwrap()
        .add_metadata(
            "tokenizer.ggml.tokens",
            Value::Array(tokens.into_iter().map(Value::String).collect()),
        )
        .unwrap()
        .add_metadata(
            "tokenizer.ggml.token_type",
            Value::Array(types.into_iter().map(Value::I32).collect()),
        )
        .unwrap()
        .add_metadata("tokenizer.ggml.merges", Value::Array(merges))
        .unwrap()
        .add_metadata(
            "tokenizer.ggml.bos_token_id",
            usize_of(&cfg, "bos_token_id") as u32,
        )
        .unwrap()
        .add_metadata(
            "tokenizer.ggml.eos_token_id",
            usize_of(&cfg, "eos_token_id") as u32,
        )
        .unwrap();

    let put = |w: &mut GgufWriter, gguf: &str, hf: &str| {
        let (shape, v) = get(hf);
        let dims: Vec<u64> = shape.iter().rev().map(|&d| d as u64).collect();
        w.add_tensor(gguf, &dims, GgmlType::F32, f32_bytes(v))
            .unwrap();
    };
    put(&mut w, "token_embd.weight", "model.embed_tokens.weight");
    put(&mut w, "output_norm.weight", "model.norm.weight");
    if !cfg["tie_word_embeddings"].as_bool().unwrap_or(false) {
        put(&mut w, "output.weight", "lm_head.weight");
    }
    for i in 0..layers {
        let hf = |s: &str| format!("model.layers.{i}.{s}");
        let gg = |s: &str| format!("blk.{i}.{s}");
        for (g, h) in [
            ("attn_norm.weight", "input_layernorm.weight"),
            ("attn_q.weight", "self_attn.q_proj.weight"),
            ("attn_k.weight", "self_attn.k_proj.weight"),
            ("attn_v.weight", "self_attn.v_proj.weight"),
            ("attn_output.weight", "self_attn.o_proj.weight"),
            ("attn_q_norm.weight", "self_attn.q_norm.weight"),
            ("attn_k_norm.weight", "self_attn.k_norm.weight"),
            ("ffn_norm.weight", "post_attention_layernorm.weight"),
            ("ffn_gate_inp.weight", "mlp.gate.weight"),
        ] {
            put(&mut w, &gg(g), &hf(h));
        }
        for (g, h, dims) in [
            ("ffn_gate_exps.weight", "gate_proj", [hd, ff, experts]),
            ("ffn_up_exps.weight", "up_proj", [hd, ff, experts]),
            ("ffn_down_exps.weight", "down_proj", [ff, hd, experts]),
        ] {
            let mut data = Vec::new();
            for e in 0..experts {
                let (shape, v) = get(&hf(&format!("mlp.experts.{e}.{h}.weight")));
                assert_eq!(shape, &[dims[1], dims[0]]);
                data.extend(f32_bytes(v));
            }
            let dims = dims.map(|d| d as u64);
            w.add_tensor(gg(g), &dims, GgmlType::F32, data).unwrap();
        }
    }
    w.write_file(path).unwrap();
}

fn argmax(v: &[f32]) -> u32 {
    let mut best = 0;
    for (i, &x) in v.iter().enumerate() {
        if x > v[best] {
            best = i;
        }
    }
    best as u32
}

#[test]
fn qwen3_moe_matches_transformers() {
    let path = std::env::temp_dir().join(format!(
        "quire-qwen3moe-fixture-{}.gguf",
        std::process::id()
    ));
    write_gguf(&path);
    let model = quire_model::load_gguf(&path);
    std::fs::remove_file(&path).ok();
    let model = model.unwrap();
    let c = &model.weights.config;
    assert_eq!(c.arch, quire_core::Architecture::Qwen3Moe);
    assert!(c.moe.is_some() && c.qk_norm && !c.tie_word_embeddings);

    let reference = read_json("reference.json");
    let ids = |key: &str| -> Vec<u32> {
        reference[key]
            .as_array()
            .unwrap()
            .iter()
            .map(|v| v.as_u64().unwrap() as u32)
            .collect()
    };
    let (input, prompt, greedy) = (ids("input_ids"), ids("prompt_ids"), ids("greedy_ids"));
    let raw = std::fs::read(fixture_dir().join("logits.f32.bin")).unwrap();
    let want: Vec<f32> = raw
        .chunks_exact(4)
        .map(|b| f32::from_le_bytes(b.try_into().unwrap()))
        .collect();
    let vocab = c.vocab_size;
    assert_eq!(want.len(), input.len() * vocab);

    let kv = KvCacheSpec {
        num_blocks: 8,
        block_size: 16,
    };
    let opts = CpuOptions {
        threads: 2,
        kv_dtype: KvDtype::F32,
        ..CpuOptions::default()
    };
    let table: Vec<quire_core::BlockId> = (0..8).map(quire_core::BlockId).collect();
    let mut exec = CpuExecutor::new(&model.weights, kv, opts).unwrap();
    // Logits of every input position, one prefill.
    let n = input.len();
    let pos: Vec<u32> = (0..n as u32).collect();
    let seqs = [SeqBatch {
        query_start: 0,
        query_len: n,
        seq_len: n,
        block_table: &table,
    }];
    let got = exec
        .forward(&ForwardBatch {
            token_ids: &input,
            positions: &pos,
            slot_mapping: &pos,
            seqs: &seqs,
            logits_indices: &pos,
        })
        .unwrap()
        .to_vec();
    let mut worst = 0f32;
    for (g, w) in got.chunks_exact(vocab).zip(want.chunks_exact(vocab)) {
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = g.iter().zip(w).fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        worst = worst.max(err / scale);
    }
    println!("qwen3_moe: logits max relative error {worst:.3e} over {n} positions");
    assert!(worst < 1e-4, "relative error {worst:.3e}");

    // 32 greedy tokens: prefill the prompt, then decode one at a time with the KV cache.
    let mut exec = CpuExecutor::new(&model.weights, kv, opts).unwrap();
    let p = prompt.len();
    let pos: Vec<u32> = (0..p as u32).collect();
    let seqs = [SeqBatch {
        query_start: 0,
        query_len: p,
        seq_len: p,
        block_table: &table,
    }];
    let last = [p as u32 - 1];
    let mut next = argmax(
        exec.forward(&ForwardBatch {
            token_ids: &prompt,
            positions: &pos,
            slot_mapping: &pos,
            seqs: &seqs,
            logits_indices: &last,
        })
        .unwrap(),
    );
    let mut out = vec![next];
    while out.len() < greedy.len() {
        let at = (p + out.len() - 1) as u32;
        let seqs = [SeqBatch {
            query_start: 0,
            query_len: 1,
            seq_len: at as usize + 1,
            block_table: &table,
        }];
        next = argmax(
            exec.forward(&ForwardBatch {
                token_ids: &[next],
                positions: &[at],
                slot_mapping: &[at],
                seqs: &seqs,
                logits_indices: &[0],
            })
            .unwrap(),
        );
        out.push(next);
    }
    assert_eq!(out, greedy, "greedy tokens differ from transformers'");
    // The tokenizer built from the GGUF reproduces transformers' ids of the text.
    let text = reference["text"].as_str().unwrap();
    assert_eq!(
        model
            .tokenizer
            .encode(text, false, true)
            .unwrap()
            .into_iter()
            .map(|t| t.0)
            .collect::<Vec<_>>(),
        ids("text_ids")
    );
}
