//! Structured outputs: a request's grammar (a JSON Schema, any JSON object, a regular expression
//! or a Lark-like grammar) becomes, before each token, the set of tokens that keep the output a
//! prefix of the grammar's language; the engine sets every other logit to −∞ before sampling.
//!
//! The grammar work is llguidance's (the library llama.cpp, vLLM and mistral.rs use). What lives
//! here is the bridge to quire's tokenizer: the token trie llguidance walks is built from the
//! tokenizer's own byte strings (special tokens carry llguidance's 0xFF marker so no text grammar
//! can produce them), and the model's end-of-generation tokens all count as the grammar's EOS.

use std::collections::HashMap;
use std::sync::Arc;

use llguidance::api::TopLevelGrammar;
use llguidance::toktrie::{SimpleVob, TokEnv, TokRxInfo, TokTrie, TokenizerEnv};
use llguidance::{Matcher, ParserFactory};
use quire_core::{Constraint, FinishReason, SeqId, TokenId};
use quire_tokenizer::Tokenizer;
use rayon::prelude::*;

use crate::EngineError;

/// The tokenizer as llguidance sees it.
struct QuireTokEnv {
    trie: TokTrie,
    tokenizer: Arc<Tokenizer>,
}

impl TokenizerEnv for QuireTokEnv {
    fn tok_trie(&self) -> &TokTrie {
        &self.trie
    }

    /// Used for tokens the grammar forces: the tokenizer's own encoding where the bytes are text,
    /// the trie's greedy split where they are not.
    fn tokenize_bytes(&self, s: &[u8]) -> Vec<u32> {
        match std::str::from_utf8(s) {
            Ok(text) => match self.tokenizer.encode(text, false, false) {
                Ok(ids) => ids.into_iter().map(|t| t.0).collect(),
                Err(_) => self.trie.greedy_tokenize(s),
            },
            Err(_) => self.trie.greedy_tokenize(s),
        }
    }
}

/// Compiles grammars against one tokenizer. Building it walks the whole vocabulary (tens of
/// milliseconds for 50k tokens), so an engine makes one, the first time a request needs it.
pub struct Grammars {
    factory: ParserFactory,
    /// Every token that ends generation (the tokenizer's stop tokens): allowed wherever the
    /// grammar allows its EOS.
    stop_tokens: Vec<TokenId>,
}

impl Grammars {
    pub fn new(tokenizer: &Arc<Tokenizer>) -> Result<Self, EngineError> {
        let vocab = tokenizer.vocab_size();
        let stop_tokens = tokenizer.stop_tokens();
        let eos = stop_tokens
            .first()
            .or(tokenizer.eos().as_ref())
            .map_or(0, |t| t.0);
        let words: Vec<Vec<u8>> = (0..vocab as u32)
            .map(|id| {
                let id = TokenId(id);
                match tokenizer.token_bytes(id) {
                    Some(b) if !tokenizer.is_special(id) && !b.is_empty() => b,
                    _ => {
                        // A control or unknown token: a name no text can spell.
                        let name = tokenizer.token_str(id).unwrap_or("<unk>");
                        let mut w = vec![TokTrie::SPECIAL_TOKEN_MARKER];
                        w.extend_from_slice(format!("{name}[{}]", id.0).as_bytes());
                        w
                    }
                }
            })
            .collect();
        let info = TokRxInfo {
            tok_eos: eos,
            tok_bos: tokenizer.bos().map(|t| t.0),
            tok_pad: tokenizer.pad().map(|t| t.0),
            tok_unk: tokenizer.unk().map(|t| t.0),
            tok_end_of_turn: tokenizer.eot().map(|t| t.0),
            ..TokRxInfo::new(vocab as u32, eos)
        };
        let env: TokEnv = Arc::new(QuireTokEnv {
            trie: TokTrie::from(&info, &words),
            tokenizer: tokenizer.clone(),
        });
        let mut factory = ParserFactory::new_simple(&env).map_err(|e| EngineError::Constraint {
            field: "grammar",
            message: format!("the tokenizer could not be prepared for grammars: {e}"),
        })?;
        factory.quiet();
        Ok(Self {
            factory,
            stop_tokens,
        })
    }

    /// A fresh matcher for `c`, or the reason the grammar is refused (naming the request field).
    pub fn compile(&self, c: &Constraint) -> Result<Guide, EngineError> {
        let refuse = |message: String| EngineError::Constraint {
            field: c.field(),
            message,
        };
        let grammar = match c {
            Constraint::JsonObject => {
                TopLevelGrammar::from_json_schema(serde_json::json!({"type": "object"}))
            }
            Constraint::JsonSchema(text) => {
                let schema: serde_json::Value = serde_json::from_str(text)
                    .map_err(|e| refuse(format!("the JSON schema is not valid JSON: {e}")))?;
                if !(schema.is_object() || schema.is_boolean()) {
                    return Err(refuse("a JSON schema is an object or a boolean".into()));
                }
                TopLevelGrammar::from_json_schema(schema)
            }
            Constraint::Regex(rx) => TopLevelGrammar::from_regex(rx),
            Constraint::Lark(text) => TopLevelGrammar::from_lark(text.clone()),
        };
        let parser = self
            .factory
            .create_parser(grammar)
            .map_err(|e| refuse(format!("the grammar is not accepted: {e}")))?;
        let matcher = Matcher::new(Ok(parser));
        if let Some(e) = matcher.get_error() {
            return Err(refuse(format!("the grammar is not accepted: {e}")));
        }
        Ok(Guide {
            matcher,
            pending: None,
        })
    }

    /// Sets every logit the mask forbids to −∞ (tokens past the tokenizer's vocabulary, which a
    /// padded output layer may have, included); the grammar's EOS allows every stop token.
    /// Returns how many tokens stay allowed.
    ///
    /// `logits`: [vocab] (one row, vocab ≥ the mask's length or not).
    pub fn apply(&self, mask: &SimpleVob, logits: &mut [f32]) -> usize {
        apply_mask(mask, self.also_allowed(mask), logits)
    }

    /// The token argmax picks from `logits` after [`Grammars::apply`], without writing the row:
    /// see [`masked_argmax`].
    ///
    /// `logits`: [vocab] (one row).
    pub fn argmax(&self, mask: &SimpleVob, logits: &[f32]) -> Option<u32> {
        masked_argmax(mask, self.also_allowed(mask), logits)
    }

    /// Writes `mask` as one row of a backend's allowed-token bits (see
    /// `quire_backend::Executor::forward_sample`): the tokens [`Grammars::apply`] would leave
    /// allowed. Returns whether any is.
    ///
    /// `out`: [mask_words(vocab)] (one row).
    pub fn pack(&self, mask: &SimpleVob, out: &mut [u32]) -> bool {
        pack_mask(mask, self.also_allowed(mask), out)
    }

    /// The stop tokens when the grammar allows its EOS (every one of them ends generation),
    /// else none.
    fn also_allowed(&self, mask: &SimpleVob) -> &[TokenId] {
        let eos_ok = self
            .stop_tokens
            .first()
            .is_some_and(|t| t.as_usize() < mask.len() && mask.is_allowed(t.0));
        if eos_ok {
            &self.stop_tokens
        } else {
            &[]
        }
    }

    pub fn is_stop_token(&self, t: TokenId) -> bool {
        self.stop_tokens.contains(&t)
    }
}

/// One request's grammar state.
#[derive(Clone)]
pub struct Guide {
    matcher: Matcher,
    /// A picked token not yet consumed ([`Guide::defer`]).
    pending: Option<TokenId>,
}

impl Guide {
    /// The tokens allowed next, or why there are none (the grammar's own error).
    pub fn mask(&mut self) -> Result<SimpleVob, String> {
        self.matcher.compute_mask().map_err(|e| e.to_string())
    }

    /// Advances past a sampled token.
    pub fn consume(&mut self, t: TokenId) -> Result<(), String> {
        self.matcher.consume_token(t.0).map_err(|e| e.to_string())
    }

    /// The grammar is complete and admits nothing more (only EOS would follow).
    pub fn is_stopped(&self) -> bool {
        self.matcher.is_stopped()
    }

    pub fn is_accepting(&mut self) -> bool {
        self.matcher.is_accepting().unwrap_or(false)
    }

    /// Records a picked token to be consumed by [`Guide::catch_up`], which the next step's mask
    /// task runs first, on rayon's threads during the forward pass: so the engine thread does
    /// not wait for the grammar to advance between steps. A stop token is not recorded (it ends
    /// the request).
    pub fn defer(&mut self, grammars: &Grammars, t: TokenId) {
        if !grammars.is_stop_token(t) {
            self.pending = Some(t);
        }
    }

    /// Consumes the deferred token, if any: `Some(Grammar)` when the grammar refuses it,
    /// `Some(Stop)` when it completes the grammar (the request then ends without another token).
    pub fn catch_up(&mut self) -> Option<FinishReason> {
        let t = self.pending.take()?;
        if self.consume(t).is_err() {
            Some(FinishReason::Grammar)
        } else if self.is_stopped() {
            Some(FinishReason::Stop)
        } else {
            None
        }
    }

    /// Moves the grammar past a sampled token: a stop token leaves it as it is, a token it
    /// refuses ends the request (`end` becomes `Grammar`), a complete grammar ends it (`Stop`).
    pub fn advance(&mut self, grammars: &Grammars, end: &mut Option<FinishReason>, t: TokenId) {
        if grammars.is_stop_token(t) {
            return;
        }
        if self.consume(t).is_err() {
            *end = Some(FinishReason::Grammar);
        } else if self.is_stopped() {
            *end = Some(FinishReason::Stop);
        }
    }
}

/// A request's next-token mask, or why there is none.
pub type MaskResult = Result<SimpleVob, String>;

/// One guided greedy request's row of a step: its logits row, grammar, finish reason and mask.
pub struct GreedyRow<'a> {
    pub id: SeqId,
    pub row: usize,
    pub guide: &'a mut Guide,
    pub end: &'a mut Option<FinishReason>,
    pub mask: MaskResult,
}

/// Greedy picks under grammars, rows in parallel on rayon's threads: each row's argmax over its
/// allowed logits, read in place ([`masked_argmax`]), and its grammar advanced past it. A row
/// whose mask allows nothing (or failed) ends (`Grammar`) with `dead_end`.
///
/// `logits`: ([rows, vocab], vocab).
pub fn greedy_picks(
    rows: Vec<GreedyRow>,
    grammars: &Grammars,
    (logits, vocab): (&[f32], usize),
    dead_end: TokenId,
) -> HashMap<SeqId, TokenId> {
    rows.into_par_iter()
        .map(|r| {
            let l = &logits[r.row * vocab..(r.row + 1) * vocab];
            match r.mask.ok().and_then(|m| grammars.argmax(&m, l)) {
                Some(t) => {
                    r.guide.advance(grammars, r.end, TokenId(t));
                    (r.id, TokenId(t))
                }
                None => {
                    // A grammar that ended before this step keeps its reason.
                    r.end.get_or_insert(FinishReason::Grammar);
                    (r.id, dead_end)
                }
            }
        })
        .collect()
}

/// Sets every logit neither `mask` nor `extra` allows to −∞ (entries past the mask's length
/// too) and returns how many stay. Works a 32-token mask word at a time: a word with no allowed
/// token is one fill, a word with all allowed is skipped, so each logit is touched once. The
/// count is zero exactly when nothing stays allowed (an extra token the mask allows too may
/// count twice).
///
/// `logits`: [vocab] (one row).
pub fn apply_mask(mask: &SimpleVob, extra: &[TokenId], logits: &mut [f32]) -> usize {
    let kept: Vec<(usize, f32)> = extra
        .iter()
        .filter_map(|t| Some((t.as_usize(), *logits.get(t.as_usize())?)))
        .collect();
    let known = mask.len().min(logits.len());
    let mut allowed = 0;
    for (&word, chunk) in mask.as_slice().iter().zip(logits[..known].chunks_mut(32)) {
        match word {
            0 => chunk.fill(f32::NEG_INFINITY),
            u32::MAX => allowed += chunk.len(),
            w => {
                for (bit, l) in chunk.iter_mut().enumerate() {
                    if w >> bit & 1 == 0 {
                        *l = f32::NEG_INFINITY;
                    } else {
                        allowed += 1;
                    }
                }
            }
        }
    }
    logits[known..].fill(f32::NEG_INFINITY);
    for (i, v) in kept {
        if logits[i] == f32::NEG_INFINITY {
            allowed += 1;
        }
        logits[i] = v;
    }
    allowed
}

/// Sets exactly the bits of the tokens `mask` or `extra` allows in `out` (bit `t % 32` of word
/// `t / 32`; tokens past `out` dropped): the tokens [`apply_mask`] leaves allowed in a row of
/// `32 · out.len()` logits. Returns whether any is.
///
/// `out`: [words] (one row).
pub fn pack_mask(mask: &SimpleVob, extra: &[TokenId], out: &mut [u32]) -> bool {
    let src = mask.as_slice();
    let n = mask.len();
    for (k, w) in out.iter_mut().enumerate() {
        let word = src.get(k).copied().unwrap_or(0);
        // Bits past the mask's length are not its tokens.
        *w = match n.saturating_sub(32 * k) {
            0 => 0,
            left if left < 32 => word & ((1u32 << left) - 1),
            _ => word,
        };
    }
    for t in extra {
        if let Some(w) = out.get_mut(t.as_usize() / 32) {
            *w |= 1 << (t.0 % 32);
        }
    }
    out.iter().any(|&w| w != 0)
}

/// The largest logit among the tokens `mask` or `extra` allows — the first of equal maxima,
/// NaN never winning over a number, as `argmax` picks from a row [`apply_mask`] masked — reading
/// only allowed entries (whole words of disallowed tokens are skipped) and writing none. `None`
/// when nothing is allowed. Unlike argmax over a masked row, the pick is an allowed token even
/// when every allowed logit is −∞ or NaN.
///
/// `logits`: [vocab] (one row).
pub fn masked_argmax(mask: &SimpleVob, extra: &[TokenId], logits: &[f32]) -> Option<u32> {
    let known = mask.len().min(logits.len());
    let mut best: Option<(usize, f32)> = None;
    let mut offer = |i: usize, l: f32| {
        let better = match best {
            None => true,
            Some((j, m)) => match (l.is_nan(), m.is_nan()) {
                (false, true) => true,
                (true, false) => false,
                (true, true) => i < j,
                (false, false) => l > m || (l == m && i < j),
            },
        };
        if better {
            best = Some((i, l));
        }
    };
    for (k, (&word, chunk)) in mask
        .as_slice()
        .iter()
        .zip(logits[..known].chunks(32))
        .enumerate()
    {
        // Bits past a short last chunk are not this row's tokens.
        let mut w = if chunk.len() < 32 {
            word & ((1u32 << chunk.len()) - 1)
        } else {
            word
        };
        while w != 0 {
            let bit = w.trailing_zeros() as usize;
            offer(k * 32 + bit, chunk[bit]);
            w &= w - 1;
        }
    }
    for t in extra {
        if let Some(&l) = logits.get(t.as_usize()) {
            offer(t.as_usize(), l);
        }
    }
    best.map(|(i, _)| i as u32)
}

#[cfg(test)]
mod tests {
    use super::*;
    use rand::rngs::StdRng;
    use rand::{Rng, SeedableRng};

    /// The plain reference: a per-token mask check, then the backend's argmax over the row.
    fn reference(mask: &SimpleVob, extra: &[TokenId], logits: &[f32]) -> (Vec<f32>, usize) {
        let mut row = logits.to_vec();
        let mut allowed = 0;
        for (i, l) in row.iter_mut().enumerate() {
            let ok = (i < mask.len() && mask.is_allowed(i as u32))
                || extra.iter().any(|t| t.as_usize() == i);
            if ok {
                allowed += 1;
            } else {
                *l = f32::NEG_INFINITY;
            }
        }
        (row, allowed)
    }

    /// A random mask over `n` tokens mixing empty, full and partial words.
    fn random_mask(rng: &mut StdRng, n: usize) -> SimpleVob {
        let mut m = SimpleVob::alloc(n);
        for w in 0..n.div_ceil(32) {
            let kind = rng.random_range(0..4);
            for t in w * 32..((w + 1) * 32).min(n) {
                let on = match kind {
                    0 => false,
                    1 => true,
                    2 => rng.random_range(0..8) == 0,
                    _ => rng.random::<bool>(),
                };
                if on {
                    m.allow_token(t as u32);
                }
            }
        }
        m
    }

    #[test]
    fn word_wise_mask_and_argmax_match_the_per_token_reference() {
        let mut rng = StdRng::seed_from_u64(26);
        for case in 0..400 {
            let n = rng.random_range(1..300);
            // A padded output layer: logits may run past the mask.
            let vocab = n + [0, 0, 1, 7, 33][case % 5];
            let mask = random_mask(&mut rng, n);
            let extra: Vec<TokenId> = (0..rng.random_range(0..3))
                .map(|_| TokenId(rng.random_range(0..vocab as u32)))
                .collect();
            // Few distinct values, so ties are common; a few NaN and −∞ entries.
            let logits: Vec<f32> = (0..vocab)
                .map(|_| match rng.random_range(0..40) {
                    0 => f32::NAN,
                    1 => f32::NEG_INFINITY,
                    _ => rng.random_range(-4..4) as f32 * 0.5,
                })
                .collect();
            let (want_row, want_n) = reference(&mask, &extra, &logits);
            let mut row = logits.clone();
            let got_n = apply_mask(&mask, &extra, &mut row);
            // The count may count an extra token twice (as the engine always did); only
            // whether it is zero matters to the engine.
            assert_eq!(got_n == 0, want_n == 0, "case {case}: allowed count");
            assert!(
                row.iter()
                    .zip(&want_row)
                    .all(|(a, b)| a.to_bits() == b.to_bits()),
                "case {case}: masked row differs"
            );
            let mut bits = vec![u32::MAX; vocab.div_ceil(32)];
            let any = pack_mask(&mask, &extra, &mut bits);
            assert_eq!(any, want_n > 0, "case {case}: packed mask allows something");
            for (t, l) in want_row.iter().enumerate() {
                let allowed = bits[t / 32] >> (t % 32) & 1 == 1;
                let want = (t < mask.len() && mask.is_allowed(t as u32))
                    || extra.iter().any(|e| e.as_usize() == t);
                assert_eq!(allowed, want, "case {case}: packed bit of token {t} ({l})");
            }
            let got = masked_argmax(&mask, &extra, &logits);
            if want_n == 0 {
                assert_eq!(got, None, "case {case}");
                continue;
            }
            let g = got.expect("something is allowed") as usize;
            let allowed = (g < mask.len() && mask.is_allowed(g as u32))
                || extra.iter().any(|t| t.0 == g as u32);
            assert!(allowed, "case {case}: picked disallowed token {g}");
            // Where some allowed logit is above −∞, the pick is the backend's argmax.
            if want_row.iter().any(|l| *l > f32::NEG_INFINITY) {
                assert_eq!(g as u32, quire_backend::argmax(&want_row), "case {case}");
            }
        }
    }
}
