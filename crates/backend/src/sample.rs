//! Choosing a token from one logits row: top-k, top-p and min-p on the unscaled distribution, then
//! temperature, then a draw with a uniform number the caller supplies. The engine's host sampler
//! calls this, and it is the reference the CUDA kernel (`cuda/kernels/sample.cu`) is held to, so
//! it lives in the backend crate. Pure: the randomness is the caller's (`SampleParams::u`).

use crate::BackendError;

/// How one logits row becomes a token.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct SampleParams {
    /// 0 or below: the argmax (greedy), and the other fields are ignored.
    pub temperature: f32,
    /// 0 means disabled.
    pub top_k: u32,
    /// 1.0 means disabled.
    pub top_p: f32,
    /// 0.0 means disabled.
    pub min_p: f32,
    /// The uniform draw in [0, 1).
    pub u: f64,
}

impl SampleParams {
    /// Plain argmax.
    pub const GREEDY: SampleParams = SampleParams {
        temperature: 0.0,
        top_k: 0,
        top_p: 1.0,
        min_p: 0.0,
        u: 0.0,
    };

    /// Rejects values a kernel cannot give a meaning to (NaN, u outside [0, 1)).
    pub fn check(&self) -> Result<(), BackendError> {
        let bad = |m: String| Err(BackendError::InvalidBatch(m));
        if self.temperature.is_nan() {
            return bad("sampling temperature is NaN".into());
        }
        if self.top_p.is_nan() || self.min_p.is_nan() {
            return bad(format!(
                "top_p ({}) and min_p ({}) must be numbers",
                self.top_p, self.min_p
            ));
        }
        if !(0.0..1.0).contains(&self.u) {
            return bad(format!(
                "the uniform draw must lie in [0, 1), got {}",
                self.u
            ));
        }
        Ok(())
    }
}

/// The token `p` picks from `logits`: see [`sample_row_with`].
pub fn sample_row(logits: &[f32], p: &SampleParams) -> u32 {
    sample_row_with(logits, p, &mut Vec::new())
}

/// The token `p` picks from `logits` (`[vocab]`), with `cand` as scratch.
///
/// Temperature ≤ 0: [`crate::argmax`]. Otherwise the candidates are the finite logits (none:
/// token 0); with `0 < top_k < len` the `top_k` largest by (logit desc, id asc) stay; they are
/// sorted so; f32 probabilities `exp(l - max) / z` of the unscaled distribution cut the list to
/// the shortest prefix reaching `top_p` (when `top_p < 1`) and to those at least
/// `min_p · probs[0]` (when `min_p > 0`; at least one); then weights `exp((l - max) / T)` in f64,
/// and the first id where `u · total` falls inside its weight along the sorted prefix (else the
/// last kept id).
pub fn sample_row_with(logits: &[f32], p: &SampleParams, cand: &mut Vec<(f32, u32)>) -> u32 {
    if p.temperature <= 0.0 {
        return crate::argmax(logits);
    }
    cand.clear();
    cand.extend(
        logits
            .iter()
            .enumerate()
            .filter(|(_, l)| l.is_finite())
            .map(|(i, &l)| (l, i as u32)),
    );
    draw_from(cand, p)
}

/// Words of one row's allowed-token mask over a vocabulary of `vocab` tokens: bit `t % 32` of
/// word `t / 32` is token `t`.
pub fn mask_words(vocab: usize) -> usize {
    vocab.div_ceil(32)
}

/// Whether `mask` (one row's words, see [`mask_words`]) allows token `t`; tokens past its words
/// are not allowed.
pub fn mask_allows(mask: &[u32], t: usize) -> bool {
    mask.get(t / 32).is_some_and(|w| w >> (t % 32) & 1 == 1)
}

/// The token `p` picks from `logits` when only the tokens `mask` allows may be picked (`None`:
/// all may): exactly [`sample_row_with`] on the row with every other logit set to −∞. So the
/// pick is an allowed token whenever an allowed logit is finite (greedy: whenever one is above
/// −∞ and not NaN); a row with none gives what `sample_row_with` gives a row of −∞ (token 0),
/// and callers that can meet such rows (a grammar's dead end) check for them themselves. The
/// reference the device samplers' masks are held to.
///
/// `logits`: [vocab]; `mask`: [mask_words(vocab)] (words past the row are ignored).
pub fn sample_row_masked(
    logits: &[f32],
    mask: Option<&[u32]>,
    p: &SampleParams,
    cand: &mut Vec<(f32, u32)>,
) -> u32 {
    let Some(mask) = mask else {
        return sample_row_with(logits, p, cand);
    };
    let masked = |i: usize, l: f32| {
        if mask_allows(mask, i) {
            l
        } else {
            f32::NEG_INFINITY
        }
    };
    if p.temperature <= 0.0 {
        // The allowed entries first, a mask word at a time: where the best of them is a number
        // above −∞ it is the masked row's argmax (every other entry is −∞ there).
        let mut best: Option<(usize, f32)> = None;
        for (k, &word) in mask.iter().enumerate() {
            let mut w = word;
            while w != 0 {
                let i = 32 * k + w.trailing_zeros() as usize;
                w &= w - 1;
                match logits.get(i) {
                    Some(&l) if !l.is_nan() && best.is_none_or(|(_, b)| l > b) => {
                        best = Some((i, l))
                    }
                    _ => {}
                }
            }
        }
        if let Some((i, _)) = best.filter(|&(_, l)| l > f32::NEG_INFINITY) {
            return i as u32;
        }
        // Else every entry is −∞ or NaN: `argmax` over the masked row, without writing it.
        let mut best = (0usize, masked(0, logits.first().copied().unwrap_or(0.0)));
        for (i, &l) in logits.iter().enumerate() {
            let l = masked(i, l);
            if l > best.1 || best.1.is_nan() && !l.is_nan() {
                best = (i, l);
            }
        }
        return best.0 as u32;
    }
    cand.clear();
    cand.extend(
        logits
            .iter()
            .enumerate()
            .filter(|&(i, l)| l.is_finite() && mask_allows(mask, i))
            .map(|(i, &l)| (l, i as u32)),
    );
    draw_from(cand, p)
}

/// The rest of [`sample_row_with`] once `c` holds the row's candidates (its finite logits).
fn draw_from(c: &mut Vec<(f32, u32)>, p: &SampleParams) -> u32 {
    if c.is_empty() {
        return 0;
    }
    let by_logit_desc = |a: &(f32, u32), b: &(f32, u32)| b.0.total_cmp(&a.0).then(a.1.cmp(&b.1));
    let top_k = p.top_k as usize;
    if top_k > 0 && top_k < c.len() {
        c.select_nth_unstable_by(top_k - 1, by_logit_desc);
        c.truncate(top_k);
    }
    c.sort_unstable_by(by_logit_desc);
    // Probabilities of the unscaled distribution for top-p and min-p.
    let mx = c[0].0;
    let mut probs: Vec<f32> = c.iter().map(|&(l, _)| (l - mx).exp()).collect();
    let z: f32 = probs.iter().sum();
    probs.iter_mut().for_each(|v| *v /= z);
    let mut keep = c.len();
    if p.top_p < 1.0 {
        let mut cum = 0.0;
        for (i, &pr) in probs.iter().enumerate() {
            cum += pr;
            if cum >= p.top_p {
                keep = i + 1;
                break;
            }
        }
    }
    if p.min_p > 0.0 {
        let floor = p.min_p * probs[0];
        keep = keep.min(probs.iter().take_while(|&&pr| pr >= floor).count().max(1));
    }
    c.truncate(keep);
    let t = p.temperature;
    let weights: Vec<f64> = c
        .iter()
        .map(|&(l, _)| (((l - mx) / t) as f64).exp())
        .collect();
    let total: f64 = weights.iter().sum();
    let mut u = p.u * total;
    for (w, &(_, id)) in weights.iter().zip(c.iter()) {
        if u < *w {
            return id;
        }
        u -= w;
    }
    c.last().map(|e| e.1).unwrap_or(0)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn params(temperature: f32, top_k: u32, top_p: f32, min_p: f32, u: f64) -> SampleParams {
        SampleParams {
            temperature,
            top_k,
            top_p,
            min_p,
            u,
        }
    }

    /// The token at every u of a fine grid: which ids are reachable, and how often.
    fn histogram(logits: &[f32], p: SampleParams, n: usize) -> Vec<usize> {
        let mut h = vec![0; logits.len()];
        for i in 0..n {
            let u = (i as f64 + 0.5) / n as f64;
            h[sample_row(logits, &SampleParams { u, ..p }) as usize] += 1;
        }
        h
    }

    #[test]
    fn top_k_ties_keep_the_lowest_ids() {
        // Four equal maxima; top_k 2 keeps ids 1 and 3 (the lowest), each half of the draws.
        let l = [0.0f32, 5.0, -1.0, 5.0, 5.0, 2.0, 5.0];
        let h = histogram(&l, params(1.0, 2, 1.0, 0.0, 0.0), 1000);
        assert_eq!(h, vec![0, 500, 0, 500, 0, 0, 0]);
        // top_k 1 among ties is the first of them at any temperature.
        for u in [0.0, 0.5, 0.999] {
            assert_eq!(sample_row(&l, &params(7.0, 1, 1.0, 0.0, u)), 1);
        }
        // A tie straddling the cut: 9.0 first, then the 5.0s by id.
        let l = [5.0f32, 9.0, 5.0, 5.0];
        let h = histogram(&l, params(100.0, 3, 1.0, 0.0, 0.0), 3000);
        assert!(h[0] > 0 && h[1] > 0 && h[2] > 0 && h[3] == 0, "{h:?}");
    }

    #[test]
    fn top_p_keeps_the_shortest_prefix_reaching_p() {
        // probabilities ~ [0.6439, 0.2369, 0.0871, 0.0321]
        let l = [1.0f32, 3.0, 0.0, 2.0];
        let reach = |top_p: f32| {
            let h = histogram(&l, params(1.0, 0, top_p, 0.0, 0.0), 2000);
            h.iter().filter(|&&c| c > 0).count()
        };
        assert_eq!(reach(0.5), 1);
        assert_eq!(reach(0.6439), 1);
        assert_eq!(reach(0.65), 2);
        assert_eq!(reach(0.88), 2);
        assert_eq!(reach(0.9), 3);
        assert_eq!(reach(0.99), 4);
        assert_eq!(reach(1.0), 4);
        // The kept prefix is ids 1, 3, 0 in that order: u just below 1 picks the last kept.
        assert_eq!(sample_row(&l, &params(1.0, 0, 0.9, 0.0, 0.999_999)), 0);
    }

    #[test]
    fn min_p_drops_tokens_below_a_fraction_of_the_best() {
        // p / p_max = [1, 0.368, 0.135, 0.0498]
        let l = [3.0f32, 2.0, 1.0, 0.0];
        let kept = |min_p: f32| {
            let h = histogram(&l, params(1.0, 0, 1.0, min_p, 0.0), 2000);
            h.iter().filter(|&&c| c > 0).count()
        };
        assert_eq!(kept(0.0), 4);
        assert_eq!(kept(0.04), 4);
        assert_eq!(kept(0.1), 3);
        assert_eq!(kept(0.3), 2);
        assert_eq!(kept(0.5), 1);
        // At 1 only tokens as likely as the best pass.
        assert_eq!(kept(1.0), 1);
    }

    #[test]
    fn low_temperature_tends_to_argmax_and_zero_is_argmax() {
        let l = [0.5f32, 2.0, 1.999, -3.0, 2.0];
        assert_eq!(sample_row(&l, &params(0.0, 0, 1.0, 0.0, 0.7)), 1);
        assert_eq!(sample_row(&l, &params(-1.0, 0, 1.0, 0.0, 0.7)), 1);
        // Near zero, only the two equal maxima (ids 1 and 4, in id order) share the draws.
        let h = histogram(&l, params(1e-4, 0, 1.0, 0.0, 0.0), 1000);
        assert_eq!(h, vec![0, 500, 0, 0, 500]);
        let h = histogram(&[0.5f32, 2.0, 1.999], params(1e-5, 0, 1.0, 0.0, 0.0), 1000);
        assert_eq!(h, vec![0, 1000, 0]);
    }

    #[test]
    fn u_at_the_ends_picks_the_first_and_last_kept() {
        let l = [1.0f32, 4.0, 3.0, 2.0];
        let p = params(1.0, 3, 1.0, 0.0, 0.0);
        assert_eq!(sample_row(&l, &p), 1);
        assert_eq!(sample_row(&l, &SampleParams { u: 1e-12, ..p }), 1);
        // Kept: 1, 2, 3 (top 3); the largest u below 1 lands on the last of them.
        assert_eq!(
            sample_row(
                &l,
                &SampleParams {
                    u: 1.0 - 1e-12,
                    ..p
                }
            ),
            3
        );
        let before_1 = f64::from_bits(1f64.to_bits() - 1);
        assert_eq!(sample_row(&l, &SampleParams { u: before_1, ..p }), 3);
        // The first boundary: p(1) = 1 / (1 + e^-1 + e^-2).
        let w1 = 1.0 / (1.0 + (-1f64).exp() + (-2f64).exp());
        assert_eq!(sample_row(&l, &SampleParams { u: w1 - 1e-9, ..p }), 1);
        assert_eq!(sample_row(&l, &SampleParams { u: w1 + 1e-9, ..p }), 2);
    }

    #[test]
    fn non_finite_logits_are_never_candidates() {
        let l = [
            f32::NAN,
            f32::INFINITY,
            1.0,
            f32::NEG_INFINITY,
            0.5,
            f32::NAN,
        ];
        let h = histogram(&l, params(1.0, 0, 1.0, 0.0, 0.0), 1000);
        assert_eq!((h[0], h[1], h[3], h[5]), (0, 0, 0, 0), "{h:?}");
        assert!(h[2] > h[4] && h[4] > 0, "{h:?}");
        // Greedy is the host argmax: +inf wins there.
        assert_eq!(sample_row(&l, &params(0.0, 0, 1.0, 0.0, 0.0)), 1);
    }

    #[test]
    fn a_row_without_finite_logits_gives_token_zero() {
        let l = [f32::NEG_INFINITY, f32::NAN, f32::NEG_INFINITY];
        for u in [0.0, 0.3, 0.99] {
            assert_eq!(sample_row(&l, &params(1.0, 2, 0.5, 0.1, u)), 0);
        }
        assert_eq!(sample_row(&[], &params(1.0, 0, 1.0, 0.0, 0.5)), 0);
    }

    #[test]
    fn check_rejects_nan_and_u_outside_the_unit_interval() {
        let ok = params(0.8, 40, 0.9, 0.05, 0.25);
        assert!(ok.check().is_ok());
        assert!(SampleParams::GREEDY.check().is_ok());
        for bad in [
            SampleParams { u: 1.0, ..ok },
            SampleParams { u: -0.1, ..ok },
            SampleParams { u: f64::NAN, ..ok },
            SampleParams {
                temperature: f32::NAN,
                ..ok
            },
            SampleParams {
                top_p: f32::NAN,
                ..ok
            },
        ] {
            assert!(bad.check().is_err(), "{bad:?}");
        }
    }

    #[test]
    fn masked_sampling_is_sampling_the_row_with_disallowed_logits_at_minus_infinity() {
        use rand::{Rng, SeedableRng};
        let mut rng = rand::rngs::StdRng::seed_from_u64(37);
        let mut cand = Vec::new();
        for case in 0..3000 {
            let vocab = rng.random_range(1..200);
            // Few distinct values (ties), some NaN and infinities.
            let logits: Vec<f32> = (0..vocab)
                .map(|_| match rng.random_range(0..30) {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    2 => f32::INFINITY,
                    _ => rng.random_range(-6..6) as f32 * 0.5,
                })
                .collect();
            // Masks of every density, one allowed token, none; short masks and stray high bits.
            let mut mask = vec![0u32; mask_words(vocab) - usize::from(case % 17 == 0)];
            match case % 5 {
                0 => mask.iter_mut().for_each(|w| *w = rng.random()),
                1 => {
                    let t = rng.random_range(0..vocab);
                    if let Some(w) = mask.get_mut(t / 32) {
                        *w |= 1 << (t % 32);
                    }
                }
                2 => {}
                3 => mask.iter_mut().for_each(|w| *w = !0),
                _ => (0..vocab)
                    .filter(|_| rng.random_range(0..8) == 0)
                    .for_each(|t| {
                        if let Some(w) = mask.get_mut(t / 32) {
                            *w |= 1 << (t % 32);
                        }
                    }),
            }
            let row: Vec<f32> = logits
                .iter()
                .enumerate()
                .map(|(i, &l)| {
                    if mask_allows(&mask, i) {
                        l
                    } else {
                        f32::NEG_INFINITY
                    }
                })
                .collect();
            let p = if case % 3 == 0 {
                SampleParams::GREEDY
            } else {
                params(
                    rng.random_range(0.2..2.0),
                    rng.random_range(0..5),
                    rng.random_range(0.3..1.0),
                    rng.random_range(0.0..0.3),
                    rng.random(),
                )
            };
            let got = sample_row_masked(&logits, Some(&mask), &p, &mut cand);
            assert_eq!(got, sample_row(&row, &p), "case {case}: {p:?}");
            let any_allowed = if p.temperature > 0.0 {
                row.iter().any(|l| l.is_finite())
            } else {
                row.iter().any(|l| *l > f32::NEG_INFINITY)
            };
            if any_allowed {
                assert!(
                    mask_allows(&mask, got as usize),
                    "case {case}: {got} is not allowed"
                );
            }
            assert_eq!(
                sample_row_masked(&logits, None, &p, &mut cand),
                sample_row(&logits, &p),
                "case {case}: no mask"
            );
        }
    }
}
