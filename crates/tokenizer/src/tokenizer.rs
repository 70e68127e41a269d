//! The [`Tokenizer`]: text <-> token ids for one model, with llama.cpp's behaviour for special
//! tokens, BOS/EOS and the SentencePiece space prefix, so that prompts tokenize to the same ids as
//! in the llama.cpp reference runs.

use std::borrow::Cow;

use quire_core::TokenId;

use crate::bpe::{ByteLevelBpe, ByteTable};
use crate::spec::{TokenType, TokenizerSpec};
use crate::spm::{Spm, SPACE_MARK};
use crate::vocab::{attr, Fragment, Vocab};
use crate::TokenizerError;

/// A fragment of text to tokenize, or a special token already recognised.
enum Piece<'a> {
    Text(Cow<'a, str>),
    Token(u32),
}

#[derive(Debug)]
enum Model {
    /// `"gpt2"`: byte-level BPE.
    Bpe(Box<ByteLevelBpe>),
    /// `"llama"`: SentencePiece-style, score-driven merges.
    Spm(Box<Spm>),
}

/// A tokenizer built from a [`TokenizerSpec`]. Immutable once built; share it between threads.
#[derive(Debug)]
pub struct Tokenizer {
    vocab: Vocab,
    model: Model,
    bytes: ByteTable,
    add_bos: bool,
    add_eos: bool,
    add_space_prefix: bool,
}

impl Tokenizer {
    /// Builds the tokenizer. Special-token ids outside the vocabulary are treated as absent.
    pub fn from_spec(spec: TokenizerSpec) -> Result<Self, TokenizerError> {
        let vocab = Vocab::from_spec(&spec)?;
        let model = match spec.model.as_str() {
            "gpt2" => Model::Bpe(Box::new(ByteLevelBpe::new(
                &vocab,
                &spec.merges,
                spec.pre.as_deref(),
            )?)),
            "llama" => Model::Spm(Box::new(Spm::new(&vocab))),
            other => return Err(TokenizerError::UnsupportedModel(other.to_string())),
        };
        if spec.add_bos_token && vocab.bos.is_none() {
            return Err(TokenizerError::InvalidSpec(
                "add_bos_token is set but there is no (valid) bos_token_id".into(),
            ));
        }
        if spec.add_eos_token && vocab.eos.is_none() {
            return Err(TokenizerError::InvalidSpec(
                "add_eos_token is set but there is no (valid) eos_token_id".into(),
            ));
        }
        Ok(Self {
            vocab,
            model,
            bytes: ByteTable::new(),
            add_bos: spec.add_bos_token,
            add_eos: spec.add_eos_token,
            add_space_prefix: spec.add_space_prefix,
        })
    }

    /// Tokenizes `text`.
    ///
    /// `add_special` adds BOS (and EOS) where the model asks for them (`add_bos_token`,
    /// `add_eos_token`). With `parse_special`, control tokens written in the text (such as
    /// `<|im_start|>`) become their single token; without it they are tokenized as plain text.
    /// User-defined tokens are always recognised, as in llama.cpp.
    pub fn encode(
        &self,
        text: &str,
        add_special: bool,
        parse_special: bool,
    ) -> Result<Vec<TokenId>, TokenizerError> {
        self.encode_segments(&[(text, parse_special)], add_special)
    }

    /// Tokenizes the concatenation of `segments`, each `(text, parse_special)`: special-token text
    /// in a segment with `parse_special` off stays plain text. Text on both sides of a segment
    /// boundary is tokenized as one piece, so the ids equal `encode` of the joined text wherever no
    /// special token differs. This is how chat message content is kept from forging control tokens.
    pub fn encode_segments(
        &self,
        segments: &[(&str, bool)],
        add_special: bool,
    ) -> Result<Vec<TokenId>, TokenizerError> {
        let frags = self.merged_fragments(segments);
        let len: usize = segments.iter().map(|s| s.0.len()).sum();
        let mut out: Vec<u32> = Vec::with_capacity(len / 3 + 2);
        if add_special && self.add_bos {
            out.extend(self.vocab.bos);
        }
        match &self.model {
            Model::Bpe(bpe) => {
                for frag in frags {
                    match frag {
                        Piece::Text(t) => bpe.encode(&t, &mut out)?,
                        Piece::Token(id) => out.push(id),
                    }
                }
            }
            Model::Spm(spm) => {
                // A space is prefixed to the first text and to text right after a special token.
                let mut prev_special = true;
                for frag in frags {
                    match frag {
                        Piece::Text(t) => {
                            let mut s = String::with_capacity(t.len() + 4);
                            if self.add_space_prefix && prev_special {
                                s.push(' ');
                            }
                            s.push_str(&t);
                            let escaped = s.replace(' ', SPACE_MARK);
                            spm.encode(&self.vocab, &escaped, &mut out);
                            prev_special = false;
                        }
                        Piece::Token(id) => {
                            out.push(id);
                            prev_special = true;
                        }
                    }
                }
            }
        }
        if add_special && self.add_eos {
            out.extend(self.vocab.eos);
        }
        Ok(out.into_iter().map(TokenId).collect())
    }

    /// Each segment cut into special tokens and text, with text that meets across a segment
    /// boundary joined again.
    fn merged_fragments<'a>(&self, segments: &[(&'a str, bool)]) -> Vec<Piece<'a>> {
        let mut out: Vec<Piece<'a>> = Vec::new();
        for &(text, parse_special) in segments {
            for frag in self.vocab.partition(text, parse_special) {
                match (frag, out.last_mut()) {
                    (Fragment::Text(t), Some(Piece::Text(prev))) => prev.to_mut().push_str(t),
                    (Fragment::Text(t), _) => out.push(Piece::Text(Cow::Borrowed(t))),
                    (Fragment::Token(id), _) => out.push(Piece::Token(id)),
                }
            }
        }
        out
    }

    /// The first control or unknown token (such as `<|im_start|>`) whose text occurs in `text`,
    /// i.e. one that `encode(.., parse_special = true)` would turn into that token.
    pub fn control_text_in(&self, text: &str) -> Option<&str> {
        self.vocab
            .partition(text, true)
            .iter()
            .find_map(|f| match f {
                Fragment::Token(id) if self.vocab.attr(*id) & attr::HIDDEN != 0 => {
                    Some(self.vocab.tokens[*id as usize].as_str())
                }
                _ => None,
            })
    }

    /// Appends the bytes of one token; `show_special` renders control/unknown tokens as their text.
    /// Returns false if the id is out of range.
    pub(crate) fn append_piece(&self, id: u32, show_special: bool, out: &mut Vec<u8>) -> bool {
        let Some(text) = self.vocab.tokens.get(id as usize) else {
            return false;
        };
        let a = self.vocab.attr(id);
        if a & attr::HIDDEN != 0 {
            if show_special {
                out.extend_from_slice(text.as_bytes());
            }
        } else if a & attr::USER_DEFINED != 0 {
            out.extend_from_slice(text.as_bytes());
        } else if a & attr::NORMAL != 0 {
            match self.model {
                Model::Bpe(_) => out.extend_from_slice(&self.bytes.decode(text)),
                Model::Spm(_) => out.extend_from_slice(text.replace(SPACE_MARK, " ").as_bytes()),
            }
        } else if a & attr::BYTE != 0 {
            match parse_byte_token(text) {
                Some(b) => out.push(b),
                None => out.extend_from_slice(text.as_bytes()),
            }
        }
        // Unused and undefined tokens render as nothing (llama.cpp's token_to_piece).
        true
    }

    /// Turns ids back into text: the token pieces concatenated, then decoded as UTF-8 (invalid
    /// sequences become U+FFFD). `skip_special` leaves out control and unknown tokens. No space is
    /// stripped or cleaned up, so the result equals what a [`crate::StreamDecoder`] produces.
    pub fn decode(&self, ids: &[TokenId], skip_special: bool) -> Result<String, TokenizerError> {
        let mut bytes = Vec::with_capacity(ids.len() * 4);
        for &TokenId(id) in ids {
            if !self.append_piece(id, !skip_special, &mut bytes) {
                return Err(TokenizerError::InvalidTokenId {
                    id,
                    vocab_size: self.vocab.len(),
                });
            }
        }
        Ok(match String::from_utf8(bytes) {
            Ok(s) => s,
            Err(e) => String::from_utf8_lossy(e.as_bytes()).into_owned(),
        })
    }

    /// The raw bytes of one token as it appears in output text (byte-level encoding undone, `▁` as
    /// a space, `<0xAB>` as its byte; control tokens as their text; unused tokens empty). `None` if
    /// the id is out of range. A token can be part of a UTF-8 sequence; see [`crate::StreamDecoder`].
    pub fn token_bytes(&self, id: TokenId) -> Option<Vec<u8>> {
        let mut out = Vec::new();
        self.append_piece(id.0, true, &mut out).then_some(out)
    }

    /// The longest token text in bytes, as stored (at least as long as the input text it stands
    /// for: `▁`, byte-level characters and `<0xAB>` all take at least the bytes they encode). A
    /// text longer than `n * max_token_bytes()` cannot tokenize to `n` tokens or fewer.
    pub fn max_token_bytes(&self) -> usize {
        self.vocab.tokens.iter().map(String::len).max().unwrap_or(0)
    }

    pub fn vocab_size(&self) -> usize {
        self.vocab.len()
    }

    pub fn bos(&self) -> Option<TokenId> {
        self.vocab.bos.map(TokenId)
    }

    pub fn eos(&self) -> Option<TokenId> {
        self.vocab.eos.map(TokenId)
    }

    /// End of turn: `eot_token_id`, or the first of llama.cpp's known end-of-turn texts in the vocab.
    pub fn eot(&self) -> Option<TokenId> {
        self.vocab.eot.map(TokenId)
    }

    pub fn unk(&self) -> Option<TokenId> {
        self.vocab.unk.map(TokenId)
    }

    pub fn pad(&self) -> Option<TokenId> {
        self.vocab.pad.map(TokenId)
    }

    /// Whether `encode(.., add_special = true, ..)` prepends BOS.
    pub fn adds_bos(&self) -> bool {
        self.add_bos
    }

    /// The tokens that end generation, ascending: llama.cpp's end-of-generation set (EOS, EOT and
    /// tokens such as `<|im_end|>`, `<|eot_id|>`, `<|endoftext|>`, `<|end_of_text|>`, plus the
    /// fill-in-the-middle pad/repo/file-separator tokens, whichever the vocabulary has).
    pub fn stop_tokens(&self) -> Vec<TokenId> {
        self.vocab.eog.iter().copied().map(TokenId).collect()
    }

    /// Whether this is a control or unknown token, i.e. one that decoding with `skip_special`
    /// leaves out. Out-of-range ids are not special.
    pub fn is_special(&self, id: TokenId) -> bool {
        self.vocab.attr(id.0) & attr::HIDDEN != 0
    }

    /// The type of a token after llama.cpp's adjustments (tokens it detects as end of generation
    /// count as control).
    pub fn token_type(&self, id: TokenId) -> Option<TokenType> {
        self.vocab.token_type(id.0)
    }

    /// The token's text as stored in the vocabulary (byte-level or `▁`-escaped, not decoded).
    pub fn token_str(&self, id: TokenId) -> Option<&str> {
        self.vocab.tokens.get(id.as_usize()).map(String::as_str)
    }

    /// The id of a vocabulary text, if any.
    pub fn token_id(&self, text: &str) -> Option<TokenId> {
        self.vocab.lookup(text).map(TokenId)
    }
}

/// Parses `<0xAB>`.
fn parse_byte_token(text: &str) -> Option<u8> {
    let hex = text.strip_prefix("<0x")?.strip_suffix('>')?;
    if hex.len() != 2 || !hex.bytes().all(|b| b.is_ascii_hexdigit()) {
        return None;
    }
    u8::from_str_radix(hex, 16).ok()
}

#[cfg(test)]
mod tests {
    use super::parse_byte_token;

    #[test]
    fn byte_tokens_parse() {
        assert_eq!(parse_byte_token("<0x0A>"), Some(10));
        assert_eq!(parse_byte_token("<0xff>"), Some(255));
        assert_eq!(parse_byte_token("<0x1>"), None);
        assert_eq!(parse_byte_token("<0x+1>"), None);
        assert_eq!(parse_byte_token("x"), None);
    }
}
