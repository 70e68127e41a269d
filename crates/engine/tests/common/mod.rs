//! Shared by the engine's test files: the shared llama.cpp reference of the default model.

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
