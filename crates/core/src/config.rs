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
    ///
    /// Every size is bounded (see [`LIMITS`]) and every product a loader or backend forms from
    /// them (projection widths, tensor element counts, KV bytes per token) is computed with
    /// checked arithmetic here, so that code after a successful `validate` may multiply freely
    /// and a hostile file is refused before anything is allocated from its numbers.
    pub fn validate(&self) -> Result<(), String> {
        let sizes = [
            ("hidden_size", self.hidden_size),
            ("intermediate_size", self.intermediate_size),
            ("num_layers", self.num_layers),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
            ("vocab_size", self.vocab_size),
            ("max_position_embeddings", self.max_position_embeddings),
        ];
        for (name, v) in sizes {
            if v == 0 {
                return Err(format!("{name} must be > 0"));
            }
            let limit = limit_of(name);
            if v > limit {
                return Err(format!(
                    "{name} {v} is implausibly large (quire accepts at most {limit})"
                ));
            }
        }
        self.check_products()?;
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
            if m.num_experts > MAX_EXPERTS {
                return Err(format!(
                    "num_experts {} is implausibly large (quire accepts at most {MAX_EXPERTS})",
                    m.num_experts
                ));
            }
            if m.expert_intermediate_size > limit_of("intermediate_size") {
                return Err(format!(
                    "expert intermediate size {} is implausibly large (quire accepts at most {})",
                    m.expert_intermediate_size,
                    limit_of("intermediate_size")
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

    /// The products of sizes that loaders and backends form, each checked for overflow and
    /// against [`MAX_TENSOR_ELEMENTS`] (no real model's tensor comes near it).
    fn check_products(&self) -> Result<(), String> {
        let mul = |what: &str, factors: &[(&str, usize)]| -> Result<usize, String> {
            let n = factors
                .iter()
                .try_fold(1usize, |acc, &(_, v)| acc.checked_mul(v))
                .filter(|&n| n <= MAX_TENSOR_ELEMENTS);
            n.ok_or_else(|| {
                let named: Vec<String> = factors.iter().map(|(k, v)| format!("{k} {v}")).collect();
                format!(
                    "{what} ({}) is implausibly large (quire accepts at most {MAX_TENSOR_ELEMENTS} \
                     elements per tensor)",
                    named.join(" × ")
                )
            })
        };
        let (h, heads, kvh, hd) = (
            ("hidden_size", self.hidden_size),
            ("num_heads", self.num_heads),
            ("num_kv_heads", self.num_kv_heads),
            ("head_dim", self.head_dim),
        );
        let q = mul("the query width", &[heads, hd])?;
        let kv = mul("the key/value width", &[kvh, hd])?;
        mul("the query projection", &[h, ("num_heads × head_dim", q)])?;
        mul(
            "the key/value projection",
            &[h, ("num_kv_heads × head_dim", kv)],
        )?;
        mul("the embedding", &[h, ("vocab_size", self.vocab_size)])?;
        mul(
            "the FFN projection",
            &[h, ("intermediate_size", self.intermediate_size)],
        )?;
        mul(
            "the KV cache per token",
            &[
                ("2 (K and V)", 2),
                ("num_layers", self.num_layers),
                ("num_kv_heads × head_dim", kv),
                ("4 bytes", 4),
            ],
        )?;
        if let Some(m) = &self.moe {
            mul(
                "the expert stack",
                &[
                    h,
                    ("expert intermediate size", m.expert_intermediate_size),
                    ("num_experts", m.num_experts),
                ],
            )?;
        }
        Ok(())
    }
}

/// Largest number of experts a config may declare.
pub const MAX_EXPERTS: usize = 1 << 16;

/// Largest element count of one tensor (2^40: 4 TiB of f32), and of any product of sizes.
pub const MAX_TENSOR_ELEMENTS: usize = 1 << 40;

/// Upper bounds on single config sizes: far above every released model (the largest head is 256
/// wide, the largest vocabulary ~256k, the longest context ~10M tokens), low enough that no
/// product of them can overflow a 64-bit size.
pub const LIMITS: [(&str, usize); 8] = [
    ("hidden_size", 1 << 20),
    ("intermediate_size", 1 << 22),
    ("num_layers", 4096),
    ("num_heads", 1 << 14),
    ("num_kv_heads", 1 << 14),
    ("head_dim", 1 << 14),
    ("vocab_size", 1 << 24),
    ("max_position_embeddings", 1 << 28),
];

fn limit_of(name: &str) -> usize {
    LIMITS
        .iter()
        .find(|(n, _)| *n == name)
        .map_or(usize::MAX, |&(_, l)| l)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn small() -> ModelConfig {
        ModelConfig {
            arch: Architecture::Llama,
            hidden_size: 64,
            intermediate_size: 128,
            num_layers: 2,
            num_heads: 4,
            num_kv_heads: 2,
            head_dim: 16,
            vocab_size: 320,
            max_position_embeddings: 256,
            rms_norm_eps: 1e-5,
            rope_theta: 1e4,
            rope_dim: 16,
            rope_style: RopeStyle::Normal,
            tie_word_embeddings: true,
            attention_bias: false,
            qk_norm: false,
            sliding_window: None,
            moe: None,
        }
    }

    fn err(edit: impl FnOnce(&mut ModelConfig)) -> String {
        let mut c = small();
        edit(&mut c);
        c.validate().expect_err("config should be refused")
    }

    #[test]
    fn zero_context_length_is_refused() {
        assert!(small().validate().is_ok());
        let e = err(|c| c.max_position_embeddings = 0);
        assert!(e.contains("max_position_embeddings must be > 0"), "{e}");
    }

    #[test]
    fn huge_sizes_are_refused_by_name_without_overflow() {
        let e = err(|c| c.head_dim = 1 << 31);
        assert!(
            e.contains("head_dim 2147483648 is implausibly large"),
            "{e}"
        );
        let e = err(|c| {
            c.head_dim = 1 << 63;
            c.rope_dim = 16;
        });
        assert!(e.contains("head_dim"), "{e}");
        let e = err(|c| c.max_position_embeddings = usize::MAX);
        assert!(e.contains("max_position_embeddings"), "{e}");
        // Each size within its limit, but their product not: the message names the factors.
        let e = err(|c| {
            c.hidden_size = 1 << 20;
            c.vocab_size = 1 << 24;
        });
        assert!(
            e.contains("the embedding") && e.contains("vocab_size 16777216"),
            "{e}"
        );
        let e = err(|c| {
            c.num_heads = 1 << 14;
            c.num_kv_heads = 1 << 14;
            c.head_dim = 1 << 14;
            c.rope_dim = 16;
            c.hidden_size = 1 << 20;
        });
        assert!(e.contains("the query projection"), "{e}");
        let e = err(|c| {
            c.moe = Some(MoeConfig {
                num_experts: usize::MAX,
                num_experts_per_tok: 2,
                expert_intermediate_size: 32,
                norm_topk_prob: true,
            })
        });
        assert!(e.contains("num_experts"), "{e}");
    }
}
