//! The exact multi-token product (`cpu::matmul::multi`, AVX-512 VNNI or AVX2, reached through
//! `matmul` for 2 or more tokens) against the one-token kernels it must equal bit for bit
//! (`matmul_rows`: `quant::dot_row` per element, llama.cpp's AVX2 order), and both against the
//! scalar reference (`quant::scalar`), on random weights and activations: token counts 1–19 and
//! a few larger ones (partial groups of 8 and pairs), row counts that leave partial tiles
//! (odd, fewer than 4), and 1 to 48 blocks a row.
//!
//! Bound against the scalar reference (which adds the block terms one by one, where the kernels
//! keep 8 lane sums): `|got − ref| ≤ 1e-5 · Σ |w_i · x_i|` (element products of the quantized
//! values, and Q4_1's `|m_w · s_a|`), as `quant`'s own SIMD test states.
//!
//! Both paths of the kernel (AVX2, AVX-512 VNNI) run where the CPU has them; a path it lacks is
//! reported as SKIPPED on stderr.

use quire_backend::cpu::matmul::multi::{self, Isa};
use quire_backend::cpu::matmul::{
    matmul, matmul_multi, matmul_multi_swiglu, matmul_rows, Activations, QMatrix,
};
use quire_backend::cpu::quant::{dot_row, scalar, BlockQ8A, QK};
use quire_backend::cpu::team::Team;
use quire_gguf::{BlockQ4_0, BlockQ4_1, BlockQ8_0, GgmlType};
use rand::{Rng, SeedableRng};

const TYPES: [GgmlType; 3] = [GgmlType::Q4_0, GgmlType::Q4_1, GgmlType::Q8_0];

/// The paths this CPU runs; prints the skipped ones.
fn paths(test: &str) -> Vec<Isa> {
    [Isa::Avx2, Isa::Avx512]
        .into_iter()
        .filter(|&isa| {
            let ok = isa.available();
            if !ok {
                eprintln!("SKIPPED {test} on {}: this CPU cannot run it", isa.name());
            }
            ok
        })
        .collect()
}

fn random_matrix(
    rng: &mut rand::rngs::StdRng,
    dtype: GgmlType,
    rows: usize,
    cols: usize,
) -> QMatrix {
    let vals: Vec<f32> = (0..rows * cols)
        .map(|i| {
            // A zero row and a row of tiny weights among the random ones.
            match i / cols {
                1 => 0.0,
                2 => rng.random_range(-1e-3f32..1e-3),
                _ => rng.random_range(-1.0f32..1.0),
            }
        })
        .collect();
    QMatrix::quantized("w", dtype, rows, cols, &vals).unwrap()
}

/// Activations of `n` tokens, with a zero token and a large one among them.
fn random_x(rng: &mut rand::rngs::StdRng, n: usize, cols: usize) -> Vec<f32> {
    (0..n * cols)
        .map(|i| match (i / cols) % 5 {
            3 => 0.0,
            4 => rng.random_range(-300.0f32..300.0),
            _ => rng.random_range(-2.0f32..2.0),
        })
        .collect()
}

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

/// The scalar reference and `Σ |term|` over every element product (and Q4_1's offset terms) for
/// one weight row and one token: the kernels keep 8 lane sums per block, so the bound is on the
/// magnitudes before any cancellation.
fn reference(dtype: GgmlType, w: &[u8], a: &[BlockQ8A]) -> (f32, f64) {
    let f = |x: half::f16| x.to_f32() as f64;
    // Σ_j |(q_j − off) · a_j| over a block of nibbles.
    let nib = |qs: &[u8], a: &BlockQ8A, off: i32| -> f64 {
        (0..16)
            .map(|j| {
                ((((qs[j] & 15) as i32 - off) * a.qs[j] as i32).abs()
                    + (((qs[j] >> 4) as i32 - off) * a.qs[j + 16] as i32).abs())
                    as f64
            })
            .sum()
    };
    match dtype {
        GgmlType::Q4_0 => {
            let wb = blocks::<BlockQ4_0>(w);
            let mag = wb
                .iter()
                .zip(a)
                .map(|(w, a)| (f(w.d) * a.d as f64).abs() * nib(&w.qs, a, 8))
                .sum();
            (scalar::dot_q4_0(wb, a), mag)
        }
        GgmlType::Q4_1 => {
            let wb = blocks::<BlockQ4_1>(w);
            let mag = wb
                .iter()
                .zip(a)
                .map(|(w, a)| {
                    (f(w.d) * a.d as f64).abs() * nib(&w.qs, a, 0) + (f(w.m) * a.s as f64).abs()
                })
                .sum();
            (scalar::dot_q4_1(wb, a), mag)
        }
        _ => {
            let wb = blocks::<BlockQ8_0>(w);
            let mag = wb
                .iter()
                .zip(a)
                .map(|(w, a)| {
                    let s: i32 =
                        w.qs.iter()
                            .zip(&a.qs)
                            .map(|(&x, &y)| (x as i32 * y as i32).abs())
                            .sum();
                    (f(w.d) * a.d as f64).abs() * s as f64
                })
                .sum();
            (scalar::dot_q8_0(wb, a), mag)
        }
    }
}

/// `matmul` (the multi-token kernel for n ≥ 2) equals `matmul_rows` and per-element `dot_row`
/// bit for bit, and both are within the bound of the scalar reference.
#[test]
fn multi_token_product_equals_one_token_kernels_bit_for_bit() {
    let isas = paths("multi_token_product_equals_one_token_kernels_bit_for_bit");
    let mut rng = rand::rngs::StdRng::seed_from_u64(37);
    let team = Team::new(2);
    let token_counts: Vec<usize> = (1..=19).chain([24, 31, 33, 64]).collect();
    for dtype in TYPES {
        for (rows, nb) in [(1usize, 1usize), (3, 3), (37, 18), (64, 48), (21, 5)] {
            let cols = nb * QK;
            let w = random_matrix(&mut rng, dtype, rows, cols);
            for &n in &token_counts {
                let x = random_x(&mut rng, n, cols);
                let mut act = Activations::default();
                act.prepare(&team, &x, cols, dtype);
                let mut want = vec![f32::NAN; n * rows];
                matmul_rows(&team, &w, &x, &act, &mut want);
                // What the engine runs, then every path this CPU has.
                let mut outs = vec![("matmul", vec![f32::NAN; n * rows])];
                matmul(&team, &w, &x, &act, &mut outs[0].1);
                for &isa in &isas {
                    let mut got = vec![f32::NAN; n * rows];
                    matmul_multi(&team, isa, &w, &act, &mut got);
                    outs.push((isa.name(), got));
                }
                for (path, got) in &outs {
                    for t in 0..n {
                        let xq = &act.q[t * nb..(t + 1) * nb];
                        for r in 0..rows {
                            let (g, o) = (got[t * rows + r], want[t * rows + r]);
                            let one = dot_row(dtype, w.row(r), &x[t * cols..(t + 1) * cols], xq);
                            let ctx =
                                format!("{path} {dtype:?} rows={rows} nb={nb} n={n} t={t} r={r}");
                            assert_eq!(g.to_bits(), o.to_bits(), "{ctx}: {g} vs rows path {o}");
                            assert_eq!(g.to_bits(), one.to_bits(), "{ctx}: {g} vs dot_row {one}");
                            let (sc, mag) = reference(dtype, w.row(r), xq);
                            assert!(
                                (g as f64 - sc as f64).abs() <= 1e-5 * mag.max(1e-30),
                                "{ctx}: {g} vs scalar reference {sc} (Σ|term| {mag})"
                            );
                        }
                    }
                }
            }
        }
    }
}

/// The kernel itself on one group: every row count it is called with (4, 2 and 1) and every
/// number of real tokens in a group (1–16), against `dot_row`.
#[test]
fn tile_kernel_equals_dot_row_for_every_group_fill() {
    let isas = paths("tile_kernel_equals_dot_row_for_every_group_fill");
    let mut rng = rand::rngs::StdRng::seed_from_u64(38);
    let team = Team::new(1);
    for (dtype, isa) in TYPES
        .into_iter()
        .flat_map(|d| isas.iter().map(move |&i| (d, i)))
    {
        let nb = 7;
        let cols = nb * QK;
        let w = random_matrix(&mut rng, dtype, 4, cols);
        for n in 1..=2 * multi::TOKENS + 1 {
            let x = random_x(&mut rng, n, cols);
            let mut act = Activations::default();
            act.prepare(&team, &x, cols, dtype);
            let mut packed = multi::Packed::default();
            packed.pack(&team, dtype, &act.q, nb, n);
            for g in 0..packed.groups() {
                let four =
                    multi::tile::<4>(isa, dtype, std::array::from_fn(|k| w.row(k)), &packed, g);
                let two = [0, 2]
                    .map(|r0| multi::tile::<2>(isa, dtype, [w.row(r0), w.row(r0 + 1)], &packed, g));
                for k in 0..packed.tokens_in(g) {
                    let t = g * multi::TOKENS + k;
                    let xq = &act.q[t * nb..(t + 1) * nb];
                    for r in 0..4 {
                        let want = dot_row(dtype, w.row(r), &[], xq);
                        let one = multi::tile::<1>(isa, dtype, [w.row(r)], &packed, g)[k][0];
                        assert_eq!(
                            four[k][r].to_bits(),
                            want.to_bits(),
                            "{isa:?} {dtype:?} n={n} t={t} r={r}"
                        );
                        assert_eq!(
                            one.to_bits(),
                            want.to_bits(),
                            "{isa:?} {dtype:?} n={n} t={t} r={r} (1 row)"
                        );
                        assert_eq!(
                            two[r / 2][k][r % 2].to_bits(),
                            want.to_bits(),
                            "{isa:?} {dtype:?} n={n} t={t} r={r} (2 rows)"
                        );
                    }
                }
            }
        }
    }
}

/// The gate/up product fused with SwiGLU and quantization (`matmul_multi_swiglu`, what a step of
/// 2+ tokens runs) equals the unfused path bit for bit: the product, `ops::swiglu_chunked`, then
/// `Activations::prepare`, on every path this CPU has.
#[test]
fn fused_multi_token_swiglu_equals_unfused_path_bit_for_bit() {
    let isas = paths("fused_multi_token_swiglu_equals_unfused_path_bit_for_bit");
    let mut rng = rand::rngs::StdRng::seed_from_u64(39);
    let team = Team::new(2);
    for dtype in TYPES {
        for (inter, nb) in [(32usize, 2usize), (96, 3), (160, 18)] {
            let cols = nb * QK;
            let gate = random_matrix(&mut rng, dtype, inter, cols);
            let up = random_matrix(&mut rng, dtype, inter, cols);
            let w = QMatrix::interleave_rows("gu", &gate, &up, QK).unwrap();
            for n in [2usize, 3, 4, 5, 9, 16, 17, 40] {
                let x = random_x(&mut rng, n, cols);
                let mut act = Activations::default();
                act.prepare(&team, &x, cols, dtype);
                let mut gu = vec![f32::NAN; n * 2 * inter];
                matmul_rows(&team, &w, &x, &act, &mut gu);
                let mut want = vec![f32::NAN; n * inter];
                quire_backend::cpu::ops::swiglu_chunked(&gu, inter, QK, &mut want);
                let mut want_q = Activations::default();
                want_q.prepare(&team, &want, inter, GgmlType::Q4_1);
                for &isa in &isas {
                    let mut got = vec![f32::NAN; n * inter];
                    let mut got_q = Activations::default();
                    matmul_multi_swiglu(&team, isa, &w, &act, &mut got, &mut got_q);
                    let ctx = format!("{isa:?} {dtype:?} inter={inter} nb={nb} n={n}");
                    for (i, (a, b)) in got.iter().zip(&want).enumerate() {
                        assert_eq!(a.to_bits(), b.to_bits(), "{ctx} element {i}: {a} vs {b}");
                    }
                    assert_eq!(got_q.q.len(), want_q.q.len(), "{ctx}");
                    for (i, (a, b)) in got_q.q.iter().zip(&want_q.q).enumerate() {
                        assert_eq!(
                            (a.d.to_bits(), a.s.to_bits(), a.qs),
                            (b.d.to_bits(), b.s.to_bits(), b.qs),
                            "{ctx} block {i}"
                        );
                    }
                }
            }
        }
    }
}
