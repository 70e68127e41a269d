//! `quire compare A.json B.json`: for every test present in both bench results, the throughput
//! ratio B/A with a 95% confidence interval (Welch's t-interval on log samples, see
//! `quire_perf::ratio`), flagged when the interval excludes 1. It reads quire's and
//! llama-bench's JSON alike (tests are matched by prompt, generation, depth and batch size), so
//! it answers both "did this commit help?" and "how far is quire from llama.cpp?".

use std::path::{Path, PathBuf};

use anyhow::{bail, Context, Result};
use clap::Args;
use quire_perf::output::parse_records;
use quire_perf::{ratio_ci, Table};
use serde_json::{Map, Value};

#[derive(Args, Debug)]
pub struct CompareArgs {
    /// Baseline result (`quire bench -o json`, `-o jsonl`, or llama-bench `-o json`)
    pub a: PathBuf,
    /// Candidate result
    pub b: PathBuf,
    /// Confidence level of the intervals
    #[arg(long, default_value_t = 0.95)]
    pub level: f64,
}

struct Test {
    key: String,
    model: String,
    name: String,
    avg_ts: f64,
    samples: Vec<f64>,
}

fn u(r: &Map<String, Value>, k: &str) -> u64 {
    r.get(k).and_then(Value::as_u64).unwrap_or(0)
}

fn load(path: &Path) -> Result<(Vec<Test>, String)> {
    let text =
        std::fs::read_to_string(path).with_context(|| format!("cannot read {}", path.display()))?;
    let recs = parse_records(&text).with_context(|| path.display().to_string())?;
    let mut out = Vec::new();
    let mut build = String::new();
    for r in &recs {
        let Some(avg_ts) = r.get("avg_ts").and_then(Value::as_f64) else {
            continue;
        };
        let (p, g, d) = (u(r, "n_prompt"), u(r, "n_gen"), u(r, "n_depth"));
        let seqs = u(r, "n_seqs").max(1);
        let batched = r
            .get("test")
            .and_then(Value::as_str)
            .is_some_and(|t| t.contains(" x"));
        let mut name = match (p, g) {
            (p, 0) => format!("pp{p}"),
            (0, g) => format!("tg{g}"),
            (p, g) => format!("pp{p}+tg{g}"),
        };
        if batched {
            name += &format!(" x{seqs}");
        }
        if d > 0 {
            name += &format!(" @ d{d}");
        }
        let model = r
            .get("model_filename")
            .and_then(Value::as_str)
            .map(|f| f.rsplit('/').next().unwrap_or(f).to_string())
            .unwrap_or_default();
        let threads = u(r, "n_threads");
        let samples = r
            .get("samples_ts")
            .and_then(Value::as_array)
            .map(|a| a.iter().filter_map(Value::as_f64).collect())
            .unwrap_or_default();
        if build.is_empty() {
            build = r
                .get("build_commit")
                .and_then(Value::as_str)
                .unwrap_or("?")
                .to_string();
        }
        out.push(Test {
            key: format!("{name} t{threads}"),
            model,
            name,
            avg_ts,
            samples,
        });
    }
    if out.is_empty() {
        bail!("{} holds no bench results (no avg_ts)", path.display());
    }
    Ok((out, build))
}

pub fn run(a: CompareArgs) -> Result<()> {
    if !(0.5..1.0).contains(&a.level) {
        bail!("--level must be in [0.5, 1)");
    }
    let (ta, build_a) = load(&a.a)?;
    let (tb, build_b) = load(&a.b)?;
    // Match on model file and test when the model names agree, else on the test alone (two
    // tools, or two copies of a model under different names).
    let same_models = ta
        .iter()
        .any(|x| tb.iter().any(|y| x.model == y.model && x.key == y.key));
    let pct = format!("{:.0}% CI", a.level * 100.0);
    let mut t = Table::new(
        &[
            "model",
            "test",
            "A t/s",
            "B t/s",
            "B/A",
            &pct,
            "significant",
        ],
        &["A t/s", "B t/s", "B/A", &pct],
    );
    for x in &ta {
        let Some(y) = tb
            .iter()
            .find(|y| y.key == x.key && (!same_models || y.model == x.model))
        else {
            continue;
        };
        let (ci, sig) = match ratio_ci(&x.samples, &y.samples, a.level) {
            Some(c) => (
                format!("{:.3} – {:.3}", c.lo, c.hi),
                if c.significant() {
                    if c.lo > 1.0 {
                        "yes, B faster"
                    } else {
                        "yes, B slower"
                    }
                } else {
                    "no"
                },
            ),
            None => ("n/a (< 2 samples)".into(), "?"),
        };
        let threads = x.key.rsplit(' ').next().unwrap_or("");
        t.push(vec![
            x.model.clone(),
            format!("{} ({threads})", x.name),
            format!("{:.2}", x.avg_ts),
            format!("{:.2}", y.avg_ts),
            format!("{:.3}", y.avg_ts / x.avg_ts),
            ci,
            sig.into(),
        ]);
    }
    if t.rows.is_empty() {
        bail!("no test appears in both files (tests match on n_prompt, n_gen, n_depth, n_seqs and n_threads)");
    }
    println!("A: {} (build {build_a})", a.a.display());
    println!("B: {} (build {build_b})\n", a.b.display());
    print!("{}", t.markdown());
    println!(
        "\nB/A is the ratio of mean t/s; the interval is Welch's t on log(samples_ts), {} level.",
        a.level
    );
    Ok(())
}
