//! Options every engine command shares, and building a model and engine from them.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_backend::cpu::{CpuExecutor, CpuOptions, KvDtype};
use quire_backend::{kv_bytes_per_token, Executor, KvCacheSpec};
use quire_engine::{Engine, EngineConfig};
use quire_model::LoadedModel;

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file or HF model folder (config.json, *.safetensors, tokenizer.json)
    /// [default: $QUIRE_MODEL, else SmolLM2-135M-Instruct Q4_1, fetched once]
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Compute backend
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda"])]
    pub backend: String,
    /// CPU threads [default: all cores]
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// CUDA: fraction of the GPU memory free at start that weights, activations and the KV cache
    /// may take; the KV pool gets what is left after the weights (unless --num-blocks is given)
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
}

#[derive(Args, Debug, Clone)]
pub struct EngineArgs {
    /// Tokens per KV-cache block (16, 32, 64 or 128)
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Number of KV-cache blocks [default: from --kv-cache-mb]
    #[arg(long)]
    pub num_blocks: Option<usize>,
    /// KV-cache size in MiB when --num-blocks is not given
    #[arg(long, default_value_t = 1024)]
    pub kv_cache_mb: usize,
    /// KV-cache storage type. f16 (llama.cpp's default) also rounds Q and the attention
    /// accumulator to f16 as llama.cpp's CPU flash attention does; f32 is exact f32 attention
    #[arg(long, default_value = "f16", value_parser = ["f32", "f16"])]
    pub kv_dtype: String,
    /// Most sequences in one step
    #[arg(long, default_value_t = 64)]
    pub max_num_seqs: usize,
    /// Token budget of one step (prompt chunks plus decodes)
    #[arg(long, default_value_t = 512)]
    pub max_num_batched_tokens: usize,
    /// Turn off prefix caching (reuse of cached KV blocks of shared prompt prefixes)
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Longest prompt + completion [default: the model's context length]
    #[arg(long)]
    pub max_model_len: Option<usize>,
}

pub fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    let path = quire_model::resolve_model_path(args.model.as_deref(), &mut |m| eprintln!("{m}"))?;
    if !path.exists() {
        bail!("model file {} does not exist", path.display());
    }
    // A directory is an HF model folder, anything else a GGUF file.
    quire_model::load(&path).with_context(|| format!("cannot load {}", path.display()))
}

pub fn cpu_options(args: &ModelArgs, kv_dtype: &str) -> CpuOptions {
    let mut o = CpuOptions::default();
    if let Some(t) = args.threads {
        o.threads = t.max(1);
    }
    o.kv_dtype = if kv_dtype == "f16" {
        KvDtype::F16
    } else {
        KvDtype::F32
    };
    o
}

/// Builds the executor for `kv` on the chosen backend.
pub fn executor(
    model: &LoadedModel,
    args: &ModelArgs,
    kv: KvCacheSpec,
    kv_dtype: &str,
) -> Result<Box<dyn Executor>> {
    match args.backend.as_str() {
        "cpu" => Ok(Box::new(CpuExecutor::new(
            &model.weights,
            kv,
            cpu_options(args, kv_dtype),
        )?)),
        "cuda" => cuda_executor(model, args, Some(kv.num_blocks), kv.block_size, kv_dtype),
        other => bail!("unknown backend {other}"),
    }
}

/// The CUDA executor; `num_blocks: None` sizes the KV pool from free GPU memory.
pub fn cuda_executor(
    model: &LoadedModel,
    args: &ModelArgs,
    num_blocks: Option<usize>,
    block_size: usize,
    kv_dtype: &str,
) -> Result<Box<dyn Executor>> {
    if kv_dtype != "f16" {
        bail!("the CUDA backend keeps its KV cache in f16: use --kv-dtype f16");
    }
    let u = args.gpu_memory_utilization;
    if !(u > 0.0 && u <= 1.0) {
        bail!("--gpu-memory-utilization must be in (0, 1] (got {u})");
    }
    let opts = quire_backend::cuda::CudaOptions {
        device: 0,
        gpu_memory_utilization: u,
        num_blocks,
        block_size,
        ..Default::default()
    };
    match quire_backend::cuda::CudaExecutor::new(&model.weights, opts) {
        Ok(e) => Ok(e),
        Err(quire_backend::BackendError::NotBuilt(b)) => {
            bail!("backend {b} was not built into this binary (build with `cargo build --release --features {b}`)")
        }
        Err(e) => Err(e.into()),
    }
}

pub fn kv_spec(model: &LoadedModel, e: &EngineArgs) -> Result<KvCacheSpec> {
    if !matches!(e.block_size, 16 | 32 | 64 | 128) {
        bail!(
            "--block-size must be 16, 32, 64 or 128 (got {})",
            e.block_size
        );
    }
    let per_token =
        kv_bytes_per_token(&model.weights.config) / if e.kv_dtype == "f16" { 2 } else { 1 };
    let num_blocks = match e.num_blocks {
        Some(n) => n,
        None => e.kv_cache_mb.saturating_mul(1 << 20) / (per_token * e.block_size),
    };
    if num_blocks == 0 {
        bail!("the KV cache holds no block: raise --kv-cache-mb or --num-blocks");
    }
    Ok(KvCacheSpec {
        num_blocks,
        block_size: e.block_size,
    })
}

pub fn build_engine(
    model: &LoadedModel,
    m: &ModelArgs,
    e: &EngineArgs,
    top_logprobs: usize,
) -> Result<Engine> {
    let exec = if m.backend == "cuda" {
        if !matches!(e.block_size, 16 | 32 | 64 | 128) {
            bail!(
                "--block-size must be 16, 32, 64 or 128 (got {})",
                e.block_size
            );
        }
        cuda_executor(model, m, e.num_blocks, e.block_size, &e.kv_dtype)?
    } else {
        executor(model, m, kv_spec(model, e)?, &e.kv_dtype)?
    };
    let kv = exec.kv_spec();
    let ctx = model.weights.config.max_position_embeddings;
    let max_model_len = e
        .max_model_len
        .unwrap_or(ctx)
        .min(kv.num_blocks * kv.block_size);
    if e.max_num_seqs == 0 || e.max_num_batched_tokens == 0 {
        bail!("--max-num-seqs and --max-num-batched-tokens must be at least 1");
    }
    Ok(Engine::new(
        exec,
        model.tokenizer.clone(),
        EngineConfig {
            max_num_seqs: e.max_num_seqs,
            max_num_batched_tokens: e.max_num_batched_tokens,
            enable_prefix_caching: !e.no_prefix_cache,
            max_model_len,
            top_logprobs,
        },
    ))
}
