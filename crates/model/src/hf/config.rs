//! HF `config.json` → [`ModelConfig`] (and Llama 3 RoPE frequency divisors). Field names and
//! defaults follow transformers' `LlamaConfig`, `MistralConfig`, `Qwen2Config`, `Qwen3Config` and
//! `Qwen3MoeConfig`; both the older `rope_theta` / `rope_scaling` fields and transformers 5's
//! `rope_parameters` are read (and both names of the expert count, `num_experts` and v5's
//! `num_local_experts`).

use serde_json::{Map, Value};

use quire_core::{Architecture, ModelConfig, MoeConfig, RopeStyle};

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
        "Qwen3MoeForCausalLM" | "qwen3_moe" => Architecture::Qwen3Moe,
        other => {
            return Err(ModelError::UnsupportedArch(format!(
                "{other} (HF: LlamaForCausalLM, MistralForCausalLM, Qwen2ForCausalLM, \
                 Qwen3ForCausalLM, Qwen3MoeForCausalLM)"
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

    let moe = match arch {
        Architecture::Qwen3Moe => Some(moe_config(&f, num_layers)?),
        _ => None,
    };
    let intermediate_size = match (f.usize_opt("intermediate_size")?, &moe) {
        (Some(v), _) => v,
        // The dense MLP size is unused when every layer has experts.
        (None, Some(m)) => m.expert_intermediate_size,
        (None, None) => f.usize_req("intermediate_size")?,
    };

    let rms_norm_eps = f.f64_opt("rms_norm_eps")?.unwrap_or(1e-6);
    let config = ModelConfig {
        arch,
        hidden_size: hidden,
        intermediate_size,
        num_layers,
        num_heads,
        num_kv_heads,
        head_dim,
        vocab_size: f.usize_req("vocab_size")?,
        max_position_embeddings: f.usize_opt("max_position_embeddings")?.unwrap_or(4096),
        rms_norm_eps: rms_norm_eps as f32,
        rope_theta: rope_theta as f32,
        rope_dim: head_dim,
        // HF checkpoints keep Q/K rows unpermuted: rotate-half RoPE for all five families.
        rope_style: RopeStyle::Neox,
        tie_word_embeddings: !has_tensor("lm_head.weight"),
        attention_bias: has_tensor("model.layers.0.self_attn.q_proj.bias"),
        qk_norm: has_tensor("model.layers.0.self_attn.q_norm.weight"),
        sliding_window,
        moe,
    };
    config.validate().map_err(bad)?;
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

/// Qwen3-MoE's experts (transformers' `Qwen3MoeConfig`; `norm_topk_prob` defaults to false there).
/// transformers makes layer `i` a dense MLP of `intermediate_size` when `i` is in `mlp_only_layers`
/// or `(i + 1) % decoder_sparse_step != 0`; quire's [`ModelConfig`] has experts on every layer or
/// none (the CPU backend takes one FFN kind per model), so such configs are refused by key.
fn moe_config(f: &Fields, num_layers: usize) -> Result<MoeConfig, ModelError> {
    let num_experts = match (
        f.usize_opt("num_experts")?,
        f.usize_opt("num_local_experts")?,
    ) {
        (Some(a), Some(b)) if a != b => {
            return Err(bad(format!(
                "num_experts ({a}) and num_local_experts ({b}) disagree"
            )))
        }
        (Some(a), _) | (None, Some(a)) => a,
        (None, None) => return Err(bad("missing field num_experts (or num_local_experts)")),
    };
    if num_experts > 1 << 16 {
        return Err(bad(format!("implausible expert count {num_experts}")));
    }
    let step = f.usize_opt("decoder_sparse_step")?.unwrap_or(1);
    if step == 0 {
        return Err(bad("decoder_sparse_step is 0"));
    }
    let only: Vec<usize> = match f.get("mlp_only_layers") {
        None => Vec::new(),
        Some(Value::Array(a)) => a
            .iter()
            .map(|v| {
                v.as_u64()
                    .and_then(|x| usize::try_from(x).ok())
                    .ok_or_else(|| bad(format!("mlp_only_layers holds a non-index {v}")))
            })
            .collect::<Result<_, _>>()?,
        Some(v) => return Err(bad(format!("mlp_only_layers is not a list: {v}"))),
    };
    let listed: Vec<usize> = only.iter().copied().filter(|&i| i < num_layers).collect();
    let off_step: Vec<usize> = (0..num_layers).filter(|i| (i + 1) % step != 0).collect();
    if !listed.is_empty() || !off_step.is_empty() {
        let mut why = Vec::new();
        if !listed.is_empty() {
            why.push(format!("mlp_only_layers {listed:?}"));
        }
        if !off_step.is_empty() {
            why.push(format!(
                "decoder_sparse_step {step} leaves layers {off_step:?} dense"
            ));
        }
        return Err(bad(format!(
            "{}: dense MLP layers in a Qwen3-MoE model are not supported (quire runs experts on \
             every layer)",
            why.join("; ")
        )));
    }
    Ok(MoeConfig {
        num_experts,
        num_experts_per_tok: f.usize_req("num_experts_per_tok")?,
        expert_intermediate_size: f.usize_req("moe_intermediate_size")?,
        norm_topk_prob: f.bool_opt("norm_topk_prob")?.unwrap_or(false),
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

    const QWEN3_MOE: &str = r#"{"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "hidden_size": 64, "intermediate_size": 128, "moe_intermediate_size": 32,
        "num_experts": 8, "num_experts_per_tok": 2, "norm_topk_prob": true,
        "decoder_sparse_step": 1, "mlp_only_layers": [], "num_hidden_layers": 2,
        "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 320,
        "rms_norm_eps": 1e-6, "rope_theta": 10000.0, "hidden_act": "silu",
        "tie_word_embeddings": false, "use_sliding_window": false, "sliding_window": null,
        "max_window_layers": 2}"#;

    #[test]
    fn qwen3_moe_keys() {
        let c = parse(QWEN3_MOE, &all).unwrap().config;
        assert_eq!(c.arch, Architecture::Qwen3Moe);
        assert_eq!((c.head_dim, c.intermediate_size), (16, 128));
        assert!(c.qk_norm && c.sliding_window.is_none());
        let m = c.moe.unwrap();
        assert_eq!(
            (
                m.num_experts,
                m.num_experts_per_tok,
                m.expert_intermediate_size
            ),
            (8, 2, 32)
        );
        assert!(m.norm_topk_prob);

        // transformers 5 names the count num_local_experts; norm_topk_prob defaults to false;
        // a missing dense size falls back to the experts' (it is unused).
        let v5 = with(
            QWEN3_MOE,
            &[
                ("num_experts", Value::Null),
                ("num_local_experts", 4.into()),
                ("norm_topk_prob", Value::Null),
                ("intermediate_size", Value::Null),
                ("architectures", Value::Null),
            ],
        );
        let c5 = parse(&v5, &all).unwrap().config;
        let m5 = c5.moe.unwrap();
        assert_eq!((m5.num_experts, m5.norm_topk_prob), (4, false));
        assert_eq!(c5.intermediate_size, 32);

        let e = |edits: &[(&str, Value)]| {
            parse(&with(QWEN3_MOE, edits), &all)
                .unwrap_err()
                .to_string()
        };
        let only = e(&[("mlp_only_layers", serde_json::json!([1]))]);
        assert!(
            only.contains("mlp_only_layers [1]") && only.contains("not supported"),
            "{only}"
        );
        // Indices past the last layer change nothing.
        assert!(parse(
            &with(QWEN3_MOE, &[("mlp_only_layers", serde_json::json!([7]))]),
            &all
        )
        .is_ok());
        let step = e(&[("decoder_sparse_step", 2.into())]);
        assert!(
            step.contains("decoder_sparse_step 2 leaves layers [0]"),
            "{step}"
        );
        assert!(e(&[("decoder_sparse_step", 0.into())]).contains("decoder_sparse_step is 0"));
        assert!(e(&[("mlp_only_layers", 1.into())]).contains("mlp_only_layers is not a list"));
        assert!(e(&[("num_experts", Value::Null)]).contains("num_experts (or num_local_experts)"));
        assert!(e(&[("num_local_experts", 4.into())]).contains("disagree"));
        assert!(e(&[("moe_intermediate_size", Value::Null)]).contains("moe_intermediate_size"));
        assert!(e(&[("num_experts_per_tok", 9.into())]).contains("exceed"));
    }
}
