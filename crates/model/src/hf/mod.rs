//! Hugging Face model folders (Llama, Mistral, Qwen2, Qwen3, Qwen3-MoE): `config.json`, safetensors weights
//! (one file or shards with their index), `tokenizer.json`, `tokenizer_config.json` (chat template,
//! BOS/EOS) and `generation_config.json` (end-of-generation ids) → the same [`LoadedModel`] as a
//! GGUF file. Weights stay memory-mapped in their stored type (F32, F16 or BF16); every tensor's
//! shape is checked against the config before a backend sees it.
//!
//! HF stores a Linear weight as `[out, in]` row-major, which is ggml's `dims = [in, out]` (row
//! length first), so shapes are only reversed, never transposed; and HF Q/K rows are not permuted,
//! so RoPE is the rotate-half (Neox) style for all five families. Qwen3-MoE's per-expert tensors
//! are stacked into the backends' expert slabs by `experts` (the one place that copies weights).

mod config;
mod experts;
mod shards;

use std::path::Path;
use std::sync::Arc;

use quire_backend::{FfnWeights, LayerWeights, ModelWeights};
use quire_core::ModelConfig;
use quire_tokenizer::{ChatTemplate, Tokenizer};

pub use config::HfConfig;
pub use shards::Shards;

use crate::{LoadedModel, ModelError, ModelMeta};

/// Whether `path` looks like an HF model folder (a directory with a `config.json`).
pub fn is_hf_folder(path: &Path) -> bool {
    // `exists`, not `is_file`: a config.json that is a FIFO or device is then refused by name
    // when read, rather than the folder being called one without config.json.
    path.is_dir() && path.join("config.json").exists()
}

fn read(path: &Path) -> Result<String, ModelError> {
    crate::regular_file(path)?;
    std::fs::read_to_string(path).map_err(|e| ModelError::Io {
        path: path.display().to_string(),
        msg: e.to_string(),
    })
}

fn read_opt(path: &Path) -> Result<Option<String>, ModelError> {
    if path.exists() {
        read(path).map(Some)
    } else {
        Ok(None)
    }
}

/// The folder's config and tensor table, for `quire info` (nothing is checked beyond parsing).
pub struct HfInfo {
    pub config_json: serde_json::Value,
    pub config: Result<HfConfig, ModelError>,
    /// (name, dtype, HF shape, shard file name)
    pub tensors: Vec<(String, String, Vec<usize>, String)>,
    pub total_bytes: u64,
}

pub fn inspect(dir: &Path) -> Result<HfInfo, ModelError> {
    let text = read(&dir.join("config.json"))?;
    let config_json: serde_json::Value = serde_json::from_str(&text)
        .map_err(|e| ModelError::Invalid(format!("config.json: bad JSON: {e}")))?;
    let sh = Shards::open(dir)?;
    let config = config::parse(&text, &|n| sh.has(n));
    let tensors = sh
        .tensors
        .iter()
        .map(|(name, e)| {
            let file = sh.files[e.file]
                .path
                .file_name()
                .map(|f| f.to_string_lossy().into_owned())
                .unwrap_or_default();
            (
                name.clone(),
                format!("{:?}", e.dtype),
                e.shape.clone(),
                file,
            )
        })
        .collect();
    Ok(HfInfo {
        config_json,
        config,
        tensors,
        total_bytes: sh.total_bytes(),
    })
}

fn weights(
    sh: &Shards,
    cfg: &ModelConfig,
    rope_freqs: Option<Vec<f32>>,
) -> Result<ModelWeights, ModelError> {
    let (hd, qs, kvs, inter, vocab) = (
        cfg.hidden_size,
        cfg.q_size(),
        cfg.kv_size(),
        cfg.intermediate_size,
        cfg.vocab_size,
    );
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let p = format!("model.layers.{i}.");
        let t = |s: &str, dims: &[usize]| sh.tensor(&format!("{p}{s}"), dims);
        let o = |s: &str, dims: &[usize]| sh.opt_tensor(&format!("{p}{s}"), dims);
        if sh.has(&format!("{p}self_attn.o_proj.bias")) {
            return Err(ModelError::Invalid(format!(
                "{p}self_attn.o_proj.bias: an output-projection bias is not supported"
            )));
        }
        let bias = |s: &str, n: usize| -> Result<_, ModelError> {
            let b = o(s, &[n])?;
            if cfg.attention_bias && b.is_none() {
                return Err(ModelError::MissingTensor(format!("{p}{s}")));
            }
            Ok(b)
        };
        let norm = |s: &str| -> Result<_, ModelError> {
            let n = o(s, &[cfg.head_dim])?;
            if cfg.qk_norm && n.is_none() {
                return Err(ModelError::MissingTensor(format!("{p}{s}")));
            }
            Ok(n)
        };
        layers.push(LayerWeights {
            attn_norm: t("input_layernorm.weight", &[hd])?,
            wq: t("self_attn.q_proj.weight", &[hd, qs])?,
            wk: t("self_attn.k_proj.weight", &[hd, kvs])?,
            wv: t("self_attn.v_proj.weight", &[hd, kvs])?,
            wo: t("self_attn.o_proj.weight", &[qs, hd])?,
            bq: bias("self_attn.q_proj.bias", qs)?,
            bk: bias("self_attn.k_proj.bias", kvs)?,
            bv: bias("self_attn.v_proj.bias", kvs)?,
            q_norm: norm("self_attn.q_norm.weight")?,
            k_norm: norm("self_attn.k_norm.weight")?,
            ffn_norm: t("post_attention_layernorm.weight", &[hd])?,
            ffn: if cfg.moe.is_some() {
                FfnWeights::Moe(experts::load(sh, &p, cfg)?)
            } else {
                FfnWeights::Dense {
                    w_gate: t("mlp.gate_proj.weight", &[hd, inter])?,
                    w_up: t("mlp.up_proj.weight", &[hd, inter])?,
                    w_down: t("mlp.down_proj.weight", &[inter, hd])?,
                }
            },
        });
    }
    if sh.has(&format!(
        "model.layers.{}.input_layernorm.weight",
        cfg.num_layers
    )) {
        return Err(ModelError::Invalid(format!(
            "the weights have more layers than num_hidden_layers = {}",
            cfg.num_layers
        )));
    }
    Ok(ModelWeights {
        tok_embd: sh.tensor("model.embed_tokens.weight", &[hd, vocab])?,
        output_norm: sh.tensor("model.norm.weight", &[hd])?,
        output: sh.opt_tensor("lm_head.weight", &[hd, vocab])?,
        layers,
        rope_freqs,
        config: cfg.clone(),
    })
}

/// Loads an HF model folder.
pub fn load_hf(dir: &Path) -> Result<LoadedModel, ModelError> {
    let config_text = read(&dir.join("config.json"))?;
    let sh = Shards::open(dir)?;
    let hc = config::parse(&config_text, &|n| sh.has(n))?;
    let cfg = hc.config.clone();
    let weights = weights(&sh, &cfg, hc.rope_freqs.clone())?;

    // Tokenizer and template.
    let tj = read(&dir.join("tokenizer.json"))?;
    let tc = read_opt(&dir.join("tokenizer_config.json"))?;
    let mut tok = quire_tokenizer::hf::from_hf_files(&tj, tc.as_deref())?;
    let gen: serde_json::Value = match read_opt(&dir.join("generation_config.json"))? {
        Some(t) => serde_json::from_str(&t)
            .map_err(|e| ModelError::Invalid(format!("generation_config.json: bad JSON: {e}")))?,
        None => serde_json::Value::Null,
    };
    let gen_ids = |key: &str| -> Vec<u32> {
        match gen.get(key) {
            Some(serde_json::Value::Array(a)) => a
                .iter()
                .filter_map(|v| v.as_u64().and_then(|x| u32::try_from(x).ok()))
                .collect(),
            Some(v) => v
                .as_u64()
                .and_then(|x| u32::try_from(x).ok())
                .into_iter()
                .collect(),
            None => Vec::new(),
        }
    };
    let mut eog = gen_ids("eos_token_id");
    eog.extend(&hc.eos_token_ids);
    let spec = &mut tok.spec;
    if spec.eos_token_id.is_none() {
        spec.eos_token_id = eog.first().copied();
    }
    if spec.bos_token_id.is_none() {
        spec.bos_token_id = gen_ids("bos_token_id").first().copied().or(hc.bos_token_id);
    }
    spec.eog_token_ids = eog;
    let text_of = |id: Option<u32>| {
        id.and_then(|i| spec.tokens.get(i as usize).cloned())
            .unwrap_or_default()
    };
    if tok.bos_token.is_empty() {
        tok.bos_token = text_of(spec.bos_token_id);
    }
    if tok.eos_token.is_empty() {
        tok.eos_token = text_of(spec.eos_token_id);
    }
    let template_src = match tok.chat_template.take() {
        Some(t) => Some(t),
        // transformers >= 4.43 may save the template beside the config.
        None => read_opt(&dir.join("chat_template.jinja"))?,
    };
    let chat_template = match template_src {
        Some(src) => ChatTemplate::new(&src, &tok.bos_token, &tok.eos_token)?,
        None => ChatTemplate::chatml_fallback(),
    };
    let tokenizer = Tokenizer::from_spec(tok.spec)?;
    if tokenizer.vocab_size() > cfg.vocab_size {
        return Err(ModelError::Invalid(format!(
            "tokenizer has {} tokens but the embedding only {}",
            tokenizer.vocab_size(),
            cfg.vocab_size
        )));
    }
    let meta = meta(dir, &sh, &hc);
    Ok(LoadedModel {
        weights,
        tokenizer: Arc::new(tokenizer),
        chat_template,
        meta,
        file: None,
    })
}

fn meta(dir: &Path, sh: &Shards, hc: &HfConfig) -> ModelMeta {
    let n_params: u64 = sh
        .tensors
        .values()
        .map(|e| e.shape.iter().product::<usize>() as u64)
        .sum();
    let mut by_type: Vec<(String, u64)> = Vec::new();
    for (name, e) in &sh.tensors {
        if e.shape.len() < 2 || name == "model.embed_tokens.weight" {
            continue;
        }
        let t = format!("{:?}", e.dtype);
        match by_type.iter_mut().find(|(n, _)| *n == t) {
            Some(x) => x.1 += e.len as u64,
            None => by_type.push((t, e.len as u64)),
        }
    }
    let weight_type = by_type
        .into_iter()
        .max_by_key(|e| e.1)
        .map(|e| e.0)
        .unwrap_or_default();
    let name = dir
        .file_name()
        .map(|s| s.to_string_lossy().into_owned())
        .unwrap_or_default();
    let arch = hc.config.arch.name().to_string();
    ModelMeta {
        path: dir.display().to_string(),
        file_name: name.clone(),
        name,
        model_type: format!(
            "{arch} {} {weight_type}",
            crate::gguf_loader::human_params(n_params)
        ),
        arch,
        file_size: sh.total_bytes(),
        n_params,
        weight_type,
    }
}
