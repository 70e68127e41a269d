//! Options every engine command shares, and building a model and engine from them.

use std::path::PathBuf;

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_backend::cpu::{CpuExecutor, CpuOptions, KvDtype};
use quire_backend::cuda::CudaOptions;
use quire_backend::{kv_bytes_per_token, Executor, KvCacheSpec};
use quire_engine::{Engine, EngineConfig};
use quire_model::LoadedModel;

/// `--cpu-math`'s help, shared by every command that takes it.
pub const CPU_MATH_HELP: &str = "CPU arithmetic. `fast` (the default): attention vectorized over \
    keys (polynomial exp with relative error below 1.2e-7, f32 accumulators, AVX-512 or AVX2 \
    picked at run time), each row's keys split in fixed ranges over the threads; every query row \
    is computed as if alone (a prompt's rows share their reads of the keys, not arithmetic), so a \
    row's result depends only on its query and keys. Greedy text may part from llama.cpp's at \
    near-ties. 3x llama.cpp's decode at depth 8192 on a 2-core Xeon. `exact`: llama.cpp's AVX2 \
    arithmetic bit for bit (its greedy text)";

#[derive(Args, Debug, Clone)]
pub struct ModelArgs {
    /// GGUF model file or HF model folder (config.json, *.safetensors, tokenizer.json)
    /// [default: $QUIRE_MODEL, else SmolLM2-135M-Instruct Q4_1, fetched once]
    #[arg(long, short = 'm')]
    pub model: Option<PathBuf>,
    /// Compute backend (cuda and wgpu need a build with `--features cuda` / `--features wgpu`)
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    pub backend: String,
    /// wgpu: the adapter, by its index in `quire adapters` or a substring of its name
    /// [default: the first discrete GPU, else the first adapter]. WGPU_BACKEND=vulkan|metal|dx12
    /// narrows the APIs searched
    #[arg(long)]
    pub adapter: Option<String>,
    /// CPU threads [default: all cores]. More than the machine's cores is capped to its core
    /// count, with a warning (oversubscribed threads only wait on each other)
    #[arg(long, short = 't', value_parser = parse_threads)]
    pub threads: Option<usize>,
    /// CUDA: fraction of the GPU memory free at start that weights, activations and the KV cache
    /// may take; the KV pool gets what is left after the weights (unless --num-blocks is given)
    #[arg(long, default_value_t = 0.9)]
    pub gpu_memory_utilization: f32,
    /// CUDA: weights on the GPU. `native` keeps Q4_0/Q4_1/Q8_0 and Q4_K/Q5_K/Q6_K weights as
    /// stored and multiplies them with 8-bit activations (dp4a kernels: llama.cpp's numerics, fewer
    /// bytes per token); `f16` dequantizes every weight to f16 for cuBLAS. Weights of other types
    /// (F16, BF16, F32) go to the GPU as f16 either way
    #[arg(long, default_value = "native", value_parser = ["native", "f16"])]
    pub gpu_weights: String,
    #[arg(long, default_value = "fast", value_parser = ["exact", "fast"], help = CPU_MATH_HELP)]
    pub cpu_math: String,
    /// Split the model over N devices (tensor parallelism): attention heads and FFN columns are
    /// divided among N ranks that add their partial products with an all-reduce after each
    /// block. CUDA: GPUs 0..N-1, one thread per GPU in this process, NCCL (libnccl.so.2) loaded
    /// at run time; NVLink multicast stays off (NCCL_NVLS_ENABLE=0). CPU: N ranks in this process
    /// sharing its threads (a check of the split, not a speed-up). N must divide the attention
    /// heads, and the KV heads must divide N or N them (extra ranks then share KV heads)
    #[arg(long, default_value_t = 1, value_parser = parse_tp_size)]
    pub tensor_parallel_size: usize,
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
    /// Most sequences in one step [default: 256 with --backend cuda, 64 otherwise]
    #[arg(long)]
    pub max_num_seqs: Option<usize>,
    /// Token budget of one step (prompt chunks plus decodes) [default: 8192 with --backend cuda,
    /// 512 otherwise]
    #[arg(long)]
    pub max_num_batched_tokens: Option<usize>,
    /// Turn off prefix caching (reuse of cached KV blocks of shared prompt prefixes)
    #[arg(long)]
    pub no_prefix_cache: bool,
    /// Longest prompt + completion, at least 1 [default: the model's context length, capped by
    /// the KV cache's size]
    #[arg(long)]
    pub max_model_len: Option<usize>,
}

impl EngineArgs {
    /// `--max-num-seqs`, or the backend's default: a GPU step of 64 sequences and 512 tokens
    /// leaves an H100 mostly idle under load (8B f16, 256 requests in flight: 24.8 req/s against
    /// 36.3 with 256 and 8192 on an H200), while on a CPU a larger step only lengthens every
    /// request's time per token.
    pub fn max_num_seqs(&self, backend: &str) -> usize {
        self.max_num_seqs
            .unwrap_or(if backend == "cuda" { 256 } else { 64 })
    }

    /// `--max-num-batched-tokens`, or the backend's default (see [`EngineArgs::max_num_seqs`]).
    pub fn max_num_batched_tokens(&self, backend: &str) -> usize {
        self.max_num_batched_tokens
            .unwrap_or(if backend == "cuda" { 8192 } else { 512 })
    }
}

pub fn load_model(args: &ModelArgs) -> Result<LoadedModel> {
    let path = quire_model::resolve_model_path(args.model.as_deref(), &mut |m| eprintln!("{m}"))?;
    if !path.exists() {
        bail!("model file {} does not exist", path.display());
    }
    // A directory is an HF model folder, anything else a GGUF file.
    quire_model::load(&path).with_context(|| format!("cannot load {}", path.display()))
}

fn parse_tp_size(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

fn parse_threads(s: &str) -> Result<usize, String> {
    match s.parse::<usize>() {
        Ok(0) => Err("must be at least 1".into()),
        Ok(n) => Ok(n),
        Err(e) => Err(e.to_string()),
    }
}

/// The cores this process may use.
fn available_cores() -> usize {
    std::thread::available_parallelism().map_or(1, |n| n.get())
}

pub fn cpu_options(args: &ModelArgs, kv_dtype: &str) -> CpuOptions {
    let mut o = CpuOptions::default();
    if let Some(t) = args.threads {
        let cores = available_cores();
        if t > cores {
            static WARNED: std::sync::Once = std::sync::Once::new();
            WARNED.call_once(|| {
                eprintln!(
                    "warning: --threads {t} is more than the {cores} available cores; using {cores}"
                )
            });
        }
        o.threads = t.clamp(1, cores);
    }
    o.math = args.cpu_math.parse().unwrap_or_default();
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
    let tp = args.tensor_parallel_size;
    match args.backend.as_str() {
        "cpu" if tp > 1 => Ok(quire_backend::tp::cpu_group(
            &model.weights,
            kv,
            cpu_options(args, kv_dtype),
            tp,
        )?),
        "cpu" => Ok(Box::new(CpuExecutor::new(
            &model.weights,
            kv,
            cpu_options(args, kv_dtype),
        )?)),
        "cuda" => cuda_executor(
            model,
            args,
            (Some(kv.num_blocks), kv.block_size),
            kv_dtype,
            CudaOptions::default().max_num_batched_tokens,
        ),
        "wgpu" => wgpu_executor(model, args, kv, kv_dtype),
        other => bail!("unknown backend {other}"),
    }
}

/// The wgpu executor on the adapter `--adapter` names.
pub fn wgpu_executor(
    model: &LoadedModel,
    args: &ModelArgs,
    kv: KvCacheSpec,
    kv_dtype: &str,
) -> Result<Box<dyn Executor>> {
    if kv_dtype != "f16" {
        bail!("the wgpu backend keeps its KV cache in f16: use --kv-dtype f16");
    }
    if args.tensor_parallel_size > 1 {
        bail!("the wgpu backend runs on one adapter: --tensor-parallel-size needs --backend cuda (or cpu)");
    }
    let opts = quire_backend::wgpu::WgpuOptions {
        adapter: args.adapter.clone(),
    };
    match quire_backend::wgpu::executor(&model.weights, kv, &opts) {
        Ok(e) => Ok(e),
        Err(quire_backend::BackendError::NotBuilt(b)) => {
            bail!("backend {b} was not built into this binary (build with `cargo build --release --features {b}`)")
        }
        Err(e) => Err(e.into()),
    }
}

/// The CUDA executor: `pool` is (blocks, or `None` to size the pool from free memory, block
/// size); `max_tokens` the most tokens a step holds (activations allocated at load).
pub fn cuda_executor(
    model: &LoadedModel,
    args: &ModelArgs,
    (num_blocks, block_size): (Option<usize>, usize),
    kv_dtype: &str,
    max_tokens: usize,
) -> Result<Box<dyn Executor>> {
    if kv_dtype != "f16" {
        bail!("the CUDA backend keeps its KV cache in f16: use --kv-dtype f16");
    }
    let u = args.gpu_memory_utilization;
    if !(u > 0.0 && u <= 1.0) {
        bail!("--gpu-memory-utilization must be in (0, 1] (got {u})");
    }
    let opts = CudaOptions {
        device: 0,
        gpu_memory_utilization: u,
        num_blocks,
        block_size,
        quantized_weights: args.gpu_weights == "native",
        max_num_batched_tokens: max_tokens,
        ..Default::default()
    };
    match quire_backend::cuda::tp_group(&model.weights, opts, args.tensor_parallel_size) {
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
    // The config is validated, so these products fit; checked anyway, as the totals below are.
    let block_bytes = kv_bytes_per_token(&model.weights.config)
        .checked_div(if e.kv_dtype == "f16" { 2 } else { 1 })
        .and_then(|b| b.checked_mul(e.block_size))
        .filter(|&b| b > 0)
        .context("KV-cache block size overflows")?;
    let num_blocks = match e.num_blocks {
        Some(n) => n,
        None => e.kv_cache_mb.saturating_mul(1 << 20) / block_bytes,
    };
    if num_blocks == 0 {
        bail!("the KV cache holds no block: raise --kv-cache-mb or --num-blocks");
    }
    check_kv_fits(num_blocks, block_bytes, mem_available())?;
    Ok(KvCacheSpec {
        num_blocks,
        block_size: e.block_size,
    })
}

/// Refuses a CPU KV cache larger than the memory available (`avail` bytes, when known), saying how
/// many blocks and MiB would fit, instead of letting the allocation abort the process.
pub fn check_kv_fits(num_blocks: usize, block_bytes: usize, avail: Option<u64>) -> Result<()> {
    let fit = |avail: u64| {
        let blocks = avail / block_bytes as u64;
        let mb = (blocks * block_bytes as u64) >> 20;
        format!("at most {blocks} blocks fit (--num-blocks {blocks}, or --kv-cache-mb {mb})")
    };
    let Some(total) = num_blocks.checked_mul(block_bytes) else {
        bail!(
            "a KV cache of {num_blocks} blocks of {block_bytes} bytes overflows the address space{}",
            avail.map(|a| format!("; {}", fit(a))).unwrap_or_default()
        );
    };
    if let Some(avail) = avail {
        if total as u64 > avail {
            bail!(
                "a KV cache of {num_blocks} blocks needs {} MiB but only {} MiB of memory is available; {}",
                total >> 20,
                avail >> 20,
                fit(avail)
            );
        }
    }
    Ok(())
}

/// Memory available to new allocations without swapping: Linux's `MemAvailable` in
/// /proc/meminfo, in bytes. `None` elsewhere or when it cannot be read (the allocation itself is
/// then the only check).
pub fn mem_available() -> Option<u64> {
    let text = std::fs::read_to_string("/proc/meminfo").ok()?;
    parse_mem_available(&text)
}

fn parse_mem_available(meminfo: &str) -> Option<u64> {
    let line = meminfo.lines().find(|l| l.starts_with("MemAvailable:"))?;
    let mut parts = line.split_whitespace().skip(1);
    let kib: u64 = parts.next()?.parse().ok()?;
    match parts.next() {
        Some("kB") => kib.checked_mul(1024),
        _ => None,
    }
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
        cuda_executor(
            model,
            m,
            (e.num_blocks, e.block_size),
            &e.kv_dtype,
            e.max_num_batched_tokens(&m.backend),
        )?
    } else {
        executor(model, m, kv_spec(model, e)?, &e.kv_dtype)?
    };
    if e.max_model_len == Some(0) {
        bail!("--max-model-len must be at least 1");
    }
    let kv = exec.kv_spec();
    let ctx = model.weights.config.max_position_embeddings;
    let max_model_len = e
        .max_model_len
        .unwrap_or(ctx)
        .min(kv.num_blocks * kv.block_size);
    let (max_num_seqs, max_num_batched_tokens) = (
        e.max_num_seqs(&m.backend),
        e.max_num_batched_tokens(&m.backend),
    );
    if max_num_seqs == 0 || max_num_batched_tokens == 0 {
        bail!("--max-num-seqs and --max-num-batched-tokens must be at least 1");
    }
    Ok(Engine::new(
        exec,
        model.tokenizer.clone(),
        EngineConfig {
            max_num_seqs,
            max_num_batched_tokens,
            enable_prefix_caching: !e.no_prefix_cache,
            max_model_len,
            top_logprobs,
        },
    ))
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn mem_available_is_read_from_meminfo() {
        let text = "MemTotal:       24000000 kB\nMemFree:  100 kB\nMemAvailable:   2048 kB\n";
        assert_eq!(parse_mem_available(text), Some(2 << 20));
        assert_eq!(parse_mem_available("MemTotal: 1 kB\n"), None);
    }

    #[test]
    fn kv_cache_larger_than_memory_says_what_fits() {
        // 1 MiB blocks, 10.5 MiB available: 10 blocks fit.
        let avail = Some((10 << 20) + (1 << 19));
        assert!(check_kv_fits(10, 1 << 20, avail).is_ok());
        let e = check_kv_fits(11, 1 << 20, avail).unwrap_err().to_string();
        assert!(
            e.contains("needs 11 MiB")
                && e.contains("--num-blocks 10")
                && e.contains("--kv-cache-mb 10"),
            "{e}"
        );
        let e = check_kv_fits(usize::MAX, 1 << 20, avail)
            .unwrap_err()
            .to_string();
        assert!(
            e.contains("overflows") && e.contains("--num-blocks 10"),
            "{e}"
        );
        assert!(check_kv_fits(1 << 20, 1 << 20, None).is_ok());
    }
}
