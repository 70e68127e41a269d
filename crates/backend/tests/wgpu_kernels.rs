//! The wgpu kernels against plain CPU references on random inputs, with the testkit's metric:
//! the GEMV for every weight type, K-quants included, with subgroup sums and with the
//! workgroup-memory fallback (odd row counts, one token and several), the embedding
//! gather, RMSNorm, bias + QK-norm + RoPE (both styles, partial rotation), SwiGLU, the argmax,
//! and the fused KV write + paged attention on testkit's random paged batches (scattered block
//! tables, odd lengths, NaN-poisoned unused slots, prompt chunks with decodes, sliding window).
//! Outputs are poisoned with NaN before each kernel runs. Needs an adapter (lavapipe will do):
//! ignored unless QUIRE_REQUIRE_WGPU is set at build time (see quire-testkit).

#[cfg(feature = "wgpu")]
use {
    half::f16,
    quire_backend::cpu::ops,
    quire_backend::wgpu::kernels::{HeadShape, Kernels},
    quire_backend::wgpu::probe::{AttnInput, Probe},
    quire_backend::{HostTensor, TensorBytes},
    quire_core::RopeStyle,
    quire_gguf::GgmlType,
    quire_testkit::metric::{self, rel_l2, RelL2},
    quire_testkit::paged::{PagedBatch, PagedCase},
    rand::{rngs::StdRng, Rng, SeedableRng},
};

#[cfg(feature = "wgpu")]
fn probe() -> Probe {
    let adapter = std::env::var("QUIRE_WGPU_ADAPTER").ok();
    Probe::new(adapter.as_deref())
        .unwrap_or_else(|e| quire_testkit::missing(quire_testkit::Backend::Wgpu, &e))
}

#[cfg(feature = "wgpu")]
fn rnd(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

/// A `[rows, cols]` tensor of type `t` from random values.
#[cfg(feature = "wgpu")]
fn tensor(rng: &mut StdRng, t: GgmlType, rows: usize, cols: usize) -> HostTensor {
    let v = rnd(rng, rows * cols, 1.0);
    let mut bytes = Vec::new();
    match t {
        GgmlType::F32 => bytes.extend(v.iter().flat_map(|x| x.to_le_bytes())),
        GgmlType::F16 => bytes.extend(v.iter().flat_map(|&x| f16::from_f32(x).to_le_bytes())),
        GgmlType::BF16 => bytes.extend(
            v.iter()
                .flat_map(|&x| half::bf16::from_f32(x).to_le_bytes()),
        ),
        _ => quire_gguf::quantize_row(t, &v, &mut bytes).expect("quantizes"),
    }
    HostTensor {
        name: format!("w_{}", t.name()),
        dtype: t,
        dims: vec![cols, rows],
        bytes: TensorBytes::owned(bytes),
    }
}

/// The f64 product `x` · `w`ᵀ of `[n, cols]` and `[rows, cols]`, the weights as the device holds
/// them (f32 and bf16 go to the device as f16: the reference rounds the same way).
#[cfg(feature = "wgpu")]
fn reference_product(w: &HostTensor, x: &[f32], n: usize) -> Vec<f64> {
    let (cols, rows) = (w.row_len(), w.rows());
    let wf: Vec<f32> = match w.dtype {
        GgmlType::F32 | GgmlType::BF16 => w
            .to_f32()
            .unwrap()
            .into_iter()
            .map(|x| f16::from_f32(x).to_f32())
            .collect(),
        _ => w.to_f32().unwrap(),
    };
    let mut want = vec![0f64; n * rows];
    for ti in 0..n {
        for r in 0..rows {
            want[ti * rows + r] = (0..cols)
                .map(|c| wf[r * cols + c] as f64 * x[ti * cols + c] as f64)
                .sum();
        }
    }
    want
}

/// Every weight type through the GEMV with `p`'s kernels: odd row counts (not multiples of the
/// 8 rows of a workgroup), one token, a few (one and two groups of four), and more than one
/// workgroup of tokens (9, 16, 37).
#[cfg(feature = "wgpu")]
fn check_matmul(p: &mut Probe, seed: u64) {
    let mut rng = StdRng::seed_from_u64(seed);
    let types = [
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
    for t in types {
        let k = t.block_size().max(8);
        let shapes = [
            (37, 3 * k, 1),
            (37, 3 * k, 5),
            (130, 10 * k, 2),
            (5, k, 9),
            (67, 2 * k, 37),
            (19, 7 * k, 16),
            (3, 33 * k, 1),
        ];
        for (rows, cols, n) in shapes {
            let w = tensor(&mut rng, t, rows, cols);
            let x = rnd(&mut rng, n * cols, 1.0);
            let got = p.matmul(&w, &x, n).unwrap();
            let want = reference_product(&w, &x, n);
            let e = rel_l2(&got, &want);
            assert!(
                e < metric::DOT_F32,
                "{} {rows}x{cols} n={n} (subgroup sums: {}): rel L2 {e:e}",
                t.name(),
                p.k.subgroup
            );
        }
    }
}

quire_testkit::wgpu_test! {
    fn matmul_matches_the_dequantized_product_for_every_weight_type() {
        let mut p = probe();
        check_matmul(&mut p, 1);
    }
}

quire_testkit::wgpu_test! {
    fn matmul_without_subgroups_matches_the_dequantized_product() {
        // The workgroup-memory reduction, for adapters without SUBGROUP.
        let mut p = probe();
        p.k = Kernels::with_subgroups(&p.gpu, false).unwrap();
        check_matmul(&mut p, 7);
    }
}

quire_testkit::wgpu_test! {
    fn embedding_rows_are_the_dequantized_rows() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(2);
        let types = [
            GgmlType::F16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ];
        for t in types {
            let (rows, cols) = (23, 3 * t.block_size().max(32));
            let w = tensor(&mut rng, t, rows, cols);
            let wf = w.to_f32().unwrap();
            let tokens = [5u32, 0, 22, 5, 17];
            let got = p.embed(&w, &tokens).unwrap();
            // Scale-only types round once, as the CPU does: equal bits. The affine ones
            // (d * q - m) may be one fused multiply-add on a GPU: within an f32 rounding of the
            // row's largest value.
            let affine = matches!(t, GgmlType::Q4_1 | GgmlType::Q4_K | GgmlType::Q5_K);
            for (i, &tok) in tokens.iter().enumerate() {
                let row = &wf[tok as usize * cols..][..cols];
                let g = &got[i * cols..][..cols];
                if affine {
                    let top = row.iter().fold(0f32, |a, v| a.max(v.abs()));
                    for (a, b) in g.iter().zip(row) {
                        assert!((a - b).abs() <= top * 2.0 * f32::EPSILON, "{} token {tok}: {a} vs {b}", t.name());
                    }
                } else {
                    assert_eq!(g, row, "{} token {tok}", t.name());
                }
            }
        }
    }
}

quire_testkit::wgpu_test! {
    fn rms_norm_matches_the_cpu() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(3);
        for (n, dim) in [(1, 576), (7, 100), (3, 2048)] {
            let x = rnd(&mut rng, n * dim, 3.0);
            let w = rnd(&mut rng, dim, 1.0);
            let mut want = vec![0f32; n * dim];
            ops::rms_norm(&x, &w, 1e-5, &mut want);
            let got = p.rms_norm(&x, &w, 1e-5).unwrap();
            let e = rel_l2(&got, &want);
            assert!(e < metric::F32_ELEMENTWISE, "n={n} dim={dim}: {e:e}");
        }
    }
}

quire_testkit::wgpu_test! {
    fn bias_qk_norm_and_rope_match_the_cpu() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(4);
        let shape = HeadShape { q_heads: 6, kv_heads: 2, head_dim: 64 };
        let (qs, kvs) = (shape.q_size(), shape.kv_size());
        let n = 5;
        for style in [RopeStyle::Normal, RopeStyle::Neox] {
            for (rope_dim, bias, norm) in [(64, false, false), (64, true, true), (32, true, false)] {
                let qkv = rnd(&mut rng, n * shape.stride(), 2.0);
                let b = rnd(&mut rng, shape.stride(), 0.5);
                let (qn, kn) = (rnd(&mut rng, 64, 1.0), rnd(&mut rng, 64, 1.0));
                let table = ops::RopeTable::new(rope_dim, 10000.0, None);
                let positions = [0u32, 1, 17, 300, 4095];
                let mut cs = Vec::new();
                let mut tmp = Vec::new();
                for &pos in &positions {
                    table.angles(pos, &mut tmp);
                    cs.extend_from_slice(&tmp);
                }
                let mut want = qkv.clone();
                for (t, row) in want.chunks_exact_mut(shape.stride()).enumerate() {
                    if bias {
                        ops::add_in_place(row, &b);
                    }
                    let (q, rest) = row.split_at_mut(qs);
                    let k = &mut rest[..kvs];
                    if norm {
                        ops::rms_norm_heads(q, &qn, 1e-6);
                        ops::rms_norm_heads(k, &kn, 1e-6);
                    }
                    let c = &cs[t * rope_dim / 2..(t + 1) * rope_dim / 2];
                    ops::rope(q, 64, c, style);
                    ops::rope(k, 64, c, style);
                }
                let got = p
                    .qkv_post(
                        shape,
                        &qkv,
                        bias.then_some(&b[..]),
                        norm.then_some((&qn[..], &kn[..])),
                        &cs,
                        style == RopeStyle::Neox,
                        1e-6,
                    )
                    .unwrap();
                let e = rel_l2(&got, &want);
                assert!(
                    e < metric::F32_ELEMENTWISE,
                    "{style:?} rope_dim {rope_dim} bias {bias} norm {norm}: {e:e}"
                );
            }
        }
    }
}

quire_testkit::wgpu_test! {
    fn swiglu_and_argmax_match_the_host() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(5);
        let (n, inter) = (3, 300);
        let gu = rnd(&mut rng, n * 2 * inter, 6.0);
        let want: Vec<f32> = (0..n * inter)
            .map(|i| {
                let (t, j) = (i / inter, i % inter);
                let (g, u) = (gu[t * 2 * inter + j], gu[t * 2 * inter + inter + j]);
                g / (1.0 + (-g).exp()) * u
            })
            .collect();
        let got = p.swiglu(&gu, inter).unwrap();
        let e = rel_l2(&got, &want);
        assert!(e < metric::F32_ELEMENTWISE, "swiglu: {e:e}");

        let vocab = 1000;
        let mut logits = rnd(&mut rng, 4 * vocab, 10.0);
        logits[3] = 50.0; // row 0: a tie, the first wins
        logits[700] = 50.0;
        logits[vocab] = f32::NAN; // row 1: NaN never wins
        logits[vocab + 999] = 60.0;
        for l in &mut logits[2 * vocab..3 * vocab] {
            *l = f32::NAN; // row 2: all NaN gives 0
        }
        let want: Vec<u32> = logits.chunks_exact(vocab).map(quire_backend::argmax).collect();
        assert_eq!(want[..3], [3, 999, 0]);
        assert_eq!(p.argmax(&logits, vocab).unwrap(), want);
    }
}

/// f64 causal attention of every new token over its sequence's keys (the dense copies).
#[cfg(feature = "wgpu")]
fn reference(b: &PagedBatch<f16>, q: &[f32], s: HeadShape, window: usize) -> Vec<f64> {
    let (hd, kvr) = (s.head_dim, s.kv_size());
    let group = s.q_heads / s.kv_heads;
    let mut out = vec![0f64; b.tokens() * s.q_size()];
    for seq in &b.seqs {
        for i in 0..seq.query_len {
            let t = seq.query_start + i;
            let pos = seq.seq_len - seq.query_len + i;
            let first = if window > 0 {
                (pos + 1).saturating_sub(window)
            } else {
                0
            };
            for h in 0..s.q_heads {
                let kvh = h / group;
                let qh = &q[t * s.q_size() + h * hd..][..hd];
                let scores: Vec<f64> = (first..=pos)
                    .map(|j| {
                        let k = &seq.keys[j * kvr + kvh * hd..][..hd];
                        let d: f64 = qh.iter().zip(k).map(|(&a, &b)| a as f64 * b as f64).sum();
                        d / (hd as f64).sqrt()
                    })
                    .collect();
                let m = scores.iter().cloned().fold(f64::MIN, f64::max);
                let z: f64 = scores.iter().map(|x| (x - m).exp()).sum();
                for (j, sc) in (first..=pos).zip(&scores) {
                    let v = &seq.values[j * kvr + kvh * hd..][..hd];
                    let pr = (sc - m).exp() / z;
                    for d in 0..hd {
                        out[t * s.q_size() + h * hd + d] += pr * v[d] as f64;
                    }
                }
            }
        }
    }
    out
}

quire_testkit::wgpu_test! {
    fn paged_attention_writes_the_cache_and_matches_dense_attention() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(6);
        // (shape, block size, window, (cached, new) per sequence)
        type Case = (HeadShape, usize, Option<usize>, Vec<(usize, usize)>);
        let cases: [Case; 4] = [
            // Decodes and a prompt chunk on top of a cached context, GQA 3.
            (HeadShape { q_heads: 6, kv_heads: 2, head_dim: 64 }, 16, None,
             vec![(100, 1), (0, 37), (63, 13), (5, 1)]),
            // Head dim 128 (two pairs per invocation), block 32, a fresh odd prompt.
            (HeadShape { q_heads: 4, kv_heads: 4, head_dim: 128 }, 32, None,
             vec![(0, 71), (200, 1)]),
            // Sliding window 40: keys before it are NaN in the cache.
            (HeadShape { q_heads: 8, kv_heads: 2, head_dim: 32 }, 16, Some(40),
             vec![(100, 1), (63, 13), (0, 50)]),
            // GQA 16, head dim 128: the kernel's largest group.
            (HeadShape { q_heads: 16, kv_heads: 1, head_dim: 128 }, 16, None,
             vec![(70, 3), (0, 1)]),
        ];
        for (shape, bs, window, seqs) in cases {
            let case = PagedCase { window, ..PagedCase::new(bs, shape.kv_size(), &seqs) };
            let b: PagedBatch<f16> = case.generate(&mut rng);
            let n = b.tokens();
            let q = rnd(&mut rng, n * shape.q_size(), 1.0);
            // QKV rows: [q | k | v] of each new token.
            let mut qkv = Vec::with_capacity(n * shape.stride());
            for t in 0..n {
                qkv.extend_from_slice(&q[t * shape.q_size()..][..shape.q_size()]);
                qkv.extend_from_slice(&b.k_new[t * shape.kv_size()..][..shape.kv_size()]);
                qkv.extend_from_slice(&b.v_new[t * shape.kv_size()..][..shape.kv_size()]);
            }
            let mut tables = Vec::new();
            let mut tokens = Vec::new();
            for s in &b.seqs {
                let off = tables.len() as u32;
                tables.extend(s.block_table.iter().map(|x| x.0));
                for i in 0..s.query_len {
                    let t = s.query_start + i;
                    tokens.push([
                        b.positions[t],
                        b.slot_mapping[t],
                        (s.seq_len - s.query_len) as u32,
                        s.query_start as u32,
                        off,
                    ]);
                }
            }
            let out = p
                .attention(&AttnInput {
                    shape,
                    block_size: bs,
                    window: window.unwrap_or(0),
                    qkv: &qkv,
                    k_cache: &b.k_cache,
                    v_cache: &b.v_cache,
                    tokens: &tokens,
                    tables: &tables,
                })
                .unwrap();
            let want = reference(&b, &q, shape, window.unwrap_or(0));
            let mut e = RelL2::default();
            e.add(&out.out, &want);
            assert!(
                e.value() < metric::ATTENTION_F32,
                "{shape:?} block {bs} window {window:?}: {:e}",
                e.value()
            );
            // The cache: each new token's slot holds its K/V, every other slot is untouched.
            let mut k_want = b.k_cache.clone();
            let mut v_want = b.v_cache.clone();
            let row = shape.kv_size();
            for (t, &slot) in b.slot_mapping.iter().enumerate() {
                for i in 0..row {
                    k_want[slot as usize * row + i] = f16::from_f32(b.k_new[t * row + i]);
                    v_want[slot as usize * row + i] = f16::from_f32(b.v_new[t * row + i]);
                }
            }
            let bits = |v: &[f16]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
            assert!(bits(&out.k_cache) == bits(&k_want), "K cache after the write");
            assert!(bits(&out.v_cache) == bits(&v_want), "V cache after the write");
        }
    }
}
