//! Microbenchmark of the decode matrix-vector product on one thread: the one-row kernels
//! (`quant::dot_row`) against the four-row kernels (`rows::dot_rows4`) on SmolLM2-135M's shapes, with
//! weights in cache (one matrix, repeated) and streamed from memory (30 layers' worth, as a decode
//! step reads them). Alternates the two kernels and reports the minimum and median pass time, since
//! the machine is shared and the minimum is what interference cannot inflate.
//!
//! `cargo run --release -p quire-backend --example matvec_bench [-- DTYPE]` (q4_1 default, q4_0, q8_0)

use std::hint::black_box;
use std::time::Instant;

use quire_backend::cpu::quant::{dot_row, quantize_row_q8a, BlockQ8A, QK};
use quire_backend::cpu::rows::{dot_rows4, ROWS};
use quire_gguf::GgmlType;

fn rand_row(seed: &mut u64, n: usize) -> Vec<f32> {
    (0..n)
        .map(|_| {
            *seed = seed
                .wrapping_mul(6364136223846793005)
                .wrapping_add(1442695040888963407);
            ((*seed >> 40) as f32 / (1u64 << 24) as f32) * 2.0 - 1.0
        })
        .collect()
}

fn one_row(dtype: GgmlType, w: &[u8], rb: usize, x: &[f32], xq: &[BlockQ8A], out: &mut [f32]) {
    for (r, o) in out.iter_mut().enumerate() {
        *o = dot_row(dtype, &w[r * rb..(r + 1) * rb], x, xq);
    }
}

fn four_rows(dtype: GgmlType, w: &[u8], rb: usize, x: &[f32], xq: &[BlockQ8A], out: &mut [f32]) {
    for (g, o) in out.chunks_exact_mut(ROWS).enumerate() {
        let rows = std::array::from_fn(|k| &w[(g * ROWS + k) * rb..(g * ROWS + k + 1) * rb]);
        o.copy_from_slice(&dot_rows4(dtype, rows, x, xq));
    }
}

fn four_rows_pf<const D: usize>(
    dtype: GgmlType,
    w: &[u8],
    rb: usize,
    x: &[f32],
    xq: &[BlockQ8A],
    out: &mut [f32],
) {
    let gb = ROWS * rb;
    for (g, o) in out.chunks_exact_mut(ROWS).enumerate() {
        // Prefetch the group D ahead (its cache lines), then compute this one.
        let ahead = (g + D) * gb;
        if ahead + gb <= w.len() {
            let mut off = 0;
            while off < gb {
                #[cfg(target_arch = "x86_64")]
                unsafe {
                    use std::arch::x86_64::*;
                    _mm_prefetch(w.as_ptr().add(ahead + off) as *const i8, _MM_HINT_T0);
                }
                off += 64;
            }
        }
        let rows = std::array::from_fn(|k| &w[(g * ROWS + k) * rb..(g * ROWS + k + 1) * rb]);
        o.copy_from_slice(&dot_rows4(dtype, rows, x, xq));
    }
}

type Kernel = fn(GgmlType, &[u8], usize, &[f32], &[BlockQ8A], &mut [f32]);

fn main() {
    let dtype = match std::env::args().nth(1).as_deref() {
        None | Some("q4_1") => GgmlType::Q4_1,
        Some("q4_0") => GgmlType::Q4_0,
        Some("q8_0") => GgmlType::Q8_0,
        Some(o) => panic!("unknown type {o}"),
    };
    let mut seed = 1u64;
    // (rows, cols) of one layer's decode products: QKV, O, gate+up, down.
    let shapes = [(960usize, 576usize), (576, 576), (3072, 576), (576, 1536)];
    let copies = 30;
    let mats: Vec<Vec<Vec<u8>>> = (0..copies)
        .map(|_| {
            shapes
                .iter()
                .map(|&(rows, cols)| {
                    let mut w = Vec::new();
                    quire_gguf::quantize_row(dtype, &rand_row(&mut seed, rows * cols), &mut w)
                        .unwrap();
                    w
                })
                .collect()
        })
        .collect();
    let xs: Vec<(Vec<f32>, Vec<BlockQ8A>)> = [576usize, 1536]
        .iter()
        .map(|&cols| {
            let x = rand_row(&mut seed, cols);
            let mut q = vec![BlockQ8A::default(); cols / QK];
            quantize_row_q8a(&x, &mut q);
            (x, q)
        })
        .collect();
    let mut out = vec![0f32; 3072];
    let bytes: usize = mats[0].iter().map(|m| m.len()).sum();
    let pass = |k: Kernel, layers: usize, out: &mut [f32]| {
        let t0 = Instant::now();
        for m in &mats[..layers] {
            for (w, &(rows, cols)) in m.iter().zip(&shapes) {
                let (x, xq) = &xs[(cols == 1536) as usize];
                let rb = w.len() / rows;
                k(dtype, black_box(w), rb, x, xq, &mut out[..rows]);
            }
        }
        black_box(&out);
        t0.elapsed().as_secs_f64()
    };
    println!(
        "{dtype:?}, one thread, one layer = {:.2} MB of weights",
        bytes as f64 / 1e6
    );
    println!("| weights | kernel | ms/layer min | median | GB/s (min) |");
    println!("|---|---|--:|--:|--:|");
    for (label, layers, reps) in [
        ("in cache (1 layer)", 1usize, 400usize),
        ("streamed (30 layers)", copies, 40),
    ] {
        let kernels: [(&str, Kernel); 5] = [
            ("one row", one_row),
            ("four rows", four_rows),
            ("four rows, prefetch 1 group", four_rows_pf::<1>),
            ("four rows, prefetch 2 groups", four_rows_pf::<2>),
            ("four rows, prefetch 4 groups", four_rows_pf::<4>),
        ];
        let mut t = [vec![], vec![], vec![], vec![], vec![]];
        for _ in 0..reps {
            for (i, (_, k)) in kernels.iter().enumerate() {
                t[i].push(pass(*k, layers, &mut out) / layers as f64);
            }
        }
        for (i, (name, _)) in kernels.iter().enumerate() {
            t[i].sort_by(f64::total_cmp);
            let (min, med) = (t[i][0], t[i][t[i].len() / 2]);
            println!(
                "| {label} | {name} | {:.4} | {:.4} | {:.2} |",
                min * 1e3,
                med * 1e3,
                bytes as f64 / min / 1e9
            );
        }
    }
}
