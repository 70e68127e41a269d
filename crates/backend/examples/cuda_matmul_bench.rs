//! Microbenchmark of the GPU matmuls a decode step runs: f16 weights through cuBLAS and through
//! quire's GEMV kernel (`kernels/gemv.cu`, 1, 2, 4 and 8 tokens) against the quantized kernels
//! (Q8_0, Q4_0, Q4_1 with 8-bit activations, 1 and 8 tokens) on the weight shapes of Llama-3-8B,
//! Llama-3.2-1B and SmolLM2-135M. Every case is timed with CUDA events over many launches after a
//! warm-up; it prints the median and spread per launch and the weight bytes read per second, beside
//! the copy ceiling (`--ceiling-gbs`, default 3000: a device-to-device copy on the H100 measured in
//! ../shared/notes).
//!
//! Matrices under the 50 MB L2 stay cached from one launch to the next, unlike in a real decode
//! step; `--flush-l2` reads a 256 MiB matrix before every timed launch (outside the timing).
//! `--f16-only` skips the quantized types; `--gemv-warps N` fixes the GEMV's warps per CTA.
//!
//! `cargo run --release -p quire-backend --features cuda --example cuda_matmul_bench [-- --reps 200]`

use half::f16;
use quire_backend::cpu::quant::{quantize_row_q8a, BlockQ8A, QK};
use quire_backend::cuda::gemv::Gemv;
use quire_backend::cuda::gpu::{EventFlags, Gpu};
use quire_backend::cuda::qmat::{QuantKernels, Q8A_BYTES};
use quire_gguf::GgmlType;

/// The L2 flush: a 256 MiB f16 matrix `[SCRUB_ROWS, SCRUB_K]` read by the GEMV.
const SCRUB_ROWS: usize = 32768;
const SCRUB_K: usize = 4096;

fn median_spread(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let m = v[v.len() / 2];
    let p10 = v[v.len() / 10];
    let p90 = v[v.len() * 9 / 10];
    (m, (p90 - p10) / 2.0)
}

fn main() -> Result<(), Box<dyn std::error::Error>> {
    let args: Vec<String> = std::env::args().collect();
    let arg = |name: &str, default: f64| {
        args.iter()
            .position(|a| a == name)
            .and_then(|i| args.get(i + 1))
            .map_or(default, |v| v.parse().expect("a number"))
    };
    let reps = arg("--reps", 100.0) as usize;
    let ceiling = arg("--ceiling-gbs", 3000.0);
    let flag = |name: &str| args.iter().any(|a| a == name);
    let (flush, f16_only) = (flag("--flush-l2"), flag("--f16-only"));
    let fixed_warps = arg("--gemv-warps", 0.0) as u32;
    let g = Gpu::new(0)?;
    let q = QuantKernels::new(&g)?;
    let gemv = Gemv::new(&g)?;
    let scrub = if flush {
        Some((
            g.alloc::<f16>(SCRUB_ROWS * SCRUB_K)?,
            g.alloc::<f16>(SCRUB_K)?,
            g.alloc::<f32>(SCRUB_ROWS)?,
        ))
    } else {
        None
    };
    println!(
        "device: {} ({}), {reps} timed launches per case, L2 {}",
        g.name,
        g.arch,
        if flush {
            "flushed before each launch"
        } else {
            "warm"
        }
    );
    println!(
        "| shape | k x out | kernel | tokens | median us | +/- | weight GB/s | % of {ceiling:.0} |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    let shapes = [
        ("8B qkv", 4096usize, 6144usize),
        ("8B o", 4096, 4096),
        ("8B gate_up", 4096, 28672),
        ("8B down", 14336, 4096),
        ("8B output", 4096, 128256),
        ("1B gate_up", 2048, 16384),
        ("1B down", 8192, 2048),
        ("135M gate_up", 576, 3072),
        ("135M down", 1536, 576),
    ];
    for (name, k, out) in shapes {
        // Weights: a repeated random-ish pattern (speed does not depend on the values).
        let pattern: Vec<f32> = (0..k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let x: Vec<f32> = (0..8 * k)
            .map(|i| ((i * 104729 % 997) as f32 / 498.0) - 1.0)
            .collect();
        let mut xq = vec![BlockQ8A::default(); 8 * k / QK];
        quantize_row_q8a(&x, &mut xq);
        let mut xq_bytes = Vec::with_capacity(xq.len() * Q8A_BYTES);
        for b in &xq {
            xq_bytes.extend(b.d.to_le_bytes());
            xq_bytes.extend(b.s.to_le_bytes());
            xq_bytes.extend(b.qs.iter().map(|&v| v as u8));
        }
        let dxq = g.upload(&xq_bytes)?;
        let dx16 = g.upload(&x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>())?;
        let dy = g.alloc::<f32>(8 * out)?;
        let dtypes: &[GgmlType] = if f16_only {
            &[GgmlType::F16]
        } else {
            &[
                GgmlType::F16,
                GgmlType::Q8_0,
                GgmlType::Q4_0,
                GgmlType::Q4_1,
            ]
        };
        for &dtype in dtypes {
            let mut row = vec![];
            quire_gguf::quantize_row(dtype, &pattern, &mut row)?;
            let mut bytes = Vec::with_capacity(row.len() * out);
            for _ in 0..out {
                bytes.extend_from_slice(&row);
            }
            let dw = g.upload(&bytes)?;
            // (kernel, label, token counts): f16 through cuBLAS and the GEMV.
            let kinds: &[(u8, &str, &[usize])] = if dtype == GgmlType::F16 {
                &[
                    (0, "F16 cuBLAS", &[1, 2, 4, 8]),
                    (1, "F16 gemv", &[1, 2, 4, 8]),
                ]
            } else {
                &[(2, dtype.name(), &[1, 8])]
            };
            for &(kind, label, tokens) in kinds {
                for &n in tokens {
                    let warps = if fixed_warps > 0 {
                        fixed_warps
                    } else {
                        gemv.warps_for(k, out)
                    };
                    let launch = || -> Result<(), Box<dyn std::error::Error>> {
                        match kind {
                            0 => g.gemm_f16(dx16.ptr, dw.ptr, dy.ptr, n, k, out, 0.0)?,
                            1 => gemv
                                .matmul_with(&g, warps, dx16.ptr, dw.ptr, dy.ptr, n, k, out, 0.0)?,
                            _ => q.matmul(&g, dtype, dw.ptr, dxq.ptr, dy.ptr, n, k, out, 0.0)?,
                        }
                        Ok(())
                    };
                    for _ in 0..10 {
                        launch()?;
                    }
                    let mut times = Vec::with_capacity(reps);
                    let e0 = g.ctx.new_event(Some(EventFlags::CU_EVENT_DEFAULT))?;
                    let e1 = g.ctx.new_event(Some(EventFlags::CU_EVENT_DEFAULT))?;
                    for _ in 0..reps {
                        if let Some((sw, sx, sy)) = &scrub {
                            // Reads only, so the lines it leaves in L2 are clean and nothing is
                            // written back during the timed launch.
                            gemv.matmul(&g, sx.ptr, sw.ptr, sy.ptr, 1, SCRUB_K, SCRUB_ROWS, 0.0)?;
                        }
                        e0.record(&g.stream)?;
                        launch()?;
                        e1.record(&g.stream)?;
                        e1.synchronize()?;
                        times.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
                    }
                    let (med, spread) = median_spread(times);
                    let gbs = bytes.len() as f64 / (med * 1e-6) / 1e9;
                    let label = if kind == 1 {
                        format!("{label} ({warps}w)")
                    } else {
                        label.to_string()
                    };
                    println!(
                        "| {name} | {k} x {out} | {label} | {n} | {med:.1} | {spread:.1} | {gbs:.0} | {:.0}% |",
                        100.0 * gbs / ceiling
                    );
                }
            }
        }
    }
    Ok(())
}
