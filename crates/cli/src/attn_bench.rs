//! `quire attn-bench`: the paged attention kernel on its own. It builds random sequences whose KV
//! blocks are scattered over a shared pool (quire-testkit's generator, the one the attention tests
//! use: shuffled block ids, every unused slot NaN-poisoned so a wrong read cannot go unnoticed),
//! checks the kernel against the dense f64 reference, then times every dispatch of the paged
//! kernel and of a dense one (the same batch with each sequence's blocks consecutive, same
//! online-softmax algorithm and work split), so the cost of paging is the difference between the
//! two. One CSV row per dispatch; the summary separates the first (cold)
//! dispatches from the steady state.

use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use half::f16;
use quire_backend::cpu::attention::{dense_reference, paged_attention_math, AttnParams, KvElem};
use quire_backend::cpu::CpuMath;
use quire_backend::SeqBatch;
use quire_perf::output::csv_line;
use quire_perf::{RunStamp, Summary, Table};
use quire_testkit::paged::{CacheElem, PagedBatch, PagedCase, PagedSeq};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use rayon::prelude::*;

/// Dispatches counted as cold in the summary.
const COLD: usize = 5;

#[derive(Args, Debug)]
pub struct AttnBenchArgs {
    /// Sequences per dispatch
    #[arg(long, default_value_t = 16)]
    pub batch: usize,
    /// Query heads
    #[arg(long, default_value_t = 16)]
    pub q_heads: usize,
    /// KV heads (grouped-query attention when fewer than query heads)
    #[arg(long, default_value_t = 8)]
    pub kv_heads: usize,
    #[arg(long, default_value_t = 128)]
    pub head_dim: usize,
    /// Tokens per KV block
    #[arg(long, default_value_t = 32)]
    pub block_size: usize,
    /// Blocks reserved per sequence (the pool holds batch × max-blocks blocks)
    #[arg(long, default_value_t = 64)]
    pub max_blocks: usize,
    /// Blocks each sequence fills (its context is active-blocks × block-size tokens)
    #[arg(long, default_value_t = 32)]
    pub active_blocks: usize,
    /// Timed dispatches per kernel
    #[arg(long, default_value_t = 256)]
    pub repeats: usize,
    /// KV-cache storage type: float16, float32 or bfloat16
    #[arg(long, default_value = "float16")]
    pub dtype: String,
    /// Round Q and the V accumulator to f16 (llama.cpp's CPU flash-attention numerics); default:
    /// f32 math on f16 storage
    #[arg(long)]
    pub f16_accum: bool,
    /// decode: one new token per sequence; prefill: a chunk of --query-len tokens per sequence
    #[arg(long, default_value = "decode", value_parser = ["decode", "prefill"])]
    pub mode: String,
    /// New tokens per sequence in prefill mode
    #[arg(long, default_value_t = 32)]
    pub query_len: usize,
    /// Compute backend
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    pub backend: String,
    /// CPU arithmetic, as in the engine commands: `fast` (the default) times the kernel every
    /// engine step uses by default (vectorized over keys, split over the threads); `exact` times
    /// llama.cpp's arithmetic (with --f16-accum, its f16 accumulator)
    #[arg(long, default_value = "fast", value_parser = ["exact", "fast"])]
    pub cpu_math: String,
    /// wgpu: the adapter, by its index in `quire adapters` or a substring of its name
    #[arg(long)]
    pub adapter: Option<String>,
    /// Threads [default: all cores]
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
    /// Write one row per dispatch to this CSV file (settings and stamp go to FILE.meta.json)
    #[arg(long)]
    pub csv: Option<PathBuf>,
}

/// bfloat16 KV storage for this benchmark. The kernel is generic over the storage type; quire's
/// KV cache itself offers f32 and f16 only, and AVX2 has no bf16 arithmetic (values widen to f32
/// by a 16-bit shift), so this measures the kernel, not an engine configuration.
#[derive(Clone, Copy)]
struct Bf16(half::bf16);

impl KvElem for Bf16 {
    #[inline(always)]
    fn to_f32(self) -> f32 {
        self.0.to_f32()
    }
    #[inline(always)]
    fn from_f32(v: f32) -> Self {
        Bf16(half::bf16::from_f32(v))
    }
    const NAME: &'static str = "bf16";
    fn as_f16(_: &[Self]) -> Option<&[half::f16]> {
        None
    }
}

impl CacheElem for Bf16 {
    fn from_f32(x: f32) -> Self {
        <Self as KvElem>::from_f32(x)
    }
    fn to_f32(self) -> f32 {
        <Self as KvElem>::to_f32(self)
    }
}

/// The batch's sequences as the kernels take them.
pub(crate) fn seq_batches(seqs: &[PagedSeq]) -> Vec<SeqBatch<'_>> {
    seqs.iter()
        .map(|s| SeqBatch {
            query_start: s.query_start,
            query_len: s.query_len,
            seq_len: s.seq_len,
            block_table: &s.block_table,
        })
        .collect()
}

/// The random batch every attn-bench dispatch runs (quire-testkit's generator, as the attention
/// tests use): `batch` sequences of `seq_len` tokens, the last `qlen` of them new, each taking
/// its blocks from a shuffled pool of batch × max-blocks (the rest spare, every unused slot NaN).
pub(crate) fn bench_batch<T: CacheElem>(
    a: &AttnBenchArgs,
    qlen: usize,
    rng: &mut StdRng,
) -> PagedBatch<T> {
    let seq_len = a.active_blocks * a.block_size;
    let seqs = vec![(seq_len - qlen, qlen); a.batch];
    PagedCase {
        spare_blocks: a.batch * (a.max_blocks - a.active_blocks),
        ..PagedCase::new(a.block_size, a.kv_heads * a.head_dim, &seqs)
    }
    .generate(rng)
}

/// One dispatch of the CPU kernel over `g`: the paged layout, or its contiguous copy for the
/// dense run (same kernel, same work split, so paged / dense is the cost of the block tables).
fn kernel<'a, T: KvElem>(
    pool: &'a rayon::ThreadPool,
    math: CpuMath,
    p: &'a AttnParams,
    q: &'a [f32],
    g: &'a mut PagedBatch<T>,
) -> impl FnMut(&mut [f32]) + 'a {
    let PagedBatch {
        seqs,
        slot_mapping,
        k_new,
        v_new,
        k_cache,
        v_cache,
        kv_row,
        ..
    } = g;
    let sb = seq_batches(seqs);
    let q_row = p.num_heads * p.head_dim;
    move |out: &mut [f32]| {
        paged_attention_math(
            pool,
            math,
            p,
            q,
            q_row,
            k_new,
            v_new,
            *kv_row,
            slot_mapping,
            &sb,
            k_cache,
            v_cache,
            out,
        )
    }
}

/// (max absolute error, max absolute error ÷ max |reference|); NaN when any output is NaN.
fn errors(out: &[f32], reference: &[f64]) -> (f64, f64) {
    let mut abs = 0f64;
    let mut scale = 0f64;
    for (&o, &r) in out.iter().zip(reference) {
        let e = (o as f64 - r).abs();
        if e.is_nan() {
            return (f64::NAN, f64::NAN);
        }
        abs = abs.max(e);
        scale = scale.max(r.abs());
    }
    (abs, abs / scale.max(f64::MIN_POSITIVE))
}

fn check(a: &AttnBenchArgs) -> Result<()> {
    if a.backend != "cpu" {
        bail!("backend {} was not built into this binary", a.backend);
    }
    if a.batch == 0 || a.q_heads == 0 || a.kv_heads == 0 || a.head_dim == 0 || a.repeats == 0 {
        bail!("--batch, --q-heads, --kv-heads, --head-dim and --repeats must be at least 1");
    }
    if !a.q_heads.is_multiple_of(a.kv_heads) || a.q_heads / a.kv_heads > 16 {
        bail!("--q-heads must be a multiple of --kv-heads, at most 16 per KV head");
    }
    if a.block_size == 0 || a.block_size * (a.q_heads / a.kv_heads) > 2048 {
        bail!("--block-size × (q-heads / kv-heads) must be between 1 and 2048");
    }
    if a.active_blocks == 0 || a.active_blocks > a.max_blocks {
        bail!("--active-blocks must be between 1 and --max-blocks");
    }
    if a.mode == "prefill" && (a.query_len == 0 || a.query_len > a.active_blocks * a.block_size) {
        bail!("--query-len must be between 1 and active-blocks × block-size");
    }
    Ok(())
}

/// One CSV row per timed dispatch: the settings columns, then kernel, time and rates (shared by
/// the CPU and CUDA paths, so both files have one layout).
pub(crate) fn dispatch_csv(
    settings: &[(&str, String)],
    times: &[(&str, Vec<f64>)],
    bytes: u64,
    flops: u64,
) -> String {
    let tail = ["kernel", "time_ms", "bytes", "gbps", "flops", "intensity"];
    let header: Vec<&str> = settings.iter().map(|(k, _)| *k).chain(tail).collect();
    let mut text = csv_line(&header);
    for (name, ms) in times {
        for &t in ms {
            let mut row: Vec<String> = settings.iter().map(|(_, v)| v.clone()).collect();
            row.extend([
                name.to_string(),
                format!("{t:.6}"),
                bytes.to_string(),
                format!("{:.4}", bytes as f64 / (t * 1e6)),
                flops.to_string(),
                format!("{:.4}", flops as f64 / bytes as f64),
            ]);
            text += &csv_line(&row);
        }
    }
    text
}

pub fn run(a: AttnBenchArgs) -> Result<()> {
    if a.backend == "wgpu" {
        #[cfg(feature = "wgpu")]
        return crate::attn_bench_wgpu::run(&a);
        #[cfg(not(feature = "wgpu"))]
        bail!("backend wgpu was not built into this binary (build with `cargo build --release --features wgpu`)");
    }
    if a.backend == "cuda" {
        #[cfg(feature = "cuda")]
        return crate::attn_bench_cuda::run(&a);
        #[cfg(not(feature = "cuda"))]
        bail!("backend cuda was not built into this binary (build with `cargo build --release --features cuda`)");
    }
    check(&a)?;
    match a.dtype.to_ascii_lowercase().as_str() {
        "float16" | "f16" | "half" => bench::<f16>(&a, "float16"),
        "float32" | "f32" | "float" => bench::<f32>(&a, "float32"),
        "bfloat16" | "bf16" => {
            eprintln!(
                "note: quire's KV cache offers f32 and f16 only; bfloat16 here is the generic kernel \
                 with bf16 storage (no bf16 arithmetic on AVX2: values widen to f32 by a shift)"
            );
            bench::<Bf16>(&a, "bfloat16")
        }
        other => bail!("--dtype {other}: use float16, float32 or bfloat16"),
    }
}

fn bench<T: KvElem + CacheElem>(a: &AttnBenchArgs, dtype: &str) -> Result<()> {
    let stamp = RunStamp::collect();
    if let Some(w) = stamp.busy_warning() {
        eprintln!("{w}");
    }
    let threads = a
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()))
        .max(1);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .context("thread pool")?;
    let mut rng = StdRng::seed_from_u64(a.seed);
    let (b, d, bs) = (a.batch, a.head_dim, a.block_size);
    let kv_row = a.kv_heads * d;
    let q_row = a.q_heads * d;
    let seq_len = a.active_blocks * bs;
    let qlen = if a.mode == "prefill" { a.query_len } else { 1 };
    let tokens = b * qlen;
    let p = AttnParams {
        num_heads: a.q_heads,
        num_kv_heads: a.kv_heads,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        f16_accum: a.f16_accum,
        sliding_window: None,
    };
    let mut paged_batch = bench_batch::<T>(a, qlen, &mut rng);
    let mut dense_batch = paged_batch.contiguous();
    let pool_blocks = paged_batch.num_blocks;
    let q: Vec<f32> = (0..tokens * q_row)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let mut out = vec![0f32; tokens * q_row];

    // Parity against the f64 reference, sequence by sequence.
    let reference: Vec<f64> = (0..b)
        .into_par_iter()
        .flat_map_iter(|i| {
            let qs = &q[i * qlen * q_row..(i + 1) * qlen * q_row];
            let s = &paged_batch.seqs[i];
            dense_reference(&p, qs, &s.keys, &s.values, seq_len)
        })
        .collect();
    let math: CpuMath = a.cpu_math.parse().unwrap_or_default();
    let mut paged = kernel(&pool, math, &p, &q, &mut paged_batch);
    let mut dense = kernel(&pool, math, &p, &q, &mut dense_batch);
    let mut parity = Vec::new();
    for (name, kernel) in [
        ("paged", &mut paged as &mut dyn FnMut(&mut [f32])),
        ("dense", &mut dense),
    ] {
        out.fill(f32::NAN);
        kernel(&mut out);
        let (abs, rel) = errors(&out, &reference);
        // f16 accumulator: f16 precision (2^-11 per rounding), as the backend tests allow.
        let ok = rel < if a.f16_accum { 2e-2 } else { 1e-4 };
        println!(
            "parity {name} vs dense f64 reference ({dtype} KV, {} outputs): max abs err {abs:.3e}, max rel err {rel:.3e} — {}",
            out.len(),
            if ok { "OK" } else { "FAILED" }
        );
        parity.push((name, abs, rel, ok));
    }
    if parity.iter().any(|x| !x.3) {
        bail!("attention output differs from the reference (NaN means a poisoned slot was read)");
    }

    // Timing: every dispatch of one kernel, then the other.
    let elem = std::mem::size_of::<T>();
    let kv_bytes = (b * seq_len * 2 * kv_row * elem) as u64;
    let bytes = kv_bytes + (tokens * (2 * kv_row * (elem + 4) + 2 * q_row * 4)) as u64;
    let pairs: usize = (0..qlen).map(|i| seq_len - qlen + i + 1).sum::<usize>() * b;
    let flops = (4 * pairs * q_row) as u64;
    let mut times: Vec<(&str, Vec<f64>)> = Vec::new();
    for (name, kernel) in [
        ("paged", &mut paged as &mut dyn FnMut(&mut [f32])),
        ("dense", &mut dense),
    ] {
        let mut ms = Vec::with_capacity(a.repeats);
        for _ in 0..a.repeats {
            let t0 = Instant::now();
            kernel(&mut out);
            ms.push(t0.elapsed().as_secs_f64() * 1e3);
        }
        std::hint::black_box(&out);
        times.push((name, ms));
    }

    if let Some(path) = &a.csv {
        let text = dispatch_csv(
            &[
                ("tokens", tokens.to_string()),
                ("seq_len", seq_len.to_string()),
                ("heads", a.q_heads.to_string()),
                ("kv_heads", a.kv_heads.to_string()),
                ("head_dim", d.to_string()),
                ("block_size", bs.to_string()),
                ("threads", threads.to_string()),
            ],
            &times,
            bytes,
            flops,
        );
        std::fs::write(path, text).with_context(|| format!("cannot write {}", path.display()))?;
        let meta = path.with_extension("meta.json");
        let info = serde_json::json!({
            "stamp": stamp,
            "settings": {
                "batch": b, "q_heads": a.q_heads, "kv_heads": a.kv_heads, "head_dim": d,
                "block_size": bs, "max_blocks": a.max_blocks, "active_blocks": a.active_blocks,
                "repeats": a.repeats, "dtype": dtype, "mode": a.mode, "query_len": qlen,
                "threads": threads, "seed": a.seed, "backend": a.backend, "cpu_math": a.cpu_math,
            },
            "parity": parity.iter().map(|(n, abs, rel, _)| serde_json::json!({
                "kernel": n, "max_abs_err": abs, "max_rel_err": rel})).collect::<Vec<_>>(),
        });
        std::fs::write(&meta, serde_json::to_string_pretty(&info)? + "\n")
            .with_context(|| format!("cannot write {}", meta.display()))?;
        eprintln!(
            "wrote {} ({} rows) and {}",
            path.display(),
            2 * a.repeats,
            meta.display()
        );
    }

    println!(
        "\n{} mode: {b} seqs × {qlen} new tokens, context {seq_len} ({} blocks of {bs} scattered over {pool_blocks}), \
         {} q / {} kv heads × {d}, {dtype} KV, {} CPU math, {threads} threads, {} dispatches per kernel",
        a.mode, a.active_blocks, a.q_heads, a.kv_heads, a.cpu_math, a.repeats
    );
    println!(
        "per dispatch: {:.2} MiB moved ({:.2} MiB of KV), {:.3} GFLOP, intensity {:.2} FLOP/B\n",
        bytes as f64 / (1 << 20) as f64,
        kv_bytes as f64 / (1 << 20) as f64,
        flops as f64 / 1e9,
        flops as f64 / bytes as f64
    );
    let cols = [
        "kernel",
        "median ms",
        "p10 ms",
        "p90 ms",
        "cold ms",
        "steady median ms",
        "steady p90 ms",
        "GB/s",
        "GFLOP/s",
    ];
    let mut t = Table::new(&cols, &cols[1..]);
    let mut steady_medians = Vec::new();
    for (name, ms) in &times {
        let all = Summary::of(ms);
        let cold = Summary::of(&ms[..COLD.min(ms.len())]);
        let steady = Summary::of(if ms.len() > COLD { &ms[COLD..] } else { ms });
        steady_medians.push(steady.median);
        t.push(vec![
            name.to_string(),
            format!("{:.3}", all.median),
            format!("{:.3}", all.p10),
            format!("{:.3}", all.p90),
            format!("{:.3}", cold.mean),
            format!("{:.3}", steady.median),
            format!("{:.3}", steady.p90),
            format!("{:.2}", bytes as f64 / (steady.median * 1e6)),
            format!("{:.2}", flops as f64 / (steady.median * 1e6)),
        ]);
    }
    print!("{}", t.markdown());
    println!(
        "\ncold = mean of the first {COLD} dispatches; steady = dispatches {}..{}. paged / dense steady median: {:.3}×",
        COLD + 1,
        a.repeats,
        steady_medians[0] / steady_medians[1]
    );
    println!("{}", stamp.line());
    Ok(())
}
