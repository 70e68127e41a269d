//! Every kernel op of every backend against the plain references (`ops/reference.rs`), one
//! test body per op run for each executor this binary has (`executor_test!`: `OP::cpu`,
//! `OP::cuda`, `OP::wgpu`), in the spirit of llama.cpp's test-backend-ops: matmul for every
//! weight type (one token and many, odd row counts, with and without the residual add), the
//! embedding gather, RMSNorm, bias + QK-norm + RoPE (both styles, partial rotation), SwiGLU,
//! the argmax, and paged attention with its fused K/V write on the testkit's random paged
//! batches (scattered block tables, odd lengths, prompt chunks beside decodes, GQA, sliding
//! windows, NaN-poisoned unused slots; the cache slots checked after the write).
//!
//! The CPU variant runs the CPU backend's optimized kernels, so it is a test of them too. Each
//! case a backend does not run is printed as SKIPPED with its reason, and a body that ran no
//! case fails. Shapes are small: the wgpu variants run on lavapipe in CI (see .ci/run). The
//! CUDA and wgpu variants are ignored unless required at build time (see quire-testkit).

mod ops;

use half::f16;
use ops::{bound, reference, AttnCase, Heads, Op, QkvCase, Tally};
use quire_backend::cpu::ops::RopeTable;
use quire_core::RopeStyle;
use quire_gguf::GgmlType;
use quire_testkit::metric::rel_l2;
use quire_testkit::paged::PagedCase;
use quire_testkit::random::{rnd, tensor};
use rand::rngs::StdRng;
use rand::SeedableRng;

/// Every weight type a backend may multiply.
const WEIGHT_TYPES: [GgmlType; 9] = [
    GgmlType::F16,
    GgmlType::F32,
    GgmlType::BF16,
    GgmlType::Q8_0,
    GgmlType::Q4_0,
    GgmlType::Q4_1,
    GgmlType::Q4_K,
    GgmlType::Q5_K,
    GgmlType::Q6_K,
];

quire_testkit::executor_test! {
    /// Every weight type: rows not a multiple of any tile, one token (the GEMV kernels) and
    /// several (the tiled ones; 16, 64 and 67 tokens reach CUDA's tensor-core kernel, with rows
    /// and tokens not multiples of its 64 × 64 tile), a long row, with and without the residual
    /// add (NaN-poisoned output when without).
    fn matmul_matches_the_reference_for_every_weight_type(backend) {
        let mut dev = ops::ops(backend);
        let mut tally = Tally::new("matmul", backend);
        let mut rng = StdRng::seed_from_u64(1);
        for t in WEIGHT_TYPES {
            if tally.take(&t.name(), dev.matmul_form(t, 1)).is_none() {
                continue;
            }
            // K-quants come in blocks of 256; the others in 32.
            let unit = t.block_size().max(32);
            let shapes = [
                (37, 3 * unit, 1),
                (37, 3 * unit, 5),
                (130, 2 * unit, 2),
                (5, unit, 9),
                (67, 2 * unit, 13),
                (64, 4096, 1),
                (64, 4096, 3),
                (67, 3 * unit, 16),
                (37, 2 * unit, 64),
                (130, unit, 67),
            ];
            for (i, (rows, cols, n)) in shapes.into_iter().enumerate() {
                let w = tensor(&mut rng, t, rows, cols);
                let x = rnd(&mut rng, n * cols, 2.0);
                let add = (i % 2 == 1).then(|| rnd(&mut rng, n * rows, 1.0));
                let case = format!("{} {rows}x{cols} n={n} add={}", t.name(), add.is_some());
                // The form of the kernel these `n` tokens take (GEMV, GEMM, matrix units).
                let form = match dev.matmul_form(t, n) {
                    Ok(f) => f,
                    Err(why) => {
                        tally.take::<()>(&case, Err(why));
                        continue;
                    }
                };
                let Some(got) = tally.take(&case, dev.matmul(&w, &x, n, add.as_deref())) else {
                    continue;
                };
                let want = reference::matmul(&w, form, &x, n, add.as_deref());
                let e = rel_l2(&got, &want);
                let b = bound(Op::Matmul(form.act));
                assert!(e < b, "{case} ({form:?}): rel L2 {e:.2e} over {b:.0e}");
            }
        }
        tally.finish();
    }
}

quire_testkit::executor_test! {
    /// Embedding rows of every table type, repeated and first/last ids: exactly the format's
    /// dequantized rows.
    fn embedding_rows_are_the_dequantized_rows(backend) {
        let mut dev = ops::ops(backend);
        let mut tally = Tally::new("embed", backend);
        let mut rng = StdRng::seed_from_u64(2);
        for t in WEIGHT_TYPES {
            let (vocab, cols) = (50, 3 * t.block_size().max(32));
            let w = tensor(&mut rng, t, vocab, cols);
            let tokens = [7u32, 0, 49, 7, 23];
            let case = format!("{} {vocab}x{cols}", t.name());
            let Some(got) = tally.take(&case, dev.embed(&w, &tokens)) else {
                continue;
            };
            let want = reference::embed(&w, &tokens);
            // Scale-only formats round once (d · q): equal bits. The affine ones (d · q - m)
            // may be one fused multiply-add on a GPU: within two f32 roundings of the row's
            // largest value.
            let affine = matches!(t, GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K);
            for (g, r) in got.chunks(cols).zip(want.chunks(cols)) {
                let top = r.iter().fold(0f32, |a, v| a.max(v.abs()));
                for (a, b) in g.iter().zip(r) {
                    let same = if affine {
                        (a - b).abs() <= top * 2.0 * f32::EPSILON
                    } else {
                        a.to_bits() == b.to_bits()
                    };
                    assert!(same, "{case}: {a} where the dequantized row has {b}");
                }
            }
        }
        tally.finish();
    }
}

quire_testkit::executor_test! {
    /// Rows of odd and long widths (more than one pass of a 1024-thread block).
    fn rms_norm_matches_the_reference(backend) {
        let mut dev = ops::ops(backend);
        let mut tally = Tally::new("rms_norm", backend);
        let mut rng = StdRng::seed_from_u64(3);
        for (n, dim) in [(1, 576), (7, 100), (3, 2048), (9, 4096), (2, 8200)] {
            let x = rnd(&mut rng, n * dim, 3.0);
            let w = rnd(&mut rng, dim, 2.0);
            let case = format!("n={n} dim={dim}");
            let Some((got, prec)) = tally.take(&case, dev.rms_norm(&x, &w, 1e-5)) else {
                continue;
            };
            let e = rel_l2(&got, &reference::rms_norm(&x, &w, 1e-5));
            let b = bound(Op::RmsNorm(prec));
            assert!(e < b, "{case} ({prec:?}): rel L2 {e:.2e} over {b:.0e}");
        }
        tally.finish();
    }
}

quire_testkit::executor_test! {
    /// Both rotation styles, rotations over the whole head and part of it, with and without
    /// Qwen2's QKV bias and Qwen3's QK-norm, GQA, head dims 64 to 256, positions to 4095.
    fn bias_qk_norm_and_rope_match_the_reference(backend) {
        let mut dev = ops::ops(backend);
        let mut tally = Tally::new("qkv_post", backend);
        let mut rng = StdRng::seed_from_u64(4);
        let positions = [0u32, 1, 17, 300, 4095];
        let mut i = 0;
        for (q, kv, dim) in [(9, 3, 64), (6, 2, 64), (8, 2, 128), (4, 2, 256)] {
            for style in [RopeStyle::Normal, RopeStyle::Neox] {
                for (rope_dim, bias, norm) in [(dim, false, false), (dim, true, true), (dim / 2, true, false)] {
                    i += 1;
                    let heads = Heads { q, kv, dim };
                    let table = RopeTable::new(rope_dim, if i % 2 == 0 { 1e4 } else { 1e6 }, None);
                    let (mut cs, mut tmp) = (Vec::new(), Vec::new());
                    for &p in &positions {
                        table.angles(p, &mut tmp);
                        cs.extend_from_slice(&tmp);
                    }
                    let c = QkvCase {
                        heads,
                        qkv: rnd(&mut rng, positions.len() * heads.stride(), 2.0),
                        bias: bias.then(|| rnd(&mut rng, heads.stride(), 0.5)),
                        norms: norm.then(|| (rnd(&mut rng, dim, 1.5), rnd(&mut rng, dim, 1.5))),
                        cs,
                        style,
                        eps: 1e-6,
                    };
                    let case = format!("{heads:?} {style:?} rope_dim {rope_dim} bias {bias} norm {norm}");
                    let Some(got) = tally.take(&case, dev.qkv_post(&c)) else {
                        continue;
                    };
                    let e = rel_l2(&got, &reference::qkv_post(&c));
                    let b = bound(Op::Rope);
                    assert!(e < b, "{case}: rel L2 {e:.2e} over {b:.0e}");
                }
            }
        }
        tally.finish();
    }
}

quire_testkit::executor_test! {
    /// Gate/up rows of odd and long widths, values to ±6 (the exponential's tails).
    fn swiglu_matches_the_reference(backend) {
        let mut dev = ops::ops(backend);
        let mut tally = Tally::new("swiglu", backend);
        let mut rng = StdRng::seed_from_u64(5);
        for (n, inter) in [(3, 300), (1, 576), (7, 100), (2, 4096), (4, 8200)] {
            let gu = rnd(&mut rng, n * 2 * inter, 6.0);
            let case = format!("n={n} inter={inter}");
            let Some((got, prec)) = tally.take(&case, dev.swiglu(&gu, inter)) else {
                continue;
            };
            let e = rel_l2(&got, &reference::swiglu(&gu, inter));
            let b = bound(Op::Swiglu(prec));
            assert!(e < b, "{case} ({prec:?}): rel L2 {e:.2e} over {b:.0e}");
        }
        tally.finish();
    }
}

quire_testkit::executor_test! {
    /// Ties (the first wins, also across the slices of a split row), NaN never winning, a row
    /// of NaN giving 0, a row of -inf, the maximum at the last index; short and long rows.
    fn argmax_picks_the_first_largest(backend) {
        let mut dev = ops::ops(backend);
        let mut tally = Tally::new("argmax", backend);
        let mut rng = StdRng::seed_from_u64(6);
        for vocab in [1, 100, 1000, 4097, 8200, 49152] {
            let rows = 6;
            let mut l = rnd(&mut rng, rows * vocab, 10.0);
            if vocab >= 100 {
                l[3] = 50.0; // row 0: a tie, the first wins
                l[vocab - 3] = 50.0;
                l[vocab] = f32::NAN; // row 1: NaN never wins, the last index does
                l[vocab + vocab / 2] = f32::NAN;
                l[2 * vocab - 1] = 60.0;
                l[2 * vocab..3 * vocab].fill(f32::NAN); // row 2: no number gives 0
                l[3 * vocab..4 * vocab].fill(f32::NEG_INFINITY); // row 3: all -inf
            }
            let case = format!("vocab {vocab}");
            let Some(got) = tally.take(&case, dev.argmax(&l, vocab)) else {
                continue;
            };
            let want = reference::argmax(&l, vocab);
            if vocab >= 100 {
                assert_eq!(want[..4], [3, vocab as u32 - 1, 0, 0], "the reference itself");
            }
            assert_eq!(got, want, "{case}");
        }
        tally.finish();
    }
}

/// (heads, block size, window, (cached, new) per sequence).
type AttnShape = (Heads, usize, Option<usize>, Vec<(usize, usize)>);

/// The attention cases: decode rows and prompt chunks (on top of cached contexts, and fresh;
/// chunks of 16+ rows take CUDA's tensor-core kernel) in one batch, GQA 1 to 16, head dims 32
/// to 256, every block size, windows shorter and longer than the contexts.
fn attention_shapes() -> Vec<AttnShape> {
    let h = |q, kv, dim| Heads { q, kv, dim };
    vec![
        (
            h(6, 2, 64),
            16,
            None,
            vec![(100, 1), (0, 37), (63, 13), (5, 1)],
        ),
        (h(4, 4, 128), 32, None, vec![(0, 71), (200, 1)]),
        (h(8, 2, 32), 16, Some(40), vec![(100, 1), (63, 13), (0, 50)]),
        (h(16, 1, 128), 16, None, vec![(70, 3), (0, 1)]),
        (
            h(9, 3, 64),
            64,
            None,
            vec![(150, 1), (40, 37), (0, 13), (0, 1)],
        ),
        (
            h(8, 1, 64),
            128,
            Some(17),
            vec![(300, 1), (80, 24), (0, 33)],
        ),
        (h(4, 2, 256), 16, None, vec![(30, 1), (12, 17), (0, 5)]),
        (h(12, 6, 64), 32, Some(1), vec![(60, 1), (20, 19)]),
        (h(8, 8, 64), 16, Some(1000), vec![(399, 1), (0, 64)]),
        // Long prompt chunks of odd lengths, fresh and after a cached prefix, GQA 4 at head dim
        // 128 (the wgpu kernel cuts them into query tiles with a short last one).
        (
            h(8, 2, 128),
            16,
            None,
            vec![(0, 130), (45, 33), (9, 7), (300, 1)],
        ),
    ]
}

quire_testkit::executor_test! {
    fn paged_attention_writes_the_cache_and_matches_dense_attention(backend) {
        let mut dev = ops::ops(backend);
        let mut tally = Tally::new("attention", backend);
        let mut rng = StdRng::seed_from_u64(7);
        for (heads, bs, window, seqs) in attention_shapes() {
            let gen = PagedCase { window, ..PagedCase::new(bs, heads.kv_size(), &seqs) };
            let batch = gen.generate::<f16>(&mut rng);
            let q = rnd(&mut rng, batch.tokens() * heads.q_size(), 1.0);
            let c = AttnCase { heads, window, batch, q };
            let case = format!("{heads:?} block {bs} window {window:?} seqs {seqs:?}");
            let Some(got) = tally.take(&case, dev.attention(&c)) else {
                continue;
            };
            let e = rel_l2(&got.out, &reference::attention(&c));
            let b = bound(Op::Attention(got.prec));
            assert!(e < b, "{case} ({:?}): rel L2 {e:.2e} over {b:.0e}", got.prec);
            // Each new token's slot holds its K/V; every other slot is untouched.
            let (k, v) = reference::caches_after_write(&c);
            let bits = |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&got.k_cache) == bits(&k), "{case}: K cache after the write");
            assert!(bits(&got.v_cache) == bits(&v), "{case}: V cache after the write");
        }
        tally.finish();
    }
}
