//! Incremental detokenization for streaming output. A token may hold only part of a UTF-8 character
//! (byte-level BPE and `<0xAB>` byte tokens split multi-byte characters), so text can only be
//! released once its bytes form complete characters; the decoder holds back an incomplete tail.

use quire_core::TokenId;

use crate::Tokenizer;

/// Turns a stream of token ids into text deltas; holds back incomplete UTF-8 sequences.
///
/// The concatenation of everything returned by [`push`](Self::push) and [`flush`](Self::flush)
/// equals [`Tokenizer::decode`] of the same ids.
#[derive(Debug, Default, Clone)]
pub struct StreamDecoder {
    pending: Vec<u8>,
}

impl StreamDecoder {
    pub fn new() -> Self {
        Self::default()
    }

    /// Adds one token and returns the text that became complete (possibly empty). With
    /// `skip_special`, control and unknown tokens add nothing. An id outside the vocabulary adds
    /// nothing.
    pub fn push(&mut self, tokenizer: &Tokenizer, id: TokenId, skip_special: bool) -> String {
        tokenizer.append_piece(id.0, !skip_special, &mut self.pending);
        self.take_complete()
    }

    /// Returns whatever is still held back, invalid bytes replaced by U+FFFD, and resets.
    pub fn flush(&mut self) -> String {
        let rest = std::mem::take(&mut self.pending);
        String::from_utf8_lossy(&rest).into_owned()
    }

    /// Whether bytes are held back waiting for the rest of a character.
    pub fn has_pending(&self) -> bool {
        !self.pending.is_empty()
    }

    /// Releases the longest prefix that is complete: valid UTF-8, with invalid sequences (ones no
    /// later byte can complete) replaced by U+FFFD. Only an incomplete sequence at the very end
    /// stays pending.
    fn take_complete(&mut self) -> String {
        let mut out = String::new();
        let mut start = 0;
        loop {
            match std::str::from_utf8(&self.pending[start..]) {
                Ok(s) => {
                    out.push_str(s);
                    start = self.pending.len();
                    break;
                }
                Err(e) => {
                    let valid = start + e.valid_up_to();
                    // The prefix up to `valid` was just checked to be UTF-8.
                    out.push_str(&String::from_utf8_lossy(&self.pending[start..valid]));
                    match e.error_len() {
                        Some(bad) => {
                            out.push(char::REPLACEMENT_CHARACTER);
                            start = valid + bad;
                        }
                        None => {
                            start = valid;
                            break;
                        }
                    }
                }
            }
        }
        self.pending.drain(..start);
        out
    }
}
