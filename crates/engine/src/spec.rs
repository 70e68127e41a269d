//! Speculative decoding: a cheap proposer guesses the next few tokens, the target model computes
//! all of them in one forward pass (one logits row per position), and the longest prefix the
//! target agrees with is kept, plus one token of the target's own — so a step emits between 1
//! and K + 1 tokens for the price of one pass over the weights, and the output distribution is
//! exactly the target's.
//!
//! Acceptance follows Leviathan et al. 2023 ("Fast Inference from Transformers via Speculative
//! Decoding"). The n-gram proposer's draft distribution is a point mass on its proposal `d`, so
//! the rule reduces to: accept `d` with probability `p(d)` under the target's (filtered,
//! temperature-scaled) distribution; on rejection draw from `p` with `d` removed and renormalized.
//! Greedy requests accept while the target's argmax equals the proposal, which keeps greedy
//! output token-identical with speculation off.

use quire_core::TokenId;

use crate::sampler::{argmax, Sampler};

/// Speculative-decoding settings of an engine.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SpecConfig {
    /// Most tokens proposed per request and step (0 = off).
    pub num_tokens: usize,
    /// Shortest and longest n-gram the prompt-lookup proposer matches.
    pub ngram_min: usize,
    pub ngram_max: usize,
}

impl Default for SpecConfig {
    fn default() -> Self {
        Self {
            num_tokens: 0,
            ngram_min: 1,
            ngram_max: 3,
        }
    }
}

impl SpecConfig {
    pub fn validate(&self) -> Result<(), String> {
        if self.ngram_min == 0 || self.ngram_min > self.ngram_max {
            return Err(format!(
                "the n-gram range must satisfy 1 <= MIN <= MAX, got {},{}",
                self.ngram_min, self.ngram_max
            ));
        }
        if self.num_tokens > 64 {
            return Err(format!(
                "at most 64 speculative tokens per step, got {}",
                self.num_tokens
            ));
        }
        Ok(())
    }
}

/// Prompt lookup: finds the most recent earlier occurrence of the last `n` tokens (`n` from
/// `max_n` down to `min_n`) and proposes up to `k` tokens that followed it. Empty when nothing
/// matches.
pub fn ngram_propose(tokens: &[TokenId], min_n: usize, max_n: usize, k: usize) -> Vec<TokenId> {
    let len = tokens.len();
    if k == 0 {
        return Vec::new();
    }
    for n in (min_n.max(1)..=max_n).rev() {
        if len < n + 1 {
            continue;
        }
        let pattern = &tokens[len - n..];
        // Start positions of earlier occurrences, most recent first (the suffix itself excluded).
        for start in (0..len - n).rev() {
            if &tokens[start..start + n] == pattern {
                let from = start + n;
                let to = (from + k).min(len);
                return tokens[from..to].to_vec();
            }
        }
    }
    Vec::new()
}

/// Greedy verification: `argmaxes[j]` is the target's pick after proposal `j - 1` (row 0 after
/// the last known token). Returns the accepted proposals followed by the target's own token.
pub fn accept_greedy(proposals: &[TokenId], argmaxes: &[u32]) -> Vec<TokenId> {
    let mut out = Vec::with_capacity(proposals.len() + 1);
    for (j, &t) in argmaxes.iter().enumerate() {
        out.push(TokenId(t));
        if proposals.get(j) != Some(&TokenId(t)) {
            break;
        }
    }
    out
}

/// Sampled verification (rejection sampling against a point-mass draft) for a request whose pick
/// depends on its logits row alone. `rows[j]` are the logits after proposal `j - 1`; there are
/// `proposals.len() + 1` of them. Draws from the request's own random stream.
pub fn accept_sampled(
    sampler: &mut Sampler,
    proposals: &[TokenId],
    rows: &[&[f32]],
) -> Vec<TokenId> {
    let mut out = Vec::with_capacity(proposals.len() + 1);
    for (j, &d) in proposals.iter().enumerate() {
        let probs = sampler.target_probs(rows[j]);
        let p_d = probs
            .iter()
            .find(|&&(id, _)| id == d.0)
            .map_or(0.0, |e| e.1);
        if sampler.uniform() < p_d {
            out.push(d);
            continue;
        }
        // Rejected: the residual max(0, p - q) with q the point mass on d, renormalized.
        out.push(TokenId(draw_without(&probs, d.0, sampler.uniform())));
        return out;
    }
    // Every proposal accepted: the target's own next token from the last row.
    let last = rows[proposals.len()];
    let t = if sampler.params.is_greedy() {
        argmax(last)
    } else {
        let probs = sampler.target_probs(last);
        draw_without(&probs, u32::MAX, sampler.uniform())
    };
    out.push(TokenId(t));
    out
}

/// A draw from `probs` (id, probability) with `skip` removed and the rest renormalized, using the
/// uniform number `u`. When nothing is left (the target was certain of `skip`), `skip` itself.
fn draw_without(probs: &[(u32, f64)], skip: u32, u: f64) -> u32 {
    let total: f64 = probs.iter().filter(|e| e.0 != skip).map(|e| e.1).sum();
    if total <= 0.0 {
        return skip;
    }
    let mut x = u * total;
    let mut last = skip;
    for &(id, p) in probs.iter().filter(|e| e.0 != skip) {
        if x < p {
            return id;
        }
        x -= p;
        last = id;
    }
    last
}

#[cfg(test)]
mod tests {
    use super::*;
    use quire_core::SamplingParams;

    fn t(v: &[u32]) -> Vec<TokenId> {
        v.iter().copied().map(TokenId).collect()
    }

    #[test]
    fn ngram_finds_the_most_recent_longest_match() {
        // ... 1 2 3 [9 9] ... 1 2 3 [7 8] ... 1 2 3 → the later occurrence wins.
        let toks = t(&[1, 2, 3, 9, 9, 0, 1, 2, 3, 7, 8, 5, 1, 2, 3]);
        assert_eq!(ngram_propose(&toks, 1, 3, 2), t(&[7, 8]));
        assert_eq!(ngram_propose(&toks, 1, 3, 10), t(&[7, 8, 5, 1, 2, 3]));
        // A 3-gram beats a more recent 1-gram: "4 5 6" occurred early, "6" alone later.
        let toks = t(&[4, 5, 6, 10, 11, 6, 12, 4, 5, 6]);
        assert_eq!(ngram_propose(&toks, 1, 3, 2), t(&[10, 11]));
        // Only a 1-gram match when MIN allows it.
        let toks = t(&[6, 12, 4, 5, 6]);
        assert_eq!(ngram_propose(&toks, 1, 3, 1), t(&[12]));
        assert!(ngram_propose(&toks, 2, 3, 1).is_empty());
        assert!(ngram_propose(&t(&[1]), 1, 3, 4).is_empty());
        assert!(ngram_propose(&toks, 1, 3, 0).is_empty());
    }

    #[test]
    fn greedy_acceptance_stops_at_the_first_disagreement() {
        assert_eq!(accept_greedy(&t(&[5, 6, 7]), &[5, 6, 8, 1]), t(&[5, 6, 8]));
        assert_eq!(accept_greedy(&t(&[5, 6]), &[5, 6, 9]), t(&[5, 6, 9]));
        assert_eq!(accept_greedy(&t(&[5]), &[4, 5]), t(&[4]));
        assert_eq!(accept_greedy(&[], &[4]), t(&[4]));
    }

    #[test]
    fn rejection_sampling_keeps_the_target_distribution() {
        // Logits with probabilities ~ [0.64, 0.24, 0.09, 0.03] at temperature 1; propose token 1.
        let row = [3.0f32, 2.0, 1.0, 0.0];
        let mut s = Sampler::new(SamplingParams {
            temperature: 1.0,
            seed: Some(5),
            ..Default::default()
        });
        let want: Vec<f64> = s.target_probs(&row).iter().map(|e| e.1).collect();
        let mut ids: Vec<u32> = s.target_probs(&row).iter().map(|e| e.0).collect();
        ids.sort_unstable();
        assert_eq!(ids, vec![0, 1, 2, 3]);
        let n = 40_000;
        let mut counts = [0usize; 4];
        for _ in 0..n {
            let out = accept_sampled(&mut s, &t(&[1]), &[&row, &row]);
            counts[out[0].as_usize()] += 1;
        }
        let probs = s.target_probs(&row);
        for (id, p) in probs {
            let got = counts[id as usize] as f64 / n as f64;
            assert!(
                (got - p).abs() < 0.01,
                "token {id}: {got} vs {p} ({want:?})"
            );
        }
    }
}
