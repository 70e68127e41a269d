//! The performance toolkit as a user runs it: `attn-bench` (small sizes) prints its parity line and
//! writes one CSV row per dispatch with the documented columns; `bench` on the default model
//! prints llama-bench-compatible JSON and CSV that parse back with the expected fields; `compare`
//! of a result with itself finds no significant difference.

use std::path::{Path, PathBuf};
use std::process::{Command, Output};

use serde_json::Value;

fn quire(args: &[&str], model: Option<&Path>) -> Output {
    let mut c = Command::new(env!("CARGO_BIN_EXE_quire"));
    c.args(args);
    if let Some(m) = model {
        c.env("QUIRE_MODEL", m);
    }
    let out = c.output().expect("run quire");
    assert!(
        out.status.success(),
        "quire {args:?} failed:\n{}",
        String::from_utf8_lossy(&out.stderr)
    );
    out
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("quire-toolkit-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// RFC 4180 records (quoted fields may hold commas, doubled quotes and line breaks).
fn parse_csv(text: &str) -> Vec<Vec<String>> {
    let mut rows = Vec::new();
    let mut row = Vec::new();
    let mut field = String::new();
    let mut quoted = false;
    let mut chars = text.chars().peekable();
    while let Some(c) = chars.next() {
        match (quoted, c) {
            (true, '"') if chars.peek() == Some(&'"') => {
                field.push('"');
                chars.next();
            }
            (true, '"') => quoted = false,
            (true, c) => field.push(c),
            (false, '"') => quoted = true,
            (false, ',') => row.push(std::mem::take(&mut field)),
            (false, '\n') => {
                row.push(std::mem::take(&mut field));
                rows.push(std::mem::take(&mut row));
            }
            (false, '\r') => {}
            (false, c) => field.push(c),
        }
    }
    if !field.is_empty() || !row.is_empty() {
        row.push(field);
        rows.push(row);
    }
    rows
}

#[test]
fn attn_bench_parity_and_csv() {
    let dir = tmpdir("attn");
    let csv = dir.join("attn.csv");
    let out = quire(
        &[
            "attn-bench",
            "--batch",
            "3",
            "--q-heads",
            "4",
            "--kv-heads",
            "2",
            "--head-dim",
            "32",
            "--block-size",
            "16",
            "--max-blocks",
            "8",
            "--active-blocks",
            "5",
            "--repeats",
            "12",
            "--dtype",
            "float16",
            "--threads",
            "2",
            "--csv",
            csv.to_str().unwrap(),
        ],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    let parity: Vec<&str> = stdout.lines().filter(|l| l.starts_with("parity")).collect();
    assert_eq!(parity.len(), 2, "{stdout}");
    assert!(
        parity
            .iter()
            .all(|l| l.contains("err") && l.ends_with("OK")),
        "{stdout}"
    );
    assert!(stdout.contains("steady median ms"), "{stdout}");

    let rows = parse_csv(&std::fs::read_to_string(&csv).unwrap());
    let want = [
        "tokens",
        "seq_len",
        "heads",
        "kv_heads",
        "head_dim",
        "block_size",
        "threads",
        "kernel",
        "time_ms",
        "bytes",
        "gbps",
        "flops",
        "intensity",
    ];
    assert_eq!(rows[0], want);
    assert_eq!(rows.len(), 1 + 2 * 12);
    let col = |name: &str| want.iter().position(|w| *w == name).unwrap();
    for r in &rows[1..] {
        assert_eq!(r.len(), want.len());
        assert_eq!(r[col("tokens")], "3");
        assert_eq!(r[col("seq_len")], "80");
        assert_eq!(
            (r[col("heads")].as_str(), r[col("kv_heads")].as_str()),
            ("4", "2")
        );
        assert!(["paged", "dense"].contains(&r[col("kernel")].as_str()));
        let ms: f64 = r[col("time_ms")].parse().unwrap();
        let bytes: f64 = r[col("bytes")].parse().unwrap();
        let gbps: f64 = r[col("gbps")].parse().unwrap();
        let flops: f64 = r[col("flops")].parse().unwrap();
        let intensity: f64 = r[col("intensity")].parse().unwrap();
        assert!(ms > 0.0 && bytes > 0.0 && flops > 0.0);
        assert!(
            (gbps - bytes / (ms * 1e6)).abs() <= 1e-3 * gbps.max(1.0),
            "{r:?}"
        );
        assert!((intensity - flops / bytes).abs() < 1e-3);
    }
    let meta: Value =
        serde_json::from_str(&std::fs::read_to_string(dir.join("attn.meta.json")).unwrap())
            .unwrap();
    assert_eq!(meta["settings"]["active_blocks"], 5);
    assert!(meta["stamp"]["commit"].is_string());

    // Prefill chunks and bf16 storage run and pass parity too.
    let out = quire(
        &[
            "attn-bench",
            "--batch",
            "2",
            "--q-heads",
            "6",
            "--kv-heads",
            "2",
            "--head-dim",
            "16",
            "--block-size",
            "8",
            "--max-blocks",
            "6",
            "--active-blocks",
            "4",
            "--repeats",
            "3",
            "--dtype",
            "bfloat16",
            "--mode",
            "prefill",
            "--query-len",
            "5",
        ],
        None,
    );
    let stdout = String::from_utf8_lossy(&out.stdout);
    assert_eq!(
        stdout
            .lines()
            .filter(|l| l.starts_with("parity") && l.ends_with("OK"))
            .count(),
        2
    );
    std::fs::remove_dir_all(dir).ok();
}

fn model() -> PathBuf {
    quire_core::default_model::model_for_tests()
}

#[test]
fn bench_json_and_csv_parse_with_llama_bench_fields() {
    let m = model();
    let out = quire(
        &["bench", "-p", "16", "-n", "4", "-r", "2", "-o", "json"],
        Some(&m),
    );
    let recs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("bench -o json is JSON");
    assert_eq!(recs.len(), 2);
    let names: Vec<&str> = recs.iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(names, ["pp16", "tg4"]);
    for r in &recs {
        for k in [
            "model_filename",
            "model_type",
            "backends",
            "build_commit",
            "test_time",
            "device",
            "driver",
        ] {
            assert!(r[k].is_string(), "{k} in {r}");
        }
        for k in [
            "model_size",
            "model_n_params",
            "n_prompt",
            "n_gen",
            "n_depth",
            "n_threads",
            "avg_ns",
            "stddev_ns",
        ] {
            assert!(r[k].is_u64(), "{k} in {r}");
        }
        for k in ["avg_ts", "stddev_ts", "gbps", "tflops", "pct_of_ceiling"] {
            assert!(
                r[k].as_f64().is_some_and(|x| x.is_finite() && x >= 0.0),
                "{k} in {r}"
            );
        }
        let ts: Vec<f64> = r["samples_ts"]
            .as_array()
            .unwrap()
            .iter()
            .map(|x| x.as_f64().unwrap())
            .collect();
        assert_eq!(ts.len(), 2);
        assert_eq!(r["samples_ns"].as_array().unwrap().len(), 2);
        let mean = ts.iter().sum::<f64>() / 2.0;
        assert!((r["avg_ts"].as_f64().unwrap() - mean).abs() < 1e-9 * mean);
        assert!(r["avg_ts"].as_f64().unwrap() > 0.0);
        assert_eq!(r["n_depth"], 0);
        assert!(r["model_filename"].as_str().unwrap().ends_with(".gguf"));
    }
    assert_eq!(
        (recs[0]["n_prompt"].as_u64(), recs[0]["n_gen"].as_u64()),
        (Some(16), Some(0))
    );
    assert_eq!(
        (recs[1]["n_prompt"].as_u64(), recs[1]["n_gen"].as_u64()),
        (Some(0), Some(4))
    );

    // compare of a result with itself: ratio 1, not significant.
    let dir = tmpdir("bench");
    let a = dir.join("a.json");
    std::fs::write(&a, &out.stdout).unwrap();
    let cmp = quire(&["compare", a.to_str().unwrap(), a.to_str().unwrap()], None);
    let text = String::from_utf8_lossy(&cmp.stdout);
    let rows: Vec<&str> = text
        .lines()
        .filter(|l| l.contains("| pp16") || l.contains("| tg4"))
        .collect();
    assert_eq!(rows.len(), 2, "{text}");
    assert!(
        rows.iter()
            .all(|l| l.contains("1.000") && l.contains("| no")),
        "{text}"
    );

    let out = quire(
        &["bench", "-p", "16", "-n", "4", "-r", "2", "-o", "csv"],
        Some(&m),
    );
    let rows = parse_csv(&String::from_utf8(out.stdout).unwrap());
    assert_eq!(rows.len(), 3, "{rows:?}");
    let head = &rows[0];
    let col = |name: &str| {
        head.iter()
            .position(|h| h == name)
            .unwrap_or_else(|| panic!("no {name}"))
    };
    for r in &rows[1..] {
        assert_eq!(r.len(), head.len());
        assert!(r[col("avg_ts")].parse::<f64>().unwrap() > 0.0);
        assert!(r[col("model_size")].parse::<u64>().unwrap() > 0);
        let samples: Vec<f64> = serde_json::from_str(&r[col("samples_ts")]).unwrap();
        assert_eq!(samples.len(), 2);
    }
    assert_eq!(rows[1][col("test")], "pp16");
    assert_eq!(rows[2][col("n_gen")], "4");
    std::fs::remove_dir_all(dir).ok();
}

#[test]
fn bench_batched_decode_and_pg() {
    let m = model();
    let out = quire(
        &[
            "bench", "-p", "0", "-n", "2", "-b", "1,3", "-pg", "8,2", "-r", "1", "-o", "jsonl",
        ],
        Some(&m),
    );
    let recs: Vec<Value> = String::from_utf8(out.stdout)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    let names: Vec<&str> = recs.iter().map(|r| r["test"].as_str().unwrap()).collect();
    assert_eq!(names, ["tg2", "pp8+tg2", "tg2 x1", "tg2 x3"]);
    let x3 = &recs[3];
    assert_eq!(x3["n_seqs"], 3);
    let (all, per) = (
        x3["avg_ts"].as_f64().unwrap(),
        x3["per_seq_ts"].as_f64().unwrap(),
    );
    assert!((all / 3.0 - per).abs() < 1e-9 * all);
}

/// `git` in `dir`, or `None` where git is missing or fails.
fn git(dir: &Path, args: &[&str]) -> Option<String> {
    let out = Command::new("git")
        .arg("-C")
        .arg(dir)
        .args(args)
        .output()
        .ok()?;
    out.status
        .success()
        .then(|| String::from_utf8_lossy(&out.stdout).trim().to_string())
}

/// A new user's run: `bench -d CTX` on a model whose trained context is CTX runs (the cache is
/// sized for depth + test; a warning says it went past the context), started from inside another
/// git checkout. Its JSON names the commit quire was built from (not that checkout's), the load
/// time, the peak memory and the `QUIRE_*` settings of the run; `generate --json` carries the
/// load time and peaks too.
#[test]
fn bench_at_full_context_stamps_the_build() {
    let dir = tmpdir("ctx");
    let m = dir.join("tiny.gguf");
    let ms = m.to_str().unwrap();
    quire(
        &[
            "make-model",
            "--preset",
            "smollm2-135m",
            "--dtype",
            "q8_0",
            "--layers",
            "2",
            "--ctx",
            "64",
            ms,
        ],
        None,
    );
    // Another checkout with a commit of its own, as the working directory.
    let other = dir.join("other");
    std::fs::create_dir_all(&other).unwrap();
    let other_commit = git(&other, &["init", "-q"]).and_then(|_| {
        git(
            &other,
            &[
                "-c",
                "user.name=t",
                "-c",
                "user.email=t@t",
                "commit",
                "-q",
                "--allow-empty",
                "-m",
                "other",
            ],
        )?;
        git(&other, &["rev-parse", "--short", "HEAD"])
    });
    let out = Command::new(env!("CARGO_BIN_EXE_quire"))
        .args([
            "bench", "-m", ms, "-p", "0", "-n", "4", "-d", "64", "-r", "1", "-o", "json",
        ])
        .current_dir(&other)
        .env_remove("QUIRE_COMMIT")
        .env("QUIRE_TEST_SETTING", "on")
        .output()
        .unwrap();
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "bench -d 64 failed:\n{stderr}");
    assert!(
        stderr.contains("tg4 @ d64 reaches 68 tokens, past the model's trained context of 64"),
        "{stderr}"
    );
    let recs: Vec<Value> = serde_json::from_slice(&out.stdout).expect("bench -o json is JSON");
    assert_eq!(recs.len(), 1);
    let r = &recs[0];
    assert_eq!(r["test"], "tg4 @ d64");
    assert_eq!(r["n_depth"], 64);

    let commit = r["build_commit"].as_str().unwrap();
    match git(
        Path::new(env!("CARGO_MANIFEST_DIR")),
        &["rev-parse", "--short", "HEAD"],
    ) {
        Some(head) => assert!(
            commit == head || commit == format!("{head}-dirty"),
            "stamped {commit}, built at {head}"
        ),
        None => assert_eq!(commit, "unknown"),
    }
    if let Some(o) = other_commit {
        assert!(
            !commit.starts_with(&o),
            "stamped the working directory's commit {o}"
        );
    }
    assert!(r["load_ms"].as_f64().is_some_and(|x| x > 0.0), "{r}");
    #[cfg(target_os = "linux")]
    assert!(
        r["peak_rss_bytes"].as_u64().is_some_and(|b| b > 1 << 20),
        "{r}"
    );
    assert!(
        r["peak_gpu_bytes"].is_null(),
        "the CPU has no device memory: {r}"
    );
    assert!(
        r["quire_env"]
            .as_str()
            .unwrap()
            .split(' ')
            .any(|kv| kv == "QUIRE_TEST_SETTING=on"),
        "{r}"
    );

    let out = quire(
        &[
            "generate",
            "-m",
            ms,
            "--prompt",
            "a b c",
            "--max-tokens",
            "2",
            "--json",
        ],
        None,
    );
    let j: Value = serde_json::from_slice(&out.stdout).expect("generate --json is JSON");
    assert!(j["load_ms"].as_f64().is_some_and(|x| x > 0.0), "{j}");
    #[cfg(target_os = "linux")]
    assert!(
        j["peak_rss_bytes"].as_u64().is_some_and(|b| b > 1 << 20),
        "{j}"
    );
    assert!(j["peak_gpu_bytes"].is_null(), "{j}");
    std::fs::remove_dir_all(dir).ok();
}
