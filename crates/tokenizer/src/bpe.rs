//! Byte-level BPE (`tokenizer.ggml.model = "gpt2"`), built at run time with the `tokenizers` crate
//! from the GGUF tokens and merges.
//!
//! The pre-tokenizer must split text exactly as llama.cpp does for the file's `tokenizer.ggml.pre`,
//! or token ids differ from the reference. llama.cpp applies a list of regexes one after another;
//! each regex splits every piece left by the previous one into its matches *and* the unmatched gaps
//! between them. That is `tokenizers`' `Split` with `SplitDelimiterBehavior::Isolated`, so the
//! pre-tokenizer here is a `Sequence` of such splits followed by a `ByteLevel` step with its own
//! (GPT-2) regex switched off. The regex strings are the ones in llama.cpp's src/llama-vocab.cpp
//! (`llm_tokenizer_bpe` constructor), and the pre-name -> regex-set mapping is its
//! `llama_vocab::impl::load`.

use tokenizers::models::bpe::{Vocab as BpeVocab, BPE};
use tokenizers::pre_tokenizers::byte_level::ByteLevel;
use tokenizers::pre_tokenizers::sequence::Sequence;
use tokenizers::pre_tokenizers::split::{Split, SplitPattern};
use tokenizers::pre_tokenizers::PreTokenizerWrapper;
use tokenizers::{
    Model, OffsetReferential, OffsetType, PreTokenizedString, PreTokenizer, SplitDelimiterBehavior,
};

use crate::vocab::Vocab;
use crate::TokenizerError;

/// GPT-2's split (llama.cpp omits the trailing `|\s+`; the unmatched gaps it leaves are kept as
/// pieces anyway, which gives the same result).
const GPT2: &str = r"'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)";
/// Llama 3 (case-insensitive contractions, numbers in groups of 1 to 3 digits, newlines kept with
/// the punctuation before them).
const LLAMA3: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
/// Qwen 2: as Llama 3 but every digit on its own.
const QWEN2: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const TEKKEN: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const GPT4O: &str = r"[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))*((?=[\p{L}])([^A-Z]))+(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|[^\r\n\p{L}\p{N}]?((?=[\p{L}])([^a-z]))+((?=[\p{L}])([^A-Z]))*(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])?|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+";
const SEED_CODER: &str = r"(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1}| ?[^\s\p{L}\p{N}\r\n]+|\s*[\r\n]+|\s+(?!\S)|\s+";

/// The regex list and merge behaviour of one llama.cpp pre-tokenizer type.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) struct PreConfig {
    pub regexes: &'static [&'static str],
    /// A whole piece that is itself a token is taken as is, without merging (Llama 3 family).
    pub ignore_merges: bool,
}

/// Maps `tokenizer.ggml.pre` to llama.cpp's regex list.
///
/// A missing `pre` is llama.cpp's "default" type. A name llama.cpp does not know (or one of the
/// rarer types not listed here) gets GPT-2's split: llama.cpp would refuse such a file, and GPT-2's
/// split is the closest common ancestor of the others.
pub(crate) fn pre_config(pre: Option<&str>) -> PreConfig {
    const fn cfg(regexes: &'static [&'static str], ignore_merges: bool) -> PreConfig {
        PreConfig {
            regexes,
            ignore_merges,
        }
    }
    match pre {
        None | Some("default") => cfg(
            &[r"[\p{P}\$\+<=>\^~\|]+", GPT2, r"\p{N}+", "[0-9][0-9][0-9]"],
            false,
        ),
        Some(
            "llama3" | "llama-v3" | "llama-bpe" | "falcon3" | "falcon-h1" | "pixtral" | "midm-2.0"
            | "lfm2" | "jina-v5-nano",
        ) => cfg(&[LLAMA3], true),
        Some("dbrx" | "smaug-bpe" | "glm4" | "chatglm-bpe") => cfg(&[LLAMA3], false),
        Some(
            "qwen2" | "deepseek-r1-qwen" | "kormo" | "f2llmv2" | "stablelm2" | "hunyuan"
            | "solar-open" | "megrez",
        ) => cfg(&[QWEN2], false),
        Some(
            "starcoder" | "refact" | "command-r" | "smollm" | "codeshell" | "exaone" | "minerva-7b"
            | "mellum2",
        ) => cfg(&[r"\p{N}", GPT2], false),
        Some("falcon") => cfg(&[r"[\p{P}\$\+<=>\^~\|`]+", GPT2, "[0-9][0-9][0-9]"], false),
        Some("bloom" | "poro-chat" | "gpt3-finnish") => cfg(&[r" ?[^(\s|.,!?…。，、।۔،)]+"], false),
        Some("deepseek-coder") => cfg(
            &[
                "[\r\n]",
                r"\s?\p{L}+",
                r"\s?\p{P}+",
                "[一-龥ࠀ-一가-퟿]+",
                r"\p{N}",
            ],
            false,
        ),
        Some("tekken") => cfg(&[TEKKEN], true),
        Some("gpt-4o" | "llama4" | "kanana2" | "talkie" | "minimax-m2") => cfg(&[GPT4O], false),
        Some("seed-coder") => cfg(&[SEED_CODER], false),
        // gpt-2, phi-2, mpt, olmo, jais, jina-*, roberta-bpe, exaone4, ... and unknown names.
        Some(_) => cfg(&[GPT2], false),
    }
}

/// GPT-2's `bytes_to_unicode`: printable Latin-1 bytes stand for themselves, the others map in
/// order to U+0100 onwards.
pub(crate) fn byte_to_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
    let cp = if printable(b) {
        u32::from(b)
    } else {
        256 + (0..b).filter(|&x| !printable(x)).count() as u32
    };
    // Every code point here is below U+0144, hence a valid char.
    char::from_u32(cp).unwrap_or('\0')
}

/// The inverse of [`byte_to_char`], indexed by code point (all mapped characters are below U+0144).
pub(crate) struct ByteTable {
    to_byte: [Option<u8>; 0x144],
}

impl std::fmt::Debug for ByteTable {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str("ByteTable")
    }
}

impl ByteTable {
    pub fn new() -> Self {
        let mut to_byte = [None; 0x144];
        for b in 0..=255u8 {
            if let Some(slot) = to_byte.get_mut(byte_to_char(b) as usize) {
                *slot = Some(b);
            }
        }
        Self { to_byte }
    }

    /// The byte a byte-level character stands for.
    pub fn byte_of(&self, c: char) -> Option<u8> {
        self.to_byte.get(c as usize).copied().flatten()
    }

    /// Undoes the byte-level encoding of a token text. A text containing characters outside the
    /// table (not produced by byte-level encoding) is returned as its own UTF-8 bytes, as the
    /// `tokenizers` ByteLevel decoder does.
    pub fn decode(&self, text: &str) -> Vec<u8> {
        let mut out = Vec::with_capacity(text.len());
        for c in text.chars() {
            match self.byte_of(c) {
                Some(b) => out.push(b),
                None => return text.as_bytes().to_vec(),
            }
        }
        out
    }
}

/// The `tokenizers` model and pre-tokenizer of one vocabulary.
pub(crate) struct ByteLevelBpe {
    model: BPE,
    pre: PreTokenizerWrapper,
    /// Whether the vocabulary has the single-character token of each byte.
    has_byte: [bool; 256],
    ignore_merges: bool,
    bytes: ByteTable,
}

impl std::fmt::Debug for ByteLevelBpe {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("ByteLevelBpe").finish_non_exhaustive()
    }
}

fn bpe_err(e: impl Into<Box<dyn std::error::Error + Send + Sync>>) -> TokenizerError {
    TokenizerError::Bpe(e.into())
}

impl ByteLevelBpe {
    pub fn new(
        vocab: &Vocab,
        merges: &[String],
        pre: Option<&str>,
    ) -> Result<Self, TokenizerError> {
        let config = pre_config(pre);

        let mut bpe_vocab = BpeVocab::default();
        for (i, text) in vocab.tokens.iter().enumerate() {
            bpe_vocab.entry(text.clone()).or_insert(i as u32);
        }

        // llama.cpp splits a merge at the first space after its first byte and ranks merges by
        // position, the first of duplicates winning. `tokenizers` needs both parts and their
        // concatenation in the vocabulary; merges that fail that are dropped (in llama.cpp they
        // could only produce a piece that then falls back to bytes).
        let mut seen = std::collections::HashSet::with_capacity(merges.len());
        let mut pairs = Vec::with_capacity(merges.len());
        for merge in merges {
            // Byte search: a space byte is always a char boundary.
            let Some(at) = merge.bytes().skip(1).position(|b| b == b' ').map(|p| p + 1) else {
                continue;
            };
            let (left, right) = (&merge[..at], &merge[at + 1..]);
            if left.is_empty() || right.is_empty() {
                continue;
            }
            let joined = format!("{left}{right}");
            if !bpe_vocab.contains_key(left)
                || !bpe_vocab.contains_key(right)
                || !bpe_vocab.contains_key(&joined)
            {
                continue;
            }
            if seen.insert((left.to_string(), right.to_string())) {
                pairs.push((left.to_string(), right.to_string()));
            }
        }

        let model = BPE::builder()
            .vocab_and_merges(bpe_vocab, pairs)
            .ignore_merges(config.ignore_merges)
            .build()
            .map_err(bpe_err)?;

        let mut steps: Vec<PreTokenizerWrapper> = Vec::with_capacity(config.regexes.len() + 1);
        for re in config.regexes {
            let split = Split::new(
                SplitPattern::Regex((*re).to_string()),
                SplitDelimiterBehavior::Isolated,
                false,
            )
            .map_err(bpe_err)?;
            steps.push(split.into());
        }
        let byte_level = ByteLevel::default()
            .add_prefix_space(false)
            .trim_offsets(false)
            .use_regex(false);
        steps.push(byte_level.into());

        let mut has_byte = [false; 256];
        for (b, has) in has_byte.iter_mut().enumerate() {
            let c = byte_to_char(b as u8);
            *has = vocab.lookup(c.encode_utf8(&mut [0; 4])).is_some();
        }

        Ok(Self {
            model,
            pre: Sequence::new(steps).into(),
            has_byte,
            ignore_merges: config.ignore_merges,
            bytes: ByteTable::new(),
        })
    }

    /// Appends the ids of `text` (which holds no special tokens) to `out`.
    pub fn encode(&self, text: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if text.is_empty() {
            return Ok(());
        }
        let mut pretok = PreTokenizedString::from(text);
        self.pre.pre_tokenize(&mut pretok).map_err(bpe_err)?;
        for (piece, _, _) in pretok.get_splits(OffsetReferential::Original, OffsetType::None) {
            let known = |c: char| {
                self.bytes
                    .byte_of(c)
                    .is_some_and(|b| self.has_byte[b as usize])
            };
            if piece.chars().all(known)
                || (self.ignore_merges && self.model.token_to_id(piece).is_some())
            {
                self.tokenize_run(piece, out)?;
                continue;
            }
            // llama.cpp keeps a byte without a token as a symbol that no merge touches and drops it
            // at the end; `tokenizers` would drop it first and let its neighbours merge. So the runs
            // between such bytes are tokenized separately.
            for run in piece.split(|c: char| !known(c)) {
                self.tokenize_run(run, out)?;
            }
        }
        Ok(())
    }

    fn tokenize_run(&self, run: &str, out: &mut Vec<u32>) -> Result<(), TokenizerError> {
        if !run.is_empty() {
            out.extend(
                self.model
                    .tokenize(run)
                    .map_err(bpe_err)?
                    .iter()
                    .map(|t| t.id),
            );
        }
        Ok(())
    }

    /// The pieces the pre-tokenizer cuts `text` into, before byte-level encoding (for tests).
    #[cfg(test)]
    pub fn pieces(&self, text: &str) -> Vec<String> {
        let mut pretok = PreTokenizedString::from(text);
        let Ok(()) = self.pre.pre_tokenize(&mut pretok) else {
            return Vec::new();
        };
        let table = ByteTable::new();
        pretok
            .get_splits(OffsetReferential::Original, OffsetType::None)
            .into_iter()
            .map(|(p, _, _)| String::from_utf8_lossy(&table.decode(p)).into_owned())
            .collect()
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::spec::TokenizerSpec;

    fn splitter(pre: &str) -> ByteLevelBpe {
        let spec = TokenizerSpec {
            model: "gpt2".into(),
            tokens: vec!["a".into()],
            ..Default::default()
        };
        let vocab = Vocab::from_spec(&spec).expect("vocab");
        ByteLevelBpe::new(&vocab, &[], Some(pre)).expect("bpe")
    }

    #[test]
    fn byte_table_round_trips() {
        let t = ByteTable::new();
        for b in 0..=255u8 {
            let s = byte_to_char(b).to_string();
            assert_eq!(t.decode(&s), vec![b]);
        }
        assert_eq!(byte_to_char(b' '), 'Ġ');
        assert_eq!(byte_to_char(b'\n'), 'Ċ');
    }

    #[test]
    fn every_known_pre_type_compiles() {
        for pre in [
            "default",
            "llama-bpe",
            "dbrx",
            "qwen2",
            "smollm",
            "falcon",
            "bloom",
            "deepseek-coder",
            "tekken",
            "gpt-4o",
            "seed-coder",
            "gpt-2",
            "no-such-pre",
        ] {
            let s = splitter(pre);
            assert!(
                !s.pieces("Hello, world! 12345 it's\n\n  x").is_empty(),
                "{pre}"
            );
        }
    }

    #[test]
    fn smollm_isolates_digits_then_gpt2() {
        let s = splitter("smollm");
        assert_eq!(
            s.pieces("1, 2024 it's  ok\n"),
            ["1", ",", " ", "2", "0", "2", "4", " it", "'s", " ", " ok", "\n"]
        );
    }

    #[test]
    fn llama3_groups_digits_by_three() {
        let s = splitter("llama-bpe");
        assert_eq!(
            s.pieces("1234567 I'M ok.\n\nx"),
            ["123", "456", "7", " I", "'M", " ok", ".\n\n", "x"]
        );
    }

    #[test]
    fn default_pre_splits_punctuation_and_digit_triples() {
        let s = splitter("default");
        assert_eq!(s.pieces("a+b 12345"), ["a", "+", "b", " ", "123", "45"]);
    }
}
