//! The converted tokenizer against the `tokenizers` crate reading the same `tokenizer.json` (HF's
//! own implementation), on the fixture tokenizers of tests/hf (Llama 3, Qwen 2 and GPT-2 splits).

use std::str::FromStr;

use serde_json::Value;

use super::*;
use crate::Tokenizer;

fn fixture(arch: &str) -> (String, String) {
    let dir = format!(
        "{}/../../tests/hf/fixtures/{arch}",
        env!("CARGO_MANIFEST_DIR")
    );
    let read = |f: &str| {
        std::fs::read_to_string(format!("{dir}/{f}")).unwrap_or_else(|e| panic!("{dir}/{f}: {e}"))
    };
    (read("tokenizer.json"), read("tokenizer_config.json"))
}

const TEXTS: &[&str] = &[
    "The quick brown fox jumps over the lazy dog, and the theory said: it's 2024!\nHello  world\t<|im_end|> model token quire 12345.",
    "Hello world",
    "  leading spaces and trailing   ",
    "numbers 1 22 333 4444 55555 and 3.14159",
    "I'M SHOUTING, you'll see; we'd've THE'S",
    "unicode: héllo wörld ñ 日本語 🦀\r\n\r\nnext",
    "<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n",
    "tabs\tand\nnewlines\n\n\n end",
    "",
];

#[test]
fn fixture_tokenizers_match_the_tokenizers_crate() {
    for arch in ["llama", "qwen2", "qwen3", "mistral"] {
        let (tj, tc) = fixture(arch);
        let hf = from_hf_files(&tj, Some(&tc)).unwrap();
        let pre = hf.spec.pre.clone();
        let ours = Tokenizer::from_spec(hf.spec).unwrap();
        let theirs = tokenizers::Tokenizer::from_str(&tj).unwrap();
        for text in TEXTS {
            let want: Vec<u32> = theirs.encode(*text, false).unwrap().get_ids().to_vec();
            let got: Vec<u32> = ours
                .encode(text, false, true)
                .unwrap()
                .iter()
                .map(|t| t.0)
                .collect();
            assert_eq!(got, want, "{arch} ({pre:?}): {text:?}");
            // And back: byte-level decoding restores the text.
            let ids: Vec<_> = got.iter().map(|&i| crate::TokenId(i)).collect();
            assert_eq!(ours.decode(&ids, false).unwrap(), *text, "{arch}: {text:?}");
        }
        assert_eq!(ours.vocab_size(), 320);
        assert_eq!(ours.bos().map(|t| t.0), Some(317), "{arch}");
        assert_eq!(ours.eos().map(|t| t.0), Some(319), "{arch}");
        assert!(!ours.adds_bos());
        assert_eq!(hf.bos_token, "<|endoftext|>");
        assert!(hf.chat_template.unwrap().contains("im_start"));
    }
}

#[test]
fn pre_tokenizer_names() {
    let cases = [
        ("llama", "llama-bpe"),
        ("qwen2", "qwen2"),
        ("mistral", "gpt-2"),
    ];
    for (arch, pre) in cases {
        let hf = from_hf_files(&fixture(arch).0, None).unwrap();
        assert_eq!(hf.spec.pre.as_deref(), Some(pre));
    }
}

fn edit(tj: &str, f: impl FnOnce(&mut Value)) -> String {
    let mut v: Value = serde_json::from_str(tj).unwrap();
    f(&mut v);
    v.to_string()
}

#[test]
fn merges_as_pairs_equal_merges_as_strings() {
    let (tj, _) = fixture("qwen2");
    let pairs = edit(&tj, |v| {
        let ms = v["model"]["merges"].as_array_mut().unwrap();
        for m in ms.iter_mut() {
            let s = m.as_str().unwrap().to_string();
            let (a, b) = s.split_once(' ').unwrap();
            *m = serde_json::json!([a, b]);
        }
    });
    let a = from_hf_files(&tj, None).unwrap().spec;
    let b = from_hf_files(&pairs, None).unwrap().spec;
    assert!(!a.merges.is_empty());
    assert_eq!(a.merges, b.merges);
}

#[test]
fn post_processor_bos_and_added_token_types() {
    let (tj, _) = fixture("llama");
    let with_pp = edit(&tj, |v| {
        v["post_processor"] = serde_json::json!({
            "type": "TemplateProcessing",
            "single": [{"SpecialToken": {"id": "<|endoftext|>", "type_id": 0}},
                       {"Sequence": {"id": "A", "type_id": 0}}],
            "pair": [], "special_tokens": {}
        });
        // A non-special added token is user-defined.
        v["added_tokens"][1]["special"] = Value::Bool(false);
    });
    let tc = r#"{"bos_token": {"content": "<|endoftext|>"}, "eos_token": "<|im_end|>"}"#;
    let hf = from_hf_files(&with_pp, Some(tc)).unwrap();
    assert!(hf.spec.add_bos_token);
    assert_eq!(hf.spec.token_types[318], 4);
    assert_eq!(hf.spec.token_types[319], 3);
    assert_eq!(hf.spec.token_types[5], 1);
    let tok = Tokenizer::from_spec(hf.spec).unwrap();
    let ids = tok.encode("Hi", true, false).unwrap();
    assert_eq!(ids[0].0, 317);
    // Without the flag and without a post-processor: no BOS.
    let hf = from_hf_files(&tj, Some(tc)).unwrap();
    assert!(!hf.spec.add_bos_token);
}

#[test]
fn clear_errors() {
    let (tj, _) = fixture("qwen2");
    let msg = |s: &str| from_hf_files(s, None).unwrap_err().to_string();
    assert!(msg("{not json").contains("bad JSON"));
    assert!(msg("{}").contains("no \"model\""));
    let unknown_regex = edit(&tj, |v| {
        v["pre_tokenizer"]["pretokenizers"][0]["pattern"]["Regex"] = "\\p{L}+".into();
    });
    let m = msg(&unknown_regex);
    assert!(
        m.contains("unknown pre-tokenizer regex") && m.contains("\\\\p{L}+"),
        "{m}"
    );
    let metaspace = edit(&tj, |v| {
        v["pre_tokenizer"] = serde_json::json!({"type": "Metaspace", "replacement": "▁"});
    });
    assert!(msg(&metaspace).contains("Metaspace"));
    let fallback = edit(&tj, |v| v["model"]["byte_fallback"] = Value::Bool(true));
    assert!(msg(&fallback).contains("byte_fallback"));
    let wordpiece = edit(&tj, |v| v["model"]["type"] = "WordPiece".into());
    assert!(msg(&wordpiece).contains("WordPiece"));
    let bad_merge = edit(&tj, |v| v["model"]["merges"][0] = serde_json::json!(7));
    assert!(msg(&bad_merge).contains("bad merge"));
    let bad_cfg = from_hf_files(&tj, Some("[")).unwrap_err().to_string();
    assert!(bad_cfg.contains("tokenizer_config.json"), "{bad_cfg}");
}
