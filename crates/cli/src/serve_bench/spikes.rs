//! ITL spikes: gaps between content chunks above k × the median ITL, and their attribution to the
//! server step that overlapped them, from the server's step log.
//!
//! The step log is JSON Lines, one object per engine step. Times must be wall-clock (Unix epoch)
//! so they can be aligned with the client's clock (same machine, or NTP-synced ones):
//! - start: `start_unix_s` | `start_s` | `start` | `t_start` (seconds), `start_unix_ms` |
//!   `start_ms` (ms), `start_unix_us` | `start_us` (µs);
//! - end: the same names with `end`, else start + `duration_ms` | `dur_ms` | `elapsed_ms` |
//!   `duration_s` | `duration_us`;
//! - optional: `step` (else the line number), `prompt_tokens` (or `prefill_tokens`),
//!   `decode_tokens`, `preemptions` (this step's; else differences of `preemptions_total`).
//!
//! Every other field is kept and shown under `raw`.

use std::fmt::Write as _;
use std::path::Path;

use anyhow::{bail, Context, Result};
use serde_json::{json, Value};

use super::load::RequestRecord;

#[derive(Debug, Clone)]
pub struct Spike {
    /// The gap's end (the late chunk's arrival), seconds since the start.
    pub time_s: f64,
    /// The gap's start (the previous chunk).
    pub start_s: f64,
    pub request: usize,
    pub gap_ms: f64,
    /// Index into the step list of the attributed step, and how many steps overlapped the gap.
    pub step: Option<(usize, usize)>,
}

/// The gaps above `factor` × median ITL of successful requests. Returns the median, the
/// threshold and the spikes in time order (None when there are no ITLs or the median is 0).
pub fn find_spikes(records: &[RequestRecord], factor: f64) -> Option<(f64, f64, Vec<Spike>)> {
    let mut all: Vec<f64> = records
        .iter()
        .filter(|r| r.ok())
        .flat_map(|r| r.o.itl_ms.iter().copied())
        .collect();
    if all.is_empty() {
        return None;
    }
    all.sort_by(f64::total_cmp);
    let median = super::report::percentile(&all, 50.0);
    if median <= 0.0 {
        return None;
    }
    let threshold = factor * median;
    let mut spikes = Vec::new();
    for r in records.iter().filter(|r| r.ok()) {
        for (j, &gap) in r.o.itl_ms.iter().enumerate() {
            // itl_ms[j] is the gap between content chunks j and j + 1.
            if gap > threshold {
                let (start_s, time_s) = match (r.o.chunk_s.get(j), r.o.chunk_s.get(j + 1)) {
                    (Some(&a), Some(&b)) => (a, b),
                    _ => continue,
                };
                spikes.push(Spike {
                    time_s,
                    start_s,
                    request: r.index,
                    gap_ms: gap,
                    step: None,
                });
            }
        }
    }
    spikes.sort_by(|a, b| a.time_s.total_cmp(&b.time_s));
    Some((median, threshold, spikes))
}

/// One engine step from the server's log, times as Unix seconds.
#[derive(Debug, Clone)]
pub struct Step {
    pub index: u64,
    pub start_unix: f64,
    pub end_unix: f64,
    pub prompt_tokens: Option<u64>,
    pub decode_tokens: Option<u64>,
    pub preemptions: Option<u64>,
    pub raw: Value,
}

fn num(v: &Value, keys: &[&str]) -> Option<f64> {
    keys.iter().find_map(|k| v.get(*k).and_then(|x| x.as_f64()))
}

fn time(v: &Value, what: &str) -> Option<f64> {
    let k = |suffix: &str| {
        [
            format!("{what}_unix{suffix}"),
            format!("{what}{suffix}"),
            format!("t_{what}{suffix}"),
        ]
    };
    let find = |suffix: &str| {
        k(suffix)
            .iter()
            .find_map(|key| v.get(key.as_str()).and_then(|x| x.as_f64()))
    };
    find("_s")
        .or_else(|| find(""))
        .or_else(|| find("_ms").map(|x| x / 1e3))
        .or_else(|| find("_us").map(|x| x / 1e6))
}

/// Parses the step log (format in the module doc). Errors name the file and line.
pub fn load_step_log(path: &Path) -> Result<Vec<Step>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --step-log {}", path.display()))?;
    let mut steps = Vec::new();
    let mut last_total: Option<u64> = None;
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let at = || format!("{} line {}", path.display(), i + 1);
        let v: Value = serde_json::from_str(line).with_context(|| format!("{}: not JSON", at()))?;
        let Some(start) = time(&v, "start") else {
            bail!("{}: no start time (start_unix_s, start_ms, …)", at());
        };
        let end = time(&v, "end").or_else(|| {
            num(&v, &["duration_ms", "dur_ms", "elapsed_ms"])
                .map(|d| start + d / 1e3)
                .or_else(|| num(&v, &["duration_s"]).map(|d| start + d))
                .or_else(|| num(&v, &["duration_us"]).map(|d| start + d / 1e6))
        });
        let Some(end) = end else {
            bail!("{}: no end time or duration", at());
        };
        let u = |keys: &[&str]| num(&v, keys).map(|x| x as u64);
        let preemptions = u(&["preemptions"]).or_else(|| {
            let total = u(&["preemptions_total"])?;
            let d = total.saturating_sub(last_total.unwrap_or(total));
            last_total = Some(total);
            Some(d)
        });
        steps.push(Step {
            index: u(&["step"]).unwrap_or(i as u64),
            start_unix: start,
            end_unix: end.max(start),
            prompt_tokens: u(&["prompt_tokens", "prefill_tokens"]),
            decode_tokens: u(&["decode_tokens"]),
            preemptions,
            raw: v,
        });
    }
    steps.sort_by(|a, b| a.start_unix.total_cmp(&b.start_unix));
    Ok(steps)
}

/// Whether the log's times can be Unix times (after 2001); else they cannot be aligned.
pub fn looks_like_unix_times(steps: &[Step]) -> bool {
    steps.first().is_some_and(|s| s.start_unix > 1e9)
}

/// For each spike, the step that caused it: among the steps whose [start, end] overlaps the
/// gap, the longest one (a gap spanning several short steps and one long one was the long one).
pub fn attribute(spikes: &mut [Spike], steps: &[Step], t0_unix: f64) {
    let max_dur = steps
        .iter()
        .map(|s| s.end_unix - s.start_unix)
        .fold(0.0, f64::max);
    for sp in spikes.iter_mut() {
        let (a, b) = (t0_unix + sp.start_s, t0_unix + sp.time_s);
        let hi = steps.partition_point(|s| s.start_unix <= b);
        let mut best: Option<usize> = None;
        let mut count = 0;
        for i in (0..hi).rev() {
            let s = &steps[i];
            if s.start_unix < a - max_dur {
                break;
            }
            if s.end_unix >= a {
                count += 1;
                let longer = best.is_none_or(|j| {
                    s.end_unix - s.start_unix > steps[j].end_unix - steps[j].start_unix
                });
                if longer {
                    best = Some(i);
                }
            }
        }
        sp.step = best.map(|i| (i, count));
    }
}

/// A spike as JSON, with its step when attributed.
pub fn spike_json(sp: &Spike, steps: &[Step], t0_unix: f64) -> Value {
    let step = sp.step.map(|(i, overlapping)| {
        let s = &steps[i];
        json!({
            "step": s.index,
            "start_s": s.start_unix - t0_unix,
            "duration_ms": (s.end_unix - s.start_unix) * 1e3,
            "prompt_tokens": s.prompt_tokens,
            "decode_tokens": s.decode_tokens,
            "preemptions": s.preemptions,
            "overlapping_steps": overlapping,
            "raw": s.raw,
        })
    });
    json!({
        "time_s": sp.time_s,
        "gap_start_s": sp.start_s,
        "request": sp.request,
        "gap_ms": sp.gap_ms,
        "step": step,
    })
}

/// The spikes part of the report: JSON, markdown, and notes about the step log (which is read
/// here, after the run, as the server writes it during the run).
pub fn spike_section(
    records: &[RequestRecord],
    factor: f64,
    step_log: Option<&Path>,
    max_spikes: usize,
    t0_unix: f64,
) -> (Value, String, Vec<String>) {
    let mut notes: Vec<String> = Vec::new();
    let found = find_spikes(records, factor);
    let steps = match step_log {
        Some(p) => match load_step_log(p) {
            Ok(s) if looks_like_unix_times(&s) => s,
            Ok(s) if s.is_empty() => {
                notes.push(format!("step log {}: no steps", p.display()));
                Vec::new()
            }
            Ok(_) => {
                notes.push(format!(
                    "step log {}: times are not Unix times, spikes not attributed",
                    p.display()
                ));
                Vec::new()
            }
            Err(e) => {
                notes.push(format!("{e:#}; spikes not attributed"));
                Vec::new()
            }
        },
        None => Vec::new(),
    };
    let (j, md) = match found {
        Some((median, threshold, mut spikes)) => {
            attribute(&mut spikes, &steps, t0_unix);
            let n_itl: usize = records
                .iter()
                .filter(|r| r.ok())
                .map(|r| r.o.itl_ms.len())
                .sum();
            let attributed = spikes.iter().filter(|s| s.step.is_some()).count();
            let mut distinct: Vec<usize> =
                spikes.iter().filter_map(|s| s.step.map(|x| x.0)).collect();
            distinct.sort_unstable();
            distinct.dedup();
            let j = json!({
                "factor": factor,
                "median_itl_ms": median,
                "threshold_ms": threshold,
                "count": spikes.len(),
                "itl_count": n_itl,
                "step_log": step_log,
                "steps_in_log": steps.len(),
                "attributed": attributed,
                "distinct_steps": distinct.len(),
                "spikes": spikes.iter().take(1000).map(|s| spike_json(s, &steps, t0_unix)).collect::<Vec<_>>(),
            });
            let mut md = format!(
                "ITL spikes (> {} × median ITL {median:.1} ms = {threshold:.1} ms): {} of {n_itl} gaps",
                factor,
                spikes.len()
            );
            if !steps.is_empty() {
                let _ = write!(
                    md,
                    ", {attributed} attributed to {} distinct server steps",
                    distinct.len()
                );
            }
            if !spikes.is_empty() && max_spikes > 0 {
                let mut top: Vec<_> = spikes.iter().collect();
                top.sort_by(|x, y| y.gap_ms.total_cmp(&x.gap_ms));
                top.truncate(max_spikes);
                top.sort_by(|x, y| x.time_s.total_cmp(&y.time_s));
                let _ = writeln!(md, "; the {} largest:\n", top.len());
                if steps.is_empty() {
                    md.push_str("| t (s) | request | gap (ms) |\n|--:|--:|--:|\n");
                } else {
                    md.push_str("| t (s) | request | gap (ms) | step | step (ms) | prompt tok | decode tok | preemptions | running |\n|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n");
                }
                for s in top {
                    let _ = write!(md, "| {:.3} | {} | {:.1} |", s.time_s, s.request, s.gap_ms);
                    if !steps.is_empty() {
                        match s.step {
                            Some((i, _)) => {
                                let st = &steps[i];
                                let _ = write!(
                                    md,
                                    " {} | {:.1} | {} | {} | {} | {} |",
                                    st.index,
                                    (st.end_unix - st.start_unix) * 1e3,
                                    opt(st.prompt_tokens),
                                    opt(st.decode_tokens),
                                    opt(st.preemptions),
                                    opt(st.raw.get("running").and_then(|v| v.as_u64())),
                                );
                            }
                            None => md.push_str(" – | – | – | – | – | – |"),
                        }
                    }
                    md.push('\n');
                }
            } else {
                md.push_str(".\n");
            }
            (j, md)
        }
        None => (
            Value::Null,
            "ITL spikes: none measured (no inter-token gaps, or their median is 0).\n".into(),
        ),
    };
    (j, md, notes)
}

fn opt(v: Option<u64>) -> String {
    v.map_or("–".into(), |n| n.to_string())
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve_bench::client::Outcome;

    fn rec(index: usize, chunks: &[f64]) -> RequestRecord {
        RequestRecord {
            index,
            arrival_s: 0.0,
            send_s: 0.0,
            prompt_words: 1,
            max_tokens: chunks.len(),
            o: Outcome {
                done_s: *chunks.last().unwrap(),
                ttft_ms: Some(chunks[0] * 1e3),
                itl_ms: chunks.windows(2).map(|w| (w[1] - w[0]) * 1e3).collect(),
                chunk_s: chunks.to_vec(),
                output_tokens: chunks.len() as u64,
                ..Outcome::default()
            },
        }
    }

    #[test]
    fn spikes_found_and_attributed() {
        // 10 ms gaps, one 100 ms gap from 1.03 to 1.13 s in request 1.
        let a = rec(0, &[1.0, 1.01, 1.02, 1.03, 1.04]);
        let b = rec(1, &[1.0, 1.01, 1.02, 1.03, 1.13, 1.14]);
        let (median, thr, mut spikes) = find_spikes(&[a, b], 3.0).unwrap();
        assert!((median - 10.0).abs() < 1e-6 && (thr - 30.0).abs() < 1e-6);
        assert_eq!(spikes.len(), 1);
        assert_eq!(spikes[0].request, 1);
        assert!((spikes[0].time_s - 1.13).abs() < 1e-9);

        let t0 = 1_700_000_000.0;
        let dir = std::env::temp_dir().join(format!("quire-steplog-{}", std::process::id()));
        std::fs::create_dir_all(&dir).unwrap();
        let p = dir.join("steps.jsonl");
        let lines = [
            format!(
                r#"{{"step":7,"start_unix_s":{},"end_unix_s":{},"prompt_tokens":0,"decode_tokens":2}}"#,
                t0 + 1.02,
                t0 + 1.031
            ),
            format!(
                r#"{{"step":8,"start_unix_ms":{},"duration_ms":95,"prompt_tokens":512,"decode_tokens":1,"preemptions_total":3}}"#,
                (t0 + 1.032) * 1e3
            ),
            format!(
                r#"{{"step":9,"start":{},"end":{},"decode_tokens":2,"preemptions_total":4}}"#,
                t0 + 1.128,
                t0 + 1.138
            ),
        ];
        std::fs::write(&p, lines.join("\n")).unwrap();
        let steps = load_step_log(&p).unwrap();
        assert!(looks_like_unix_times(&steps));
        assert_eq!(steps[1].preemptions, Some(0));
        assert_eq!(steps[2].preemptions, Some(1));
        attribute(&mut spikes, &steps, t0);
        let (i, overlapping) = spikes[0].step.unwrap();
        assert_eq!(steps[i].index, 8);
        assert_eq!(steps[i].prompt_tokens, Some(512));
        assert_eq!(overlapping, 3);
        let j = spike_json(&spikes[0], &steps, t0);
        assert_eq!(j["step"]["step"], 8);
        std::fs::remove_dir_all(&dir).ok();
    }

    #[test]
    fn no_spikes_without_itls() {
        assert!(find_spikes(&[rec(0, &[1.0])], 3.0).is_none());
    }
}
