"""Structured outputs and tool calls against `quire serve`, with the official `openai` package and
`jsonschema` to check replies. Called by crates/cli/tests/server.rs (which starts the server on the
default model); prints one JSON line of results and exits non-zero on the first failed check.

Checks:
  - json_schema replies (nested objects, arrays, enums, required fields; greedy and sampled) parse
    and validate against their schemas; json_object replies are objects
  - tool_choice "required" and a named function always give calls whose arguments validate
    against the function's parameters, with finish_reason "tool_calls"
  - streamed tool-call deltas (and content deltas) assemble to the non-streamed message
  - a conversation with an assistant tool call and the tool's result is served
  - bad schemas, grammars and tool specs are 400s whose `param` names the field
"""

import json
import sys

import jsonschema

from server_client import MODEL, check, check_error_shape, client, raw

SCHEMAS = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 20},
            "age": {"type": "integer", "minimum": 0, "maximum": 120},
            "email": {"type": "string", "maxLength": 40},
        },
        "required": ["name", "age"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "id": {"type": "integer"},
            "status": {"enum": ["open", "shipped", "delivered"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "qty": {"type": "integer", "minimum": 1, "maximum": 9},
                    },
                    "required": ["sku", "qty"],
                    "additionalProperties": False,
                },
            },
            "address": {
                "type": "object",
                "properties": {"city": {"type": "string", "maxLength": 20}, "zip": {"type": "string", "pattern": "^[0-9]{5}$"}},
                "required": ["city", "zip"],
                "additionalProperties": False,
            },
        },
        "required": ["id", "status", "items", "address"],
        "additionalProperties": False,
    },
    "tags": {"type": "array", "items": {"enum": ["red", "green", "blue"]}, "minItems": 2, "maxItems": 4},
    "flag": {"type": "boolean"},
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "The current weather in a city.",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
                "additionalProperties": False,
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "get_time",
            "description": "The local time in a time zone.",
            "parameters": {
                "type": "object",
                "properties": {"zone": {"type": "string", "maxLength": 30}},
                "required": ["zone"],
                "additionalProperties": False,
            },
        },
    },
]
PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}


def ask(c, prompt, **kw):
    return c.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": prompt}], max_tokens=300, **kw
    )


def structured(c, out):
    for name, schema in SCHEMAS.items():
        fmt = {"type": "json_schema", "json_schema": {"name": name, "schema": schema, "strict": True}}
        for kw in ({"temperature": 0}, {"temperature": 0.9, "seed": 7}):
            r = ask(c, f"Give me a {name} as JSON.", response_format=fmt, **kw)
            ch = r.choices[0]
            check(ch.finish_reason == "stop", f"{name} {kw}: finish {ch.finish_reason}: {ch.message.content!r}")
            try:
                jsonschema.validate(json.loads(ch.message.content), schema)
            except (json.JSONDecodeError, jsonschema.ValidationError) as e:
                check(False, f"{name} {kw}: {e}: {ch.message.content!r}")
            out["schemas"] += 1
    r = ask(c, "A person as JSON: name and age only.", response_format={"type": "json_object"}, temperature=0)
    ch = r.choices[0]
    check(ch.finish_reason == "stop", f"json_object: finish {ch.finish_reason}: {ch.message.content!r}")
    check(isinstance(json.loads(ch.message.content), dict), "json_object is not an object")
    r = c.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A date?"}],
        max_tokens=40,
        extra_body={"regex": "20[0-9]{2}-[01][0-9]-[0-3][0-9]"},
    )
    text = r.choices[0].message.content
    check(len(text) == 10 and text[:2] == "20" and text[4] == "-" and text[7] == "-", f"regex: {text!r}")


def assemble(stream):
    """A streamed chat reply as (content, tool calls, finish_reason)."""
    content, calls, finish = "", {}, None
    for chunk in stream:
        for ch in chunk.choices:
            d = ch.delta
            content += d.content or ""
            for tc in d.tool_calls or []:
                slot = calls.setdefault(tc.index, {"id": "", "name": "", "arguments": ""})
                slot["id"] += tc.id or ""
                slot["name"] += (tc.function.name or "") if tc.function else ""
                slot["arguments"] += (tc.function.arguments or "") if tc.function else ""
            finish = ch.finish_reason or finish
    return content, [calls[k] for k in sorted(calls)], finish


def tool_calls(c, out):
    prompts = ["What is the weather in Paris?", "What time is it in Tokyo?", "Weather in Oslo and the time in Lima?"]
    named = {"type": "function", "function": {"name": "get_time"}}
    for prompt in prompts:
        for choice in ("required", named):
            for kw in ({"temperature": 0}, {"temperature": 1.0, "seed": 3}):
                r = ask(c, prompt, tools=TOOLS, tool_choice=choice, **kw)
                ch = r.choices[0]
                check(ch.finish_reason == "tool_calls", f"{prompt} {choice}: finish {ch.finish_reason}")
                calls = ch.message.tool_calls or []
                check(calls, f"{prompt} {choice}: no calls: {ch.message}")
                for tc in calls:
                    check(tc.type == "function" and tc.id, f"call shape: {tc}")
                    if choice is named:
                        check(tc.function.name == "get_time", f"named choice called {tc.function.name}")
                    check(tc.function.name in PARAMS, f"unknown function {tc.function.name}")
                    jsonschema.validate(json.loads(tc.function.arguments), PARAMS[tc.function.name])
                    out["calls"] += 1
                if kw["temperature"] == 0:
                    s = ask(c, prompt, tools=TOOLS, tool_choice=choice, stream=True, **kw)
                    content, scalls, finish = assemble(s)
                    # Ids are per response; everything else must agree.
                    check(all(sc["id"] for sc in scalls), f"streamed calls without ids: {scalls}")
                    got = [(sc["name"], sc["arguments"]) for sc in scalls]
                    want = [(t.function.name, t.function.arguments) for t in calls]
                    check(got == want, f"streamed calls {got} != {want}")
                    check(content == (ch.message.content or ""), f"streamed content {content!r}")
                    check(finish == "tool_calls", f"streamed finish {finish}")
                    out["streams"] += 1
    # auto: whatever the model does, the message is well formed and the stream assembles to it.
    r = ask(c, prompts[0], tools=TOOLS, temperature=0)
    s = assemble(ask(c, prompts[0], tools=TOOLS, temperature=0, stream=True))
    m = r.choices[0].message
    want = [(t.function.name, t.function.arguments) for t in m.tool_calls or []]
    got = (s[0], [(sc["name"], sc["arguments"]) for sc in s[1]], s[2])
    check(got == (m.content or "", want, r.choices[0].finish_reason), f"auto: stream {got} != {m}")
    # The tool's result goes back to the model.
    call = {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris", "unit": "celsius"}'}}
    r = c.chat.completions.create(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": None, "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": '{"temp": 21, "sky": "clear"}'},
        ],
        tools=TOOLS,
        max_tokens=30,
        temperature=0,
    )
    check(r.choices[0].finish_reason in ("stop", "length", "tool_calls"), f"tool result turn: {r}")


def bad_requests():
    bad = [
        ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "nope"}}}}, "response_format"),
        ({"response_format": {"type": "yaml"}}, "response_format.type"),
        ({"regex": "(unclosed"}, "regex"),
        ({"grammar": "start: missing_rule"}, "grammar"),
        ({"tools": [{"type": "function", "function": {"name": ""}}]}, "tools[0].function.name"),
        ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
        ({"tools": TOOLS, "tool_choice": "required", "regex": "a+"}, "tool_choice"),
    ]
    for extra, param in bad:
        body = {"model": MODEL, "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5, **extra}
        status, reply = raw("POST", "/v1/chat/completions", json.dumps(body))
        check_error_shape(status, reply, 400, json.dumps(extra))
        check(reply["error"]["param"] == param, f"{extra}: param {reply['error']['param']!r}, want {param!r}")
    return len(bad)


def main():
    c = client()
    out = {"schemas": 0, "calls": 0, "streams": 0}
    structured(c, out)
    tool_calls(c, out)
    out["bad_requests"] = bad_requests()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    sys.exit(main())
