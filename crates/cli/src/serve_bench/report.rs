//! Statistics per phase and overall: throughput, latency distributions, goodput under SLOs;
//! their JSON (field names as `vllm bench serve`) and the markdown table.

use serde_json::{json, Map, Value};

use super::load::RequestRecord;

/// The three phases. A request belongs to the phase in which it *completed* (its last byte, or
/// its failure): the phase's latencies are what a client saw finishing in that window.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Phase {
    /// The arrival rate rising to --rate: [0, ramp).
    Ramp,
    /// Arrivals at --rate: [ramp, duration).
    Steady,
    /// No more arrivals; in-flight requests drain: [duration, end].
    Tail,
}

impl Phase {
    pub const ALL: [Phase; 3] = [Phase::Ramp, Phase::Steady, Phase::Tail];

    pub fn at(t_s: f64, ramp_s: f64, duration_s: f64) -> Phase {
        if t_s < ramp_s {
            Phase::Ramp
        } else if t_s < duration_s {
            Phase::Steady
        } else {
            Phase::Tail
        }
    }

    pub fn name(self) -> &'static str {
        match self {
            Phase::Ramp => "ramp",
            Phase::Steady => "steady",
            Phase::Tail => "tail",
        }
    }

    /// The phase's window in seconds since the start.
    pub fn bounds(self, ramp_s: f64, duration_s: f64, end_s: f64) -> (f64, f64) {
        match self {
            Phase::Ramp => (0.0, ramp_s),
            Phase::Steady => (ramp_s, duration_s),
            Phase::Tail => (duration_s, end_s.max(duration_s)),
        }
    }
}

/// Service-level objectives; a request is "good" when it completed and meets all that are given.
#[derive(Debug, Clone, Copy, Default)]
pub struct Slo {
    pub ttft_ms: Option<f64>,
    pub tpot_ms: Option<f64>,
    pub e2e_ms: Option<f64>,
}

impl Slo {
    pub fn any(&self) -> bool {
        self.ttft_ms.is_some() || self.tpot_ms.is_some() || self.e2e_ms.is_some()
    }

    /// A one-token output has no TPOT and passes that SLO; no first token fails the TTFT SLO.
    pub fn met_by(&self, r: &RequestRecord) -> bool {
        r.ok()
            && self
                .ttft_ms
                .is_none_or(|s| r.o.ttft_ms.is_some_and(|t| t <= s))
            && self
                .tpot_ms
                .is_none_or(|s| r.tpot_ms().is_none_or(|t| t <= s))
            && self.e2e_ms.is_none_or(|s| r.e2e_ms() <= s)
    }
}

/// Percentiles reported for every latency.
pub const PERCENTILES: [f64; 4] = [50.0, 90.0, 95.0, 99.0];

/// The p-th percentile of sorted values, linear interpolation between closest ranks (numpy's
/// default, as vLLM uses).
pub fn percentile(sorted: &[f64], p: f64) -> f64 {
    if sorted.is_empty() {
        return f64::NAN;
    }
    let pos = p / 100.0 * (sorted.len() - 1) as f64;
    let (lo, hi) = (pos.floor() as usize, pos.ceil() as usize);
    sorted[lo] + (sorted[hi] - sorted[lo]) * (pos - lo as f64)
}

/// Summary of one latency distribution (ms).
#[derive(Debug, Clone, PartialEq)]
pub struct Dist {
    pub n: usize,
    pub mean: f64,
    /// Population standard deviation (numpy's default).
    pub std: f64,
    pub median: f64,
    /// Values at [`PERCENTILES`].
    pub pct: [f64; 4],
}

impl Dist {
    pub fn of(mut v: Vec<f64>) -> Option<Dist> {
        v.retain(|x| x.is_finite());
        if v.is_empty() {
            return None;
        }
        v.sort_by(f64::total_cmp);
        let n = v.len();
        let mean = v.iter().sum::<f64>() / n as f64;
        let var = v.iter().map(|x| (x - mean) * (x - mean)).sum::<f64>() / n as f64;
        Some(Dist {
            n,
            mean,
            std: var.sqrt(),
            median: percentile(&v, 50.0),
            pct: PERCENTILES.map(|p| percentile(&v, p)),
        })
    }

    pub fn p(&self, p: f64) -> f64 {
        let i = PERCENTILES
            .iter()
            .position(|&q| q == p)
            .expect("a listed percentile");
        self.pct[i]
    }
}

/// Everything reported for one phase or overall.
#[derive(Debug, Clone)]
pub struct Stats {
    pub name: &'static str,
    pub start_s: f64,
    pub end_s: f64,
    pub completed: usize,
    pub failed: usize,
    pub input_tokens: u64,
    pub output_tokens: u64,
    pub ttft: Option<Dist>,
    pub tpot: Option<Dist>,
    pub itl: Option<Dist>,
    pub e2el: Option<Dist>,
    pub queue: Option<Dist>,
    /// Completed requests meeting every SLO (None without SLOs).
    pub good: Option<usize>,
}

impl Stats {
    pub fn compute<'a>(
        name: &'static str,
        (start_s, end_s): (f64, f64),
        records: impl Iterator<Item = &'a RequestRecord>,
        slo: &Slo,
    ) -> Stats {
        let (mut ttft, mut tpot, mut itl, mut e2el, mut queue) =
            (Vec::new(), Vec::new(), Vec::new(), Vec::new(), Vec::new());
        let (mut completed, mut failed, mut good) = (0, 0, 0);
        let (mut input_tokens, mut output_tokens) = (0, 0);
        for r in records {
            if !r.ok() {
                failed += 1;
                continue;
            }
            completed += 1;
            input_tokens += r.input_tokens();
            output_tokens += r.o.output_tokens;
            ttft.extend(r.o.ttft_ms);
            tpot.extend(r.tpot_ms());
            itl.extend_from_slice(&r.o.itl_ms);
            e2el.push(r.e2e_ms());
            queue.push(r.queue_ms());
            good += usize::from(slo.met_by(r));
        }
        Stats {
            name,
            start_s,
            end_s,
            completed,
            failed,
            input_tokens,
            output_tokens,
            ttft: Dist::of(ttft),
            tpot: Dist::of(tpot),
            itl: Dist::of(itl),
            e2el: Dist::of(e2el),
            queue: Dist::of(queue),
            good: slo.any().then_some(good),
        }
    }

    pub fn duration(&self) -> f64 {
        (self.end_s - self.start_s).max(0.0)
    }

    /// `x` per second of this window (None for an empty window).
    pub fn per_s(&self, x: f64) -> Option<f64> {
        let d = self.duration();
        (d > 1e-9).then(|| x / d)
    }

    /// The JSON object: vLLM's names (`completed`, `request_throughput`, `mean_ttft_ms`,
    /// `percentiles_ttft_ms`, …) plus `failed`, `goodput_fraction`, `*_queue_ms`, `start_s`, `end_s`.
    pub fn to_json(&self) -> Map<String, Value> {
        let mut m = Map::new();
        let mut put = |k: &str, v: Value| {
            m.insert(k.to_string(), v);
        };
        put("start_s", json!(self.start_s));
        put("end_s", json!(self.end_s));
        put("duration", json!(self.duration()));
        put("completed", json!(self.completed));
        put("failed", json!(self.failed));
        put("total_input_tokens", json!(self.input_tokens));
        put("total_output_tokens", json!(self.output_tokens));
        put(
            "request_throughput",
            json!(self.per_s(self.completed as f64)),
        );
        put(
            "output_throughput",
            json!(self.per_s(self.output_tokens as f64)),
        );
        put(
            "total_token_throughput",
            json!(self.per_s((self.input_tokens + self.output_tokens) as f64)),
        );
        put(
            "request_goodput",
            json!(self.good.and_then(|g| self.per_s(g as f64))),
        );
        put(
            "goodput_fraction",
            json!(self.good.and_then(|g| (self.completed + self.failed > 0)
                .then(|| g as f64 / (self.completed + self.failed) as f64))),
        );
        for (metric, d) in [
            ("ttft", &self.ttft),
            ("tpot", &self.tpot),
            ("itl", &self.itl),
            ("e2el", &self.e2el),
            ("queue", &self.queue),
        ] {
            put(
                &format!("mean_{metric}_ms"),
                json!(d.as_ref().map(|d| d.mean)),
            );
            put(
                &format!("median_{metric}_ms"),
                json!(d.as_ref().map(|d| d.median)),
            );
            put(
                &format!("std_{metric}_ms"),
                json!(d.as_ref().map(|d| d.std)),
            );
            for (i, p) in PERCENTILES.iter().enumerate() {
                put(
                    &format!("p{p}_{metric}_ms"),
                    json!(d.as_ref().map(|d| d.pct[i])),
                );
            }
            put(
                &format!("percentiles_{metric}_ms"),
                json!(d.as_ref().map(|d| {
                    PERCENTILES
                        .iter()
                        .zip(d.pct)
                        .map(|(p, v)| json!([p, v]))
                        .collect::<Vec<_>>()
                })),
            );
        }
        m
    }
}

fn ms(d: &Option<Dist>, p: f64) -> String {
    match d {
        Some(d) => format!("{:.1}", d.p(p)),
        None => "–".into(),
    }
}

/// Seconds with one decimal, without a trailing ".0".
fn secs(t: f64) -> String {
    let s = format!("{t:.1}");
    s.strip_suffix(".0").map_or(s.clone(), str::to_string)
}

fn rate(x: Option<f64>, decimals: usize) -> String {
    x.map_or("–".into(), |v| format!("{v:.decimals$}"))
}

/// The markdown table: one row per phase and one overall; latencies in ms.
pub fn markdown_table(phases: &[Stats], overall: &Stats) -> String {
    let mut s = String::from(
        "| phase | requests | failed | req/s | out tok/s | TTFT p50 | TTFT p99 | TPOT p50 | TPOT p99 \
         | ITL p50 | ITL p99 | E2E p50 | E2E p99 | goodput |\n\
         |---|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|--:|\n",
    );
    let rows = phases.iter().map(|st| (st, false)).chain([(overall, true)]);
    for (st, is_overall) in rows {
        let label = if is_overall {
            format!("**{}**", st.name)
        } else {
            format!("{} ({}–{} s)", st.name, secs(st.start_s), secs(st.end_s))
        };
        let goodput = match st.good {
            Some(g) if st.completed + st.failed > 0 => format!(
                "{:.0}% ({}/s)",
                100.0 * g as f64 / (st.completed + st.failed) as f64,
                rate(st.per_s(g as f64), 2)
            ),
            _ => "–".into(),
        };
        s.push_str(&format!(
            "| {label} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {} | {goodput} |\n",
            st.completed,
            st.failed,
            rate(st.per_s(st.completed as f64), 2),
            rate(st.per_s(st.output_tokens as f64), 1),
            ms(&st.ttft, 50.0),
            ms(&st.ttft, 99.0),
            ms(&st.tpot, 50.0),
            ms(&st.tpot, 99.0),
            ms(&st.itl, 50.0),
            ms(&st.itl, 99.0),
            ms(&st.e2el, 50.0),
            ms(&st.e2el, 99.0),
        ));
    }
    s
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::serve_bench::client::Outcome;

    fn rec(send_s: f64, done_s: f64, ttft_ms: f64, tokens: u64, ok: bool) -> RequestRecord {
        RequestRecord {
            index: 0,
            arrival_s: send_s,
            send_s,
            prompt_words: 4,
            max_tokens: tokens as usize,
            o: Outcome {
                error: (!ok).then(|| "boom".to_string()),
                done_s,
                ttft_ms: Some(ttft_ms),
                itl_ms: vec![10.0; tokens.saturating_sub(1) as usize],
                chunk_s: vec![],
                output_tokens: tokens,
                prompt_tokens: Some(5),
                usage: true,
            },
        }
    }

    #[test]
    fn percentiles_interpolate_like_numpy() {
        let v = [1.0, 2.0, 3.0, 4.0];
        assert_eq!(percentile(&v, 50.0), 2.5);
        assert_eq!(percentile(&v, 0.0), 1.0);
        assert_eq!(percentile(&v, 100.0), 4.0);
        assert!((percentile(&v, 90.0) - 3.7).abs() < 1e-12);
        assert_eq!(percentile(&[7.0], 99.0), 7.0);
        let d = Dist::of(vec![4.0, 1.0, 3.0, 2.0, f64::NAN]).unwrap();
        assert_eq!((d.n, d.mean, d.median), (4, 2.5, 2.5));
        assert!((d.std - 1.25f64.sqrt()).abs() < 1e-12);
        assert!(d.pct.windows(2).all(|w| w[0] <= w[1]));
        assert!(Dist::of(vec![]).is_none());
    }

    #[test]
    fn phases_by_completion_time() {
        assert_eq!(Phase::at(0.0, 10.0, 60.0), Phase::Ramp);
        assert_eq!(Phase::at(9.99, 10.0, 60.0), Phase::Ramp);
        assert_eq!(Phase::at(10.0, 10.0, 60.0), Phase::Steady);
        assert_eq!(Phase::at(60.0, 10.0, 60.0), Phase::Tail);
        assert_eq!(Phase::at(0.0, 0.0, 60.0), Phase::Steady);
        assert_eq!(Phase::Tail.bounds(10.0, 60.0, 64.5), (60.0, 64.5));
    }

    #[test]
    fn stats_tpot_goodput_and_rates() {
        // e2e 1000 ms, ttft 100 ms, 10 tokens: tpot = 900/9 = 100 ms.
        let a = rec(0.0, 1.0, 100.0, 10, true);
        assert_eq!(a.tpot_ms(), Some(100.0));
        let b = rec(0.5, 1.0, 400.0, 1, true);
        assert_eq!(b.tpot_ms(), None);
        let c = rec(0.5, 1.5, 50.0, 3, false);
        let slo = Slo {
            ttft_ms: Some(200.0),
            ..Slo::default()
        };
        let st = Stats::compute("x", (0.0, 2.0), [&a, &b, &c].into_iter(), &slo);
        assert_eq!((st.completed, st.failed, st.good), (2, 1, Some(1)));
        assert_eq!(st.output_tokens, 11);
        assert_eq!(st.input_tokens, 10);
        assert_eq!(st.per_s(st.completed as f64), Some(1.0));
        assert_eq!(st.itl.as_ref().unwrap().n, 9);
        let j = st.to_json();
        assert_eq!(j["request_goodput"], json!(0.5));
        assert_eq!(j["median_ttft_ms"], json!(250.0));
        assert_eq!(j["percentiles_ttft_ms"][0], json!([50.0, 250.0]));
        assert!(j["p99_tpot_ms"].is_number());
        let empty = Stats::compute("e", (5.0, 5.0), std::iter::empty(), &Slo::default());
        assert!(empty.to_json()["request_throughput"].is_null());
        let md = markdown_table(&[empty], &st);
        assert_eq!(md.lines().count(), 4);
        assert!(md.contains("| **x** |") && md.contains("| e (5–5 s) |"));
    }

    #[test]
    fn slo_rules() {
        let r = rec(0.0, 1.0, 100.0, 10, true);
        let s = |t, p, e| Slo {
            ttft_ms: t,
            tpot_ms: p,
            e2e_ms: e,
        };
        assert!(s(Some(100.0), Some(100.0), Some(1000.0)).met_by(&r));
        assert!(!s(Some(99.0), None, None).met_by(&r));
        assert!(!s(None, Some(99.0), None).met_by(&r));
        assert!(!s(None, None, Some(999.0)).met_by(&r));
    }
}
