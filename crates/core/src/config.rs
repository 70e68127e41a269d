//! Model hyper-parameters shared by loaders (GGUF, safetensors) and backends (CPU, CUDA). A loader
//! fills one `ModelConfig`; a backend needs nothing else to run the architecture.

use serde::{Deserialize, Serialize};

/// Which pairs of a head's dimensions RoPE rotates together.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum RopeStyle {
    /// Adjacent pairs (2i, 2i+1): GGUF `llama` files, whose Q/K rows were permuted by the converter.
    Normal,
    /// Halves (i, i + rot_dim/2): HF checkpoints, Qwen2/3 and GPT-NeoX-style GGUFs.
    Neox,
}

/// The decoder-only transformer families quire runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Serialize, Deserialize)]
pub enum Architecture {
    Llama,
    Qwen2,
    Qwen3,
    Mistral,
    /// Qwen3 attention (QK-norm, Neox RoPE) with a mixture-of-experts FFN on every layer.
    Qwen3Moe,
}

impl Architecture {
    pub fn name(self) -> &'static str {
        match self {
            Architecture::Llama => "llama",
            Architecture::Qwen2 => "qwen2",
            Architecture::Qwen3 => "qwen3",
            Architecture::Mistral => "mistral",
            Architecture::Qwen3Moe => "qwen3moe",
        }
    }
}

/// A sparse mixture-of-experts FFN (Qwen3-MoE; transformers' `Qwen3MoeSparseMoeBlock`, llama.cpp's
/// `build_moe_ffn` with softmax gating): per token, router logits over all experts, softmax (f32),
/// the `num_experts_per_tok` largest probabilities, optionally renormalized to sum to 1, weight the
/// outputs of those experts' SwiGLU FFNs.
#[derive(Debug, Clone, Copy, PartialEq, Serialize, Deserialize)]
pub struct MoeConfig {
    pub num_experts: usize,
    /// Experts each token is routed to (top-k).
    pub num_experts_per_tok: usize,
    /// Intermediate size of each expert's FFN (HF `moe_intermediate_size`).
    pub expert_intermediate_size: usize,
    /// Divide the top-k probabilities by their sum (HF `norm_topk_prob`).
    pub norm_topk_prob: bool,
}

#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
pub struct ModelConfig {
    pub arch: Architecture,
    pub hidden_size: usize,
    pub intermediate_size: usize,
    pub num_layers: usize,
    pub num_heads: usize,
    pub num_kv_heads: usize,
    pub head_dim: usize,
    pub vocab_size: usize,
    /// Longest context the model was trained for.
    pub max_position_embeddings: usize,
    pub rms_norm_eps: f32,
    pub rope_theta: f32,
    /// Dimensions of each head that RoPE rotates (usually `head_dim`).
    pub rope_dim: usize,
    pub rope_style: RopeStyle,
    pub tie_word_embeddings: bool,
    /// Q, K and V projections carry a bias (Qwen2).
    pub attention_bias: bool,
    /// RMSNorm on each query and key head before RoPE (Qwen3).
    pub qk_norm: bool,
    /// Sliding-window attention on every layer (Mistral): a query at position `p` attends the keys
    /// at positions `p - w < j <= p` only, i.e. the `w` most recent tokens including itself.
    /// `None`: full causal attention.
    #[serde(default)]
    pub sliding_window: Option<usize>,
    /// Every layer's FFN is a mixture of experts (`intermediate_size` is then unused by the
    /// forward pass). `None`: dense SwiGLU FFNs.
    #[serde(default)]
    pub moe: Option<MoeConfig>,
}

impl ModelConfig {
    pub fn q_size(&self) -> usize {
        self.num_heads * self.head_dim
    }

    pub fn kv_size(&self) -> usize {
        self.num_kv_heads * self.head_dim
    }

    /// Checks the shape relations a backend relies on; the message names the broken one.
    pub fn validate(&self) -> Result<(), String> {
        let nonzero = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
        ];
        for (name, v) in nonzero {
            if v == 0 {
                return Err(format!("{name} must be > 0"));
            }
        }
        if !self.num_heads.is_multiple_of(self.num_kv_heads) {
            return Err(format!(
                "num_heads ({}) must be a multiple of num_kv_heads ({})",
                self.num_heads, self.num_kv_heads
            ));
        }
        if self.rope_dim > self.head_dim || !self.rope_dim.is_multiple_of(2) {
            return Err(format!(
                "rope dimension {} must be even and <= head_dim {}",
                self.rope_dim, self.head_dim
            ));
        }
        if !(self.rms_norm_eps.is_finite() && self.rms_norm_eps >= 0.0) {
            return Err(format!("bad rms_norm_eps {}", self.rms_norm_eps));
        }
        if self.sliding_window == Some(0) {
            return Err("sliding_window must be > 0".into());
        }
        if !(self.rope_theta.is_finite() && self.rope_theta > 0.0) {
            return Err(format!("bad rope theta {}", self.rope_theta));
        }
        if let Some(m) = &self.moe {
            if m.num_experts == 0 || m.num_experts_per_tok == 0 || m.expert_intermediate_size == 0 {
                return Err(format!(
                    "MoE needs nonzero experts ({}), experts per token ({}) and expert FFN size ({})",
                    m.num_experts, m.num_experts_per_tok, m.expert_intermediate_size
                ));
            }
            if m.num_experts_per_tok > m.num_experts {
                return Err(format!(
                    "experts per token ({}) exceed the number of experts ({})",
                    m.num_experts_per_tok, m.num_experts
                ));
            }
        } else if self.arch == Architecture::Qwen3Moe {
            return Err("qwen3moe needs a MoE config".into());
        }
        Ok(())
    }
}
