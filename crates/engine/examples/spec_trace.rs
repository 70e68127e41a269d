//! Where prompt lookup wins and loses, step by step, on repeat/edit prompts (a diagnostic, not a
//! test). Greedy output is the same with speculation on and off, so one plain greedy run per
//! prompt fixes the tokens; each verify step is then replayed exactly without the model: the
//! proposer sees the prompt and the output so far, and the target accepts the longest prefix of
//! its guesses that matches the output, plus one token of its own.
//!
//! `cargo run --release -p quire-engine --example spec_trace -- [K] [-v]` prints per prompt the
//! verify steps, proposed and accepted tokens, steps that proposed nothing, tokens per step and an
//! expected speed-up from a verify-cost table (`quire bench --spec verify:1,2,4,8,16` on the 2-core
//! development VM: a step of n tokens costs `verify_cost(n)` plain steps). `-v` prints every step.
//! The greedy outputs are cached in `target/spec_trace_outputs.json` (delete it after changing the
//! model or the prompts). Each prompt is replayed with the old stateless lookup
//! ([`quire_engine::spec::ngram_propose`]) and with [`NgramProposer`]. Besides the bench's three
//! prompts, two edits of other passages (`spec_prompts/*.txt`, also usable with `quire generate
//! --chat -p "$(cat FILE)"`): renaming a person and a weekday, and correcting spelling mistakes.

use quire_backend::cpu::{CpuExecutor, CpuOptions};
use quire_backend::KvCacheSpec;
use quire_core::{SamplingParams, SeqId, TokenId};
use quire_engine::{Engine, EngineConfig, NgramProposer, ProposalRow, Proposer, SpecConfig};
use quire_tokenizer::ChatMessage;

/// The bench's prompts, then edits the bench does not ask for, on other passages (also for
/// `quire generate`).
fn prompts() -> Vec<(&'static str, String)> {
    let mut v = quire_engine::spec_prompts::prompts();
    v.push((
        "rename",
        include_str!("spec_prompts/rename.txt").to_string(),
    ));
    v.push(("typos", include_str!("spec_prompts/typos.txt").to_string()));
    v
}

/// A verify step of `n` tokens (1 = a plain step) in plain steps, default model, batch 1.
fn verify_cost(n: usize) -> f64 {
    // `quire bench --spec verify:1,2,4,8,16 -n 64 -r 5 -t 2`, 2-core Xeon VM, quiet (0447fbf);
    // linear in between.
    const TABLE: [(usize, f64); 6] = [
        (1, 1.0),
        (2, 1.37),
        (3, 1.69),
        (5, 2.17),
        (9, 3.05),
        (17, 6.07),
    ];
    let i = TABLE
        .iter()
        .position(|e| e.0 >= n)
        .unwrap_or(TABLE.len() - 1);
    if i == 0 || TABLE[i].0 == n {
        return TABLE[i].1;
    }
    let (a, b) = (TABLE[i - 1], TABLE[i]);
    a.1 + (b.1 - a.1) * (n - a.0) as f64 / (b.0 - a.0) as f64
}

fn main() {
    let args: Vec<String> = std::env::args().skip(1).collect();
    let k: usize = args.iter().find_map(|a| a.parse().ok()).unwrap_or(8);
    let verbose = args.iter().any(|a| a == "-v");
    let m = quire_model::load_gguf(&quire_core::default_model::model_for_tests()).unwrap();
    let cache = concat!(
        env!("CARGO_MANIFEST_DIR"),
        "/../../target/spec_trace_outputs.json"
    );
    let runs: Vec<(String, Vec<u32>, Vec<u32>)> = match std::fs::read_to_string(cache) {
        Ok(s) => serde_json::from_str(&s).unwrap(),
        Err(_) => {
            let r = generate(&m);
            std::fs::write(cache, serde_json::to_string(&r).unwrap()).unwrap();
            r
        }
    };
    let spec = SpecConfig {
        num_tokens: k,
        ngram_min: 1,
        ngram_max: 3,
    };
    println!("| prompt | K | steps | verify steps | empty steps | accepted / proposed | tokens per step | expected speed-up |");
    println!("|---|---:|---:|---:|---:|---:|---:|---:|");
    for (name, prompt, out) in &runs {
        let mut old = Stateless;
        let mut new = NgramProposer::default();
        for (label, p) in [("old", &mut old as &mut dyn Proposer), ("new", &mut new)] {
            let r = replay(p, prompt, out, &spec, verbose.then_some(&m));
            println!(
                "| {name} ({label}) | {k} | {} | {} | {} | {}/{} ({:.0}%) | {:.2} | {:.2}x |",
                r.steps,
                r.verify_steps,
                r.steps - r.verify_steps,
                r.accepted,
                r.proposed,
                100.0 * r.accepted as f64 / r.proposed.max(1) as f64,
                out.len() as f64 / r.steps as f64,
                out.len() as f64 / r.cost,
            );
        }
    }
}

/// The lookup before copy tracking: the latest earlier occurrence of the last 1–3 tokens.
struct Stateless;

impl Proposer for Stateless {
    fn name(&self) -> &'static str {
        "ngram"
    }

    fn propose(
        &mut self,
        rows: &[ProposalRow],
        spec: &SpecConfig,
    ) -> Result<Vec<Vec<TokenId>>, quire_engine::EngineError> {
        Ok(rows
            .iter()
            .map(|r| {
                quire_engine::spec::ngram_propose(
                    r.tokens,
                    spec.ngram_min,
                    spec.ngram_max,
                    spec.num_tokens,
                )
            })
            .collect())
    }
}

/// The plain greedy output of every prompt: (name, prompt tokens, output tokens).
fn generate(m: &quire_model::LoadedModel) -> Vec<(String, Vec<u32>, Vec<u32>)> {
    let kv = KvCacheSpec {
        num_blocks: 128,
        block_size: 16,
    };
    let exec = CpuExecutor::new(&m.weights, kv, CpuOptions::default()).unwrap();
    let mut e = Engine::new(Box::new(exec), m.tokenizer.clone(), EngineConfig::default());
    let mut runs = Vec::new();
    for (name, text) in prompts() {
        let prompt = quire_tokenizer::encode_chat(
            &m.tokenizer,
            &m.chat_template,
            &[ChatMessage::new("user", text)],
        )
        .unwrap();
        let params = SamplingParams {
            max_tokens: 256,
            ..Default::default()
        };
        let id: SeqId = e.add_request(prompt.clone(), params).unwrap();
        let mut out = Vec::new();
        while e.has_unfinished() {
            for o in e.step().unwrap() {
                if o.id == id {
                    out.extend(o.tokens.iter().map(|t| t.token.0));
                }
            }
        }
        runs.push((name.to_string(), prompt.iter().map(|t| t.0).collect(), out));
    }
    runs
}

#[derive(Default)]
struct Replay {
    steps: usize,
    verify_steps: usize,
    proposed: usize,
    accepted: usize,
    /// Sum of the steps' costs in plain steps.
    cost: f64,
}

/// Replays greedy decoding of `out` after `prompt` with proposer `p`.
fn replay(
    p: &mut dyn Proposer,
    prompt: &[u32],
    out: &[u32],
    spec: &SpecConfig,
    show: Option<&quire_model::LoadedModel>,
) -> Replay {
    let all: Vec<TokenId> = prompt.iter().chain(out).copied().map(TokenId).collect();
    let id = SeqId(1);
    let mut r = Replay::default();
    // The first output token comes from the prefill step.
    let mut done = 1;
    r.steps += 1;
    r.cost += 1.0;
    while done < out.len() {
        let known = &all[..prompt.len() + done];
        let mut g = p
            .propose(&[ProposalRow { id, tokens: known }], spec)
            .unwrap()
            .remove(0);
        g.truncate(spec.num_tokens);
        let rest = &out[done..];
        let acc = g.iter().zip(rest).take_while(|(a, b)| a.0 == **b).count();
        let emitted = (acc + 1).min(rest.len());
        if let Some(m) = show {
            let text = |t: &[u32]| {
                let ids: Vec<TokenId> = t.iter().copied().map(TokenId).collect();
                format!("{:?}", m.tokenizer.decode(&ids, false).unwrap_or_default())
            };
            let gu: Vec<u32> = g.iter().map(|t| t.0).collect();
            println!(
                "  @{done:3} proposed {:40} accepted {acc} emitted {}",
                text(&gu),
                text(&rest[..emitted])
            );
        }
        r.steps += 1;
        if !g.is_empty() {
            r.verify_steps += 1;
        }
        r.proposed += g.len();
        r.accepted += acc;
        r.cost += verify_cost(g.len() + 1);
        done += emitted;
    }
    p.release(id);
    r
}
