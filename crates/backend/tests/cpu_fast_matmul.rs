//! The tiled prompt product (`cpu::matmul::fast_gemm`, reached through `matmul_fast_tiled`; not
//! yet used by the engine, see `matmul_math`) against the scalar reference dot products
//! (`cpu::quant::scalar`), on random weights and activations with row and token counts that leave
//! partial tiles (odd rows, tokens not a multiple of 4).
//!
//! Bound: every block's integer sum is exact in both, so the two differ only in how the f32 block
//! terms are added (order; Q4_0's `-8` offset applied as `-8·d_w·(d_a·Σa)`). For `nb` blocks,
//! `|fast − ref| ≤ 4·(nb + 4)·ε·Σ_b |term_b|` with ε = 2⁻²⁴ and `term_b` each block's
//! contribution (Q4_0 counting the offset part separately) — the usual recursive-summation bound,
//! with slack for the few extra products.

use quire_backend::cpu::matmul::{fast_gemm, matmul_fast_tiled, matmul_math, Activations, QMatrix};
use quire_backend::cpu::quant::{scalar, BlockQ8A, QK};
use quire_backend::cpu::team::Team;
use quire_backend::cpu::CpuMath;
use quire_gguf::{BlockQ4_0, BlockQ4_1, BlockQ8_0, GgmlType};
use rand::{Rng, SeedableRng};

fn blocks<T>(bytes: &[u8]) -> &[T] {
    assert!(bytes.len().is_multiple_of(std::mem::size_of::<T>()));
    assert!((bytes.as_ptr() as usize).is_multiple_of(std::mem::align_of::<T>()));
    // SAFETY: length and alignment checked; the block types are plain old data.
    unsafe {
        std::slice::from_raw_parts(
            bytes.as_ptr() as *const T,
            bytes.len() / std::mem::size_of::<T>(),
        )
    }
}

/// The scalar reference product and the bound's `Σ|term|` for one weight row and one token.
fn reference(dtype: GgmlType, w: &[u8], a: &[BlockQ8A]) -> (f32, f64) {
    let f = |x: half::f16| x.to_f32() as f64;
    let mut mag = 0f64;
    let want = match dtype {
        GgmlType::Q4_0 => {
            for (wb, ab) in blocks::<BlockQ4_0>(w).iter().zip(a) {
                let (mut p, mut s) = (0f64, 0f64);
                for j in 0..16 {
                    p += ((wb.qs[j] & 15) as f64) * ab.qs[j] as f64
                        + ((wb.qs[j] >> 4) as f64) * ab.qs[j + 16] as f64;
                    s += (ab.qs[j] as f64 + ab.qs[j + 16] as f64) * 8.0;
                }
                mag += f(wb.d).abs() * ab.d as f64 * (p.abs() + s.abs());
            }
            scalar::dot_q4_0(blocks(w), a)
        }
        GgmlType::Q4_1 => {
            for (wb, ab) in blocks::<BlockQ4_1>(w).iter().zip(a) {
                let p: f64 = (0..16)
                    .map(|j| {
                        ((wb.qs[j] & 15) as f64) * ab.qs[j] as f64
                            + ((wb.qs[j] >> 4) as f64) * ab.qs[j + 16] as f64
                    })
                    .sum();
                mag += f(wb.d).abs() * ab.d as f64 * p.abs() + (f(wb.m) * ab.s as f64).abs();
            }
            scalar::dot_q4_1(blocks(w), a)
        }
        _ => {
            for (wb, ab) in blocks::<BlockQ8_0>(w).iter().zip(a) {
                let p: f64 = wb
                    .qs
                    .iter()
                    .zip(&ab.qs)
                    .map(|(&x, &y)| x as f64 * y as f64)
                    .sum();
                mag += f(wb.d).abs() * ab.d as f64 * p.abs();
            }
            scalar::dot_q8_0(blocks(w), a)
        }
    };
    (want, mag)
}

fn random_matrix(
    rng: &mut rand::rngs::StdRng,
    dtype: GgmlType,
    rows: usize,
    cols: usize,
) -> QMatrix {
    let vals: Vec<f32> = (0..rows * cols)
        .map(|_| rng.random_range(-1.0f32..1.0))
        .collect();
    QMatrix::quantized("w", dtype, rows, cols, &vals).unwrap()
}

quire_testkit::simd_test! {
    fn fast_prompt_matmul_matches_the_scalar_reference_within_the_summation_bound() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(25);
        let team = Team::new(2);
        assert!(fast_gemm::has_fast_gemm(GgmlType::Q4_1), "the tiled kernel did not run");
        for dtype in [GgmlType::Q4_1, GgmlType::Q4_0, GgmlType::Q8_0] {
            // (rows, cols, tokens): partial row tiles, 0–3 tokens past the last group of 4.
            for (rows, cols, n) in [(37usize, 96usize, 9usize), (5, 32, 4), (64, 576, 13), (19, 1536, 7)] {
                let w = random_matrix(&mut rng, dtype, rows, cols);
                let scale = rng.random_range(0.01f32..50.0);
                let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-scale..scale)).collect();
                let mut act = Activations::default();
                act.prepare(&team, &x, cols, dtype);
                let mut got = vec![f32::NAN; n * rows];
                matmul_fast_tiled(&team, &w, &x, &act, &mut got);
                let nb = cols / QK;
                for t in 0..n {
                    for r in 0..rows {
                        let (want, mag) = reference(dtype, w.row(r), &act.q[t * nb..(t + 1) * nb]);
                        let bound = 4.0 * (nb + 4) as f64 * f32::EPSILON as f64 / 2.0 * mag;
                        let g = got[t * rows + r];
                        assert!(
                            g.is_finite() && (g as f64 - want as f64).abs() <= bound,
                            "{dtype:?} rows={rows} cols={cols} n={n} (t={t}, r={r}): fast {g}, reference {want}, bound {bound:e}"
                        );
                    }
                }
            }
        }
    }
}

quire_testkit::simd_test! {
    fn fast_tile_kernels_agree_with_each_other_and_exact_mode_is_untouched() {
        let mut rng = rand::rngs::StdRng::seed_from_u64(26);
        let team = Team::new(2);
        let (rows, cols, n) = (10usize, 160usize, 8usize);
        let w = random_matrix(&mut rng, GgmlType::Q4_1, rows, cols);
        let x: Vec<f32> = (0..n * cols).map(|_| rng.random_range(-1.0f32..1.0)).collect();
        let mut act = Activations::default();
        act.prepare(&team, &x, cols, GgmlType::Q4_1);
        let nb = cols / QK;
        let scales = fast_gemm::TokenScales::new(GgmlType::Q4_1, &act.q, nb, n / 4);
        // The 4-row tile and the one-row kernel compute each (row, token) the same way.
        for g in 0..n / 4 {
            let tile = fast_gemm::gemm_tile(GgmlType::Q4_1, [0, 1, 2, 3].map(|k| w.row(4 + k)), &act.q, &scales, g).unwrap();
            let ones: [[f32; 4]; 4] = std::array::from_fn(|k| {
                fast_gemm::gemm_row(GgmlType::Q4_1, w.row(4 + k), &act.q, &scales, g).unwrap()
            });
            let bits = |v: [[f32; 4]; 4]| v.map(|row| row.map(f32::to_bits));
            let by_token: [[f32; 4]; 4] = std::array::from_fn(|t| std::array::from_fn(|k| ones[k][t]));
            assert_eq!(bits(tile), bits(by_token), "g={g}");
        }
        // Exact mode still gives the one-token kernels' bits.
        let mut exact = vec![f32::NAN; n * rows];
        matmul_math(&team, CpuMath::Exact, &w, &x, &act, &mut exact);
        for t in 0..n {
            for r in 0..rows {
                let one = quire_backend::cpu::quant::dot_row(GgmlType::Q4_1, w.row(r), &x[t * cols..(t + 1) * cols], &act.q[t * nb..(t + 1) * nb]);
                assert_eq!(exact[t * rows + r].to_bits(), one.to_bits());
            }
        }
    }
}
