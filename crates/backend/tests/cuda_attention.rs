//! CUDA paged attention against the f64 dense reference on random paged batches: every block size,
//! GQA ratios 1 to 8, head dims 64 and 128, decode rows, prompt chunks on top of a cache and fresh
//! prompts in one launch, non-contiguous block tables, unused cache slots NaN-poisoned, long
//! contexts that split the keys. Needs a GPU; skipped without one unless QUIRE_REQUIRE_GPU is set.
#![cfg(feature = "cuda")]

use half::f16;
use quire_backend::cpu::attention::{dense_reference, AttnParams};
use quire_backend::cuda::attention::{HostRun, PagedAttention};
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
fn case(
    g: &Gpu,
    rng: &mut StdRng,
    nh: usize,
    nkv: usize,
    d: usize,
    bs: usize,
    seqs: &[(usize, usize)],
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
    let a = PagedAttention::new(g, nh, nkv, d).unwrap();
    let run = HostRun::new(g, &a, &qkv, stride, &batch, bs, &k_cache, &v_cache).unwrap();
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
        sliding_window: None,
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
            assert!(got.is_finite(), "non-finite output at seq {i} elem {j}");
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
                let err = case(&g, &mut rng, nh, nkv, d, bs, &seqs);
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
            a.plan(g.sms, seqs.iter().map(|s| s.0).sum(), max).splits > 1,
            "this case should split"
        );
        let err = case(&g, &mut rng, 32, 8, 128, bs, seqs);
        assert!(err < 2e-3, "{seqs:?}: rel err {err:.2e}");
    }
}
