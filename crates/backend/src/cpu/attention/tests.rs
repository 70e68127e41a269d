//! Parity of the paged kernel against the dense f64 reference: random non-contiguous block tables,
//! GQA ratios 1, 3, 4 and 8, head dims 64 and 128, odd lengths, mixed prompt chunks and decodes in
//! one batch, every unused cache slot poisoned with NaN (the shared generator of quire-testkit);
//! errors are the relative L2 error of quire-testkit's metric.

use super::*;
use quire_testkit::metric::{self, RelL2};
use quire_testkit::paged::{CacheElem, PagedCase};
use rand::{Rng, SeedableRng};

struct Case {
    num_heads: usize,
    num_kv_heads: usize,
    head_dim: usize,
    block_size: usize,
    /// (context already cached, new tokens) per sequence.
    seqs: Vec<(usize, usize)>,
    f16_accum: bool,
    sliding_window: Option<usize>,
}

fn run_case<T: KvElem + CacheElem>(c: &Case, seed: u64) -> f64 {
    let mut rng = rand::rngs::StdRng::seed_from_u64(seed);
    let pool = rayon::ThreadPoolBuilder::new()
        .num_threads(2)
        .build()
        .unwrap();
    let d = c.head_dim;
    let kv_row = c.num_kv_heads * d;
    let q_row = c.num_heads * d;
    // Spare blocks stay poisoned; with a sliding window, cached keys before every query's window
    // stay NaN too: never read.
    let gen = PagedCase {
        spare_blocks: 7,
        window: c.sliding_window,
        ..PagedCase::new(c.block_size, kv_row, &c.seqs)
    }
    .generate::<T>(&mut rng);
    let (mut k_cache, mut v_cache) = (gen.k_cache, gen.v_cache);
    let p = AttnParams {
        num_heads: c.num_heads,
        num_kv_heads: c.num_kv_heads,
        head_dim: d,
        block_size: c.block_size,
        scale: 1.0 / (d as f32).sqrt(),
        f16_accum: c.f16_accum,
        sliding_window: c.sliding_window,
    };
    // The batch: every sequence's new tokens, flat.
    let total = gen.positions.len();
    let q: Vec<f32> = (0..total * q_row)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let seqs: Vec<SeqBatch> = gen
        .seqs
        .iter()
        .map(|s| SeqBatch {
            query_start: s.query_start,
            query_len: s.query_len,
            seq_len: s.seq_len,
            block_table: &s.block_table,
        })
        .collect();
    let mut out = vec![0f32; total * q_row];
    paged_attention(
        &pool,
        &p,
        &q,
        q_row,
        &gen.k_new,
        &gen.v_new,
        kv_row,
        &gen.slot_mapping,
        &seqs,
        &mut k_cache,
        &mut v_cache,
        &mut out,
    );
    let mut err = RelL2::default();
    for (i, s) in seqs.iter().enumerate() {
        let qs = &q[s.query_start * q_row..(s.query_start + s.query_len) * q_row];
        let want = dense_reference(&p, qs, &gen.seqs[i].keys, &gen.seqs[i].values, s.seq_len);
        let got = &out[s.query_start * q_row..(s.query_start + s.query_len) * q_row];
        err.add(got, &want);
    }
    err.value()
}

#[test]
fn paged_matches_dense_reference_f32() {
    let mut seed = 0;
    for (num_heads, num_kv_heads) in [(4, 4), (9, 3), (8, 2), (16, 2)] {
        for head_dim in [64, 128] {
            for block_size in [16, 32, 64] {
                seed += 1;
                let c = Case {
                    num_heads,
                    num_kv_heads,
                    head_dim,
                    block_size,
                    // decodes with odd contexts, a fresh odd prompt, a chunk after a cached prefix
                    seqs: vec![(0, 37), (100, 1), (1, 1), (63, 13), (0, 1), (129, 1)],
                    f16_accum: false,
                    sliding_window: None,
                };
                let rel = run_case::<f32>(&c, seed);
                assert!(
                    rel < metric::ATTENTION_F32,
                    "gqa {num_heads}/{num_kv_heads} d{head_dim} bs{block_size}: rel err {rel:e}"
                );
            }
        }
    }
}

#[test]
fn sliding_window_matches_dense_reference() {
    // Windows shorter than, equal to and longer than a block, and 1 (only the token itself), over
    // prompts, chunks after cached prefixes and decodes; keys before the window are NaN.
    let mut seed = 100;
    for window in [1, 5, 8, 16, 17, 40, 1000] {
        for (f16_accum, block_size) in [(false, 16), (false, 32), (true, 16)] {
            seed += 1;
            let c = Case {
                num_heads: 8,
                num_kv_heads: 2,
                head_dim: 64,
                block_size,
                seqs: vec![(0, 37), (100, 1), (1, 1), (63, 13), (0, 1), (129, 1)],
                f16_accum,
                sliding_window: Some(window),
            };
            let rel = if f16_accum {
                run_case::<f16>(&c, seed)
            } else {
                run_case::<f32>(&c, seed)
            };
            let tol = if f16_accum {
                metric::ATTENTION_F16_ACCUM
            } else {
                metric::ATTENTION_F32
            };
            assert!(
                rel < tol,
                "window {window} bs{block_size} f16acc {f16_accum}: rel err {rel:e}"
            );
        }
    }
}

#[test]
fn sliding_window_reference_attends_exactly_the_last_w_keys() {
    // One query head, d = 1, q = 0 (uniform weights): the output is the mean of the attended
    // values, so the window's edges are visible: position p with window w averages v[p-w+1..=p].
    let p = AttnParams {
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 1,
        block_size: 16,
        scale: 1.0,
        f16_accum: false,
        sliding_window: Some(3),
    };
    let n = 6;
    let q = vec![0f32; n];
    let k = vec![1f32; n];
    let v: Vec<f32> = (0..n).map(|i| (1u32 << i) as f32).collect();
    let out = dense_reference(&p, &q, &k, &v, n);
    let want = [1.0, 1.5, 7.0 / 3.0, 14.0 / 3.0, 28.0 / 3.0, 56.0 / 3.0];
    for (o, w) in out.iter().zip(want) {
        assert!((o - w).abs() < 1e-12, "{out:?}");
    }
}

#[test]
fn paged_matches_dense_reference_f16_storage() {
    let c = Case {
        num_heads: 16,
        num_kv_heads: 8,
        head_dim: 128,
        block_size: 32,
        seqs: vec![(200, 1), (0, 45), (31, 2)],
        f16_accum: false,
        sliding_window: None,
    };
    let rel = run_case::<f16>(&c, 99);
    assert!(rel < metric::ATTENTION_F32, "rel err {rel:e}");
}

#[test]
fn f16_accumulator_stays_within_f16_precision() {
    // llama.cpp-style numerics: Q and the running V sum rounded to f16. The error is that of f16
    // (2^-11 relative per rounding), far above f32's but bounded; NaN-poisoned slots stay unread.
    for (num_heads, num_kv_heads, head_dim) in [(8, 8, 64), (12, 4, 128), (16, 2, 64)] {
        let c = Case {
            num_heads,
            num_kv_heads,
            head_dim,
            block_size: 16,
            seqs: vec![(0, 19), (150, 1), (33, 3)],
            f16_accum: true,
            sliding_window: None,
        };
        let rel = run_case::<f16>(&c, 7);
        // Above 1e-6: the f16 roundings do happen.
        assert!(
            rel < metric::ATTENTION_F16_ACCUM && rel > 1e-6,
            "rel err {rel:e}"
        );
    }
}

quire_testkit::simd_test! {
    fn simd_f16_accumulator_steps_equal_the_scalar_ones_bit_for_bit() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(3);
        for d in [32usize, 64, 128, 256] {
            let a: Vec<f32> = (0..d).map(|_| rng.random_range(-3.0..3.0)).collect();
            let b: Vec<f32> = (0..d).map(|_| rng.random_range(-3.0..3.0)).collect();
            // SAFETY: simd_test! checked the features (has_avx2); d is a multiple of 32.
            let fast = unsafe { simd::dot(&a, &b) };
            assert_eq!(fast.to_bits(), dot_ggml_order(&a, &b).to_bits());
            let h: Vec<f16> = a.iter().map(|&x| f16::from_f32(x)).collect();
            let mut conv = vec![0f32; d];
            unsafe { simd::f16_to_f32(&h, &mut conv) };
            assert!(conv.iter().zip(&h).all(|(c, h)| *c == h.to_f32()));
            let mut acc_fast: Vec<f32> = conv.clone();
            let mut acc_slow = conv.clone();
            let (s, vs) = (rng.random_range(0.0..1.0f32), rng.random_range(0.0..1.0f32));
            unsafe {
                simd::scale_round(&mut acc_fast, s);
                simd::mad_round(&mut acc_fast, &b, vs);
            }
            for (x, &v) in acc_slow.iter_mut().zip(&b) {
                *x = f16::from_f32(*x * s).to_f32();
                *x = f16::from_f32(v.mul_add(vs, *x)).to_f32();
            }
            assert_eq!(acc_fast, acc_slow);
        }
    }
}
