//! The CUDA paged-attention kernels' own choices against the f64 dense reference on random
//! paged batches: which kernel a batch takes (sequences with chunks of 16+ rows run
//! `paged_prefill` on tensor cores, the other rows `paged_decode` when all of them are decodes,
//! else `paged_attention`; checked per case), tile boundaries of every kernel over every block
//! size, GQA ratios 1 to 8 and head dims 64, 128 and 256, key splits of long contexts and their
//! merge, and the decode kernel's own bias, QK-norm and RoPE on un-roped rows (checked against
//! the CPU backend's routines), with f16 and f32 output rows. The general mixed-batch and
//! sliding-window cases every backend runs are in backend_ops.rs. Needs a GPU: ignored without
//! one (see quire-testkit).

// The GPU-only parts compile with the `cuda` feature only; without it every test here fails
// when run (and is ignored unless QUIRE_REQUIRE_GPU is set: see quire-testkit).
#[cfg(feature = "cuda")]
use {
    half::f16,
    quire_backend::cpu::attention::{dense_reference, AttnParams},
    quire_backend::cpu::ops,
    quire_backend::cuda::attention::{HostRun, PagedAttention, RopeInputs, PREFILL_MIN_ROWS},
    quire_backend::cuda::gpu::Gpu,
    quire_backend::{ForwardBatch, SeqBatch},
    quire_core::{BlockId, RopeStyle},
    quire_testkit::metric::{self, RelL2},
    quire_testkit::paged::PagedCase,
    rand::{rngs::StdRng, Rng, SeedableRng},
};

#[cfg(feature = "cuda")]
fn gpu() -> Gpu {
    Gpu::new(0).unwrap_or_else(|e| quire_testkit::no_gpu(&e))
}

/// (query_len, seq_len) of each sequence. Returns the relative error against the dense reference.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn case(
    g: &Gpu,
    rng: &mut StdRng,
    nh: usize,
    nkv: usize,
    d: usize,
    bs: usize,
    seqs: &[(usize, usize)],
    window: Option<usize>,
) -> f64 {
    case_with(g, rng, nh, nkv, d, bs, seqs, window, None)
}

/// What `paged_decode` applies to un-roped QKV rows in a `case_with` (decode batches only).
#[cfg(feature = "cuda")]
#[derive(Debug, Clone, Copy)]
struct Rope {
    rope_dim: usize,
    neox: bool,
    bias: bool,
    qk_norm: bool,
    theta: f32,
}

/// `Rope`'s host data: random bias and norm weights, the (cos, sin) table.
#[cfg(feature = "cuda")]
struct RopeData {
    bias: Option<Vec<f32>>,
    q_norm: Option<Vec<f32>>,
    k_norm: Option<Vec<f32>>,
    cs: Vec<(f32, f32)>,
    pairs: usize,
    style: RopeStyle,
    eps: f32,
}

#[cfg(feature = "cuda")]
impl RopeData {
    fn new(rng: &mut StdRng, r: &Rope, q_size: usize, kv: usize, d: usize, max_pos: usize) -> Self {
        let mut vec = |len: usize, lo: f32, hi: f32| -> Vec<f32> {
            (0..len).map(|_| rng.random_range(lo..hi)).collect()
        };
        let bias = r.bias.then(|| vec(q_size + 2 * kv, -0.5, 0.5));
        let q_norm = r.qk_norm.then(|| vec(d, 0.5, 1.5));
        let k_norm = r.qk_norm.then(|| vec(d, 0.5, 1.5));
        // The table as the CUDA backend builds it at load time (the CPU backend's RopeTable).
        let table = ops::RopeTable::new(r.rope_dim, r.theta, None);
        let (mut cs, mut tmp) = (vec![], vec![]);
        for p in 0..max_pos {
            table.angles(p as u32, &mut tmp);
            cs.extend_from_slice(&tmp);
        }
        let style = if r.neox {
            RopeStyle::Neox
        } else {
            RopeStyle::Normal
        };
        Self {
            bias,
            q_norm,
            k_norm,
            cs,
            pairs: r.rope_dim / 2,
            style,
            eps: 1e-6,
        }
    }

    /// The rows roped on the host the way the CPU backend's forward pass does it (bias, QK-norm,
    /// rotation of q and k).
    // qkv: [n, stride] (q | k | v | padding); positions: [n]
    fn apply(
        &self,
        qkv: &[f32],
        stride: usize,
        q_size: usize,
        kv: usize,
        d: usize,
        positions: &[u32],
    ) -> Vec<f32> {
        let mut out = qkv.to_vec();
        for (t, &p) in positions.iter().enumerate() {
            let row = &mut out[t * stride..t * stride + q_size + 2 * kv];
            if let Some(b) = &self.bias {
                ops::add_in_place(row, b);
            }
            let (q, rest) = row.split_at_mut(q_size);
            let k = &mut rest[..kv];
            if let Some(w) = &self.q_norm {
                ops::rms_norm_heads(q, w, self.eps);
            }
            if let Some(w) = &self.k_norm {
                ops::rms_norm_heads(k, w, self.eps);
            }
            let cs = &self.cs[p as usize * self.pairs..(p as usize + 1) * self.pairs];
            ops::rope(q, d, cs, self.style);
            ops::rope(k, d, cs, self.style);
        }
        out
    }

    fn inputs(&self) -> RopeInputs<'_> {
        RopeInputs {
            bias: self.bias.as_deref(),
            q_norm: self.q_norm.as_deref(),
            k_norm: self.k_norm.as_deref(),
            cs: &self.cs,
            pairs: self.pairs,
            neox: self.style == RopeStyle::Neox,
            eps: self.eps,
        }
    }
}

/// The kernel's f16 K/V against the host's: at most one f16 step apart, or, below 2e-3, within
/// 2e-6. The two QK-norms differ by an f32 rounding or two (sum order, rsqrt), which a rotation
/// that cancels to nearly zero magnifies beyond one step of the (then fine) f16 grid.
#[cfg(feature = "cuda")]
fn kv_close(got: f16, want: f16) -> bool {
    // Ordered integers: adjacent f16 values differ by 1 across zero too.
    let ord = |h: f16| {
        let b = h.to_bits() as i32;
        if b & 0x8000 != 0 {
            -(b & 0x7fff)
        } else {
            b
        }
    };
    let (g, w) = (got.to_f32(), want.to_f32());
    (ord(got) - ord(want)).abs() <= 1 || (w.abs() < 2e-3 && (g - w).abs() <= 2e-6)
}

/// `case`, or with `rope` (and a forced split count) a decode batch whose QKV rows are un-roped:
/// `paged_decode` applies bias, QK-norm and RoPE itself. Such a case runs three times, with one
/// split, the planned splits and the forced count (the in-kernel merge, empty splits included),
/// each checked against the reference (rows roped on the host by the CPU backend's routines) and
/// the cache slots against the host-roped K/V rounded to f16 (`kv_close`), and the split runs'
/// outputs against the unsplit one's.
#[cfg(feature = "cuda")]
#[allow(clippy::too_many_arguments)]
fn case_with(
    g: &Gpu,
    rng: &mut StdRng,
    nh: usize,
    nkv: usize,
    d: usize,
    bs: usize,
    seqs: &[(usize, usize)],
    window: Option<usize>,
    rope: Option<(Rope, usize)>,
) -> f64 {
    let q_size = nh * d;
    let kv = nkv * d;
    let stride = q_size + 2 * kv + 3; // odd padding: rows are not packed
    let stride = stride.div_ceil(4) * 4; // float4 loads need 16-byte rows
                                         // The cache and the dense copies from the shared generator (the new rows' K/V go into the
                                         // QKV rows, their slots stay NaN for the kernel's fused write).
    let gen = PagedCase::new(
        bs,
        kv,
        &seqs
            .iter()
            .map(|&(ql, sl)| (sl - ql, ql))
            .collect::<Vec<_>>(),
    )
    .generate::<f16>(rng);
    let (k_cache, v_cache, num_blocks) = (gen.k_cache, gen.v_cache, gen.num_blocks);
    let (pos, slot) = (gen.positions, gen.slot_mapping);
    let n = pos.len();
    let tok = vec![0u32; n];
    let mut qkv = vec![0f32; n * stride];
    for r in 0..n {
        qkv[r * stride + q_size..r * stride + q_size + kv]
            .copy_from_slice(&gen.k_new[r * kv..(r + 1) * kv]);
        qkv[r * stride + q_size + kv..r * stride + q_size + 2 * kv]
            .copy_from_slice(&gen.v_new[r * kv..(r + 1) * kv]);
        for i in 0..q_size {
            qkv[r * stride + i] = rng.random_range(-1.0..1.0);
        }
    }
    let tables: Vec<Vec<BlockId>> = gen.seqs.iter().map(|s| s.block_table.clone()).collect();
    let mut dense_k: Vec<Vec<f32>> = gen.seqs.iter().map(|s| s.keys.clone()).collect();
    let mut dense_v: Vec<Vec<f32>> = gen.seqs.iter().map(|s| s.values.clone()).collect();
    // With `rope`: the rows stay un-roped for the kernel; the reference reads them roped on the
    // host, the step's keys and values rounded to f16 as the kernel stores them.
    let rope = rope.map(|(r, forced)| {
        assert!(
            seqs.iter().all(|s| s.0 == 1),
            "fused RoPE runs decode batches only"
        );
        let max_pos = seqs.iter().map(|s| s.1).max().unwrap();
        (RopeData::new(rng, &r, q_size, kv, d, max_pos), forced)
    });
    let roped = match &rope {
        Some((r, _)) => r.apply(&qkv, stride, q_size, kv, d, &pos),
        None => qkv.clone(),
    };
    if rope.is_some() {
        for (i, &(_, sl)) in seqs.iter().enumerate() {
            let (r, p) = (i, sl - 1); // one row per sequence
            for j in 0..kv {
                let at = r * stride + q_size + j;
                dense_k[i][p * kv + j] = f16::from_f32(roped[at]).to_f32();
                dense_v[i][p * kv + j] = f16::from_f32(roped[at + kv]).to_f32();
            }
        }
    }
    let mut sb = vec![];
    let mut start = 0;
    for (i, &(ql, sl)) in seqs.iter().enumerate() {
        sb.push(SeqBatch {
            query_start: start,
            query_len: ql,
            seq_len: sl,
            block_table: &tables[i],
        });
        start += ql;
    }
    let batch = ForwardBatch {
        token_ids: &tok,
        positions: &pos,
        slot_mapping: &slot,
        seqs: &sb,
        logits_indices: &[],
    };
    let a = PagedAttention::new(g, nh, nkv, d)
        .unwrap()
        .with_window(window);
    let p = AttnParams {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        f16_accum: false,
        sliding_window: window,
    };
    let reference: Vec<Vec<f64>> = seqs
        .iter()
        .enumerate()
        .map(|(i, &(ql, sl))| {
            let s0 = sb[i].query_start;
            let q: Vec<f32> = (s0..s0 + ql)
                .flat_map(|r| roped[r * stride..r * stride + q_size].to_vec())
                .collect();
            dense_reference(&p, &q, &dense_k[i], &dense_v[i], sl)
        })
        .collect();
    let out_f32 = rng.random_bool(0.5);
    // Forced split counts: None keeps the plan's.
    let runs = match &rope {
        Some((_, forced)) => vec![Some(1), None, Some(*forced)],
        None => vec![None],
    };
    let mut worst = 0f64;
    let mut unsplit: Option<Vec<f32>> = None;
    for forced in runs {
        let mut run = HostRun::new(g, &a, &qkv, stride, &batch, bs, &k_cache, &v_cache).unwrap();
        assert_eq!(
            run.plan.decode,
            seqs.iter().all(|s| s.0 == 1 || s.0 >= PREFILL_MIN_ROWS),
            "batches whose rows outside prompt tiles are all decodes (only they) take the decode kernel"
        );
        assert_eq!(
            run.plan.fused_rope,
            seqs.iter().all(|s| s.0 == 1),
            "only all-decode batches may rope in the decode kernel"
        );
        let tiled: usize = seqs
            .iter()
            .filter(|s| s.0 >= PREFILL_MIN_ROWS)
            .map(|s| s.0.div_ceil(a.prefill_rows()))
            .sum();
        assert_eq!(
            run.layout.num_tiles, tiled,
            "chunks of {PREFILL_MIN_ROWS}+ rows (only they) take the prefill kernel"
        );
        if let Some((r, _)) = &rope {
            run.set_rope(g, &r.inputs()).unwrap();
        }
        if let Some(splits) = forced {
            run.set_splits(g, &a, splits).unwrap();
            assert_eq!(run.plan.splits, splits);
            if splits > 1 {
                assert!(
                    run.plan.decode,
                    "the split decode kernel merges its own splits"
                );
            }
        }
        run.out_f32 = out_f32;
        run.launch(g, &a).unwrap();
        let (out, kc, vc) = run.read(g).unwrap();

        // The fused write filled exactly the new slots; every other unused slot is still NaN.
        for (t, &s) in slot.iter().enumerate() {
            for i in 0..kv {
                let (k_got, v_got) = (kc[s as usize * kv + i], vc[s as usize * kv + i]);
                let at = t * stride + q_size + i;
                if rope.is_some() {
                    let (k_want, v_want) =
                        (f16::from_f32(roped[at]), f16::from_f32(roped[at + kv]));
                    assert!(
                        kv_close(k_got, k_want),
                        "K slot {s} dim {i}: {k_got} vs host-roped {k_want}"
                    );
                    assert!(
                        kv_close(v_got, v_want),
                        "V slot {s} dim {i}: {v_got} vs host {v_want}"
                    );
                } else {
                    assert_eq!(k_got.to_f32(), qkv[at], "K slot {s}");
                    assert_eq!(v_got.to_f32(), qkv[at + kv], "V slot {s}");
                }
            }
        }
        let used: usize = seqs.iter().map(|s| s.1).sum();
        assert_eq!(
            kc.iter().filter(|x| x.is_nan()).count(),
            (num_blocks * bs - used) * kv
        );
        if rope.is_some() {
            // The kernel read the rows, never wrote them back.
            let mut back = vec![0f32; run.qkv.len];
            g.dtoh(&run.qkv, &mut back).unwrap();
            assert!(back == qkv, "the QKV rows were modified");
        }

        let mut err = RelL2::default();
        for (i, s) in sb.iter().enumerate() {
            let s0 = s.query_start;
            let got = &out[s0 * q_size..s0 * q_size + reference[i].len()];
            err.add(got, &reference[i]);
        }
        worst = worst.max(err.value());
        // Split runs against the unsplit one: the same attention, summed in another order
        // (outputs within a step or two of f16 rounding).
        match &unsplit {
            None if rope.is_some() => unsplit = Some(out),
            Some(u) => {
                for (j, (&x, &y)) in u.iter().zip(&out).enumerate() {
                    assert!(
                        (x - y).abs() <= 2e-3 * x.abs().max(y.abs()) + 1e-4,
                        "elem {j}: {y} with {:?}, {x} with one split",
                        run.plan
                    );
                }
            }
            None => {}
        }
    }
    worst
}

quire_testkit::gpu_test! {
    fn long_contexts_split_the_keys_and_still_match() {
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(11);
        for &(seqs, bs) in &[
            (&[(1usize, 4097usize)][..], 16),
            (&[(1, 3000), (1, 17), (1, 9000)][..], 128),
            (&[(5, 2500)][..], 32),
        ] {
            let a = PagedAttention::new(&g, 32, 8, 128).unwrap();
            let max = seqs.iter().map(|s| s.1).max().unwrap();
            assert!(
                a.plan(
                    g.sms,
                    seqs.iter().map(|s| s.0).sum(),
                    max,
                    seqs.iter().all(|s| s.0 == 1)
                )
                .splits
                    > 1,
                "this case should split"
            );
            let err = case(&g, &mut rng, 32, 8, 128, bs, seqs, None);
            assert!(err < metric::ATTENTION_GPU, "{seqs:?}: rel err {err:.2e}");
        }
    }
}

quire_testkit::gpu_test! {
    /// The decode kernel: all-decode batches over every block size, GQA 1, 2, 3, 4 and 8, head dims
    /// 64, 128 and 256, contexts of one key, one tile's worth ± 1 (tiles are 4096 / head_dim keys),
    /// odd and long lengths, with and without windows.
    fn decode_batches_match_the_dense_reference() {
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(23);
        let mut worst = 0f64;
        for &(nh, nkv) in &[(8, 8), (16, 8), (9, 3), (32, 8), (16, 2)] {
            for d in [64, 128, 256] {
                let tile = 4096 / d;
                for bs in [16, 32, 64, 128] {
                    let seqs = [
                        (1, 1),
                        (1, rng.random_range(2..tile)),
                        (1, tile),
                        (1, tile + 1),
                        (1, 4 * tile - 1),
                        (1, rng.random_range(300..900) | 1),
                        (1, rng.random_range(1500..2600)),
                    ];
                    let window = (bs == 32 || bs == 128).then(|| rng.random_range(1..3 * tile));
                    let err = case(&g, &mut rng, nh, nkv, d, bs, &seqs, window);
                    assert!(
                        err < metric::ATTENTION_GPU,
                        "decode Hq {nh} Hkv {nkv} D {d} block {bs} window {window:?}: rel err {err:.2e}"
                    );
                    worst = worst.max(err);
                }
            }
        }
        eprintln!("paged decode: worst relative error {worst:.2e}");
    }
}

quire_testkit::gpu_test! {
    /// The decode kernel's split choices: one row with a long context (many splits, B1), a batch
    /// large enough for one split per row (the output written directly), windows over split contexts.
    fn decode_splits_and_windows_match() {
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(29);
        let a = PagedAttention::new(&g, 32, 8, 128).unwrap();
        let many: Vec<(usize, usize)> = (0..80).map(|_| (1, rng.random_range(1..700))).collect();
        let one_split = a.plan(g.sms, many.len(), 700, true);
        assert_eq!(one_split.splits, 1, "{} rows: {one_split:?}", many.len());
        let err = case(&g, &mut rng, 32, 8, 128, 16, &many, None);
        assert!(err < metric::ATTENTION_GPU, "80 decode rows: rel err {err:.2e}");
        for &(seqs, bs, window) in &[
            (&[(1usize, 20001usize)][..], 64, None),
            (&[(1, 4096)][..], 16, None),
            (&[(1, 5000), (1, 3), (1, 777)][..], 32, Some(1000)),
            (&[(1, 2500), (1, 2049)][..], 128, Some(300)),
        ] {
            let max = seqs.iter().map(|s| s.1).max().unwrap();
            let a = PagedAttention::new(&g, 32, 8, 128)
                .unwrap()
                .with_window(window);
            assert!(
                a.plan(g.sms, seqs.len(), max, true).splits > 1,
                "{seqs:?} should split"
            );
            let err = case(&g, &mut rng, 32, 8, 128, bs, seqs, window);
            assert!(err < metric::ATTENTION_GPU, "{seqs:?} window {window:?}: rel err {err:.2e}");
        }
    }
}

quire_testkit::gpu_test! {
    /// The decode kernel on un-roped QKV rows (the forward pass's decode steps): it applies the QKV
    /// bias, QK-norm and RoPE itself and merges its own splits. Batches of 1 to 9 decode rows, GQA 1,
    /// 2, 3, 4 and 8, head dims 64 and 128, block sizes 16 and 128, every combination of bias, QK-norm
    /// and rotation style, rotations over part of the head (rope_dim = head_dim / 2, and 40), contexts
    /// from one key to a few thousand, some windows; then one long row, and head dim 256. Each case
    /// runs with one split, the planned splits and a forced count (short rows then leave most splits
    /// empty), against the dense reference on rows roped by the CPU backend's routines, the cache
    /// slots against the host-roped K/V, and the split outputs against the unsplit one.
    fn fused_rope_and_split_merge_match_host_rope_and_the_dense_reference() {
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(31);
        let mut worst = 0f64;
        let mut i = 0usize;
        for &(nh, nkv) in &[(8, 8), (16, 8), (9, 3), (32, 8), (16, 2)] {
            for d in [64, 128] {
                let tile = 4096 / d;
                for bs in [16, 128] {
                    let rows = rng.random_range(1..=9);
                    let seqs: Vec<(usize, usize)> = (0..rows)
                        .map(|r| match r {
                            0 => (1, 1),
                            1 => (1, tile + 1),
                            _ => (1, rng.random_range(2..3500)),
                        })
                        .collect();
                    let rope = Rope {
                        rope_dim: match i % 5 {
                            3 => d / 2,
                            4 => 40,
                            _ => d,
                        },
                        neox: i & 1 == 0,
                        bias: i & 2 != 0,
                        qk_norm: i & 4 != 0,
                        theta: if i.is_multiple_of(3) { 1e6 } else { 1e4 },
                    };
                    let window = (i % 7 == 5).then(|| rng.random_range(1..500));
                    let forced = rng.random_range(5..40);
                    let err = case_with(
                        &g,
                        &mut rng,
                        nh,
                        nkv,
                        d,
                        bs,
                        &seqs,
                        window,
                        Some((rope, forced)),
                    );
                    assert!(
                        err < metric::ATTENTION_GPU,
                        "fused RoPE Hq {nh} Hkv {nkv} D {d} block {bs} {rope:?} window {window:?} \
                         rows {seqs:?}: rel err {err:.2e}"
                    );
                    worst = worst.max(err);
                    i += 1;
                }
            }
        }
        // One row over a long context: the planned splits are many (the B1 graph's case).
        let a = PagedAttention::new(&g, 32, 8, 128).unwrap();
        assert!(
            a.plan(g.sms, 1, 6000, true).splits > 1,
            "one long row should split"
        );
        let rope = Rope {
            rope_dim: 128,
            neox: true,
            bias: true,
            qk_norm: true,
            theta: 5e5,
        };
        let err = case_with(
            &g,
            &mut rng,
            32,
            8,
            128,
            16,
            &[(1, 6000)],
            None,
            Some((rope, 64)),
        );
        assert!(
            err < metric::ATTENTION_GPU,
            "fused RoPE, one row of 6000 keys: rel err {err:.2e}"
        );
        // Head dim 256 (a quarter of it rotated), GQA 1 and 8.
        for (nh, nkv) in [(4, 4), (16, 2)] {
            let rope = Rope {
                rope_dim: 64,
                neox: false,
                bias: true,
                qk_norm: true,
                theta: 1e4,
            };
            let seqs = [(1, 1), (1, 17), (1, 700)];
            let err = case_with(&g, &mut rng, nh, nkv, 256, 32, &seqs, None, Some((rope, 9)));
            assert!(
                err < metric::ATTENTION_GPU,
                "fused RoPE, D 256, Hq {nh} Hkv {nkv}: rel err {err:.2e}"
            );
        }
        eprintln!("fused RoPE decode: worst relative error {worst:.2e}");
    }
}

quire_testkit::gpu_test! {
    /// The prefill kernel: prompt chunks alone and on top of a cached context, beside decode rows and
    /// short chunks in one batch, every block size, GQA 1 to 8, head dims 64, 128 and 256, chunk
    /// lengths around the tile size (64 score rows / GQA query rows) and the key tile (64 keys; 32 at
    /// head_dim 256), with and without windows.
    fn prefill_chunks_match_the_dense_reference() {
        let g = gpu();
        let mut rng = StdRng::seed_from_u64(23);
        let mut worst = 0f64;
        for &(nh, nkv) in &[(8, 8), (16, 8), (9, 3), (32, 8), (16, 2)] {
            for d in [64, 128, 256] {
                for bs in [16, 32, 64, 128] {
                    let cached = rng.random_range(0..300);
                    let q = rng.random_range(16..200);
                    // A short chunk beside the prompts sends the other rows to paged_attention;
                    // decodes alone beside them (a server's usual step) to paged_decode.
                    let short = vec![(q, q + cached), (1, 77), (64, 64), (7, 40), (17, 17 + 65)];
                    let decodes = vec![(q, q + cached), (1, 77), (64, 64), (1, 300), (1, 1), (17, 82)];
                    for seqs in [short, decodes] {
                        for window in [None, Some(rng.random_range(1..90))] {
                            let err = case(&g, &mut rng, nh, nkv, d, bs, &seqs, window);
                            assert!(
                                err < metric::ATTENTION_GPU,
                                "prefill Hq {nh} Hkv {nkv} D {d} block {bs} window {window:?} {seqs:?}: rel err {err:.2e}"
                            );
                            worst = worst.max(err);
                        }
                    }
                }
            }
        }
        // A lone 512-token prompt from an empty cache, as `bench` pp512 runs it.
        let err = case(&g, &mut rng, 32, 8, 128, 16, &[(512, 512)], None);
        assert!(err < metric::ATTENTION_GPU, "512-token prompt: rel err {err:.2e}");
        eprintln!("paged prefill: worst relative error {worst:.2e}");
    }
}
