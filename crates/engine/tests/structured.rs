//! Structured outputs on the default model: every completion asked to follow a JSON Schema, a
//! regular expression or a Lark grammar does, greedy and sampled; a guided request batched with
//! plain ones leaves theirs unchanged; bad grammars are refused with the field named. Each test
//! runs on every backend (`executor_test!`): the mask is applied on the host, so the backends
//! differ only in the logits they hand it.

use std::collections::HashMap;

use quire_backend::KvCacheSpec;
use quire_core::{Constraint, FinishReason, SamplingParams, SeqId, TokenId};
use quire_engine::{Engine, EngineConfig, EngineError};
use quire_testkit::{executor_test, Backend};

fn load() -> quire_model::LoadedModel {
    quire_model::load_gguf(&quire_core::default_model::model_for_tests())
        .expect("default model loads")
}

fn engine(b: Backend, m: &quire_model::LoadedModel) -> Engine {
    let kv = KvCacheSpec {
        num_blocks: 256,
        block_size: 16,
    };
    Engine::new(
        b.executor(&m.weights, kv),
        m.tokenizer.clone(),
        EngineConfig::default(),
    )
}

/// A one-turn ChatML conversation (the default model's template).
fn chat(m: &quire_model::LoadedModel, user: &str) -> Vec<TokenId> {
    let text = format!("<|im_start|>user\n{user}<|im_end|>\n<|im_start|>assistant\n");
    m.tokenizer.encode(&text, true, true).unwrap()
}

/// Steps until every request finished; each request's text, tokens and finish reason.
fn drain(e: &mut Engine) -> HashMap<SeqId, (String, Vec<u32>, FinishReason)> {
    let mut acc: HashMap<SeqId, (String, Vec<u32>)> = HashMap::new();
    let mut done = HashMap::new();
    let mut steps = 0;
    while e.has_unfinished() {
        steps += 1;
        assert!(steps < 10_000, "engine does not make progress");
        for o in e.step().unwrap() {
            let a = acc.entry(o.id).or_default();
            a.0.push_str(&o.text_delta);
            a.1.extend(o.tokens.iter().map(|t| t.token.0));
            if let Some(r) = o.finish_reason {
                let (text, toks) = acc.remove(&o.id).unwrap_or_default();
                done.insert(o.id, (text, toks, r));
            }
        }
    }
    done
}

fn guided(c: Constraint, temperature: f32, seed: u64) -> SamplingParams {
    SamplingParams {
        constraint: Some(c),
        temperature,
        seed: Some(seed),
        max_tokens: 160,
        ..Default::default()
    }
}

const PERSON: &str = r#"{
  "type": "object",
  "properties": {
    "name": {"type": "string", "maxLength": 24},
    "age": {"type": "integer", "minimum": 0, "maximum": 150},
    "city": {"type": "string", "enum": ["Paris", "Oslo", "Lima"]}
  },
  "required": ["name", "age", "city"],
  "additionalProperties": false
}"#;

fn check_person(text: &str) -> Result<(), String> {
    let v: serde_json::Value =
        serde_json::from_str(text).map_err(|e| format!("not JSON ({e}): {text:?}"))?;
    let o = v.as_object().ok_or(format!("not an object: {text}"))?;
    let mut keys: Vec<&str> = o.keys().map(String::as_str).collect();
    keys.sort_unstable();
    if keys != ["age", "city", "name"] {
        return Err(format!("keys {keys:?}: {text}"));
    }
    let name = o["name"].as_str().ok_or("name is not a string")?;
    let age = o["age"].as_i64().ok_or("age is not an integer")?;
    let city = o["city"].as_str().ok_or("city is not a string")?;
    if name.chars().count() > 24
        || !(0..=150).contains(&age)
        || !["Paris", "Oslo", "Lima"].contains(&city)
    {
        return Err(format!("values out of the schema: {text}"));
    }
    Ok(())
}

executor_test! {
    fn json_schema_regex_and_lark_outputs_follow_their_grammar(backend) {
        let m = load();
        let mut e = engine(backend, &m);
        let person = chat(&m, "Describe a person as JSON.");
        let mut cases = Vec::new();
        for (t, seed) in [(0.0, 0), (1.0, 1), (1.0, 2), (1.5, 3)] {
            let id = e
                .add_request(person.clone(), guided(Constraint::JsonSchema(PERSON.into()), t, seed))
                .unwrap();
            cases.push((id, "schema"));
        }
        // Any object, greedy (a sampled free-form object may run past max_tokens).
        let id = e
            .add_request(person.clone(), guided(Constraint::JsonObject, 0.0, 0))
            .unwrap();
        cases.push((id, "object"));
        let phone = chat(&m, "What is your phone number?");
        let id = e
            .add_request(phone.clone(), guided(Constraint::Regex(r"\([0-9]{3}\) [0-9]{3}-[0-9]{4}".into()), 1.0, 9))
            .unwrap();
        cases.push((id, "regex"));
        let yes_no = chat(&m, "Is the sky green? Answer yes or no.");
        let lark = "start: answer \".\"\nanswer: \"yes\" | \"no\"";
        let id = e
            .add_request(yes_no, guided(Constraint::Lark(lark.into()), 0.0, 0))
            .unwrap();
        cases.push((id, "lark"));
        let got = drain(&mut e);
        let mut failures = Vec::new();
        for (id, kind) in cases {
            let (text, _, reason) = &got[&id];
            eprintln!("{kind}: {reason:?} {text:?}");
            let verdict = match kind {
                "schema" => check_person(text),
                "object" => match serde_json::from_str::<serde_json::Value>(text) {
                    Ok(v) if v.is_object() => Ok(()),
                    _ => Err(format!("not a JSON object: {text:?}")),
                },
                "regex" => {
                    let b = text.as_bytes();
                    let ok = b.len() == 14
                        && b[0] == b'('
                        && b[4] == b')'
                        && b[5] == b' '
                        && b[9] == b'-'
                        && text.chars().enumerate().all(|(i, c)| [0, 4, 5, 9].contains(&i) || c.is_ascii_digit());
                    if ok { Ok(()) } else { Err(format!("does not match the regex: {text:?}")) }
                }
                _ => if text == "yes." || text == "no." { Ok(()) } else { Err(format!("not yes/no: {text:?}")) },
            };
            if let Err(why) = verdict {
                failures.push(format!("{kind}: {why}"));
            }
            // A complete grammar ends the request (an end token, or nothing more is allowed).
            if *reason != FinishReason::Stop {
                failures.push(format!("{kind}: finished by {reason:?}: {text:?}"));
            }
        }
        assert!(failures.is_empty(), "{failures:#?}");
    }
}

executor_test! {
    fn a_guided_request_leaves_plain_ones_in_its_batch_unchanged(backend) {
        let m = load();
        let prompt = chat(&m, "Write a haiku about rivers.");
        let plain = SamplingParams {
            max_tokens: 24,
            ..Default::default()
        };
        let mut alone = engine(backend, &m);
        let id = alone.add_request(prompt.clone(), plain.clone()).unwrap();
        let want = drain(&mut alone).remove(&id).unwrap();

        let mut e = engine(backend, &m);
        let g = e
            .add_request(chat(&m, "A person as JSON."), guided(Constraint::JsonSchema(PERSON.into()), 0.0, 0))
            .unwrap();
        let id = e.add_request(prompt, plain).unwrap();
        let mut got = drain(&mut e);
        assert_eq!(got.remove(&id).unwrap().1, want.1, "the plain request's tokens changed");
        let (text, _, _) = got.remove(&g).unwrap();
        check_person(&text).unwrap();
    }
}

#[test]
fn bad_grammars_are_refused_naming_the_field() {
    let m = load();
    let mut e = engine(Backend::Cpu, &m);
    let prompt = chat(&m, "hi");
    let cases = [
        (
            Constraint::JsonSchema("{not json".into()),
            "response_format",
        ),
        (Constraint::JsonSchema("[1, 2]".into()), "response_format"),
        (
            Constraint::JsonSchema(r#"{"type": "no-such-type"}"#.into()),
            "response_format",
        ),
        (Constraint::Regex("(unclosed".into()), "regex"),
        (Constraint::Lark("start: undefined_rule".into()), "grammar"),
    ];
    for (c, field) in cases {
        let label = format!("{c:?}");
        match e.add_request(prompt.clone(), guided(c, 0.0, 0)) {
            Err(EngineError::Constraint { field: f, message }) => {
                assert_eq!(f, field, "{label}");
                assert!(!message.is_empty(), "{label}");
                eprintln!("{label}: {message}");
            }
            Err(other) => panic!("{label}: refused with another error: {other}"),
            Ok(_) => panic!("{label}: accepted"),
        }
    }
    assert!(!e.has_unfinished(), "a refused request was queued");
}

executor_test! {
    /// The executor's sampling under allowed-token masks (what a guided step hands it) on the
    /// model's logits of a prompt, one row per position, run in a shuffled block table: masks of
    /// a few hundred tokens (a JSON grammar's), one token, a third of the vocabulary, none (the
    /// row unmasked), and the row's own best token forbidden. Every pick is an allowed token;
    /// greedy picks equal the reference sampler's (`sample_row_masked`) on the executor's own
    /// logits on every backend, and sampled picks too on the CPU (elsewhere a device sampler's
    /// sums may move a pick at a top-p or draw boundary: at most 1 in 10).
    fn device_sampling_under_random_masks_picks_only_allowed_tokens(backend) {
        use quire_backend::{
            argmax, mask_allows, mask_words, sample_row_masked, ForwardBatch, SampleParams,
            SeqBatch,
        };
        use quire_core::BlockId;
        use rand::seq::SliceRandom;
        use rand::{Rng, SeedableRng};
        let m = load();
        let kv = KvCacheSpec { num_blocks: 64, block_size: 16 };
        let mut exec = backend.executor(&m.weights, kv);
        let vocab = exec.vocab_size();
        let words = mask_words(vocab);
        let mut rng = rand::rngs::StdRng::seed_from_u64(37);
        let seq: Vec<u32> = chat(&m, "Describe a person as JSON, with a name, an age and a city.")
            .iter()
            .map(|t| t.0)
            .collect();
        let n = seq.len();
        let mut blocks: Vec<u32> = (0..64).collect();
        blocks.shuffle(&mut rng);
        let table: Vec<BlockId> = blocks[..n.div_ceil(16)].iter().map(|&b| BlockId(b)).collect();
        let positions: Vec<u32> = (0..n as u32).collect();
        let slots: Vec<u32> = (0..n)
            .map(|p| quire_core::slot(&table, p, 16) as u32)
            .collect();
        let seqs = [SeqBatch { query_start: 0, query_len: n, seq_len: n, block_table: &table }];
        let batch = ForwardBatch {
            token_ids: &seq,
            positions: &positions,
            slot_mapping: &slots,
            seqs: &seqs,
            logits_indices: &positions,
        };
        let logits = exec.forward(&batch).unwrap().to_vec();
        let mut masks = vec![0u32; n * words];
        let allow = |masks: &mut [u32], r: usize, t: usize| masks[r * words + t / 32] |= 1 << (t % 32);
        for r in 0..n {
            let row = &logits[r * vocab..(r + 1) * vocab];
            match r % 5 {
                0 => (0..rng.random_range(50..400)).for_each(|_| allow(&mut masks, r, rng.random_range(0..vocab))),
                1 => allow(&mut masks, r, rng.random_range(0..vocab)),
                2 => (0..vocab).filter(|_| rng.random_range(0..3) == 0).for_each(|t| allow(&mut masks, r, t)),
                3 => (0..vocab).for_each(|t| allow(&mut masks, r, t)),
                _ => {
                    let best = argmax(row) as usize;
                    (0..vocab).filter(|&t| t != best && rng.random_bool(0.5)).for_each(|t| allow(&mut masks, r, t));
                }
            }
        }
        let params: Vec<SampleParams> = (0..n)
            .map(|r| if r % 2 == 0 {
                SampleParams::GREEDY
            } else {
                SampleParams {
                    temperature: rng.random_range(0.5..1.5),
                    top_k: [0, 40][r % 4 / 2],
                    top_p: [1.0, 0.9][rng.random_range(0..2)],
                    min_p: [0.0, 0.05][rng.random_range(0..2)],
                    u: rng.random(),
                }
            })
            .collect();
        let mut calls = 0;
        let mut fill = |w: &mut [u32]| {
            calls += 1;
            assert_eq!(w.len(), masks.len(), "mask words");
            assert!(w.iter().all(|&x| x == u32::MAX), "the masks start all set");
            w.copy_from_slice(&masks);
        };
        let got = exec.forward_sample(&batch, &params, Some(&mut fill)).unwrap();
        assert_eq!(calls, 1, "the masks are asked for once");
        assert_eq!(got.len(), n);
        let (mut sampled, mut differ, mut moved) = (0, 0, 0);
        for r in 0..n {
            let row = &logits[r * vocab..(r + 1) * vocab];
            let mask = &masks[r * words..(r + 1) * words];
            assert!(mask_allows(mask, got[r] as usize), "row {r}: token {} is not allowed", got[r]);
            let want = sample_row_masked(row, Some(mask), &params[r], &mut Vec::new());
            moved += usize::from(r % 5 != 3 && params[r].temperature <= 0.0 && want != argmax(row));
            if params[r].temperature <= 0.0 || backend.is_oracle() {
                assert_eq!(got[r], want, "row {r} {:?}", params[r]);
            } else {
                sampled += 1;
                differ += usize::from(got[r] != want);
            }
        }
        eprintln!("{}: {n} rows, {differ} of {sampled} sampled rows differ from the host sampler; masks moved {moved} greedy picks", backend.name());
        assert!(differ * 10 <= sampled, "{differ} of {sampled} sampled rows differ");
        assert!(moved * 4 > n / 2, "the masks should move most masked greedy picks ({moved})");
    }
}
