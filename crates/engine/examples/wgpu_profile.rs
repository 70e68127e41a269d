//! Per-kernel wall-clock time of the wgpu backend on the default model (or the GGUF file given as
//! the first argument): one prefill of N tokens (second argument, default 32) and 8 decode steps,
//! each dispatch in its own submission. `WGPU_BACKEND=vulkan cargo run --release -p quire-engine
//! --features wgpu --example wgpu_profile`.

use std::time::Instant;

use quire_backend::KvCacheSpec;

fn main() {
    let mut args = std::env::args().skip(1);
    let path = args
        .next()
        .map(std::path::PathBuf::from)
        .unwrap_or_else(quire_core::default_model::model_for_tests);
    let n: usize = args
        .next()
        .map_or(32, |s| s.parse().expect("a token count"));
    let m = quire_model::load_gguf(&path).expect("model loads");
    let kv = KvCacheSpec {
        num_blocks: (n + 16).div_ceil(16),
        block_size: 16,
    };
    let t = Instant::now();
    let mut e = quire_backend::wgpu::executor(&m.weights, kv, &Default::default())
        .unwrap_or_else(|e| panic!("{e}"));
    eprintln!("load: {:.1} s", t.elapsed().as_secs_f64());
    let table: Vec<quire_core::BlockId> =
        (0..kv.num_blocks as u32).map(quire_core::BlockId).collect();
    let mut tokens: Vec<u32> = (0..n as u32).map(|i| 100 + i).collect();
    let mut done = 0;
    for (phase, steps) in [("prefill", 1), ("decode", 8)] {
        e.set_profiling(true);
        let t = Instant::now();
        for _ in 0..steps {
            let new = &tokens[done..];
            let positions: Vec<u32> = (done..tokens.len()).map(|p| p as u32).collect();
            let slots = positions.clone();
            let seqs = [quire_backend::SeqBatch {
                query_start: 0,
                query_len: new.len(),
                seq_len: tokens.len(),
                block_table: &table,
            }];
            let last = [new.len() as u32 - 1];
            let batch = quire_backend::ForwardBatch {
                token_ids: new,
                positions: &positions,
                slot_mapping: &slots,
                seqs: &seqs,
                logits_indices: &last,
            };
            let next = e.forward_greedy(&batch).unwrap()[0];
            done = tokens.len();
            tokens.push(next);
        }
        let wall = t.elapsed().as_secs_f64();
        let mut stats = e.take_profile();
        stats.sort_by_key(|s| std::cmp::Reverse(s.total_ns));
        println!("{phase} ({steps} steps, {wall:.2} s with profiling):");
        for s in stats {
            println!(
                "  {:<24} {:>5} calls {:>10.2} ms",
                s.name,
                s.calls,
                s.total_ns as f64 / 1e6
            );
        }
    }
}
