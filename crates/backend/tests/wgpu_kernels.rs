//! The wgpu backend's own kernel variants, beyond what the per-executor op suite
//! (`backend_ops.rs`) runs on every backend: the GEMV with subgroup sums and its workgroup-memory
//! fallback for adapters without subgroups (every weight type, odd row counts, 1..8 tokens and
//! more), the decode attention split over key ranges then merged, with its lane sums through
//! subgroups and through workgroup memory (long, odd and windowed contexts on testkit's
//! random paged batches: scattered block tables, NaN-poisoned unused slots), the tiled prompt
//! attention (odd chunk lengths on cached prefixes, windows, GQA 1 to 4, both row-sum forms)
//! and its query tiles, and timed runs.
//! Plain CPU references, the testkit's metric; outputs are poisoned with NaN before each run. Needs an adapter (lavapipe will do):
//! ignored unless QUIRE_REQUIRE_WGPU is set at build time (see quire-testkit).

#[cfg(feature = "wgpu")]
use {
    half::f16,
    quire_backend::wgpu::gemm::GemmPath,
    quire_backend::wgpu::gemv::{gemv_pipeline, Gemv, GemvIn, SLOT_FOLD},
    quire_backend::wgpu::kernels::{
        bind, encode, Dispatch, HeadShape, Kernels, MmShape, PromptPath, SplitPlan,
    },
    quire_backend::wgpu::probe::{AttnInput, Probe},
    quire_backend::wgpu::weights::DMatrix,
    quire_backend::HostTensor,
    quire_gguf::GgmlType,
    quire_testkit::metric::{self, rel_l2, RelL2},
    quire_testkit::paged::{PagedBatch, PagedCase},
    quire_testkit::random::{rnd, tensor},
    rand::{rngs::StdRng, SeedableRng},
};

#[cfg(feature = "wgpu")]
fn probe() -> Probe {
    let adapter = std::env::var("QUIRE_WGPU_ADAPTER").ok();
    Probe::new(adapter.as_deref())
        .unwrap_or_else(|e| quire_testkit::missing(quire_testkit::Backend::Wgpu, &e))
}

/// The f64 product `x` · `w`ᵀ of `[n, cols]` and `[rows, cols]`, the operands as the device's
/// kernel sees them: f32 and bf16 weights go to the device as f16, and where `f16_operands`
/// (the cooperative-matrix GEMM) the dequantized weights and the activations are rounded to
/// f16 too. The reference rounds the same way.
#[cfg(feature = "wgpu")]
fn reference_product(w: &HostTensor, x: &[f32], n: usize, f16_operands: bool) -> Vec<f64> {
    let (cols, rows) = (w.row_len(), w.rows());
    let round = |v: f32| f16::from_f32(v).to_f32();
    let to_f16 = f16_operands || matches!(w.dtype, GgmlType::F32 | GgmlType::BF16);
    let wf: Vec<f32> = w
        .to_f32()
        .unwrap()
        .into_iter()
        .map(|v| if to_f16 { round(v) } else { v })
        .collect();
    let xf: Vec<f32> = x
        .iter()
        .map(|&v| if f16_operands { round(v) } else { v })
        .collect();
    let mut want = vec![0f64; n * rows];
    for ti in 0..n {
        for r in 0..rows {
            want[ti * rows + r] = (0..cols)
                .map(|c| wf[r * cols + c] as f64 * xf[ti * cols + c] as f64)
                .sum();
        }
    }
    want
}

/// Every weight type through the GEMV with `p`'s kernels: odd row counts (not multiples of the
/// 16 rows of a workgroup, nor of the pairs of rows a group walks: 1, 3, 17, 33 rows), every
/// token count of one workgroup (1..8: one vec of four, two, a partial second), more than one
/// workgroup of tokens (9, 16, 37), and rows of fewer units than a subgroup has invocations.
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
            (1, 2 * k, 1),
            (17, 5 * k, 3),
            (33, 9 * k, 8),
            (16, k, 6),
        ];
        let every_n = (1..=8).map(|n| (21, 2 * k, n));
        for (rows, cols, n) in shapes.into_iter().chain(every_n) {
            let w = tensor(&mut rng, t, rows, cols);
            let x = rnd(&mut rng, n * cols, 1.0);
            let got = p.matmul(&w, &x, n).unwrap();
            // The GEMV and the tiled GEMM sum f32 products of the operands as given; the
            // matrix units' f16 fragments accumulate in f32 in their own order.
            let path = p.matmul_path(t, n);
            let coop = matches!(path, Some(GemmPath::Coop(..)));
            let want = reference_product(&w, &x, n, coop);
            let e = rel_l2(&got, &want);
            let bound = if coop {
                metric::DOT_F32_VS_CUBLAS
            } else {
                metric::DOT_F32
            };
            assert!(
                e < bound,
                "{} {rows}x{cols} n={n} (subgroup sums: {}, GEMM: {}): rel L2 {e:e} over {bound:e}",
                t.name(),
                p.k.subgroup,
                path.map_or("none (GEMV)".into(), |g| g.name()),
            );
        }
    }
}

quire_testkit::wgpu_test! {
    fn matmul_with_subgroups_matches_the_dequantized_product() {
        // The subgroupAdd reduction the executor picks where the adapter has SUBGROUP (lavapipe
        // does, with subgroups of 8: a group of rows takes several passes over its units).
        let mut p = probe();
        assert!(
            p.gpu.caps.subgroup.is_some(),
            "adapter {} has no subgroups: this test needs one that has",
            p.gpu.info.name
        );
        p.k = Kernels::with_subgroups(&p.gpu, true).unwrap();
        check_matmul(&mut p, 11);
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

/// One attention case: (shape, block size, window, (cached, new) per sequence).
#[cfg(feature = "wgpu")]
type AttnCase = (HeadShape, usize, Option<usize>, Vec<(usize, usize)>);

/// Runs `case` through the probe (the kernel the executor would pick for it) against the f64
/// reference, checks the fused KV write bit for bit, and returns what ran.
#[cfg(feature = "wgpu")]
fn check_attention(p: &mut Probe, rng: &mut StdRng, case: &AttnCase) -> Option<SplitPlan> {
    check_attention_as(p, rng, case, None, None)
}

/// [`check_attention`] with the decode kernel's split and keys per step forced (decode rows);
/// also runs the kernel three more times back to back and checks the output is the same bits
/// (the last-arriver counters are left at zero for the next dispatch).
#[cfg(feature = "wgpu")]
fn check_attention_as(
    p: &mut Probe,
    rng: &mut StdRng,
    case: &AttnCase,
    plan: Option<SplitPlan>,
    keys: Option<usize>,
) -> Option<SplitPlan> {
    let (shape, bs, window, seqs) = case;
    let (shape, bs, window) = (*shape, *bs, *window);
    let case = PagedCase {
        window,
        ..PagedCase::new(bs, shape.kv_size(), seqs)
    };
    let b: PagedBatch<f16> = case.generate(rng);
    let n = b.tokens();
    let q = rnd(rng, n * shape.q_size(), 1.0);
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
    let input = AttnInput {
        shape,
        block_size: bs,
        window: window.unwrap_or(0),
        qkv: &qkv,
        k_cache: &b.k_cache,
        v_cache: &b.v_cache,
        tokens: &tokens,
        tables: &tables,
        plan,
        keys,
    };
    let run = p.attention_run(&input).unwrap();
    let plan = run.plan;
    let out = p.attention(&input).unwrap();
    p.time_back_to_back(&run.list, 3, 1).unwrap();
    let again = p.attention_read(&run).unwrap();
    let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
    assert!(
        bits(&again.out) == bits(&out.out),
        "{shape:?} split {plan:?} keys {keys:?}: repeated runs differ"
    );
    let want = reference(&b, &q, shape, window.unwrap_or(0));
    let mut e = RelL2::default();
    e.add(&out.out, &want);
    // The coop prompt kernel's Q and P are f16 on matrix units; the others compute in f32.
    let coop = plan.is_none() && matches!(p.k.attention.path(&shape), PromptPath::Coop(_));
    let bound = if coop {
        metric::ATTENTION_GPU
    } else {
        metric::ATTENTION_F32
    };
    assert!(
        e.value() < bound,
        "{shape:?} block {bs} window {window:?} split {plan:?}: {:e}",
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
    assert!(
        bits(&out.k_cache) == bits(&k_want),
        "K cache after the write"
    );
    assert!(
        bits(&out.v_cache) == bits(&v_want),
        "V cache after the write"
    );
    plan
}

quire_testkit::wgpu_test! {
    fn split_decode_attention_matches_dense_attention() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(7);
        // Decode rows only (the split kernels): contexts of several tiles, odd lengths, rows
        // far shorter than the longest (their later ranges are empty), one-key rows.
        let cases: [AttnCase; 5] = [
            // GQA 3 (reductions over 32 lanes of the 42 a head could have), block 16.
            (HeadShape { q_heads: 6, kv_heads: 2, head_dim: 64 }, 16, None,
             vec![(700, 1), (0, 1), (129, 1), (255, 1)]),
            // The seed shape's heads, block 32, head dim 128 (one key lane per V pair … two).
            (HeadShape { q_heads: 16, kv_heads: 8, head_dim: 128 }, 32, None,
             vec![(1023, 1), (517, 1), (31, 1)]),
            // Sliding window 300 over 900 keys: the NaN keys before it are never read.
            (HeadShape { q_heads: 8, kv_heads: 2, head_dim: 32 }, 16, Some(300),
             vec![(900, 1), (130, 1)]),
            // GQA 16 (the largest group), head dim 96: 48 pairs, two key lanes.
            (HeadShape { q_heads: 16, kv_heads: 1, head_dim: 96 }, 64, None,
             vec![(333, 1), (2, 1)]),
            // Head dim 256: one key lane, 128 pairs.
            (HeadShape { q_heads: 2, kv_heads: 2, head_dim: 256 }, 128, None,
             vec![(1500, 1)]),
        ];
        // The kernel as the adapter runs it (lane sums through subgroups where it has them),
        // then with the workgroup-memory sums of adapters without subgroups.
        let has_subgroups = p.gpu.caps.subgroup.is_some();
        for subgroup in [has_subgroups, false] {
            p.k = Kernels::with_subgroups(&p.gpu, subgroup).unwrap();
            for case in &cases {
                let plan = check_attention(&mut p, &mut rng, case).expect("decode rows split");
                let d = p.k.attn_split.kernel(&case.0);
                assert_eq!(d.subgroup, subgroup, "{d:?}");
                eprintln!("{:?}: {plan:?}, {}", case.0, d.describe());
            }
            // The first case splits its longest row over several ranges.
            let plan = check_attention(&mut p, &mut rng, &cases[0]).unwrap();
            assert!(plan.splits > 1, "{plan:?}");
        }
    }
}

quire_testkit::wgpu_test! {
    fn decode_attention_variants_and_many_ranges_match_dense_attention() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(11);
        // GQA 4 at head dim 64, block 16: a long row (294 blocks: one range of it outgrows the
        // kernel's table in workgroup memory), a short one (most of its ranges empty) and a
        // middling one.
        let shape = HeadShape { q_heads: 8, kv_heads: 2, head_dim: 64 };
        let case: AttnCase = (shape, 16, None, vec![(4700, 1), (36, 1), (1029, 1)]);
        // The engine's split, one range per row (written straight to the output), and the most
        // ranges, of an odd length, merged by the last workgroup to finish.
        let plans = [
            None,
            Some(SplitPlan { splits: 1, split_keys: 4701 }),
            Some(SplitPlan { splits: 64, split_keys: 75 }),
        ];
        let has_subgroups = p.gpu.caps.subgroup.is_some();
        for subgroup in [has_subgroups, false] {
            p.k = Kernels::with_subgroups(&p.gpu, subgroup).unwrap();
            for keys in [1, 2, 4, 8] {
                for plan in plans {
                    check_attention_as(&mut p, &mut rng, &case, plan, Some(keys))
                        .expect("decode rows split");
                }
            }
        }
    }
}

quire_testkit::wgpu_test! {
    fn timed_attention_runs_give_positive_times_and_the_same_output() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(8);
        let shape = HeadShape { q_heads: 4, kv_heads: 2, head_dim: 64 };
        let case = PagedCase::new(16, shape.kv_size(), &[(200, 1), (50, 1)]);
        let b: PagedBatch<f16> = case.generate(&mut rng);
        let n = b.tokens();
        let mut qkv = Vec::new();
        for t in 0..n {
            qkv.extend(rnd(&mut rng, shape.q_size(), 1.0));
            qkv.extend_from_slice(&b.k_new[t * shape.kv_size()..][..shape.kv_size()]);
            qkv.extend_from_slice(&b.v_new[t * shape.kv_size()..][..shape.kv_size()]);
        }
        let mut tables = Vec::new();
        let mut tokens = Vec::new();
        for s in &b.seqs {
            let off = tables.len() as u32;
            tables.extend(s.block_table.iter().map(|x| x.0));
            let t = s.query_start;
            tokens.push([b.positions[t], b.slot_mapping[t], b.positions[t], t as u32, off]);
        }
        let input = AttnInput {
            shape, block_size: 16, window: 0, qkv: &qkv, k_cache: &b.k_cache,
            v_cache: &b.v_cache, tokens: &tokens, tables: &tables, plan: None, keys: None,
        };
        let run = p.attention_run(&input).unwrap();
        let (ns, gpu) = p.time(&run.list, 5).unwrap();
        assert_eq!(ns.len(), 5);
        assert!(ns.iter().all(|&t| t > 0.0 && t < 60e9), "{ns:?} (GPU timestamps: {gpu})");
        let once = p.attention_read(&run).unwrap();
        let fresh = p.attention(&input).unwrap();
        let bits = |v: &[f32]| v.iter().map(|x| x.to_bits()).collect::<Vec<_>>();
        assert!(bits(&once.out) == bits(&fresh.out), "five timed runs = one run");
    }
}

quire_testkit::wgpu_test! {
    fn prompt_attention_matches_dense_attention() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(9);
        // Prompt chunks (the tiled kernel): query lengths 1, 7, 33 and 130 (tiles cut mid-chunk,
        // a last tile of one token), fresh and on cached prefixes (a chunk that starts
        // mid-sequence and mid-block), beside decode rows in one batch; GQA 1, 3 and 4; head
        // dims 64 and 128; the testkit's shuffled block tables with NaN in every unused slot.
        let h = |q_heads, kv_heads, head_dim| HeadShape { q_heads, kv_heads, head_dim };
        let cases: [AttnCase; 7] = [
            (h(4, 4, 64), 16, None, vec![(0, 7), (45, 33), (0, 1), (300, 1)]),
            (h(6, 2, 64), 16, None, vec![(0, 130), (19, 7), (77, 1)]),
            (h(8, 2, 128), 32, None, vec![(0, 33), (150, 130), (3, 1)]),
            (h(12, 3, 128), 16, None, vec![(61, 7), (0, 33), (200, 1)]),
            (h(3, 1, 64), 64, None, vec![(0, 130), (130, 33)]),
            // Sliding windows shorter than the chunk (rows of one tile start at different keys).
            (h(8, 2, 64), 16, Some(20), vec![(90, 33), (0, 130)]),
            (h(4, 1, 128), 32, Some(100), vec![(250, 130), (5, 7)]),
        ];
        // As the adapter runs it (the coop kernel where the adapter has matrix units), then the
        // scalar kernel with its row sums through subgroups (where they hold 8 lanes) and
        // through workgroup memory.
        let has_subgroups = p.gpu.caps.subgroup.is_some();
        let has_coop = p.k.attention.coop.is_some();
        eprintln!(
            "prompt attention paths: {}scalar",
            if has_coop { "coop, " } else { "(no coop kernel on this adapter) " }
        );
        let runs = [(has_subgroups, true), (has_subgroups, false), (false, false)];
        for (subgroup, coop) in runs.into_iter().filter(|r| has_coop || !r.1) {
            p.k = Kernels::with_subgroups(&p.gpu, subgroup).unwrap();
            if !coop {
                p.k.attention.coop = None;
            }
            for case in &cases {
                let want = coop && (case.0.head_dim == 64 || case.0.head_dim == 128);
                let path = p.k.attention.path(&case.0);
                assert_eq!(matches!(path, PromptPath::Coop(_)), want, "{case:?}: {path:?}");
                let plan = check_attention(&mut p, &mut rng, case);
                assert!(plan.is_none(), "prompt chunks take the prompt kernel: {plan:?}");
            }
        }
    }
}

#[cfg(feature = "wgpu")]
#[test]
fn query_tiles_cover_every_token_of_a_sequence_once() {
    use quire_backend::wgpu::kernels::{fill_tiles, TOK_WORDS};
    // Three sequences of 5, 1 and 9 tokens (first rows 0, 5, 6), tiles of at most 4 tokens.
    let mut tok = vec![0u32; 15 * TOK_WORDS];
    for (first, len, toff) in [(0u32, 5u32, 0u32), (5, 1, 3), (6, 9, 7)] {
        for t in first..first + len {
            let w = &mut tok[t as usize * TOK_WORDS..][..5];
            w.copy_from_slice(&[t - first + 40, t, 40, first, toff]);
        }
    }
    let tiles = fill_tiles(&mut tok, 4);
    let got: Vec<(u32, u32)> = (0..tiles)
        .map(|i| (tok[i * TOK_WORDS + 5], tok[i * TOK_WORDS + 6]))
        .collect();
    assert_eq!(got, [(0, 4), (4, 1), (5, 1), (6, 4), (10, 4), (14, 1)]);
    // The token words stay as they were.
    assert_eq!(&tok[14 * TOK_WORDS..][..5], &[48, 14, 40, 6, 7]);
}

quire_testkit::wgpu_test! {
    fn down_gemv_with_the_swiglu_in_its_input_matches_the_product() {
        // The decode down projection reading [gate | up] rows through silu(gate) · up, against
        // the f64 product of the dequantized weights with the activation computed on the host
        // (f32, as the unfused kernel writes it): every weight type, odd rows, 1..8 tokens.
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(11);
        let has_subgroups = p.gpu.caps.subgroup.is_some();
        for subgroup in [has_subgroups, false] {
            p.k = Kernels::with_subgroups(&p.gpu, subgroup).unwrap();
            for t in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1,
                      GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
                let k = t.block_size().max(8);
                for (rows, cols, n) in [(37, 3 * k, 1), (21, 2 * k, 5), (17, 5 * k, 8)] {
                    let w = tensor(&mut rng, t, rows, cols);
                    let gu = rnd(&mut rng, n * 2 * cols, 3.0);
                    let act: Vec<f32> = (0..n * cols)
                        .map(|i| {
                            let (ti, c) = (i / cols, i % cols);
                            let g = gu[ti * 2 * cols + c];
                            g / (1.0 + (-g).exp()) * gu[ti * 2 * cols + cols + c]
                        })
                        .collect();
                    let got = p.matmul_swiglu(&w, &gu, n).unwrap();
                    let want = reference_product(&w, &act, n, false);
                    let e = rel_l2(&got, &want);
                    assert!(
                        e < metric::DOT_F32,
                        "{t:?} {rows}x{cols} n={n} (subgroup sums: {subgroup}): rel L2 {e:e}"
                    );
                }
            }
        }
    }
}

/// `x` · `w`ᵀ (`[n, rows]`) through GEMV design `g` with subgroup sums or without, reading `x`
/// as stored or (`swiglu`: `x` is `[n, 2 cols]` [gate | up] rows) as silu(gate) · up; the output
/// is poisoned with NaN first.
#[cfg(feature = "wgpu")]
fn run_gemv(
    p: &mut Probe,
    g: Gemv,
    subgroup: bool,
    w: &HostTensor,
    x: &[f32],
    n: usize,
    swiglu: bool,
) -> Vec<f32> {
    let (cols, rows) = (w.row_len(), w.rows());
    let m = DMatrix::stack(&mut p.gpu, &w.name, &[w], cols).unwrap();
    let f32s = |v: &[f32]| v.iter().flat_map(|f| f.to_le_bytes()).collect::<Vec<u8>>();
    let xb = p.gpu.upload("x", &f32s(x)).unwrap();
    let yu =
        wgpu::BufferUsages::STORAGE | wgpu::BufferUsages::COPY_SRC | wgpu::BufferUsages::COPY_DST;
    let y = p.gpu.buffer("y", (n * rows * 4) as u64, yu).unwrap();
    p.gpu
        .queue
        .write_buffer(&y, 0, &f32s(&vec![f32::NAN; n * rows]));
    let usage = wgpu::BufferUsages::UNIFORM | wgpu::BufferUsages::COPY_DST;
    let input = if swiglu {
        GemvIn::Swiglu
    } else {
        GemvIn::Plain
    };
    let mut list = Vec::new();
    for part in &m.parts {
        let s = MmShape {
            rows: part.rows,
            cols,
            n,
            x_stride: if swiglu { 2 * cols } else { cols },
            y_stride: rows,
            y_off: part.y_off,
            add: false,
            row_words: part.ty.row_words(cols),
            row0: part.row0,
        };
        let pbuf = p.gpu.buffer("params", 64, usage).unwrap();
        let words: Vec<u8> = s.params().iter().flat_map(|w| w.to_le_bytes()).collect();
        p.gpu.queue.write_buffer(&pbuf, 0, &words);
        let pipe = gemv_pipeline(&p.gpu, part.ty, g, subgroup, input).unwrap();
        let bind = bind(
            &p.gpu,
            &pipe,
            (&pbuf, 0),
            &[(1, &part.buf), (2, &xb), (3, &y)],
        );
        list.push(Dispatch {
            name: "gemv",
            pipe,
            bind,
            groups: g.groups(&s),
            bytes: 0,
            flops: 0,
        });
    }
    let mut enc = p.gpu.device.create_command_encoder(&Default::default());
    encode(&mut enc, &list);
    p.gpu.submit_wait(enc.finish()).unwrap();
    let b = p.gpu.download(&y, (n * rows * 4) as u64).unwrap();
    b.chunks_exact(4)
        .map(|c| f32::from_le_bytes([c[0], c[1], c[2], c[3]]))
        .collect()
}

quire_testkit::wgpu_test! {
    fn every_gemv_design_matches_the_dequantized_product() {
        // Each design wgpu_gemv_bench offers (and the engine's), with subgroup sums and without,
        // plain and with the SwiGLU in its input, every weight type: row counts that are not
        // multiples of a workgroup's rows (1, 3, 17, 37), rows shorter than a workgroup's
        // stride of slots and several strides long (k to 33 k columns), 1..8 tokens.
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(23);
        let subs: &[bool] = if p.gpu.caps.subgroup.is_some() { &[true, false] } else { &[false] };
        let mut designs = Gemv::CANDIDATES.to_vec();
        designs.extend([Gemv::SLOT, Gemv::Slot { rows: 1, wg: 32 }]);
        for g in designs {
            for &sub in subs {
                for t in [GgmlType::F16, GgmlType::Q8_0, GgmlType::Q4_0, GgmlType::Q4_1,
                          GgmlType::Q4_K, GgmlType::Q5_K, GgmlType::Q6_K] {
                    let k = t.block_size().max(8);
                    let shapes = [(37, 3 * k, 1), (1, k, 1), (3, 33 * k, 2), (17, 7 * k, 8),
                                  (18, 2 * k, 3)];
                    for (i, &(rows, cols, n)) in shapes.iter().enumerate() {
                        let swiglu = i % 2 == 1;
                        let w = tensor(&mut rng, t, rows, cols);
                        let xin = rnd(&mut rng, n * cols * (1 + swiglu as usize), 2.0);
                        let act: Vec<f32> = if swiglu {
                            (0..n * cols)
                                .map(|i| {
                                    let (ti, c) = (i / cols, i % cols);
                                    let g = xin[ti * 2 * cols + c];
                                    g / (1.0 + (-g).exp()) * xin[ti * 2 * cols + cols + c]
                                })
                                .collect()
                        } else {
                            xin.clone()
                        };
                        let got = run_gemv(&mut p, g, sub, &w, &xin, n, swiglu);
                        let want = reference_product(&w, &act, n, false);
                        let e = rel_l2(&got, &want);
                        assert!(
                            e < metric::DOT_F32,
                            "{} {} {rows}x{cols} n={n} swiglu={swiglu} subgroup={sub}: rel L2 {e:e}",
                            g.name(), t.name()
                        );
                    }
                }
            }
        }
    }
}

quire_testkit::wgpu_test! {
    fn slot_gemv_folds_its_grid_past_32768_row_blocks() {
        // One row per workgroup, so 32,771 rows take a second row of the grid along y.
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(5);
        let g = Gemv::Slot { rows: 1, wg: 32 };
        let sub = p.gpu.caps.subgroup.is_some();
        for t in [GgmlType::Q4_0, GgmlType::F16] {
            let (rows, cols) = (SLOT_FOLD as usize + 3, t.block_size().max(8));
            let w = tensor(&mut rng, t, rows, cols);
            let x = rnd(&mut rng, cols, 1.0);
            let got = run_gemv(&mut p, g, sub, &w, &x, 1, false);
            let want = reference_product(&w, &x, 1, false);
            let e = rel_l2(&got, &want);
            assert!(e < metric::DOT_F32, "{} {rows}x{cols}: rel L2 {e:e}", t.name());
        }
    }
}

quire_testkit::wgpu_test! {
    fn unit_gemv_matches_the_dequantized_product() {
        // The unit kernel (gemv_q.wgsl) for each type it has: its designs with subgroup sums and
        // without, plain and with the SwiGLU in its input; row counts that are not multiples of
        // a workgroup's rows, rows shorter than a workgroup's stride of units and many strides
        // long (Llama-3-8B's down projection's 14,336 columns), a tall odd matrix (an lm_head
        // scaled down), 1..3 tokens (along the grid's z).
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(36);
        let subs: &[bool] = if p.gpu.caps.subgroup.is_some() { &[true, false] } else { &[false] };
        for g in Gemv::UNITS {
            for &sub in subs {
                for t in [GgmlType::Q4_K, GgmlType::Q6_K, GgmlType::Q5_K, GgmlType::Q4_0,
                          GgmlType::Q4_1] {
                    let shapes = [(37, 768, 1), (1, 256, 1), (3, 33 * 256, 2), (17, 1792, 3),
                                  (65, 14336, 1), (1003, 4096, 1)];
                    for (i, &(rows, cols, n)) in shapes.iter().enumerate() {
                        let swiglu = i % 2 == 1;
                        let w = tensor(&mut rng, t, rows, cols);
                        let xin = rnd(&mut rng, n * cols * (1 + swiglu as usize), 2.0);
                        let act: Vec<f32> = if swiglu {
                            (0..n * cols)
                                .map(|i| {
                                    let (ti, c) = (i / cols, i % cols);
                                    let g = xin[ti * 2 * cols + c];
                                    g / (1.0 + (-g).exp()) * xin[ti * 2 * cols + cols + c]
                                })
                                .collect()
                        } else {
                            xin.clone()
                        };
                        let got = run_gemv(&mut p, g, sub, &w, &xin, n, swiglu);
                        let want = reference_product(&w, &act, n, false);
                        let e = rel_l2(&got, &want);
                        assert!(
                            e < metric::DOT_F32,
                            "{} {} {rows}x{cols} n={n} swiglu={swiglu} subgroup={sub}: rel L2 {e:e}",
                            g.name(), t.name()
                        );
                    }
                }
            }
        }
    }
}
