//! The quantized-weight kernels of `kernels/quant.cu` against the CPU backend: activation
//! quantization (bit for bit, from f16 and f32 rows), RMSNorm and SwiGLU straight into 8-bit
//! blocks, the whole-matrix dequantization to f16 (bit for bit), and both tensor-core matmuls
//! (the 64 × 64 tile and the pipelined split-K one) and the staged few-token kernel against the dp4a one on the same blocks (equal up to the f32
//! summation order). The quantized
//! matmuls against the CPU reference and the quantized embedding gather are tested in
//! backend_ops.rs, one body for every backend.
//! Outputs are poisoned with NaN first. Needs a GPU: ignored without one (see quire-testkit). Timing: `cargo run --release -p quire-backend --features cuda
//! --example cuda_matmul_bench`.

// The GPU-only parts compile with the `cuda` feature only; without it every test here fails
// when run (and is ignored unless QUIRE_REQUIRE_GPU is set: see quire-testkit).
#[cfg(feature = "cuda")]
use {
    half::f16,
    quire_backend::cpu::kquant::is_kquant,
    quire_backend::cpu::ops,
    quire_backend::cpu::quant::{quantize_row_q8a_scalar, BlockQ8A, QK},
    quire_backend::cuda::gpu::{Gpu, KArg},
    quire_backend::cuda::qmat::{QKernel, QuantKernels, Q8A_BYTES},
    quire_gguf::GgmlType,
    rand::{rngs::StdRng, Rng, SeedableRng},
};

/// Every stored type the quantized kernels read.
#[cfg(feature = "cuda")]
const ALL: [GgmlType; 6] = [
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q8_0,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

#[cfg(feature = "cuda")]
fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| quire_testkit::no_gpu(&e))
}

#[cfg(feature = "cuda")]
fn rnd(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

#[cfg(feature = "cuda")]
fn q8_bytes(blocks: &[BlockQ8A]) -> Vec<u8> {
    let mut v = Vec::with_capacity(blocks.len() * Q8A_BYTES);
    for b in blocks {
        v.extend(b.d.to_le_bytes());
        v.extend(b.s.to_le_bytes());
        v.extend(b.qs.iter().map(|&q| q as u8));
    }
    v
}

#[cfg(feature = "cuda")]
fn q8_from_bytes(bytes: &[u8]) -> Vec<BlockQ8A> {
    bytes
        .chunks_exact(Q8A_BYTES)
        .map(|c| {
            let mut b = BlockQ8A {
                d: f32::from_le_bytes(c[0..4].try_into().unwrap()),
                s: f32::from_le_bytes(c[4..8].try_into().unwrap()),
                ..Default::default()
            };
            for (q, &x) in b.qs.iter_mut().zip(&c[8..]) {
                *q = x as i8;
            }
            b
        })
        .collect()
}

#[cfg(feature = "cuda")]
fn cpu_q8(x: &[f32]) -> Vec<BlockQ8A> {
    let mut out = vec![BlockQ8A::default(); x.len() / QK];
    quantize_row_q8a_scalar(x, &mut out);
    out
}

/// Blocks quantized from rows that may differ in the last bits: scales within f16 rounding, every
/// value within one step, and at most 2% of them off by one.
#[cfg(feature = "cuda")]
fn assert_q8_close(got: &[BlockQ8A], want: &[BlockQ8A], what: &str) {
    assert_eq!(got.len(), want.len());
    let (mut off, mut total) = (0, 0);
    for (i, (g, w)) in got.iter().zip(want).enumerate() {
        assert!(
            (g.d - w.d).abs() <= 2e-3 * w.d.abs() + 1e-30,
            "{what} block {i}: d {} vs {}",
            g.d,
            w.d
        );
        for (a, b) in g.qs.iter().zip(&w.qs) {
            let diff = (*a as i32 - *b as i32).abs();
            assert!(diff <= 1, "{what} block {i}: q {a} vs {b}");
            off += (diff == 1) as usize;
            total += 1;
        }
    }
    assert!(off * 50 <= total, "{what}: {off}/{total} values off by one");
}

quire_testkit::gpu_test! {
    fn activation_quantization_is_the_cpus_bit_for_bit() {
        let g = gpu();
        let q = QuantKernels::new(&g).unwrap();
        let mut rng = StdRng::seed_from_u64(11);
        for (n, k) in [(1usize, 576usize), (5, 4096), (3, 96)] {
            let mut x: Vec<f16> = rnd(&mut rng, n * k, 4.0)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            // A zero block, and one with a single huge value.
            x[..QK].iter_mut().for_each(|v| *v = f16::ZERO);
            x[QK + 3] = f16::from_f32(1000.0);
            let dx = g.upload(&x).unwrap();
            let dq = g.upload(&vec![0xFFu8; n * k / QK * Q8A_BYTES]).unwrap();
            // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
            unsafe { q.quantize(&g, dx.ptr, false, dq.ptr, n, k) }.unwrap();
            let mut got = vec![0u8; dq.len];
            g.dtoh(&dq, &mut got).unwrap();
            let xf: Vec<f32> = x.iter().map(|v| v.to_f32()).collect();
            assert_eq!(got, q8_bytes(&cpu_q8(&xf)), "n={n} k={k}");
            // From f32 rows (the attention output before the o-projection): no f16 rounding first.
            let mut x32 = rnd(&mut rng, n * k, 4.0);
            x32[QK + 5] = -777.25;
            let dx = g.upload(&x32).unwrap();
            // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
            unsafe { q.quantize(&g, dx.ptr, true, dq.ptr, n, k) }.unwrap();
            g.dtoh(&dq, &mut got).unwrap();
            assert_eq!(got, q8_bytes(&cpu_q8(&x32)), "f32 n={n} k={k}");
        }
    }
}

quire_testkit::gpu_test! {
    fn rms_norm_and_swiglu_into_8_bits_match_the_cpu() {
        let g = gpu();
        let q = QuantKernels::new(&g).unwrap();
        let mut rng = StdRng::seed_from_u64(12);
        for dim in [576usize, 2048, 96] {
            let rows = 6;
            let x = rnd(&mut rng, rows * dim, 3.0);
            let w = rnd(&mut rng, dim, 2.0);
            let idx = [4i32, 0, 5];
            let (dx, dw, di) = (
                g.upload(&x).unwrap(),
                g.upload(&w).unwrap(),
                g.upload(&idx).unwrap(),
            );
            let dq = g
                .upload(&vec![0xFFu8; idx.len() * dim / QK * Q8A_BYTES])
                .unwrap();
            let threads = (dim.div_ceil(32) * 32).min(1024) as u32;
            // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
            unsafe { g.launch(
                &q.rms_norm_q8,
                (idx.len() as u32, 1, 1),
                (threads, 1, 1),
                &[
                    KArg::P(dx.ptr),
                    KArg::P(di.ptr),
                    KArg::P(dw.ptr),
                    KArg::P(dq.ptr),
                    KArg::I(dim as i32),
                    KArg::F(1e-5),
                ],
            ) }
            .unwrap();
            let mut got = vec![0u8; dq.len];
            g.dtoh(&dq, &mut got).unwrap();
            let mut want = vec![];
            for &r in &idx {
                let mut o = vec![0f32; dim];
                let r = r as usize;
                ops::rms_norm(&x[r * dim..(r + 1) * dim], &w, 1e-5, &mut o);
                want.extend(cpu_q8(&o));
            }
            assert_q8_close(&q8_from_bytes(&got), &want, &format!("rms_norm dim {dim}"));

            // SwiGLU over [n, 2 * inter] with inter = dim.
            let gu = rnd(&mut rng, rows * 2 * dim, 4.0);
            let dgu = g.upload(&gu).unwrap();
            let blocks = rows * dim / QK;
            let dq = g.upload(&vec![0xFFu8; blocks * Q8A_BYTES]).unwrap();
            // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
            unsafe { g.launch(
                &q.swiglu_q8,
                (blocks.div_ceil(8) as u32, 1, 1),
                (256, 1, 1),
                &[
                    KArg::P(dgu.ptr),
                    KArg::P(dq.ptr),
                    KArg::I(dim as i32),
                    KArg::L(blocks as i64),
                ],
            ) }
            .unwrap();
            let mut got = vec![0u8; dq.len];
            g.dtoh(&dq, &mut got).unwrap();
            let mut act = vec![0f32; rows * dim];
            ops::swiglu(&gu, dim, &mut act);
            assert_q8_close(
                &q8_from_bytes(&got),
                &cpu_q8(&act),
                &format!("swiglu inter {dim}"),
            );
        }
    }
}

quire_testkit::gpu_test! {
    /// The whole-matrix dequantization (the many-token matmuls' f16 weights): each value the
    /// format's dequantized one rounded to f16, bit for bit. (The quantized embedding gather and
    /// matmuls are in backend_ops.rs, one body for every backend.)
    fn whole_matrix_dequantization_is_the_rounded_rows() {
        let g = gpu();
        let q = QuantKernels::new(&g).unwrap();
        let mut rng = StdRng::seed_from_u64(14);
        for dtype in ALL {
            let (vocab, hidden) = (50usize, if is_kquant(dtype) { 768 } else { 576 });
            let table = rnd(&mut rng, vocab * hidden, 1.0);
            let mut tb = vec![];
            quire_gguf::quantize_row(dtype, &table, &mut tb).unwrap();
            let dt = g.upload(&tb).unwrap();
            let out = g.upload(&vec![f16::NAN; vocab * hidden]).unwrap();
            // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
            unsafe { q.dequantize(&g, dtype, dt.ptr, out.ptr, vocab * hidden) }
                .unwrap();
            let mut got = vec![f16::ZERO; vocab * hidden];
            g.dtoh(&out, &mut got).unwrap();
            let mut want = vec![0f32; vocab * hidden];
            quire_gguf::dequantize_row(dtype, &tb, &mut want).unwrap();
            let want: Vec<u16> = want.iter().map(|&v| f16::from_f32(v).to_bits()).collect();
            let got: Vec<u16> = got.iter().map(|v| v.to_bits()).collect();
            assert_eq!(got, want, "{} dequantize", dtype.name());
        }
    }
}

quire_testkit::gpu_test! {
    /// Both tensor-core kernels (the 64 × 64 tile and the pipelined split-K one) against the dp4a
    /// kernel on the same weight and activation blocks, every type: tiles cut at odd row and
    /// token counts (rows not multiples of 64; 1, 7, 9, 17, 33, 63, 67, 127, 130 tokens across the
    /// 8/16/32/64-token tiles), K steps cut short (legacy rows of 3, 11 and 45 blocks against the
    /// 8-block step; odd block counts put activation rows 8 bytes off the 16-byte grid and
    /// legacy rows 2 bytes off, and the last 16-byte unit past the matrix's end), rows of 4096
    /// values split over several CTAs, one token, with and without the residual add
    /// (NaN-poisoned output when without). Each block's integer dot is exact on all and its scale
    /// terms the same f32 expressions, so only the order of the sums over blocks differs: every
    /// value within 2e-5 of the output's RMS. The pipelined kernel runs twice and must give the
    /// same bits (the split partials are summed in a fixed order; the tile counters reset).
    fn tensor_core_matmul_equals_the_dp4a_kernel() {
        let g = gpu();
        let q = QuantKernels::new(&g).unwrap();
        let mut rng = StdRng::seed_from_u64(15);
        for dtype in ALL {
            let unit: usize = if is_kquant(dtype) { 256 } else { 32 };
            let shapes = [
                (130usize, 3 * unit, 67usize),
                (67, 11 * 32, 64),
                (67, 45 * 32, 33),
                (64, unit, 9),
                (5, 2 * unit, 130),
                (200, unit, 1),
                (70, 4096, 7),
                (70, 4096, 17),
                (129, 4096, 33),
                (61, 4096, 63),
                (200, 4096, 127),
            ];
            for (rows, cols, n) in shapes {
                if !cols.is_multiple_of(unit) {
                    continue; // 11 blocks of 32 is no whole super-block
                }
                let w = rnd(&mut rng, rows * cols, 1.0);
                let mut wb = vec![];
                quire_gguf::quantize_row(dtype, &w, &mut wb).unwrap();
                let x = rnd(&mut rng, n * cols, 2.0);
                let xq = q8_bytes(&cpu_q8(&x));
                let (dw, dq) = (g.upload(&wb).unwrap(), g.upload(&xq).unwrap());
                assert!(q.tc_ok(dw.ptr), "this test needs an sm_80+ GPU");
                for beta in [0.0f32, 1.0] {
                    let y0 = if beta == 0.0 {
                        vec![f32::NAN; n * rows]
                    } else {
                        rnd(&mut rng, n * rows, 1.0)
                    };
                    let mut outs = vec![];
                    let kernels = [
                        QKernel::Dp4a,
                        QKernel::TensorCore,
                        QKernel::TensorCorePipe,
                        QKernel::TensorCorePipe,
                    ];
                    for kernel in kernels {
                        let dy = g.upload(&y0).unwrap();
                        // SAFETY: every address is a live allocation of this test (g.upload),
                        // sized for the launch's shape, and the stream is synchronised (dtoh)
                        // before any of them drops.
                        unsafe {
                            q.matmul_with(kernel, &g, dtype, dw.ptr, dq.ptr, dy.ptr, n, cols, rows, beta)
                        }
                        .unwrap();
                        let mut y = vec![0f32; n * rows];
                        g.dtoh(&dy, &mut y).unwrap();
                        outs.push(y);
                    }
                    let want = &outs[0];
                    let case = format!("{} {rows}x{cols} n={n} beta={beta}", dtype.name());
                    let rms = (want.iter().map(|v| (v * v) as f64).sum::<f64>()
                        / want.len() as f64)
                        .sqrt() as f32;
                    assert!(rms.is_finite() && rms > 0.0, "{case}: dp4a output RMS {rms}");
                    let plan = q.tcp_plan(dtype, rows, cols, n);
                    for (name, got) in [("64x64 tile", &outs[1]), ("pipelined", &outs[2])] {
                        for (i, (a, b)) in got.iter().zip(want).enumerate() {
                            assert!(
                                (a - b).abs() <= 2e-5 * rms,
                                "{case} ({plan:?}): token {} row {}: {name} tensor cores {a}, \
                                 dp4a {b}",
                                i / rows,
                                i % rows
                            );
                        }
                    }
                    assert!(
                        outs[2].iter().zip(&outs[3]).all(|(a, b)| a.to_bits() == b.to_bits()),
                        "{case} ({plan:?}): two runs of the pipelined kernel differ"
                    );
                }
            }
        }
    }
}

/// Row lengths (values) for the staged-kernel test, per type: the shortest row the kernel takes
/// (16-byte aligned rows: 8 blocks of Q4_0/Q8_0/Q6_K, 4 of Q4_1, one K-quant super-block of
/// Q4_K/Q5_K) and one of a full stage plus that much, so the last stage is cut short (Q6_K rows
/// are always whole stages: three of them).
#[cfg(feature = "cuda")]
fn staged_row_lengths(dtype: GgmlType) -> [usize; 2] {
    match dtype {
        GgmlType::Q4_0 => [8 * 32, (64 + 8) * 32],
        GgmlType::Q4_1 => [4 * 32, (64 + 4) * 32],
        GgmlType::Q8_0 => [8 * 32, (32 + 8) * 32],
        GgmlType::Q6_K => [8 * 256, 3 * 8 * 256],
        _ => [256, (8 + 3) * 256],
    }
}

quire_testkit::gpu_test! {
    /// The staged kernel (`mmv_*`, rows through shared memory by 16-byte loads) against the dp4a
    /// kernel reading the rows directly, every type: odd row counts (a CTA's last warp with one
    /// row, a row pair cut short), the last stage of a row cut short, one token and 3, 8 and 9
    /// (two token groups, the second of one), with and without the residual add (NaN-poisoned
    /// output when without). Both run `block_dot` per 32-block, so only the f32 summation order
    /// differs: every value within 2e-5 of the output's RMS. Rows that do not start 16-byte
    /// aligned are refused with an error, and `pick` sends them to the dp4a kernel.
    fn staged_gemv_equals_the_dp4a_kernel() {
        let g = gpu();
        let q = QuantKernels::new(&g).unwrap();
        let mut rng = StdRng::seed_from_u64(16);
        for dtype in ALL {
            for cols in staged_row_lengths(dtype) {
                for (rows, n) in [(131usize, 1usize), (7, 1), (1, 1), (37, 3), (9, 8), (131, 9)] {
                    let w = rnd(&mut rng, rows * cols, 1.0);
                    let mut wb = vec![];
                    quire_gguf::quantize_row(dtype, &w, &mut wb).unwrap();
                    let x = rnd(&mut rng, n * cols, 2.0);
                    let xq = q8_bytes(&cpu_q8(&x));
                    let (dw, dq) = (g.upload(&wb).unwrap(), g.upload(&xq).unwrap());
                    assert!(QuantKernels::mmv_ok(dtype, cols, dw.ptr), "{} k={cols}", dtype.name());
                    if n < quire_backend::cuda::qmat::TC_MIN_TOKENS {
                        assert_eq!(q.pick(dtype, n, cols, dw.ptr), QKernel::Staged);
                    }
                    for beta in [0.0f32, 1.0] {
                        let y0 = if beta == 0.0 {
                            vec![f32::NAN; n * rows]
                        } else {
                            rnd(&mut rng, n * rows, 1.0)
                        };
                        let mut outs = vec![];
                        for kernel in [QKernel::Dp4a, QKernel::Staged] {
                            let dy = g.upload(&y0).unwrap();
                            // SAFETY: every address is a live allocation of this test (g.upload),
                            // sized for the launch's shape, and the stream is synchronised (dtoh)
                            // before any of them drops.
                            unsafe {
                                q.matmul_with(kernel, &g, dtype, dw.ptr, dq.ptr, dy.ptr, n, cols, rows, beta)
                            }
                            .unwrap();
                            let mut y = vec![0f32; n * rows];
                            g.dtoh(&dy, &mut y).unwrap();
                            outs.push(y);
                        }
                        let (want, got) = (&outs[0], &outs[1]);
                        let case = format!("{} {rows}x{cols} n={n} beta={beta}", dtype.name());
                        let rms = (want.iter().map(|v| (v * v) as f64).sum::<f64>()
                            / want.len() as f64)
                            .sqrt() as f32;
                        assert!(rms.is_finite() && rms > 0.0, "{case}: dp4a output RMS {rms}");
                        for (i, (a, b)) in got.iter().zip(want).enumerate() {
                            assert!(
                                (a - b).abs() <= 2e-5 * rms,
                                "{case}: token {} row {}: staged {a}, dp4a {b}",
                                i / rows,
                                i % rows
                            );
                        }
                    }
                }
            }
        }
        // Q6_K rows of 3 super-blocks (630 bytes) do not start 16-byte aligned.
        let (rows, cols) = (5usize, 3 * 256);
        let mut wb = vec![];
        quire_gguf::quantize_row(GgmlType::Q6_K, &rnd(&mut rng, rows * cols, 1.0), &mut wb).unwrap();
        let dw = g.upload(&wb).unwrap();
        let dq = g.upload(&q8_bytes(&cpu_q8(&rnd(&mut rng, cols, 2.0)))).unwrap();
        let dy = g.upload(&vec![0f32; rows]).unwrap();
        assert!(!QuantKernels::mmv_ok(GgmlType::Q6_K, cols, dw.ptr));
        assert_eq!(q.pick(GgmlType::Q6_K, 1, cols, dw.ptr), QKernel::Dp4a);
        // SAFETY: as above; the call is refused before any launch.
        let e = unsafe {
            q.matmul_with(QKernel::Staged, &g, GgmlType::Q6_K, dw.ptr, dq.ptr, dy.ptr, 1, cols, rows, 0.0)
        };
        assert!(e.is_err(), "an unaligned row was not refused");
    }
}
