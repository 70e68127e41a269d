//! Microbenchmark of the wgpu prompt GEMM on Llama-3-8B's matmul shapes: every GEMM path the
//! adapter has (the tiled fallback; the cooperative-matrix kernel in each of its blockings where
//! the adapter has matrix units; each split over columns as the path splits that shape, its
//! reduce included, and marked `*` where the engine picks that path) and, for reference, the
//! GEMV that short chunks use. Per path, type and shape:
//! the median time of the repetitions after a warm-up, the fastest and slowest, TFLOP/s
//! (2·tokens·rows·cols per product), and tokens per second of that one product; then, per path
//! and type, the tokens per second of an 8B prompt's matmuls alone (32 layers of QKV, O, gate+up
//! and down). Timed with GPU timestamps at the compute-pass boundaries where the adapter has
//! TIMESTAMP_QUERY, else by the wall clock around each submission (the output says which).
//!
//! `cargo run --release -p quire-backend --features wgpu --example wgpu_gemm_bench -- [--adapter
//! N|NAME] [--tokens 512,64] [--reps 10] [--types f16,q4_0] [--shapes small] [--no-matmul]`
//! (`--shapes small`: 1/8 of each dimension, for CPU drivers such as lavapipe).

use std::time::Instant;

use half::f16;
use quire_backend::wgpu::gemm::GemmPath;
use quire_backend::wgpu::kernels::{self, Dispatch, MmShape};
use quire_backend::wgpu::probe::Probe;
use quire_backend::wgpu::weights::DMatrix;
use quire_backend::{BackendError, HostTensor, TensorBytes};
use quire_gguf::GgmlType;
use rand::{rngs::StdRng, Rng, SeedableRng};

const HELP: &str = "wgpu_gemm_bench: times the wgpu prompt GEMM on Llama-3-8B's matmul shapes

options:
  --adapter N|NAME  the adapter (index or name substring; default: the first discrete GPU)
  --tokens LIST     tokens per product, comma-separated (default 512)
  --reps N          timed repetitions after 3 warm-up runs (default 10)
  --types LIST      weight types, comma-separated: f16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k
                    (default f16)
  --shapes small    divide every dimension by 8 (for CPU drivers such as lavapipe)
  --no-matmul       skip the GEMV (the path of chunks of up to 8 tokens)";

/// (name, rows, cols) of Llama-3-8B's matmuls; `layer` marks those of one layer.
const SHAPES: [(&str, usize, usize, bool); 5] = [
    ("qkv 6144x4096", 6144, 4096, true),
    ("o 4096x4096", 4096, 4096, true),
    ("up 14336x4096", 14336, 4096, false),
    ("gate+up 28672x4096", 28672, 4096, true),
    ("down 4096x14336", 4096, 14336, true),
];

struct Args {
    adapter: Option<String>,
    tokens: Vec<usize>,
    reps: usize,
    types: Vec<GgmlType>,
    scale: usize,
    matmul: bool,
}

fn parse() -> Result<Args, String> {
    let mut a = Args {
        adapter: None,
        tokens: vec![512],
        reps: 10,
        types: vec![GgmlType::F16],
        scale: 1,
        matmul: true,
    };
    let mut it = std::env::args().skip(1);
    while let Some(k) = it.next() {
        let mut val = || it.next().ok_or(format!("{k} needs a value"));
        let num = |v: String| v.parse::<usize>().map_err(|e| format!("{k} {v}: {e}"));
        match k.as_str() {
            "--adapter" => a.adapter = Some(val()?),
            "--tokens" => {
                a.tokens = val()?
                    .split(',')
                    .map(|v| v.parse::<usize>().map(|n| n.max(1)))
                    .collect::<Result<_, _>>()
                    .map_err(|e| format!("--tokens: {e}"))?
            }
            "--reps" => a.reps = num(val()?)?.max(1),
            "--types" => {
                a.types = val()?
                    .split(',')
                    .map(|t| match t.to_lowercase().as_str() {
                        "f16" => Ok(GgmlType::F16),
                        "q8_0" => Ok(GgmlType::Q8_0),
                        "q4_0" => Ok(GgmlType::Q4_0),
                        "q4_1" => Ok(GgmlType::Q4_1),
                        "q4_k" => Ok(GgmlType::Q4_K),
                        "q5_k" => Ok(GgmlType::Q5_K),
                        "q6_k" => Ok(GgmlType::Q6_K),
                        _ => Err(format!(
                            "unknown type {t:?} (f16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)"
                        )),
                    })
                    .collect::<Result<_, _>>()?
            }
            "--shapes" => match val()?.as_str() {
                "small" => a.scale = 8,
                "8b" => a.scale = 1,
                s => return Err(format!("--shapes {s}: small or 8b")),
            },
            "--no-matmul" => a.matmul = false,
            "-h" | "--help" => {
                println!("{HELP}");
                std::process::exit(0);
            }
            _ => return Err(format!("unknown argument {k:?}\n\n{HELP}")),
        }
    }
    Ok(a)
}

/// A `[rows, cols]` tensor of type `t` with random values.
fn tensor(rng: &mut StdRng, t: GgmlType, rows: usize, cols: usize) -> HostTensor {
    let v: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0..1.0))
        .collect();
    let mut bytes = Vec::new();
    match t {
        GgmlType::F16 => bytes.extend(v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes())),
        _ => quire_gguf::quantize_row(t, &v, &mut bytes).expect("quantizes"),
    }
    HostTensor {
        name: format!("w_{}", t.name()),
        dtype: t,
        dims: vec![cols, rows],
        bytes: TensorBytes::owned(bytes),
    }
}

/// Which kernel a row of the table timed.
#[derive(Clone, Copy)]
enum Path {
    Gemm(GemmPath),
    Matmul,
}

impl Path {
    fn name(self) -> String {
        match self {
            Path::Gemm(p) => p.name(),
            Path::Matmul => "GEMV (chunks of up to 8 tokens)".into(),
        }
    }
}

/// Runs `list` `reps` times, each in a pass of its own; the nanoseconds of each run.
fn time(p: &Probe, list: &[Dispatch], reps: usize) -> Result<Vec<f64>, BackendError> {
    let gpu = &p.gpu;
    let stamps = gpu
        .device
        .features()
        .contains(wgpu::Features::TIMESTAMP_QUERY);
    if !stamps {
        let mut out = Vec::new();
        for _ in 0..reps {
            let t = Instant::now();
            let mut enc = gpu.device.create_command_encoder(&Default::default());
            kernels::encode(&mut enc, list);
            gpu.submit_wait(enc.finish())?;
            out.push(t.elapsed().as_nanos() as f64);
        }
        return Ok(out);
    }
    let n = (2 * reps) as u32;
    let set = gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
        label: Some("gemm bench"),
        ty: wgpu::QueryType::Timestamp,
        count: n,
    });
    let bytes = 8 * n as u64;
    let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("resolve"),
        size: bytes,
        usage: wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC,
        mapped_at_creation: false,
    });
    let read = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("timestamps"),
        size: bytes,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let mut enc = gpu.device.create_command_encoder(&Default::default());
    for r in 0..reps as u32 {
        let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
            label: Some("gemm bench"),
            timestamp_writes: Some(wgpu::ComputePassTimestampWrites {
                query_set: &set,
                beginning_of_pass_write_index: Some(2 * r),
                end_of_pass_write_index: Some(2 * r + 1),
            }),
        });
        for d in list {
            pass.set_pipeline(&d.pipe);
            pass.set_bind_group(0, &d.bind, &[]);
            pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
        }
    }
    enc.resolve_query_set(&set, 0..n, &resolve, 0);
    enc.copy_buffer_to_buffer(&resolve, 0, &read, 0, bytes);
    gpu.submit_wait(enc.finish())?;
    let raw = gpu.read(&read, bytes)?;
    let period = gpu.queue.get_timestamp_period() as f64;
    let ticks: Vec<u64> = raw
        .chunks_exact(8)
        .map(|b| u64::from_le_bytes(b.try_into().expect("8 bytes")))
        .collect();
    Ok(ticks
        .chunks_exact(2)
        .map(|t| t[1].saturating_sub(t[0]) as f64 * period)
        .collect())
}

/// A uniform buffer holding `params`.
fn param_buf(p: &mut Probe, params: &kernels::Params) -> Result<wgpu::Buffer, BackendError> {
    let pb = p.gpu.buffer(
        "bench parameters",
        64,
        wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
    )?;
    let words: Vec<u8> = params.iter().flat_map(|w| w.to_le_bytes()).collect();
    p.gpu.queue.write_buffer(&pb, 0, &words);
    Ok(pb)
}

/// The dispatches of one product of `m` over `n` tokens through `path` (a GEMM's split as the
/// path splits the shape, its partial sums in `part`), and the split's slices (1: none).
fn dispatches(
    p: &mut Probe,
    path: Path,
    m: &DMatrix,
    n: usize,
    (x, y, part): (&wgpu::Buffer, &wgpu::Buffer, &wgpu::Buffer),
) -> Result<Option<(Vec<Dispatch>, u32)>, BackendError> {
    let mut list = Vec::new();
    let mut slices = 1;
    for dpart in &m.parts {
        let s = MmShape {
            rows: dpart.rows,
            cols: m.cols,
            n,
            x_stride: m.cols,
            y_stride: m.rows,
            y_off: dpart.y_off,
            add: false,
            row_words: dpart.ty.row_words(m.cols),
            row0: dpart.row0,
        };
        let d = |pipe: wgpu::ComputePipeline, bind, groups| Dispatch {
            name: "gemm",
            pipe,
            bind,
            groups,
            bytes: 0,
            flops: 0,
        };
        match path {
            Path::Gemm(g) => {
                let Some(pipe) = p.k.gemm.pipe(g, dpart.ty).cloned() else {
                    return Ok(None);
                };
                let split = g.split(dpart.ty, &s);
                slices = split.slices;
                let pb = param_buf(p, &split.params(&s))?;
                let bufs = [(1, &dpart.buf), (2, x), (3, y), (4, part)];
                let bind = kernels::bind(&p.gpu, &pipe, (&pb, 0), &bufs);
                list.push(d(pipe, bind, g.groups(&s, split)));
                if split.is_split() {
                    let (params, groups) = split.reduce(&s);
                    let pb = param_buf(p, &params)?;
                    let pipe = p.k.gemm.reduce.clone();
                    let bind = kernels::bind(&p.gpu, &pipe, (&pb, 0), &[(3, y), (4, part)]);
                    list.push(d(pipe, bind, groups));
                }
            }
            Path::Matmul => {
                let pipe = p.k.matmul(dpart.ty).clone();
                let pb = param_buf(p, &s.params())?;
                let bufs = [(1, &dpart.buf), (2, x), (3, y)];
                let bind = kernels::bind(&p.gpu, &pipe, (&pb, 0), &bufs);
                list.push(d(pipe, bind, s.matmul_groups()));
            }
        }
    }
    Ok(Some((list, slices)))
}

/// Keeps the GPU busy for about `secs` with `list`: clocks up, and a shape's new buffers
/// touched, before its first timing (without it the first paths timed on a fresh shape ran up to
/// 4x slower on an H200 than the same kernels later).
fn warm_up(p: &Probe, list: &[Dispatch], secs: f64) -> Result<(), BackendError> {
    let t = Instant::now();
    while t.elapsed().as_secs_f64() < secs {
        time(p, list, 10)?;
    }
    Ok(())
}

/// Times every path on one shape at `n` tokens of type `t`; adds each path's median seconds to
/// `layer` where the shape is one of a layer's products.
fn bench_shape(
    p: &mut Probe,
    a: &Args,
    rng: &mut StdRng,
    (t, n): (GgmlType, usize),
    (name, rows, cols, in_layer): (&str, usize, usize, bool),
    paths: &[Path],
    layer: &mut [f64],
) -> Result<(), BackendError> {
    let (rows, cols) = (rows / a.scale, cols / a.scale);
    let w = tensor(rng, t, rows, cols);
    let m = DMatrix::stack(&mut p.gpu, name, &[&w], cols)?;
    drop(w);
    let xv: Vec<u8> = (0..n * cols)
        .flat_map(|_| rng.random_range(-1.0f32..1.0).to_le_bytes())
        .collect();
    let x = p.gpu.upload("x", &xv)?;
    use wgpu::BufferUsages as U;
    let y = p
        .gpu
        .buffer("y", (n * rows * 4) as u64, U::STORAGE | U::COPY_SRC)?;
    let part = p.gpu.buffer(
        "partial sums",
        (p.k.gemm.scratch_floats().max(1) * 4) as u64,
        U::STORAGE,
    )?;
    let engine = m
        .parts
        .first()
        .map(|dp| p.k.gemm.choose(dp.ty, &MmShape::dense(dp.rows, cols, n)));
    for (i, &path) in paths.iter().enumerate() {
        let Some((list, slices)) = dispatches(p, path, &m, n, (&x, &y, &part))? else {
            continue;
        };
        if i == 0 {
            let first = layer.iter().all(|&s| s == 0.0);
            warm_up(p, &list, if first { 1.0 } else { 0.3 })?;
        }
        time(p, &list, 3)?;
        let mut ns = time(p, &list, a.reps)?;
        ns.sort_by(f64::total_cmp);
        let med = ns[ns.len() / 2];
        let flop = 2.0 * (n * rows * cols) as f64;
        let mark = matches!(path, Path::Gemm(g) if Some(g) == engine);
        println!(
            "{:<40} {:>1} {:>6} {:<5} {:<20} {:>10.1} {:>10.1}-{:<10.1} {:>8.3} {:>10.0}",
            path.name(),
            if mark { "*" } else { "" },
            slices,
            t.name(),
            format!("{n}x{rows}x{cols}"),
            med / 1e3,
            ns[0] / 1e3,
            ns[ns.len() - 1] / 1e3,
            flop / med / 1e3,
            n as f64 / (med * 1e-9)
        );
        if in_layer {
            layer[i] += med * 1e-9;
        }
    }
    for b in [&x, &y, &part] {
        p.gpu.release(b);
    }
    for dp in &m.parts {
        p.gpu.release(&dp.buf);
    }
    Ok(())
}

fn run(a: &Args) -> Result<(), BackendError> {
    let mut p = Probe::new(a.adapter.as_deref())?;
    let stamps = p
        .gpu
        .device
        .features()
        .contains(wgpu::Features::TIMESTAMP_QUERY);
    println!(
        "adapter: {} ({}, {}); timing: {}",
        p.gpu.info.name,
        p.gpu.info.backend,
        p.gpu.info.driver,
        if stamps {
            "GPU timestamps at pass boundaries"
        } else {
            "wall clock around each submission (no TIMESTAMP_QUERY)"
        }
    );
    let mut paths: Vec<Path> = p.k.gemm.paths().into_iter().map(Path::Gemm).collect();
    if a.matmul {
        paths.push(Path::Matmul);
    }
    let mut rng = StdRng::seed_from_u64(7);
    println!(
        "{:<40} {:>1} {:>6} {:<5} {:<20} {:>10} {:>21} {:>8} {:>10}",
        "path", "*", "slices", "type", "shape", "median µs", "min-max µs", "TFLOP/s", "tok/s"
    );
    for &n in &a.tokens {
        for &t in &a.types {
            // Per path: the seconds of one layer's products at this type.
            let mut layer = vec![0f64; paths.len()];
            for shape in SHAPES {
                bench_shape(&mut p, a, &mut rng, (t, n), shape, &paths, &mut layer)?;
            }
            for (path, s) in paths.iter().zip(&layer) {
                println!(
                    "{} {}: the matmuls of an 8B prompt of {n} tokens (32 layers){}: {:.0} tok/s",
                    path.name(),
                    t.name(),
                    if a.scale > 1 { " at 1/8 scale" } else { "" },
                    n as f64 / (32.0 * s)
                );
            }
        }
    }
    Ok(())
}

fn main() {
    let a = match parse() {
        Ok(a) => a,
        Err(e) => {
            eprintln!("{e}");
            std::process::exit(2);
        }
    };
    if let Err(e) = run(&a) {
        eprintln!("wgpu_gemm_bench: {e}");
        std::process::exit(1);
    }
}
