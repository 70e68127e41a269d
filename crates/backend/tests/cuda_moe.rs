//! The CUDA mixture-of-experts block (cuda/moe.rs, kernels/moe.cu) against the CPU backend's, the
//! oracle: every expert type the kernels keep as stored (Q4_0, Q4_1, Q8_0, and the K-quants Q4_K,
//! Q5_K, Q6_K, which used to go to f16) and F16 (the f16 path), at decode sizes (16, 7, 3, 2 and 1
//! tokens: the fused top-k + sort, tiles of 8 pairs on both the dp4a kernels and the GEMV-shaped
//! ones, one token on the one-pair GEMV kernel), a mid size (100 tokens: separate top-k and sort,
//! both tile paths, the GEMV path's down and combine as two launches) and a prompt size (200
//! tokens) on both the dp4a tiles and the grouped int8 tensor-core GEMM. The router is rigged so
//! that two experts get no pair and one gets most tokens (several 64-pair tiles, the last
//! partial); the others get odd counts (checked: some tile holds an odd number of pairs above 1).
//!
//! The shapes give the GEMV-shaped kernels two stages of rows with a partial second one (gate/up
//! of Q4_0 and Q4_K: hidden 2304; the fused down + combine of Q4_1: expert rows 2304, two stages
//! per slot), one stage (the others), and down matrices whose rows are not 16-byte aligned (Q4_0,
//! Q8_0 and Q6_K: the dp4a down kernel and the separate combine run inside the GEMV path); the
//! dp4a kernels get partial K steps. Six experts per token, so the fused down kernel's four warps
//! take two slots or one each (a warp moves to its next slot's expert mid-way). Wherever it runs,
//! the GEMV path runs twice and must give the same bits both times (no float atomics: a step is
//! deterministic), and must agree with the dp4a path within 0.2%.
//!
//! Bounds: the block's output (x after minus x before) within 2% of its largest magnitude of the
//! CPU's (the CPU MoE test's bound against an f64 reference; both sides quantize the activations
//! to 8 bits, the GPU the SwiGLU output from its own f32 sums); the tensor-core path within 0.2%
//! of the dp4a path on the same blocks (the same integer dots, summed in another order). Tokens
//! whose k-th and (k+1)-th router logits are within 1e-3 (f64) are left out of the comparison:
//! the GPU's f32 router GEMM may order them otherwise.
//! The same scratch serves every case (largest first), so a pair a kernel skipped would show the
//! previous case's values. Needs a GPU: ignored without one (see quire-testkit).

#[cfg(feature = "cuda")]
use {
    half::f16,
    quire_backend::cpu::moe::{MoeLayer as CpuMoe, MoeScratch as CpuScratch},
    quire_backend::cpu::profile::Profiler,
    quire_backend::cpu::quant::{quantize_row_q8a_scalar, BlockQ8A, QK},
    quire_backend::cpu::team::Team,
    quire_backend::cuda::gpu::Gpu,
    quire_backend::cuda::moe::{MoeInputs, MoeKernels, MoeLayer, MoePath, MoeRun, MoeScratch},
    quire_backend::cuda::nvrtc,
    quire_backend::cuda::qmat::{QuantKernels, Q8A_BYTES},
    quire_backend::{HostTensor, MoeWeights, TensorBytes},
    quire_core::{Architecture, ModelConfig, MoeConfig, RopeStyle},
    quire_gguf::{quantize_row, GgmlType},
    rand::{rngs::StdRng, Rng, SeedableRng},
};

#[cfg(feature = "cuda")]
const EXPERTS: usize = 16;
#[cfg(feature = "cuda")]
const TOP_K: usize = 6;
/// The expert most tokens pick, and the two none picks.
#[cfg(feature = "cuda")]
const POPULAR: usize = 0;
#[cfg(feature = "cuda")]
const STARVED: [usize; 2] = [14, 15];

#[cfg(feature = "cuda")]
fn config(hidden: usize, moe: MoeConfig) -> ModelConfig {
    ModelConfig {
        arch: Architecture::Qwen3Moe,
        hidden_size: hidden,
        intermediate_size: 1,
        num_layers: 1,
        num_heads: 1,
        num_kv_heads: 1,
        head_dim: 32,
        vocab_size: 1,
        max_position_embeddings: 64,
        rms_norm_eps: 1e-6,
        rope_theta: 1e4,
        rope_dim: 32,
        rope_style: RopeStyle::Neox,
        tie_word_embeddings: true,
        attention_bias: false,
        qk_norm: true,
        sliding_window: None,
        moe: Some(moe),
    }
}

#[cfg(feature = "cuda")]
fn tensor(name: &str, dtype: GgmlType, dims: &[usize], values: &[f32]) -> HostTensor {
    let mut bytes = Vec::new();
    quantize_row(dtype, values, &mut bytes).unwrap();
    HostTensor {
        name: name.into(),
        dtype,
        dims: dims.to_vec(),
        bytes: TensorBytes::owned(bytes),
    }
}

#[cfg(feature = "cuda")]
fn rnd(rng: &mut StdRng, n: usize, a: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-a..a)).collect()
}

/// Router `[experts][hidden]`: random (logits of spread ~1.3), plus weights on input 0 (which
/// every token sets to 4): +3 to the popular expert's logit (picked by most tokens, yet not so
/// far ahead that the others' weights vanish) and −24 to the starved experts'.
#[cfg(feature = "cuda")]
fn router(rng: &mut StdRng, hd: usize) -> Vec<f32> {
    // Wider rows get smaller weights, so the random part of the logits keeps its spread.
    let a = 0.3 * (256.0 / hd as f32).sqrt().min(1.0);
    let mut r = rnd(rng, EXPERTS * hd, a);
    r[POPULAR * hd] = 0.75;
    for e in STARVED {
        r[e * hd] = -6.0;
    }
    r
}

#[cfg(feature = "cuda")]
fn layer(rng: &mut StdRng, dtype: GgmlType, hd: usize, inter: usize) -> MoeWeights {
    let e = EXPERTS;
    MoeWeights {
        gate_inp: tensor("gate_inp", GgmlType::F32, &[hd, e], &router(rng, hd)),
        gate_exps: tensor(
            "gate",
            dtype,
            &[hd, inter, e],
            &rnd(rng, e * inter * hd, 0.2),
        ),
        up_exps: tensor("up", dtype, &[hd, inter, e], &rnd(rng, e * inter * hd, 0.2)),
        down_exps: tensor(
            "down",
            dtype,
            &[inter, hd, e],
            &rnd(rng, e * hd * inter, 0.2),
        ),
    }
}

/// Per token: whether its routing is clear (the k-th and (k+1)-th f64 logits at least 1e-3
/// apart), and the pair count of each expert over the clear tokens.
#[cfg(feature = "cuda")]
fn routing(w: &MoeWeights, h: &[f32], hd: usize) -> (Vec<bool>, Vec<usize>) {
    let r = w.gate_inp.to_f32().unwrap();
    let mut counts = vec![0; EXPERTS];
    let clear = h
        .chunks_exact(hd)
        .map(|x| {
            let mut l: Vec<(f64, usize)> = (0..EXPERTS)
                .map(|e| {
                    let row = &r[e * hd..(e + 1) * hd];
                    let v = row.iter().zip(x).map(|(a, b)| *a as f64 * *b as f64).sum();
                    (v, e)
                })
                .collect();
            l.sort_by(|a, b| b.0.partial_cmp(&a.0).unwrap());
            l[..TOP_K].iter().for_each(|&(_, e)| counts[e] += 1);
            l[TOP_K - 1].0 - l[TOP_K].0 >= 1e-3
        })
        .collect();
    (clear, counts)
}

#[cfg(feature = "cuda")]
fn q8_bytes(x: &[f32]) -> Vec<u8> {
    let mut blocks = vec![BlockQ8A::default(); x.len() / QK];
    quantize_row_q8a_scalar(x, &mut blocks);
    let mut v = Vec::with_capacity(blocks.len() * Q8A_BYTES);
    for b in &blocks {
        v.extend(b.d.to_le_bytes());
        v.extend(b.s.to_le_bytes());
        v.extend(b.qs.iter().map(|&q| q as u8));
    }
    v
}

/// Largest difference between two block outputs over the clear tokens, and the largest
/// magnitude of `want` there.
#[cfg(feature = "cuda")]
fn max_diff(got: &[f32], want: &[f32], clear: &[bool], hd: usize) -> (f32, f32) {
    let (mut diff, mut scale) = (0.0f32, 0.0f32);
    for (t, ok) in clear.iter().enumerate() {
        if !ok {
            continue;
        }
        for i in t * hd..(t + 1) * hd {
            assert!(got[i].is_finite(), "token {t}: {} at {i}", got[i]);
            diff = diff.max((got[i] - want[i]).abs());
            scale = scale.max(want[i].abs());
        }
    }
    (diff, scale)
}

quire_testkit::gpu_test! {
    fn moe_block_matches_the_cpu_for_every_expert_type_and_path() {
        let g = Gpu::new(0).unwrap_or_else(|e| quire_testkit::no_gpu(&e));
        let mk = MoeKernels::new(&g).unwrap();
        let qk = QuantKernels::new(&g).unwrap();
        let act = g.module(&nvrtc::ACTIVATION, &[]).unwrap();
        let swiglu = Gpu::function(&act, "swiglu_f16").unwrap();
        let run = MoeRun { g: &g, mk: &mk, qk: &qk, swiglu_f16: &swiglu };
        let team = Team::new(2);
        let mut rng = StdRng::seed_from_u64(24);
        let types = [
            (GgmlType::Q4_0, 2304, 96),
            (GgmlType::Q4_1, 256, 2304),
            (GgmlType::Q8_0, 256, 96),
            (GgmlType::Q4_K, 2304, 256),
            (GgmlType::Q5_K, 256, 512),
            (GgmlType::Q6_K, 2048, 256),
            (GgmlType::F16, 160, 96),
        ];
        for (dtype, hd, inter) in types {
            let m = MoeConfig {
                num_experts: EXPERTS,
                num_experts_per_tok: TOP_K,
                expert_intermediate_size: inter,
                norm_topk_prob: true,
            };
            let w = layer(&mut rng, dtype, hd, inter);
            let cpu = CpuMoe::new(&w, &config(hd, m)).unwrap();
            let gpu_layer = MoeLayer::upload(&g, &w, m, hd, true).unwrap();
            let quant = dtype != GgmlType::F16;
            assert_eq!(gpu_layer.q8_in(), quant, "{dtype:?} kept as stored");
            let mut s = MoeScratch::empty(&g).unwrap();
            s.grow(&g, 200, &m, hd).unwrap();
            assert_eq!(run.gemv_ok(&gpu_layer), quant, "{dtype:?}: GEMV-shaped gate/up");
            // The tile paths (the dp4a one first: the GEMV path is held to it), by token count.
            let tiles = || -> Vec<MoePath> {
                [MoePath::Dp4a, MoePath::Gemv].into_iter().filter(|&p| run.path_ok(&gpu_layer, p)).collect()
            };
            let mut cases = vec![(200, vec![MoePath::Dp4a]), (100, tiles())];
            if quant && run.tc_ok(&gpu_layer) {
                cases[0].1.insert(0, MoePath::TensorCore);
            }
            for n in [16, 7, 3, 2, 1] {
                cases.push((n, tiles()));
            }
            let mut odd_tile = false;
            for (n, paths) in cases {
                let what = format!("{dtype:?} n={n}");
                let mut h = rnd(&mut rng, n * hd, 1.0);
                h.chunks_exact_mut(hd).for_each(|x| x[0] = 4.0);
                let resid = rnd(&mut rng, n * hd, 1.0);
                let (clear, counts) = routing(&w, &h, hd);
                let skipped = clear.iter().filter(|c| !**c).count();
                assert!(skipped * 10 <= n.max(10), "{what}: {skipped} near-tie tokens");
                for e in STARVED {
                    assert_eq!(counts[e], 0, "{what}: expert {e} was to get no pair");
                }
                if n >= 100 {
                    let c = counts[POPULAR];
                    assert!(c > 64, "{what}: expert 0 was to take several tiles ({c} pairs)");
                }
                if n <= 16 {
                    odd_tile |= counts.iter().any(|&c| c % 8 > 1 && c % 2 == 1);
                }

                let mut want = resid.clone();
                cpu.forward(&team, &mut Profiler::default(), None, &h, &mut CpuScratch::default(), &mut want);
                let delta = |x: &[f32]| -> Vec<f32> {
                    x.iter().zip(&resid).map(|(a, b)| a - b).collect()
                };
                let want = delta(&want);

                g.htod(&h, &mut s.hf, 0).unwrap();
                let h16: Vec<f16> = h.iter().map(|&v| f16::from_f32(v)).collect();
                let dh = g.upload(&h16).unwrap();
                let dq = g.upload(&q8_bytes(&h)).unwrap();
                let block = |path: MoePath| -> Vec<f32> {
                    let dx = g.upload(&resid).unwrap();
                    let io = MoeInputs { hf: s.hf.ptr, h: dh.ptr, q8: dq.ptr, x: dx.ptr, n, hidden: hd };
                    // SAFETY: every address is a live allocation of this test (the scratch grown
                    // for 200 tokens, the uploads sized for n tokens), and the stream is
                    // synchronised (dtoh) before any of them drops.
                    unsafe { run.run_with(&gpu_layer, &s, &io, path) }.unwrap();
                    let mut got = vec![0.0f32; n * hd];
                    g.dtoh(&dx, &mut got).unwrap();
                    delta(&got)
                };
                let mut dp4a = None;
                for path in paths {
                    let what = format!("{what} {path:?}");
                    let got = block(path);
                    let (diff, scale) = max_diff(&got, &want, &clear, hd);
                    assert!(scale > 0.0, "{what}: the CPU block added nothing");
                    assert!(diff <= 2e-2 * scale, "{what}: off by {diff} (largest {scale})");
                    match path {
                        MoePath::Dp4a => dp4a = Some(got),
                        MoePath::Gemv => {
                            let again = block(path);
                            let same = got.iter().zip(&again).all(|(a, b)| a.to_bits() == b.to_bits());
                            assert!(same, "{what}: a second run gave other bits");
                            let d = dp4a.as_ref().expect("the dp4a path runs first");
                            let all = vec![true; n];
                            let (diff, scale) = max_diff(&got, d, &all, hd);
                            assert!(diff <= 2e-3 * scale, "{what}: off the dp4a path by {diff} (largest {scale})");
                        }
                        MoePath::TensorCore => {}
                    }
                }
            }
            assert!(odd_tile, "{dtype:?}: no decode case gave an expert an odd pair count above 1");
        }
    }
}

quire_testkit::gpu_test! {
    fn tensor_core_experts_equal_the_dp4a_experts_on_the_same_input() {
        let g = Gpu::new(0).unwrap_or_else(|e| quire_testkit::no_gpu(&e));
        let mk = MoeKernels::new(&g).unwrap();
        let qk = QuantKernels::new(&g).unwrap();
        let act = g.module(&nvrtc::ACTIVATION, &[]).unwrap();
        let swiglu = Gpu::function(&act, "swiglu_f16").unwrap();
        let run = MoeRun { g: &g, mk: &mk, qk: &qk, swiglu_f16: &swiglu };
        let mut rng = StdRng::seed_from_u64(25);
        for (dtype, hd, inter) in [
            (GgmlType::Q4_0, 160, 96),
            (GgmlType::Q4_1, 160, 96),
            (GgmlType::Q8_0, 160, 96),
            (GgmlType::Q4_K, 256, 256),
            (GgmlType::Q5_K, 256, 256),
            (GgmlType::Q6_K, 256, 256),
        ] {
            let m = MoeConfig {
                num_experts: EXPERTS,
                num_experts_per_tok: TOP_K,
                expert_intermediate_size: inter,
                norm_topk_prob: false,
            };
            let w = layer(&mut rng, dtype, hd, inter);
            let gpu_layer = MoeLayer::upload(&g, &w, m, hd, true).unwrap();
            if !run.tc_ok(&gpu_layer) {
                eprintln!("no int8 tensor cores on {}: skipped", g.arch);
                return;
            }
            // 131 tokens: the popular expert's pairs (~110) take two tensor-core tiles, the
            // second partial.
            let n = 131;
            let mut s = MoeScratch::empty(&g).unwrap();
            s.grow(&g, n, &m, hd).unwrap();
            let mut h = rnd(&mut rng, n * hd, 1.0);
            h.chunks_exact_mut(hd).for_each(|x| x[0] = 4.0);
            let resid = rnd(&mut rng, n * hd, 1.0);
            g.htod(&h, &mut s.hf, 0).unwrap();
            let h16: Vec<f16> = h.iter().map(|&v| f16::from_f32(v)).collect();
            let dh = g.upload(&h16).unwrap();
            let dq = g.upload(&q8_bytes(&h)).unwrap();
            let mut outs = Vec::new();
            for path in [MoePath::Dp4a, MoePath::TensorCore] {
                let dx = g.upload(&resid).unwrap();
                let io = MoeInputs { hf: s.hf.ptr, h: dh.ptr, q8: dq.ptr, x: dx.ptr, n, hidden: hd };
                // SAFETY: as in the test above: live allocations of this test, sized for n
                // tokens, the stream synchronised by dtoh before they drop.
                unsafe { run.run_with(&gpu_layer, &s, &io, path) }.unwrap();
                let mut got = vec![0.0f32; n * hd];
                g.dtoh(&dx, &mut got).unwrap();
                outs.push(got.iter().zip(&resid).map(|(a, b)| a - b).collect::<Vec<f32>>());
            }
            let all = vec![true; n];
            let (diff, scale) = max_diff(&outs[1], &outs[0], &all, hd);
            assert!(scale > 0.0, "{dtype:?}: the block added nothing");
            assert!(diff <= 2e-3 * scale, "{dtype:?}: tensor cores off by {diff} (largest {scale})");
        }
    }
}
