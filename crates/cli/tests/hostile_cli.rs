//! Hostile arguments and inputs to the `quire` binary: each ends in one `error:` line and exit 1
//! (never a panic, an abort or a hang), or, for a closed stdout pipe, a quiet exit.

use std::io::Read;
use std::path::PathBuf;
use std::process::{Command, Output, Stdio};
use std::time::{Duration, Instant};

fn model() -> PathBuf {
    quire_core::default_model::model_for_tests()
}

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("quire-hcli-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Runs quire, killing it (and failing the test) after 60 s.
fn quire(args: &[&str]) -> Output {
    let mut child = Command::new(env!("CARGO_BIN_EXE_quire"))
        .args(args)
        .env("QUIRE_MODEL", model())
        .stdin(Stdio::null())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .expect("run quire");
    let t0 = Instant::now();
    loop {
        if child.try_wait().unwrap().is_some() {
            return child.wait_with_output().unwrap();
        }
        if t0.elapsed() > Duration::from_secs(60) {
            let _ = child.kill();
            panic!("quire {args:?} hangs");
        }
        std::thread::sleep(Duration::from_millis(20));
    }
}

/// Exit 1 and exactly one `error:` line on stderr containing `want`.
fn one_error(args: &[&str], want: &str) {
    let out = quire(args);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{args:?}: {err}");
    assert!(!err.contains("panicked"), "{args:?}: {err}");
    let lines: Vec<&str> = err.lines().filter(|l| l.starts_with("error:")).collect();
    assert_eq!(lines.len(), 1, "{args:?}: {err}");
    assert!(lines[0].contains(want), "{args:?}: want {want:?} in {err}");
}

const GEN: [&str; 5] = ["generate", "--prompt", "hi", "--max-tokens", "1"];

#[test]
fn zero_max_model_len_is_an_error() {
    one_error(
        &[&GEN[..], &["--max-model-len", "0"]].concat(),
        "--max-model-len must be at least 1",
    );
}

#[test]
fn a_kv_cache_beyond_memory_says_what_fits() {
    for args in [
        &["--num-blocks", "100000000000"][..],
        &["--kv-cache-mb", "100000000"][..],
        &["--num-blocks", &usize::MAX.to_string()][..],
    ] {
        one_error(&[&GEN[..], args].concat(), "blocks fit (--num-blocks ");
    }
}

#[cfg(unix)]
#[test]
fn a_fifo_model_is_refused_not_opened() {
    let dir = tmpdir("fifo");
    let fifo = dir.join("model.gguf");
    let _ = std::fs::remove_file(&fifo);
    assert!(Command::new("mkfifo")
        .arg(&fifo)
        .status()
        .unwrap()
        .success());
    let f = fifo.to_str().unwrap();
    one_error(&["info", "-m", f], "not a regular file");
    one_error(&[&GEN[..], &["-m", f]].concat(), "FIFO");
    let _ = std::fs::remove_dir_all(dir);
}

/// A missing file's I/O error appears once, not once per layer of error wrapping.
#[test]
fn causes_are_not_repeated() {
    let out = quire(&["info", "-m", "/nonexistent/m.gguf"]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("No such file").count(), 1, "{err}");
    let out = quire(&[&GEN[..], &["-m", "/dev/null"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(err.matches("not a regular file").count(), 1, "{err}");
}

#[cfg(unix)]
#[test]
fn info_into_a_closed_pipe_ends_quietly() {
    let mut child = Command::new(env!("CARGO_BIN_EXE_quire"))
        .args(["info", "--full"])
        .env("QUIRE_MODEL", model())
        .stdout(Stdio::piped())
        .stderr(Stdio::piped())
        .spawn()
        .unwrap();
    // Read one byte, then close our end, as `head -c1` does.
    let mut stdout = child.stdout.take().unwrap();
    let mut b = [0u8; 1];
    stdout.read_exact(&mut b).unwrap();
    drop(stdout);
    let out = child.wait_with_output().unwrap();
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(err.is_empty(), "stderr: {err}");
    // Killed by SIGPIPE as `seq` would be (or done before the pipe closed): no panic, exit 101.
    use std::os::unix::process::ExitStatusExt;
    assert!(
        out.status.signal() == Some(libc_sigpipe()) || out.status.success(),
        "{:?}",
        out.status
    );
}

fn libc_sigpipe() -> i32 {
    13
}

#[test]
fn too_many_threads_are_capped_with_a_warning() {
    let out = quire(&[&GEN[..], &["--threads", "1000"]].concat());
    let err = String::from_utf8_lossy(&out.stderr);
    assert!(out.status.success(), "{err}");
    assert!(
        err.contains("warning: --threads 1000 is more than the"),
        "{err}"
    );
    // A usage error: clap's exit status 2.
    let out = quire(&[&GEN[..], &["--threads", "0"]].concat());
    assert_eq!(out.status.code(), Some(2));
    assert!(String::from_utf8_lossy(&out.stderr).contains("must be at least 1"));
}

#[test]
fn help_tells_the_truth_about_the_gpu() {
    let out = quire(&["--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("NVIDIA GPU"), "{help}");
    let out = quire(&["generate", "--help"]);
    let help = String::from_utf8_lossy(&out.stdout);
    assert!(help.contains("Q4_K/Q5_K/Q6_K"), "{help}");
    assert!(!help.contains("Other types are always f16"), "{help}");
}

/// A prompts file with bad lines: each gets an error line in the output (in input order), the
/// good ones run, and the exit status is 1.
#[test]
fn bad_prompts_file_lines_are_reported_per_line() {
    let dir = tmpdir("prompts");
    let input = dir.join("in.jsonl");
    let output = dir.join("out.jsonl");
    std::fs::write(
        &input,
        [
            r#"{"prompt": "The capital of France is", "max_tokens": 2}"#,
            r#"{"prompt": 7}"#,
            "not json",
            r#"{"prompt": "a", "messages": []}"#,
            r#"{"prompt": "Hello", "max_tokens": 2}"#,
        ]
        .join("\n"),
    )
    .unwrap();
    let out = quire(&[
        "generate",
        "--prompts-file",
        input.to_str().unwrap(),
        "--output",
        output.to_str().unwrap(),
    ]);
    let err = String::from_utf8_lossy(&out.stderr);
    assert_eq!(out.status.code(), Some(1), "{err}");
    assert!(err.contains("in.jsonl:2: bad request"), "{err}");
    assert!(err.contains("in.jsonl:3: bad request"), "{err}");
    assert!(err.contains("in.jsonl:4: give exactly one"), "{err}");
    assert!(err.contains("error: 3 of 5 requests"), "{err}");
    let lines: Vec<serde_json::Value> = std::fs::read_to_string(&output)
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect();
    assert_eq!(lines.len(), 5);
    for (i, l) in lines.iter().enumerate() {
        assert_eq!(l["index"], i, "{l}");
        assert_eq!(l.get("error").is_some(), (1..=3).contains(&i), "{l}");
    }
    assert_eq!(lines[0]["completion_tokens"].as_array().unwrap().len(), 2);
    assert_eq!(lines[4]["finish_reason"], "length");
    let _ = std::fs::remove_dir_all(dir);
}
