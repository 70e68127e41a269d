//! Times the wgpu decode GEMV per weight type and shape against the adapter's measured read
//! bandwidth: the number that says whether decoding runs at memory speed.
//!
//! For each shape (rows × cols) and type it uploads copies of a matrix of random bytes (values do
//! not change the time of a stream of loads), runs the GEMV for `--tokens` tokens `--warmup`
//! times, then `--iters` times, and prints the median time per GEMV, the spread (10th and 90th
//! percentiles), GB/s of weights read at the median and that as a % of the ceiling: the best of
//! two plain reads of a large buffer with 16-byte loads — `quire roofline`'s kernel timed the way
//! the GEMVs are (back to back in one pass), and timed per dispatch as `quire roofline` times it.
//! One timed run is one compute pass of `--reps` GEMVs back to back, as a decode
//! step runs them (so the GPU stays at its working clock and a pass's own start-up cost is
//! spread), cycling over as many copies of the matrix as make `--rotate-mib` (so the weights
//! come from memory, not from a cache that holds a small matrix: the H100's L2 is 50 MiB).
//! Times come from GPU timestamp queries at the boundaries of that pass when the adapter has
//! TIMESTAMP_QUERY, else from the wall clock around one submission (the output says which).
//!
//! ```text
//! cargo run --release -p quire-backend --features wgpu --example wgpu_gemv_bench -- [--adapter N]
//! ```
//! Defaults are Llama-3-8B's decode shapes; on a CPU driver (lavapipe) pass small ones, e.g.
//! `--shapes 256x512,37x1024 --iters 3`. `--no-subgroup` times the fallback without subgroup
//! operations. `--variant LIST` picks the GEMV designs (`quire_backend::wgpu::gemv::Gemv`), each
//! timed in turn on the same buffers: `multi` (the multi-token kernel, which the engine runs for
//! 2..8 tokens), the one-token slot kernel as `rRwW` (R rows per workgroup of W invocations) and
//! the unit kernel for the 4-, 5- and 6-bit types as `uRwW` (`quire_backend::wgpu::gemv_q`);
//! the engine's design for each type (`Gemv::engine`) is marked `*`.

use std::time::Instant;

use anyhow::{bail, Context, Result};
use quire_backend::wgpu::gemv::{gemv_pipeline, Gemv, GemvIn};
use quire_backend::wgpu::gpu::{Gpu, Timestamps};
use quire_backend::wgpu::kernels::{bind, Dispatch, Kernels, MmShape, READ_BW};
use quire_backend::wgpu::probe::Probe;
use quire_backend::wgpu::weights::DMatrix;
use quire_backend::{HostTensor, TensorBytes};
use quire_gguf::GgmlType;

const HELP: &str = "\
wgpu_gemv_bench: time the wgpu decode GEMV against the adapter's read bandwidth

USAGE: wgpu_gemv_bench [OPTIONS]

OPTIONS:
  --adapter N|NAME   adapter index or name substring (see `quire adapters`); default: the first
                     discrete GPU
  --types LIST       comma-separated: f16,q8_0,q4_0,q4_1,q4_k,q5_k,q6_k (default: all)
  --shapes LIST      comma-separated ROWSxCOLS (default: 4096x4096,14336x4096,4096x14336,
                     128256x4096, Llama-3-8B's decode matmuls and lm_head)
  --tokens N         tokens per GEMV (default 1; up to 8 share one read of the weights)
  --iters N          timed runs per case (default 20)
  --warmup N         untimed runs first (default 3)
  --reps N           GEMVs per timed pass, back to back; the time printed is per GEMV
                     (default 16)
  --rotate-mib N     cycle the GEMVs of a pass over copies of the matrix filling this many MiB,
                     so they read memory, not cache (default 256; 0: one copy)
  --ceiling-mib N    size of the read-bandwidth buffer (default 1024, capped at one binding)
  --no-subgroup      time the GEMV's fallback (workgroup-memory sums) instead of subgroupAdd
  --variant LIST     GEMV designs, comma-separated, each timed on the same buffers: multi (the
                     multi-token kernel: 16 rows per workgroup of 256, a subgroup per row pair)
                     and rRwW, the one-token slot kernel with R rows (1, 2, 4, 8) per workgroup
                     of W invocations (32, 64, 128, 256); uRwW, the unit kernel for Q4_K, Q5_K,
                     Q6_K, Q4_0, Q4_1 (a 16-byte unit per invocation), same R and W; default:
                     multi,r2w128,r4w128,r8w256
  -h, --help         this text

ENVIRONMENT: WGPU_BACKEND=vulkan|metal|dx12 narrows the APIs searched. The engine's design for
each type and token count is marked * in the table.

Times are GPU timestamps at the boundaries of each timed pass where the adapter has them (the
first line says which), divided by --reps.";

struct Args {
    adapter: Option<String>,
    types: Vec<GgmlType>,
    shapes: Vec<(usize, usize)>,
    tokens: usize,
    iters: usize,
    warmup: usize,
    reps: usize,
    rotate_mib: usize,
    ceiling_mib: u64,
    no_subgroup: bool,
    variants: Vec<Gemv>,
}

fn parse_type(s: &str) -> Result<GgmlType> {
    Ok(match s.to_ascii_lowercase().as_str() {
        "f16" => GgmlType::F16,
        "q8_0" => GgmlType::Q8_0,
        "q4_0" => GgmlType::Q4_0,
        "q4_1" => GgmlType::Q4_1,
        "q4_k" => GgmlType::Q4_K,
        "q5_k" => GgmlType::Q5_K,
        "q6_k" => GgmlType::Q6_K,
        _ => bail!("unknown type {s:?} (f16, q8_0, q4_0, q4_1, q4_k, q5_k, q6_k)"),
    })
}

fn parse_args() -> Result<Args> {
    let mut a = Args {
        adapter: None,
        types: ["f16", "q8_0", "q4_0", "q4_1", "q4_k", "q5_k", "q6_k"]
            .iter()
            .map(|t| parse_type(t))
            .collect::<Result<_>>()?,
        shapes: vec![(4096, 4096), (14336, 4096), (4096, 14336), (128256, 4096)],
        tokens: 1,
        iters: 20,
        warmup: 3,
        reps: 16,
        rotate_mib: 256,
        ceiling_mib: 1024,
        no_subgroup: false,
        variants: Gemv::CANDIDATES.to_vec(),
    };
    let mut it = std::env::args().skip(1);
    while let Some(flag) = it.next() {
        if flag == "-h" || flag == "--help" {
            println!("{HELP}");
            std::process::exit(0);
        }
        if flag == "--no-subgroup" {
            a.no_subgroup = true;
            continue;
        }
        let v = it
            .next()
            .with_context(|| format!("{flag} needs a value (see --help)"))?;
        let num = |v: &str| -> Result<usize> {
            v.parse()
                .with_context(|| format!("{flag}: {v:?} is not a number"))
        };
        match flag.as_str() {
            "--adapter" => a.adapter = Some(v),
            "--types" => a.types = v.split(',').map(parse_type).collect::<Result<_>>()?,
            "--shapes" => {
                a.shapes = v
                    .split(',')
                    .map(|s| {
                        let (r, c) = s
                            .split_once('x')
                            .with_context(|| format!("shape {s:?} is not ROWSxCOLS"))?;
                        Ok((num(r)?, num(c)?))
                    })
                    .collect::<Result<_>>()?
            }
            "--tokens" => a.tokens = num(&v)?,
            "--iters" => a.iters = num(&v)?,
            "--warmup" => a.warmup = num(&v)?,
            "--reps" => a.reps = num(&v)?,
            "--rotate-mib" => a.rotate_mib = num(&v)?,
            "--ceiling-mib" => a.ceiling_mib = num(&v)? as u64,
            "--variant" => {
                a.variants = v
                    .split(',')
                    .map(|g| Gemv::parse(g).map_err(anyhow::Error::msg))
                    .collect::<Result<_>>()?
            }
            _ => bail!("unknown option {flag} (see --help)"),
        }
    }
    if a.iters == 0 || a.tokens == 0 || a.reps == 0 {
        bail!("--iters, --tokens and --reps must be at least 1");
    }
    Ok(a)
}

/// Times `list` (one pass) `warmup + iters` times; returns the timed runs in seconds, and
/// whether they are GPU timestamps.
fn time(gpu: &Gpu, list: &[Dispatch], warmup: usize, iters: usize) -> Result<(Vec<f64>, bool)> {
    let ts = gpu.caps.timestamps != Timestamps::None;
    let qs = ts.then(|| {
        gpu.device.create_query_set(&wgpu::QuerySetDescriptor {
            label: Some("bench"),
            ty: wgpu::QueryType::Timestamp,
            count: 2,
        })
    });
    let usage = wgpu::BufferUsages::QUERY_RESOLVE | wgpu::BufferUsages::COPY_SRC;
    let resolve = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("timestamps"),
        size: 16,
        usage,
        mapped_at_creation: false,
    });
    let read = gpu.device.create_buffer(&wgpu::BufferDescriptor {
        label: Some("timestamps readback"),
        size: 16,
        usage: wgpu::BufferUsages::MAP_READ | wgpu::BufferUsages::COPY_DST,
        mapped_at_creation: false,
    });
    let period = gpu.queue.get_timestamp_period() as f64 * 1e-9;
    let mut out = Vec::new();
    for i in 0..warmup + iters {
        let mut enc = gpu.device.create_command_encoder(&Default::default());
        {
            let tw = qs.as_ref().map(|q| wgpu::ComputePassTimestampWrites {
                query_set: q,
                beginning_of_pass_write_index: Some(0),
                end_of_pass_write_index: Some(1),
            });
            let mut pass = enc.begin_compute_pass(&wgpu::ComputePassDescriptor {
                label: Some("bench"),
                timestamp_writes: tw,
            });
            for d in list {
                pass.set_pipeline(&d.pipe);
                pass.set_bind_group(0, &d.bind, &[]);
                pass.dispatch_workgroups(d.groups[0], d.groups[1], d.groups[2]);
            }
        }
        if let Some(q) = &qs {
            enc.resolve_query_set(q, 0..2, &resolve, 0);
            enc.copy_buffer_to_buffer(&resolve, 0, &read, 0, 16);
        }
        let t = Instant::now();
        gpu.submit_wait(enc.finish())?;
        let wall = t.elapsed().as_secs_f64();
        let secs = if ts {
            let b = gpu.read(&read, 16)?;
            let t0 = u64::from_le_bytes(b[..8].try_into()?);
            let t1 = u64::from_le_bytes(b[8..].try_into()?);
            t1.saturating_sub(t0) as f64 * period
        } else {
            wall
        };
        if i >= warmup {
            out.push(secs);
        }
    }
    Ok((out, ts))
}

/// Median, 10th and 90th percentiles (nearest rank).
fn stats(v: &mut [f64]) -> (f64, f64, f64) {
    v.sort_by(|a, b| a.total_cmp(b));
    let at = |q: f64| v[((q * v.len() as f64).ceil() as usize).clamp(1, v.len()) - 1];
    (v[v.len() / 2], at(0.1), at(0.9))
}

/// A buffer of `bytes` of pseudo-random bytes (xorshift; the values do not matter).
fn random_bytes(bytes: usize, seed: u64) -> Vec<u8> {
    let mut s = seed | 1;
    let mut v = Vec::with_capacity(bytes + 8);
    while v.len() < bytes {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        v.extend_from_slice(&s.to_le_bytes());
    }
    v.truncate(bytes);
    v
}

/// The read ceiling in GB/s: the larger of `quire roofline`'s read kernel timed as the GEMVs
/// are (back to back in one pass) and timed per dispatch (as `quire roofline` does), over a
/// buffer of up to `mib` MiB.
fn ceiling(p: &mut Probe, mib: u64, a: &Args) -> Result<f64> {
    let bytes = (mib << 20).min(p.gpu.max_binding() / 16 * 16);
    let src = p
        .gpu
        .upload("read ceiling", &random_bytes(bytes as usize, 0x51))?;
    let words = (bytes / 16) as u32;
    let per_group = 4096u32;
    let groups = words.div_ceil(per_group);
    let dst = p
        .gpu
        .buffer("read sink", groups as u64 * 4, wgpu::BufferUsages::STORAGE)?;
    let pbuf = p.gpu.buffer(
        "read params",
        64,
        wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
    )?;
    let pw = [words, per_group, 0, 0];
    let pb: Vec<u8> = pw.iter().flat_map(|w| w.to_le_bytes()).collect();
    p.gpu.queue.write_buffer(&pbuf, 0, &pb);
    let pipe = p.gpu.pipeline("read ceiling", READ_BW, "main")?;
    let bg = bind(&p.gpu, &pipe, (&pbuf, 0), &[(1, &src), (2, &dst)]);
    let read = Dispatch {
        name: "read",
        pipe,
        bind: bg,
        groups: [groups, 1, 1],
        bytes,
        flops: 0,
    };
    let list = vec![read; a.reps];
    let (mut t, _) = time(&p.gpu, &list, a.warmup, a.iters)?;
    for t in &mut t {
        *t /= a.reps as f64;
    }
    let (med, p10, p90) = stats(&mut t);
    let gbs = |s: f64| bytes as f64 / s / 1e9;
    println!(
        "read ceiling, back to back: {} MiB, {:.1} us median (p10 {:.1}, p90 {:.1}), {:.0} GB/s",
        bytes >> 20,
        med * 1e6,
        p10 * 1e6,
        p90 * 1e6,
        gbs(med)
    );
    p.gpu.release(&src);
    drop(src);
    let (b, mut t, _) = p.read_bandwidth(bytes, a.iters)?;
    let (med2, _, _) = stats(&mut t);
    let per = b as f64 / med2 / 1e9;
    println!("read ceiling, per dispatch (quire roofline): {per:.0} GB/s");
    Ok(gbs(med).max(per))
}

fn main() -> Result<()> {
    let a = parse_args()?;
    let mut p = Probe::new(a.adapter.as_deref())?;
    if a.no_subgroup {
        p.k = Kernels::with_subgroups(&p.gpu, false)?;
    }
    let caps = p.gpu.caps;
    println!(
        "adapter: {} ({}, {}); GEMV sums: {}; timing: {}",
        p.gpu.info.name,
        p.gpu.info.backend,
        p.gpu.info.driver,
        if let (true, Some((lo, hi))) = (p.k.subgroup, caps.subgroup) {
            format!("subgroupAdd (subgroup size {lo}-{hi})")
        } else {
            "workgroup memory".to_string()
        },
        if caps.timestamps != Timestamps::None {
            "GPU timestamps at pass boundaries"
        } else {
            "wall clock around one submission (no TIMESTAMP_QUERY)"
        }
    );
    let ceil = ceiling(&mut p, a.ceiling_mib, &a)?;
    println!("ceiling used: {ceil:.0} GB/s");
    // The design the engine runs for this many tokens of type `t` (marked `*`).
    let engine = |m: &DMatrix| match (a.tokens, m.parts.first()) {
        (1, Some(part)) => Gemv::engine(part.ty),
        _ => Gemv::Multi,
    };
    println!(
        "{:<8} {:<6} {:>7} {:>6} {:>3} {:>10} {:>9} {:>9} {:>9} {:>7} {:>6}",
        "variant",
        "type",
        "rows",
        "cols",
        "n",
        "med us",
        "p10 us",
        "p90 us",
        "GB/s",
        "% ceil",
        "copies"
    );
    for &(rows, cols) in &a.shapes {
        for &t in &a.types {
            let block = t.block_size().max(8);
            if cols % block != 0 {
                println!(
                    "{:<6} {rows:>7} {cols:>6}: cols not a multiple of {block}, skipped",
                    t.name()
                );
                continue;
            }
            let Some(row_bytes) = t.row_size(cols as u64).map(|b| b as usize) else {
                continue;
            };
            let w = HostTensor {
                name: format!("{}_{rows}x{cols}", t.name()),
                dtype: t,
                dims: vec![cols, rows],
                bytes: TensorBytes::owned(random_bytes(rows * row_bytes, rows as u64 ^ 0x9e37)),
            };
            let m = DMatrix::stack(&mut p.gpu, &w.name, &[&w], cols)?;
            // Copies to cycle over, so that a pass's GEMVs read memory rather than cache.
            let want = ((a.rotate_mib as u64) << 20) / m.bytes().max(1);
            let copies = (want as usize).clamp(1, a.reps);
            let mut ms = vec![m];
            for _ in 1..copies {
                ms.push(DMatrix::stack(&mut p.gpu, &w.name, &[&w], cols)?);
            }
            drop(w);
            let n = a.tokens;
            let usage = wgpu::BufferUsages::STORAGE;
            let x = p.gpu.upload("x", &random_x(n * cols))?;
            let y = p.gpu.buffer("y", (n * rows * 4) as u64, usage)?;
            for &kern in &a.variants {
                if !kern.supports(ms[0].parts[0].ty) {
                    println!(
                        "{:<8} {:<6} {rows:>7} {cols:>6}: no form for this type, skipped",
                        kern.name(),
                        t.name()
                    );
                    continue;
                }
                let pipe =
                    gemv_pipeline(&p.gpu, ms[0].parts[0].ty, kern, p.k.subgroup, GemvIn::Plain)?;
                let case = Case {
                    ms: &ms,
                    rows,
                    cols,
                    n,
                    x: &x,
                    y: &y,
                };
                let (med, p10, p90) = time_gemv(&mut p.gpu, &a, &case, kern, &pipe)?;
                let gbs = ms[0].bytes() as f64 / med / 1e9;
                println!(
                    "{:<8} {:<6} {rows:>7} {cols:>6} {n:>3} {:>10.1} {:>9.1} {:>9.1} {gbs:>9.1} {:>6.1}% {copies:>6}",
                    format!(
                        "{}{}",
                        kern.name(),
                        if kern == engine(&ms[0]) { "*" } else { "" }
                    ),
                    t.name(),
                    med * 1e6,
                    p10 * 1e6,
                    p90 * 1e6,
                    100.0 * gbs / ceil
                );
            }
            let bufs = ms.iter().flat_map(|m| m.parts.iter().map(|p| &p.buf));
            for b in bufs.chain([&x, &y]) {
                p.gpu.release(b);
            }
        }
    }
    Ok(())
}

/// One shape's copies of the matrix and its activations and output.
struct Case<'a> {
    ms: &'a [DMatrix],
    rows: usize,
    cols: usize,
    n: usize,
    x: &'a wgpu::Buffer,
    y: &'a wgpu::Buffer,
}

/// Times `reps` GEMVs of design `kern` (pipeline `pipe`) back to back over the copies; returns the
/// median, 10th and 90th percentile seconds per GEMV.
fn time_gemv(
    gpu: &mut Gpu,
    a: &Args,
    c: &Case,
    kern: Gemv,
    pipe: &wgpu::ComputePipeline,
) -> Result<(f64, f64, f64)> {
    // The dispatches of each copy (one per part), then `reps` GEMVs over the copies.
    let mut per_copy = Vec::new();
    let mut pbufs = Vec::new();
    for m in c.ms {
        let mut ds = Vec::new();
        for part in &m.parts {
            let s = MmShape {
                rows: part.rows,
                cols: c.cols,
                n: c.n,
                x_stride: c.cols,
                y_stride: c.rows,
                y_off: part.y_off,
                add: false,
                row_words: part.ty.row_words(c.cols),
                row0: part.row0,
            };
            let pbuf = gpu.buffer(
                "params",
                64,
                wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST,
            )?;
            let pb: Vec<u8> = s.params().iter().flat_map(|w| w.to_le_bytes()).collect();
            gpu.queue.write_buffer(&pbuf, 0, &pb);
            let bg = bind(gpu, pipe, (&pbuf, 0), &[(1, &part.buf), (2, c.x), (3, c.y)]);
            let groups = kern.groups(&s);
            ds.push(Dispatch {
                name: "gemv",
                pipe: pipe.clone(),
                bind: bg,
                groups,
                bytes: 0,
                flops: 0,
            });
            pbufs.push(pbuf);
        }
        per_copy.push(ds);
    }
    let list: Vec<Dispatch> = (0..a.reps)
        .flat_map(|i| per_copy[i % c.ms.len()].iter().cloned())
        .collect();
    let (mut ts, _) = time(gpu, &list, a.warmup, a.iters)?;
    for t in &mut ts {
        *t /= a.reps as f64;
    }
    for b in &pbufs {
        gpu.release(b);
    }
    Ok(stats(&mut ts))
}

/// `len` activations in [-1, 1).
fn random_x(len: usize) -> Vec<u8> {
    random_bytes(len * 4, 7)
        .chunks_exact(4)
        .flat_map(|c| {
            let v = u32::from_le_bytes([c[0], c[1], c[2], c[3]]) as f32 / u32::MAX as f32;
            (2.0 * v - 1.0).to_le_bytes()
        })
        .collect()
}
