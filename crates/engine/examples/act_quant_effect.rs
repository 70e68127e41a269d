//! How far 8-bit activation quantization (the CPU backend's and llama.cpp's Q4/Q8 path) moves the
//! default model's logits, and how sensitive that path is to tiny upstream differences.
//!
//! 1. The model as stored against the same weights dequantized to f16 (f32 activations),
//!    teacher-forced on the reference sequences: the yardstick for backends that do not quantize
//!    activations.
//! 2. Each form against itself with every RMSNorm weight scaled by (1 ± ~1e-6): a perturbation the
//!    size of float summation-order differences between two backends. With f32 activations the
//!    logits move by about that much; with 8-bit activations some values cross a rounding step
//!    and move by a whole step, so two correct backends that sum in different orders sit this far
//!    apart (why CUDA-vs-CPU on the stored weights is not ~1e-6).
//!
//! `cargo run --release -p quire-engine --example act_quant_effect [MODEL.gguf]`

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::{KvCacheSpec, ModelWeights};
use quire_engine::runner::forward_single;

fn main() {
    let path = std::env::args()
        .nth(1)
        .map(std::path::PathBuf::from)
        .unwrap_or_else(quire_core::default_model::model_for_tests);
    let m = quire_model::load_gguf(&path).unwrap();
    let w16 = m.weights.dequantized_f16().unwrap();
    let kv = KvCacheSpec {
        num_blocks: 64,
        block_size: 16,
    };
    let exec = |w: &ModelWeights| CpuExecutor::new(w, kv, CpuOptions::default()).unwrap();
    let refs = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/smollm2-135m-q4_1.greedy.jsonl"
    );
    let seqs: Vec<Vec<u32>> = std::fs::read_to_string(refs)
        .unwrap()
        .lines()
        .map(|line| {
            let r: serde_json::Value = serde_json::from_str(line).unwrap();
            let ids = |k: &str| {
                r[k].as_array()
                    .unwrap()
                    .iter()
                    .map(|x| x.as_u64().unwrap() as u32)
                    .collect::<Vec<_>>()
            };
            ids("prompt_tokens")
                .into_iter()
                .chain(ids("completion_tokens"))
                .collect()
        })
        .collect();
    let vocab = m.weights.config.vocab_size;
    let compare = |name: &str, a: &ModelWeights, b: &ModelWeights| {
        let (mut ea, mut eb) = (exec(a), exec(b));
        let (mut worst, mut sum, mut rows) = (0f64, 0f64, 0usize);
        for seq in &seqs {
            let all: Vec<u32> = (0..seq.len() as u32).collect();
            let la = forward_single(&mut ea, seq, &all).unwrap();
            let lb = forward_single(&mut eb, seq, &all).unwrap();
            for (x, y) in la.chunks_exact(vocab).zip(lb.chunks_exact(vocab)) {
                let num: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
                let den: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
                let e = (num / den).sqrt();
                worst = worst.max(e);
                sum += e;
                rows += 1;
            }
        }
        println!(
            "{name}: mean relative error {:.2e}, worst {worst:.2e} over {rows} rows",
            sum / rows as f64
        );
    };
    compare(
        "stored (8-bit activations) vs f16-dequantized weights (f32 activations)",
        &m.weights,
        &w16,
    );
    compare(
        "stored vs stored with norm weights x (1 ± 1e-6)",
        &m.weights,
        &m.weights.with_norms_nudged(1e-6).unwrap(),
    );
    compare(
        "f16-dequantized vs the same with norm weights x (1 ± 1e-6)",
        &w16,
        &w16.with_norms_nudged(1e-6).unwrap(),
    );
}
