//! The model shapes `quire make-model` can write: each preset's hyper-parameters as the real
//! model's GGUF header states them (kept apart from the writer so that adding a model is one entry
//! here).

use clap::ValueEnum;

#[derive(Clone, Copy, Debug, PartialEq, Eq, ValueEnum)]
pub enum Preset {
    /// Meta-Llama-3-8B
    #[value(name = "llama3-8b")]
    Llama3_8b,
    /// Meta-Llama-3-70B (141 GB in f16: for tensor parallelism over several GPUs)
    #[value(name = "llama3-70b")]
    Llama3_70b,
    /// Llama-3.2-1B (tied embeddings)
    #[value(name = "llama3.2-1b")]
    Llama32_1b,
    /// SmolLM2-135M (tied embeddings)
    #[value(name = "smollm2-135m")]
    Smollm2_135m,
    /// Qwen3-8B (arch qwen3, QK norm)
    #[value(name = "qwen3-8b")]
    Qwen3_8b,
    /// Qwen3-30B-A3B (arch qwen3moe: 128 experts, 8 per token)
    #[value(name = "qwen3-30b-a3b")]
    Qwen3_30bA3b,
    /// A tiny qwen3moe (8 experts, 2 per token) for tests
    #[value(name = "qwen3-moe-tiny")]
    Qwen3MoeTiny,
}

/// A model's hyper-parameters, as its GGUF header states them.
#[derive(Debug, Clone)]
pub(crate) struct Shape {
    pub(crate) arch: &'static str,
    pub(crate) name: &'static str,
    pub(crate) hidden: u64,
    pub(crate) inter: u64,
    pub(crate) layers: u64,
    pub(crate) heads: u64,
    pub(crate) kv_heads: u64,
    pub(crate) head_dim: u64,
    pub(crate) vocab: u64,
    pub(crate) rope_theta: f32,
    pub(crate) ctx: u32,
    pub(crate) eps: f32,
    pub(crate) tied: bool,
    pub(crate) qk_norm: bool,
    pub(crate) add_bos: bool,
    /// Mixture of experts: (experts, experts per token, expert FFN size); `inter` is then the
    /// unused dense size the real config states.
    pub(crate) moe: Option<(u64, u64, u64)>,
}

impl Preset {
    pub(crate) const ALL: [Preset; 7] = [
        Preset::Llama3_8b,
        Preset::Llama3_70b,
        Preset::Llama32_1b,
        Preset::Smollm2_135m,
        Preset::Qwen3_8b,
        Preset::Qwen3_30bA3b,
        Preset::Qwen3MoeTiny,
    ];

    pub(crate) fn shape(self) -> Shape {
        let llama = Shape {
            arch: "llama",
            name: "Llama-3-8B",
            hidden: 4096,
            inter: 14336,
            layers: 32,
            heads: 32,
            kv_heads: 8,
            head_dim: 128,
            vocab: 128256,
            rope_theta: 500000.0,
            ctx: 8192,
            eps: 1e-5,
            tied: false,
            qk_norm: false,
            add_bos: true,
            moe: None,
        };
        let qwen3 = Shape {
            arch: "qwen3",
            name: "Qwen3-8B",
            inter: 12288,
            layers: 36,
            vocab: 151936,
            rope_theta: 1000000.0,
            ctx: 40960,
            eps: 1e-6,
            qk_norm: true,
            add_bos: false,
            ..llama.clone()
        };
        match self {
            Preset::Llama3_8b => llama,
            // meta-llama/Meta-Llama-3-70B config.json: hidden 8192, intermediate 28672, 80 layers,
            // 64 heads, 8 KV heads (head_dim 128), vocab 128256, rope theta 500000, untied.
            Preset::Llama3_70b => Shape {
                name: "Llama-3-70B",
                hidden: 8192,
                inter: 28672,
                layers: 80,
                heads: 64,
                ..llama
            },
            Preset::Llama32_1b => Shape {
                name: "Llama-3.2-1B",
                hidden: 2048,
                inter: 8192,
                layers: 16,
                head_dim: 64,
                ctx: 131072,
                tied: true,
                ..llama
            },
            Preset::Smollm2_135m => Shape {
                name: "SmolLM2-135M",
                hidden: 576,
                inter: 1536,
                layers: 30,
                heads: 9,
                kv_heads: 3,
                head_dim: 64,
                vocab: 49152,
                rope_theta: 100000.0,
                tied: true,
                add_bos: false,
                ..llama
            },
            Preset::Qwen3_8b => qwen3,
            // Qwen/Qwen3-30B-A3B config.json: hidden 2048, intermediate 6144, moe_intermediate 768,
            // 48 layers, 32 heads, 4 KV heads, head_dim 128, 128 experts, 8 per token,
            // norm_topk_prob true (llama.cpp's qwen3moe always renormalizes), untied.
            Preset::Qwen3_30bA3b => Shape {
                arch: "qwen3moe",
                name: "Qwen3-30B-A3B",
                hidden: 2048,
                inter: 6144,
                layers: 48,
                kv_heads: 4,
                moe: Some((128, 8, 768)),
                ..qwen3
            },
            Preset::Qwen3MoeTiny => Shape {
                arch: "qwen3moe",
                name: "Qwen3-MoE-tiny",
                hidden: 128,
                inter: 256,
                layers: 2,
                heads: 4,
                kv_heads: 2,
                head_dim: 32,
                vocab: 1024,
                ctx: 4096,
                moe: Some((8, 2, 64)),
                ..qwen3
            },
        }
    }

    pub(crate) fn cli_name(self) -> String {
        self.to_possible_value()
            .map(|v| v.get_name().to_owned())
            .unwrap_or_default()
    }
}
