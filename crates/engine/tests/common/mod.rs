//! Shared by the engine's test files: the shared llama.cpp reference of the default model, and
//! the rule by which a backend other than the CPU oracle may part from an expected greedy path.

#![allow(dead_code)]

use serde_json::Value;

/// The lines of tests/data/smollm2-135m-q4_1.greedy.jsonl (prompts, greedy completions, top-3
/// log-probabilities from llama.cpp).
pub fn reference() -> Vec<Value> {
    let path = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../tests/data/smollm2-135m-q4_1.greedy.jsonl"
    );
    std::fs::read_to_string(path)
        .unwrap_or_else(|e| panic!("{path}: {e}"))
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}

/// A JSON array of token ids.
pub fn ids(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

/// Where a backend other than the CPU oracle may part from an expected greedy path: only where
/// the oracle's log-probabilities of the two choices are within this. Such backends pick kernels
/// by batch shape and sum in other orders, and with stored Q4/Q8 weights the 8-bit activation
/// quantization turns ~1e-6 differences into whole rounding steps (see tests/cuda.rs), which
/// moves near-ties; 0.25 is the bound tests/cuda.rs holds the CUDA backend's partings from the
/// CPU's to on stored weights.
pub const NEAR_TIE: f32 = 0.25;

/// The CPU backend with f32 attention accumulation, as judge of where a path parts.
pub struct Oracle {
    exec: Box<dyn quire_backend::Executor>,
}

impl Oracle {
    pub fn new(w: &quire_backend::ModelWeights) -> Self {
        let kv = quire_backend::KvCacheSpec {
            num_blocks: 64,
            block_size: 16,
        };
        let opts = quire_backend::cpu::CpuOptions {
            attn_f16_accum: false,
            ..Default::default()
        };
        let exec = quire_backend::cpu::CpuExecutor::new(w, kv, opts).expect("CPU oracle");
        Self {
            exec: Box::new(exec),
        }
    }

    /// The oracle's log-probability of `want` minus that of `got`, after `ctx`.
    pub fn gap(&mut self, ctx: &[u32], want: u32, got: u32) -> f32 {
        let vocab = self.exec.vocab_size();
        let last = [ctx.len() as u32 - 1];
        let l =
            quire_engine::runner::forward_single(self.exec.as_mut(), ctx, &last).expect("oracle");
        let lse = quire_engine::sampler::log_sum_exp(&l[..vocab]);
        (l[want as usize] - lse) - (l[got as usize] - lse)
    }
}

/// `got` against `want` (greedy tokens after `prompt`, with their finish reasons): equal on the
/// oracle backend; on others equal, or parting where the oracle's two choices are within
/// [`NEAR_TIE`] (the oracle made from `w` on first need). Err describes a failure.
pub fn check_greedy<R: PartialEq + std::fmt::Debug>(
    backend: quire_testkit::Backend,
    w: &quire_backend::ModelWeights,
    oracle: &mut Option<Oracle>,
    prompt: &[u32],
    got: &(Vec<u32>, R),
    want: &(Vec<u32>, R),
) -> Result<(), String> {
    if got == want {
        return Ok(());
    }
    let n = got
        .0
        .iter()
        .zip(&want.0)
        .take_while(|(a, b)| a == b)
        .count();
    if backend.is_oracle() || n == got.0.len().min(want.0.len()) {
        return Err(format!(
            "{} tokens agree, then got {:?} / want {:?}",
            n,
            (&got.0[n..], &got.1),
            (&want.0[n..], &want.1)
        ));
    }
    let ctx: Vec<u32> = prompt.iter().chain(&want.0[..n]).copied().collect();
    let gap = oracle
        .get_or_insert_with(|| Oracle::new(w))
        .gap(&ctx, want.0[n], got.0[n]);
    eprintln!(
        "{}: parts at {n}, the oracle's two choices {gap:.4} apart",
        backend.name()
    );
    if gap > NEAR_TIE {
        return Err(format!(
            "parts at {n} where the oracle's choices are {gap:.4} apart"
        ));
    }
    Ok(())
}
