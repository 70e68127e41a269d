//! `quire profile`: where one prefill and one decode step spend their time. The executor's
//! per-op timers (on only for the profiled step) give calls, time, bytes and FLOPs per op and per
//! layer; each op is then placed against this machine's ceilings (memory- or compute-bound, and
//! how close to its roof it runs). Steps are repeated and the median step (by wall time) is
//! reported, so one preempted run does not decide the picture.

use std::collections::BTreeMap;
use std::path::PathBuf;
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_backend::{Executor, KvCacheSpec, OpStat};
use quire_perf::output::csv_line;
use quire_perf::{Ceilings, RunStamp, Summary, Table};
use rand::{Rng, SeedableRng};
use serde_json::{json, Value};

use crate::common::{executor, load_model, ModelArgs};
use crate::stepper::{fresh_seqs, Stepper};

#[derive(Args, Debug)]
pub struct ProfileArgs {
    #[command(flatten)]
    pub model: ModelArgs,
    /// Prompt tokens of the profiled prefill (one forward)
    #[arg(short = 'p', long = "n-prompt", default_value_t = 512)]
    pub n_prompt: usize,
    /// Context depth of the profiled decode step
    #[arg(short = 'd', long = "n-depth", default_value_t = 512)]
    pub depth: usize,
    /// Also profile a mixed step: the prompt of -p tokens beside this many decode rows, each at
    /// depth -d, in one forward (as a server's steps are under load). 0: no mixed step
    #[arg(long, default_value_t = 0)]
    pub mixed_rows: usize,
    /// Repetitions of each step (the median step is reported)
    #[arg(short = 'r', long = "repetitions", default_value_t = 5)]
    pub reps: usize,
    /// Write per-op, per-layer rows of the median steps to this CSV file
    #[arg(long)]
    pub csv: Option<PathBuf>,
    /// Print the report as JSON (for `quire roofline`) instead of tables
    #[arg(long)]
    pub json: bool,
    /// KV-cache storage type (f16, the engine default)
    #[arg(long, default_value = "f16", value_parser = ["f32", "f16"])]
    pub kv_dtype: String,
    /// Tokens per KV-cache block
    #[arg(long, default_value_t = 16)]
    pub block_size: usize,
    /// Seed of the random tokens
    #[arg(long, default_value_t = 1)]
    pub seed: u64,
}

/// One op (or one op of one layer) of a step, with its derived rates.
struct Row {
    op: String,
    layer: Option<usize>,
    calls: u64,
    total_ns: u64,
    bytes: u64,
    flops: u64,
}

struct Phase {
    name: &'static str,
    tokens: usize,
    depth: usize,
    /// Decode rows at `depth` beside the prompt (a mixed step), else 0.
    rows: usize,
    samples_ns: Vec<u64>,
    step_ns: u64,
    layers: Vec<Row>,
    ops: Vec<Row>,
    /// How the executor measured the ops, where it says.
    note: Option<String>,
}

/// The roofs ops are placed under: the device's memory bandwidth and compute peaks (GOP/s) for
/// the layers' matrix products, the output projection and every other op; `None`: no compute
/// peak known, the op sits under the memory roof alone.
struct OpRoofs {
    mem_bw_gbps: f64,
    matmul: Option<f64>,
    output: Option<f64>,
    other: Option<f64>,
    /// The header line naming them, and their JSON record.
    line: String,
    json: Value,
}

impl OpRoofs {
    /// The CPU's (`quire roofline`): quantized matrix products under the kernel rate of the
    /// weight type, everything else under the FP32 peak.
    fn cpu(c: &Ceilings, wt: &WeightTypes, threads: usize) -> OpRoofs {
        let (peak, label) = c.compute_gflops(&wt.layers);
        let (opeak, olabel) = c.compute_gflops(&wt.output);
        OpRoofs {
            mem_bw_gbps: c.mem_bw_gbps,
            matmul: Some(peak),
            output: Some(opeak),
            other: Some(c.fp32_gflops),
            line: format!(
                "{threads} threads · ceilings: memory {:.2} GB/s, {label} {peak:.1} GOP/s \
                 (output: {olabel} {opeak:.1} GOP/s), fp32 {:.1} GFLOP/s",
                c.mem_bw_gbps, c.fp32_gflops
            ),
            json: json!({
                "mem_bw_gbps": c.mem_bw_gbps,
                "fp32_gflops": c.fp32_gflops,
                "quant_gops": c.quant_gops,
            }),
        }
    }

    /// The GPU's (`gpu_ceilings`): measured copy bandwidth; matrix products and attention (tensor
    /// cores in prefill) under the f16 tensor peak when the chip is known; the elementwise ops
    /// under memory alone.
    #[cfg(feature = "cuda")]
    fn gpu(g: &crate::gpu_ceilings::GpuCeilings) -> OpRoofs {
        let t = g.tensor_gflops();
        OpRoofs {
            mem_bw_gbps: g.copy_gbps,
            matmul: t,
            output: t,
            other: None,
            line: g.line(),
            json: json!({
                "device": g.device,
                "mem_bw_gbps": g.copy_gbps,
                "tensor_gflops": t,
            }),
        }
    }

    /// The wgpu adapter's (`wgpu_ceilings`): measured read bandwidth; no compute peak, so every
    /// op is placed against memory.
    #[cfg(feature = "wgpu")]
    fn wgpu(g: &crate::wgpu_ceilings::WgpuCeilings) -> OpRoofs {
        OpRoofs {
            mem_bw_gbps: g.read_gbps,
            matmul: None,
            output: None,
            other: None,
            line: g.line(),
            json: json!({
                "device": g.adapter,
                "driver": g.driver,
                "mem_bw_gbps": g.read_gbps,
                "gpu_timestamps": g.gpu_timestamps,
            }),
        }
    }

    fn peak_for(&self, op: &str) -> Option<f64> {
        if op == "output" {
            self.output
        } else if op.starts_with("matmul")
            || op == "moe"
            || op == "attention" && self.other.is_none()
        {
            self.matmul
        } else {
            self.other
        }
    }
}

/// Weight types of the layers' matrices and of the output projection (often different: tied
/// embeddings are usually stored at higher precision).
struct WeightTypes {
    layers: String,
    output: String,
}

fn derived(r: &Row, step_ns: u64, c: &OpRoofs) -> Value {
    let ns = r.total_ns.max(1) as f64;
    let intensity = if r.bytes > 0 {
        r.flops as f64 / r.bytes as f64
    } else {
        0.0
    };
    let mem_roof = c.mem_bw_gbps * intensity;
    let (bound, pct_roof) = match c.peak_for(&r.op) {
        Some(peak) if r.flops > 0 && mem_roof >= peak => {
            ("compute", 100.0 * (r.flops as f64 / ns) / peak)
        }
        _ => ("memory", 100.0 * (r.bytes as f64 / ns) / c.mem_bw_gbps),
    };
    json!({
        "op": r.op,
        "layer": r.layer,
        "calls": r.calls,
        "total_ns": r.total_ns,
        "mean_ns": r.total_ns as f64 / r.calls.max(1) as f64,
        "pct_of_step": 100.0 * r.total_ns as f64 / step_ns.max(1) as f64,
        "bytes": r.bytes,
        "flops": r.flops,
        "gbps": r.bytes as f64 / ns,
        "gflops": r.flops as f64 / ns,
        "intensity": intensity,
        "bound": bound,
        "pct_of_roof": pct_roof,
    })
}

fn aggregate(stats: &[OpStat]) -> (Vec<Row>, Vec<Row>) {
    let mut layers: Vec<Row> = stats
        .iter()
        .map(|s| Row {
            op: s.name.clone(),
            layer: s.layer,
            calls: s.calls,
            total_ns: s.total_ns,
            bytes: s.bytes,
            flops: s.flops,
        })
        .collect();
    layers.sort_by_key(|r| (r.layer.map_or(usize::MAX, |l| l), r.op.clone()));
    let mut by_op: BTreeMap<&str, Row> = BTreeMap::new();
    for s in stats {
        let e = by_op.entry(&s.name).or_insert_with(|| Row {
            op: s.name.clone(),
            layer: None,
            calls: 0,
            total_ns: 0,
            bytes: 0,
            flops: 0,
        });
        e.calls += s.calls;
        e.total_ns += s.total_ns;
        e.bytes += s.bytes;
        e.flops += s.flops;
    }
    let mut ops: Vec<Row> = by_op.into_values().collect();
    ops.sort_by_key(|r| std::cmp::Reverse(r.total_ns));
    (layers, ops)
}

/// What one profiled step holds: `tokens` new tokens of one sequence after `depth` cached ones,
/// and beside it (a mixed step) `rows` decode rows at depth `row_depth`.
struct StepShape {
    name: &'static str,
    tokens: usize,
    depth: usize,
    rows: usize,
    row_depth: usize,
}

/// Runs `reps` profiled steps of `shape` (every cached token filled once first, untimed; each
/// step then runs at the same depths again, over the same cache slots) and keeps the median one.
fn profile_phase(
    exec: &mut dyn Executor,
    st: &mut Stepper,
    shape: &StepShape,
    reps: usize,
    rng: &mut impl Rng,
) -> Result<Phase> {
    let &StepShape {
        name,
        tokens,
        depth,
        rows,
        row_depth,
    } = shape;
    let bs = exec.kv_spec().block_size;
    let vocab = exec.vocab_size() as u32;
    let mut runs: Vec<(u64, Vec<OpStat>)> = Vec::with_capacity(reps);
    let mut note = None;
    let mut seqs = fresh_seqs(1 + rows, (depth + tokens).max(row_depth + 1), bs);
    exec.set_profiling(false);
    st.prefill(exec, &mut seqs[0], depth, rng)?;
    for s in &mut seqs[1..] {
        st.prefill(exec, s, row_depth, rng)?;
    }
    for _ in 0..reps {
        seqs[0].len = depth;
        let toks: Vec<u32> = (0..tokens).map(|_| rng.random_range(0..vocab)).collect();
        let mut batch: Vec<Vec<u32>> = vec![toks];
        for s in &mut seqs[1..] {
            s.len = row_depth;
            batch.push(vec![rng.random_range(0..vocab)]);
        }
        let batch: Vec<&[u32]> = batch.iter().map(Vec::as_slice).collect();
        exec.take_profile();
        exec.set_profiling(true);
        let t0 = Instant::now();
        st.step(exec, &mut seqs, &batch)?;
        let ns = t0.elapsed().as_nanos() as u64;
        let ns = exec.profiled_step_ns().unwrap_or(ns);
        exec.set_profiling(false);
        runs.push((ns, exec.take_profile()));
        note = exec.profile_note();
    }
    let samples_ns: Vec<u64> = runs.iter().map(|r| r.0).collect();
    runs.sort_by_key(|r| r.0);
    let (step_ns, stats) = runs.swap_remove(runs.len() / 2);
    let (layers, ops) = aggregate(&stats);
    Ok(Phase {
        name,
        tokens: tokens + rows,
        depth: depth.max(row_depth),
        rows,
        samples_ns,
        step_ns,
        layers,
        ops,
        note,
    })
}

fn phase_table(p: &Phase, c: &OpRoofs) -> String {
    let cols = [
        "op",
        "calls",
        "total ms",
        "mean µs",
        "% step",
        "GB/s",
        "GFLOP/s",
        "FLOP/B",
        "bound",
        "% of roof",
    ];
    let mut t = Table::new(
        &cols,
        &cols[1..8]
            .iter()
            .chain(&cols[9..])
            .copied()
            .collect::<Vec<_>>(),
    );
    let mut covered = 0u64;
    for r in &p.ops {
        covered += r.total_ns;
        let d = derived(r, p.step_ns, c);
        let g = |k: &str| d[k].as_f64().unwrap_or(0.0);
        t.push(vec![
            r.op.clone(),
            r.calls.to_string(),
            format!("{:.3}", r.total_ns as f64 / 1e6),
            format!("{:.1}", g("mean_ns") / 1e3),
            format!("{:.1}", g("pct_of_step")),
            format!("{:.2}", g("gbps")),
            format!("{:.2}", g("gflops")),
            format!("{:.2}", g("intensity")),
            d["bound"].as_str().unwrap_or("").into(),
            format!("{:.1}", g("pct_of_roof")),
        ]);
    }
    let rest = p.step_ns.saturating_sub(covered);
    t.push(vec![
        "(outside ops)".into(),
        "".into(),
        format!("{:.3}", rest as f64 / 1e6),
        "".into(),
        format!("{:.1}", 100.0 * rest as f64 / p.step_ns.max(1) as f64),
        "".into(),
        "".into(),
        "".into(),
        "".into(),
        "".into(),
    ]);
    t.markdown()
}

pub fn run(a: ProfileArgs) -> Result<()> {
    if a.n_prompt == 0 || a.reps == 0 {
        bail!("-p and -r must be at least 1");
    }
    if !matches!(a.block_size, 16 | 32 | 64 | 128) {
        bail!("--block-size must be 16, 32, 64 or 128");
    }
    let model = load_model(&a.model)?;
    let threads = a
        .model
        .threads
        .unwrap_or_else(|| std::thread::available_parallelism().map_or(1, |n| n.get()));
    let stamp = RunStamp::collect();
    if let Some(w) = stamp.busy_warning() {
        eprintln!("{w}");
    }
    let w = &model.weights;
    let wt = WeightTypes {
        layers: model.meta.weight_type.clone(),
        output: w
            .output
            .as_ref()
            .unwrap_or(&w.tok_embd)
            .dtype
            .name()
            .to_string(),
    };
    // The GPU's roofs for CUDA runs (the CPU's would put a GPU at hundreds of % of memory).
    let ceil = match a.model.backend.as_str() {
        #[cfg(feature = "cuda")]
        "cuda" => OpRoofs::gpu(&crate::gpu_ceilings::GpuCeilings::measure()?),
        #[cfg(feature = "wgpu")]
        "wgpu" => {
            let mut p = quire_backend::wgpu::probe::Probe::new(a.model.adapter.as_deref())?;
            OpRoofs::wgpu(&crate::wgpu_ceilings::WgpuCeilings::measure(&mut p)?)
        }
        _ => OpRoofs::cpu(&crate::roofline::ceilings_for(threads)?, &wt, threads),
    };
    // Blocks for one sequence per row of the largest step (fresh_seqs gives each its own run).
    let need = a.n_prompt.max(a.depth + 1);
    let kv = KvCacheSpec {
        num_blocks: need.div_ceil(a.block_size) * (1 + a.mixed_rows),
        block_size: a.block_size,
    };
    let margs = ModelArgs {
        threads: Some(threads),
        ..a.model.clone()
    };
    let mut exec = executor(&model, &margs, kv, &a.kv_dtype)?;
    let mut st = Stepper::default();
    let mut rng = rand::rngs::StdRng::seed_from_u64(a.seed);
    // Warm-up: one unprofiled prefill.
    let mut warm = fresh_seqs(1, a.n_prompt, a.block_size);
    st.prefill(exec.as_mut(), &mut warm[0], a.n_prompt, &mut rng)?;
    let mut shapes = vec![
        StepShape {
            name: "prefill",
            tokens: a.n_prompt,
            depth: 0,
            rows: 0,
            row_depth: 0,
        },
        StepShape {
            name: "decode",
            tokens: 1,
            depth: a.depth,
            rows: 0,
            row_depth: 0,
        },
    ];
    if a.mixed_rows > 0 {
        shapes.push(StepShape {
            name: "mixed",
            tokens: a.n_prompt,
            depth: 0,
            rows: a.mixed_rows,
            row_depth: a.depth,
        });
    }
    let phases = shapes
        .iter()
        .map(|sh| profile_phase(exec.as_mut(), &mut st, sh, a.reps, &mut rng))
        .collect::<Result<Vec<_>>>()?;

    if let Some(path) = &a.csv {
        let mut out = csv_line(&[
            "phase",
            "op",
            "layer",
            "calls",
            "total_ns",
            "mean_ns",
            "pct_of_step",
            "bytes",
            "flops",
            "gbps",
            "gflops",
            "intensity",
            "bound",
            "pct_of_roof",
            "threads",
            "commit",
            "device",
            "quire_env",
        ]);
        for p in &phases {
            for r in &p.layers {
                let d = derived(r, p.step_ns, &ceil);
                let mut cells = vec![p.name.to_string()];
                for k in [
                    "op",
                    "layer",
                    "calls",
                    "total_ns",
                    "mean_ns",
                    "pct_of_step",
                    "bytes",
                    "flops",
                    "gbps",
                    "gflops",
                    "intensity",
                    "bound",
                    "pct_of_roof",
                ] {
                    cells.push(quire_perf::output::csv_cell(&d[k]));
                }
                cells.extend([
                    threads.to_string(),
                    stamp.commit.clone(),
                    stamp.cpu.clone(),
                    stamp.env.join(" "),
                ]);
                out += &csv_line(&cells);
            }
        }
        std::fs::write(path, out).with_context(|| format!("cannot write {}", path.display()))?;
        eprintln!("wrote {}", path.display());
    }

    let phase_json: Vec<Value> = phases
        .iter()
        .map(|p| {
            let s = Summary::of(&p.samples_ns.iter().map(|&x| x as f64).collect::<Vec<_>>());
            json!({
                "phase": p.name,
                "rows": p.rows,
                "tokens": p.tokens,
                "depth": p.depth,
                "step_ns": p.step_ns,
                "samples_ns": p.samples_ns,
                "p10_ns": s.p10,
                "p90_ns": s.p90,
                "tok_s": p.tokens as f64 * 1e9 / p.step_ns as f64,
                "timing_note": p.note,
                "ops": p.ops.iter().map(|r| derived(r, p.step_ns, &ceil)).collect::<Vec<_>>(),
                "layers": p.layers.iter().map(|r| derived(r, p.step_ns, &ceil)).collect::<Vec<_>>(),
            })
        })
        .collect();
    if a.json {
        let report = json!({
            "stamp": stamp,
            "settings": {
                "model_filename": model.meta.path,
                "model_type": model.meta.model_type,
                "backend": a.model.backend,
                "threads": threads,
                "n_prompt": a.n_prompt,
                "n_depth": a.depth,
                "repetitions": a.reps,
                "kv_dtype": a.kv_dtype,
                "cpu_math": (a.model.backend == "cpu").then_some(&a.model.cpu_math),
                "block_size": a.block_size,
                "seed": a.seed,
            },
            "ceilings": ceil.json,
            "phases": phase_json,
        });
        println!("{}", serde_json::to_string_pretty(&report)?);
        return Ok(());
    }
    let math = if a.model.backend == "cpu" {
        format!(" · {} math", a.model.cpu_math)
    } else {
        String::new()
    };
    println!(
        "{} · {}{math} · KV {} · {}\n",
        model.meta.model_type, a.model.backend, a.kv_dtype, ceil.line
    );
    for (p, pj) in phases.iter().zip(&phase_json) {
        let title = match p.name {
            "prefill" => format!("prefill of {} tokens (one forward)", p.tokens),
            "mixed" => format!(
                "mixed step: a {}-token prompt beside {} decode rows at depth {} (one forward)",
                p.tokens - p.rows,
                p.rows,
                p.depth
            ),
            _ => format!("decode step at depth {}", p.depth),
        };
        println!(
            "## {title}: median {:.2} ms (p10 {:.2}, p90 {:.2}; {} runs), {:.1} tok/s\n",
            p.step_ns as f64 / 1e6,
            pj["p10_ns"].as_f64().unwrap_or(0.0) / 1e6,
            pj["p90_ns"].as_f64().unwrap_or(0.0) / 1e6,
            p.samples_ns.len(),
            pj["tok_s"].as_f64().unwrap_or(0.0)
        );
        println!("{}", phase_table(p, &ceil));
        if let Some(n) = &p.note {
            println!("{n}\n");
        }
    }
    println!("{}", stamp.line());
    Ok(())
}
