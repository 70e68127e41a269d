//! Chat-template rendering against Hugging Face's environment. The expected strings were produced by
//! Jinja2 3.1.6 set up as transformers does (`ImmutableSandboxedEnvironment(trim_blocks=True,
//! lstrip_blocks=True, extensions=[loopcontrols])`, `tojson` = `json.dumps(ensure_ascii=False)`,
//! `raise_exception`) on the same templates and messages.

use quire_tokenizer::{ChatMessage, ChatTemplate, TokenizerError};

fn messages() -> Vec<ChatMessage> {
    vec![
        ChatMessage::new("system", "  Be brief.  "),
        ChatMessage::new("user", "Hi there"),
        ChatMessage::new("assistant", "Yo"),
    ]
}

fn render(source: &str) -> String {
    ChatTemplate::new(source, "<s>", "</s>")
        .expect("compiles")
        .render(&messages(), true)
        .expect("renders")
}

#[test]
fn trim_and_lstrip_blocks_as_in_transformers() {
    let source = "{% for m in messages %}\n  {% if m.role != 'system' %}\n  {{ m.role }}: \
                  {{ m.content }}\n  {% endif %}\n{% endfor %}\n";
    assert_eq!(render(source), "  user: Hi there\n  assistant: Yo\n");
}

#[test]
fn python_string_and_dict_methods() {
    let source =
        "{{ messages[0].content.strip() }}|{{ messages[1].content.upper() }}|{% for k, v in \
                  messages[0].items() %}{{ k }}={{ v.strip() }};{% endfor %}|{{ \
                  messages[1].content.replace('Hi', 'Hello') }}|{% if \
                  messages[1].content.startswith('Hi') and messages[2].content.endswith('o') \
                  %}yes{% endif %}|{{ messages[1].content.split()[1] }}";
    assert_eq!(
        render(source),
        "Be brief.|HI THERE|role=system;content=Be brief.;|Hello there|yes|there"
    );
}

#[test]
fn tojson_is_python_json_dumps() {
    let source = "{{ {'a': \"<b>&'é\\n\", 'n': 1.5, 'l': [1, none, true], 'e': {}} | tojson }}\n\
                  {{ {'z': 1, 'a': [1, 2]} | tojson(indent=2) }}\n\
                  {{ {'z': 1, 'a': 2} | tojson(sort_keys=true, separators=(',', ':')) }}\n\
                  {{ 'é' | tojson(ensure_ascii=true) }}\n\
                  {{ messages[0] | tojson }}";
    assert_eq!(
        render(source),
        "{\"a\": \"<b>&'é\\n\", \"n\": 1.5, \"l\": [1, null, true], \"e\": {}}\n\
         {\n  \"z\": 1,\n  \"a\": [\n    1,\n    2\n  ]\n}\n\
         {\"a\":2,\"z\":1}\n\
         \"\\u00e9\"\n\
         {\"role\": \"system\", \"content\": \"  Be brief.  \"}"
    );
}

#[test]
fn variables_loop_controls_and_namespace() {
    let source = "{{ bos_token }}{% set ns = namespace(n=0) %}{% for m in messages %}{% if \
                  loop.index > 2 %}{% break %}{% endif %}{% set ns.n = ns.n + 1 %}{% if m.role == \
                  'system' %}{% continue %}{% endif %}[{{ m.content | trim }}]{% endfor %}{{ ns.n \
                  }}{{ eos_token }}{% if add_generation_prompt %}GEN{% endif %}";
    assert_eq!(render(source), "<s>[Hi there]2</s>GEN");
}

#[test]
fn raise_exception_is_an_error_with_the_message() {
    let t = ChatTemplate::new(
        "{% if messages[0].role != 'user' %}{{ raise_exception('Conversations must start with a \
         user message') }}{% endif %}",
        "",
        "",
    )
    .expect("compiles");
    let err = t.render(&messages(), false).expect_err("raises");
    assert!(matches!(err, TokenizerError::Template(_)));
    assert!(
        err.to_string()
            .contains("Conversations must start with a user message"),
        "{err}"
    );
    assert!(t.render(&messages()[1..], false).is_ok());
}

#[test]
fn strftime_now_formats_the_current_date() {
    let out = render("{{ strftime_now('%Y-%m-%d') }}|{{ strftime_now('%d %b %Y') }}");
    let (iso, human) = out.split_once('|').expect("two dates");
    assert_eq!(iso.len(), 10, "{iso}");
    assert!(iso.starts_with("20"), "{iso}");
    assert_eq!(&human[human.len() - 4..], &iso[..4]);
}

#[test]
fn generation_tags_render_their_content() {
    assert_eq!(
        render(
            "{% for m in messages %}{% generation %}{{ m.role[0] }}{% endgeneration %}{% endfor %}"
        ),
        "sua"
    );
}

#[test]
fn extra_variables() {
    let t = ChatTemplate::new(
        "{% if tools %}{{ tools | tojson }}{% endif %}{{ messages | length }}",
        "",
        "",
    )
    .expect("compiles");
    let mut extra = serde_json::Map::new();
    extra.insert("tools".into(), serde_json::json!([{"name": "f"}]));
    assert_eq!(
        t.render_with(&messages(), false, extra).expect("renders"),
        "[{\"name\": \"f\"}]3"
    );
    assert_eq!(t.render(&messages(), false).expect("renders"), "3");
}

#[test]
fn broken_templates_are_errors() {
    assert!(ChatTemplate::new("{% for m in messages %}", "", "").is_err());
    // Unknown filters and methods are found when rendering.
    for source in [
        "{{ messages | no_such_filter }}",
        "{{ messages[0].content.no_such_method() }}",
    ] {
        let t = ChatTemplate::new(source, "", "").expect("compiles");
        assert!(t.render(&messages(), false).is_err(), "{source}");
    }
}

#[test]
fn chatml_fallback() {
    let t = ChatTemplate::chatml_fallback();
    assert_eq!(
        t.render(&messages()[1..], true).expect("renders"),
        "<|im_start|>user\nHi there<|im_end|>\n<|im_start|>assistant\nYo<|im_end|>\n\
         <|im_start|>assistant\n"
    );
    assert_eq!(t.render(&[], false).expect("renders"), "");
}
