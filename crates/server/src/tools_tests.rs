use super::*;
use quire_tokenizer::ChatTemplate;

fn tools() -> Vec<Value> {
    vec![
        json!({"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {"city": {"type": "string"}}}}}),
        json!({"type": "function", "function": {"name": "get_time"}}),
    ]
}

fn hermes_template() -> ChatTemplate {
    let src =
        "{% for m in messages %}{{ m.content }}{% endfor %}{% if tools %}<tool_call>{% endif %}";
    ChatTemplate::new(src, "", "").unwrap()
}

fn spec(choice: Option<Value>, parallel: Option<bool>) -> ToolSpec {
    ToolSpec::parse(
        Some(&tools()),
        choice.as_ref(),
        parallel,
        &hermes_template(),
    )
    .unwrap()
    .unwrap()
}

#[test]
fn the_template_decides_the_format_and_where_tools_go() {
    let s = spec(None, None);
    assert_eq!(s.format, CallFormat::Hermes);
    assert!(!s.describe_in_system);
    assert_eq!(s.choice, ToolChoice::Auto);
    let plain = ToolSpec::parse(Some(&tools()), None, None, &ChatTemplate::chatml_fallback())
        .unwrap()
        .unwrap();
    assert!(plain.describe_in_system);
    assert!(plain.system_prompt().contains("\"get_weather\""));
    let llama = ChatTemplate::new(
        "{% if tools %}ipython {\"name\": ..., \"parameters\": ...}{% endif %}",
        "",
        "",
    )
    .unwrap();
    let l = ToolSpec::parse(Some(&tools()), None, None, &llama)
        .unwrap()
        .unwrap();
    assert_eq!(l.format, CallFormat::Llama3);
    assert!(!l.parallel, "Llama 3's form is one call per reply");
    // "none", or no tools with auto: no tool handling at all.
    assert!(ToolSpec::parse(
        Some(&tools()),
        Some(&json!("none")),
        None,
        &hermes_template()
    )
    .unwrap()
    .is_none());
    assert!(ToolSpec::parse(None, None, None, &hermes_template())
        .unwrap()
        .is_none());
}

#[test]
fn bad_tool_specs_are_refused_naming_the_field() {
    let t = hermes_template();
    let cases: Vec<(Vec<Value>, Option<Value>, &str)> = vec![
        (vec![json!({"type": "code"})], None, "tools[0]"),
        (vec![json!({"type": "function"})], None, "tools[0]"),
        (
            vec![json!({"type": "function", "function": {"name": ""}})],
            None,
            "tools[0].function.name",
        ),
        (
            vec![json!({"type": "function", "function": {"name": "f", "parameters": 3}})],
            None,
            "tools[0].function.parameters",
        ),
        (tools(), Some(json!("sometimes")), "tool_choice"),
        (
            tools(),
            Some(json!({"type": "function", "function": {"name": "nope"}})),
            "tool_choice",
        ),
        (
            tools(),
            Some(json!({"function": {"name": "get_time"}})),
            "tool_choice",
        ),
        (vec![], Some(json!("required")), "tool_choice"),
        (
            vec![tools()[1].clone(), tools()[1].clone()],
            None,
            "tools[1]",
        ),
    ];
    for (tools, choice, param) in cases {
        let e = ToolSpec::parse(Some(&tools), choice.as_ref(), None, &t).unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some(param),
            "{tools:?} {choice:?}: {}",
            e.message
        );
    }
}

#[test]
fn calls_are_read_back_and_anything_else_stays_text() {
    let s = spec(None, None);
    let text = "Let me check.\n<tool_call>\n{\"name\": \"get_weather\", \"arguments\": {\"city\": \"Paris\"}}\n</tool_call>\n<tool_call>{\"name\": \"get_time\", \"arguments\": {}}</tool_call>";
    let (content, calls) = s.extract(text);
    assert_eq!(content, "Let me check.");
    assert_eq!(
        calls,
        vec![
            ToolCall {
                name: "get_weather".into(),
                arguments: r#"{"city":"Paris"}"#.into()
            },
            ToolCall {
                name: "get_time".into(),
                arguments: "{}".into()
            },
        ]
    );
    for junk in [
        "<tool_call>{\"name\": \"unknown\", \"arguments\": {}}</tool_call>",
        "<tool_call>not json</tool_call>",
        "<tool_call>{\"name\": \"get_time\", \"arguments\": {}}",
        "<tool_call>{\"name\": \"get_time\", \"arguments\": 5}</tool_call>",
    ] {
        let (content, calls) = s.extract(junk);
        assert!(calls.is_empty(), "{junk}");
        assert_eq!(content, junk);
    }
    // Without parallel calls the first call is read and later ones stay text.
    let single = spec(None, Some(false));
    let (content, calls) = single.extract(text);
    assert_eq!(calls.len(), 1);
    assert!(content.ends_with("</tool_call>"), "{content}");
}

#[test]
fn streamed_content_stops_where_a_call_may_begin() {
    let s = spec(None, None);
    assert_eq!(s.safe_prefix("Hello there"), 11);
    assert_eq!(s.safe_prefix("Hello <tool_"), 5);
    assert_eq!(s.safe_prefix("Hello <"), 5);
    assert_eq!(s.safe_prefix("Hello \n<tool_call>{\"name\""), 5);
    assert_eq!(s.safe_prefix("a < b"), 5);
    assert_eq!(s.safe_prefix("  "), 0);
}

#[test]
fn required_and_named_choices_become_grammars() {
    assert!(spec(None, None).constraint().is_none());
    let Some(Constraint::Lark(g)) = spec(Some(json!("required")), None).constraint() else {
        panic!("required gives a grammar");
    };
    assert!(
        g.contains("anyOf") && g.contains("get_weather") && g.contains("get_time"),
        "{g}"
    );
    assert!(g.contains("(\"\\n\" call)*"), "parallel calls repeat: {g}");
    let named = json!({"type": "function", "function": {"name": "get_time"}});
    let Some(Constraint::Lark(g)) = spec(Some(named), Some(false)).constraint() else {
        panic!("a named choice gives a grammar");
    };
    assert!(!g.contains("get_weather") && !g.contains("call)*"), "{g}");
}
