//! `quire make-model` as a user runs it: a 2-layer SmolLM2-135M in each weight type loads in quire
//! with the preset's shapes and metadata, its weights have the intended scale, and generation and
//! perplexity give finite results; an existing file is refused without --force; unknown presets
//! are listed by clap; a full disk is one error line naming the path; --help shows the sizes.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use quire_gguf::{dequantize_row, GgmlType, GgufFile};
use serde_json::Value;

fn quire(args: &[&str]) -> Output {
    Command::new(env!("CARGO_BIN_EXE_quire"))
        .args(args)
        .output()
        .expect("run quire")
}

fn ok(args: &[&str]) -> Output {
    let out = quire(args);
    assert!(
        out.status.success(),
        "quire {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("quire-make-model-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn s(p: &Path) -> &str {
    p.to_str().unwrap()
}

/// The root mean square of the first `n` values of a tensor, after checking they are all finite.
fn rms_of(f: &GgufFile, name: &str, n: usize) -> f32 {
    let t = f.tensor(name).unwrap();
    let bytes = f.tensor_data(t);
    let mut v = vec![0f32; n];
    let len = n / t.dtype.block_size() * t.dtype.type_size();
    dequantize_row(t.dtype, &bytes[..len], &mut v).unwrap();
    assert!(v.iter().all(|x| x.is_finite()), "{name}");
    (v.iter().map(|x| x * x).sum::<f32>() / n as f32).sqrt()
}

#[test]
fn smollm2_two_layers_in_every_dtype_loads_and_runs() {
    let dir = tmpdir("smol");
    let text = dir.join("text.txt");
    let words = "the quick brown fox jumps over the lazy dog and keeps running ";
    std::fs::write(&text, words.repeat(40)).unwrap();
    for (dtype, ggml) in [
        ("f16", GgmlType::F16),
        ("bf16", GgmlType::BF16),
        ("q8_0", GgmlType::Q8_0),
        ("q4_0", GgmlType::Q4_0),
    ] {
        let path = dir.join(format!("smol-{dtype}.gguf"));
        let out = ok(&[
            "make-model",
            "--preset",
            "smollm2-135m",
            "--dtype",
            dtype,
            "--layers",
            "2",
            s(&path),
        ]);
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(err.contains("wrote ") && err.contains(" GB in "), "{err}");

        // Header: the preset's hyper-parameters, as quire info reports them.
        let info: Value =
            serde_json::from_slice(&ok(&["info", "--json", "-m", s(&path)]).stdout).unwrap();
        let m = &info["metadata"];
        assert_eq!(m["general.architecture"], "llama");
        for (k, v) in [
            ("llama.block_count", 2),
            ("llama.embedding_length", 576),
            ("llama.feed_forward_length", 1536),
            ("llama.attention.head_count", 9),
            ("llama.attention.head_count_kv", 3),
            ("llama.context_length", 8192),
            ("tokenizer.ggml.bos_token_id", 49150),
            ("tokenizer.ggml.eos_token_id", 49151),
        ] {
            assert_eq!(m[k], v, "{k}");
        }
        assert_eq!(m["llama.rope.freq_base"], 100000.0);
        assert_eq!(m["tokenizer.ggml.model"], "gpt2");
        assert_eq!(m["tokenizer.ggml.tokens"]["len"], 49152);
        let tensors = info["tensors"].as_array().unwrap();
        // token_embd, 9 per layer, output_norm; tied, so no output.weight.
        assert_eq!(tensors.len(), 1 + 2 * 9 + 1);
        let find = |n: &str| tensors.iter().find(|t| t["name"] == n).unwrap();
        assert!(tensors.iter().all(|t| t["name"] != "output.weight"));
        assert_eq!(
            find("token_embd.weight")["dims"],
            serde_json::json!([576, 49152])
        );
        assert_eq!(
            find("blk.1.attn_k.weight")["dims"],
            serde_json::json!([576, 192])
        );
        assert_eq!(
            find("blk.1.ffn_down.weight")["dims"],
            serde_json::json!([1536, 576])
        );
        assert_eq!(find("blk.1.ffn_down.weight")["type"], ggml.name());
        assert_eq!(find("output_norm.weight")["type"], "F32");

        // Values: weights normal(0, 0.02), norms exactly 1.
        let f = GgufFile::open(&path).unwrap();
        for name in [
            "token_embd.weight",
            "blk.0.attn_q.weight",
            "blk.1.ffn_up.weight",
        ] {
            let rms = rms_of(&f, name, 4096);
            assert!((0.015..0.025).contains(&rms), "{dtype} {name}: rms {rms}");
        }
        assert_eq!(rms_of(&f, "blk.1.ffn_norm.weight", 576), 1.0);
        let q = f.tensor("blk.0.attn_q.weight").unwrap();
        assert_eq!(f.tensor_data(q).len() as u64, q.size_bytes());

        // quire generates from it, and every logit is finite (a NaN anywhere would make the
        // perplexity NaN or infinite).
        let gen = ok(&[
            "generate",
            "-m",
            s(&path),
            "--prompt",
            "hi there",
            "--max-tokens",
            "4",
            "--ignore-eos",
            "--json",
        ]);
        let stdout = String::from_utf8_lossy(&gen.stdout);
        let j: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
        let completion = j["completion_tokens"].as_array().unwrap();
        assert_eq!(completion.len(), 4, "{j}");
        assert!(completion.iter().all(|t| t.as_u64().unwrap() < 49152));
        let ppl = ok(&[
            "perplexity",
            "-m",
            s(&path),
            "-f",
            s(&text),
            "--ctx",
            "64",
            "--chunks",
            "2",
            "--json",
        ]);
        let p: Value = serde_json::from_slice(&ppl.stdout).unwrap();
        let ppl = p["ppl"].as_f64().unwrap();
        assert!(ppl.is_finite() && ppl > 1.0, "{dtype}: ppl {ppl}");
        std::fs::remove_file(&path).unwrap();
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn existing_files_are_refused_without_force() {
    let dir = tmpdir("force");
    let path = dir.join("m.gguf");
    std::fs::write(&path, b"keep me").unwrap();
    let args = [
        "make-model",
        "--preset",
        "smollm2-135m",
        "--dtype",
        "q4_0",
        "--layers",
        "1",
        s(&path),
    ];
    let out = quire(&args);
    assert_eq!(out.status.code(), Some(1));
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(
        err.contains("already exists") && err.contains("--force"),
        "{err}"
    );
    assert_eq!(err.lines().count(), 1, "{err}");
    assert_eq!(std::fs::read(&path).unwrap(), b"keep me");

    let mut forced = args.to_vec();
    forced.insert(1, "--force");
    ok(&forced);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_u32("llama.block_count").unwrap(), Some(1));
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn bad_arguments_and_write_errors_are_one_clear_line() {
    let dir = tmpdir("errors");
    let out = quire(&["make-model", "--preset", "gpt5", s(&dir.join("x.gguf"))]);
    assert_eq!(out.status.code(), Some(2));
    let err = String::from_utf8_lossy(&out.stderr);
    for p in ["llama3-8b", "llama3.2-1b", "smollm2-135m", "qwen3-8b"] {
        assert!(err.contains(p), "{err}");
    }
    let out = quire(&[
        "make-model",
        "--preset",
        "llama3-8b",
        "--dtype",
        "q5_k",
        "x.gguf",
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.contains("q8_0") && err.contains("bf16"), "{err}");

    // --help teaches: purpose, examples, sizes.
    let help = String::from_utf8(ok(&["make-model", "--help"]).stdout).unwrap();
    for needle in [
        "llama.cpp",
        "Examples:",
        "llama-bench -m",
        "16.06GB",
        "4.61GB",
    ] {
        assert!(help.contains(needle), "{needle} not in:\n{help}");
    }

    let missing = dir.join("no-such-dir").join("x.gguf");
    let out = quire(&["make-model", "--preset", "smollm2-135m", s(&missing)]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1));
    assert!(
        err.starts_with("error: ") && err.contains(s(&missing)),
        "{err}"
    );

    // A full disk: /dev/full fails every write with ENOSPC. Through a link, so that the test
    // can only ever remove its own link.
    #[cfg(target_os = "linux")]
    if Path::new("/dev/full").exists() {
        let link = dir.join("full.gguf");
        std::os::unix::fs::symlink("/dev/full", &link).unwrap();
        let out = quire(&[
            "make-model",
            "--force",
            "--preset",
            "smollm2-135m",
            "--layers",
            "1",
            s(&link),
        ]);
        assert_eq!(out.status.code(), Some(1));
        let err = String::from_utf8_lossy(&out.stderr);
        assert!(
            err.contains(s(&link)) && err.contains("No space left"),
            "{err}"
        );
        assert!(!err.contains("panicked"), "{err}");
        assert!(Path::new("/dev/full").exists());
        assert!(link.symlink_metadata().is_ok());
    }
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn qwen3_header_has_qk_norm_and_an_untied_output() {
    let dir = tmpdir("qwen3");
    let path = dir.join("q.gguf");
    ok(&[
        "make-model",
        "--preset",
        "qwen3-8b",
        "--dtype",
        "q4_0",
        "--layers",
        "1",
        s(&path),
    ]);
    let f = GgufFile::open(&path).unwrap();
    assert_eq!(f.get_str("general.architecture").unwrap(), Some("qwen3"));
    assert_eq!(f.get_u32("qwen3.attention.key_length").unwrap(), Some(128));
    assert_eq!(f.get_u32("qwen3.context_length").unwrap(), Some(40960));
    assert_eq!(f.tensor("blk.0.attn_k_norm.weight").unwrap().dims, [128]);
    assert_eq!(f.tensor("output.weight").unwrap().dims, [4096, 151936]);
    assert_eq!(
        f.tensor("blk.0.ffn_gate.weight").unwrap().dims,
        [4096, 12288]
    );
    drop(f);
    let gen = ok(&[
        "generate",
        "-m",
        s(&path),
        "--prompt",
        "hi",
        "--max-tokens",
        "2",
        "--ignore-eos",
        "--json",
        "--kv-cache-mb",
        "64",
    ]);
    let stdout = String::from_utf8_lossy(&gen.stdout);
    let j: Value = serde_json::from_str(stdout.lines().last().unwrap()).unwrap();
    assert_eq!(j["completion_tokens"].as_array().unwrap().len(), 2, "{j}");
    std::fs::remove_dir_all(&dir).unwrap();
}
