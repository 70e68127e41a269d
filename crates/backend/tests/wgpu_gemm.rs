//! The wgpu prompt GEMM against a plain CPU reference (dequantize, then f64 sums) on random
//! inputs, for every weight type and every path the adapter has: the tiled fallback everywhere,
//! and the cooperative-matrix kernel where the adapter has matrix units (the test prints which
//! paths ran; on lavapipe only the tiled one exists). Odd shapes: row counts and token counts
//! that are not multiples of the tiles, f16 rows that are not multiples of 32 columns, strided
//! x, output columns at an offset in wider rows, and the residual add. Target columns are
//! poisoned with NaN (or hold the residual), every other column must come back bit for bit.
//! The coop kernels' WGSL (the GEMM's and the prompt attention's), which lavapipe cannot run, is
//! checked with naga here: parsed,
//! validated with the capabilities it needs, translated to SPIR-V (and MSL for Apple's 8×8).
//! Adapter tests are ignored unless QUIRE_REQUIRE_WGPU is set at build time (see quire-testkit).

#[cfg(feature = "wgpu")]
use {
    half::f16,
    quire_backend::wgpu::gemm::{self, GemmPath, Split},
    quire_backend::wgpu::probe::Probe,
    quire_backend::HostTensor,
    quire_gguf::GgmlType,
    quire_testkit::metric::{self, rel_l2},
    quire_testkit::random::rnd,
    rand::{rngs::StdRng, SeedableRng},
};

#[cfg(feature = "wgpu")]
fn probe() -> Probe {
    let adapter = std::env::var("QUIRE_WGPU_ADAPTER").ok();
    Probe::new(adapter.as_deref())
        .unwrap_or_else(|e| quire_testkit::missing(quire_testkit::Backend::Wgpu, &e))
}

/// A `[rows, cols]` tensor of type `t` from random values (testkit's), and the values the
/// device computes with (f32 and bf16 go to the device as f16).
#[cfg(feature = "wgpu")]
fn tensor(rng: &mut StdRng, t: GgmlType, rows: usize, cols: usize) -> (HostTensor, Vec<f32>) {
    let w = quire_testkit::random::tensor(rng, t, rows, cols);
    let mut wf = w.to_f32().unwrap();
    if matches!(t, GgmlType::F32 | GgmlType::BF16) {
        wf.iter_mut().for_each(|x| *x = f16::from_f32(*x).to_f32());
    }
    (w, wf)
}

/// The bound of each path: f32 products summed in f32 for the tiled kernel; for the coop kernel
/// x and the dequantized weights are rounded to f16 (2^-11 relative each) before f32
/// accumulation on the matrix units, as a GEMV on an f16-rounded input is.
#[cfg(feature = "wgpu")]
fn bound(path: GemmPath) -> f64 {
    match path {
        GemmPath::Tiled => metric::DOT_F32,
        GemmPath::Coop(..) => metric::DOT_FUSED_F16_INPUT,
    }
}

/// Columns of one 16-byte unit of type `t` on the device (f32 and bf16 go there as f16).
#[cfg(feature = "wgpu")]
fn unit_cols(t: GgmlType) -> usize {
    match t {
        GgmlType::F16 | GgmlType::F32 | GgmlType::BF16 => 8,
        GgmlType::Q8_0 => 16,
        _ => 32,
    }
}

/// The dequantized product `w` · `x`ᵀ in f64 (+ `y0` where `add`) for the columns
/// `y_off..y_off + rows` of every token's row, and the device's values there; panics if the
/// device wrote any other column of `got`.
#[cfg(feature = "wgpu")]
#[allow(clippy::too_many_arguments)]
fn compare(
    what: &str,
    wf: &[f32],
    (rows, cols): (usize, usize),
    x: &[f32],
    x_stride: usize,
    n: usize,
    (y0, got): (&[f32], &[f32]),
    (y_stride, y_off, add): (usize, usize, bool),
) -> (Vec<f32>, Vec<f64>) {
    let mut g = Vec::new();
    let mut want = Vec::new();
    for ti in 0..n {
        for r in 0..rows {
            let dot: f64 = (0..cols)
                .map(|c| wf[r * cols + c] as f64 * x[ti * x_stride + c] as f64)
                .sum();
            let o = ti * y_stride + y_off + r;
            want.push(if add { y0[o] as f64 + dot } else { dot });
            g.push(got[o]);
        }
        for c in (0..y_stride).filter(|c| !(y_off..y_off + rows).contains(c)) {
            let o = ti * y_stride + c;
            assert_eq!(
                got[o].to_bits(),
                y0[o].to_bits(),
                "{what}: column {c} of token {ti} was written"
            );
        }
    }
    (g, want)
}

quire_testkit::wgpu_test! {
    fn gemm_matches_the_dequantized_product_for_every_weight_type_and_path() {
        let mut p = probe();
        let mut rng = StdRng::seed_from_u64(11);
        let paths = p.k.gemm.paths();
        let names: Vec<String> = paths.iter().map(|x| x.name()).collect();
        println!("adapter {}: GEMM paths {}", p.gpu.info.name, names.join("; "));
        let types = [
            GgmlType::F16,
            GgmlType::F32,
            GgmlType::BF16,
            GgmlType::Q8_0,
            GgmlType::Q4_0,
            GgmlType::Q4_1,
            GgmlType::Q4_K,
            GgmlType::Q5_K,
            GgmlType::Q6_K,
        ];
        for path in paths {
            for t in types {
                // Row lengths per format: f16 rows that are not whole 32-column steps, blocks of
                // 32, superblocks of 256; the last long enough to split over columns.
                let cols = match t {
                    GgmlType::F16 | GgmlType::F32 | GgmlType::BF16 => [136, 320, 40, 64, 1048],
                    GgmlType::Q4_K | GgmlType::Q5_K | GgmlType::Q6_K => [256, 512, 256, 256, 1280],
                    _ => [160, 320, 32, 64, 1056],
                };
                // (rows, cols, tokens, residual add): one tile and a part, several tiles each
                // way, a single token, a thin matrix, few tiles over long rows (split).
                let shapes = [
                    (67, cols[0], 17, false),
                    (130, cols[1], 70, true),
                    (5, cols[2], 1, false),
                    (200, cols[3], 129, true),
                    (70, cols[4], 33, true),
                ];
                for (rows, cols, n, add) in shapes {
                    let (w, wf) = tensor(&mut rng, t, rows, cols);
                    let x_stride = cols + 4;
                    let x = rnd(&mut rng, n * x_stride, 1.0);
                    let (y_off, y_stride) = (3, rows + 7);
                    let mut y0 = rnd(&mut rng, n * y_stride, 1.0);
                    if !add {
                        for ti in 0..n {
                            y0[ti * y_stride + y_off..][..rows].fill(f32::NAN);
                        }
                    }
                    // The path's own split of this shape, none, and an uneven one: two units
                    // per slice, the last slice shorter (a split's slices must be whole steps).
                    let unit = unit_cols(t);
                    let units = cols / unit;
                    let per = 2 * path.blocking().k as usize / unit;
                    let uneven = Split {
                        slices: units.div_ceil(per) as u32,
                        units: per as u32,
                    };
                    let mut splits = vec![None, Some(Split::NONE)];
                    if uneven.is_split() {
                        splits.push(Some(uneven));
                    }
                    for split in splits {
                        let what = format!(
                            "{} on {} {rows}x{cols} n={n} add={add} split {split:?}",
                            t.name(),
                            path.name()
                        );
                        let got = p
                            .gemm(path, split, &w, &x, x_stride, n, &y0, y_stride, y_off, add)
                            .unwrap()
                            .expect("the adapter listed this path");
                        let (g, want) = compare(
                            &what,
                            &wf,
                            (rows, cols),
                            &x,
                            x_stride,
                            n,
                            (&y0, &got),
                            (y_stride, y_off, add),
                        );
                        let e = rel_l2(&g, &want);
                        assert!(e < bound(path), "{what}: rel L2 {e:e}");
                    }
                }
            }
        }
    }
}

/// What wgpu grants a device opened with SHADER_F16, SUBGROUP and cooperative matrices.
#[cfg(feature = "wgpu")]
fn coop_caps() -> naga::valid::Capabilities {
    use naga::valid::Capabilities as C;
    C::SHADER_FLOAT16_IN_FLOAT32 | C::SHADER_FLOAT16 | C::SUBGROUP | C::COOPERATIVE_MATRIX
}

#[test]
#[cfg_attr(not(feature = "wgpu"), ignore = "needs --features wgpu")]
fn coop_kernels_validate_and_translate_to_spirv_and_msl() {
    #[cfg(feature = "wgpu")]
    {
        use naga::back::{msl, spv};
        use naga::valid::{ValidationFlags, Validator};
        let mut failures = Vec::new();
        // The GEMM's and the prompt attention's (the same configurations, two head dims).
        let mut sources = gemm::coop_sources();
        assert_eq!(
            sources.len(),
            2 * gemm::BLOCKINGS.len() * quire_backend::wgpu::kernels::WType::ALL.len(),
            "two configurations, every blocking, every weight type"
        );
        let attn = quire_backend::wgpu::attn_prompt::coop_sources();
        assert_eq!(attn.len(), 4, "two configurations, head dims 64 and 128");
        sources.extend(attn);
        for (name, src, entries) in sources {
            let module = match naga::front::wgsl::parse_str(&src) {
                Ok(m) => m,
                Err(e) => {
                    failures.push(format!("{name}: WGSL: {}", e.emit_to_string(&src)));
                    continue;
                }
            };
            let mut validator = Validator::new(ValidationFlags::all(), coop_caps());
            let info = match validator.validate(&module) {
                Ok(i) => i,
                Err(e) => {
                    failures.push(format!("{name}: validation: {}", e.emit_to_string(&src)));
                    continue;
                }
            };
            for entry in entries {
                assert!(
                    module.entry_points.iter().any(|e| e.name == entry),
                    "{name}: no entry point {entry}"
                );
            }
            let opts = spv::Options {
                lang_version: (1, 3),
                ..Default::default()
            };
            if let Err(e) = spv::write_vec(&module, &info, &opts, None) {
                failures.push(format!("{name}: SPIR-V: {e}"));
            }
            // Metal's simdgroup matrices are 8x8: only that configuration is for Apple.
            if name.contains("_coop8_") {
                let opts = msl::Options {
                    lang_version: (2, 4),
                    ..Default::default()
                };
                let pipe = msl::PipelineOptions::default();
                if let Err(e) = msl::write_string(&module, &info, &opts, &pipe) {
                    failures.push(format!("{name}: MSL: {e}"));
                }
            }
        }
        assert!(failures.is_empty(), "{}", failures.join("\n"));
    }
}

#[test]
#[cfg_attr(not(feature = "wgpu"), ignore = "needs --features wgpu")]
fn coop_gemm_is_refused_by_naga_without_the_feature() {
    // The check above must be able to fail: the same source without COOPERATIVE_MATRIX.
    #[cfg(feature = "wgpu")]
    {
        use naga::valid::{Capabilities as C, ValidationFlags, Validator};
        let (_, src, _) = gemm::coop_sources().remove(0);
        let module = naga::front::wgsl::parse_str(&src).expect("parses");
        let caps = coop_caps() - C::COOPERATIVE_MATRIX;
        assert!(Validator::new(ValidationFlags::all(), caps)
            .validate(&module)
            .is_err());
    }
}
