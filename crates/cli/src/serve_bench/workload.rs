//! What to send and when: arrival times (Poisson or gamma renewal process whose rate rises linearly
//! over the ramp), prompt and output lengths, random-word prompts or the lines of a JSONL dataset.

use std::path::Path;
use std::sync::LazyLock;

use anyhow::{bail, Context, Result};
use rand::rngs::StdRng;
use rand::seq::SliceRandom;
use rand::{Rng, SeedableRng};
use rand_distr::{Distribution, Gamma};

/// Arrival times in seconds since the start, all below `duration_s`.
///
/// The process runs in "operational time": unit-mean gamma gaps (shape = `burstiness`, so 1 is a
/// Poisson process and the squared coefficient of variation of the gaps is 1/burstiness), mapped
/// through the inverse of the cumulative rate Λ(t). The rate is `rate·t/ramp` during the ramp and
/// `rate` after it, so Λ(t) = rate·t²/(2·ramp) in the ramp and rate·(t − ramp/2) after.
pub fn arrival_times(
    rate: f64,
    burstiness: f64,
    ramp_s: f64,
    duration_s: f64,
    rng: &mut StdRng,
) -> Vec<f64> {
    let gap = Gamma::new(burstiness, 1.0 / burstiness).expect("burstiness is checked positive");
    let mut out = Vec::new();
    let mut u = 0.0;
    loop {
        u += gap.sample(rng);
        let t = time_at(u, rate, ramp_s);
        if t >= duration_s {
            return out;
        }
        out.push(t);
    }
}

/// The inverse of the cumulative arrival rate: the time at which Λ(t) = u.
pub fn time_at(u: f64, rate: f64, ramp_s: f64) -> f64 {
    let ramp_area = rate * ramp_s / 2.0;
    if ramp_s > 0.0 && u < ramp_area {
        (2.0 * ramp_s * u / rate).sqrt()
    } else {
        ramp_s + (u - ramp_area) / rate
    }
}

/// A length drawn uniformly from [mean·(1−ratio), mean·(1+ratio)] (at least 1).
pub fn sample_len(mean: usize, ratio: f64, rng: &mut StdRng) -> usize {
    let lo = ((mean as f64 * (1.0 - ratio)).round() as usize).max(1);
    let hi = ((mean as f64 * (1.0 + ratio)).round() as usize).max(lo);
    if lo == hi {
        lo
    } else {
        rng.random_range(lo..=hi)
    }
}

/// Common short English words: each is one token in the usual BPE vocabularies, so a prompt of
/// N words is about N tokens (the report uses the server's own count from `usage`).
const WORDS: &str = "\
    the of and to in is you that it he was for on are as with his they at be this have from \
    or one had by word but not what all were we when your can said there use an each which \
    she do how their if will up other about out many then them these so some her would make \
    like him into time has look two more write go see number no way could people my than \
    first water been call who oil its now find long down day did get come made may part over \
    new sound take only little work know place year live me back give most very after thing \
    our just name good sentence man think say great where help through much before line \
    right too mean old any same tell boy follow came want show also around form three small \
    set put end does another well large must big even such because turn here why ask went \
    men read need land different home us move try kind hand picture again change off play \
    spell air away animal house point page letter mother answer found study still learn \
    should world high every near add food between own below country plant last school father \
    keep tree never start city earth eye light thought head under story saw left few while \
    along might close";

/// [`WORDS`] split once.
static WORD_LIST: LazyLock<Vec<&'static str>> =
    LazyLock::new(|| WORDS.split_whitespace().collect());

/// `n` random words separated by spaces.
pub fn random_prompt(n: usize, rng: &mut StdRng) -> String {
    let mut s = String::with_capacity(n * 6);
    for i in 0..n {
        if i > 0 {
            s.push(' ');
        }
        s.push_str(WORD_LIST[rng.random_range(0..WORD_LIST.len())]);
    }
    s
}

/// One line of a `--dataset` file.
#[derive(Debug, Clone)]
pub struct DatasetEntry {
    pub prompt: String,
    pub max_tokens: Option<usize>,
}

/// Reads a JSONL dataset: one object per line with a string `prompt` and an optional
/// `max_tokens` or `output_len`; blank lines are skipped.
pub fn load_dataset(path: &Path) -> Result<Vec<DatasetEntry>> {
    let text = std::fs::read_to_string(path)
        .with_context(|| format!("cannot read --dataset {}", path.display()))?;
    let mut out = Vec::new();
    for (i, line) in text.lines().enumerate() {
        let line = line.trim();
        if line.is_empty() {
            continue;
        }
        let where_ = || format!("{} line {}", path.display(), i + 1);
        let v: serde_json::Value =
            serde_json::from_str(line).with_context(|| format!("{}: not JSON", where_()))?;
        let Some(prompt) = v.get("prompt").and_then(|p| p.as_str()) else {
            bail!("{}: no \"prompt\" string", where_());
        };
        let max_tokens = ["max_tokens", "output_len"]
            .iter()
            .find_map(|k| v.get(*k).and_then(|x| x.as_u64()))
            .map(|n| n.max(1) as usize);
        out.push(DatasetEntry {
            prompt: prompt.to_string(),
            max_tokens,
        });
    }
    if out.is_empty() {
        bail!("--dataset {} has no prompts", path.display());
    }
    Ok(out)
}

/// One request to send: its prompt, the approximate prompt length in words, and max_tokens.
#[derive(Debug, Clone)]
pub struct RequestSpec {
    pub prompt: String,
    pub prompt_words: usize,
    pub max_tokens: usize,
}

/// Produces the request specs in order, deterministically from the seed.
pub struct Workload {
    rng: StdRng,
    input_len: usize,
    output_len: usize,
    range_ratio: f64,
    dataset: Option<Vec<DatasetEntry>>,
    next: usize,
}

impl Workload {
    pub fn new(
        seed: u64,
        input_len: usize,
        output_len: usize,
        range_ratio: f64,
        dataset: Option<Vec<DatasetEntry>>,
    ) -> Self {
        // A stream of its own, so the arrivals (seeded separately) do not depend on the lengths.
        let mut rng = StdRng::seed_from_u64(seed ^ 0x5eed_0f9e_0e7a_1100);
        let dataset = dataset.map(|mut d| {
            d.shuffle(&mut rng);
            d
        });
        Workload {
            rng,
            input_len,
            output_len,
            range_ratio,
            dataset,
            next: 0,
        }
    }

    pub fn next_spec(&mut self) -> RequestSpec {
        let i = self.next;
        self.next += 1;
        match &self.dataset {
            Some(d) => {
                let e = &d[i % d.len()];
                let max_tokens = match e.max_tokens {
                    Some(n) => n,
                    None => sample_len(self.output_len, self.range_ratio, &mut self.rng),
                };
                RequestSpec {
                    prompt: e.prompt.clone(),
                    prompt_words: e.prompt.split_whitespace().count(),
                    max_tokens,
                }
            }
            None => {
                let n = sample_len(self.input_len, self.range_ratio, &mut self.rng);
                let max_tokens = sample_len(self.output_len, self.range_ratio, &mut self.rng);
                RequestSpec {
                    prompt: random_prompt(n, &mut self.rng),
                    prompt_words: n,
                    max_tokens,
                }
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn gaps(t: &[f64]) -> Vec<f64> {
        t.windows(2).map(|w| w[1] - w[0]).collect()
    }

    fn mean_var(x: &[f64]) -> (f64, f64) {
        let m = x.iter().sum::<f64>() / x.len() as f64;
        let v = x.iter().map(|v| (v - m) * (v - m)).sum::<f64>() / x.len() as f64;
        (m, v)
    }

    #[test]
    fn poisson_mean_gap_is_one_over_rate() {
        let mut rng = StdRng::seed_from_u64(7);
        let rate = 8.0;
        let t = arrival_times(rate, 1.0, 0.0, 20_000.0 / rate, &mut rng);
        assert!((t.len() as f64 - 20_000.0).abs() < 600.0, "{}", t.len());
        let (m, v) = mean_var(&gaps(&t));
        assert!((m - 1.0 / rate).abs() < 0.03 / rate, "mean gap {m}");
        // Exponential gaps: variance = mean².
        let cv2 = v / (m * m);
        assert!((cv2 - 1.0).abs() < 0.08, "cv² {cv2}");
        assert!(t.windows(2).all(|w| w[0] <= w[1]));
    }

    #[test]
    fn gamma_burstiness_sets_the_variance() {
        for k in [0.25, 4.0] {
            let mut rng = StdRng::seed_from_u64(11);
            let rate = 5.0;
            let t = arrival_times(rate, k, 0.0, 40_000.0 / rate, &mut rng);
            let (m, v) = mean_var(&gaps(&t));
            assert!((m - 1.0 / rate).abs() < 0.05 / rate, "k {k}: mean gap {m}");
            let cv2 = v / (m * m);
            assert!((cv2 - 1.0 / k).abs() < 0.15 / k, "k {k}: cv² {cv2}");
        }
    }

    #[test]
    fn ramp_rises_linearly() {
        // Expected count in the ramp = rate·ramp/2; in its first half, a quarter of that.
        let (rate, ramp) = (20.0, 100.0);
        let mut rng = StdRng::seed_from_u64(3);
        let t = arrival_times(rate, 1.0, ramp, 200.0, &mut rng);
        let in_ramp = t.iter().filter(|&&x| x < ramp).count() as f64;
        let first_half = t.iter().filter(|&&x| x < ramp / 2.0).count() as f64;
        let after = t.iter().filter(|&&x| x >= ramp).count() as f64;
        assert!((in_ramp - 1000.0).abs() < 120.0, "{in_ramp}");
        assert!((first_half - 250.0).abs() < 60.0, "{first_half}");
        assert!((after - 2000.0).abs() < 160.0, "{after}");
        assert!(t.iter().all(|&x| (0.0..200.0).contains(&x)));
    }

    #[test]
    fn time_at_is_continuous_at_the_ramp_end() {
        let (rate, ramp) = (4.0, 10.0);
        let area = rate * ramp / 2.0;
        assert!((time_at(area - 1e-9, rate, ramp) - ramp).abs() < 1e-6);
        assert!((time_at(area, rate, ramp) - ramp).abs() < 1e-12);
        assert_eq!(time_at(8.0, 4.0, 0.0), 2.0);
    }

    #[test]
    fn seeded_and_reproducible() {
        let a = arrival_times(3.0, 1.0, 5.0, 30.0, &mut StdRng::seed_from_u64(1));
        let b = arrival_times(3.0, 1.0, 5.0, 30.0, &mut StdRng::seed_from_u64(1));
        assert_eq!(a, b);
        let mut w1 = Workload::new(9, 16, 8, 0.5, None);
        let mut w2 = Workload::new(9, 16, 8, 0.5, None);
        for _ in 0..20 {
            let (x, y) = (w1.next_spec(), w2.next_spec());
            assert_eq!(x.prompt, y.prompt);
            assert_eq!(x.max_tokens, y.max_tokens);
            assert!((8..=24).contains(&x.prompt_words));
            assert_eq!(x.prompt.split(' ').count(), x.prompt_words);
            assert!((4..=12).contains(&x.max_tokens));
        }
    }

    #[test]
    fn lengths_stay_in_range() {
        let mut rng = StdRng::seed_from_u64(2);
        assert_eq!(sample_len(64, 0.0, &mut rng), 64);
        assert_eq!(sample_len(1, 0.9, &mut rng), 1);
        let v: Vec<usize> = (0..2000).map(|_| sample_len(100, 0.5, &mut rng)).collect();
        assert!(v.iter().all(|&n| (50..=150).contains(&n)));
        let m = v.iter().sum::<usize>() as f64 / v.len() as f64;
        assert!((m - 100.0).abs() < 3.0, "{m}");
    }
}
