//! SentencePiece-style tokenizer (`tokenizer.ggml.model = "llama"`): BPE without a merge list, where
//! the merge chosen next is the adjacent pair whose concatenation is the vocabulary token with the
//! highest score, and characters no token covers fall back to `<0xAB>` byte tokens.
//!
//! Written here rather than taken from `tokenizers`, whose BPE needs a merge list and whose Unigram
//! model picks the best segmentation globally; neither reproduces llama.cpp's greedy procedure
//! (`llm_tokenizer_spm_session` in llama.cpp's src/llama-vocab.cpp), which the reference follows:
//! start from UTF-8 characters, repeatedly merge the best-scoring adjacent pair (ties: leftmost),
//! then emit each final symbol as its token or as its bytes.

use std::cmp::Ordering;
use std::collections::BinaryHeap;

use crate::vocab::Vocab;

/// The escaped space of SentencePiece, U+2581.
pub(crate) const SPACE_MARK: &str = "\u{2581}";

/// Precomputed lookups of a SentencePiece vocabulary.
#[derive(Debug)]
pub(crate) struct Spm {
    /// The token of each byte: `<0xAB>` if present, else the one-character token of an ASCII byte,
    /// else the unknown token; `None` drops the byte.
    byte_tokens: [Option<u32>; 256],
}

#[derive(Debug, Clone, Copy)]
struct Symbol {
    start: usize,
    len: usize,
    prev: Option<usize>,
    next: Option<usize>,
}

#[derive(Debug, Clone, Copy)]
struct Bigram {
    left: usize,
    right: usize,
    score: f32,
    size: usize,
}

impl PartialEq for Bigram {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}
impl Eq for Bigram {}
impl PartialOrd for Bigram {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}
impl Ord for Bigram {
    /// Max-heap order: higher score first, then the leftmost pair.
    fn cmp(&self, other: &Self) -> Ordering {
        self.score
            .total_cmp(&other.score)
            .then_with(|| other.left.cmp(&self.left))
    }
}

impl Spm {
    pub fn new(vocab: &Vocab) -> Self {
        let mut byte_tokens = [None; 256];
        for (b, slot) in byte_tokens.iter_mut().enumerate() {
            let hex = format!("<0x{b:02X}>");
            *slot = vocab
                .lookup(&hex)
                .or_else(|| {
                    u8::try_from(b)
                        .ok()
                        .filter(u8::is_ascii)
                        .and_then(|c| vocab.lookup(&char::from(c).to_string()))
                })
                .or(vocab.unk);
        }
        Self { byte_tokens }
    }

    /// Appends the ids of `text` to `out`. `text` must already have its spaces escaped to `▁`.
    pub fn encode(&self, vocab: &Vocab, text: &str, out: &mut Vec<u32>) {
        let mut symbols: Vec<Symbol> = Vec::with_capacity(text.len());
        for (i, (start, c)) in text.char_indices().enumerate() {
            symbols.push(Symbol {
                start,
                len: c.len_utf8(),
                prev: i.checked_sub(1),
                next: None,
            });
        }
        let n = symbols.len();
        for (i, sym) in symbols.iter_mut().enumerate() {
            sym.next = Some(i + 1).filter(|&next| next < n);
        }

        let mut queue = BinaryHeap::new();
        let try_add = |queue: &mut BinaryHeap<Bigram>, symbols: &[Symbol], left, right| {
            let (Some(left), Some(right)) = (left, right) else {
                return;
            };
            let (l, r): (Symbol, Symbol) = (symbols[left], symbols[right]);
            let piece = &text[l.start..r.start + r.len];
            if let Some(id) = vocab.lookup(piece) {
                queue.push(Bigram {
                    left,
                    right,
                    score: vocab.scores[id as usize],
                    size: piece.len(),
                });
            }
        };
        for i in 1..n {
            try_add(&mut queue, &symbols, Some(i - 1), Some(i));
        }

        while let Some(bigram) = queue.pop() {
            let (l, r) = (symbols[bigram.left], symbols[bigram.right]);
            // Stale: one side was merged away or grew since the pair was queued.
            if l.len == 0 || r.len == 0 || l.len + r.len != bigram.size {
                continue;
            }
            symbols[bigram.left].len += r.len;
            symbols[bigram.right].len = 0;
            symbols[bigram.left].next = r.next;
            if let Some(next) = r.next {
                symbols[next].prev = Some(bigram.left);
            }
            let merged = symbols[bigram.left];
            try_add(&mut queue, &symbols, merged.prev, Some(bigram.left));
            try_add(&mut queue, &symbols, Some(bigram.left), merged.next);
        }

        let mut at = if n == 0 { None } else { Some(0) };
        while let Some(i) = at {
            let sym = symbols[i];
            let piece = &text[sym.start..sym.start + sym.len];
            match vocab.lookup(piece) {
                Some(id) => out.push(id),
                None => out.extend(piece.bytes().filter_map(|b| self.byte_tokens[b as usize])),
            }
            at = sym.next;
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TokenizerSpec;

    fn vocab(tokens: &[(&str, f32)]) -> Vocab {
        let spec = TokenizerSpec {
            model: "llama".into(),
            tokens: tokens.iter().map(|(t, _)| t.to_string()).collect(),
            scores: tokens.iter().map(|(_, s)| *s).collect(),
            ..Default::default()
        };
        Vocab::from_spec(&spec).expect("vocab")
    }

    #[test]
    fn highest_score_merges_first() {
        // "abc": "ab" (-1) beats "bc" (-2), then "abc" is not a token -> [ab, c].
        let v = vocab(&[
            ("a", -5.0),
            ("b", -5.0),
            ("c", -5.0),
            ("ab", -1.0),
            ("bc", -2.0),
        ]);
        let spm = Spm::new(&v);
        let mut out = Vec::new();
        spm.encode(&v, "abc", &mut out);
        assert_eq!(out, [3, 2]);
    }

    #[test]
    fn ties_merge_leftmost_first() {
        let v = vocab(&[("a", 0.0), ("aa", -1.0)]);
        let spm = Spm::new(&v);
        let mut out = Vec::new();
        spm.encode(&v, "aaa", &mut out);
        assert_eq!(out, [1, 0]);
    }
}
