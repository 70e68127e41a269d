//! `quire serve-bench` against a mock OpenAI-compatible streaming server (std threads, HTTP/1.1
//! keep-alive, chunked SSE) that counts what it served and exposes the counts on /metrics.

use std::io::{BufRead, BufReader, Read, Write};
use std::net::{TcpListener, TcpStream};
use std::path::{Path, PathBuf};
use std::process::Command;
use std::sync::atomic::{AtomicU64, Ordering};
use std::sync::{Arc, Mutex};
use std::thread;
use std::time::{Duration, SystemTime, UNIX_EPOCH};

use serde_json::Value;

#[derive(Default)]
struct Counts {
    requests: AtomicU64,
    generation_tokens: AtomicU64,
    prompt_tokens: AtomicU64,
    /// Completions received (every 10th has one slow "step" of 40 ms in its stream).
    received: AtomicU64,
    steps: AtomicU64,
    /// Where to log each emitted chunk as a server step (as `quire serve --step-log`).
    step_log: Option<Mutex<std::fs::File>>,
}

#[derive(Clone, Copy, PartialEq)]
enum Mode {
    Ok,
    /// Every completion answers HTTP 500.
    Fail,
}

struct Mock {
    port: u16,
    counts: Arc<Counts>,
}

fn start_mock(mode: Mode, step_log: Option<&Path>) -> Mock {
    let listener = TcpListener::bind("127.0.0.1:0").unwrap();
    let port = listener.local_addr().unwrap().port();
    let counts = Arc::new(Counts {
        step_log: step_log.map(|p| Mutex::new(std::fs::File::create(p).unwrap())),
        ..Counts::default()
    });
    let c = counts.clone();
    thread::spawn(move || {
        for stream in listener.incoming() {
            let Ok(stream) = stream else { continue };
            let c = c.clone();
            thread::spawn(move || {
                let _ = serve_connection(stream, &c, mode);
            });
        }
    });
    Mock { port, counts }
}

/// Reads requests off one keep-alive connection until the client closes it.
fn serve_connection(stream: TcpStream, c: &Counts, mode: Mode) -> std::io::Result<()> {
    stream.set_nodelay(true)?;
    let mut reader = BufReader::new(stream.try_clone()?);
    let mut out = stream;
    loop {
        let mut request_line = String::new();
        if reader.read_line(&mut request_line)? == 0 {
            return Ok(());
        }
        let mut content_length = 0usize;
        loop {
            let mut h = String::new();
            reader.read_line(&mut h)?;
            let h = h.trim_end();
            if h.is_empty() {
                break;
            }
            if let Some((k, v)) = h.split_once(':') {
                if k.eq_ignore_ascii_case("content-length") {
                    content_length = v.trim().parse().unwrap_or(0);
                }
            }
        }
        let mut body = vec![0u8; content_length];
        reader.read_exact(&mut body)?;
        let mut parts = request_line.split_whitespace();
        let (method, path) = (parts.next().unwrap_or(""), parts.next().unwrap_or(""));
        match (method, path) {
            ("GET", "/v1/models") => respond(
                &mut out,
                200,
                "application/json",
                r#"{"object":"list","data":[{"id":"mock-model","object":"model"}]}"#,
            )?,
            ("GET", "/metrics") => {
                let text = format!(
                    "# HELP quire_requests_total Finished requests.\n\
                     # TYPE quire_requests_total counter\n\
                     quire_requests_total{{finish_reason=\"stop\"}} 0\n\
                     quire_requests_total{{finish_reason=\"length\"}} {}\n\
                     quire_requests_total{{finish_reason=\"abort\"}} 0\n\
                     # TYPE quire_generation_tokens_total counter\n\
                     quire_generation_tokens_total {}\n\
                     quire_prompt_tokens_total {}\n",
                    c.requests.load(Ordering::SeqCst),
                    c.generation_tokens.load(Ordering::SeqCst),
                    c.prompt_tokens.load(Ordering::SeqCst),
                );
                respond(&mut out, 200, "text/plain; version=0.0.4", &text)?
            }
            ("POST", "/v1/completions") if mode == Mode::Fail => respond(
                &mut out,
                500,
                "application/json",
                r#"{"error":{"message":"mock failure"}}"#,
            )?,
            ("POST", "/v1/completions") => stream_completion(&mut out, &body, c)?,
            _ => respond(&mut out, 404, "text/plain", "not found")?,
        }
    }
}

fn respond(out: &mut TcpStream, status: u16, ctype: &str, body: &str) -> std::io::Result<()> {
    write!(
        out,
        "HTTP/1.1 {status} X\r\ncontent-type: {ctype}\r\ncontent-length: {}\r\n\r\n{body}",
        body.len()
    )?;
    out.flush()
}

fn chunk(out: &mut TcpStream, data: &str) -> std::io::Result<()> {
    write!(out, "{:x}\r\n{data}\r\n", data.len())?;
    out.flush()
}

fn unix_now() -> f64 {
    SystemTime::now()
        .duration_since(UNIX_EPOCH)
        .unwrap()
        .as_secs_f64()
}

/// `max_tokens` text chunks 3 ms apart (40 ms before the fourth chunk of every 10th request),
/// then a usage chunk and [DONE] (chunked encoding).
fn stream_completion(out: &mut TcpStream, body: &[u8], c: &Counts) -> std::io::Result<()> {
    let req: Value = serde_json::from_slice(body).unwrap_or(Value::Null);
    assert_eq!(req["stream"], true, "serve-bench streams");
    assert_eq!(req["stream_options"]["include_usage"], true);
    assert_eq!(req["ignore_eos"], true);
    assert_eq!(req["model"], "mock-model");
    let n = req["max_tokens"].as_u64().unwrap_or(1);
    let prompt = req["prompt"]
        .as_str()
        .unwrap_or("")
        .split_whitespace()
        .count() as u64;
    write!(
        out,
        "HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\ntransfer-encoding: chunked\r\n\r\n"
    )?;
    let slow = c.received.fetch_add(1, Ordering::SeqCst) % 10 == 9;
    for i in 0..n {
        let start = unix_now();
        let spike = slow && i == 3;
        thread::sleep(Duration::from_millis(if spike { 40 } else { 3 }));
        if let Some(log) = &c.step_log {
            let line = format!(
                "{{\"step\":{},\"start\":{start},\"end\":{},\"prompt_tokens\":{},\"decode_tokens\":1,\"preemptions\":0,\"running\":2}}\n",
                c.steps.fetch_add(1, Ordering::SeqCst),
                unix_now(),
                if spike { 999 } else { 0 }
            );
            log.lock().unwrap().write_all(line.as_bytes())?;
        }
        let ev = format!(
            "data: {{\"id\":\"c\",\"object\":\"text_completion\",\"choices\":[{{\"index\":0,\"text\":\" w{i}\",\"finish_reason\":null}}]}}\n\n"
        );
        chunk(out, &ev)?;
    }
    // Counted before the last chunk goes out, as a real server finishes the request first.
    c.requests.fetch_add(1, Ordering::SeqCst);
    c.generation_tokens.fetch_add(n, Ordering::SeqCst);
    c.prompt_tokens.fetch_add(prompt, Ordering::SeqCst);
    let usage = format!(
        "data: {{\"id\":\"c\",\"choices\":[],\"usage\":{{\"prompt_tokens\":{prompt},\"completion_tokens\":{n},\"total_tokens\":{}}}}}\n\ndata: [DONE]\n\n",
        prompt + n
    );
    chunk(out, &usage)?;
    write!(out, "0\r\n\r\n")?;
    out.flush()
}

fn tmp_dir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("quire-serve-bench-{name}-{}", std::process::id()));
    std::fs::create_dir_all(&d).unwrap();
    d
}

fn quire() -> Command {
    Command::new(env!("CARGO_BIN_EXE_quire"))
}

#[test]
fn runs_against_a_mock_server() {
    let dir = tmp_dir("ok");
    let (json_path, svg_path) = (dir.join("out.json"), dir.join("out.svg"));
    let step_log = dir.join("steps.jsonl");
    let mock = start_mock(Mode::Ok, Some(&step_log));
    let out = quire()
        .args(["serve-bench", "--url"])
        .arg(format!("http://127.0.0.1:{}", mock.port))
        .args([
            "--duration",
            "4",
            "--ramp",
            "1",
            "--rate",
            "10",
            "--input-len",
            "16",
            "--output-len",
            "8",
            "--slo-ttft-ms",
            "5000",
            "--save-requests",
            "--json",
        ])
        .arg(&json_path)
        .arg("--svg")
        .arg(&svg_path)
        .arg("--step-log")
        .arg(&step_log)
        .output()
        .unwrap();
    let stdout = String::from_utf8_lossy(&out.stdout);
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        out.status.success(),
        "exit {:?}\nstdout:\n{stdout}\nstderr:\n{stderr}",
        out.status
    );

    eprintln!("{stdout}");
    let j: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    let served = mock.counts.requests.load(Ordering::SeqCst);
    let completed = j["completed"].as_u64().unwrap();
    assert!(completed >= 15, "about 35 expected, got {completed}");
    assert_eq!(completed, served, "completed = what the mock served");
    assert_eq!(j["failed"], 0);
    assert_eq!(j["num_prompts"].as_u64(), Some(completed));
    assert_eq!(j["total_output_tokens"].as_u64(), Some(8 * completed));
    assert_eq!(j["output_tokens_from_usage"].as_u64(), Some(completed));
    assert_eq!(j["model_id"], "mock-model");
    assert_eq!(j["total_input_tokens"].as_u64(), Some(16 * completed));

    // Phases partition the requests.
    let mut sum = 0;
    for p in ["ramp", "steady", "tail"] {
        let ph = &j["phases"][p];
        assert!(ph.is_object(), "phase {p} missing");
        assert!(ph.get("mean_ttft_ms").is_some() && ph.get("request_throughput").is_some());
        sum += ph["completed"].as_u64().unwrap();
    }
    assert_eq!(sum, completed);
    assert!(j["phases"]["steady"]["completed"].as_u64().unwrap() > 0);

    // Metrics cross-check.
    let sm = &j["server_metrics"];
    assert_eq!(sm["available"], true, "{sm}");
    assert_eq!(sm["agrees"], true, "{sm}");
    assert_eq!(sm["requests_delta"].as_f64(), Some(served as f64));
    assert_eq!(sm["prompt_tokens_agree"], true, "{sm}");

    // Latencies: present and ordered.
    for m in ["ttft", "tpot", "itl", "e2el"] {
        let p50 = j[format!("p50_{m}_ms")].as_f64().unwrap();
        let p90 = j[format!("p90_{m}_ms")].as_f64().unwrap();
        let p99 = j[format!("p99_{m}_ms")].as_f64().unwrap();
        let mean = j[format!("mean_{m}_ms")].as_f64().unwrap();
        assert!(p50 <= p90 && p90 <= p99, "{m}: {p50} {p90} {p99}");
        assert!(mean > 0.0 && j[format!("median_{m}_ms")].as_f64() == Some(p50));
        assert_eq!(
            j[format!("percentiles_{m}_ms")].as_array().unwrap().len(),
            4
        );
    }
    // 3 ms between chunks: ITL median of a few ms, e2e above 7 gaps.
    assert!(j["median_itl_ms"].as_f64().unwrap() >= 2.0);
    assert!(j["median_e2el_ms"].as_f64().unwrap() >= 20.0);
    assert_eq!(
        j["request_goodput"].as_f64(),
        j["request_throughput"].as_f64()
    );
    // The 40 ms gaps are spikes, attributed to the mock's 40 ms steps (prompt_tokens 999).
    let sp = &j["itl_spikes"];
    assert!(sp["median_itl_ms"].as_f64().unwrap() < 10.0, "{sp}");
    assert!(
        sp["steps_in_log"].as_u64().unwrap() >= 7 * completed,
        "{sp}"
    );
    let spikes = sp["spikes"].as_array().unwrap();
    // Every 10th request had one: at least one such gap, attributed to its 40 ms step (a gap
    // from scheduling noise may overlap a slow step too, so no exact count).
    let slow: Vec<&Value> = spikes
        .iter()
        .filter(|s| s["step"]["prompt_tokens"] == 999)
        .collect();
    assert!(!slow.is_empty(), "{sp}");
    assert!(
        slow.iter().any(|s| s["gap_ms"].as_f64().unwrap() >= 35.0
            && s["step"]["duration_ms"].as_f64().unwrap() >= 39.0
            && s["step"]["raw"]["running"] == 2),
        "{sp}"
    );
    assert_eq!(j["requests"].as_array().unwrap().len() as u64, completed);
    assert_eq!(j["requests"][0]["itl_ms"].as_array().unwrap().len(), 7);
    assert!(j["stamp"]["commit"].is_string());
    assert_eq!(j["settings"]["rate"], 10.0);

    let svg = std::fs::read_to_string(&svg_path).unwrap();
    assert!(svg.contains("<svg") && svg.trim_end().ends_with("</svg>"));
    assert!(svg.contains("steady") && svg.contains("<circle"));

    // The markdown table: header, rule, three phases, overall.
    assert!(stdout.contains("| phase | requests |"), "{stdout}");
    for row in ["| ramp (", "| steady (", "| tail (", "| **overall** |"] {
        assert!(stdout.contains(row), "no row {row}:\n{stdout}");
    }
    assert!(stdout.contains("**agrees**"), "{stdout}");
    assert!(
        stdout.contains("| t (s) | request | gap (ms) | step |"),
        "{stdout}"
    );
    assert!(stdout.contains("| 999 | 1 | 0 | 2 |"), "{stdout}");
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn closed_loop_with_concurrency_cap() {
    let mock = start_mock(Mode::Ok, None);
    let dir = tmp_dir("closed");
    let json_path = dir.join("out.json");
    let out = quire()
        .args(["serve-bench", "--url"])
        .arg(format!("http://127.0.0.1:{}/", mock.port))
        .args([
            "--concurrency",
            "3",
            "--duration",
            "1.5",
            "--ramp",
            "0.5",
            "--input-len",
            "4",
            "--output-len",
            "4",
            "--range-ratio",
            "0.5",
            "--json",
        ])
        .arg(&json_path)
        .output()
        .unwrap();
    assert!(
        out.status.success(),
        "{}",
        String::from_utf8_lossy(&out.stderr)
    );
    let j: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(j["closed_loop"], true);
    assert_eq!(j["max_concurrency"], 3);
    assert!(j["request_rate"].is_null());
    let completed = j["completed"].as_u64().unwrap();
    // ~12 ms per request, 3 in flight, ~1.5 s: far more than an open loop at 4/s would send.
    assert!(completed > 30, "{completed}");
    assert_eq!(completed, mock.counts.requests.load(Ordering::SeqCst));
    assert_eq!(j["server_metrics"]["agrees"], true);
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn failing_server_reports_errors_and_exits_1() {
    let mock = start_mock(Mode::Fail, None);
    let dir = tmp_dir("fail");
    let json_path = dir.join("out.json");
    let out = quire()
        .args(["serve-bench", "--url"])
        .arg(format!("http://127.0.0.1:{}", mock.port))
        .args(["--duration", "1", "--ramp", "0", "--rate", "20", "--json"])
        .arg(&json_path)
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert!(
        stderr.contains("error: all") && stderr.contains("HTTP 500"),
        "{stderr}"
    );
    // The results are still written.
    let j: Value = serde_json::from_str(&std::fs::read_to_string(&json_path).unwrap()).unwrap();
    assert_eq!(j["completed"], 0);
    assert!(j["failed"].as_u64().unwrap() > 5);
    assert!(j["errors"][0].as_str().unwrap().contains("mock failure"));
    std::fs::remove_dir_all(&dir).ok();
}

#[test]
fn unreachable_server_is_one_error_line() {
    // A port that was just free: nothing listens there.
    let port = TcpListener::bind("127.0.0.1:0")
        .unwrap()
        .local_addr()
        .unwrap()
        .port();
    let url = format!("http://127.0.0.1:{port}");
    let out = quire()
        .args(["serve-bench", "--url", &url, "--duration", "2"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    let lines: Vec<&str> = stderr.lines().filter(|l| !l.trim().is_empty()).collect();
    assert_eq!(lines.len(), 1, "{stderr}");
    assert!(lines[0].starts_with("error: "), "{stderr}");
    assert!(lines[0].contains(&url), "{stderr}");
    assert!(out.stdout.is_empty());
}

#[test]
fn help_teaches() {
    let out = quire().args(["serve-bench", "--help"]).output().unwrap();
    assert!(out.status.success());
    let h = String::from_utf8_lossy(&out.stdout);
    for flag in [
        "--rate",
        "--burstiness",
        "--concurrency",
        "--ramp",
        "--duration",
        "--drain-timeout",
        "--request-timeout",
        "--input-len",
        "--output-len",
        "--range-ratio",
        "--dataset",
        "--slo-ttft-ms",
        "--spike-factor",
        "--step-log",
        "--json",
        "--svg",
        "requests/s",
        "Examples:",
    ] {
        assert!(h.contains(flag), "--help lacks {flag}");
    }
}

#[test]
fn bad_settings_are_one_error_line() {
    let out = quire()
        .args(["serve-bench", "--ramp", "100", "--duration", "10"])
        .output()
        .unwrap();
    assert_eq!(out.status.code(), Some(1));
    let stderr = String::from_utf8_lossy(&out.stderr);
    assert_eq!(stderr.lines().count(), 1, "{stderr}");
    assert!(stderr.starts_with("error: --ramp"), "{stderr}");
}
