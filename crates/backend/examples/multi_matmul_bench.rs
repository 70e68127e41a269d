//! Microbenchmark of the few-token exact product (a speculative verify step, batched decode):
//! `matmul_multi` (the multi-token kernels, on each path the CPU has: AVX2, AVX-512 VNNI)
//! against `matmul_rows` (the one- and four-token kernels, what 2+ tokens took before), over one layer's worth of SmolLM2-135M's
//! matrices plus its output projection (Q8_0, 49,152 × 576), for several token counts. The two
//! alternate; the minimum and median of the passes are printed (the machine is shared: the
//! minimum is what interference cannot inflate), with the cost relative to one token.
//!
//! `cargo run --release -p quire-backend --example multi_matmul_bench [-- THREADS [REPS]]`

use std::time::Instant;

use quire_backend::cpu::matmul::multi::Isa;
use quire_backend::cpu::matmul::{matmul_multi, matmul_rows, Activations, QMatrix};
use quire_backend::cpu::team::Team;
use quire_gguf::GgmlType;

fn rand_vals(seed: &mut u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn matrix(seed: &mut u64, name: &str, dtype: GgmlType, rows: usize, cols: usize) -> QMatrix {
    QMatrix::quantized(name, dtype, rows, cols, &rand_vals(seed, rows * cols)).unwrap()
}

fn main() {
    let args: Vec<String> = std::env::args().collect();
    let threads: usize = args.get(1).map_or(2, |a| a.parse().expect("THREADS"));
    let reps: usize = args.get(2).map_or(15, |a| a.parse().expect("REPS"));
    let mut seed = 1u64;
    // One layer of SmolLM2-135M (Q4_1) and the tied output matrix (Q8_0): [rows, cols].
    let mats = [
        matrix(&mut seed, "qkv", GgmlType::Q4_1, 960, 576),
        matrix(&mut seed, "o", GgmlType::Q4_1, 576, 576),
        matrix(&mut seed, "gate_up", GgmlType::Q4_1, 3072, 576),
        matrix(&mut seed, "down", GgmlType::Q4_1, 576, 1536),
        matrix(&mut seed, "output", GgmlType::Q8_0, 49152, 576),
    ];
    let team = Team::new(threads);
    println!("threads {threads}, {reps} alternating passes");
    let isas: Vec<Isa> = [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|i| i.available())
        .collect();
    let names: Vec<&str> = isas.iter().map(|i| i.name()).collect();
    println!(
        "| matrix | tokens | one-token kernels min / median µs | {} |",
        names
            .iter()
            .map(|n| format!("{n} min / median µs | rows / {n} | {n} vs 1 token"))
            .collect::<Vec<_>>()
            .join(" | ")
    );
    println!("|---|---:|---:|{}", "---:|---:|---:|".repeat(isas.len()));
    for w in &mats {
        let mut one_token = vec![None; isas.len()];
        for n in [1usize, 2, 4, 5, 8, 9, 16, 17] {
            let x = rand_vals(&mut seed, n * w.cols);
            let mut act = Activations::default();
            act.prepare(&team, &x, w.cols, w.dtype);
            let mut out = vec![0f32; n * w.rows];
            let mut times = vec![vec![]; 1 + isas.len()];
            for _ in 0..reps {
                let t = Instant::now();
                matmul_rows(&team, w, &x, &act, &mut out);
                times[0].push(t.elapsed().as_secs_f64() * 1e6);
                for (k, &isa) in isas.iter().enumerate() {
                    let t = Instant::now();
                    if n == 1 {
                        // One token is always the one-token kernels' (as `matmul` does).
                        matmul_rows(&team, w, &x, &act, &mut out);
                    } else {
                        matmul_multi(&team, isa, w, &act, &mut out);
                    }
                    times[k + 1].push(t.elapsed().as_secs_f64() * 1e6);
                }
            }
            let stats: Vec<(f64, f64)> = times
                .iter_mut()
                .map(|v| {
                    v.sort_by(f64::total_cmp);
                    (v[0], v[v.len() / 2])
                })
                .collect();
            let (rmin, rmed) = stats[0];
            let cols: Vec<String> = stats[1..]
                .iter()
                .enumerate()
                .map(|(k, &(min, med))| {
                    let base = *one_token[k].get_or_insert(min);
                    format!(
                        "{min:.1} / {med:.1} | {:.2} | {:.2}",
                        rmin / min,
                        min / base
                    )
                })
                .collect();
            println!(
                "| {} | {n} | {rmin:.1} / {rmed:.1} | {} |",
                w.name,
                cols.join(" | ")
            );
        }
    }
}
