//! CUDA paged attention against the f64 dense reference on random paged batches: every block size,
//! GQA ratios 1 to 8, head dims 64, 128 and 256, decode rows, prompt chunks on top of a cache and
//! fresh prompts in one launch, non-contiguous block tables, unused cache slots NaN-poisoned, long
//! contexts that split the keys, f16 and f32 output rows. Sequences with chunks of 16+ rows run
//! `paged_prefill` (tensor cores), other rows of mixed batches `paged_attention`, all-decode
//! batches `paged_decode` (checked per case). Needs a GPU; skipped without one unless
//! QUIRE_REQUIRE_GPU is set.
#![cfg(feature = "cuda")]

use half::f16;
use quire_backend::cpu::attention::{dense_reference, AttnParams};
use quire_backend::cuda::attention::{HostRun, PagedAttention, PREFILL_MIN_ROWS};
use quire_backend::cuda::gpu::Gpu;
use quire_backend::{ForwardBatch, SeqBatch};
use quire_core::BlockId;
use rand::{rngs::StdRng, seq::SliceRandom, Rng, SeedableRng};

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

/// (query_len, seq_len) of each sequence.
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
    let q_size = nh * d;
    let kv = nkv * d;
    let stride = q_size + 2 * kv + 3; // odd padding: rows are not packed
    let stride = stride.div_ceil(4) * 4; // float4 loads need 16-byte rows
    let blocks_needed: usize = seqs.iter().map(|&(_, l)| l.div_ceil(bs)).sum();
    let num_blocks = blocks_needed + 5;
    let mut ids: Vec<usize> = (0..num_blocks).collect();
    ids.shuffle(rng);
    let nan = f16::from_f32(f32::NAN);
    let mut k_cache = vec![nan; num_blocks * bs * kv];
    let mut v_cache = vec![nan; num_blocks * bs * kv];
    let n: usize = seqs.iter().map(|s| s.0).sum();
    let mut qkv = vec![0f32; n * stride];
    let (mut tok, mut pos, mut slot) = (vec![], vec![], vec![]);
    let mut tables: Vec<Vec<BlockId>> = vec![];
    let mut dense_k: Vec<Vec<f32>> = vec![];
    let mut dense_v: Vec<Vec<f32>> = vec![];
    let mut next = 0;
    let mut row = 0;
    for &(ql, sl) in seqs {
        let table: Vec<BlockId> = ids[next..next + sl.div_ceil(bs)]
            .iter()
            .map(|&b| BlockId(b as u32))
            .collect();
        next += sl.div_ceil(bs);
        let (mut dk, mut dv) = (vec![0f32; sl * kv], vec![0f32; sl * kv]);
        for p in 0..sl {
            let s = table[p / bs].as_usize() * bs + p % bs;
            let new = p >= sl - ql;
            for i in 0..kv {
                let (a, b) = (
                    f16::from_f32(rng.random_range(-1.0..1.0)),
                    f16::from_f32(rng.random_range(-1.0..1.0)),
                );
                dk[p * kv + i] = a.to_f32();
                dv[p * kv + i] = b.to_f32();
                if new {
                    let r = row + p - (sl - ql);
                    qkv[r * stride + q_size + i] = a.to_f32();
                    qkv[r * stride + q_size + kv + i] = b.to_f32();
                } else {
                    k_cache[s * kv + i] = a;
                    v_cache[s * kv + i] = b;
                }
            }
            if new {
                tok.push(0u32);
                pos.push(p as u32);
                slot.push(s as u32);
            }
        }
        for r in row..row + ql {
            for i in 0..q_size {
                qkv[r * stride + i] = rng.random_range(-1.0..1.0);
            }
        }
        row += ql;
        tables.push(table);
        dense_k.push(dk);
        dense_v.push(dv);
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
    let mut run = HostRun::new(g, &a, &qkv, stride, &batch, bs, &k_cache, &v_cache).unwrap();
    assert_eq!(
        run.plan.decode,
        seqs.iter().all(|s| s.0 == 1),
        "all-decode batches (only they) take the decode kernel"
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
    run.out_f32 = rng.random_bool(0.5);
    run.launch(g, &a).unwrap();
    let (out, kc, vc) = run.read(g).unwrap();

    // The fused write filled exactly the new slots; every other unused slot is still NaN.
    for (t, &s) in slot.iter().enumerate() {
        for i in 0..kv {
            assert_eq!(
                kc[s as usize * kv + i].to_f32(),
                qkv[t * stride + q_size + i],
                "K slot {s}"
            );
            assert_eq!(
                vc[s as usize * kv + i].to_f32(),
                qkv[t * stride + q_size + kv + i],
                "V slot {s}"
            );
        }
    }
    let used: usize = seqs.iter().map(|s| s.1).sum();
    assert_eq!(
        kc.iter().filter(|x| x.is_nan()).count(),
        (num_blocks * bs - used) * kv
    );

    let p = AttnParams {
        num_heads: nh,
        num_kv_heads: nkv,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        f16_accum: false,
        sliding_window: window,
    };
    let (mut num, mut den) = (0f64, 0f64);
    for (i, &(ql, sl)) in seqs.iter().enumerate() {
        let s0 = sb[i].query_start;
        let q: Vec<f32> = (s0..s0 + ql)
            .flat_map(|r| qkv[r * stride..r * stride + q_size].to_vec())
            .collect();
        let r = dense_reference(&p, &q, &dense_k[i], &dense_v[i], sl);
        for (j, &x) in r.iter().enumerate() {
            let got = out[s0 * q_size + j] as f64;
            assert!(
                got.is_finite(),
                "non-finite output at seq {i} elem {j} ({:?}; NaN: a poisoned slot was read)",
                run.plan
            );
            num += (got - x) * (got - x);
            den += x * x;
        }
    }
    (num / den).sqrt()
}

#[test]
fn paged_attention_matches_the_dense_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(7);
    let mut worst = 0f64;
    for &(nh, nkv) in &[(8, 8), (9, 3), (32, 8), (16, 2), (12, 6)] {
        for d in [64, 128] {
            for bs in [16, 32, 64, 128] {
                let decode_len = rng.random_range(1..400);
                let chunk_ctx = rng.random_range(1..200);
                let seqs = [(1, decode_len), (37, 37 + chunk_ctx), (13, 13), (1, 1)];
                let err = case(&g, &mut rng, nh, nkv, d, bs, &seqs, None);
                assert!(
                    err < 2e-3,
                    "Hq {nh} Hkv {nkv} D {d} block {bs}: rel err {err:.2e}"
                );
                worst = worst.max(err);
            }
        }
    }
    eprintln!("paged attention: worst relative error {worst:.2e}");
}

#[test]
fn long_contexts_split_the_keys_and_still_match() {
    let Some(g) = gpu() else { return };
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
        assert!(err < 2e-3, "{seqs:?}: rel err {err:.2e}");
    }
}

#[test]
fn sliding_windows_match_the_windowed_dense_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(17);
    // Windows shorter and longer than the contexts, a split long context, prompt chunks.
    for &(window, bs) in &[
        (1usize, 16usize),
        (5, 16),
        (8, 32),
        (17, 64),
        (40, 128),
        (1000, 16),
    ] {
        let seqs = [(1, 300), (37, 80), (13, 13), (1, 2500)];
        let err = case(&g, &mut rng, 32, 8, 128, bs, &seqs, Some(window));
        assert!(err < 2e-3, "window {window} block {bs}: rel err {err:.2e}");
        let err = case(&g, &mut rng, 9, 3, 64, bs, &seqs[..3], Some(window));
        assert!(
            err < 2e-3,
            "window {window} block {bs} (GQA 3, D 64): rel err {err:.2e}"
        );
    }
}

/// The decode kernel: all-decode batches over every block size, GQA 1, 2, 3, 4 and 8, head dims
/// 64, 128 and 256, contexts of one key, one tile's worth ± 1 (tiles are 4096 / head_dim keys),
/// odd and long lengths, with and without windows.
#[test]
fn decode_batches_match_the_dense_reference() {
    let Some(g) = gpu() else { return };
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
                    err < 2e-3,
                    "decode Hq {nh} Hkv {nkv} D {d} block {bs} window {window:?}: rel err {err:.2e}"
                );
                worst = worst.max(err);
            }
        }
    }
    eprintln!("paged decode: worst relative error {worst:.2e}");
}

/// The decode kernel's split choices: one row with a long context (many splits, B1), a batch
/// large enough for one split per row (the output written directly), windows over split contexts.
#[test]
fn decode_splits_and_windows_match() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(29);
    let a = PagedAttention::new(&g, 32, 8, 128).unwrap();
    let many: Vec<(usize, usize)> = (0..80).map(|_| (1, rng.random_range(1..700))).collect();
    let one_split = a.plan(g.sms, many.len(), 700, true);
    assert_eq!(one_split.splits, 1, "{} rows: {one_split:?}", many.len());
    let err = case(&g, &mut rng, 32, 8, 128, 16, &many, None);
    assert!(err < 2e-3, "80 decode rows: rel err {err:.2e}");
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
        assert!(err < 2e-3, "{seqs:?} window {window:?}: rel err {err:.2e}");
    }
}

/// The prefill kernel: prompt chunks alone and on top of a cached context, beside decode rows and
/// short chunks in one batch, every block size, GQA 1 to 8, head dims 64, 128 and 256, chunk
/// lengths around the tile size (64 score rows / GQA query rows) and the key tile (64 keys; 32 at
/// head_dim 256), with and without windows.
#[test]
fn prefill_chunks_match_the_dense_reference() {
    let Some(g) = gpu() else { return };
    let mut rng = StdRng::seed_from_u64(23);
    let mut worst = 0f64;
    for &(nh, nkv) in &[(8, 8), (16, 8), (9, 3), (32, 8), (16, 2)] {
        for d in [64, 128, 256] {
            for bs in [16, 32, 64, 128] {
                let cached = rng.random_range(0..300);
                let q = rng.random_range(16..200);
                let seqs = [(q, q + cached), (1, 77), (64, 64), (7, 40), (17, 17 + 65)];
                for window in [None, Some(rng.random_range(1..90))] {
                    let err = case(&g, &mut rng, nh, nkv, d, bs, &seqs, window);
                    assert!(
                        err < 2e-3,
                        "prefill Hq {nh} Hkv {nkv} D {d} block {bs} window {window:?}: rel err {err:.2e}"
                    );
                    worst = worst.max(err);
                }
            }
        }
    }
    // A lone 512-token prompt from an empty cache, as `bench` pp512 runs it.
    let err = case(&g, &mut rng, 32, 8, 128, 16, &[(512, 512)], None);
    assert!(err < 2e-3, "512-token prompt: rel err {err:.2e}");
    eprintln!("paged prefill: worst relative error {worst:.2e}");
}
