//! Microbenchmark of activation quantization (`quantize_row_q8a`): the AVX2 path against its
//! scalar reference on the row lengths a decode step quantizes (SmolLM2: 576 and 1536; Llama-3-8B:
//! 4096 and 14336). Median and p10/p90 of 101 runs, each many rows.
//!
//! `cargo run --release -p quire-backend --example quantize_bench`

use std::hint::black_box;
use std::time::Instant;

use quire_backend::cpu::quant::{quantize_row_q8a, quantize_row_q8a_scalar, BlockQ8A, QK};

fn time(f: &mut dyn FnMut()) -> (f64, f64, f64) {
    for _ in 0..10 {
        f();
    }
    let mut t: Vec<f64> = (0..101)
        .map(|_| {
            let t0 = Instant::now();
            f();
            t0.elapsed().as_secs_f64()
        })
        .collect();
    t.sort_by(f64::total_cmp);
    (t[50], t[10], t[90])
}

fn main() {
    println!("| cols | kernel | ns/row median | p10 | p90 | GB/s (f32 in) |");
    println!("|--:|---|--:|--:|--:|--:|");
    for cols in [576usize, 1536, 4096, 14336] {
        let x: Vec<f32> = (0..cols)
            .map(|i| ((i * 7919 % 1000) as f32 - 500.0) / 97.0)
            .collect();
        let mut q = vec![BlockQ8A::default(); cols / QK];
        let reps = (1 << 20) / cols;
        for (name, f) in [
            (
                "scalar",
                quantize_row_q8a_scalar as fn(&[f32], &mut [BlockQ8A]),
            ),
            ("dispatch (AVX2 if present)", quantize_row_q8a),
        ] {
            let (med, p10, p90) = time(&mut || {
                for _ in 0..reps {
                    f(black_box(&x), black_box(&mut q));
                }
            });
            let per_row = |s: f64| s / reps as f64 * 1e9;
            println!(
                "| {cols} | {name} | {:.0} | {:.0} | {:.0} | {:.1} |",
                per_row(med),
                per_row(p10),
                per_row(p90),
                (cols * 4) as f64 / per_row(med)
            );
        }
    }
}
