//! The f16 GEMV of decode steps (`kernels/gemv.cu`) against f64 dot products of the same f16
//! values on the CPU: 1, 2, 3, 5 and 8 tokens, real and odd shapes (k not a multiple of the
//! kernel's 128-wide chunk, rows not a multiple of its 16-row tile), beta 0 and 1, every warp
//! count. Outputs are poisoned with NaN first, and the memory past the written region must come
//! back bit for bit. Needs a GPU; skipped without one unless QUIRE_REQUIRE_GPU is set. Timing:
//! `cargo run --release -p quire-backend --features cuda --example cuda_matmul_bench`.
#![cfg(feature = "cuda")]

use half::f16;
use quire_backend::cuda::gemv::{choose_warps, Gemv, MAX_TOKENS, MAX_WARPS};
use quire_backend::cuda::gpu::Gpu;
use rand::{rngs::StdRng, Rng, SeedableRng};
use rayon::prelude::*;

fn gpu() -> Option<Gpu> {
    match Gpu::new(0) {
        Ok(g) => Some(g),
        Err(e) if std::env::var_os("QUIRE_REQUIRE_GPU").is_some() => panic!("{e}"),
        Err(e) => {
            eprintln!("SKIPPED (no GPU): {e}");
            None
        }
    }
}

fn rnd_f16(rng: &mut StdRng, n: usize) -> Vec<f16> {
    (0..n)
        .map(|_| f16::from_f32(rng.random_range(-1.0f32..1.0)))
        .collect()
}

/// Outputs past the written region: a NaN whose bits the kernel could not produce by accident.
const POISON: u32 = 0x7fc0_dead;
/// Elements of poison behind the `n × out` outputs.
const TAIL: usize = 4099;

/// One product on the GPU with `warps` (or the kernel's own choice) checked against the CPU.
#[allow(clippy::too_many_arguments)]
fn check(
    g: &Gpu,
    gv: &Gemv,
    rng: &mut StdRng,
    w: &[f16],
    dw: u64,
    k: usize,
    out: usize,
    n: usize,
    beta: f32,
    warps: Option<u32>,
) {
    let what = format!("k {k} out {out} n {n} beta {beta} warps {warps:?}");
    let x = rnd_f16(rng, n * k);
    let dx = g.upload(&x).unwrap();
    // y: beta 0 outputs start as NaN (every one must be written); beta 1 ones as random values.
    let mut y0: Vec<f32> = if beta == 0.0 {
        vec![f32::NAN; n * out]
    } else {
        (0..n * out).map(|_| rng.random_range(-4.0..4.0)).collect()
    };
    y0.extend(std::iter::repeat_n(f32::from_bits(POISON), TAIL));
    let dy = g.upload(&y0).unwrap();
    match warps {
        Some(wp) => gv.matmul_with(g, wp, dx.ptr, dw, dy.ptr, n, k, out, beta),
        None => gv.matmul(g, dx.ptr, dw, dy.ptr, n, k, out, beta),
    }
    .unwrap_or_else(|e| panic!("{what}: {e}"));
    let mut got = vec![0f32; y0.len()];
    g.dtoh(&dy, &mut got).unwrap();

    let xf: Vec<f64> = x.iter().map(|v| v.to_f64()).collect();
    // Per (token, row): the exact dot product and Σ|w·x|, the scale of its rounding error.
    let want: Vec<(f64, f64)> = (0..n * out)
        .into_par_iter()
        .map(|i| {
            let (t, r) = (i / out, i % out);
            let (mut dot, mut l1) = (0f64, 0f64);
            for (a, b) in w[r * k..(r + 1) * k].iter().zip(&xf[t * k..(t + 1) * k]) {
                let p = a.to_f64() * b;
                dot += p;
                l1 += p.abs();
            }
            (dot + beta as f64 * y0[i] as f64, l1)
        })
        .collect();
    let (mut num, mut den) = (0f64, 0f64);
    for (i, &(want, l1)) in want.iter().enumerate() {
        let v = got[i] as f64;
        let (t, r) = (i / out, i % out);
        assert!(v.is_finite(), "{what}: y[{t}, {r}] not written ({v})");
        // f32 accumulation errs by ~1e-7 · Σ|w·x|; one wrong or missing product moves the sum by
        // ~0.3, a hundred times the bound.
        let tol = 1e-3 * want.abs() + 2e-5 * l1 + 1e-6;
        assert!(
            (v - want).abs() <= tol,
            "{what}: y[{t}, {r}] = {v}, want {want} (tolerance {tol:.2e})"
        );
        num += (v - want).powi(2);
        den += want.powi(2);
    }
    let e = (num / den.max(1e-300)).sqrt();
    assert!(e < 1e-3, "{what}: relative error {e:.2e}");
    for (j, v) in got[n * out..].iter().enumerate() {
        assert_eq!(
            v.to_bits(),
            POISON,
            "{what}: wrote {v} at y[{}], past the {n} x {out} outputs",
            n * out + j
        );
    }
}

#[test]
fn gemv_matches_f64_dot_products_on_real_and_odd_shapes() {
    let Some(g) = gpu() else { return };
    let gv = Gemv::new(&g).unwrap();
    let mut rng = StdRng::seed_from_u64(21);
    // (k, out): SmolLM2-135M, Llama-3-8B, a ragged tail chunk, a tiny matrix, 8 halves per row.
    let shapes = [
        (576usize, 1536usize),
        (1536, 576),
        (4096, 6144),
        (14336, 4096),
        (136, 33),
        (64, 7),
        (8, 1),
    ];
    for (k, out) in shapes {
        let w = rnd_f16(&mut rng, out * k);
        let dw = g.upload(&w).unwrap();
        for n in [1usize, 2, 3, 5, 8] {
            for beta in [0.0f32, 1.0] {
                check(&g, &gv, &mut rng, &w, dw.ptr, k, out, n, beta, None);
            }
        }
    }
}

#[test]
fn every_warp_count_gives_the_same_products() {
    let Some(g) = gpu() else { return };
    let gv = Gemv::new(&g).unwrap();
    let mut rng = StdRng::seed_from_u64(22);
    // 21 chunks of 128 and a 40-wide tail: warps above the chunk count idle, which must not matter.
    for (k, out) in [(2728usize, 50usize), (96, 17)] {
        let w = rnd_f16(&mut rng, out * k);
        let dw = g.upload(&w).unwrap();
        for warps in 1..=MAX_WARPS {
            for (n, beta) in [(1usize, 0.0f32), (4, 1.0), (MAX_TOKENS, 0.0)] {
                check(&g, &gv, &mut rng, &w, dw.ptr, k, out, n, beta, Some(warps));
            }
        }
    }
}

#[test]
fn shapes_the_kernel_does_not_take_are_left_to_cublas() {
    // No GPU needed: the rule the forward pass uses to pick the kernel.
    assert!(Gemv::supports(1, 4096, 4096, 0x1000, 0x2000));
    assert!(Gemv::supports(8, 8, 1, 0x1010, 0x2010));
    assert!(!Gemv::supports(0, 4096, 4096, 0x1000, 0x2000), "no tokens");
    assert!(!Gemv::supports(9, 4096, 4096, 0x1000, 0x2000), "9 tokens");
    assert!(!Gemv::supports(1, 4100, 4096, 0x1000, 0x2000), "k % 8");
    assert!(!Gemv::supports(1, 4096, 0, 0x1000, 0x2000), "no outputs");
    assert!(
        !Gemv::supports(1, 4096, 4096, 0x1008, 0x2000),
        "x unaligned"
    );
    assert!(
        !Gemv::supports(1, 4096, 4096, 0x1000, 0x2002),
        "w unaligned"
    );
    let Some(g) = gpu() else { return };
    let gv = Gemv::new(&g).unwrap();
    let dw = g.upload(&[f16::ONE; 64]).unwrap();
    let dx = g.upload(&[f16::ONE; 64]).unwrap();
    let dy = g.upload(&[0f32; 64]).unwrap();
    let e = gv.matmul(&g, dx.ptr + 8, dw.ptr, dy.ptr, 1, 8, 4, 0.0);
    assert!(e.is_err(), "an unaligned x must be refused, not launched");
    let e = gv.matmul_with(&g, MAX_WARPS + 1, dx.ptr, dw.ptr, dy.ptr, 1, 8, 4, 0.0);
    assert!(
        e.is_err(),
        "more warps than the kernel's shared memory holds"
    );
}

#[test]
fn warp_choice_fills_one_wave_and_never_exceeds_the_chunks() {
    // No GPU needed. An H100: 132 SMs holding 6, 3 or 1 CTAs of 4, 8 or 16 warps (80 registers).
    let h100 = |k, out| choose_warps(k, out, 132, [6, 3, 1]);
    assert_eq!(
        h100(4096, 28672),
        4,
        "8B gate_up: 1792 CTAs, many waves anyway"
    );
    assert_eq!(
        h100(14336, 4096),
        8,
        "8B down: 256 CTAs fit one wave of 8 warps"
    );
    assert_eq!(h100(4096, 6144), 8, "8B qkv");
    assert_eq!(h100(8192, 2048), 16, "1B down: 128 CTAs, one per SM");
    assert_eq!(h100(1536, 576), 8, "135M down: 12 chunks");
    assert_eq!(h100(576, 1536), 4, "135M: 5 chunks");
    assert_eq!(h100(64, 7), 1, "one chunk, one warp");
    for (k, out) in [(8usize, 1usize), (4096, 128256), (136, 33), (16384, 16)] {
        let w = h100(k, out);
        assert!((1..=MAX_WARPS).contains(&w), "k {k} out {out}: {w} warps");
        assert!(w as usize <= k.div_ceil(128), "k {k} out {out}: {w} warps");
    }
    let Some(g) = gpu() else { return };
    let gv = Gemv::new(&g).unwrap();
    for (k, out) in [
        (4096usize, 28672usize),
        (14336, 4096),
        (8192, 2048),
        (64, 7),
    ] {
        let w = gv.warps_for(k, out);
        assert!((1..=MAX_WARPS).contains(&w), "k {k} out {out}: {w} warps");
        eprintln!("k {k} out {out}: {w} warps on {}", g.name);
    }
}
