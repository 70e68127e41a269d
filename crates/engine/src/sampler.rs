//! Choosing the next token from logits. Order follows llama.cpp's default chain: penalties, then
//! top-k, top-p and min-p on the unscaled distribution, then temperature, then a draw from the
//! request's own seeded random stream (so a seed reproduces a completion whatever else is batched).

use quire_backend::{sample_row_with, SampleParams};
use quire_core::{SamplingParams, TokenId};
use rand::rngs::StdRng;
use rand::{Rng, SeedableRng};

/// Per-request sampling state.
pub struct Sampler {
    pub params: SamplingParams,
    rng: StdRng,
    /// Scratch: (logit, id) candidates.
    cand: Vec<(f32, u32)>,
}

/// A token with its log-probability and the most likely alternatives.
#[derive(Debug, Clone, PartialEq)]
pub struct Sampled {
    pub token: TokenId,
    /// Log-probability of `token` under the model (before penalties); computed only when the
    /// request asked for logprobs (`SamplingParams::logprobs` or alternatives), `None` otherwise.
    pub logprob: Option<f32>,
    pub top: Vec<(TokenId, f32)>,
}

impl Sampler {
    pub fn new(params: SamplingParams) -> Self {
        let seed = params.seed.unwrap_or_else(|| {
            use std::time::{SystemTime, UNIX_EPOCH};
            SystemTime::now()
                .duration_since(UNIX_EPOCH)
                .map(|d| d.as_nanos() as u64)
                .unwrap_or(0)
        });
        Self {
            params,
            rng: StdRng::seed_from_u64(seed),
            cand: Vec::new(),
        }
    }

    /// Applies penalties in place, using the tokens generated (and prompted) so far.
    fn apply_penalties(&self, logits: &mut [f32], history: &[TokenId]) {
        let p = &self.params;
        if p.repetition_penalty != 1.0 && p.repeat_last_n > 0 {
            let start = history.len().saturating_sub(p.repeat_last_n);
            let mut seen = std::collections::HashSet::new();
            for t in &history[start..] {
                if seen.insert(t.0) {
                    if let Some(l) = logits.get_mut(t.as_usize()) {
                        *l = if *l > 0.0 {
                            *l / p.repetition_penalty
                        } else {
                            *l * p.repetition_penalty
                        };
                    }
                }
            }
        }
        if p.presence_penalty != 0.0 || p.frequency_penalty != 0.0 {
            let mut counts = std::collections::HashMap::new();
            for t in history {
                *counts.entry(t.0).or_insert(0u32) += 1;
            }
            for (t, c) in counts {
                if let Some(l) = logits.get_mut(t as usize) {
                    *l -= p.presence_penalty + p.frequency_penalty * c as f32;
                }
            }
        }
    }

    /// True when the next token is the plain argmax of the logits: greedy, no penalties, no
    /// log-probabilities asked (the backend may then pick on the device).
    pub fn is_plain_greedy(&self) -> bool {
        self.params.is_greedy() && self.is_plain()
    }

    /// True when the next token is the argmax of the logits the request's grammar (if any)
    /// allows: greedy, no penalties, no log-probabilities asked. A guided request's pick may
    /// then read only its allowed logits ([`crate::constrain::Grammars::argmax`]).
    pub fn is_greedy_under_mask(&self) -> bool {
        self.params.is_greedy() && self.is_plain_under_mask()
    }

    /// True when the next token depends on the logits row alone (no penalties, no
    /// log-probabilities asked, no grammar), so the backend may pick it on the device from `device_params`.
    pub fn is_plain(&self) -> bool {
        self.params.constraint.is_none() && self.is_plain_under_mask()
    }

    /// True when the next token depends on the logits row and the grammar's mask alone (no
    /// penalties, no log-probabilities asked): the backend may pick it on the device, under the
    /// mask, from `device_params`.
    pub fn is_plain_under_mask(&self) -> bool {
        let p = &self.params;
        !p.logprobs
            && p.top_logprobs == 0
            && (p.repetition_penalty == 1.0 || p.repeat_last_n == 0)
            && p.presence_penalty == 0.0
            && p.frequency_penalty == 0.0
    }

    /// What the backend needs to pick this request's next token on the device, or `None` when
    /// the pick needs the host (`is_plain_under_mask` is false; a guided request's pick must be
    /// masked by the caller). Takes the step's one uniform draw from the request's own stream
    /// when it samples, as `sample` would, so a seed reproduces the same completion on either
    /// path (greedy requests draw nothing, on either path).
    pub fn device_params(&mut self) -> Option<SampleParams> {
        if !self.is_plain_under_mask() {
            return None;
        }
        if self.params.is_greedy() {
            return Some(SampleParams::GREEDY);
        }
        let u = self.rng.random::<f64>();
        Some(self.row_params(u))
    }

    /// Picks the next token. `logits` may be modified. `n_top` alternatives are reported with
    /// log-probabilities of the unmodified model distribution.
    pub fn sample(&mut self, logits: &mut [f32], history: &[TokenId], n_top: usize) -> Sampled {
        let top = if n_top > 0 {
            top_logprobs(logits, n_top)
        } else {
            Vec::new()
        };
        // A pass of exp over the whole vocabulary: only when someone reads the result.
        let want = self.params.logprobs || n_top > 0;
        let raw_lse = if want { log_sum_exp(logits) } else { 0.0 };
        self.apply_penalties(logits, history);
        let token = if self.params.is_greedy() {
            argmax(logits)
        } else {
            self.draw(logits)
        };
        let logprob = want.then(|| logits_raw_logprob(token, &top, raw_lse, logits));
        Sampled {
            token: TokenId(token),
            logprob,
            top,
        }
    }

    fn draw(&mut self, logits: &[f32]) -> u32 {
        // No finite logit: token 0, without a draw from the stream (as it always was).
        if !logits.iter().any(|l| l.is_finite()) {
            return 0;
        }
        let u = self.rng.random::<f64>();
        sample_row_with(logits, &self.row_params(u), &mut self.cand)
    }

    /// One uniform draw in `[0, 1)` from the request's own stream.
    pub fn uniform(&mut self) -> f64 {
        self.rng.random::<f64>()
    }

    /// The distribution a draw from `logits` follows under this request's filters (top-k, top-p,
    /// min-p, temperature), as `(token, probability)` with probability > 0, most likely first —
    /// the same candidates and weights [`quire_backend::sample_row`] draws from. Greedy: a point
    /// mass on the argmax.
    pub fn target_probs(&self, logits: &[f32]) -> Vec<(u32, f64)> {
        let p = &self.params;
        if p.is_greedy() {
            return vec![(argmax(logits), 1.0)];
        }
        let mut c: Vec<(f32, u32)> = logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (l, i as u32))
            .collect();
        if c.is_empty() {
            return vec![(0, 1.0)];
        }
        let desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
        if p.top_k > 0 && p.top_k < c.len() {
            c.select_nth_unstable_by(p.top_k - 1, desc);
            c.truncate(p.top_k);
        }
        c.sort_unstable_by(desc);
        let mx = c[0].0;
        // The cuts use the unscaled distribution in f32, as the sampler does.
        let unscaled: Vec<f32> = c.iter().map(|&(l, _)| (l - mx).exp()).collect();
        let z: f32 = unscaled.iter().sum();
        let mut keep = c.len();
        if p.top_p < 1.0 {
            let mut cum = 0.0f32;
            for (i, &u) in unscaled.iter().enumerate() {
                cum += u / z;
                if cum >= p.top_p {
                    keep = i + 1;
                    break;
                }
            }
        }
        if p.min_p > 0.0 {
            let floor = p.min_p * (unscaled[0] / z);
            let above = unscaled.iter().take_while(|&&u| u / z >= floor).count();
            keep = keep.min(above.max(1));
        }
        c.truncate(keep);
        let w: Vec<f64> = c
            .iter()
            .map(|&(l, _)| (((l - mx) / p.temperature) as f64).exp())
            .collect();
        let total: f64 = w.iter().sum();
        c.iter()
            .zip(w)
            .map(|(&(_, id), w)| (id, w / total))
            .filter(|e| e.1 > 0.0)
            .collect()
    }

    /// The request's filters for [`quire_backend::sample_row`] with the uniform draw `u`.
    fn row_params(&self, u: f64) -> SampleParams {
        let p = &self.params;
        SampleParams {
            temperature: p.temperature,
            top_k: p.top_k.try_into().unwrap_or(u32::MAX),
            top_p: p.top_p,
            min_p: p.min_p,
            u,
        }
    }
}

/// Index of the largest logit (the lowest index among equals).
pub use quire_backend::argmax;

pub fn log_sum_exp(logits: &[f32]) -> f32 {
    let mx = logits.iter().cloned().fold(f32::NEG_INFINITY, f32::max);
    let s: f64 = logits.iter().map(|&l| ((l - mx) as f64).exp()).sum();
    mx + s.ln() as f32
}

/// The `n` most likely tokens with their log-probabilities, most likely first.
pub fn top_logprobs(logits: &[f32], n: usize) -> Vec<(TokenId, f32)> {
    let lse = log_sum_exp(logits);
    let mut idx: Vec<u32> = (0..logits.len() as u32).collect();
    let n = n.min(idx.len());
    if n == 0 {
        return Vec::new();
    }
    let cmp = |a: &u32, b: &u32| {
        logits[*b as usize]
            .total_cmp(&logits[*a as usize])
            .then(a.cmp(b))
    };
    idx.select_nth_unstable_by(n - 1, cmp);
    idx.truncate(n);
    idx.sort_by(cmp);
    idx.into_iter()
        .map(|i| (TokenId(i), logits[i as usize] - lse))
        .collect()
}

fn logits_raw_logprob(token: u32, top: &[(TokenId, f32)], raw_lse: f32, logits: &[f32]) -> f32 {
    // Prefer the value computed before penalties touched the logits.
    top.iter()
        .find(|(t, _)| t.0 == token)
        .map(|e| e.1)
        .unwrap_or_else(|| logits[token as usize] - raw_lse)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params() -> SamplingParams {
        SamplingParams {
            seed: Some(1),
            ..Default::default()
        }
    }

    #[test]
    fn greedy_is_argmax() {
        let mut s = Sampler::new(params());
        let mut l = vec![0.1, 3.0, 2.9, -1.0];
        assert_eq!(s.sample(&mut l, &[], 0).token, TokenId(1));
    }

    #[test]
    fn top_k_one_is_greedy_at_any_temperature() {
        let mut s = Sampler::new(SamplingParams {
            temperature: 5.0,
            top_k: 1,
            ..params()
        });
        for _ in 0..50 {
            let mut l = vec![0.1, 3.0, 2.9, -1.0];
            assert_eq!(s.sample(&mut l, &[], 0).token, TokenId(1));
        }
    }

    #[test]
    fn top_p_and_min_p_cut_the_tail() {
        // probabilities ~ [0.64, 0.24, 0.09, 0.03]
        let logits = [3.0f32, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            top_p: 0.7,
            ..params()
        });
        let mut seen = [false; 4];
        for _ in 0..400 {
            seen[s.sample(&mut logits.clone(), &[], 0).token.as_usize()] = true;
        }
        assert_eq!(seen, [true, true, false, false]);
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            min_p: 0.3,
            ..params()
        });
        let mut seen = [false; 4];
        for _ in 0..400 {
            seen[s.sample(&mut logits.clone(), &[], 0).token.as_usize()] = true;
        }
        assert_eq!(seen, [true, true, false, false]);
    }

    #[test]
    fn same_seed_same_draws() {
        let logits = [1.0f32, 1.1, 0.9, 1.05, 0.95];
        let p = SamplingParams {
            temperature: 1.0,
            seed: Some(42),
            ..Default::default()
        };
        let run = || {
            let mut s = Sampler::new(p.clone());
            (0..32)
                .map(|_| s.sample(&mut logits.clone(), &[], 0).token.0)
                .collect::<Vec<_>>()
        };
        assert_eq!(run(), run());
        assert!(run().iter().any(|&t| t != run()[0]), "draws should vary");
    }

    #[test]
    fn device_params_reproduce_the_host_draws() {
        let logits = [1.0f32, 1.1, 0.9, 1.05, 0.95, f32::NAN, -2.0];
        let p = SamplingParams {
            temperature: 0.8,
            top_k: 5,
            top_p: 0.95,
            min_p: 0.02,
            seed: Some(7),
            ..Default::default()
        };
        let mut host = Sampler::new(p.clone());
        let mut device = Sampler::new(p);
        let mut tokens = vec![];
        for _ in 0..64 {
            let want = host.sample(&mut logits.clone(), &[], 0).token.0;
            let dp = device.device_params().expect("no penalties, no logprobs");
            assert_eq!(quire_backend::sample_row(&logits, &dp), want);
            tokens.push(want);
        }
        assert!(tokens.iter().any(|&t| t != tokens[0]), "draws should vary");
    }

    #[test]
    fn device_params_only_for_plain_requests_and_greedy_draws_nothing() {
        let greedy = SamplingParams {
            seed: Some(3),
            ..Default::default()
        };
        let mut s = Sampler::new(greedy.clone());
        assert_eq!(s.device_params(), Some(SampleParams::GREEDY));
        // The stream is untouched: a fresh sampler's first draw comes next.
        let mut fresh = Sampler::new(greedy);
        assert_eq!(s.rng.random::<f64>(), fresh.rng.random::<f64>());
        for p in [
            SamplingParams {
                logprobs: true,
                ..params()
            },
            SamplingParams {
                top_logprobs: 2,
                ..params()
            },
            SamplingParams {
                repetition_penalty: 1.1,
                temperature: 1.0,
                ..params()
            },
            SamplingParams {
                presence_penalty: 0.5,
                ..params()
            },
            SamplingParams {
                frequency_penalty: 0.5,
                ..params()
            },
        ] {
            assert_eq!(Sampler::new(p.clone()).device_params(), None, "{p:?}");
        }
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            repetition_penalty: 1.3,
            repeat_last_n: 0,
            ..params()
        });
        assert!(s.device_params().is_some_and(|d| d.temperature == 1.0));
    }

    #[test]
    fn repetition_penalty_discourages_seen_tokens() {
        let mut s = Sampler::new(SamplingParams {
            repetition_penalty: 2.0,
            ..params()
        });
        let mut l = vec![2.0, 1.5, -1.0];
        assert_eq!(s.sample(&mut l, &[TokenId(0)], 0).token, TokenId(1));
        assert_eq!(l[0], 1.0);
    }

    #[test]
    fn top_logprobs_are_normalized_and_sorted() {
        let l = [0.0f32, 2.0, 1.0];
        let t = top_logprobs(&l, 3);
        assert_eq!(t.iter().map(|e| e.0 .0).collect::<Vec<_>>(), vec![1, 2, 0]);
        let total: f32 = t.iter().map(|e| e.1.exp()).sum();
        assert!((total - 1.0).abs() < 1e-5);
    }
}
