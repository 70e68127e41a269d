//! Microbenchmark of the GPU matmuls a decode step runs: cuBLAS on f16 weights against the
//! quantized kernels (Q8_0, Q4_0, Q4_1, and Q4_K/Q5_K/Q6_K where rows hold whole super-blocks,
//! with 8-bit activations) on the weight shapes of Llama-3-8B,
//! Llama-3.2-1B and SmolLM2-135M, for 1 and 8 tokens. Every case is timed with CUDA events over
//! many launches after a warm-up; it prints the median and spread per launch and the weight bytes
//! read per second, beside the read roof (measured, see below, or `--ceiling-gbs`).
//!
//! The last table times the paths a quantized weight can take for many tokens on the Llama-3-8B
//! shapes (qkv, o, gate_up, down, output; Q4_0, Q4_K, Q5_K, Q6_K, Q8_0 at 8 to 512 tokens and 17):
//! the dp4a kernel (eight tokens per CTA), the 64 × 64 int8 tensor-core kernel, the pipelined
//! split-K tensor-core kernel, and dequantization to f16 followed by cuBLAS (both timed together,
//! as a step runs them). It prints microseconds, stored weight bytes per second, percent of the
//! read roof and TFLOP/s per path, and marks the one `QuantKernels::matmul` picks;
//! `qmat::TC_MIN_TOKENS` and `CudaOptions::dequant_gemm_tokens` are set from it.
//!
//! The one-token table (first) times the two kernels a decode step can run on a quantized weight,
//! the dp4a kernel reading the rows directly (`mmq_*_t1`) and the staged one (`mmv_*_t1`,
//! 16-byte loads through shared memory), for Q4_0, Q4_K, Q6_K and Q8_0 on the 8B shapes, in
//! microseconds, stored weight bytes per second and percent of the read roof, which is measured
//! first (a read-only pass over 2 GiB, `read_roof` in quant.cu) unless `--ceiling-gbs` names one.
//!
//! `cargo run --release -p quire-backend --features cuda --example cuda_matmul_bench [-- --reps 200]`
//! (`--only t1` runs the one-token table alone, `--only decode` it and the decode table,
//! `--only many` the many-token table).

use half::f16;
use quire_backend::cpu::quant::{quantize_row_q8a, BlockQ8A, QK};
use quire_backend::cuda::gpu::{EventFlags, Gpu, HostBuf, KArg};
use quire_backend::cuda::qmat::{QKernel, QuantKernels, Q8A_BYTES};
use quire_gguf::GgmlType;

#[derive(Clone, Copy, PartialEq)]
enum Kind {
    MatMul,
    Gemv,
    GemvHost,
}

fn median_spread(mut v: Vec<f64>) -> (f64, f64) {
    v.sort_by(|a, b| a.partial_cmp(b).unwrap());
    let m = v[v.len() / 2];
    let p10 = v[v.len() / 10];
    let p90 = v[v.len() * 9 / 10];
    (m, (p90 - p10) / 2.0)
}

/// Times `launch` with CUDA events: 10 warm-up launches, then `reps` timed ones; the median and
/// the half-spread between the 10th and 90th percentiles, in microseconds.
fn time_us(
    g: &Gpu,
    reps: usize,
    mut launch: impl FnMut() -> Result<(), Box<dyn std::error::Error>>,
) -> Result<(f64, f64), Box<dyn std::error::Error>> {
    for _ in 0..10 {
        launch()?;
    }
    let mut times = Vec::with_capacity(reps);
    let e0 = g.ctx.new_event(Some(EventFlags::CU_EVENT_DEFAULT))?;
    let e1 = g.ctx.new_event(Some(EventFlags::CU_EVENT_DEFAULT))?;
    for _ in 0..reps {
        e0.record(&g.stream)?;
        launch()?;
        e1.record(&g.stream)?;
        e1.synchronize()?;
        times.push(e0.elapsed_ms(&e1)? as f64 * 1e3);
    }
    Ok(median_spread(times))
}

/// 8-bit activation blocks of `x` as the device holds them.
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

/// The device's read roof in GB/s: the median of `reps` read-only passes over 2 GiB.
fn read_roof_gbs(
    g: &Gpu,
    q: &QuantKernels,
    reps: usize,
) -> Result<f64, Box<dyn std::error::Error>> {
    let bytes = 2usize << 30;
    let buf = g.alloc::<u8>(bytes)?;
    let sink = g.alloc::<u32>(1)?;
    let (med, _) = time_us(g, reps.min(50), || {
        // SAFETY: `buf` (bytes / 16 words) and `sink` are live allocations of this function,
        // and each timed launch is synchronised (event) before either drops.
        unsafe {
            g.launch(
                &q.read_roof,
                // 16 CTAs per SM of an H100; the kernel's grid-stride loop takes any grid.
                (132 * 16, 1, 1),
                (256, 1, 1),
                &[
                    KArg::P(buf.ptr),
                    KArg::L((bytes / 16) as i64),
                    KArg::P(sink.ptr),
                ],
            )
        }?;
        Ok(())
    })?;
    Ok(bytes as f64 / (med * 1e-6) / 1e9)
}

/// The one-token table: the dp4a and the staged kernel per type on the 8B shapes, against `roof`.
fn one_token(
    g: &Gpu,
    q: &QuantKernels,
    reps: usize,
    roof: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    println!();
    println!("| rows x cols (out x k) | dtype | kernel | median us | +/- | weight GB/s | % of {roof:.0} |");
    println!("|---|---|---|---:|---:|---:|---:|");
    for (out, k) in [
        (4096usize, 4096usize),
        (14336, 4096),
        (4096, 14336),
        (128256, 4096),
    ] {
        let pattern: Vec<f32> = (0..k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let x: Vec<f32> = (0..k)
            .map(|i| ((i * 104729 % 997) as f32 / 498.0) - 1.0)
            .collect();
        let dxq = g.upload(&q8_device_bytes(&x))?;
        let dy = g.alloc::<f32>(out)?;
        for dtype in [
            GgmlType::Q4_0,
            GgmlType::Q4_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
        ] {
            let mut row = vec![];
            quire_gguf::quantize_row(dtype, &pattern, &mut row)?;
            let bytes = row.len() * out;
            let dw = g.upload(&row.repeat(out))?;
            for (name, kernel) in [
                ("dp4a mmq_t1", QKernel::Dp4a),
                ("staged mmv_t1", QKernel::Staged),
            ] {
                if kernel == QKernel::Staged && !QuantKernels::mmv_ok(dtype, k, dw.ptr) {
                    continue;
                }
                let (med, spread) = time_us(g, reps, || {
                    // SAFETY: every address is a live allocation of this function (g.upload /
                    // g.alloc) sized for one token of this shape, and each timed launch is
                    // synchronised (event) before any of them drops.
                    unsafe {
                        q.matmul_with(kernel, g, dtype, dw.ptr, dxq.ptr, dy.ptr, 1, k, out, 0.0)
                    }?;
                    Ok(())
                })?;
                let gbs = bytes as f64 / (med * 1e-6) / 1e9;
                println!(
                    "| {out} x {k} | {} | {name} | {med:.1} | {spread:.1} | {gbs:.0} | {:.0}% |",
                    dtype.name(),
                    100.0 * gbs / roof
                );
            }
        }
    }
    Ok(())
}

/// The many-token table: per Llama-3-8B shape, type and token count, every path a quantized weight
/// can take for many tokens — dp4a (eight tokens per CTA), the 64 × 64 tensor-core tile kernel,
/// the pipelined split-K tensor-core kernel (its token tile and K splits shown), and dequantize +
/// cuBLAS (both timed together, as a step runs them) — in microseconds, stored weight bytes per
/// second, percent of the read roof and TFLOP/s. The last column marks the path
/// `QuantKernels::matmul` takes (below `CudaOptions::dequant_gemm_tokens`).
fn many_tokens(
    g: &Gpu,
    q: &QuantKernels,
    reps: usize,
    roof: f64,
) -> Result<(), Box<dyn std::error::Error>> {
    const TOKENS: [usize; 8] = [8, 16, 32, 64, 128, 256, 512, 17];
    let max_n = 512;
    println!();
    println!(
        "| rows x cols (out x k) | dtype | tokens | path | median us | +/- | weight GB/s | % of {roof:.0} | TFLOP/s | matmul's |"
    );
    println!("|---|---|---:|---|---:|---:|---:|---:|---:|---|");
    for (name, out, k) in [
        ("qkv", 6144usize, 4096usize),
        ("o", 4096, 4096),
        ("gate_up", 28672, 4096),
        ("down", 4096, 14336),
        ("output", 128256, 4096),
    ] {
        let pattern: Vec<f32> = (0..k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let x: Vec<f32> = (0..max_n * k)
            .map(|i| ((i * 104729 % 997) as f32 / 498.0) - 1.0)
            .collect();
        let dxq = g.upload(&q8_device_bytes(&x))?;
        let dx16 = g.upload(&x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>())?;
        let dy = g.alloc::<f32>(max_n * out)?;
        let dwdq = g.alloc::<f16>(out * k)?;
        for dtype in [
            GgmlType::Q4_0,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
            GgmlType::Q8_0,
        ] {
            let mut row = vec![];
            quire_gguf::quantize_row(dtype, &pattern, &mut row)?;
            let bytes = row.len() * out;
            let dw = g.upload(&row.repeat(out))?;
            for n in TOKENS {
                let chosen = q.pick(dtype, n, k, dw.ptr);
                let paths = [
                    ("dp4a", Some(QKernel::Dp4a), n <= 64),
                    ("TC 64x64", Some(QKernel::TensorCore), n <= 128),
                    ("TC pipelined", Some(QKernel::TensorCorePipe), n >= 8),
                    ("dequant+cuBLAS", None, n >= 64),
                ];
                for (path, kernel, wanted) in paths {
                    if !wanted
                        || (kernel == Some(QKernel::TensorCore) && !q.tc_ok(dw.ptr))
                        || (kernel == Some(QKernel::TensorCorePipe)
                            && !(q.tc_ok(dw.ptr) && q.tcp_ok(dtype, n)))
                    {
                        continue;
                    }
                    let (med, spread) = time_us(g, reps, || {
                        // SAFETY: every address is a live allocation of this function (g.upload /
                        // g.alloc) sized for `max_n` tokens of this shape, and each timed launch
                        // is synchronised (event) before any of them drops.
                        unsafe {
                            match kernel {
                                Some(kernel) => q.matmul_with(
                                    kernel, g, dtype, dw.ptr, dxq.ptr, dy.ptr, n, k, out, 0.0,
                                )?,
                                None => {
                                    q.dequantize(g, dtype, dw.ptr, dwdq.ptr, out * k)?;
                                    g.gemm_f16(dx16.ptr, dwdq.ptr, dy.ptr, n, k, out, 0.0)?
                                }
                            }
                        }
                        Ok(())
                    })?;
                    let gbs = bytes as f64 / (med * 1e-6) / 1e9;
                    let tflops = 2.0 * (n * k * out) as f64 / (med * 1e-6) / 1e12;
                    let label = if kernel == Some(QKernel::TensorCorePipe) {
                        let p = q.tcp_plan(dtype, out, k, n);
                        format!("{path} (tile {}, {} K splits)", p.nt, p.grid.2)
                    } else {
                        path.to_string()
                    };
                    // The engine's step: `matmul`'s pick below 256 tokens (the default
                    // `dequant_gemm_tokens`), dequantize + cuBLAS from there.
                    let taken = if n < 256 {
                        kernel == Some(chosen)
                    } else {
                        kernel.is_none()
                    };
                    let mark = if taken { "<-" } else { "" };
                    println!(
                        "| {name} {out} x {k} | {} | {n} | {label} | {med:.1} | {spread:.1} | {gbs:.0} | {:.0}% | {tflops:.2} | {mark} |",
                        dtype.name(),
                        100.0 * gbs / roof
                    );
                }
            }
        }
    }
    Ok(())
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
    let only = args
        .iter()
        .position(|a| a == "--only")
        .and_then(|i| args.get(i + 1))
        .map(String::as_str);
    if let Some(o) = only {
        if !["many", "decode", "t1"].contains(&o) {
            return Err(format!("--only takes `t1`, `decode` or `many`, not `{o}`").into());
        }
    }
    let g = Gpu::new(0)?;
    let q = QuantKernels::new(&g)?;
    let gemv = quire_backend::cuda::gemv::Gemv::new(&g)?;
    println!(
        "device: {} ({}), {reps} timed launches per case",
        g.name, g.arch
    );
    let ceiling = match arg("--ceiling-gbs", 0.0) {
        c if c > 0.0 => c,
        _ => read_roof_gbs(&g, &q, reps)?,
    };
    println!("read roof: {ceiling:.0} GB/s");
    if only == Some("many") {
        return many_tokens(&g, &q, reps, ceiling);
    }
    one_token(&g, &q, reps, ceiling)?;
    if only == Some("t1") {
        return Ok(());
    }
    println!();
    println!(
        "| shape | k x out | dtype | tokens | median us | +/- | weight GB/s | % of {ceiling:.0} |"
    );
    println!("|---|---|---|---:|---:|---:|---:|---:|");
    let shapes = [
        ("8B qkv", 4096usize, 6144usize),
        ("8B gate_up", 4096, 28672),
        ("8B down", 14336, 4096),
        ("8B output", 4096, 128256),
        ("1B gate_up", 2048, 16384),
        ("1B down", 8192, 2048),
        ("135M gate_up", 576, 3072),
        ("135M down", 1536, 576),
        ("135M output", 576, 49152),
    ];
    // The output projections also run the form a one-row decode step uses: RMSNorm input, logits
    // stored into mapped page-locked host memory (`gemv host`).
    let (_host_logits, host_y) = HostBuf::<f32>::mapped(128256)?;
    for (name, k, out) in shapes {
        // Weights: a repeated random-ish pattern (speed does not depend on the values).
        let pattern: Vec<f32> = (0..k)
            .map(|i| ((i * 7919 % 1000) as f32 / 500.0) - 1.0)
            .collect();
        let x: Vec<f32> = (0..8 * k)
            .map(|i| ((i * 104729 % 997) as f32 / 498.0) - 1.0)
            .collect();
        let dxq = g.upload(&q8_device_bytes(&x))?;
        let dx16 = g.upload(&x.iter().map(|&v| f16::from_f32(v)).collect::<Vec<_>>())?;
        let dy = g.alloc::<f32>(8 * out)?;
        let (dxf, dnw) = (g.upload(&x[..k])?, g.upload(&vec![1.0f32; k])?);
        for dtype in [
            GgmlType::F16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ] {
            if !k.is_multiple_of(dtype.block_size()) {
                continue; // K-quants need rows of whole 256-element super-blocks
            }
            let mut row = vec![];
            quire_gguf::quantize_row(dtype, &pattern, &mut row)?;
            let mut bytes = Vec::with_capacity(row.len() * out);
            for _ in 0..out {
                bytes.extend_from_slice(&row);
            }
            let dw = g.upload(&bytes)?;
            // (tokens, kernel): cuBLAS or the quantized matmul, quire's GEMV (the one-token f16
            // path), or its host-output form.
            let mut cases = vec![(1usize, Kind::MatMul), (8, Kind::MatMul)];
            if dtype == GgmlType::F16 {
                cases.insert(1, (1, Kind::Gemv));
                if name.ends_with("output") {
                    cases.insert(2, (1, Kind::GemvHost));
                }
            }
            for (n, kind) in cases {
                let launch = || -> Result<(), Box<dyn std::error::Error>> {
                    if kind == Kind::GemvHost {
                        let input = quire_backend::cuda::gemv::GemvInput::Norm {
                            x: dxf.ptr,
                            rows_idx: 0,
                            norm_w: dnw.ptr,
                            eps: 1e-5,
                        };
                        // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                        unsafe { gemv.run_host(&g, dw.ptr, input, host_y, k, out) }?;
                    } else if kind == Kind::Gemv {
                        // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                        unsafe {
                            gemv.run(
                                &g,
                                dw.ptr,
                                quire_backend::cuda::gemv::GemvInput::F16 { x: dx16.ptr },
                                dy.ptr,
                                k,
                                out,
                                0.0,
                            )
                        }?;
                    } else if dtype == GgmlType::F16 {
                        // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                        unsafe { g.gemm_f16(dx16.ptr, dw.ptr, dy.ptr, n, k, out, 0.0) }?;
                    } else {
                        // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                        unsafe { q.matmul(&g, dtype, dw.ptr, dxq.ptr, dy.ptr, n, k, out, 0.0) }?;
                    }
                    Ok(())
                };
                let (med, spread) = time_us(&g, reps, launch)?;
                let gbs = bytes.len() as f64 / (med * 1e-6) / 1e9;
                println!(
                    "| {name} | {k} x {out} | {}{} | {n} | {med:.1} | {spread:.1} | {gbs:.0} | {:.0}% |",
                    dtype.name(),
                    match kind {
                        Kind::GemvHost => " gemv host",
                        Kind::Gemv => " gemv",
                        Kind::MatMul if dtype == GgmlType::F16 => " cuBLAS",
                        Kind::MatMul => "",
                    },
                    100.0 * gbs / ceiling
                );
            }
        }
    }
    if only != Some("decode") {
        many_tokens(&g, &q, reps, ceiling)?;
    }
    Ok(())
}
