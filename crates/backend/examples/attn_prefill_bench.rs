//! Prefill attention alone, as in a 512-token prompt of the default model (9 query / 3 KV heads ×
//! 64, f16 KV, blocks of 16, f16 accumulator): `cargo run --release -p quire-backend --example
//! attn_prefill_bench -- [tokens] [threads] [reps]`. Prints the median and spread of the calls;
//! run it under `perf stat -e cycles:u` to count cycles on a busy machine.

use half::f16;
use quire_backend::cpu::attention::{paged_attention, AttnParams};
use quire_backend::cpu::team::Team;
use quire_backend::SeqBatch;
use quire_testkit::paged::{PagedBatch, PagedCase};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Instant;

fn main() {
    let args: Result<Vec<usize>, _> = std::env::args().skip(1).map(|a| a.parse()).collect();
    let args = args.unwrap_or_default();
    let tokens = args.first().copied().unwrap_or(512);
    let threads = args.get(1).copied().unwrap_or(2);
    let reps = args.get(2).copied().unwrap_or(20);
    if args.len() != std::env::args().len() - 1
        || args.len() > 3
        || [tokens, threads, reps].contains(&0)
    {
        eprintln!(
            "usage: attn_prefill_bench [tokens] [threads] [reps] (whole numbers, at least 1)"
        );
        std::process::exit(2);
    }
    let (heads, kv_heads, d, bs) = (9, 3, 64, 16);
    let p = AttnParams {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        f16_accum: true,
        sliding_window: None,
    };
    let kv_row = kv_heads * d;
    let q_row = heads * d;
    // One fresh prompt, its blocks scattered as in a paged cache (quire-testkit's generator, the
    // one the attention tests use); the kernel writes its K/V into the NaN-poisoned slots.
    let mut rng = StdRng::seed_from_u64(1);
    let PagedBatch {
        seqs: gen_seqs,
        slot_mapping,
        k_new,
        v_new,
        mut k_cache,
        mut v_cache,
        ..
    } = PagedCase {
        spare_blocks: 0,
        ..PagedCase::new(bs, kv_row, &[(0, tokens)])
    }
    .generate::<f16>(&mut rng);
    let q: Vec<f32> = (0..tokens * q_row)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let seqs = [SeqBatch {
        query_start: 0,
        query_len: tokens,
        seq_len: tokens,
        block_table: &gen_seqs[0].block_table,
    }];
    let mut out = vec![0f32; tokens * q_row];
    let team = Team::new(threads);
    let mut ms = Vec::new();
    for _ in 0..reps {
        let t0 = Instant::now();
        paged_attention(
            &team,
            &p,
            &q,
            q_row,
            &k_new,
            &v_new,
            kv_row,
            &slot_mapping,
            &seqs,
            &mut k_cache,
            &mut v_cache,
            &mut out,
        );
        ms.push(t0.elapsed().as_secs_f64() * 1e3);
    }
    let sum: f64 = out.iter().map(|&x| x as f64).sum();
    ms.sort_by(|a, b| a.total_cmp(b));
    println!(
        "{tokens} tokens, {threads} threads, {reps} calls: median {:.3} ms (min {:.3}, max {:.3}); checksum {sum:.6}",
        ms[ms.len() / 2],
        ms[0],
        ms[ms.len() - 1]
    );
}
