//! How far 8-bit activation quantization (the CPU backend's and llama.cpp's Q4/Q8 path) moves the
//! default model's logits: the model as stored against the same weights dequantized to f16 (f32
//! activations), teacher-forced on the reference sequences. This is the yardstick for comparing
//! backends that do not quantize activations (CUDA's f16 GEMMs).
//!
//! `cargo run --release -p quire-engine --example act_quant_effect`

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::KvCacheSpec;
use quire_engine::runner::forward_single;

fn main() {
    let m = quire_model::load_gguf(&quire_core::default_model::model_for_tests()).unwrap();
    let w16 = m.weights.dequantized_f16().unwrap();
    let kv = KvCacheSpec {
        num_blocks: 64,
        block_size: 16,
    };
    let mut a = CpuExecutor::new(&m.weights, kv, CpuOptions::default()).unwrap();
    let mut b = CpuExecutor::new(&w16, kv, CpuOptions::default()).unwrap();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/smollm2-135m-q4_1.greedy.jsonl"
    );
    let vocab = m.weights.config.vocab_size;
    let (mut worst, mut sum, mut rows) = (0f64, 0f64, 0usize);
    for line in std::fs::read_to_string(path).unwrap().lines() {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        let ids = |k: &str| {
            r[k].as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect::<Vec<_>>()
        };
        let seq: Vec<u32> = ids("prompt_tokens")
            .into_iter()
            .chain(ids("completion_tokens"))
            .collect();
        let all: Vec<u32> = (0..seq.len() as u32).collect();
        let la = forward_single(&mut a, &seq, &all).unwrap();
        let lb = forward_single(&mut b, &seq, &all).unwrap();
        for i in 0..seq.len() {
            let (x, y) = (
                &la[i * vocab..(i + 1) * vocab],
                &lb[i * vocab..(i + 1) * vocab],
            );
            let num: f64 = x.iter().zip(y).map(|(p, q)| ((p - q) as f64).powi(2)).sum();
            let den: f64 = y.iter().map(|q| (*q as f64).powi(2)).sum();
            let e = (num / den).sqrt();
            worst = worst.max(e);
            sum += e;
            rows += 1;
        }
    }
    println!(
        "stored (8-bit activations) vs f16-dequantized weights (f32 activations): mean relative error {:.2e}, worst {worst:.2e} over {rows} rows",
        sum / rows as f64
    );
}
