//! GGUF → config, host tensors, tokenizer and chat template. Everything read from the file is
//! checked against the config before a backend sees it, so a backend may trust shapes.

use std::path::Path;
use std::sync::Arc;

use quire_backend::{
    ByteOwner, FfnWeights, HostTensor, LayerWeights, ModelWeights, MoeWeights, TensorBytes,
};
use quire_core::{Architecture, ModelConfig, MoeConfig, RopeStyle};
use quire_gguf::GgufFile;
use quire_tokenizer::{ChatTemplate, Tokenizer, TokenizerSpec};

use crate::ModelError;

/// Facts about the file for `info`, `bench` and reports.
#[derive(Debug, Clone, serde::Serialize)]
pub struct ModelMeta {
    pub path: String,
    pub file_name: String,
    pub name: String,
    pub arch: String,
    pub file_size: u64,
    pub n_params: u64,
    /// e.g. "Q4_1": the type of most of the matrix weights.
    pub weight_type: String,
    /// llama-bench style, e.g. "llama 135M Q4_1".
    pub model_type: String,
}

pub struct LoadedModel {
    pub weights: ModelWeights,
    pub tokenizer: Arc<Tokenizer>,
    pub chat_template: ChatTemplate,
    pub meta: ModelMeta,
    /// The GGUF file (`None` for an HF folder).
    pub file: Option<Arc<GgufFile>>,
}

impl LoadedModel {
    /// Bytes of all weights as stored (GGUF tensor data, or the safetensors files).
    pub fn weight_bytes(&self) -> u64 {
        match &self.file {
            Some(f) => f.tensors().iter().map(|t| t.size_bytes()).sum(),
            None => self.meta.file_size,
        }
    }
}

fn req_u32(f: &GgufFile, key: &str) -> Result<u32, ModelError> {
    f.get_u32(key)?
        .ok_or_else(|| ModelError::MissingKey(key.into()))
}

fn config_from_gguf(f: &GgufFile) -> Result<ModelConfig, ModelError> {
    let arch_name = f
        .get_str("general.architecture")?
        .ok_or_else(|| ModelError::MissingKey("general.architecture".into()))?;
    let (arch, rope_style) = match arch_name {
        "llama" => (Architecture::Llama, RopeStyle::Normal),
        "mistral" => (Architecture::Mistral, RopeStyle::Normal),
        "qwen2" => (Architecture::Qwen2, RopeStyle::Neox),
        "qwen3" => (Architecture::Qwen3, RopeStyle::Neox),
        "qwen3moe" => (Architecture::Qwen3Moe, RopeStyle::Neox),
        other => return Err(ModelError::UnsupportedArch(other.to_string())),
    };
    let k = |s: &str| format!("{arch_name}.{s}");
    let hidden = req_u32(f, &k("embedding_length"))? as usize;
    let num_heads = req_u32(f, &k("attention.head_count"))? as usize;
    if num_heads == 0 {
        return Err(ModelError::Invalid("attention.head_count is 0".into()));
    }
    let num_kv_heads = f
        .get_u32(&k("attention.head_count_kv"))?
        .map(|v| v as usize)
        .unwrap_or(num_heads);
    let head_dim = f
        .get_u32(&k("attention.key_length"))?
        .map(|v| v as usize)
        .unwrap_or(hidden / num_heads);
    let vocab_size = match f.get_u32(&k("vocab_size"))? {
        Some(v) => v as usize,
        None => f
            .tensor("token_embd.weight")
            .and_then(|t| t.dims.get(1).copied())
            .ok_or_else(|| ModelError::MissingTensor("token_embd.weight".into()))?
            as usize,
    };
    let moe = if arch == Architecture::Qwen3Moe {
        Some(moe_config(f, arch_name)?)
    } else {
        None
    };
    let intermediate_size = match (f.get_u32(&k("feed_forward_length"))?, &moe) {
        (Some(v), _) => v as usize,
        // A MoE file may leave the (unused) dense FFN size out.
        (None, Some(m)) => m.expert_intermediate_size,
        (None, None) => return Err(ModelError::MissingKey(k("feed_forward_length"))),
    };
    let cfg = ModelConfig {
        arch,
        hidden_size: hidden,
        intermediate_size,
        num_layers: req_u32(f, &k("block_count"))? as usize,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size,
        max_position_embeddings: f.get_u32(&k("context_length"))?.unwrap_or(4096) as usize,
        rms_norm_eps: f
            .get_f32(&k("attention.layer_norm_rms_epsilon"))?
            .unwrap_or(1e-5),
        rope_theta: f.get_f32(&k("rope.freq_base"))?.unwrap_or(10000.0),
        rope_dim: f
            .get_u32(&k("rope.dimension_count"))?
            .map(|v| v as usize)
            .unwrap_or(head_dim),
        rope_style,
        tie_word_embeddings: f.tensor("output.weight").is_none(),
        attention_bias: f.tensor("blk.0.attn_q.bias").is_some(),
        qk_norm: f.tensor("blk.0.attn_q_norm.weight").is_some(),
        sliding_window: f
            .get_u32(&k("attention.sliding_window"))?
            .filter(|&w| w > 0)
            .map(|w| w as usize),
        moe,
    };
    cfg.validate().map_err(ModelError::Invalid)?;
    Ok(cfg)
}

/// The experts of a `qwen3moe` file. llama.cpp's qwen3moe graph always renormalizes the top-k
/// weights (`build_moe_ffn(..., norm_w = true, ...)`) and reads no key for it; quire honours
/// `{arch}.expert_weights_norm` when a file has it (a key llama.cpp defines for other MoE
/// architectures) and otherwise renormalizes, as llama.cpp and Qwen3-MoE's `norm_topk_prob` do.
fn moe_config(f: &GgufFile, arch_name: &str) -> Result<MoeConfig, ModelError> {
    let k = |s: &str| format!("{arch_name}.{s}");
    let m = MoeConfig {
        num_experts: req_u32(f, &k("expert_count"))? as usize,
        num_experts_per_tok: req_u32(f, &k("expert_used_count"))? as usize,
        expert_intermediate_size: req_u32(f, &k("expert_feed_forward_length"))? as usize,
        norm_topk_prob: f.get_bool(&k("expert_weights_norm"))?.unwrap_or(true),
    };
    if m.num_experts > 1 << 16 {
        return Err(ModelError::Invalid(format!(
            "implausible expert count {}",
            m.num_experts
        )));
    }
    Ok(m)
}

fn tensor(file: &Arc<GgufFile>, name: &str) -> Result<HostTensor, ModelError> {
    let info = file
        .tensor(name)
        .ok_or_else(|| ModelError::MissingTensor(name.into()))?;
    if !info.dtype.is_supported() {
        return Err(ModelError::Invalid(format!(
            "tensor {name} has type {}, which this build cannot compute with yet",
            info.dtype.name()
        )));
    }
    let start = (file.data_offset() + info.offset) as usize;
    let owner: Arc<dyn ByteOwner> = file.clone();
    let bytes = TensorBytes::new(owner, start, info.size_bytes() as usize)
        .ok_or_else(|| ModelError::Invalid(format!("tensor {name} lies outside the file")))?;
    Ok(HostTensor {
        name: name.to_string(),
        dtype: info.dtype,
        dims: info.dims.iter().map(|&d| d as usize).collect(),
        bytes,
    })
}

fn opt_tensor(file: &Arc<GgufFile>, name: &str) -> Result<Option<HostTensor>, ModelError> {
    if file.tensor(name).is_some() {
        tensor(file, name).map(Some)
    } else {
        Ok(None)
    }
}

fn tokenizer_spec(f: &GgufFile) -> Result<TokenizerSpec, ModelError> {
    let id = |key: &str| -> Result<Option<u32>, ModelError> { Ok(f.get_u32(key)?) };
    Ok(TokenizerSpec {
        model: f
            .get_str("tokenizer.ggml.model")?
            .ok_or_else(|| ModelError::MissingKey("tokenizer.ggml.model".into()))?
            .to_string(),
        pre: f.get_str("tokenizer.ggml.pre")?.map(str::to_string),
        tokens: f
            .get_str_array("tokenizer.ggml.tokens")?
            .ok_or_else(|| ModelError::MissingKey("tokenizer.ggml.tokens".into()))?
            .into_iter()
            .map(str::to_string)
            .collect(),
        token_types: f
            .get_i32_array("tokenizer.ggml.token_type")?
            .unwrap_or_default(),
        merges: f
            .get_str_array("tokenizer.ggml.merges")?
            .unwrap_or_default()
            .into_iter()
            .map(str::to_string)
            .collect(),
        scores: f
            .get_f32_array("tokenizer.ggml.scores")?
            .unwrap_or_default(),
        bos_token_id: id("tokenizer.ggml.bos_token_id")?,
        eos_token_id: id("tokenizer.ggml.eos_token_id")?,
        eot_token_id: id("tokenizer.ggml.eot_token_id")?,
        unknown_token_id: id("tokenizer.ggml.unknown_token_id")?,
        padding_token_id: id("tokenizer.ggml.padding_token_id")?,
        add_bos_token: f.get_bool("tokenizer.ggml.add_bos_token")?.unwrap_or(false),
        add_eos_token: f.get_bool("tokenizer.ggml.add_eos_token")?.unwrap_or(false),
        add_space_prefix: f
            .get_bool("tokenizer.ggml.add_space_prefix")?
            .unwrap_or(false),
        eog_token_ids: Vec::new(),
    })
}

/// Loads a GGUF model: memory-maps it, checks it and builds its tokenizer and chat template.
pub fn load_gguf(path: &Path) -> Result<LoadedModel, ModelError> {
    let file = Arc::new(GgufFile::open(path)?);
    let cfg = config_from_gguf(&file)?;
    let mut layers = Vec::with_capacity(cfg.num_layers);
    for i in 0..cfg.num_layers {
        let t = |s: &str| tensor(&file, &format!("blk.{i}.{s}"));
        let o = |s: &str| opt_tensor(&file, &format!("blk.{i}.{s}"));
        layers.push(LayerWeights {
            attn_norm: t("attn_norm.weight")?,
            wq: t("attn_q.weight")?,
            wk: t("attn_k.weight")?,
            wv: t("attn_v.weight")?,
            wo: t("attn_output.weight")?,
            bq: o("attn_q.bias")?,
            bk: o("attn_k.bias")?,
            bv: o("attn_v.bias")?,
            q_norm: o("attn_q_norm.weight")?,
            k_norm: o("attn_k_norm.weight")?,
            ffn_norm: t("ffn_norm.weight")?,
            ffn: if cfg.moe.is_some() {
                FfnWeights::Moe(MoeWeights {
                    gate_inp: t("ffn_gate_inp.weight")?,
                    gate_exps: t("ffn_gate_exps.weight")?,
                    up_exps: t("ffn_up_exps.weight")?,
                    down_exps: t("ffn_down_exps.weight")?,
                })
            } else {
                FfnWeights::Dense {
                    w_gate: t("ffn_gate.weight")?,
                    w_up: t("ffn_up.weight")?,
                    w_down: t("ffn_down.weight")?,
                }
            },
        });
    }
    let rope_freqs = opt_tensor(&file, "rope_freqs.weight")?
        .map(|t| t.to_f32())
        .transpose()?;
    let weights = ModelWeights {
        tok_embd: tensor(&file, "token_embd.weight")?,
        output_norm: tensor(&file, "output_norm.weight")?,
        output: opt_tensor(&file, "output.weight")?,
        layers,
        rope_freqs,
        config: cfg.clone(),
    };
    let spec = tokenizer_spec(&file)?;
    let tok_str = |id: Option<u32>| {
        id.and_then(|i| spec.tokens.get(i as usize).cloned())
            .unwrap_or_default()
    };
    let (bos, eos) = (tok_str(spec.bos_token_id), tok_str(spec.eos_token_id));
    let chat_template = match file.get_str("tokenizer.chat_template")? {
        Some(src) => ChatTemplate::new(src, &bos, &eos)?,
        None => ChatTemplate::chatml_fallback(),
    };
    let tokenizer = Tokenizer::from_spec(spec)?;
    if tokenizer.vocab_size() > cfg.vocab_size {
        return Err(ModelError::Invalid(format!(
            "tokenizer has {} tokens but the embedding only {}",
            tokenizer.vocab_size(),
            cfg.vocab_size
        )));
    }
    let meta = meta(path, &file, &cfg)?;
    Ok(LoadedModel {
        weights,
        tokenizer: Arc::new(tokenizer),
        chat_template,
        meta,
        file: Some(file),
    })
}

fn meta(path: &Path, f: &GgufFile, cfg: &ModelConfig) -> Result<ModelMeta, ModelError> {
    let n_params: u64 = f.tensors().iter().map(|t| t.n_elements()).sum();
    // The most common type among 2-D weights, by bytes.
    let mut by_type: Vec<(String, u64)> = Vec::new();
    for t in f
        .tensors()
        .iter()
        .filter(|t| t.dims.len() >= 2 && t.name != "token_embd.weight")
    {
        let name = t.dtype.name().to_string();
        match by_type.iter_mut().find(|(n, _)| *n == name) {
            Some(e) => e.1 += t.size_bytes(),
            None => by_type.push((name, t.size_bytes())),
        }
    }
    let weight_type = by_type
        .into_iter()
        .max_by_key(|e| e.1)
        .map(|e| e.0)
        .unwrap_or_default();
    let size_label = match f.get_str("general.size_label")? {
        Some(s) => s.to_string(),
        None => human_params(n_params),
    };
    Ok(ModelMeta {
        path: path.display().to_string(),
        file_name: path
            .file_name()
            .map(|s| s.to_string_lossy().into_owned())
            .unwrap_or_default(),
        name: f.get_str("general.name")?.unwrap_or("").to_string(),
        arch: cfg.arch.name().to_string(),
        file_size: f.bytes().len() as u64,
        n_params,
        model_type: format!("{} {} {}", cfg.arch.name(), size_label, weight_type),
        weight_type,
    })
}

pub(crate) fn human_params(n: u64) -> String {
    if n >= 1_000_000_000 {
        format!("{:.1}B", n as f64 / 1e9)
    } else {
        format!("{}M", (n as f64 / 1e6).round())
    }
}
