//! Prefill attention alone, as in a 512-token prompt of the default model (9 query / 3 KV heads ×
//! 64, f16 KV, blocks of 16, f16 accumulator): `cargo run --release -p quire-backend --example
//! attn_prefill_bench -- [tokens] [threads] [reps]`. Prints the median and spread of the calls;
//! run it under `perf stat -e cycles:u` to count cycles on a busy machine.

use half::f16;
use quire_backend::cpu::attention::{paged_attention, AttnParams};
use quire_backend::cpu::team::Team;
use quire_backend::SeqBatch;
use quire_core::BlockId;
use std::time::Instant;

fn main() {
    let args: Vec<usize> = std::env::args()
        .skip(1)
        .map(|a| a.parse().expect("numeric arguments"))
        .collect();
    let tokens = args.first().copied().unwrap_or(512);
    let threads = args.get(1).copied().unwrap_or(2);
    let reps = args.get(2).copied().unwrap_or(20);
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
    // A cheap deterministic generator (xorshift) in -1..1.
    let mut state = 0x9E37_79B9_7F4A_7C15u64;
    let mut rnd = move || {
        state ^= state << 13;
        state ^= state >> 7;
        state ^= state << 17;
        (state >> 40) as f32 / (1u64 << 23) as f32 - 1.0
    };
    let nblocks = tokens.div_ceil(bs);
    // Blocks in reverse order: non-contiguous, as a paged cache is.
    let table: Vec<BlockId> = (0..nblocks as u32).rev().map(BlockId).collect();
    let q: Vec<f32> = (0..tokens * q_row).map(|_| 2.0 * rnd()).collect();
    let k_new: Vec<f32> = (0..tokens * kv_row).map(|_| rnd()).collect();
    let v_new: Vec<f32> = (0..tokens * kv_row).map(|_| rnd()).collect();
    let slots: Vec<u32> = (0..tokens)
        .map(|t| quire_core::slot(&table, t, bs) as u32)
        .collect();
    let seqs = [SeqBatch {
        query_start: 0,
        query_len: tokens,
        seq_len: tokens,
        block_table: &table,
    }];
    let mut k_cache = vec![f16::from_f32(f32::NAN); nblocks * bs * kv_row];
    let mut v_cache = k_cache.clone();
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
            &slots,
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
