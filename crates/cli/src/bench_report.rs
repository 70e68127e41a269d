//! `quire bench`'s markdown output: llama-bench's table of results (one row per test, batched
//! rows with their per-sequence rate and speed-up), then quire's own columns (bandwidth, share of
//! the measured ceiling) and the load time and memory of each model. Split from bench.rs, which
//! runs the tests and builds the records this formats.

use quire_perf::{mem, RunStamp, Table};
use serde_json::{Map, Value};

pub(crate) fn fmt_size(bytes: u64) -> String {
    if bytes < 1 << 30 {
        format!("{:.2} MiB", bytes as f64 / (1u64 << 20) as f64)
    } else {
        format!("{:.2} GiB", bytes as f64 / (1u64 << 30) as f64)
    }
}

pub(crate) fn fmt_params(n: u64) -> String {
    if n < 1_000_000_000 {
        format!("{:.2} M", n as f64 / 1e6)
    } else {
        format!("{:.2} B", n as f64 / 1e9)
    }
}

fn s(r: &Map<String, Value>, k: &str) -> String {
    match r.get(k) {
        Some(Value::String(x)) => x.clone(),
        Some(v) => v.to_string(),
        None => String::new(),
    }
}

fn f(r: &Map<String, Value>, k: &str) -> f64 {
    r.get(k).and_then(Value::as_f64).unwrap_or(f64::NAN)
}

/// llama-bench's markdown table with quire's columns after `t/s`, then the batch-scaling table.
pub(crate) fn markdown(
    records: &[Map<String, Value>],
    stamp: &RunStamp,
    ceil_lines: &[String],
) -> String {
    let mut t = Table::new(
        &[
            "model",
            "size",
            "params",
            "backend",
            "threads",
            "test",
            "t/s",
            "GB/s",
            "TFLOP/s",
            "% of ceiling",
        ],
        &[
            "size",
            "params",
            "threads",
            "test",
            "t/s",
            "GB/s",
            "TFLOP/s",
            "% of ceiling",
        ],
    );
    let mut b = Table::new(
        &[
            "model",
            "threads",
            "test",
            "B",
            "t/s (all seqs)",
            "t/s per seq",
            "speedup vs B=1",
            "GB/s",
        ],
        &[
            "threads",
            "B",
            "t/s (all seqs)",
            "t/s per seq",
            "speedup vs B=1",
            "GB/s",
        ],
    );
    for r in records {
        let ts = format!("{:.2} ± {:.2}", f(r, "avg_ts"), f(r, "stddev_ts"));
        if r.get("test")
            .and_then(Value::as_str)
            .is_some_and(|n| n.contains(" x"))
        {
            let base = records.iter().find(|o| {
                o.get("n_seqs").and_then(Value::as_u64) == Some(1)
                    && s(o, "test").contains(" x")
                    && ["model_filename", "n_threads", "n_gen", "n_depth"]
                        .iter()
                        .all(|k| o.get(*k) == r.get(*k))
            });
            b.push(vec![
                s(r, "model_type"),
                s(r, "n_threads"),
                s(r, "test"),
                s(r, "n_seqs"),
                ts,
                format!("{:.2}", f(r, "per_seq_ts")),
                base.map_or("-".into(), |o| {
                    format!("{:.2}×", f(r, "avg_ts") / f(o, "avg_ts"))
                }),
                format!("{:.1}", f(r, "gbps")),
            ]);
            continue;
        }
        let size = r.get("model_size").and_then(Value::as_u64).unwrap_or(0);
        let params = r.get("model_n_params").and_then(Value::as_u64).unwrap_or(0);
        t.push(vec![
            s(r, "model_type"),
            fmt_size(size),
            fmt_params(params),
            s(r, "backends"),
            s(r, "n_threads"),
            s(r, "test"),
            ts,
            format!("{:.1}", f(r, "gbps")),
            format!("{:.3}", f(r, "tflops")),
            format!(
                "{:.1}% {}",
                f(r, "pct_of_ceiling"),
                s(r, "ceiling").split(' ').next().unwrap_or("")
            ),
        ]);
    }
    let mut tables = String::new();
    if !t.rows.is_empty() {
        tables += &t.markdown();
    }
    if !b.rows.is_empty() {
        tables += "\nbatched decode (B sequences, one forward per step):\n\n";
        tables += &b.markdown();
    }
    // One line per model from its last record, which has the highest peaks.
    let mut models: Vec<String> = Vec::new();
    let mut mem_lines = Vec::new();
    for r in records.iter().rev() {
        let name = s(r, "model_filename");
        if models.contains(&name) {
            continue;
        }
        let bytes = |k| r.get(k).and_then(Value::as_u64);
        mem_lines.push(format!(
            "{}: loaded in {:.0} ms, peak host RSS {}, peak GPU memory {}",
            s(r, "model_type"),
            f(r, "load_ms"),
            mem::fmt_mib(bytes("peak_rss_bytes")),
            mem::fmt_mib(bytes("peak_gpu_bytes")),
        ));
        models.push(name);
    }
    let mut out = tables + "\n";
    for l in mem_lines.iter().rev() {
        out += &format!("{l}\n");
    }
    out += &format!("build: {} (quire {})\n", stamp.commit, stamp.quire_version);
    if let Some(m) = records
        .iter()
        .find_map(|r| r.get("cpu_math").and_then(Value::as_str))
    {
        out += &format!("CPU arithmetic: {m} (--cpu-math)\n");
    }
    out += &format!("{}\n", stamp.line());
    for l in ceil_lines {
        out += &format!("{l}\n");
    }
    out
}
