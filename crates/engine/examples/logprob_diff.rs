//! Prints, per reference prompt, how far quire's teacher-forced log-probabilities are from
//! llama.cpp's (`QUIRE_KV=f32` for an exact f32 KV cache). A diagnostic, not a test.
use quire_backend::cpu::{CpuExecutor, CpuOptions, KvDtype};
use quire_backend::{Executor, KvCacheSpec};
use quire_engine::runner::forward_single;
use quire_engine::sampler::log_sum_exp;

fn main() {
    let m = quire_model::load_gguf(&quire_core::default_model::model_for_tests()).unwrap();
    let mut o = CpuOptions::default();
    if std::env::var("QUIRE_KV").as_deref() == Ok("f32") {
        o.kv_dtype = KvDtype::F32;
    }
    let mut exec = CpuExecutor::new(
        &m.weights,
        KvCacheSpec {
            num_blocks: 16,
            block_size: 16,
        },
        o,
    )
    .unwrap();
    let vocab = exec.vocab_size();
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/smollm2-135m-q4_1.greedy.jsonl"
    );
    for line in std::fs::read_to_string(path).unwrap().lines() {
        let r: serde_json::Value = serde_json::from_str(line).unwrap();
        let ids = |v: &serde_json::Value| {
            v.as_array()
                .unwrap()
                .iter()
                .map(|x| x.as_u64().unwrap() as u32)
                .collect::<Vec<_>>()
        };
        let (p, c) = (ids(&r["prompt_tokens"]), ids(&r["completion_tokens"]));
        let seq: Vec<u32> = p.iter().chain(&c).copied().collect();
        let rows: Vec<u32> = (p.len() as u32 - 1..seq.len() as u32 - 1).collect();
        let logits = forward_single(&mut exec, &seq, &rows).unwrap();
        let (mut mx, mut sum, mut n) = (0f64, 0f64, 0);
        for (i, top3) in r["top3_logprobs"].as_array().unwrap().iter().enumerate() {
            let l = &logits[i * vocab..(i + 1) * vocab];
            let lse = log_sum_exp(l);
            for cand in top3.as_array().unwrap() {
                let sd = (l[cand[0].as_u64().unwrap() as usize] - lse) as f64
                    - cand[1].as_f64().unwrap();
                let d = sd.abs();
                mx = f64::max(mx, d);
                if std::env::var("QUIRE_VERBOSE").is_ok() && n < 60 {
                    print!("{i}:{sd:+.3} ");
                }
                sum += d;
                n += 1;
            }
        }
        println!(
            "max {mx:.4} mean {:.4}  {:?}",
            sum / n as f64,
            &r["prompt"].as_str().unwrap()[..20.min(r["prompt"].as_str().unwrap().len())]
        );
    }
}
