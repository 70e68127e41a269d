//! Prompt lookup that follows one copy. A request that repeats or edits a passage copies it
//! with a few changes; "the continuation of the latest earlier occurrence of the last few
//! tokens" ([`crate::spec::ngram_propose`]) forgets where the copy was after every step, so a
//! common word (" the", ",") jumps to wherever it last occurred, and right after a replaced word
//! that is not in the passage it proposes nothing. [`CopyTracker`] keeps, per sequence, the
//! position in the earlier text that the output is copying from:
//!
//! - while the output keeps agreeing with the source, it proposes the source's continuation;
//! - after a disagreement (a substitution, insertion or deletion), it looks for the last few
//!   tokens near the point where the copy broke off before anywhere else, so the copy resumes
//!   past the edited span; while the new tokens match nothing at all (a word not in the
//!   passage), it guesses that the edit replaced as many tokens as it wrote and proposes the
//!   source's next two tokens after that;
//! - the number of tokens proposed follows the copy's record: one more than half the tokens it
//!   predicted right in a row, up to K. A fresh match of n tokens counts as 3n right; a copy that
//!   resumes near where it broke off keeps half its run from before (one odd token in a long
//!   repeat costs little), one that jumps elsewhere starts over. A rejected guess costs a wider
//!   verify step: on the 2-core development VM each token of a verify step costs about a quarter
//!   of a plain step (`quire bench --spec verify`), so a guess has to be likely to pay. Replayed
//!   with that cost (below), half the streak beats the whole streak on every prompt but one
//!   (rename: 1.82× against 1.85× at K = 8), and a third or a quarter of it.
//!
//! On the default model (`examples/spec_trace.rs` replays greedy outputs step by step), the edit
//! prompt of `quire bench --spec` at K = 8 gets 120 of 160 proposed tokens accepted where the
//! stateless lookup got 124 of 257: a few more steps (42 against 38), but far fewer rejected
//! tokens widening them; at K = 16 the stateless lookup wastes 228 tokens, this one 52. The
//! repeat prompts keep their tokens per step.

use quire_core::TokenId;

/// How far (in tokens) from where a copy broke off a match of 2+ tokens still counts as the
/// copy resuming; a single token must be this close.
const NEAR: usize = 64;
const NEAR_ONE: usize = 4;
/// Guessing a same-length replacement stops after this many unmatched tokens.
const MAX_GUESSED_SPAN: usize = 3;
/// Tokens proposed by such a guess.
const GUESS_LEN: usize = 2;

/// One sequence's copy state.
#[derive(Debug, Default, Clone)]
pub struct CopyTracker {
    /// Tokens of the sequence at the last call.
    seen: usize,
    /// Position of the token the copy predicts next (always before the end), if copying.
    src: Option<usize>,
    /// After the copy broke off: the source position it predicted then, and the tokens written
    /// since.
    broke: Option<(usize, usize)>,
    /// Tokens the copy predicted right in a row (a fresh match of n tokens starts at 3n).
    streak: usize,
    /// `streak` when the copy last broke off.
    before: usize,
    /// Propose all `k` tokens of a copy, not one more than half its streak: for executors whose
    /// verify step costs about what a one-token step does whatever its width (a GPU).
    full_guesses: bool,
}

impl CopyTracker {
    /// A tracker that proposes all `k` tokens of a copy (`full_guesses`) or one more than half its
    /// streak.
    pub fn new(full_guesses: bool) -> Self {
        Self {
            full_guesses,
            ..Self::default()
        }
    }

    /// Up to `k` guesses for the tokens after `tokens` (the sequence so far), matching n-grams of
    /// `min_n..=max_n` tokens.
    pub fn propose(
        &mut self,
        tokens: &[TokenId],
        min_n: usize,
        max_n: usize,
        k: usize,
    ) -> Vec<TokenId> {
        let min_n = min_n.max(1);
        self.follow(tokens);
        let len = tokens.len();
        if k == 0 || len == 0 {
            return Vec::new();
        }
        if let (None, Some((at, written))) = (self.src, self.broke) {
            match resume(tokens, min_n, max_n, at + written) {
                Some((pos, n, near)) => {
                    self.src = Some(pos);
                    self.broke = None;
                    self.streak = if near { n + self.before / 2 } else { n };
                }
                None if written <= MAX_GUESSED_SPAN && at + written < len => {
                    let from = at + written;
                    return tokens[from..(from + GUESS_LEN.min(k)).min(len)].to_vec();
                }
                None => {}
            }
        }
        if self.src.is_none() {
            let (pos, n) = match latest(tokens, min_n, max_n) {
                Some(m) => m,
                None => return Vec::new(),
            };
            self.src = Some(pos);
            self.broke = None;
            self.streak = 3 * n;
        }
        let from = self.src.expect("set above");
        let n = if self.full_guesses {
            k
        } else {
            k.min(self.streak / 2 + 1)
        };
        tokens[from..(from + n).min(len)].to_vec()
    }

    /// Advances the copy over the tokens written since the last call; notes where it broke off.
    fn follow(&mut self, tokens: &[TokenId]) {
        if tokens.len() < self.seen {
            // Not the same sequence any more.
            *self = Self {
                full_guesses: self.full_guesses,
                ..Self::default()
            };
        }
        for i in self.seen..tokens.len() {
            match self.src {
                Some(s) if s < i && tokens[s] == tokens[i] => {
                    self.src = Some(s + 1);
                    self.streak += 1;
                }
                Some(s) => {
                    self.src = None;
                    self.broke = Some((s, 1));
                    self.before = self.streak;
                    self.streak = 0;
                }
                None => {
                    if let Some((_, written)) = &mut self.broke {
                        *written += 1;
                    }
                    self.streak = 0;
                }
            }
        }
        self.seen = tokens.len();
    }
}

/// Where the copy resumes after it broke off, the source having reached `expect` had every
/// written token replaced one for one: the end of the longest suffix n-gram (`max_n` down to
/// `min_n`) that occurs earlier, the occurrence nearest `expect` when one is near (64 tokens, 4
/// for a single token), else the latest. Returns (position after the match, n, whether near).
fn resume(
    tokens: &[TokenId],
    min_n: usize,
    max_n: usize,
    expect: usize,
) -> Option<(usize, usize, bool)> {
    let len = tokens.len();
    for n in (min_n..=max_n).rev() {
        if len < n + 1 {
            continue;
        }
        let pattern = &tokens[len - n..];
        let near = if n > 1 { NEAR } else { NEAR_ONE };
        let mut best: Option<(usize, usize)> = None; // (distance, end)
        let mut last = None;
        for start in 0..len - n {
            if &tokens[start..start + n] != pattern {
                continue;
            }
            let end = start + n;
            last = Some(end);
            let d = end.abs_diff(expect);
            // Nearest first; of two as near, the later.
            if d <= near && best.is_none_or(|b| d <= b.0) {
                best = Some((d, end));
            }
        }
        if let Some((_, end)) = best {
            return Some((end, n, true));
        }
        if let Some(end) = last {
            return Some((end, n, false));
        }
    }
    None
}

/// The end of the latest earlier occurrence of the longest suffix n-gram, and n.
fn latest(tokens: &[TokenId], min_n: usize, max_n: usize) -> Option<(usize, usize)> {
    let len = tokens.len();
    for n in (min_n..=max_n).rev() {
        if len < n + 1 {
            continue;
        }
        let pattern = &tokens[len - n..];
        if let Some(start) = (0..len - n).rev().find(|&s| &tokens[s..s + n] == pattern) {
            return Some((start + n, n));
        }
    }
    None
}

#[cfg(test)]
mod tests {
    use super::*;

    fn t(v: &[u32]) -> Vec<TokenId> {
        v.iter().copied().map(TokenId).collect()
    }

    /// The source passage 10..=29, a separator, then `out`.
    fn seq(out: &[u32]) -> Vec<TokenId> {
        let mut v: Vec<u32> = (10..30).collect();
        v.push(1);
        v.extend_from_slice(out);
        t(&v)
    }

    /// Feeds `out` token by token (as the engine would after each step) and returns the last
    /// proposal.
    fn run(c: &mut CopyTracker, out: &[u32], k: usize) -> Vec<TokenId> {
        let mut last = Vec::new();
        for i in 1..=out.len() {
            last = c.propose(&seq(&out[..i]), 1, 3, k);
        }
        last
    }

    #[test]
    fn a_long_copy_proposes_k_and_a_fresh_one_a_few() {
        let mut c = CopyTracker::default();
        // The first token matches one source token: a streak of 3 * 1, 3 / 2 + 1 proposed.
        assert_eq!(run(&mut c, &[10], 8), t(&[11, 12]));
        // Seven copied: a streak of 9, 5 proposed; fifteen: 17, K.
        let mut c = CopyTracker::default();
        let out: Vec<u32> = (10..17).collect();
        assert_eq!(run(&mut c, &out, 8), t(&(17..22).collect::<Vec<_>>()));
        let mut c = CopyTracker::default();
        let out: Vec<u32> = (10..25).collect();
        assert_eq!(run(&mut c, &out, 8), t(&[25, 26, 27, 28, 29, 1, 10, 11]));
        // Capped by what exists after the source.
        let mut c = CopyTracker::default();
        let out: Vec<u32> = (10..28).collect();
        assert_eq!(run(&mut c, &out, 8), t(&[28, 29, 1, 10, 11, 12, 13, 14]));
    }

    #[test]
    fn a_long_copy_keeps_half_its_run_over_one_odd_token() {
        // 16 tokens copied (a streak of 18), 26 replaced by 99, then 27: the copy resumes at
        // once with 1 + 18 / 2 = 10 behind it, 6 proposed.
        let mut out: Vec<u32> = (10..26).collect();
        out.extend_from_slice(&[99, 27]);
        let mut c = CopyTracker::default();
        assert_eq!(run(&mut c, &out, 8), t(&[28, 29, 1, 10, 11, 12]));
        // After a short copy the same edit leaves a short guess (a streak of 1 + 3 / 2).
        let mut c = CopyTracker::default();
        assert_eq!(run(&mut c, &[25, 99, 27], 8), t(&[28, 29]));
    }

    #[test]
    fn a_substituted_word_is_skipped_in_the_source() {
        let mut c = CopyTracker::default();
        // 14 replaced by 99 (in nothing earlier): the source's tokens after 14.
        assert_eq!(run(&mut c, &[10, 11, 12, 13, 99], 8), t(&[15, 16]));
        // Two new tokens for one: after the guess fails, the copy resumes where 15 is.
        let mut c = CopyTracker::default();
        run(&mut c, &[10, 11, 12, 13, 99, 98], 8);
        assert_eq!(
            run(&mut c, &[10, 11, 12, 13, 99, 98, 15], 8),
            t(&[16, 17, 18])
        );
    }

    #[test]
    fn the_copy_resumes_after_an_insertion_and_a_deletion() {
        // Inserted 99 before 14: once 14 is written the copy goes on from 15.
        let mut c = CopyTracker::default();
        assert_eq!(run(&mut c, &[10, 11, 12, 13, 99, 14], 8)[..2], t(&[15, 16]));
        // 14 and 15 deleted: 16 follows 13, and the copy goes on from 17.
        let mut c = CopyTracker::default();
        assert_eq!(run(&mut c, &[10, 11, 12, 13, 16], 8)[..2], t(&[17, 18]));
    }

    #[test]
    fn the_current_copy_beats_a_later_occurrence() {
        // Source 10..=29 where 12 also occurs later, followed by 50: the old lookup takes the
        // latest 12 (then 50), the copy takes the 13 it is copying.
        let mut v: Vec<u32> = (10..30).collect();
        v.extend_from_slice(&[7, 12, 50, 1]);
        let mut c = CopyTracker::default();
        for x in [10, 11, 12] {
            v.push(x);
            c.propose(&t(&v), 1, 1, 4);
        }
        assert_eq!(crate::spec::ngram_propose(&t(&v), 1, 1, 1), t(&[50]));
        assert_eq!(c.propose(&t(&v), 1, 1, 1), t(&[13]));
    }

    #[test]
    fn nothing_is_proposed_when_nothing_matches() {
        let mut c = CopyTracker::default();
        assert!(c.propose(&t(&[1, 2, 3, 4]), 1, 3, 4).is_empty());
        assert!(c.propose(&t(&[1, 2, 3, 4, 5]), 1, 3, 4).is_empty());
        assert!(c.propose(&t(&[]), 1, 3, 4).is_empty());
        // K = 0 and 2-grams only.
        assert!(c.propose(&t(&[1, 2, 1]), 1, 3, 0).is_empty());
        let mut c = CopyTracker::default();
        assert!(c.propose(&t(&[1, 2, 1]), 2, 3, 4).is_empty());
        // Far from the break-off and never seen: no guess after three unmatched tokens.
        let mut c = CopyTracker::default();
        assert!(run(&mut c, &[10, 11, 12, 97, 98, 99, 96], 8).is_empty());
    }

    #[test]
    fn a_shorter_sequence_starts_over() {
        let mut c = CopyTracker::default();
        run(&mut c, &[10, 11, 12, 13, 14, 15], 8);
        // Another sequence under the same tracker: no stale copy position.
        assert_eq!(c.propose(&t(&[5, 6, 5]), 1, 3, 8), t(&[6, 5]));
    }
}
