//! The `quire` binary as a user runs it: bad model files end in one error line and a non-zero exit
//! (never a panic), `generate --json` prints its object on the last line, `info` and `generate`
//! take an HF Qwen3-MoE folder, and perplexity matches llama.cpp's on the GPL-3 text.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use rand::{Rng, SeedableRng};

fn quire(args: &[&str], model: Option<&Path>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_quire"));
    c.args(args);
    if let Some(m) = model {
        c.env("QUIRE_MODEL", m);
    }
    c.output().expect("run quire")
}

fn model() -> PathBuf {
    quire_core::default_model::model_for_tests()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("quire-cli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Corrupted copies of the default model's header and metadata (truncated, bytes flipped, counts
/// made huge) must each give exactly one `error:` line on stderr and exit code 1.
#[test]
fn corrupt_models_fail_cleanly() {
    let bytes = std::fs::read(model()).unwrap();
    let dir = tmpdir("corrupt");
    let mut rng = rand::rngs::StdRng::seed_from_u64(2024);
    // The metadata (tokens, merges) ends before 2 MiB; the copy is truncated there, so every case
    // is invalid (tensor data missing) and the parser must say so rather than crash.
    let head = &bytes[..2 << 20];
    for case in 0..60 {
        let mut b = head.to_vec();
        match case % 4 {
            0 => b.truncate(rng.random_range(0..b.len())),
            1 => {
                for _ in 0..rng.random_range(1..16) {
                    let i = rng.random_range(0..b.len());
                    b[i] ^= 1 << rng.random_range(0..8);
                }
            }
            2 => {
                // A huge count or length at a random 8-byte position of the first 64 KiB.
                let i = rng.random_range(0..(64 << 10) - 8);
                b[i..i + 8]
                    .copy_from_slice(&(u64::MAX - rng.random_range(0..1000u64)).to_le_bytes());
            }
            _ => {
                // Tensor count (offset 8) or metadata count (offset 16) made huge.
                let at = if rng.random_bool(0.5) { 8 } else { 16 };
                b[at..at + 8]
                    .copy_from_slice(&rng.random_range(1u64 << 32..u64::MAX).to_le_bytes());
            }
        }
        let path = dir.join(format!("case{case}.gguf"));
        std::fs::write(&path, &b).unwrap();
        for cmd in [
            &["info"][..],
            &["generate", "--prompt", "hi", "--max-tokens", "1"][..],
        ] {
            let out = quire(cmd, Some(&path));
            let err = String::from_utf8_lossy(&out.stderr);
            assert_eq!(
                out.status.code(),
                Some(1),
                "case {case} {cmd:?}: exit {:?}, stderr {err}",
                out.status
            );
            assert!(!err.contains("panicked"), "case {case}: panic: {err}");
            let lines: Vec<&str> = err.lines().collect();
            assert_eq!(
                lines.len(),
                1,
                "case {case} {cmd:?}: expected one line, got {err:?}"
            );
            assert!(lines[0].starts_with("error: "), "case {case}: {err:?}");
        }
    }
    let _ = std::fs::remove_dir_all(dir);
}

#[test]
fn missing_model_file_is_one_line() {
    let out = quire(
        &[
            "generate",
            "--prompt",
            "hi",
            "--model",
            "/nonexistent/model.gguf",
        ],
        None,
    );
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert_eq!(err.lines().count(), 1, "{err}");
    assert!(err.contains("/nonexistent/model.gguf"), "{err}");
}

#[test]
fn generate_json_last_line() {
    let out = quire(
        &[
            "generate",
            "--prompt",
            "The capital of France is",
            "--max-tokens",
            "8",
            "--json",
        ],
        Some(&model()),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let last = stdout.lines().last().unwrap();
    let j: serde_json::Value = serde_json::from_str(last).unwrap();
    assert_eq!(
        j["prompt_tokens"],
        serde_json::json!([504, 3575, 282, 4649, 314])
    );
    assert_eq!(j["completion_tokens"].as_array().unwrap().len(), 8);
    assert_eq!(j["finish_reason"], "length");
    assert!(j["text"].as_str().unwrap().starts_with(" Paris."), "{last}");
    for k in ["prefill_tok_s", "decode_tok_s", "ttft_ms"] {
        assert!(
            j["timings"][k].as_f64().unwrap() > 0.0,
            "timings.{k} in {last}"
        );
    }
}

/// The tiny Qwen3MoeForCausalLM of tests/hf/fixtures/qwen3_moe as an HF folder (weights from the
/// fixture's manifest, 2 shards): `info` shows the derived MoE config, `generate -m FOLDER` runs.
#[test]
fn info_and_generate_take_an_hf_moe_folder() {
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("../../tests/hf/fixtures/qwen3_moe");
    let dir = tmpdir("hf-moe");
    let folder = dir.join("qwen3_moe");
    quire_model::hf_fixture::write_fixture_folder(
        &fixture,
        &folder,
        quire_model::hf_fixture::Dtype::BF16,
        2,
    )
    .unwrap();
    let folder_arg = folder.to_str().unwrap();

    let out = quire(&["info", "-m", folder_arg], None);
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    assert!(stdout.contains("HF model folder"), "{stdout}");
    assert!(
        stdout.contains("\"Qwen3Moe\"") && stdout.contains("\"num_experts\":8"),
        "{stdout}"
    );
    assert!(stdout.contains("model.layers.1.mlp.experts.7.down_proj.weight"));

    let out = quire(
        &[
            "generate",
            "-m",
            folder_arg,
            "--prompt",
            "The quick brown fox",
            "--max-tokens",
            "8",
            "--json",
        ],
        None,
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let j: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    eprintln!("{j}");
    assert_eq!(j["completion_tokens"].as_array().unwrap().len(), 8, "{j}");
    let _ = std::fs::remove_dir_all(&dir);
}

/// llama.cpp: PPL = 18.3914 over 14 chunks of 512 on GPL-3 (see tests/data/REFERENCE.md).
#[test]
fn perplexity_matches_llama_cpp_within_one_percent() {
    let gpl = "/usr/share/common-licenses/GPL-3";
    assert!(
        Path::new(gpl).exists(),
        "{gpl} is missing (Debian's base-files ships it)"
    );
    let out = quire(
        &["perplexity", "--file", gpl, "--ctx", "512", "--json"],
        Some(&model()),
    );
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let stdout = String::from_utf8(out.stdout).unwrap();
    let j: serde_json::Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    let ppl = j["ppl"].as_f64().unwrap();
    assert_eq!(j["chunks"], 14);
    let rel = (ppl - 18.3914).abs() / 18.3914;
    eprintln!(
        "quire ppl {ppl:.4} vs llama.cpp 18.3914: {:.3}% apart",
        rel * 100.0
    );
    assert!(
        rel < 0.01,
        "ppl {ppl} is {:.2}% from llama.cpp's 18.3914",
        rel * 100.0
    );
}
