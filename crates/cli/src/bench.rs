//! `quire bench`: llama-bench's measurements, flags and output, run on quire's executor. Like
//! llama-bench (which calls `llama_decode` directly) it drives the backend without the scheduler:
//! `pp` is one forward of the prompt from an empty cache (in chunks of 512), `tg` is n one-token
//! forwards, `pp+tg` both, `@ dN` first fills N tokens of context untimed. `-b` adds batched
//! decode: B sequences, each with its own block table, decoding together, one forward per step.
//! A warm-up run precedes each test; each repetition starts from an empty cache. JSON keeps
//! llama-bench's field names so tools (and `quire compare`) read both, and adds quire's: among
//! them the model's load time, peak host and GPU memory, and the run's `QUIRE_*` settings.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_backend::{Executor, KvCacheSpec};
use quire_model::LoadedModel;
use quire_perf::output::{records_csv, records_json, records_jsonl};
use quire_perf::{mem, Format, RunStamp, Summary};

use crate::roofs::Roofs;
use rand::{Rng, SeedableRng};
use serde_json::{json, Map, Value};

use crate::bench_report::markdown;
use crate::common::{executor, load_model, ModelArgs};

/// Tokens per forward when a prompt is longer (llama-bench's default n_ubatch).
pub const CHUNK: usize = 512;

#[derive(Args, Debug)]
pub struct BenchArgs {
    /// Model files, comma-separated [default: $QUIRE_MODEL, else the default model]
    #[arg(short = 'm', long = "model", value_delimiter = ',')]
    pub models: Vec<PathBuf>,
    /// Prompt lengths, comma-separated (0 for none)
    #[arg(
        short = 'p',
        long = "n-prompt",
        value_delimiter = ',',
        default_value = "512"
    )]
    pub n_prompt: Vec<String>,
    /// Generation lengths, comma-separated (0 for none)
    #[arg(
        short = 'n',
        long = "n-gen",
        value_delimiter = ',',
        default_value = "128"
    )]
    pub n_gen: Vec<String>,
    /// Prompt then generation as one test, PP,TG (also written `-pg PP,TG`, as llama-bench does)
    #[arg(long = "pg", value_name = "PP,TG")]
    pub pg: Vec<String>,
    /// Context depths filled before each test, comma-separated. The KV cache is sized for depth +
    /// test, so a test may run past the model's trained context (with a warning), as in llama-bench
    #[arg(
        short = 'd',
        long = "n-depth",
        value_delimiter = ',',
        default_value = "0"
    )]
    pub depth: Vec<usize>,
    /// Batched decode: numbers of sequences decoding together, comma-separated (e.g. 1,2,4,8,16)
    #[arg(short = 'b', long = "batch", value_delimiter = ',')]
    pub batch: Vec<usize>,
    /// Repetitions of each test
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Output format: md, csv, json, jsonl
    #[arg(short = 'o', long = "output", default_value = "md")]
    pub output: String,
    /// Compute backend
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    pub backend: String,
    /// wgpu: the adapter, by index in `quire adapters` or a substring of its name
    #[arg(long)]
    pub adapter: Option<String>,
    /// CUDA: weights on the GPU: `native` keeps Q4_0/Q4_1/Q8_0 as stored (8-bit activations),
    /// `f16` dequantizes them for cuBLAS
    #[arg(long, default_value = "native", value_parser = ["native", "f16"])]
    pub gpu_weights: String,
    #[arg(long, default_value = "fast", value_parser = ["exact", "fast"], help = crate::common::CPU_MATH_HELP)]
    pub cpu_math: String,
    /// Split the model over N devices (tensor parallelism; see `quire generate --help`). The
    /// memory and compute ceilings are then N devices' (the % columns compare with all of them)
    #[arg(long, default_value_t = 1)]
    pub tensor_parallel_size: usize,
    /// CPU threads, comma-separated [default: all cores]
    #[arg(short = 't', long = "threads", value_delimiter = ',')]
    pub threads: Vec<usize>,
    /// KV-cache storage type (f16, as the engine and llama-bench default to)
    #[arg(long, default_value = "f16", value_parser = ["f32", "f16"])]
    pub kv_dtype: String,
    /// Tokens per KV-cache block
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Seed of the random prompt tokens
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Also run every generation test as chain decode: greedy, K steps per submission with each
    /// token fed back on the device (CUDA graphs; other backends step by step), reported as
    /// `tg128 chainK`. The plain tests copy every step's logits to the host, as llama-bench does
    #[arg(long, value_name = "K", value_parser = clap::value_parser!(u16).range(2..=64))]
    pub chain: Option<u16>,
    /// Speculative decoding instead of the kernel tests (batch 1, greedy, -n tokens, built-in
    /// repeat/edit prompts, off vs each K): `ngram:K,..` (prompt lookup), `draft:FILE,K,..` (a
    /// draft model); `verify:K,..` times a verify step of K+1 tokens against a plain one
    #[arg(long, value_name = "ngram:K,..|draft:FILE,K,..|verify:K,..")]
    pub spec: Option<String>,
    #[command(flatten)]
    pub json: crate::json_bench::JsonBenchArgs,
    /// With --spec: n-gram lengths matched, MIN,MAX
    #[arg(long, value_name = "MIN,MAX", default_value = "1,3")]
    pub spec_ngram: String,
    /// The value of `-pg` when written as llama-bench does (`-pg 512,128` parses as `-p g`)
    #[arg(hide = true)]
    pub pg_values: Vec<String>,
}

/// One test of the matrix.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct TestSpec {
    pub n_prompt: usize,
    pub n_gen: usize,
    pub n_depth: usize,
    /// Sequences decoding together; 1 for llama-bench's tests.
    pub n_seqs: usize,
    /// A batched-decode test (`-b`), reported in the batch-scaling table.
    pub batched: bool,
    /// Generation as chain decode of this many steps per submission (0: one forward per step).
    pub chain: usize,
}

impl TestSpec {
    /// llama-bench's test name (`pp512`, `tg128`, `pp512+tg128`, `… @ d4096`); batched decode
    /// appends `xB` (`tg128 x8`).
    pub fn name(&self) -> String {
        let mut s = match (self.n_prompt, self.n_gen) {
            (p, 0) => format!("pp{p}"),
            (0, g) => format!("tg{g}"),
            (p, g) => format!("pp{p}+tg{g}"),
        };
        if self.batched {
            s += &format!(" x{}", self.n_seqs);
        }
        if self.chain > 0 {
            s += &format!(" chain{}", self.chain);
        }
        if self.n_depth > 0 {
            s += &format!(" @ d{}", self.n_depth);
        }
        s
    }

    /// Tokens counted in t/s (all sequences).
    pub fn tokens(&self) -> usize {
        (self.n_prompt + self.n_gen) * self.n_seqs
    }

    /// Blocks the test needs in the KV cache.
    pub fn blocks(&self, block_size: usize) -> usize {
        self.n_seqs * (self.n_depth + self.n_prompt + self.n_gen).div_ceil(block_size)
    }

    /// Forward passes of one timed run.
    pub fn forwards(&self) -> usize {
        self.n_prompt.div_ceil(CHUNK) + self.n_gen
    }
}

/// Per-model constants of the cost model (bytes moved, FLOPs done).
#[derive(Debug, Clone, Copy)]
pub struct ModelCosts {
    /// Parameters one token multiplies with (a MoE token: the router and its top-k experts).
    pub n_params: u64,
    /// Weight bytes one forward reads (all layers and the output projection).
    pub weight_bytes: u64,
    /// K and V bytes of one cached token, all layers.
    pub kv_bytes_per_token: u64,
    /// FLOPs of attention per (query token, context token) pair, all layers.
    pub attn_flops_per_pair: u64,
}

impl ModelCosts {
    pub fn of(model: &LoadedModel, kv_dtype: &str) -> ModelCosts {
        let w = &model.weights;
        let c = &w.config;
        let len = |t: &quire_backend::HostTensor| t.bytes.as_slice().len() as u64;
        let layers: u64 = w
            .layers
            .iter()
            .map(|l| {
                let ffn = match (&l.ffn, &c.moe) {
                    // A token reads the router and its top-k experts' slabs.
                    (quire_backend::FfnWeights::Moe(m), Some(mc)) => {
                        len(&m.gate_inp)
                            + (len(&m.gate_exps) + len(&m.up_exps) + len(&m.down_exps))
                                * mc.num_experts_per_tok as u64
                                / mc.num_experts as u64
                    }
                    (f, _) => f.tensors().into_iter().map(len).sum(),
                };
                len(&l.wq) + len(&l.wk) + len(&l.wv) + len(&l.wo) + ffn
            })
            .sum();
        let elem = if kv_dtype == "f16" { 2 } else { 4 };
        let idle_experts: u64 = match &c.moe {
            Some(m) => w
                .layers
                .iter()
                .map(|l| match &l.ffn {
                    quire_backend::FfnWeights::Moe(e) => {
                        let n: usize = [&e.gate_exps, &e.up_exps, &e.down_exps]
                            .iter()
                            .map(|t| t.n_elements())
                            .sum();
                        (n / m.num_experts * (m.num_experts - m.num_experts_per_tok)) as u64
                    }
                    _ => 0,
                })
                .sum(),
            None => 0,
        };
        ModelCosts {
            n_params: model.meta.n_params - idle_experts,
            weight_bytes: layers + len(w.output.as_ref().unwrap_or(&w.tok_embd)),
            kv_bytes_per_token: (2 * c.num_layers * c.kv_size() * elem) as u64,
            attn_flops_per_pair: (4 * c.num_layers * c.q_size()) as u64,
        }
    }

    /// (bytes, FLOPs) of one timed run: weights once per forward plus the KV cache read by each
    /// decode step (prompt chunks read their context once); 2 FLOPs per parameter per token plus
    /// attention.
    pub fn run_cost(&self, t: &TestSpec) -> (u64, u64) {
        let (d, p, g, s) = (
            t.n_depth as u64,
            t.n_prompt as u64,
            t.n_gen as u64,
            t.n_seqs as u64,
        );
        let kv_tokens_read =
            s * ((d + p) * u64::from(p > 0) + (0..g).map(|i| d + p + i + 1).sum::<u64>());
        let bytes =
            self.weight_bytes * t.forwards() as u64 + self.kv_bytes_per_token * kv_tokens_read;
        // Attention pairs: prompt token i at depth d sees d + i + 1 tokens.
        let pairs = s * (p * d + p * (p + 1) / 2 + (0..g).map(|i| d + p + i + 1).sum::<u64>());
        let flops = 2 * self.n_params * t.tokens() as u64 + self.attn_flops_per_pair * pairs;
        (bytes, flops)
    }
}

use crate::stepper::{fresh_seqs, Stepper};

/// One run of a test from an empty cache; returns the timed nanoseconds.
fn run_once(
    exec: &mut dyn Executor,
    st: &mut Stepper,
    t: &TestSpec,
    rng: &mut impl Rng,
) -> Result<u64> {
    let bs = exec.kv_spec().block_size;
    let vocab = exec.vocab_size() as u32;
    let mut seqs = fresh_seqs(t.n_seqs, t.n_depth + t.n_prompt + t.n_gen, bs);
    for s in seqs.iter_mut() {
        st.prefill(exec, s, t.n_depth, rng)?;
    }
    let gen: Vec<Vec<u32>> = (0..t.n_gen)
        .map(|_| (0..t.n_seqs).map(|_| rng.random_range(0..vocab)).collect())
        .collect();
    let t0 = Instant::now();
    if t.n_prompt > 0 {
        st.prefill(exec, &mut seqs[0], t.n_prompt, rng)?;
    }
    if t.chain > 0 && t.n_gen > 0 {
        let mut next = gen[0].clone();
        let mut left = t.n_gen;
        while left > 0 {
            let k = left.min(t.chain);
            next = st.chain(exec, &mut seqs, &next, k)?;
            left -= k;
        }
    } else {
        for step in &gen {
            let toks: Vec<&[u32]> = step.chunks(1).collect();
            st.step(exec, &mut seqs, &toks)?;
        }
    }
    Ok(t0.elapsed().as_nanos() as u64)
}

/// llama-bench runs tests past the model's trained context (RoPE extends to any position), and
/// so does quire: the cache is sized for depth + test. A warning says that such a test measures
/// speed at a length the model was not trained for.
fn warn_past_context(tests: &[TestSpec], ctx: usize) {
    if let Some(t) = tests
        .iter()
        .filter(|t| t.n_depth + t.n_prompt + t.n_gen > ctx)
        .max_by_key(|t| t.n_depth + t.n_prompt + t.n_gen)
    {
        eprintln!(
            "warning: {} reaches {} tokens, past the model's trained context of {ctx}; \
             it runs (as llama-bench does), but the model was not trained for such positions",
            t.name(),
            t.n_depth + t.n_prompt + t.n_gen
        );
    }
}

fn parse_list(v: &[String], what: &str) -> Result<Vec<usize>> {
    v.iter()
        .filter(|s| s.as_str() != "g")
        .map(|s| {
            s.trim()
                .parse::<usize>()
                .with_context(|| format!("{what}: '{s}' is not a number"))
        })
        .collect()
}

/// The test matrix of one model and thread count, in llama-bench's order.
pub fn test_matrix(a: &BenchArgs) -> Result<Vec<TestSpec>> {
    let mut prompts = parse_list(&a.n_prompt, "-p")?;
    // `-pg 512,128` arrives as `-p g` plus a positional value.
    let n_pg_short = a.n_prompt.iter().filter(|s| s.as_str() == "g").count();
    if n_pg_short != a.pg_values.len() {
        bail!("unexpected arguments {:?} (write -pg PP,TG)", a.pg_values);
    }
    if prompts.is_empty() && n_pg_short > 0 {
        prompts.push(512);
    }
    let gens = parse_list(&a.n_gen, "-n")?;
    let mut pgs = Vec::new();
    for v in a.pg.iter().chain(&a.pg_values) {
        let (p, g) = v
            .split_once(',')
            .with_context(|| format!("-pg wants PP,TG (got '{v}')"))?;
        pgs.push((
            parse_list(&[p.into()], "-pg")?[0],
            parse_list(&[g.into()], "-pg")?[0],
        ));
    }
    let mut tests = Vec::new();
    for &d in &a.depth {
        let one = |p, g| TestSpec {
            n_prompt: p,
            n_gen: g,
            n_depth: d,
            n_seqs: 1,
            batched: false,
            chain: 0,
        };
        tests.extend(prompts.iter().filter(|&&p| p > 0).map(|&p| one(p, 0)));
        tests.extend(gens.iter().filter(|&&g| g > 0).map(|&g| one(0, g)));
        tests.extend(pgs.iter().map(|&(p, g)| one(p, g)));
        for &b in &a.batch {
            if b == 0 {
                bail!("-b: batch sizes must be at least 1");
            }
            for &g in gens.iter().filter(|&&g| g > 0) {
                tests.push(TestSpec {
                    n_seqs: b,
                    batched: true,
                    ..one(0, g)
                });
            }
        }
    }
    if let Some(k) = a.chain {
        let chained: Vec<TestSpec> = tests
            .iter()
            .filter(|t| t.n_gen > 0)
            .map(|t| TestSpec {
                chain: k as usize,
                ..*t
            })
            .collect();
        tests.extend(chained);
    }
    Ok(tests)
}

/// What one model contributes to every record.
struct ModelInfo {
    filename: String,
    model_type: String,
    size: u64,
    n_params: u64,
    weight_type: String,
    costs: ModelCosts,
    /// Reading the file and building the first executor (weights on the device), milliseconds.
    load_ms: f64,
}

/// Peak memory when a record is written: host RSS of the process and the executor's device memory.
#[derive(Debug, Clone, Copy)]
struct Peaks {
    rss: Option<u64>,
    gpu: Option<u64>,
}

#[allow(clippy::too_many_arguments)]
fn record(
    m: &ModelInfo,
    t: &TestSpec,
    threads: usize,
    a: &BenchArgs,
    stamp: &RunStamp,
    roofs: &Roofs,
    gpu_info: &str,
    test_time: String,
    samples_ns: &[u64],
    peaks: Peaks,
) -> Map<String, Value> {
    let ns: Vec<f64> = samples_ns.iter().map(|&x| x as f64).collect();
    let ts: Vec<f64> = ns.iter().map(|&x| t.tokens() as f64 * 1e9 / x).collect();
    let (sn, st) = (Summary::of(&ns), Summary::of(&ts));
    let (bytes, flops) = m.costs.run_cost(t);
    let weights_per_run = (m.costs.weight_bytes * t.forwards() as u64) as f64;
    let (pct, bound) = roofs.pct_of_ceiling(bytes as f64, flops as f64, sn.mean);
    let v = json!({
        "build_commit": stamp.commit,
        "cpu_info": stamp.cpu,
        "gpu_info": gpu_info,
        "backends": if a.backend == "cpu" { "CPU".to_string() } else { a.backend.to_uppercase() },
        "model_filename": m.filename,
        "model_type": m.model_type,
        "model_size": m.size,
        "model_n_params": m.n_params,
        "n_batch": CHUNK,
        "n_ubatch": CHUNK,
        "n_threads": threads,
        "type_k": a.kv_dtype,
        "type_v": a.kv_dtype,
        "n_prompt": t.n_prompt,
        "n_gen": t.n_gen,
        "n_depth": t.n_depth,
        "test_time": test_time,
        "avg_ns": sn.mean.round() as u64,
        "stddev_ns": sn.stddev.round() as u64,
        "avg_ts": st.mean,
        "stddev_ts": st.stddev,
        "samples_ns": samples_ns,
        "samples_ts": ts,
    });
    let ours = json!({
        "test": t.name(),
        "n_seqs": t.n_seqs,
        "per_seq_ts": st.mean / t.n_seqs as f64,
        "median_ts": st.median,
        "p10_ts": st.p10,
        "p90_ts": st.p90,
        "gbps": weights_per_run / sn.mean,
        "gbps_with_kv": bytes as f64 / sn.mean,
        "tflops": 2.0 * m.n_params as f64 * t.tokens() as f64 / sn.mean / 1e3,
        "bytes": bytes,
        "flops": flops,
        "intensity": flops as f64 / bytes as f64,
        "pct_of_ceiling": pct,
        "ceiling": bound,
        "pct_of_bw": 100.0 * bytes as f64 / sn.mean / roofs.mem_bw_gbps,
        "pct_of_peak": roofs.compute.as_ref().map(|(p, _)| 100.0 * flops as f64 / sn.mean / p),
        "device": stamp.cpu,
        "driver": stamp.os,
        "cpu_features": stamp.cpu_features,
        "cores": stamp.cores,
        "load_avg": stamp.load_avg,
        "block_size": a.block_size,
        "kv_dtype": a.kv_dtype,
        "cpu_math": (a.backend == "cpu").then_some(&a.cpu_math),
        "tensor_parallel_size": (a.tensor_parallel_size > 1).then_some(a.tensor_parallel_size),
        "repetitions": a.reps,
        "seed": a.seed,
        "weight_type": m.weight_type,
        "quire_version": stamp.quire_version,
        "load_ms": m.load_ms,
        "peak_rss_bytes": peaks.rss,
        "peak_gpu_bytes": peaks.gpu,
        "quire_env": stamp.env.join(" "),
    });
    let mut out = Map::new();
    for part in [v, ours] {
        if let Value::Object(o) = part {
            out.extend(o);
        }
    }
    out
}

pub fn run(a: BenchArgs) -> Result<()> {
    if let Some(spec) = &a.spec {
        return crate::spec_bench::run(&a, spec);
    }
    if let Some(schema) = &a.json.json_schema {
        return crate::json_bench::run(&a, schema);
    }
    let format: Format = a.output.parse()?;
    if a.reps == 0 {
        bail!("-r must be at least 1");
    }
    if !matches!(a.block_size, 16 | 32 | 64 | 128) {
        bail!("--block-size must be 16, 32, 64 or 128");
    }
    let tests = test_matrix(&a)?;
    if tests.is_empty() {
        bail!("nothing to run: every -p and -n is 0 and no -pg was given");
    }
    let all = std::thread::available_parallelism().map_or(1, |n| n.get());
    let threads_list = if a.threads.is_empty() {
        vec![all]
    } else {
        a.threads.clone()
    };
    if threads_list.contains(&0) {
        bail!("-t: thread counts must be at least 1");
    }
    let models: Vec<Option<PathBuf>> = if a.models.is_empty() {
        vec![None]
    } else {
        a.models.iter().cloned().map(Some).collect()
    };
    let stamp = RunStamp::collect();
    if let Some(w) = stamp.busy_warning() {
        eprintln!("{w}");
    }
    let gpu = gpu_roofs(&a)?;
    let total = models.len() * threads_list.len() * tests.len() * (a.reps + 1);
    let bar = indicatif::ProgressBar::new(total as u64);
    bar.set_style(
        indicatif::ProgressStyle::with_template("{bar:30} {pos}/{len} runs  {msg}  eta {eta}")
            .expect("static template"),
    );
    let mut records = Vec::new();
    let mut ceil_lines = Vec::new();
    let mut st = Stepper::default();
    for m in &models {
        let margs = ModelArgs {
            model: m.clone(),
            backend: a.backend.clone(),
            threads: None,
            gpu_memory_utilization: 0.9,
            gpu_weights: a.gpu_weights.clone(),
            adapter: a.adapter.clone(),
            cpu_math: a.cpu_math.clone(),
            tensor_parallel_size: a.tensor_parallel_size,
        };
        let t_load = Instant::now();
        let model = bar.suspend(|| load_model(&margs))?;
        let file_ms = t_load.elapsed().as_secs_f64() * 1e3;
        bar.suspend(|| warn_past_context(&tests, model.weights.config.max_position_embeddings));
        let mut info = ModelInfo {
            filename: model.meta.path.clone(),
            model_type: model.meta.model_type.clone(),
            size: model.weight_bytes(),
            n_params: model.meta.n_params,
            weight_type: model.meta.weight_type.clone(),
            costs: ModelCosts::of(&model, &a.kv_dtype),
            load_ms: file_ms,
        };
        let kv = KvCacheSpec {
            num_blocks: tests
                .iter()
                .map(|t| t.blocks(a.block_size))
                .max()
                .unwrap_or(1),
            block_size: a.block_size,
        };
        for &th in &threads_list {
            let (roofs, line, gpu_info) = match &gpu {
                Some((roofs, line, device)) => (roofs.clone(), line.clone(), device.as_str()),
                None => {
                    let ceil = bar.suspend(|| crate::roofline::ceilings_for(th))?;
                    let (peak, label) = ceil.compute_gflops(&info.weight_type);
                    let line = format!(
                        "ceilings ({th} threads): memory {:.2} GB/s, {label} {peak:.1} GOP/s, fp32 {:.1} GFLOP/s",
                        ceil.mem_bw_gbps, ceil.fp32_gflops
                    );
                    (Roofs::cpu(&ceil, &info.weight_type), line, "")
                }
            };
            if !ceil_lines.contains(&line) {
                ceil_lines.push(line);
            }
            let margs = ModelArgs {
                threads: Some(th),
                ..margs.clone()
            };
            let t_exec = Instant::now();
            let mut exec = executor(&model, &margs, kv, &a.kv_dtype)?;
            if th == threads_list[0] {
                info.load_ms = file_ms + t_exec.elapsed().as_secs_f64() * 1e3;
            }
            for t in &tests {
                bar.set_message(format!("{} ({th} threads)", t.name()));
                let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
                // On a GPU tests warm up whole, depth included: it captures a decode graph per
                // context bound (64, 128, 256, ... keys) and per chain length, which must not
                // land in a timed run. The CPU has no graphs: one token and no depth will do.
                let warm = match gpu {
                    Some(_) => *t,
                    None => TestSpec {
                        n_gen: if t.chain > 0 { t.n_gen } else { t.n_gen.min(1) },
                        n_depth: 0,
                        ..*t
                    },
                };
                run_once(exec.as_mut(), &mut st, &warm, &mut rng)
                    .with_context(|| format!("{} warm-up", t.name()))?;
                bar.inc(1);
                let test_time = quire_perf::stamp::rfc3339_utc(std::time::SystemTime::now());
                let mut samples = Vec::with_capacity(a.reps);
                for _ in 0..a.reps {
                    samples.push(run_once(exec.as_mut(), &mut st, t, &mut rng)?);
                    bar.inc(1);
                }
                let peaks = Peaks {
                    rss: mem::peak_rss_bytes(),
                    gpu: exec.device_memory_peak(),
                };
                records.push(record(
                    &info, t, th, &a, &stamp, &roofs, gpu_info, test_time, &samples, peaks,
                ));
            }
        }
    }
    bar.finish_and_clear();
    let out = match format {
        Format::Md => markdown(&records, &stamp, &ceil_lines),
        Format::Csv => records_csv(&records),
        Format::Json => records_json(&records),
        Format::Jsonl => records_jsonl(&records),
    };
    print!("{out}");
    Ok(())
}

/// The GPU's roofs, measured once (the CPU's are measured per thread count: `None` here), with
/// the report's line and the device's name: for CUDA the copy bandwidth and the chip's tensor
/// peak, for wgpu the adapter's read bandwidth alone (its matrix peak is measured by `quire
/// roofline --backend wgpu`, too slow to repeat here, so the % columns compare with memory only).
fn gpu_roofs(a: &BenchArgs) -> Result<Option<(Roofs, String, String)>> {
    match a.backend.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => {
            let g = crate::gpu_ceilings::GpuCeilings::measure()?;
            let (mut roofs, mut line) = (g.roofs(), g.line());
            let n = a.tensor_parallel_size;
            if n > 1 {
                // N GPUs read their shares at once: the roofs are N times one GPU's.
                roofs.mem_bw_gbps *= n as f64;
                if let Some((peak, _)) = &mut roofs.compute {
                    *peak *= n as f64;
                }
                line = format!("{line}; x{n} GPUs (tensor parallel)");
            }
            Ok(Some((roofs, line, g.device)))
        }
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            let mut p = quire_backend::wgpu::probe::Probe::new(a.adapter.as_deref())?;
            let g = crate::wgpu_ceilings::WgpuCeilings::measure(&mut p)?;
            let roofs = Roofs {
                mem_bw_gbps: g.read_gbps,
                compute: None,
            };
            let line = format!("{}; no matrix peak here: % of memory only", g.line());
            Ok(Some((roofs, line, g.adapter)))
        }
        _ => Ok(None),
    }
}
