//! SentencePiece-style (`"llama"`) tokenization on a tiny hand-made vocabulary, with the merge order
//! worked out by hand: the adjacent pair whose concatenation is the best-scoring token merges first,
//! pairs made stale by earlier merges are skipped, spaces become `▁` with one prefixed at the start
//! and after special tokens, and characters without a token fall back to `<0xAB>` byte tokens.

use quire_tokenizer::{StreamDecoder, TokenId, TokenType, Tokenizer, TokenizerSpec};

/// (text, type, score)
const VOCAB: &[(&str, i32, f32)] = &[
    ("<unk>", 2, 0.0),
    ("<s>", 3, 0.0),
    ("</s>", 3, 0.0),
    ("<0x0A>", 6, 0.0),
    ("<0xC3>", 6, 0.0),
    ("<0xA9>", 6, 0.0),
    ("▁", 1, -10.0),
    ("h", 1, -10.0),
    ("e", 1, -10.0),
    ("l", 1, -10.0),
    ("o", 1, -10.0),
    ("w", 1, -10.0),
    ("r", 1, -10.0),
    ("d", 1, -10.0),
    ("▁h", 1, -1.0),
    ("▁he", 1, -0.5),
    ("el", 1, -2.0),
    ("ll", 1, -1.5),
    ("lo", 1, -2.5),
    ("llo", 1, -1.0),
    ("▁hello", 1, -0.1),
    ("▁w", 1, -1.2),
    ("▁wo", 1, -0.8),
    ("or", 1, -3.0),
    ("ld", 1, -3.5),
];

fn tokenizer(add_space_prefix: bool) -> Tokenizer {
    let spec = TokenizerSpec {
        model: "llama".into(),
        tokens: VOCAB.iter().map(|v| v.0.to_string()).collect(),
        token_types: VOCAB.iter().map(|v| v.1).collect(),
        scores: VOCAB.iter().map(|v| v.2).collect(),
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        unknown_token_id: Some(0),
        add_bos_token: TokenizerSpec::default_add_bos("llama", None),
        add_space_prefix,
        ..Default::default()
    };
    Tokenizer::from_spec(spec).expect("tokenizer")
}

fn ids(t: &Tokenizer, texts: &[&str]) -> Vec<TokenId> {
    texts
        .iter()
        .map(|s| {
            t.token_id(s)
                .unwrap_or_else(|| panic!("{s:?} not in vocab"))
        })
        .collect()
}

#[test]
fn merges_by_score_with_space_prefix() {
    let t = tokenizer(true);
    // "▁hello▁world": ▁h, ▁he, ▁w, ▁wo, ll, llo, ▁hello merge in score order; el, lo and or are
    // stale by then; ld merges last; r stays alone.
    let got = t.encode("hello world", false, false).expect("encode");
    assert_eq!(got, ids(&t, &["▁hello", "▁wo", "r", "ld"]));
    assert_eq!(got, [20, 22, 12, 24].map(TokenId));
    assert_eq!(t.decode(&got, false).expect("decode"), " hello world");
}

#[test]
fn no_space_prefix_when_disabled() {
    let t = tokenizer(false);
    // "hello": ll (-1.5) beats el (-2.0); then llo; "ello" is no token, el is stale.
    let got = t.encode("hello", false, false).expect("encode");
    assert_eq!(got, [7, 8, 19].map(TokenId));
}

#[test]
fn bos_and_special_tokens() {
    let t = tokenizer(true);
    assert!(t.adds_bos());
    // BOS, then a space is prefixed to the text at the start and after each special token.
    let got = t.encode("hello</s>world", true, true).expect("encode");
    assert_eq!(got, ids(&t, &["<s>", "▁hello", "</s>", "▁wo", "r", "ld"]));
    assert_eq!(t.decode(&got, true).expect("decode"), " hello world");
    assert_eq!(
        t.decode(&got, false).expect("decode"),
        "<s> hello</s> world"
    );
    // Without parse_special, "</s>" is text: '<', '/', 's', '>' have no tokens and no byte
    // tokens, so each becomes <unk>.
    let got = t.encode("hello</s>", false, false).expect("encode");
    assert_eq!(
        got,
        ids(&t, &["▁hello", "<unk>", "<unk>", "<unk>", "<unk>"])
    );
    assert_eq!(t.stop_tokens(), vec![TokenId(2)]);
    assert_eq!(t.token_type(TokenId(3)), Some(TokenType::Byte));
}

#[test]
fn byte_fallback() {
    let t = tokenizer(true);
    // "▁é\n": é (C3 A9) and \n have no piece tokens; their bytes do.
    let got = t.encode("é\n", false, false).expect("encode");
    assert_eq!(got, ids(&t, &["▁", "<0xC3>", "<0xA9>", "<0x0A>"]));
    assert_eq!(t.decode(&got, false).expect("decode"), " é\n");

    let mut stream = StreamDecoder::new();
    assert_eq!(stream.push(&t, got[0], false), " ");
    assert_eq!(
        stream.push(&t, got[1], false),
        "",
        "half a character is held back"
    );
    assert!(stream.has_pending());
    assert_eq!(stream.push(&t, got[2], false), "é");
    assert_eq!(stream.push(&t, got[3], false), "\n");
    assert_eq!(stream.flush(), "");
}

#[test]
fn empty_text() {
    let t = tokenizer(true);
    assert_eq!(t.encode("", false, true).expect("encode"), []);
    assert_eq!(t.encode("", true, true).expect("encode"), [TokenId(1)]);
}
