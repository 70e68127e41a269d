//! The CUDA kernels whose forms have no counterpart in the other backends: the split argmax's
//! arrival counters launch after launch (and the one-CTA `argmax_rows`), the embedding gather
//! that reads the step's ids from mapped host memory, and quire's GEMV in all its forms (fused
//! RMSNorm and SwiGLU inputs, the GLU output, the EARLY and host-output forms) against f64 dot
//! products and cuBLAS. The ops every backend has (RMSNorm, embedding, RoPE, SwiGLU, argmax,
//! matmul) are tested in backend_ops.rs, one body for every backend. Outputs are poisoned with
//! NaN first. Needs a GPU: ignored without one (see quire-testkit). Per-op timings: `quire
//! profile --backend cuda`.

// The GPU-only parts compile with the `cuda` feature only; without it every test here fails
// when run (and is ignored unless QUIRE_REQUIRE_GPU is set: see quire-testkit).
#[cfg(feature = "cuda")]
use {
    half::f16,
    quire_backend::cpu::ops,
    quire_backend::cuda::gpu::{Gpu, KArg},
    quire_backend::cuda::nvrtc,
    quire_testkit::metric::{self, rel_l2 as rel},
    rand::{rngs::StdRng, Rng, SeedableRng},
};

#[cfg(feature = "cuda")]
fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| quire_testkit::no_gpu(&e))
}

#[cfg(feature = "cuda")]
fn rnd(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

#[cfg(feature = "cuda")]
fn read_f16(g: &Gpu, b: &quire_backend::cuda::gpu::DBuf<f16>) -> Vec<f32> {
    let mut h = vec![f16::ZERO; b.len];
    g.dtoh(b, &mut h).unwrap();
    h.into_iter().map(f16::to_f32).collect()
}

quire_testkit::gpu_test! {
    /// `argmax_split` (several CTAs per row, the last to arrive reduces) picks what the host argmax
    /// picks, ties to the lowest index across slices and NaN never winning, and leaves its arrival
    /// counters at 0, so launch after launch on the same buffers stays right.
    fn split_argmax_matches_the_host_argmax_launch_after_launch() {
        use quire_backend::cuda::sample::{argmax_ctas, ARGMAX_MAX_CTAS};
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(37);
        let sample = g.module(&nvrtc::SAMPLE, &[]).unwrap();
        let f = Gpu::function(&sample, "argmax_split").unwrap();
        let rows_f = Gpu::function(&sample, "argmax_rows").unwrap();
        for dim in [128256usize, 49152, 4097, 100, 1] {
            let rows = 5;
            let ctas = argmax_ctas(dim);
            let part = g.alloc::<f32>(rows * ARGMAX_MAX_CTAS * 2).unwrap();
            let counters = g.alloc::<i32>(rows).unwrap();
            for rep in 0..3 {
                let mut logits = rnd(&mut rng, rows * dim, 10.0);
                if dim > 4096 {
                    // Row 1: a tie across two slices; row 2: NaNs and the max in the last slice.
                    logits[dim + 7] = 50.0;
                    logits[dim + dim - 3] = 50.0;
                    logits[2 * dim] = f32::NAN;
                    logits[2 * dim + dim / 2] = f32::NAN;
                    logits[3 * dim - 1] = 60.0;
                }
                if rep == 2 {
                    logits[3 * dim..4 * dim].fill(f32::NEG_INFINITY); // row 3: nothing above -inf
                }
                let dl = g.upload(&logits).unwrap();
                let dout = g.upload(&vec![-1i32; rows]).unwrap();
                // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                unsafe { g.launch(
                    &f,
                    (ctas as u32, rows as u32, 1),
                    (256, 1, 1),
                    &[
                        KArg::P(dl.ptr),
                        KArg::I(dim as i32),
                        KArg::P(dout.ptr),
                        KArg::P(part.ptr),
                        KArg::P(counters.ptr),
                    ],
                ) }
                .unwrap();
                let mut got = vec![0i32; rows];
                g.dtoh(&dout, &mut got).unwrap();
                let want: Vec<i32> = logits
                    .chunks_exact(dim)
                    .map(|r| quire_backend::argmax(r) as i32)
                    .collect();
                assert_eq!(
                    got, want,
                    "argmax_split dim {dim} ({ctas} CTAs), launch {rep}"
                );
                if dim > 4096 {
                    assert_eq!((got[1], got[2]), (7, (dim - 1) as i32));
                }
                let mut c = vec![1i32; rows];
                g.dtoh(&counters, &mut c).unwrap();
                assert!(c.iter().all(|&v| v == 0), "counters left at {c:?}");
                // The one-CTA form picks the same.
                let dout = g.upload(&vec![-1i32; rows]).unwrap();
                // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                unsafe { g.launch(
                    &rows_f,
                    (rows as u32, 1, 1),
                    (1024, 1, 1),
                    &[KArg::P(dl.ptr), KArg::I(dim as i32), KArg::P(dout.ptr)],
                ) }
                .unwrap();
                g.dtoh(&dout, &mut got).unwrap();
                assert_eq!(got, want, "argmax_rows dim {dim}, launch {rep}");
            }
        }
    }
}

quire_testkit::gpu_test! {
    /// `embed_f16_meta`: the step's metadata (64 words) copied from mapped host memory into the
    /// device buffer (poisoned first) by the kernel, and the ids taken from there: the same rows
    /// as the table's.
    fn embedding_ids_from_mapped_host_memory_are_the_table_rows() {
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(3);
        let embed = g.module(&nvrtc::EMBED, &[]).unwrap();
        for dim in [576usize, 2048, 100] {
            let table: Vec<f16> = rnd(&mut rng, 50 * dim, 1.0)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let ids = [49i32, 0, 17, 17];
            let dt = g.upload(&table).unwrap();
            let want: Vec<f32> = ids
                .iter()
                .flat_map(|&t| table[t as usize * dim..(t as usize + 1) * dim].iter().map(|v| v.to_f32()))
                .collect();
            let (mut host, src) = quire_backend::cuda::gpu::HostBuf::<i32>::mapped(64).unwrap();
            let words = host.slice_mut(64).unwrap();
            for (i, v) in words.iter_mut().enumerate() {
                *v = 1000 + i as i32;
            }
            words[8..8 + ids.len()].copy_from_slice(&ids);
            let words = words.to_vec();
            let dmeta = g.upload(&vec![-1i32; 64]).unwrap();
            let dxm = g.upload(&vec![f32::NAN; ids.len() * dim]).unwrap();
            // SAFETY: every address is a live allocation of this test (g.upload / g.alloc / the mapped buffer), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
            unsafe { g.launch(
                &Gpu::function(&embed, "embed_f16_meta").unwrap(),
                (ids.len() as u32, 1, 1),
                (256, 1, 1),
                &[
                    KArg::P(src),
                    KArg::P(dmeta.ptr),
                    KArg::I(64),
                    KArg::I(8),
                    KArg::P(dt.ptr),
                    KArg::P(dxm.ptr),
                    KArg::I(dim as i32),
                ],
            ) }
            .unwrap();
            let mut meta_got = vec![0i32; 64];
            g.dtoh(&dmeta, &mut meta_got).unwrap();
            assert_eq!(meta_got, words, "metadata copied from mapped memory");
            let mut got = vec![0f32; ids.len() * dim];
            g.dtoh(&dxm, &mut got).unwrap();
            assert_eq!(got, want, "embedding rows, ids from mapped memory");
        }
    }
}

/// The one-token GEMV against an f64 dot product of the same f16 values and against cuBLAS:
/// shapes of the 135M/1B/8B layers plus odd ones (rows not a multiple of the CTA's 16, lengths
/// not a multiple of the unrolled 1024 elements), beta 0 over a NaN-poisoned output and beta 1
/// (the residual add); then its fused inputs, RMSNorm (with a row gather) and SwiGLU, against the
/// CPU's ops rounded to f16 the same way, and the RMSNorm form that writes into mapped host
/// memory against the device form, bit for bit.
/// Runs `launch` (a GEMV into the output address it is given) again in the EARLY forms, with the
/// output reset to `init`, and checks it writes `got` bit for bit: the forms differ only in when
/// the norm weight and the residual rows are read, never in the sums or their order.
#[cfg(feature = "cuda")]
fn same_when_early(
    g: &Gpu,
    gv: &mut quire_backend::cuda::gemv::Gemv,
    got: &[f32],
    init: &[f32],
    launch: impl Fn(&quire_backend::cuda::gemv::Gemv, u64) -> Result<(), quire_backend::BackendError>,
) {
    let dy = g.upload(init).unwrap();
    gv.early_min_k = 0;
    let r = launch(gv, dy.ptr);
    gv.early_min_k = usize::MAX;
    r.unwrap();
    let mut v = vec![0f32; init.len()];
    g.dtoh(&dy, &mut v).unwrap();
    assert!(
        v.iter().zip(got).all(|(a, b)| a.to_bits() == b.to_bits()),
        "the EARLY form of a {}-row GEMV differs from the plain one",
        got.len()
    );
}

quire_testkit::gpu_test! {
    fn gemv_matches_an_f64_dot_product_and_cublas() {
        use quire_backend::cuda::gemv::{Gemv, GemvInput};
        use quire_backend::cuda::gpu::HostBuf;
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(29);
        let mut gv = Gemv::new(&g).unwrap();
        gv.early_min_k = usize::MAX; // the plain forms; `same_when_early` checks the EARLY ones
        let f16_in = GemvInput::F16 { x: 0 };
        assert!(!gv.fits(100, &f16_in) && gv.fits(104, &f16_in));
        assert!(gv.fits(4096, &f16_in));
        // The fused forms' bound: inputs this long are not fused.
        assert!(!gv.fits(16384, &GemvInput::SwiGlu { gu: 0 }));
        let dot = |w: &[f16], x: &[f16], k: usize, r: usize| -> f64 {
            (0..k).map(|i| w[r * k + i].to_f64() * x[i].to_f64()).sum()
        };
        let read = |b: &quire_backend::cuda::gpu::DBuf<f32>| {
            let mut v = vec![0f32; b.len];
            g.dtoh(b, &mut v).unwrap();
            v
        };
        for (k, out) in [
            (576usize, 960usize),
            (576, 49152),
            (1536, 576),
            (2048, 16384),
            (4096, 6144),
            (14336, 4096),
            (8192, 2048),
            (1544, 1003),
            (1000, 1003),
            (8, 1),
            (24, 17),
        ] {
            let w: Vec<f16> = rnd(&mut rng, k * out, 1.0)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let x: Vec<f16> = rnd(&mut rng, k, 1.0)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let y0 = rnd(&mut rng, out, 1.0);
            let (dw, dx) = (g.upload(&w).unwrap(), g.upload(&x).unwrap());
            for beta in [0.0f32, 1.0] {
                let want: Vec<f32> = (0..out)
                    .map(|r| (dot(&w, &x, k, r) + beta as f64 * y0[r] as f64) as f32)
                    .collect();
                let init = if beta == 0.0 {
                    vec![f32::NAN; out]
                } else {
                    y0.clone()
                };
                let dy = g.upload(&init).unwrap();
                // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                unsafe { gv.run(
                    &g,
                    dw.ptr,
                    GemvInput::F16 { x: dx.ptr },
                    dy.ptr,
                    k,
                    out,
                    beta,
                ) }
                .unwrap();
                let got = read(&dy);
                let e = rel(&got, &want);
                assert!(e < metric::DOT_F32, "gemv {k}x{out} beta {beta}: rel err {e:.2e}");
                same_when_early(&g, &mut gv, &got, &init, |gv, y| {
                    // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                    unsafe { gv.run(&g, dw.ptr, GemvInput::F16 { x: dx.ptr }, y, k, out, beta) }
                });
                let db = g.upload(&init).unwrap();
                // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                unsafe { g.gemm_f16(dx.ptr, dw.ptr, db.ptr, 1, k, out, beta) }.unwrap();
                let eb = rel(&got, &read(&db));
                assert!(
                    eb < metric::DOT_F32_VS_CUBLAS,
                    "gemv vs cuBLAS {k}x{out} beta {beta}: rel err {eb:.2e}"
                );
            }
            // RMSNorm of row 2 of a 3-row residual (gathered through rows_idx), then SwiGLU.
            if !gv.fits(k, &GemvInput::SwiGlu { gu: 0 }) {
                continue;
            }
            let xs = rnd(&mut rng, 3 * k, 3.0);
            let nw = rnd(&mut rng, k, 2.0);
            let mut normed = vec![0f32; k];
            ops::rms_norm(&xs[2 * k..], &nw, 1e-5, &mut normed);
            let gu = rnd(&mut rng, 2 * k, 4.0);
            let mut act = vec![0f32; k];
            ops::swiglu(&gu, k, &mut act);
            let (dxs, dnw, dgu) = (
                g.upload(&xs).unwrap(),
                g.upload(&nw).unwrap(),
                g.upload(&gu).unwrap(),
            );
            let idx = g.upload(&[2i32]).unwrap();
            for (name, input, v) in [
                (
                    "norm",
                    GemvInput::Norm {
                        x: dxs.ptr,
                        rows_idx: idx.ptr,
                        norm_w: dnw.ptr,
                        eps: 1e-5,
                    },
                    normed,
                ),
                ("swiglu", GemvInput::SwiGlu { gu: dgu.ptr }, act),
            ] {
                let v16: Vec<f16> = v.iter().map(|&a| f16::from_f32(a)).collect();
                let want: Vec<f32> = (0..out).map(|r| dot(&w, &v16, k, r) as f32).collect();
                let dy = g.upload(&vec![f32::NAN; out]).unwrap();
                // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                unsafe { gv.run(&g, dw.ptr, input, dy.ptr, k, out, 0.0) }.unwrap();
                let got = read(&dy);
                let e = rel(&got, &want);
                assert!(e < metric::DOT_FUSED_F16_INPUT, "gemv with {name} {k}x{out}: rel err {e:.2e}");
                same_when_early(&g, &mut gv, &got, &vec![f32::NAN; out], |gv, y| {
                    // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                    unsafe { gv.run(&g, dw.ptr, input, y, k, out, 0.0) }
                });
                if name == "norm" {
                    // The host-output form (a one-row step's logits into mapped page-locked memory):
                    // the same sums, NaN-poisoned first, every row written once.
                    // Both grids: one row group per warp, and rounds on a persistent grid (rows of
                    // at most 1024 elements).
                    let (mut host, dev) = HostBuf::<f32>::mapped(out).unwrap();
                    for (rounds, early) in [(false, false), (true, false), (false, true)] {
                        gv.host_rounds = rounds;
                        gv.early_min_k = if early { 0 } else { usize::MAX };
                        host.slice_mut(out).unwrap().fill(f32::NAN);
                        // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                        unsafe { gv.run_host(&g, dw.ptr, input, dev, k, out) }.unwrap();
                        g.sync().unwrap();
                        let h = host.slice(out);
                        assert!(
                            h.iter().zip(&got).all(|(a, b)| a.to_bits() == b.to_bits()),
                            "host-output gemv {k}x{out} (rounds {rounds}, early {early}) differs from the device form"
                        );
                    }
                    gv.early_min_k = usize::MAX;
                }
            }
        }
    }
}

quire_testkit::gpu_test! {
    /// The GLU form of the GEMV (decode's gate/up projection with the SwiGLU on the way out) against
    /// silu(gate) · up of f64 dot products, for an f16 input and an RMSNorm input; the f16 output is
    /// poisoned with NaN first.
    fn glu_gemv_matches_the_swiglu_of_f64_gate_and_up_rows() {
        use quire_backend::cuda::gemv::{Gemv, GemvInput};
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(31);
        let mut gv = Gemv::new(&g).unwrap();
        gv.early_min_k = usize::MAX; // the plain forms; the EARLY ones are checked below
        for (k, inter) in [
            (576usize, 1536usize),
            (2048, 8192),
            (4096, 1024),
            (1000, 5),
            (24, 17),
        ] {
            let w: Vec<f16> = rnd(&mut rng, 2 * k * inter, 1.0)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let dw = g.upload(&w).unwrap();
            let x: Vec<f16> = rnd(&mut rng, k, 1.0)
                .into_iter()
                .map(f16::from_f32)
                .collect();
            let xs = rnd(&mut rng, 3 * k, 3.0);
            let nw = rnd(&mut rng, k, 2.0);
            let mut normed = vec![0f32; k];
            ops::rms_norm(&xs[2 * k..], &nw, 1e-5, &mut normed);
            let normed: Vec<f16> = normed.iter().map(|&a| f16::from_f32(a)).collect();
            let (dx, dxs, dnw) = (
                g.upload(&x).unwrap(),
                g.upload(&xs).unwrap(),
                g.upload(&nw).unwrap(),
            );
            let idx = g.upload(&[2i32]).unwrap();
            for (name, input, v) in [
                ("f16", GemvInput::F16 { x: dx.ptr }, &x),
                (
                    "norm",
                    GemvInput::Norm {
                        x: dxs.ptr,
                        rows_idx: idx.ptr,
                        norm_w: dnw.ptr,
                        eps: 1e-5,
                    },
                    &normed,
                ),
            ] {
                let dot =
                    |r: usize| -> f64 { (0..k).map(|i| w[r * k + i].to_f64() * v[i].to_f64()).sum() };
                let want: Vec<f32> = (0..inter)
                    .map(|i| {
                        let (gs, us) = (dot(i), dot(inter + i));
                        (gs / (1.0 + (-gs).exp()) * us) as f32
                    })
                    .collect();
                let da = g.upload(&vec![f16::NAN; inter]).unwrap();
                // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                unsafe { gv.run_glu(&g, dw.ptr, input, da.ptr, k, inter) }.unwrap();
                let got = read_f16(&g, &da);
                let e = rel(&got, &want);
                assert!(e < metric::DOT_FUSED_F16_INPUT, "glu gemv ({name}) {k}x{inter}: rel err {e:.2e}");
                // The EARLY form: the same f16 bits.
                let de = g.upload(&vec![f16::NAN; inter]).unwrap();
                gv.early_min_k = 0;
                // SAFETY: every address is a live allocation of this test (g.upload / g.alloc), sized for the launch's shape, and the stream is synchronised (dtoh) before any of them drops.
                unsafe { gv.run_glu(&g, dw.ptr, input, de.ptr, k, inter) }.unwrap();
                gv.early_min_k = usize::MAX;
                let early = read_f16(&g, &de);
                assert!(
                    early
                        .iter()
                        .zip(&got)
                        .all(|(a, b)| a.to_bits() == b.to_bits()),
                    "glu gemv ({name}) {k}x{inter}: the EARLY form differs"
                );
            }
        }
    }
}
