//! Byte-level BPE on a tiny hand-made vocabulary, checking that each `tokenizer.ggml.pre` splits as
//! its llama.cpp regex says. The same text is tokenized under Llama 3's split (`llama-bpe`: numbers
//! in groups of up to 3 digits, case-insensitive contractions, whole-piece tokens taken without
//! merging, newlines kept with the punctuation before them) and under GPT-2's and SmolLM's, and the
//! expected ids were worked out by hand from the regex semantics and the merge ranks below.

use quire_tokenizer::{TokenId, Tokenizer, TokenizerSpec};

/// Single byte-level characters plus the merged tokens the merges below produce.
const TOKENS: &[&str] = &[
    "<|begin_of_text|>",
    "<|eot_id|>",
    "0",
    "1",
    "2",
    "3",
    "4",
    "5",
    "6",
    "7",
    "9",
    "'",
    "s",
    "t",
    "i",
    "I",
    "M",
    "o",
    "k",
    "x",
    ".",
    "Ġ",
    "Ċ",
    "34",
    "12",
    "123",
    "45",
    "20",
    "202",
    "Ġ202",
    "'M",
    "'s",
    "it",
    "Ġo",
    "Ġok",
    "ok",
    "ĊĊ",
    "999",
];

/// Highest priority first.
const MERGES: &[&str] = &[
    "3 4", "1 2", "12 3", "4 5", "2 0", "20 2", "Ġ 202", "' M", "' s", "i t", "Ġ o", "Ġo k", "o k",
    "Ċ Ċ",
];

fn tokenizer(pre: &str) -> Tokenizer {
    let mut token_types = vec![1; TOKENS.len()];
    token_types[0] = 3;
    token_types[1] = 3;
    let spec = TokenizerSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens: TOKENS.iter().map(|s| s.to_string()).collect(),
        token_types,
        merges: MERGES.iter().map(|s| s.to_string()).collect(),
        bos_token_id: Some(0),
        eos_token_id: Some(1),
        add_bos_token: TokenizerSpec::default_add_bos("gpt2", Some(pre)),
        ..Default::default()
    };
    Tokenizer::from_spec(spec).expect("tokenizer")
}

/// Ids of the given token texts.
fn ids(t: &Tokenizer, texts: &[&str]) -> Vec<TokenId> {
    texts
        .iter()
        .map(|s| {
            t.token_id(s)
                .unwrap_or_else(|| panic!("{s:?} not in vocab"))
        })
        .collect()
}

fn check(pre: &str, text: &str, want: &[&str]) {
    let t = tokenizer(pre);
    let got = t.encode(text, false, false).expect("encode");
    assert_eq!(got, ids(&t, want), "pre {pre}, text {text:?}");
    assert_eq!(t.decode(&got, false).expect("decode"), text, "round trip");
}

#[test]
fn llama3_splits_numbers_into_groups_of_three() {
    // "123" | "45": 1 2 -> 12, 12 3 -> 123; 4 5 -> 45.
    check("llama-bpe", "12345", &["123", "45"]);
    // One piece "12345": 3 4 ranks first, so 1 2 34 5 -> 12 34 5.
    check("gpt-2", "12345", &["12", "34", "5"]);
    // Every digit alone.
    check("smollm", "12345", &["1", "2", "3", "4", "5"]);
    // "123" | "456" | "7": 456 -> 45 6.
    check("llama-bpe", "1234567", &["123", "45", "6", "7"]);
}

#[test]
fn llama3_keeps_the_space_before_a_number_apart() {
    // Llama 3: " " (no letter follows) | "202" | "4". GPT-2: " 2024" is one piece, Ġ 202 merges.
    check("llama-bpe", " 2024", &["Ġ", "202", "4"]);
    check("gpt-2", " 2024", &["Ġ202", "4"]);
    check("llama3", " 2024", &["Ġ", "202", "4"]);
}

#[test]
fn llama3_contractions_are_case_insensitive() {
    // Llama 3: "I" | "'M" | " ok". GPT-2 only knows lower-case contractions: "I" | "'" | "M" | " ok".
    check("llama-bpe", "I'M ok", &["I", "'M", "Ġok"]);
    check("gpt-2", "I'M ok", &["I", "'", "M", "Ġok"]);
    check("llama-bpe", "it's", &["it", "'s"]);
    check("gpt-2", "it's", &["it", "'s"]);
}

#[test]
fn llama3_takes_whole_piece_tokens_without_merging() {
    // "999" is a token but no merge builds it: Llama 3 ignores merges for whole pieces.
    check("llama-bpe", "999", &["999"]);
    check("gpt-2", "999", &["9", "9", "9"]);
}

#[test]
fn llama3_keeps_newlines_with_preceding_punctuation() {
    // Llama 3: "ok" | ".\n\n" | "x". GPT-2: "ok" | "." | "\n" | "\n" | "x".
    check("llama-bpe", "ok.\n\nx", &["ok", ".", "ĊĊ", "x"]);
    check("gpt-2", "ok.\n\nx", &["ok", ".", "Ċ", "Ċ", "x"]);
}

#[test]
fn special_tokens_and_bos() {
    let t = tokenizer("llama-bpe");
    assert!(t.adds_bos(), "llama-bpe adds BOS by default");
    let text = "<|begin_of_text|>12<|eot_id|>";
    assert_eq!(
        t.encode(text, true, true).expect("encode"),
        ids(
            &t,
            &["<|begin_of_text|>", "<|begin_of_text|>", "12", "<|eot_id|>"]
        )
    );
    // Without parse_special the control texts are plain text. Only "i o t x t" of
    // "<|begin_of_text|>" and "o t i" of "<|eot_id|>" have tokens in this vocabulary; bytes without
    // a token are dropped, as llama.cpp drops them.
    assert_eq!(
        t.encode(text, false, false).expect("encode"),
        ids(&t, &["i", "o", "t", "x", "t", "12", "o", "t", "i"])
    );
    assert_eq!(t.stop_tokens(), vec![TokenId(1)]);
    assert_eq!(
        t.decode(&ids(&t, &["<|begin_of_text|>", "12", "<|eot_id|>"]), true)
            .expect("decode"),
        "12"
    );
}

#[test]
fn bytes_without_a_token_block_merges() {
    // "q" has no token: llama.cpp keeps it as a symbol between "i" and "t" and drops it at the end,
    // so the merge "i t" must not apply.
    check_ids("gpt-2", "iqt", &["i", "t"]);
    check_ids("gpt-2", "it", &["it"]);
}

fn check_ids(pre: &str, text: &str, want: &[&str]) {
    let t = tokenizer(pre);
    assert_eq!(t.encode(text, false, false).expect("encode"), ids(&t, want));
}

#[test]
fn unknown_pre_falls_back_to_gpt2() {
    let t = tokenizer("some-future-pre");
    let g = tokenizer("gpt-2");
    for text in ["12345", " 2024", "I'M ok", "ok.\n\nx"] {
        assert_eq!(
            t.encode(text, false, false).ok(),
            g.encode(text, false, false).ok()
        );
    }
}
