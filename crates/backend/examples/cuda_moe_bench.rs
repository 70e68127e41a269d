//! Microbenchmark of one mixture-of-experts block on CUDA at the Qwen3-30B-A3B shape (hidden 2048,
//! 128 experts, 8 per token, expert rows 768): router GEMM, top-k and sort, gate/up, SwiGLU,
//! down and the combine, as a step launches them (`MoeRun::run_with`), for Q4_0 and Q4_K experts
//! at 1, 2, 4, 8, 16, 128 and 512 tokens (`--tokens` picks others), on every expert path. Timed
//! with CUDA events over many runs after a warm-up: median and half the 10th–90th percentile
//! spread, in microseconds, and the expert weight bytes the step must read at least (each distinct
//! expert chosen, once) per second. The row the step takes by itself is marked `*`;
//! `moe::TC_MIN_TOKENS` is set from where the paths cross.
//!
//! Beside the total, where the time goes: each stage's median (`MoeRun::run_marked` with an event
//! recorded after each stage's launches) in a second run of the same reps. The events between the
//! launches stop programmatic dependent launch from overlapping one kernel's start with the
//! previous one's tail, so the stages add up to more than the total; the difference is roughly
//! what that overlap saves.
//!
//! Weights: one random expert, quantized, repeated for every expert (each still at its own
//! address, so the bytes read are real); the router random, so the routing is spread as in a
//! model with a trained router, roughly.
//!
//! `cargo run --release -p quire-backend --features cuda --example cuda_moe_bench
//! [-- --reps 200] [--tokens 1,2,4,8,16]`

use half::f16;
use quire_backend::cpu::quant::{quantize_row_q8a, BlockQ8A, QK};
use quire_backend::cuda::gpu::{EventFlags, Gpu};
use quire_backend::cuda::moe::{MoeInputs, MoeKernels, MoeLayer, MoePath, MoeRun, MoeScratch};
use quire_backend::cuda::nvrtc;
use quire_backend::cuda::qmat::{QuantKernels, Q8A_BYTES};
use quire_backend::{BackendError, HostTensor, MoeWeights, TensorBytes};
use quire_core::MoeConfig;
use quire_gguf::GgmlType;

const HIDDEN: usize = 2048;
const EXPERTS: usize = 128;
const TOP_K: usize = 8;
const INTER: usize = 768;
const TOKENS: [usize; 7] = [1, 2, 4, 8, 16, 128, 512];

type Res<T> = Result<T, Box<dyn std::error::Error>>;

fn median_spread(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let m = v[v.len() / 2];
    (m, (v[v.len() * 9 / 10] - v[v.len() / 10]) / 2.0)
}

/// Deterministic pseudo-random values in [-a, a) (a splitmix64 hash of index and seed: no RNG
/// dependency needed for a benchmark).
fn pattern(n: usize, seed: u64, a: f32) -> Vec<f32> {
    (0..n as u64)
        .map(|i| {
            let mut z = i
                .wrapping_add(seed << 40)
                .wrapping_mul(0x9E37_79B9_7F4A_7C15);
            z = (z ^ (z >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            z = (z ^ (z >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            z ^= z >> 31;
            ((z >> 40) as f32 / (1u64 << 24) as f32) * 2.0 * a - a
        })
        .collect()
}

/// `[experts][rows][cols]` of `dtype`: one quantized expert repeated.
fn experts(name: &str, dtype: GgmlType, rows: usize, cols: usize, seed: u64) -> Res<HostTensor> {
    let mut one = Vec::new();
    quire_gguf::quantize_row(dtype, &pattern(rows * cols, seed, 0.1), &mut one)?;
    Ok(HostTensor {
        name: name.into(),
        dtype,
        dims: vec![cols, rows, EXPERTS],
        bytes: TensorBytes::owned(one.repeat(EXPERTS)),
    })
}

fn q8_device_bytes(x: &[f32]) -> Vec<u8> {
    let mut xq = vec![BlockQ8A::default(); x.len() / QK];
    quantize_row_q8a(x, &mut xq);
    let mut bytes = Vec::with_capacity(xq.len() * Q8A_BYTES);
    for b in &xq {
        bytes.extend(b.d.to_le_bytes());
        bytes.extend(b.s.to_le_bytes());
        bytes.extend(b.qs.iter().map(|&v| v as u8));
    }
    bytes
}

fn main() -> Res<()> {
    let args: Vec<String> = std::env::args().collect();
    let reps = args
        .iter()
        .position(|a| a == "--reps")
        .and_then(|i| args.get(i + 1))
        .map_or(Ok(100), |v| v.parse::<usize>())
        .map_err(|e| format!("--reps takes a count: {e}"))?;
    if reps == 0 {
        return Err("--reps takes a count of at least 1".into());
    }
    let tokens: Vec<usize> = match args.iter().position(|a| a == "--tokens") {
        None => TOKENS.to_vec(),
        Some(i) => args
            .get(i + 1)
            .ok_or("--tokens takes a list such as 1,2,4,8,16")?
            .split(',')
            .map(|v| match v.trim().parse::<usize>() {
                Ok(n) if n > 0 => Ok(n),
                _ => Err(format!(
                    "--tokens takes token counts of at least 1, not {v:?}"
                )),
            })
            .collect::<Result<_, _>>()?,
    };
    let g = Gpu::new(0)?;
    let mk = MoeKernels::new(&g)?;
    let qk = QuantKernels::new(&g)?;
    let act = g.module(&nvrtc::ACTIVATION, &[])?;
    let swiglu = Gpu::function(&act, "swiglu_f16")?;
    let run = MoeRun {
        g: &g,
        mk: &mk,
        qk: &qk,
        swiglu_f16: &swiglu,
    };
    let cfg = MoeConfig {
        num_experts: EXPERTS,
        num_experts_per_tok: TOP_K,
        expert_intermediate_size: INTER,
        norm_topk_prob: true,
    };
    println!(
        "device: {} ({}); MoE block hidden {HIDDEN}, {EXPERTS} experts, {TOP_K} per token, \
         expert rows {INTER}; {reps} timed runs per case",
        g.name, g.arch
    );
    println!();
    println!(
        "| experts | tokens | path | median us | +/- | distinct experts | expert GB/s | \
         stages, us (events between) |"
    );
    println!("|---|---:|---|---:|---:|---:|---:|---|");
    let max_n = tokens.iter().copied().max().unwrap_or(1);
    let x = pattern(max_n * HIDDEN, 3, 1.0);
    let router = pattern(EXPERTS * HIDDEN, 4, 0.05);
    let dq = g.upload(&q8_device_bytes(&x))?;
    let dh = g.upload(&x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>())?;
    let dx = g.alloc::<f32>(max_n * HIDDEN)?;
    for dtype in [GgmlType::Q4_0, GgmlType::Q4_K] {
        let w = MoeWeights {
            gate_inp: HostTensor {
                name: "gate_inp".into(),
                dtype: GgmlType::F32,
                dims: vec![HIDDEN, EXPERTS],
                bytes: TensorBytes::owned(router.iter().flat_map(|v| v.to_le_bytes()).collect()),
            },
            gate_exps: experts("gate", dtype, INTER, HIDDEN, 5)?,
            up_exps: experts("up", dtype, INTER, HIDDEN, 6)?,
            down_exps: experts("down", dtype, HIDDEN, INTER, 7)?,
        };
        let layer = MoeLayer::upload(&g, &w, cfg, HIDDEN, true)?;
        let expert_bytes = layer.gate_up.bytes_for(2 * INTER, HIDDEN) / EXPERTS
            + layer.down.bytes_for(HIDDEN, INTER) / EXPERTS;
        let mut s = MoeScratch::empty(&g)?;
        s.grow(&g, max_n, &cfg, HIDDEN)?;
        g.htod(&x, &mut s.hf, 0)?;
        for &n in &tokens {
            let io = MoeInputs {
                hf: s.hf.ptr,
                h: dh.ptr,
                q8: dq.ptr,
                x: dx.ptr,
                n,
                hidden: HIDDEN,
            };
            let chosen = run.path_for(&layer, n);
            let distinct = distinct_experts(&router, &x[..n * HIDDEN]);
            for path in MoePath::ALL {
                if !run.path_ok(&layer, path) {
                    continue;
                }
                // SAFETY: every address is a live allocation of this function (the scratch
                // grown for `max_n` tokens, the uploads sized for `max_n`), and every timed
                // run is synchronised (event) before any of them drops.
                let (med, spread) = time_us(&g, reps, || unsafe {
                    run.run_with(&layer, &s, &io, path).map_err(Into::into)
                })?;
                // SAFETY: as above.
                let stages = time_stages(&g, reps, |mark| unsafe {
                    run.run_marked(&layer, &s, &io, path, mark)
                })?;
                let sum: f64 = stages.iter().map(|(_, t)| t).sum();
                let stages: Vec<String> = stages
                    .iter()
                    .map(|(name, t)| format!("{name} {t:.1}"))
                    .collect();
                let mark = if path == chosen { " *" } else { "" };
                println!(
                    "| {dtype:?} | {n} | {path:?}{mark} | {med:.1} | {spread:.1} | {distinct} | {:.0} | {} = {sum:.1} |",
                    (distinct * expert_bytes) as f64 / med / 1e3,
                    stages.join(" + ")
                );
            }
        }
    }
    Ok(())
}

/// Experts the tokens `x` choose between them (the f32 router on the host).
fn distinct_experts(router: &[f32], x: &[f32]) -> usize {
    let mut used = [false; EXPERTS];
    for t in x.chunks_exact(HIDDEN) {
        let mut l: Vec<(f32, usize)> = router
            .chunks_exact(HIDDEN)
            .enumerate()
            .map(|(e, r)| (r.iter().zip(t).map(|(a, b)| a * b).sum(), e))
            .collect();
        l.sort_by(|a, b| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1)));
        l[..TOP_K].iter().for_each(|&(_, e)| used[e] = true);
    }
    used.iter().filter(|u| **u).count()
}

/// Times `launch` with CUDA events: 10 warm-up runs, then `reps` timed ones.
fn time_us(g: &Gpu, reps: usize, mut launch: impl FnMut() -> Res<()>) -> Res<(f64, f64)> {
    for _ in 0..10 {
        launch()?;
    }
    let e0 = g.ctx.new_event(Some(EventFlags::CU_EVENT_DEFAULT))?;
    let e1 = g.ctx.new_event(Some(EventFlags::CU_EVENT_DEFAULT))?;
    let mut times = Vec::with_capacity(reps);
    for _ in 0..reps {
        e0.record(&g.stream)?;
        launch()?;
        e1.record(&g.stream)?;
        e1.synchronize()?;
        times.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
    }
    Ok(median_spread(times))
}

/// Each stage's median time: `launch` runs the block, calling its `mark` after each stage's
/// launches, where an event is recorded; a stage's time is the gap to the event before it.
/// 10 warm-up runs, then `reps` timed ones.
fn time_stages(
    g: &Gpu,
    reps: usize,
    mut launch: impl FnMut(
        &mut dyn FnMut(&'static str) -> Result<(), BackendError>,
    ) -> Result<(), BackendError>,
) -> Res<Vec<(&'static str, f64)>> {
    let new_event = || g.ctx.new_event(Some(EventFlags::CU_EVENT_DEFAULT));
    let start = new_event()?;
    let mut events = Vec::new();
    let mut names: Vec<&'static str> = Vec::new();
    let mut times: Vec<Vec<f64>> = Vec::new();
    for rep in 0..10 + reps {
        start.record(&g.stream)?;
        let mut used = 0;
        let mut seen = Vec::new();
        launch(&mut |name| {
            if used == events.len() {
                events.push(new_event().map_err(|e| BackendError::Cuda(e.to_string()))?);
            }
            events[used]
                .record(&g.stream)
                .map_err(|e| BackendError::Cuda(e.to_string()))?;
            used += 1;
            seen.push(name);
            Ok(())
        })?;
        events[..used].last().unwrap_or(&start).synchronize()?;
        if rep < 10 {
            continue;
        }
        if names.is_empty() {
            names = seen.clone();
            times = vec![Vec::with_capacity(reps); names.len()];
        }
        if seen != names {
            return Err(
                format!("the block's stages changed between runs: {names:?}, {seen:?}").into(),
            );
        }
        let mut prev = &start;
        for (i, e) in events[..used].iter().enumerate() {
            times[i].push(prev.elapsed_ms(e)? as f64 * 1e3);
            prev = e;
        }
    }
    Ok(names
        .into_iter()
        .zip(times)
        .map(|(n, t)| (n, median_spread(t).0))
        .collect())
}
