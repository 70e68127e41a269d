//! `quire roofline`: measures this machine's ceilings (streaming memory bandwidth, FP32 FMA peak,
//! and the rate of quire's own quantized dot-product kernels with operands in cache), caches them
//! in `~/.cache/quire/ceilings-v2.json` for `bench` and `profile`, and places their JSON results on a
//! roofline chart (SVG). `--chips` prints published ceilings of other hardware for comparison.
//! `--backend cuda` measures the GPU's instead (copy bandwidth; tensor peak from the datasheet).

use std::collections::BTreeMap;
use std::hint::black_box;
use std::path::{Path, PathBuf};
use std::time::Instant;

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_backend::cpu::quant::{dot_row, dot_row_x4, quantize_row_q8a, BlockQ8A, QK};
use quire_gguf::GgmlType;
use quire_perf::chips::CHIPS;
use quire_perf::output::parse_records;
use quire_perf::{Ceilings, Roof, RoofPoint, Roofline, RunStamp, Table};
use serde_json::{Map, Value};

#[derive(Args, Debug)]
pub struct RooflineArgs {
    /// `quire bench -o json` or `quire profile --json` result files to place on the chart
    pub results: Vec<PathBuf>,
    /// Where to write the chart
    #[arg(long, default_value = "roofline.svg")]
    pub svg: PathBuf,
    /// Reuse the cached ceilings when they were measured on this CPU (else measure again)
    #[arg(long)]
    pub cached: bool,
    /// Threads for the measurements [default: all cores]
    #[arg(long, short = 't')]
    pub threads: Option<usize>,
    /// Also print published ceilings of Apple M1–M4 and NVIDIA H100/H200
    #[arg(long)]
    pub chips: bool,
    /// Print the ceilings as JSON instead of a table
    #[arg(long)]
    pub json: bool,
    /// Whose ceilings: the CPU's, or the GPU's (copy bandwidth measured, f16 tensor-core peak
    /// from the datasheet of a known chip)
    /// wgpu: the adapter's read bandwidth measured by a 16-byte-load read of up to 1 GiB
    #[arg(long, default_value = "cpu", value_parser = ["cpu", "cuda", "wgpu"])]
    pub backend: String,
    /// wgpu: the adapter, by its index in `quire adapters` or a substring of its name
    #[arg(long)]
    pub adapter: Option<String>,
}

/// `~/.cache/quire/ceilings-v2.json` (under `$XDG_CACHE_HOME` when set).
pub fn cache_path() -> PathBuf {
    // v2: the kernel ceiling is the four-token kernel's (the one prefill runs).
    quire_core::default_model::cache_dir().join("ceilings-v2.json")
}

fn all_cores() -> usize {
    std::thread::available_parallelism()
        .map(|n| n.get())
        .unwrap_or(1)
}

/// Measures every ceiling on `threads` threads.
pub fn measure(threads: usize) -> Ceilings {
    let mut c = quire_perf::ceilings::measure(threads);
    c.quant_gops = measure_quant(threads);
    c
}

/// Ceilings for `threads`: the cached ones when they match this CPU, else measured now (and
/// cached when measured on all cores).
pub fn ceilings_for(threads: usize) -> Result<Ceilings> {
    let stamp = RunStamp::collect();
    let path = cache_path();
    if let Ok(c) = Ceilings::load(&path) {
        if c.matches(&stamp, threads) {
            return Ok(c);
        }
    }
    eprintln!(
        "measuring this machine's ceilings on {threads} threads (quire roofline caches them)…"
    );
    let c = measure(threads);
    if threads == all_cores() {
        c.save(&path)?;
    }
    Ok(c)
}

/// GOP/s of quire's Q4_0, Q4_1 and Q8_0 dot-product kernels on data that stays in cache: every
/// thread multiplies its own 32 × 1024 weight tile with four quantized activation rows.
pub fn measure_quant(threads: usize) -> BTreeMap<String, f64> {
    const COLS: usize = 1024;
    const ROWS: usize = 32;
    const ITERS: usize = 400;
    let x: Vec<f32> = (0..COLS)
        .map(|i| ((i * 37 % 101) as f32 - 50.0) / 50.0)
        .collect();
    let mut xq = vec![BlockQ8A::default(); COLS / QK];
    quantize_row_q8a(&x, &mut xq);
    let mut out = BTreeMap::new();
    for dtype in [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0] {
        let mut w = Vec::new();
        for r in 0..ROWS {
            let row: Vec<f32> = (0..COLS)
                .map(|i| (((i + 7 * r) * 53 % 97) as f32 - 48.0) / 48.0)
                .collect();
            quire_gguf::quantize_row(dtype, &row, &mut w).expect("quantizable type");
        }
        let row_bytes = w.len() / ROWS;
        let run = || {
            let t0 = Instant::now();
            std::thread::scope(|s| {
                for _ in 0..threads {
                    let w = w.clone();
                    let (x, xq) = (&x, &xq);
                    s.spawn(move || {
                        let mut acc = 0f32;
                        for _ in 0..ITERS {
                            for r in 0..ROWS {
                                let row = &w[r * row_bytes..(r + 1) * row_bytes];
                                // The four-token kernel where there is one (what a prefill runs).
                                match dot_row_x4(dtype, black_box(row), [xq; 4]) {
                                    Some(v) => acc += v.iter().sum::<f32>(),
                                    None => {
                                        for _ in 0..4 {
                                            acc += dot_row(dtype, black_box(row), x, xq);
                                        }
                                    }
                                }
                            }
                        }
                        black_box(acc);
                    });
                }
            });
            (2 * COLS * ROWS * 4 * ITERS * threads) as f64 / t0.elapsed().as_secs_f64() / 1e9
        };
        run();
        let samples: Vec<f64> = (0..5).map(|_| run()).collect();
        out.insert(
            dtype.name().to_ascii_lowercase(),
            quire_perf::stats::median(&samples),
        );
    }
    out
}

fn ceilings_table(c: &Ceilings) -> String {
    let mut t = Table::new(&["ceiling", "value", "how"], &["value"]);
    let bw = &c.mem_bw_samples;
    t.push(vec![
        "memory bandwidth".into(),
        format!("{:.2} GB/s", c.mem_bw_gbps),
        format!(
            "{}-thread streaming read of {} MiB, median of {} (min {:.2}, max {:.2})",
            c.threads,
            c.mem_buffer_mib,
            bw.len(),
            bw.iter().cloned().fold(f64::INFINITY, f64::min),
            bw.iter().cloned().fold(0.0, f64::max)
        ),
    ]);
    t.push(vec![
        "FP32 peak".into(),
        format!("{:.1} GFLOP/s", c.fp32_gflops),
        format!(
            "AVX2 FMA loop, 12 chains × 8 lanes, {} threads, median of {}",
            c.threads,
            c.fp32_samples.len()
        ),
    ]);
    for (k, g) in &c.quant_gops {
        t.push(vec![
            format!("{k} kernel"),
            format!("{g:.1} GOP/s"),
            "quire's four-token dot kernel on a 32×1024 tile in cache, 2 ops per multiply-add"
                .into(),
        ]);
    }
    t.push(vec![
        "ridge (FP32)".into(),
        format!("{:.1} FLOP/B", c.ridge()),
        "intensity where the FP32 roof meets the memory roof".into(),
    ]);
    t.markdown()
}

fn chips_table(c: Option<&Ceilings>) -> String {
    let mut t = Table::new(
        &[
            "chip",
            "bandwidth GB/s",
            "FP16/BF16 TFLOP/s",
            "ridge FLOP/B",
            "note",
        ],
        &["bandwidth GB/s", "FP16/BF16 TFLOP/s", "ridge FLOP/B"],
    );
    if let Some(c) = c {
        t.push(vec![
            format!("this machine: {} ({} threads)", c.stamp.cpu, c.threads),
            format!("{:.1}", c.mem_bw_gbps),
            format!("{:.3}", c.fp32_gflops / 1e3),
            format!("{:.1}", c.ridge()),
            "measured; FP32 FMA".into(),
        ]);
    }
    for chip in CHIPS {
        t.push(vec![
            chip.name.into(),
            format!("{:.1}", chip.mem_bw_gbps),
            format!("{:.1}", chip.half_tflops),
            format!("{:.1}", chip.ridge()),
            chip.note.into(),
        ]);
    }
    t.markdown()
}

fn num(r: &Map<String, Value>, k: &str) -> Option<f64> {
    r.get(k).and_then(Value::as_f64)
}

/// Points from one result file: bench records (quire's or llama-bench's) or a profile report.
fn points_from(path: &Path) -> Result<Vec<RoofPoint>> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let records = parse_records(&text).with_context(|| format!("{}", path.display()))?;
    let stem = path.file_stem().map_or("".into(), |s| s.to_string_lossy());
    let mut pts = Vec::new();
    for r in &records {
        if let Some(phases) = r.get("phases").and_then(Value::as_array) {
            for ph in phases.iter().filter_map(Value::as_object) {
                let name = ph.get("phase").and_then(Value::as_str).unwrap_or("step");
                for op in ph
                    .get("ops")
                    .and_then(Value::as_array)
                    .into_iter()
                    .flatten()
                {
                    let Some(op) = op.as_object() else { continue };
                    let (Some(f), Some(b), Some(ns)) =
                        (num(op, "flops"), num(op, "bytes"), num(op, "total_ns"))
                    else {
                        continue;
                    };
                    if f > 0.0 && b > 0.0 && ns > 0.0 {
                        pts.push(RoofPoint {
                            label: op.get("op").and_then(Value::as_str).unwrap_or("?").into(),
                            intensity: f / b,
                            gflops: f / ns,
                            group: format!("{stem}: profile {name}"),
                        });
                    }
                }
            }
            continue;
        }
        let (Some(avg_ns), Some(np), Some(ng)) =
            (num(r, "avg_ns"), num(r, "n_prompt"), num(r, "n_gen"))
        else {
            continue;
        };
        let test = r.get("test").and_then(Value::as_str).map(String::from);
        let (flops, bytes, group) = match (num(r, "flops"), num(r, "bytes")) {
            (Some(f), Some(b)) => (f, b, format!("{stem}: quire bench")),
            // llama-bench: 2 FLOPs per parameter per token, weights read once per forward
            // (prompt in ubatches of n_ubatch, one forward per generated token).
            _ => {
                let (Some(p), Some(size)) = (num(r, "model_n_params"), num(r, "model_size")) else {
                    continue;
                };
                let ub = num(r, "n_ubatch").unwrap_or(512.0).max(1.0);
                let fwd = (np / ub).ceil() + ng;
                (
                    2.0 * p * (np + ng),
                    size * fwd,
                    format!("{stem}: llama-bench"),
                )
            }
        };
        let label = test.unwrap_or_else(|| match (np as u64, ng as u64) {
            (p, 0) => format!("pp{p}"),
            (0, g) => format!("tg{g}"),
            (p, g) => format!("pp{p}+tg{g}"),
        });
        if flops > 0.0 && bytes > 0.0 && avg_ns > 0.0 {
            pts.push(RoofPoint {
                label,
                intensity: flops / bytes,
                gflops: flops / avg_ns,
                group,
            });
        }
    }
    Ok(pts)
}

/// Places the results' points under a memory roof and compute roofs; writes the SVG.
fn write_chart(a: &RooflineArgs, title: String, mem_bw_gbps: f64, roofs: Vec<Roof>) -> Result<()> {
    let mut points = Vec::new();
    for p in &a.results {
        points.extend(points_from(p)?);
    }
    if points.is_empty() {
        bail!("no bench or profile results with timings in the given files");
    }
    let chart = Roofline {
        title,
        mem_bw_gbps,
        roofs,
        points,
    };
    let svg = chart.svg(1000, 640)?;
    std::fs::write(&a.svg, svg).with_context(|| format!("cannot write {}", a.svg.display()))?;
    eprintln!("wrote {} ({} points)", a.svg.display(), chart.points.len());
    Ok(())
}

#[cfg(feature = "cuda")]
fn run_cuda(a: &RooflineArgs) -> Result<()> {
    let g = crate::gpu_ceilings::GpuCeilings::measure()?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&g)?);
    } else {
        println!("{}", g.line());
    }
    if a.chips {
        println!("\n## Published ceilings\n");
        print!("{}", chips_table(None));
    }
    if !a.results.is_empty() {
        let Some(peak) = g.tensor_gflops() else {
            bail!("no tensor-core peak known for {}: no chart", g.device);
        };
        let roofs = vec![Roof {
            label: "f16 tensor (datasheet)".into(),
            gflops: peak,
        }];
        let title = format!("{} · quire {}", g.device, RunStamp::collect().commit);
        write_chart(a, title, g.copy_gbps, roofs)?;
    }
    Ok(())
}

#[cfg(not(feature = "cuda"))]
fn run_cuda(_: &RooflineArgs) -> Result<()> {
    bail!("backend cuda was not built into this binary (build with `cargo build --release --features cuda`)")
}

#[cfg(feature = "wgpu")]
fn run_wgpu(a: &RooflineArgs) -> Result<()> {
    let mut p = quire_backend::wgpu::probe::Probe::new(a.adapter.as_deref())?;
    let g = crate::wgpu_ceilings::WgpuCeilings::measure(&mut p)?;
    if a.json {
        println!("{}", serde_json::to_string_pretty(&g)?);
    } else {
        println!("{}", g.line());
        println!("{}", RunStamp::collect().line());
    }
    if !a.results.is_empty() {
        bail!("--backend wgpu: no compute peak measured yet, so no chart (the read roof is above)");
    }
    Ok(())
}

#[cfg(not(feature = "wgpu"))]
fn run_wgpu(_: &RooflineArgs) -> Result<()> {
    bail!("backend wgpu was not built into this binary (build with `cargo build --release --features wgpu`)")
}

pub fn run(a: RooflineArgs) -> Result<()> {
    if a.backend == "cuda" {
        return run_cuda(&a);
    }
    if a.backend == "wgpu" {
        return run_wgpu(&a);
    }
    let threads = a.threads.unwrap_or_else(all_cores).max(1);
    let stamp = RunStamp::collect();
    if let Some(w) = stamp.busy_warning() {
        eprintln!("{w}");
    }
    let cached = a
        .cached
        .then(|| Ceilings::load(&cache_path()).ok())
        .flatten()
        .filter(|c| c.matches(&stamp, threads));
    let c = match cached {
        Some(c) => c,
        None => {
            eprintln!(
                "measuring memory bandwidth, FP32 peak and quantized kernels on {threads} threads…"
            );
            let c = measure(threads);
            if threads == all_cores() {
                c.save(&cache_path())?;
                eprintln!("cached in {}", cache_path().display());
            }
            c
        }
    };
    if a.json {
        println!("{}", serde_json::to_string_pretty(&c)?);
    } else {
        println!("## Ceilings of {}\n", c.stamp.cpu);
        print!("{}", ceilings_table(&c));
        println!("\n{}", c.stamp.line());
    }
    if a.chips {
        println!("\n## Published ceilings\n");
        print!("{}", chips_table(Some(&c)));
    }
    if !a.results.is_empty() {
        let mut roofs = vec![Roof {
            label: "FP32 FMA".into(),
            gflops: c.fp32_gflops,
        }];
        for (k, g) in &c.quant_gops {
            roofs.push(Roof {
                label: format!("{k} kernel"),
                gflops: *g,
            });
        }
        let title = format!(
            "{} · {} threads · quire {}",
            c.stamp.cpu, c.threads, c.stamp.commit
        );
        write_chart(&a, title, c.mem_bw_gbps, roofs)?;
    }
    Ok(())
}
