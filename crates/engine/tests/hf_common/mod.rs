//! Helpers of the HF tests: tiny model folders in temporary directories (config, fixture tokenizer,
//! generated weights) and a plain f64 forward pass of the HF decoder (written from the
//! transformers modeling code's equations, not from quire's backend; Qwen3-MoE's sparse block as
//! `Qwen3MoeSparseMoeBlock` defines it), used where transformers' own numbers are not at hand.

#![allow(dead_code)]

use std::path::{Path, PathBuf};

use quire_model::hf_fixture::ManifestTensor;
use serde_json::{json, Value};

pub const ARCHS: [&str; 5] = ["llama", "qwen2", "qwen3", "mistral", "qwen3_moe"];

pub fn fixture_dir(arch: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR")).join(format!("../../tests/hf/fixtures/{arch}"))
}

pub use quire_testkit::TempDir;

/// The config.json of the script's tiny model of `arch` (tests/hf/make_models.py `arch_configs`),
/// as a transformers 4.x save would write it.
pub fn tiny_config(arch: &str) -> Value {
    let mut c = json!({
        "hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 320,
        "max_position_embeddings": 256, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "bos_token_id": 317, "eos_token_id": 319, "hidden_act": "silu", "torch_dtype": "float32",
        // 64, not hidden / heads = 16: the GPU backends' attention kernels take 64, 128 or 256.
        "head_dim": 64,
    });
    let o = c.as_object_mut().unwrap();
    match arch {
        "llama" => {
            o.insert("architectures".into(), json!(["LlamaForCausalLM"]));
            o.insert("model_type".into(), json!("llama"));
            o.insert("num_hidden_layers".into(), json!(3));
            o.insert("tie_word_embeddings".into(), json!(false));
            o.insert("attention_bias".into(), json!(false));
            o.insert(
                "rope_scaling".into(),
                json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                       "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            );
        }
        "qwen2" => {
            o.insert("architectures".into(), json!(["Qwen2ForCausalLM"]));
            o.insert("tie_word_embeddings".into(), json!(true));
            o.insert("use_sliding_window".into(), json!(false));
            o.insert("sliding_window".into(), json!(4));
            o.insert("max_window_layers".into(), json!(1));
        }
        "qwen3" => {
            o.insert("architectures".into(), json!(["Qwen3ForCausalLM"]));
            o.insert("tie_word_embeddings".into(), json!(true));
            o.insert("attention_bias".into(), json!(false));
        }
        "mistral" => {
            o.insert("architectures".into(), json!(["MistralForCausalLM"]));
            o.insert("tie_word_embeddings".into(), json!(false));
            o.insert("sliding_window".into(), json!(8));
        }
        // tests/hf/make_moe_model.py's model as transformers 4.x writes it (`num_experts`; the
        // fixture's v5 config says `num_local_experts`), with norm_topk_prob off (the fixture has
        // it on), so both routings are checked.
        "qwen3_moe" => {
            o.insert("architectures".into(), json!(["Qwen3MoeForCausalLM"]));
            o.insert("model_type".into(), json!("qwen3_moe"));
            o.insert("tie_word_embeddings".into(), json!(false));
            o.insert("attention_bias".into(), json!(false));
            o.insert("use_sliding_window".into(), json!(false));
            o.insert("moe_intermediate_size".into(), json!(32));
            o.insert("num_experts".into(), json!(8));
            o.insert("num_experts_per_tok".into(), json!(2));
            o.insert("norm_topk_prob".into(), json!(false));
            o.insert("decoder_sparse_step".into(), json!(1));
            o.insert("mlp_only_layers".into(), json!([]));
        }
        other => panic!("unknown arch {other}"),
    }
    c
}

/// HF tensor names and shapes of the tiny model described by `config` (what transformers saves).
pub fn tiny_manifest(arch: &str, config: &Value) -> Vec<ManifestTensor> {
    let g = |k: &str| config[k].as_u64().unwrap() as usize;
    let heads = g("num_attention_heads");
    let head_dim = config["head_dim"]
        .as_u64()
        .map_or(g("hidden_size") / heads, |v| v as usize);
    let cfg = quire_core::ModelConfig {
        arch: quire_core::Architecture::Llama,
        hidden_size: g("hidden_size"),
        intermediate_size: g("intermediate_size"),
        num_layers: g("num_hidden_layers"),
        num_heads: heads,
        num_kv_heads: g("num_key_value_heads"),
        head_dim,
        vocab_size: g("vocab_size"),
        max_position_embeddings: 256,
        rms_norm_eps: 1e-6,
        rope_theta: 1e4,
        rope_dim: head_dim,
        rope_style: quire_core::RopeStyle::Neox,
        tie_word_embeddings: config["tie_word_embeddings"].as_bool().unwrap(),
        attention_bias: arch == "qwen2",
        qk_norm: arch == "qwen3" || arch == "qwen3_moe",
        sliding_window: None,
        moe: (arch == "qwen3_moe").then(|| quire_core::MoeConfig {
            num_experts: num_experts(config),
            num_experts_per_tok: g("num_experts_per_tok"),
            expert_intermediate_size: g("moe_intermediate_size"),
            norm_topk_prob: config["norm_topk_prob"].as_bool().unwrap_or(false),
        }),
    };
    quire_model::hf_fixture::manifest_for(&cfg)
}

/// `num_experts`, or transformers 5's `num_local_experts`.
pub fn num_experts(config: &Value) -> usize {
    config["num_experts"]
        .as_u64()
        .or(config["num_local_experts"].as_u64())
        .expect("num_experts") as usize
}

/// Writes config, tokenizer files (from the fixture) and weights into `dir`.
pub fn write_folder(
    dir: &Path,
    arch: &str,
    config: &Value,
    tensors: &[ManifestTensor],
    dtype: quire_model::hf_fixture::Dtype,
    shards: usize,
) {
    std::fs::write(
        dir.join("config.json"),
        serde_json::to_string_pretty(config).unwrap(),
    )
    .unwrap();
    for f in [
        "tokenizer.json",
        "tokenizer_config.json",
        "generation_config.json",
    ] {
        let src = fixture_dir(arch).join(f);
        if src.exists() {
            std::fs::copy(&src, dir.join(f)).unwrap();
        }
    }
    quire_model::hf_fixture::write_weights(dir, tensors, dtype, shards).unwrap();
}

/// The f64 reference: every position's logits, `[tokens.len()][vocab]`. `round` maps each stored
/// weight (as generated, f32) to the value the model file holds (identity for F32, bf16 rounding
/// for BF16).
pub fn reference_logits(
    config: &Value,
    tensors: &[ManifestTensor],
    tokens: &[u32],
    round: &dyn Fn(f32) -> f32,
) -> Vec<Vec<f64>> {
    reference_logits_and_margins(config, tensors, tokens, round).0
}

/// [`reference_logits`], and per position the smallest router margin over the layers (see
/// `RefFfn::forward`; infinite for dense models): where it is tiny, a rounding of the router's
/// input may choose another expert.
pub fn reference_logits_and_margins(
    config: &Value,
    tensors: &[ManifestTensor],
    tokens: &[u32],
    round: &dyn Fn(f32) -> f32,
) -> (Vec<Vec<f64>>, Vec<f64>) {
    let mut margins = vec![f64::INFINITY; tokens.len()];
    let w = |name: &str| -> Vec<f64> {
        tensors
            .iter()
            .find(|t| t.name == name)
            .unwrap_or_else(|| panic!("no {name}"))
            .values()
            .into_iter()
            .map(|v| round(v) as f64)
            .collect()
    };
    let has = |name: &str| tensors.iter().any(|t| t.name == name);
    let g = |k: &str| config[k].as_u64().unwrap() as usize;
    let (hd, nh, nkv, inter, vocab, layers) = (
        g("hidden_size"),
        g("num_attention_heads"),
        g("num_key_value_heads"),
        g("intermediate_size"),
        g("vocab_size"),
        g("num_hidden_layers"),
    );
    let d = config["head_dim"].as_u64().map_or(hd / nh, |v| v as usize);
    let eps = config["rms_norm_eps"].as_f64().unwrap();
    // transformers 5 keeps theta and the scaling in `rope_parameters`.
    let rope = &config["rope_parameters"];
    let theta = config["rope_theta"]
        .as_f64()
        .or(rope["rope_theta"].as_f64())
        .unwrap();
    let scaling = if config["rope_scaling"].is_object() {
        &config["rope_scaling"]
    } else {
        rope
    };
    let arch = config["architectures"][0].as_str().unwrap();
    let window = match arch {
        "MistralForCausalLM" => config["sliding_window"].as_u64().map(|v| v as usize),
        _ if config["use_sliding_window"].as_bool() == Some(true) => {
            config["sliding_window"].as_u64().map(|v| v as usize)
        }
        _ => None,
    };
    // Rotary frequencies, with Llama 3 scaling (transformers `_compute_llama3_parameters`).
    let inv_freq: Vec<f64> = (0..d / 2)
        .map(|i| {
            let f = theta.powf(-((2 * i) as f64) / d as f64);
            let s = scaling;
            if s["rope_type"].as_str() != Some("llama3") {
                return f;
            }
            let num = |k: &str| s[k].as_f64().unwrap();
            let (factor, lo, hi, old) = (
                num("factor"),
                num("low_freq_factor"),
                num("high_freq_factor"),
                num("original_max_position_embeddings"),
            );
            let wl = 2.0 * std::f64::consts::PI / f;
            if wl < old / hi {
                f
            } else if wl > old / lo {
                f / factor
            } else {
                let sm = (old / wl - lo) / (hi - lo);
                (1.0 - sm) * f / factor + sm * f
            }
        })
        .collect();

    let rms = |x: &[f64], wt: &[f64]| -> Vec<f64> {
        let ms = x.iter().map(|v| v * v).sum::<f64>() / x.len() as f64;
        let r = 1.0 / (ms + eps).sqrt();
        x.iter().zip(wt).map(|(v, g)| v * r * g).collect()
    };
    let rope = |x: &mut [f64], pos: usize| {
        for head in x.chunks_mut(d) {
            for i in 0..d / 2 {
                let a = pos as f64 * inv_freq[i];
                let (c, s) = (a.cos(), a.sin());
                let (x0, x1) = (head[i], head[i + d / 2]);
                head[i] = x0 * c - x1 * s;
                head[i + d / 2] = x1 * c + x0 * s;
            }
        }
    };
    let n = tokens.len();
    let emb = w("model.embed_tokens.weight");
    let mut xs: Vec<Vec<f64>> = tokens
        .iter()
        .map(|&t| emb[t as usize * hd..(t as usize + 1) * hd].to_vec())
        .collect();
    for l in 0..layers {
        let p = |s: &str| format!("model.layers.{l}.{s}");
        let (wq, wk, wv, wo) = (
            w(&p("self_attn.q_proj.weight")),
            w(&p("self_attn.k_proj.weight")),
            w(&p("self_attn.v_proj.weight")),
            w(&p("self_attn.o_proj.weight")),
        );
        let bias = |s: &str, m: usize| if has(&p(s)) { w(&p(s)) } else { vec![0.0; m] };
        let (bq, bk, bv) = (
            bias("self_attn.q_proj.bias", nh * d),
            bias("self_attn.k_proj.bias", nkv * d),
            bias("self_attn.v_proj.bias", nkv * d),
        );
        let qk_norm = has(&p("self_attn.q_norm.weight"));
        let (qn, kn) = if qk_norm {
            (
                w(&p("self_attn.q_norm.weight")),
                w(&p("self_attn.k_norm.weight")),
            )
        } else {
            (vec![], vec![])
        };
        let ln1 = w(&p("input_layernorm.weight"));
        let mut qs = Vec::new();
        let mut ks = Vec::new();
        let mut vs = Vec::new();
        for (pos, x) in xs.iter().enumerate() {
            let h = rms(x, &ln1);
            let add = |mut y: Vec<f64>, b: &[f64]| {
                y.iter_mut().zip(b).for_each(|(a, b)| *a += b);
                y
            };
            let mut q = add(lin(&wq, &h, nh * d), &bq);
            let mut k = add(lin(&wk, &h, nkv * d), &bk);
            let v = add(lin(&wv, &h, nkv * d), &bv);
            if qk_norm {
                q = q.chunks(d).flat_map(|c| rms(c, &qn)).collect();
                k = k.chunks(d).flat_map(|c| rms(c, &kn)).collect();
            }
            rope(&mut q, pos);
            rope(&mut k, pos);
            qs.push(q);
            ks.push(k);
            vs.push(v);
        }
        let ln2 = w(&p("post_attention_layernorm.weight"));
        let ffn = if has(&p("mlp.gate.weight")) {
            let e = num_experts(config);
            let expert = |i: usize, s: &str| w(&p(&format!("mlp.experts.{i}.{s}_proj.weight")));
            RefFfn::Moe {
                router: w(&p("mlp.gate.weight")),
                experts: (0..e)
                    .map(|i| [expert(i, "gate"), expert(i, "up"), expert(i, "down")])
                    .collect(),
                inter: g("moe_intermediate_size"),
                top_k: g("num_experts_per_tok"),
                norm: config["norm_topk_prob"].as_bool().unwrap_or(false),
            }
        } else {
            RefFfn::Dense([
                w(&p("mlp.gate_proj.weight")),
                w(&p("mlp.up_proj.weight")),
                w(&p("mlp.down_proj.weight")),
            ])
        };
        for t in 0..n {
            let lo = window.map_or(0, |w| (t + 1).saturating_sub(w));
            let mut att = vec![0.0; nh * d];
            for h in 0..nh {
                let kvh = h / (nh / nkv);
                let q = &qs[t][h * d..(h + 1) * d];
                let sc: Vec<f64> = (lo..=t)
                    .map(|j| {
                        let k = &ks[j][kvh * d..(kvh + 1) * d];
                        q.iter().zip(k).map(|(a, b)| a * b).sum::<f64>() / (d as f64).sqrt()
                    })
                    .collect();
                let m = sc.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = sc.iter().map(|s| (s - m).exp()).collect();
                let z: f64 = e.iter().sum();
                for (j, ej) in (lo..=t).zip(&e) {
                    for i in 0..d {
                        att[h * d + i] += ej / z * vs[j][kvh * d + i];
                    }
                }
            }
            let o = lin(&wo, &att, hd);
            let x = &mut xs[t];
            x.iter_mut().zip(&o).for_each(|(a, b)| *a += b);
            let h = rms(x, &ln2);
            let (down, margin) = ffn.forward(&h, inter);
            margins[t] = margins[t].min(margin);
            x.iter_mut().zip(&down).for_each(|(a, b)| *a += b);
        }
    }
    let norm = w("model.norm.weight");
    let head = if has("lm_head.weight") {
        w("lm_head.weight")
    } else {
        emb
    };
    let logits = xs
        .iter()
        .map(|x| lin(&head, &rms(x, &norm), vocab))
        .collect();
    (logits, margins)
}

/// y = W x with W stored [out, in].
fn lin(wt: &[f64], x: &[f64], out: usize) -> Vec<f64> {
    (0..out)
        .map(|o| {
            wt[o * x.len()..(o + 1) * x.len()]
                .iter()
                .zip(x)
                .map(|(a, b)| a * b)
                .sum()
        })
        .collect()
}

/// `down(silu(gate x) * up x)` with the three matrices stored [out, in].
fn swiglu([wg, wu, wd]: &[Vec<f64>; 3], x: &[f64], inter: usize) -> Vec<f64> {
    let gate = lin(wg, x, inter);
    let up = lin(wu, x, inter);
    let act: Vec<f64> = gate
        .iter()
        .zip(&up)
        .map(|(g, u)| g / (1.0 + (-g).exp()) * u)
        .collect();
    lin(wd, &act, x.len())
}

/// A layer's MLP in the reference.
enum RefFfn {
    Dense([Vec<f64>; 3]),
    /// transformers' `Qwen3MoeSparseMoeBlock`: softmax over the router logits, the `top_k` largest
    /// probabilities (ties: lower expert first), divided by their sum when `norm`, weighting
    /// those experts' SwiGLU outputs.
    Moe {
        router: Vec<f64>,
        experts: Vec<[Vec<f64>; 3]>,
        inter: usize,
        top_k: usize,
        norm: bool,
    },
}

impl RefFfn {
    /// The block's output, and for a mixture the router's margin: how far the last chosen
    /// expert's logit lies above the first expert left out (infinite for a dense block).
    fn forward(&self, h: &[f64], dense_inter: usize) -> (Vec<f64>, f64) {
        match self {
            RefFfn::Dense(m) => (swiglu(m, h, dense_inter), f64::INFINITY),
            RefFfn::Moe {
                router,
                experts,
                inter,
                top_k,
                norm,
            } => {
                let logits = lin(router, h, experts.len());
                let mx = logits.iter().cloned().fold(f64::NEG_INFINITY, f64::max);
                let e: Vec<f64> = logits.iter().map(|l| (l - mx).exp()).collect();
                let z: f64 = e.iter().sum();
                let mut order: Vec<usize> = (0..experts.len()).collect();
                order.sort_by(|&a, &b| e[b].total_cmp(&e[a]));
                let chosen = &order[..*top_k];
                let margin = order
                    .get(*top_k)
                    .map_or(f64::INFINITY, |&o| logits[order[top_k - 1]] - logits[o]);
                let sum: f64 = chosen.iter().map(|&i| e[i] / z).sum();
                let mut out = vec![0.0; h.len()];
                for &i in chosen {
                    let wt = e[i] / z / if *norm { sum } else { 1.0 };
                    let y = swiglu(&experts[i], h, *inter);
                    out.iter_mut().zip(&y).for_each(|(o, v)| *o += wt * v);
                }
                (out, margin)
            }
        }
    }
}

/// The testkit's relative L2 error of `got` ([rows · vocab]) against the rows of `want`.
pub fn rel_err(got: &[f32], want: &[Vec<f64>]) -> f64 {
    let flat: Vec<f64> = want.iter().flatten().copied().collect();
    quire_testkit::metric::rel_l2(got, &flat)
}

pub fn argmax(v: &[f64]) -> u32 {
    let mut best = 0;
    for (i, x) in v.iter().enumerate() {
        if *x > v[best] {
            best = i;
        }
    }
    best as u32
}

/// f32 → bf16 → f32, round to nearest even (finite inputs), as `half::bf16::from_f32` does.
pub fn bf16_round(v: f32) -> f32 {
    let b = v.to_bits();
    let r = b.wrapping_add(0x7FFF + ((b >> 16) & 1)) & 0xFFFF_0000;
    f32::from_bits(r)
}
