//! HF `config.json` → [`ModelConfig`] (and Llama 3 RoPE frequency divisors). Field names and
//! defaults follow transformers' `LlamaConfig`, `MistralConfig`, `Qwen2Config` and `Qwen3Config`;
//! both the older `rope_theta` / `rope_scaling` fields and transformers 5's `rope_parameters` are
//! read.

use serde_json::{Map, Value};

use quire_core::{Architecture, ModelConfig, RopeStyle};

use crate::ModelError;

/// What `config.json` says beyond [`ModelConfig`].
#[derive(Debug, Clone)]
pub struct HfConfig {
    pub config: ModelConfig,
    /// Per-frequency divisors of the rotary frequencies (`[rope_dim / 2]`, as GGUF's
    /// `rope_freqs.weight`), from `rope_scaling` of type `llama3`.
    pub rope_freqs: Option<Vec<f32>>,
    /// `torch_dtype` / `dtype`, e.g. "bfloat16".
    pub dtype: Option<String>,
    /// `architectures[0]`.
    pub arch_name: String,
    pub bos_token_id: Option<u32>,
    /// `eos_token_id`: one id or a list.
    pub eos_token_ids: Vec<u32>,
}

fn bad(msg: impl Into<String>) -> ModelError {
    ModelError::Invalid(format!("config.json: {}", msg.into()))
}

struct Fields<'a>(&'a Map<String, Value>);

impl Fields<'_> {
    fn get(&self, key: &str) -> Option<&Value> {
        self.0.get(key).filter(|v| !v.is_null())
    }

    fn usize_opt(&self, key: &str) -> Result<Option<usize>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_u64()
                .and_then(|x| usize::try_from(x).ok())
                .map(Some)
                .ok_or_else(|| bad(format!("{key} is not a non-negative integer: {v}"))),
        }
    }

    fn usize_req(&self, key: &str) -> Result<usize, ModelError> {
        self.usize_opt(key)?
            .ok_or_else(|| bad(format!("missing field {key}")))
    }

    fn f64_opt(&self, key: &str) -> Result<Option<f64>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_f64()
                .map(Some)
                .ok_or_else(|| bad(format!("{key} is not a number: {v}"))),
        }
    }

    fn bool_opt(&self, key: &str) -> Result<Option<bool>, ModelError> {
        match self.get(key) {
            None => Ok(None),
            Some(v) => v
                .as_bool()
                .map(Some)
                .ok_or_else(|| bad(format!("{key} is not a boolean: {v}"))),
        }
    }

    fn str_opt(&self, key: &str) -> Option<&str> {
        self.get(key).and_then(Value::as_str)
    }

    fn ids(&self, key: &str) -> Vec<u32> {
        match self.get(key) {
            Some(Value::Array(a)) => a
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
    }
}

/// Parses `config.json`. `tensor_names` tells which optional tensors exist (QKV bias, QK-norm,
/// the output projection), as the GGUF loader decides from the file.
pub fn parse(text: &str, has_tensor: &dyn Fn(&str) -> bool) -> Result<HfConfig, ModelError> {
    let root: Value = serde_json::from_str(text).map_err(|e| bad(format!("bad JSON: {e}")))?;
    let obj = root.as_object().ok_or_else(|| bad("not a JSON object"))?;
    let f = Fields(obj);

    let arch_name = f
        .get("architectures")
        .and_then(Value::as_array)
        .and_then(|a| a.first())
        .and_then(Value::as_str)
        .map(str::to_string)
        .or_else(|| f.str_opt("model_type").map(str::to_string))
        .ok_or_else(|| bad("no \"architectures\" or \"model_type\""))?;
    let arch = match arch_name.as_str() {
        "LlamaForCausalLM" | "llama" => Architecture::Llama,
        "MistralForCausalLM" | "mistral" => Architecture::Mistral,
        "Qwen2ForCausalLM" | "qwen2" => Architecture::Qwen2,
        "Qwen3ForCausalLM" | "qwen3" => Architecture::Qwen3,
        other => {
            return Err(ModelError::UnsupportedArch(format!(
                "{other} (HF: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, Qwen3ForCausalLM)"
            )))
        }
    };

    if let Some(act) = f.str_opt("hidden_act") {
        if act != "silu" {
            return Err(bad(format!(
                "hidden_act '{act}' is not supported (only silu)"
            )));
        }
    }
    if f.bool_opt("mlp_bias")? == Some(true) {
        return Err(bad("mlp_bias is not supported"));
    }

    let hidden = f.usize_req("hidden_size")?;
    let num_heads = f.usize_req("num_attention_heads")?;
    if num_heads == 0 {
        return Err(bad("num_attention_heads is 0"));
    }
    let num_kv_heads = f.usize_opt("num_key_value_heads")?.unwrap_or(num_heads);
    let head_dim = f.usize_opt("head_dim")?.unwrap_or(hidden / num_heads);
    let num_layers = f.usize_req("num_hidden_layers")?;

    // RoPE: transformers 5 keeps theta and scaling in `rope_parameters`.
    let rope_params = f.get("rope_parameters").and_then(Value::as_object);
    let rope_theta = match f.f64_opt("rope_theta")? {
        Some(t) => t,
        None => rope_params
            .and_then(|p| p.get("rope_theta"))
            .and_then(Value::as_f64)
            .unwrap_or(10000.0),
    };
    if f.f64_opt("partial_rotary_factor")?
        .is_some_and(|x| x != 1.0)
    {
        return Err(bad("partial_rotary_factor != 1 is not supported"));
    }
    let scaling = f
        .get("rope_scaling")
        .and_then(Value::as_object)
        .or(rope_params);

    // Sliding window: Mistral applies `sliding_window` to every layer. Qwen2/3 only with
    // `use_sliding_window`, and then (transformers' `layer_types`) to layers >= max_window_layers.
    let window = f.usize_opt("sliding_window")?.filter(|&w| w > 0);
    let sliding_window = match arch {
        Architecture::Llama => None,
        Architecture::Mistral => window,
        Architecture::Qwen2 | Architecture::Qwen3 | Architecture::Qwen3Moe => {
            if f.bool_opt("use_sliding_window")? == Some(true) && window.is_some() {
                let first = f.usize_opt("max_window_layers")?.unwrap_or(num_layers);
                if first >= num_layers {
                    None
                } else if first == 0 {
                    window
                } else {
                    return Err(bad(format!(
                        "sliding window on layers {first}.. only (max_window_layers) is not \
                         supported: quire applies one window to all layers"
                    )));
                }
            } else {
                None
            }
        }
    };
    if let Some(types) = f.get("layer_types").and_then(Value::as_array) {
        let sliding = types
            .iter()
            .filter(|t| t.as_str() == Some("sliding_attention"))
            .count();
        let consistent = match sliding_window {
            None => sliding == 0,
            Some(_) => sliding == types.len(),
        };
        if !consistent {
            return Err(bad(format!(
                "layer_types mixes sliding and full attention ({sliding} of {} sliding), which \
                 is not supported",
                types.len()
            )));
        }
    }

    let rms_norm_eps = f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
    let config = ModelConfig {
        arch,
        hidden_size: hidden,
        intermediate_size: f.usize_req("intermediate_size")?,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size: f.usize_req("vocab_size")?,
        max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(4096),
        rms_norm_eps: rms_norm_eps as f32,
        rope_theta: rope_theta as f32,
        rope_dim: head_dim,
        // HF checkpoints keep Q/K rows unpermuted: rotate-half RoPE for all four families.
        rope_style: RopeStyle::Neox,
        tie_word_embeddings: !has_tensor("lm_head.weight"),
        attention_bias: has_tensor("model.layers.0.self_attn.q_proj.bias"),
        qk_norm: has_tensor("model.layers.0.self_attn.q_norm.weight"),
        sliding_window,
        // Qwen3MoeForCausalLM is not read from HF folders yet (GGUF only).
        moe: None,
    };
    config.validate().map_err(bad)?;
    if config.num_layers > 4096 || config.hidden_size > 1 << 20 || config.vocab_size > 1 << 24 {
        return Err(bad("implausibly large model dimensions"));
    }
    if f.bool_opt("tie_word_embeddings")? == Some(false) && config.tie_word_embeddings {
        return Err(ModelError::MissingTensor(
            "lm_head.weight (tie_word_embeddings is false)".into(),
        ));
    }
    let rope_freqs = match scaling {
        None => None,
        Some(s) => rope_scaling_divisors(s, &config)?,
    };
    Ok(HfConfig {
        config,
        rope_freqs,
        dtype: f
            .str_opt("torch_dtype")
            .or_else(|| f.str_opt("dtype"))
            .map(str::to_string),
        arch_name,
        bos_token_id: f.ids("bos_token_id").first().copied(),
        eos_token_ids: f.ids("eos_token_id"),
    })
}

/// Llama 3's frequency scaling as divisors of the plain frequencies (what GGUF stores in
/// `rope_freqs.weight`); `None` for no scaling. Formula: transformers'
/// `modeling_rope_utils._compute_llama3_parameters` (Llama 3.1 release): with wavelength
/// `λ = 2π / f`, `λ_low = L / low_freq_factor`, `λ_high = L / high_freq_factor` (`L` the original
/// context length), frequencies with `λ < λ_high` stay, those with `λ > λ_low` are divided by
/// `factor`, and those between are interpolated with `s = (L / λ - low) / (high - low)`:
/// `f' = (1 - s) f / factor + s f`.
fn rope_scaling_divisors(
    s: &Map<String, Value>,
    c: &ModelConfig,
) -> Result<Option<Vec<f32>>, ModelError> {
    let ty = s
        .get("rope_type")
        .or_else(|| s.get("type"))
        .and_then(Value::as_str)
        .unwrap_or("default");
    match ty {
        "default" => return Ok(None),
        "llama3" => {}
        other => {
            return Err(bad(format!(
                "rope scaling type '{other}' is not supported (supported: llama3)"
            )))
        }
    }
    let num = |k: &str| {
        s.get(k)
            .and_then(Value::as_f64)
            .ok_or_else(|| bad(format!("rope_scaling: missing number {k}")))
    };
    let factor = num("factor")?;
    let low = num("low_freq_factor")?;
    let high = num("high_freq_factor")?;
    let old_len = num("original_max_position_embeddings")?;
    if !(factor > 0.0 && low > 0.0 && high > low && old_len > 0.0) {
        return Err(bad(format!(
            "rope_scaling: bad llama3 parameters (factor {factor}, low {low}, high {high}, \
             original length {old_len})"
        )));
    }
    let (low_wavelen, high_wavelen) = (old_len / low, old_len / high);
    let d = c.rope_dim;
    let divisors = (0..d / 2)
        .map(|i| {
            let f = (c.rope_theta as f64).powf(-((2 * i) as f64) / d as f64);
            let wavelen = 2.0 * std::f64::consts::PI / f;
            let scaled = if wavelen < high_wavelen {
                f
            } else if wavelen > low_wavelen {
                f / factor
            } else {
                let sm = (old_len / wavelen - low) / (high - low);
                (1.0 - sm) * f / factor + sm * f
            };
            (f / scaled) as f32
        })
        .collect();
    Ok(Some(divisors))
}

#[cfg(test)]
mod tests {
    use super::*;

    const LLAMA: &str = r#"{"architectures": ["LlamaForCausalLM"], "hidden_size": 64,
        "intermediate_size": 128, "num_hidden_layers": 2, "num_attention_heads": 4,
        "num_key_value_heads": 2, "vocab_size": 320, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        "hidden_act": "silu", "tie_word_embeddings": false}"#;

    fn with(base: &str, edits: &[(&str, Value)]) -> String {
        let mut v: Value = serde_json::from_str(base).unwrap();
        for (k, x) in edits {
            v[*k] = x.clone();
        }
        v.to_string()
    }

    fn all(_: &str) -> bool {
        true
    }

    #[test]
    fn llama3_divisors_match_the_formula_at_the_edges() {
        let s = with(
            LLAMA,
            &[(
                "rope_scaling",
                serde_json::json!({"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                    "high_freq_factor": 4.0, "original_max_position_embeddings": 64}),
            )],
        );
        let c = parse(&s, &all).unwrap();
        let d = c.rope_freqs.unwrap();
        // head_dim 16: wavelengths 2π·10000^(i/8): 6.3 (kept), 19.9 and 62.8 (interpolated),
        // >= 199 (divided by 8).
        assert_eq!(d.len(), 8);
        assert_eq!(d[0], 1.0);
        assert!(d[1] > 1.0 && d[1] < d[2] && d[2] < 8.0, "{d:?}");
        for x in &d[3..] {
            assert!((x - 8.0).abs() < 1e-6, "{d:?}");
        }
        // s = (64/λ - 1)/3 for λ = 2π·10: divisor = 1 / ((1-s)/8 + s).
        let lam = 2.0 * std::f64::consts::PI * 10000f64.powf(0.125);
        let sm = (64.0 / lam - 1.0) / 3.0;
        assert!((d[1] as f64 - 1.0 / ((1.0 - sm) / 8.0 + sm)).abs() < 1e-5);
    }

    #[test]
    fn windows_and_errors() {
        let c = |s: &str| parse(s, &all);
        let m = with(
            LLAMA,
            &[
                ("architectures", serde_json::json!(["MistralForCausalLM"])),
                ("sliding_window", 8.into()),
            ],
        );
        assert_eq!(c(&m).unwrap().config.sliding_window, Some(8));
        let q = with(
            LLAMA,
            &[
                ("architectures", serde_json::json!(["Qwen2ForCausalLM"])),
                ("sliding_window", 4.into()),
                ("use_sliding_window", false.into()),
            ],
        );
        assert_eq!(c(&q).unwrap().config.sliding_window, None);
        let q_on = with(
            &q,
            &[
                ("use_sliding_window", true.into()),
                ("max_window_layers", 1.into()),
            ],
        );
        assert!(c(&q_on)
            .unwrap_err()
            .to_string()
            .contains("max_window_layers"));
        let q_all = with(
            &q,
            &[
                ("use_sliding_window", true.into()),
                ("max_window_layers", 0.into()),
            ],
        );
        assert_eq!(c(&q_all).unwrap().config.sliding_window, Some(4));
        let e = |s: String| c(&s).unwrap_err().to_string();
        assert!(e(with(
            LLAMA,
            &[(
                "rope_scaling",
                serde_json::json!({"type": "yarn", "factor": 4.0})
            )]
        ))
        .contains("'yarn' is not supported"));
        assert!(e(with(
            LLAMA,
            &[("architectures", serde_json::json!(["GPT2LMHeadModel"]))]
        ))
        .contains("GPT2LMHeadModel"));
        assert!(e(with(LLAMA, &[("hidden_size", "64".into())])).contains("hidden_size"));
        assert!(e(with(LLAMA, &[("num_key_value_heads", 3.into())])).contains("multiple"));
        assert!(e(with(LLAMA, &[("hidden_act", "gelu".into())])).contains("gelu"));
        assert!(c("{").unwrap_err().to_string().contains("bad JSON"));
        let no_layers = LLAMA.replace("\"num_hidden_layers\": 2,", "");
        assert!(c(&no_layers)
            .unwrap_err()
            .to_string()
            .contains("num_hidden_layers"));
        // transformers 5: theta inside rope_parameters, "default" = no scaling.
        let v5 = with(
            LLAMA,
            &[
                ("rope_theta", Value::Null),
                (
                    "rope_parameters",
                    serde_json::json!({"rope_type": "default", "rope_theta": 5e5}),
                ),
            ],
        );
        let c5 = c(&v5).unwrap();
        assert_eq!(c5.config.rope_theta, 5e5);
        assert!(c5.rope_freqs.is_none());
        // Untied config without lm_head.weight.
        let untied = parse(LLAMA, &|n| n != "lm_head.weight")
            .unwrap_err()
            .to_string();
        assert!(untied.contains("lm_head.weight"), "{untied}");
    }
}
