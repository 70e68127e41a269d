//! Prefill attention alone at the default model's shape (9 query / 3 KV heads × 64, f16 KV,
//! blocks of 16): `cargo run --release -p quire-backend --example attn_prefill_bench --
//! [tokens] [threads] [reps] [depth] [exact|fast]`. `tokens` new rows after `depth` cached keys
//! (a prompt chunk; 1 is a decode step), in llama.cpp's arithmetic (`exact`, its f16
//! accumulator; the default) or quire's fast CPU arithmetic. Prints the median and spread of the
//! calls and the K/V bytes the rows read per second (each row reads its keys once); run it
//! under `perf stat -e cycles:u` to count cycles on a busy machine.

use half::f16;
use quire_backend::cpu::attention::{paged_attention_math, AttnParams};
use quire_backend::cpu::team::Team;
use quire_backend::cpu::CpuMath;
use quire_backend::SeqBatch;
use quire_testkit::paged::{PagedBatch, PagedCase};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};
use std::time::Instant;

const USAGE: &str = "usage: attn_prefill_bench [tokens] [threads] [reps] [depth] [exact|fast] \
                     (whole numbers; tokens, threads and reps at least 1)";

fn main() {
    let mut args: Vec<String> = std::env::args().skip(1).collect();
    let math = match args.last().map(String::as_str) {
        Some("fast") => Some(CpuMath::Fast),
        Some("exact") => Some(CpuMath::Exact),
        _ => None,
    };
    if math.is_some() {
        args.pop();
    }
    let math = math.unwrap_or(CpuMath::Exact);
    let nums: Result<Vec<usize>, _> = args.iter().map(|a| a.parse()).collect();
    let Ok(nums) = nums else {
        eprintln!("{USAGE}");
        std::process::exit(2);
    };
    let tokens = nums.first().copied().unwrap_or(512);
    let threads = nums.get(1).copied().unwrap_or(2);
    let reps = nums.get(2).copied().unwrap_or(20);
    let depth = nums.get(3).copied().unwrap_or(0);
    if nums.len() > 4 || [tokens, threads, reps].contains(&0) {
        eprintln!("{USAGE}");
        std::process::exit(2);
    }
    let (heads, kv_heads, d, bs) = (9, 3, 64, 16);
    let p = AttnParams {
        num_heads: heads,
        num_kv_heads: kv_heads,
        head_dim: d,
        block_size: bs,
        scale: 1.0 / (d as f32).sqrt(),
        f16_accum: math == CpuMath::Exact,
        sliding_window: None,
    };
    let kv_row = kv_heads * d;
    let q_row = heads * d;
    // One sequence, its blocks scattered as in a paged cache (quire-testkit's generator, the one
    // the attention tests use); the kernel writes the new rows' K/V into their NaN-poisoned slots.
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
        ..PagedCase::new(bs, kv_row, &[(depth, tokens)])
    }
    .generate::<f16>(&mut rng);
    let q: Vec<f32> = (0..tokens * q_row)
        .map(|_| rng.random_range(-2.0..2.0))
        .collect();
    let seqs = [SeqBatch {
        query_start: 0,
        query_len: tokens,
        seq_len: depth + tokens,
        block_table: &gen_seqs[0].block_table,
    }];
    let mut out = vec![0f32; tokens * q_row];
    let team = Team::new(threads);
    let mut ms = Vec::new();
    // Two unmeasured calls warm the caches and the threads.
    for _ in 0..reps + 2 {
        let t0 = Instant::now();
        paged_attention_math(
            &team,
            math,
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
    let ms = &mut ms[2..];
    let sum: f64 = out.iter().map(|&x| x as f64).sum();
    ms.sort_by(|a, b| a.total_cmp(b));
    let med = ms[ms.len() / 2];
    let keys: usize = (0..tokens).map(|t| depth + t + 1).sum();
    let gbs = (keys * kv_row * 2 * 2) as f64 / med / 1e6;
    println!(
        "{tokens} tokens after {depth}, {} math, {threads} threads, {reps} calls: median {med:.3} ms \
         (min {:.3}, max {:.3}), K/V rows read at {gbs:.2} GB/s; checksum {sum:.6}",
        math.as_str(),
        ms[0],
        ms[ms.len() - 1]
    );
}
