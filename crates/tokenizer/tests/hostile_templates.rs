//! Chat templates come from model files, which are untrusted input: a template that loops for
//! ever or builds a huge string must stop with a clear error, quickly, not hang or abort.

use std::time::{Duration, Instant};

use quire_tokenizer::{ChatMessage, ChatTemplate, TokenizerError};

fn render(source: &str) -> (Result<String, TokenizerError>, Duration) {
    let t = ChatTemplate::new(source, "<s>", "</s>").expect("compiles");
    let start = Instant::now();
    let r = t.render(&[ChatMessage::new("user", "hi")], true);
    (r, start.elapsed())
}

fn assert_limited(source: &str) {
    let (r, took) = render(source);
    match r {
        Err(e @ TokenizerError::TemplateLimit { .. }) => {
            assert!(e.to_string().contains("work limit"), "{e}");
        }
        other => panic!("expected the work limit, got {other:?}"),
    }
    assert!(took < Duration::from_secs(5), "stopping took {took:?}");
}

#[test]
fn nested_loops_run_out_of_fuel() {
    assert_limited(
        "{% for i in range(10000) %}{% for j in range(10000) %}{% for k in range(10000) %}\
         {% endfor %}{% endfor %}{% endfor %}",
    );
}

#[test]
fn doubling_a_string_runs_out_of_fuel() {
    assert_limited(
        "{% set ns = namespace(s='xxxxxxxxxxxxxxxx') %}{% for i in range(60) %}\
         {% set ns.s = ns.s ~ ns.s %}{% endfor %}{{ ns.s | length }}",
    );
    assert_limited("{{ ('x' * 1000000) * 1000 }}");
}

#[test]
fn ordinary_templates_are_well_inside_the_budget() {
    let t = ChatTemplate::new(
        "{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content | trim }}<|im_end|>\n\
         {% endfor %}{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}",
        "",
        "",
    )
    .unwrap();
    // 2,000 turns of 500 bytes: far more than a context holds.
    let msgs: Vec<ChatMessage> = (0..2000)
        .map(|i| {
            ChatMessage::new(
                if i % 2 == 0 { "user" } else { "assistant" },
                "w ".repeat(250),
            )
        })
        .collect();
    let out = t.render(&msgs, true).unwrap();
    assert!(out.len() > 1_000_000);
}
