//! No input makes the tokenizer panic: random text (any Unicode, special-token texts cut in halves,
//! long runs of whitespace or digits) through every pre-tokenizer family and the SentencePiece model,
//! random ids through decoding and streaming, and malformed specs through `from_spec`.

use quire_tokenizer::{StreamDecoder, TokenId, Tokenizer, TokenizerError, TokenizerSpec};

/// xorshift64*: deterministic, dependency-free.
struct Rng(u64);

impl Rng {
    fn next(&mut self) -> u64 {
        self.0 ^= self.0 >> 12;
        self.0 ^= self.0 << 25;
        self.0 ^= self.0 >> 27;
        self.0.wrapping_mul(0x2545_f491_4f6c_dd1d)
    }
    fn below(&mut self, n: usize) -> usize {
        (self.next() % n as u64) as usize
    }
}

const PIECES: &[&str] = &[
    " ",
    "  ",
    "\n",
    "\r\n",
    "\t",
    "a",
    "Z",
    "é",
    "日本",
    "😀",
    "1",
    "2024",
    "'s",
    "'M",
    "<|",
    "|>",
    "<|im_start|>",
    "<|im_end|>",
    "<s>",
    "</s>",
    "<|im_",
    ".",
    "!?",
    "\u{0}",
    "\u{2581}",
    "\u{fffd}",
    "\u{200b}",
    "\u{85}",
    "\u{a0}",
    "\u{10ffff}",
];

fn random_text(rng: &mut Rng) -> String {
    let mut s = String::new();
    for _ in 0..rng.below(40) {
        if rng.below(4) == 0 {
            // Any scalar value.
            let c = char::from_u32((rng.next() % 0x11_0000) as u32).unwrap_or('x');
            s.push(c);
        } else {
            s.push_str(PIECES[rng.below(PIECES.len())]);
        }
    }
    s
}

fn bpe(pre: &str) -> Tokenizer {
    // Every byte-level character, a few merges, and two control tokens.
    let mut tokens: Vec<String> = vec!["<|im_start|>".into(), "<|im_end|>".into()];
    for b in 0..=255u8 {
        let printable = matches!(b, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF);
        let cp = if printable {
            u32::from(b)
        } else {
            256 + (0..b)
                .filter(|&x| !matches!(x, 0x21..=0x7E | 0xA1..=0xAC | 0xAE..=0xFF))
                .count() as u32
        };
        tokens.push(char::from_u32(cp).expect("char").to_string());
    }
    tokens.extend(["Ġa", "Ġa1", "12", "ĠĠ"].map(String::from));
    let mut token_types = vec![1; tokens.len()];
    token_types[0] = 3;
    token_types[1] = 3;
    let spec = TokenizerSpec {
        model: "gpt2".into(),
        pre: Some(pre.into()),
        tokens,
        token_types,
        // Including malformed merges: no space, unknown parts, duplicates.
        merges: ["Ġ a", "Ġa 1", "1 2", "Ġ Ġ", "Ġ a", "nospace", " x", "q z"]
            .map(String::from)
            .to_vec(),
        eos_token_id: Some(1),
        ..Default::default()
    };
    Tokenizer::from_spec(spec).expect("tokenizer")
}

fn spm() -> Tokenizer {
    let mut tokens: Vec<String> = ["<unk>", "<s>", "</s>", "▁", "a", "▁a", "aa"]
        .map(String::from)
        .to_vec();
    tokens.extend((0..=255).map(|b| format!("<0x{b:02X}>")));
    let mut token_types = vec![1; tokens.len()];
    token_types[0] = 2;
    token_types[1] = 3;
    token_types[2] = 3;
    for t in &mut token_types[7..] {
        *t = 6;
    }
    let scores = (0..tokens.len()).map(|i| -(i as f32)).collect();
    let spec = TokenizerSpec {
        model: "llama".into(),
        tokens,
        token_types,
        scores,
        bos_token_id: Some(1),
        eos_token_id: Some(2),
        unknown_token_id: Some(0),
        add_bos_token: true,
        add_space_prefix: true,
        ..Default::default()
    };
    Tokenizer::from_spec(spec).expect("tokenizer")
}

#[test]
fn random_text_round_trips_through_byte_level_bpe() {
    for pre in [
        "smollm",
        "llama-bpe",
        "qwen2",
        "gpt-2",
        "default",
        "falcon",
        "tekken",
        "gpt-4o",
        "bloom",
        "deepseek-coder",
        "unknown",
    ] {
        let t = bpe(pre);
        let mut rng = Rng(0x9e37_79b9_7f4a_7c15);
        for _ in 0..300 {
            let text = random_text(&mut rng);
            let ids = t.encode(&text, true, false).expect("encode");
            // Every byte has a token, so nothing is lost.
            assert_eq!(t.decode(&ids, false).expect("decode"), text, "pre {pre}");
            let ids = t.encode(&text, false, true).expect("encode");
            assert_eq!(t.decode(&ids, false).expect("decode"), text, "pre {pre}");
        }
    }
}

#[test]
fn random_text_through_spm() {
    let t = spm();
    let mut rng = Rng(42);
    for _ in 0..500 {
        let text = random_text(&mut rng);
        let ids = t.encode(&text, true, true).expect("encode");
        assert_eq!(ids.first(), Some(&TokenId(1)));
        // All bytes have tokens; spaces come back, plus the prefixed ones.
        let back = t.decode(&ids, false).expect("decode");
        assert_eq!(
            back.replace(' ', ""),
            format!("<s>{text}").replace([' ', '\u{2581}'], "")
        );
    }
}

#[test]
fn long_runs() {
    let t = bpe("llama-bpe");
    for text in [
        " ".repeat(20_000),
        "\n".repeat(20_000),
        "9".repeat(20_000),
        "a ".repeat(10_000),
        " \n".repeat(10_000),
        "<|im_start|>".repeat(2_000),
    ] {
        let ids = t.encode(&text, false, true).expect("encode");
        assert_eq!(t.decode(&ids, false).expect("decode"), text);
    }
    let s = spm();
    let text = "a".repeat(20_000);
    let ids = s.encode(&text, false, false).expect("encode");
    assert_eq!(s.decode(&ids, false).expect("decode"), format!(" {text}"));
}

#[test]
fn random_ids_decode_and_stream() {
    for t in [bpe("smollm"), spm()] {
        let mut rng = Rng(7);
        let n = t.vocab_size() as u32;
        for _ in 0..200 {
            let ids: Vec<TokenId> = (0..rng.below(20))
                .map(|_| TokenId((rng.next() % u64::from(n)) as u32))
                .collect();
            let whole = t.decode(&ids, false).expect("decode");
            let mut stream = StreamDecoder::new();
            let mut streamed: String = ids.iter().map(|&id| stream.push(&t, id, false)).collect();
            streamed.push_str(&stream.flush());
            assert_eq!(streamed, whole);
        }
        assert!(matches!(
            t.decode(&[TokenId(n)], false),
            Err(TokenizerError::InvalidTokenId { .. })
        ));
        assert_eq!(t.token_bytes(TokenId(u32::MAX)), None);
        assert_eq!(t.token_str(TokenId(n)), None);
        assert!(!t.is_special(TokenId(u32::MAX)));
        let mut stream = StreamDecoder::new();
        assert_eq!(stream.push(&t, TokenId(u32::MAX), false), "");
    }
}

#[test]
fn malformed_specs_are_errors() {
    let good = || TokenizerSpec {
        model: "gpt2".into(),
        tokens: vec!["a".into(), "b".into()],
        ..Default::default()
    };
    assert!(Tokenizer::from_spec(good()).is_ok());
    let cases = [
        TokenizerSpec {
            tokens: vec![],
            ..good()
        },
        TokenizerSpec {
            model: "bert".into(),
            ..good()
        },
        TokenizerSpec {
            token_types: vec![1],
            ..good()
        },
        TokenizerSpec {
            model: "llama".into(),
            scores: vec![0.0],
            ..good()
        },
        TokenizerSpec {
            add_bos_token: true,
            bos_token_id: Some(99),
            ..good()
        },
        TokenizerSpec {
            add_eos_token: true,
            ..good()
        },
    ];
    for spec in cases {
        assert!(Tokenizer::from_spec(spec.clone()).is_err(), "{spec:?}");
    }
    // Odd but usable: empty and duplicate tokens, out-of-range ids, strange types and scores.
    let odd = TokenizerSpec {
        model: "llama".into(),
        tokens: vec!["".into(), "a".into(), "a".into(), "".into()],
        token_types: vec![3, 99, -1, 4],
        scores: vec![f32::NAN, -0.0, f32::INFINITY, 1.0],
        eos_token_id: Some(1000),
        unknown_token_id: Some(7),
        ..Default::default()
    };
    let t = Tokenizer::from_spec(odd).expect("tokenizer");
    assert_eq!(t.eos(), None);
    let ids = t.encode("aa [EMPTY_0] x", true, true).expect("encode");
    assert!(t.decode(&ids, false).is_ok());
}

#[test]
fn shareable_between_threads() {
    fn assert_send_sync<T: Send + Sync>() {}
    assert_send_sync::<Tokenizer>();
    assert_send_sync::<quire_tokenizer::ChatTemplate>();
    assert_send_sync::<StreamDecoder>();

    let t = std::sync::Arc::new(bpe("llama-bpe"));
    let handles: Vec<_> = (0..4)
        .map(|i| {
            let t = t.clone();
            std::thread::spawn(move || {
                let text = format!("thread {i}: 12345 it's");
                let ids = t.encode(&text, false, false).expect("encode");
                t.decode(&ids, false).expect("decode") == text
            })
        })
        .collect();
    for h in handles {
        assert!(h.join().expect("thread"));
    }
}
