//! MoE block against a plain f64 reference built from the dequantized weights: routing (softmax,
//! top-k, renormalization) and the weighted sum of SwiGLU experts, on random small layers with odd
//! token counts, k = 1 and k > 1, `norm_topk_prob` on and off, and every weight type.

use quire_core::{Architecture, ModelConfig, MoeConfig, RopeStyle};
use quire_gguf::{quantize_row, GgmlType};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

use super::*;
use crate::cpu::team::Team;

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

fn random(rng: &mut StdRng, n: usize, scale: f32) -> Vec<f32> {
    (0..n).map(|_| rng.random_range(-scale..scale)).collect()
}

/// f64 reference: `moe(h)` for each token, from the tensors' dequantized values.
// h: [n, hidden] -> [n, hidden]
fn reference(w: &MoeWeights, m: &MoeConfig, hd: usize, h: &[f32]) -> Vec<f64> {
    let f =
        |t: &HostTensor| -> Vec<f64> { t.to_f32().unwrap().into_iter().map(f64::from).collect() };
    let (router, gate, up, down) = (
        f(&w.gate_inp),
        f(&w.gate_exps),
        f(&w.up_exps),
        f(&w.down_exps),
    );
    let (ne, inter) = (m.num_experts, m.expert_intermediate_size);
    let mut out = vec![0f64; h.len()];
    for (t, x) in h.chunks_exact(hd).enumerate() {
        let dot = |row: &[f64], v: &[f64]| row.iter().zip(v).map(|(a, b)| a * b).sum::<f64>();
        let x: Vec<f64> = x.iter().map(|&v| f64::from(v)).collect();
        let logits: Vec<f64> = (0..ne)
            .map(|e| dot(&router[e * hd..(e + 1) * hd], &x))
            .collect();
        let max = logits.iter().copied().fold(f64::NEG_INFINITY, f64::max);
        let z: f64 = logits.iter().map(|l| (l - max).exp()).sum();
        let mut order: Vec<usize> = (0..ne).collect();
        // Stable sort: ties keep the lower expert first.
        order.sort_by(|&a, &b| logits[b].total_cmp(&logits[a]));
        let chosen = &order[..m.num_experts_per_tok];
        let mut weights: Vec<f64> = chosen
            .iter()
            .map(|&e| (logits[e] - max).exp() / z)
            .collect();
        if m.norm_topk_prob {
            let s: f64 = weights.iter().sum();
            weights.iter_mut().for_each(|w| *w /= s);
        }
        for (&e, &wt) in chosen.iter().zip(&weights) {
            let slab = |v: &[f64], rows: usize, len: usize| {
                v[e * rows * len..(e + 1) * rows * len].to_vec()
            };
            let (g, u, d) = (
                slab(&gate, inter, hd),
                slab(&up, inter, hd),
                slab(&down, hd, inter),
            );
            let act: Vec<f64> = (0..inter)
                .map(|i| {
                    let a = dot(&g[i * hd..(i + 1) * hd], &x);
                    a / (1.0 + (-a).exp()) * dot(&u[i * hd..(i + 1) * hd], &x)
                })
                .collect();
            for j in 0..hd {
                out[t * hd + j] += wt * dot(&d[j * inter..(j + 1) * inter], &act);
            }
        }
    }
    out
}

fn random_layer(rng: &mut StdRng, dtype: GgmlType, hd: usize, m: &MoeConfig) -> MoeWeights {
    let (ne, inter) = (m.num_experts, m.expert_intermediate_size);
    MoeWeights {
        // Router spread wide enough that top-k choices are far from ties.
        gate_inp: tensor(
            "gate_inp",
            GgmlType::F32,
            &[hd, ne],
            &random(rng, hd * ne, 0.5),
        ),
        gate_exps: tensor(
            "gate_exps",
            dtype,
            &[hd, inter, ne],
            &random(rng, hd * inter * ne, 0.3),
        ),
        up_exps: tensor(
            "up_exps",
            dtype,
            &[hd, inter, ne],
            &random(rng, hd * inter * ne, 0.3),
        ),
        down_exps: tensor(
            "down_exps",
            dtype,
            &[inter, hd, ne],
            &random(rng, hd * inter * ne, 0.3),
        ),
    }
}

#[test]
fn moe_block_matches_the_f64_reference() {
    let mut rng = StdRng::seed_from_u64(11);
    let team = Team::new(3);
    let hd = 64;
    // Exact-input types (f32 activations) and 8-bit-activation types, with their tolerances.
    let types = [
        (GgmlType::F32, 2e-5),
        (GgmlType::F16, 2e-5),
        (GgmlType::BF16, 2e-5),
        (GgmlType::Q8_0, 2e-2),
        (GgmlType::Q4_0, 2e-2),
    ];
    for (dtype, tol) in types {
        for (ne, k, norm) in [
            (8, 1, true),
            (8, 3, true),
            (8, 3, false),
            (5, 5, false),
            (6, 2, true),
        ] {
            let m = MoeConfig {
                num_experts: ne,
                num_experts_per_tok: k,
                expert_intermediate_size: 32,
                norm_topk_prob: norm,
            };
            let w = random_layer(&mut rng, dtype, hd, &m);
            let layer = MoeLayer::new(&w, &config(hd, m)).unwrap();
            let mut scratch = MoeScratch::default();
            // The same scratch serves batches of different sizes, as in a run.
            for n in [1, 5, 13, 2] {
                let h = random(&mut rng, n * hd, 1.0);
                let resid = random(&mut rng, n * hd, 1.0);
                let mut x = resid.clone();
                layer.forward(
                    &team,
                    &mut Profiler::default(),
                    None,
                    &h,
                    &mut scratch,
                    &mut x,
                );
                let want = reference(&w, &m, hd, &h);
                let scale = want.iter().fold(0f64, |a, v| a.max(v.abs()));
                let err = x
                    .iter()
                    .zip(&resid)
                    .zip(&want)
                    .map(|((x, r), w)| (f64::from(x - r) - w).abs())
                    .fold(0f64, f64::max);
                assert!(
                    err / scale < tol,
                    "{} ne={ne} k={k} norm={norm} n={n}: rel err {:.2e}",
                    dtype.name(),
                    err / scale
                );
            }
        }
    }
}

#[test]
fn routing_picks_the_top_k_softmax_weights() {
    let mut out = Vec::new();
    let logits = [0.5f32, 2.0, -1.0, 2.0, 1.0];
    route(&logits, 3, false, &mut out);
    let z: f32 = logits.iter().map(|l| l.exp()).sum();
    let p = |e: usize| logits[e].exp() / z;
    // Ties (experts 1 and 3) keep the lower index first.
    assert_eq!(out.iter().map(|e| e.0).collect::<Vec<_>>(), [1, 3, 4]);
    for &(e, w) in &out {
        assert!((w - p(e)).abs() < 1e-6);
    }
    route(&logits, 3, true, &mut out);
    let s = p(1) + p(3) + p(4);
    for &(e, w) in &out {
        assert!((w - p(e) / s).abs() < 1e-6);
    }
    assert!((out.iter().map(|e| e.1).sum::<f32>() - 1.0).abs() < 1e-6);
    route(&logits, 1, true, &mut out);
    assert_eq!(out, [(1, 1.0)]);
    // All experts: a permutation, weights the full softmax.
    route(&logits, 5, false, &mut out);
    assert_eq!(out.iter().map(|e| e.0).collect::<Vec<_>>(), [1, 3, 4, 0, 2]);
    // Large logits do not overflow.
    route(&[1000.0, 999.0, -1000.0], 2, false, &mut out);
    assert!(out.iter().all(|e| e.1.is_finite()) && out[0].0 == 0 && out[1].0 == 1);
}

#[test]
fn bad_expert_shapes_are_errors() {
    let mut rng = StdRng::seed_from_u64(2);
    let m = MoeConfig {
        num_experts: 4,
        num_experts_per_tok: 2,
        expert_intermediate_size: 32,
        norm_topk_prob: true,
    };
    let good = random_layer(&mut rng, GgmlType::Q8_0, 64, &m);
    assert!(MoeLayer::new(&good, &config(64, m)).is_ok());
    let mut w = good.clone();
    w.up_exps.dims = vec![64, 32, 3];
    assert!(MoeLayer::new(&w, &config(64, m)).is_err());
    let mut w = good.clone();
    w.gate_inp.dims = vec![64, 5];
    assert!(MoeLayer::new(&w, &config(64, m)).is_err());
    let mut w = good.clone();
    w.down_exps.bytes = TensorBytes::owned(vec![0; 10]);
    assert!(MoeLayer::new(&w, &config(64, m)).is_err());
    let dense = FfnWeights::Moe(good);
    let mut c = config(64, m);
    c.moe = None;
    assert!(ffn(&dense, &c).is_err());
}
