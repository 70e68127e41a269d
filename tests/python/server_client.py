"""Drives `quire serve` with the official `openai` package (and raw HTTP where a client library
would refuse to send what we want to test). Called by crates/cli/tests/server.rs, which starts the
server and passes its URL; each mode prints one JSON line of results on stdout and exits non-zero
on the first failed check, with the reason on stderr.

Modes:
  basic EXPECT.json   chat and completions, streaming and not: text equals `quire generate`'s,
                      usage counts are right, errors have OpenAI's shape, the API key is checked
  concurrent N        N streaming clients at once; each greedy text equals its solo run
  chaos N             N requests: valid ones, early disconnects, malformed bodies; afterwards
                      nothing runs and no KV block is held
  metrics             /metrics parsed with prometheus_client's parser
  load N MAX_TOKENS   N streaming clients; prints STARTED once all are admitted, then reports how
                      each ended (for the SIGTERM test)
"""

import asyncio
import json
import os
import random
import socket
import sys
import time
import urllib.error
import urllib.request
from urllib.parse import urlparse

import openai
from prometheus_client.parser import text_string_to_metric_families

URL = os.environ["QUIRE_URL"]
KEY = os.environ.get("QUIRE_KEY", "none")
MODEL = os.environ.get("QUIRE_MODEL_ID", "")


def fail(msg):
    print(f"FAILED: {msg}", file=sys.stderr)
    sys.exit(1)


def check(cond, msg):
    if not cond:
        fail(msg)


def client(**kw):
    return openai.OpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=300, **kw)


def aclient():
    return openai.AsyncOpenAI(base_url=URL + "/v1", api_key=KEY, max_retries=0, timeout=300)


def raw(method, path, body=None, headers=None):
    """(status, parsed JSON or text) of one plain HTTP request."""
    data = body if isinstance(body, (bytes, type(None))) else body.encode()
    h = {"Content-Type": "application/json", "Authorization": f"Bearer {KEY}"}
    h.update(headers or {})
    req = urllib.request.Request(URL + path, data=data, method=method, headers=h)
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            status, text = r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        status, text = e.code, e.read().decode()
    try:
        return status, json.loads(text)
    except json.JSONDecodeError:
        return status, text


def metrics():
    with urllib.request.urlopen(URL + "/metrics", timeout=30) as r:
        text = r.read().decode()
    values = {}
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            key = s.name + (json.dumps(s.labels, sort_keys=True) if s.labels else "")
            values[key] = s.value
    return text, values


def check_error_shape(status, body, want_status, what):
    check(status == want_status, f"{what}: status {status}, want {want_status}: {body}")
    check(isinstance(body, dict) and "error" in body, f"{what}: no error object: {body}")
    e = body["error"]
    for k in ("message", "type", "param", "code"):
        check(k in e, f"{what}: error lacks {k}: {body}")
    check(isinstance(e["message"], str) and e["message"], f"{what}: empty message")


def mode_basic(expect_path):
    expect = json.load(open(expect_path))
    c = client()
    model = MODEL
    models = c.models.list()
    check([m.id for m in models.data] == [model], f"models: {models}")

    for e in expect["completions"]:
        r = c.completions.create(model=model, prompt=e["prompt"], max_tokens=e["max_tokens"], temperature=0)
        ch = r.choices[0]
        check(ch.text == e["text"], f"completion text {ch.text!r} != generate's {e['text']!r}")
        check(ch.finish_reason == e["finish_reason"], f"finish {ch.finish_reason} != {e['finish_reason']}")
        check(r.usage.prompt_tokens == e["prompt_tokens"], f"usage.prompt_tokens {r.usage.prompt_tokens} != {e['prompt_tokens']}")
        check(r.usage.completion_tokens == e["completion_tokens"], f"usage.completion_tokens {r.usage}")
        check(r.usage.total_tokens == e["prompt_tokens"] + e["completion_tokens"], "total_tokens")
        # Streaming: the concatenated deltas are the same text; usage comes in the last chunk.
        text, finish, usage, chunks = "", None, None, 0
        for chunk in c.completions.create(model=model, prompt=e["prompt"], max_tokens=e["max_tokens"],
                                          temperature=0, stream=True, stream_options={"include_usage": True}):
            chunks += 1
            if chunk.usage is not None:
                usage = chunk.usage
                check(chunk.choices == [], "the usage chunk has no choices")
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
        check(text == e["text"], f"streamed completion {text!r} != {e['text']!r}")
        check(finish == e["finish_reason"], f"streamed finish {finish}")
        check(usage is not None and usage.completion_tokens == e["completion_tokens"]
              and usage.prompt_tokens == e["prompt_tokens"], f"stream usage {usage}")
        check(chunks >= 2, "streaming sent one chunk only")

    for e in expect["chats"]:
        msgs = [{"role": "user", "content": e["prompt"]}]
        r = c.chat.completions.create(model=model, messages=msgs, max_tokens=e["max_tokens"], temperature=0)
        m = r.choices[0].message
        check(m.role == "assistant" and m.content == e["text"], f"chat {m.content!r} != {e['text']!r}")
        check(r.usage.prompt_tokens == e["prompt_tokens"], f"chat usage {r.usage} vs {e['prompt_tokens']}")
        check(r.usage.completion_tokens == e["completion_tokens"], f"chat usage {r.usage}")
        check(r.choices[0].finish_reason == e["finish_reason"], "chat finish")
        text, role, usage = "", None, None
        for chunk in c.chat.completions.create(model=model, messages=msgs, max_completion_tokens=e["max_tokens"],
                                               temperature=0, stream=True, stream_options={"include_usage": True}):
            if chunk.usage is not None:
                usage = chunk.usage
            for ch in chunk.choices:
                role = ch.delta.role or role
                text += ch.delta.content or ""
        check(role == "assistant", "stream role")
        check(text == e["text"], f"streamed chat {text!r} != {e['text']!r}")
        check(usage.completion_tokens == e["completion_tokens"], f"streamed chat usage {usage}")

    # Stop strings, n, seed, logprobs.
    e = expect["completions"][0]
    stop_at = e["text"][len(e["text"]) // 2:][:3]
    if stop_at.strip():
        r = c.completions.create(model=model, prompt=e["prompt"], max_tokens=e["max_tokens"], temperature=0, stop=[stop_at])
        check(r.choices[0].finish_reason == "stop", "stop string finish")
        check(stop_at not in r.choices[0].text and e["text"].startswith(r.choices[0].text), "stop string cut")
    r = c.completions.create(model=model, prompt=e["prompt"], max_tokens=8, temperature=0.9, seed=7, n=3)
    check(len(r.choices) == 3 and [ch.index for ch in r.choices] == [0, 1, 2], "n choices")
    check(r.usage.prompt_tokens == e["prompt_tokens"], "n: the prompt counts once")
    r2 = c.completions.create(model=model, prompt=e["prompt"], max_tokens=8, temperature=0.9, seed=7, n=3)
    check([ch.text for ch in r.choices] == [ch.text for ch in r2.choices], "the same seed repeats")
    r = c.completions.create(model=model, prompt=e["prompt"], max_tokens=4, temperature=0, logprobs=3)
    lp = r.choices[0].logprobs
    check(len(lp.tokens) == 4 and len(lp.token_logprobs) == 4 and all(len(t) == 3 for t in lp.top_logprobs), f"logprobs {lp}")
    check("".join(lp.tokens) == r.choices[0].text, "logprob tokens spell the text")
    check(all(v <= 0 for v in lp.token_logprobs), "logprobs are <= 0")
    r = c.chat.completions.create(model=model, messages=[{"role": "user", "content": "Hi"}], max_tokens=3,
                                  temperature=0, logprobs=True, top_logprobs=2)
    content = r.choices[0].logprobs.content
    check(len(content) == r.usage.completion_tokens and all(len(t.top_logprobs) == 2 for t in content), "chat logprobs")
    check(abs(content[0].logprob - content[0].top_logprobs[0].logprob) < 1e-6, "greedy token is the top one")
    for kw in ({"presence_penalty": 1.5}, {"frequency_penalty": 1.0}, {"top_k": 5, "temperature": 0.8, "seed": 1},
               {"top_p": 0.5, "temperature": 0.8, "seed": 1}, {"min_p": 0.2, "temperature": 0.8, "seed": 1}):
        extra = {k: v for k, v in kw.items() if k in ("top_k", "min_p")}
        std = {k: v for k, v in kw.items() if k not in extra}
        r = c.completions.create(model=model, prompt=e["prompt"], max_tokens=6, extra_body=extra, **std)
        check(r.usage.completion_tokens >= 1, f"sampling with {kw}")

    # Errors: OpenAI's shape and status.
    cases = [
        ("/v1/completions", "{not json", 400, None),
        ("/v1/completions", '{"prompt": "x", "max_tokens": "ten"}', 400, "max_tokens"),
        ("/v1/completions", '{"prompt": "x", "temperature": [1]}', 400, "temperature"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 0}', 400, "max_tokens"),
        ("/v1/completions", '{"prompt": "x", "max_tokens": 100000000}', 400, "max_tokens"),
        ("/v1/completions", '{"prompt": "x", "model": "gpt-17"}', 400, "model"),
        ("/v1/completions", '{"max_tokens": 3}', 400, "prompt"),
        ("/v1/completions", json.dumps({"prompt": "word " * 9000}), 400, "prompt"),
        ("/v1/completions", '{"prompt": [99999999]}', 400, None),
        ("/v1/chat/completions", '{"messages": []}', 400, "messages"),
        ("/v1/chat/completions", '{"messages": [{"role": "wizard", "content": "x"}]}', 400, "messages[0].role"),
        ("/v1/chat/completions", '{"messages": "hi"}', 400, "messages"),
    ]
    for path, body, status, param in cases:
        s, b = raw("POST", path, body)
        check_error_shape(s, b, status, f"{path} {body[:60]}")
        if param is not None:
            check(b["error"]["param"] == param, f"{body[:60]}: param {b['error']['param']} != {param}")
    s, b = raw("POST", "/v1/completions", json.dumps({"prompt": "word " * 9000}))
    check(b["error"]["code"] == "context_length_exceeded", f"long prompt code {b}")
    s, b = raw("GET", "/v1/nothing")
    check_error_shape(s, b, 404, "unknown path")
    try:
        c.completions.create(model="gpt-17", prompt="x", max_tokens=1)
        fail("an unknown model was served")
    except openai.BadRequestError as err:
        check(err.status_code == 400, "unknown model status")
    if KEY != "none":
        s, b = raw("POST", "/v1/completions", '{"prompt": "x"}', headers={"Authorization": "Bearer wrong"})
        check_error_shape(s, b, 401, "wrong API key")
        s, b = raw("GET", "/v1/models", headers={"Authorization": ""})
        check_error_shape(s, b, 401, "missing API key")
        try:
            openai.OpenAI(base_url=URL + "/v1", api_key="wrong", max_retries=0).models.list()
            fail("a wrong key was accepted")
        except openai.AuthenticationError:
            pass
    s, b = raw("GET", "/health")
    check(s == 200 and b["status"] == "ok", f"health {s} {b}")
    print(json.dumps({"completions": len(expect["completions"]), "chats": len(expect["chats"]), "error_cases": len(cases)}))


PROMPTS = [
    "The capital of France is",
    "Write a list of three fruits:",
    "def fibonacci(n):",
    "Once upon a time, in a small village,",
    "The meaning of life is",
    "Translate to French: good morning",
    "1, 2, 3, 4,",
    "Paged attention stores the KV cache in",
]


async def stream_one(ac, prompt, max_tokens, chat=False):
    text, finish = "", None
    if chat:
        s = await ac.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": prompt}],
                                             max_tokens=max_tokens, temperature=0, stream=True)
        async for chunk in s:
            for ch in chunk.choices:
                text += ch.delta.content or ""
                finish = ch.finish_reason or finish
    else:
        s = await ac.completions.create(model=MODEL, prompt=prompt, max_tokens=max_tokens, temperature=0, stream=True)
        async for chunk in s:
            for ch in chunk.choices:
                text += ch.text
                finish = ch.finish_reason or finish
    return text, finish


def mode_concurrent(n):
    n = int(n)
    jobs = [(PROMPTS[i % len(PROMPTS)], [24, 7, 31, 16][(i // len(PROMPTS)) % 4], i % 3 == 2) for i in range(n)]

    async def solo():
        ac = aclient()
        out = {}
        for job in sorted(set(jobs)):
            out[job] = await stream_one(ac, *job)
        return out

    async def together():
        ac = aclient()
        return await asyncio.gather(*(stream_one(ac, *job) for job in jobs))

    solos = asyncio.run(solo())
    t0 = time.time()
    results = asyncio.run(together())
    dt = time.time() - t0
    for job, got in zip(jobs, results):
        check(got == solos[job], f"{job}: concurrent {got!r} != solo {solos[job]!r}")
    print(json.dumps({"clients": n, "distinct": len(solos), "seconds": round(dt, 2)}))


async def raw_http(path, body, read_bytes=None, delay=None):
    """Sends a request over a plain socket. With read_bytes, closes after that many response bytes
    (or at once when 0); returns (status, body text) otherwise."""
    u = urlparse(URL)
    reader, writer = await asyncio.open_connection(u.hostname, u.port)
    data = body.encode() if isinstance(body, str) else body
    head = (f"POST {path} HTTP/1.1\r\nHost: {u.hostname}\r\nContent-Type: application/json\r\n"
            f"Authorization: Bearer {KEY}\r\nContent-Length: {len(data)}\r\nConnection: close\r\n\r\n")
    writer.write(head.encode() + data)
    await writer.drain()
    if read_bytes is not None:
        if delay:
            await asyncio.sleep(delay)
        if read_bytes:
            await reader.read(read_bytes)
        writer.transport.abort()
        return None, None
    resp = await reader.read()
    writer.close()
    text = resp.decode(errors="replace")
    status = int(text.split(" ", 2)[1])
    return status, text.split("\r\n\r\n", 1)[1] if "\r\n\r\n" in text else ""


MALFORMED = [
    "{", "[]", "null", '"text"', "{\"prompt\": }", '{"prompt": 12.5}', '{"prompt": "x", "n": "two"}',
    '{"prompt": "x", "stop": 5}', '{"prompt": "x", "top_p": 7}', '{"prompt": "x", "seed": "s"}',
    '{"prompt": "x", "stream": "yes"}', '{"prompt": "x", "logprobs": 500}', '{"prompt": [[]]}',
    '{"messages": [{"role": "user"}], "top_logprobs": 3}', "\xff\xfe garbage", '{"prompt": "x", "max_tokens": 1e9}',
]


def mode_chaos(n):
    n = int(n)
    rng = random.Random(1234)

    async def one(i, sem):
        async with sem:
            kind = rng.choice(["valid", "valid_stream", "disconnect", "disconnect_late", "malformed", "malformed_chat"])
            prompt = rng.choice(PROMPTS) + " " + str(i)
            body = json.dumps({"prompt": prompt, "max_tokens": rng.randint(1, 6), "temperature": 0.7,
                               "stream": kind != "valid"})
            if kind == "disconnect":
                await raw_http("/v1/completions", body, read_bytes=0)
                return kind, None
            if kind == "disconnect_late":
                long_body = json.dumps({"prompt": prompt, "max_tokens": 200, "stream": True, "ignore_eos": True})
                await raw_http("/v1/completions", long_body, read_bytes=rng.randint(1, 2000), delay=rng.random() * 0.3)
                return kind, None
            if kind.startswith("malformed"):
                path = "/v1/chat/completions" if kind == "malformed_chat" else "/v1/completions"
                status, text = await raw_http(path, rng.choice(MALFORMED).encode("latin-1"))
                check(400 <= status < 500, f"malformed body got {status}: {text[:200]}")
                err = json.loads(text)
                check("error" in err and err["error"]["message"], f"error JSON {text[:200]}")
                return kind, status
            status, text = await raw_http("/v1/completions", body)
            check(status == 200, f"valid request got {status}: {text[:300]}")
            if kind == "valid_stream":
                check("data: [DONE]" in text, f"stream did not end with [DONE]: {text[-200:]}")
            return kind, status

    async def run():
        sem = asyncio.Semaphore(32)
        return await asyncio.gather(*(one(i, sem) for i in range(n)))

    t0 = time.time()
    results = asyncio.run(run())
    counts = {}
    for kind, _ in results:
        counts[kind] = counts.get(kind, 0) + 1
    # Aborted requests are freed within one engine step; give it a moment.
    deadline = time.time() + 20
    while True:
        _, v = metrics()
        idle = v["quire_requests_running"] == 0 and v["quire_requests_waiting"] == 0 and v["quire_kv_blocks_used"] == 0
        if idle or time.time() > deadline:
            break
        time.sleep(0.2)
    check(idle, f"after chaos: running {v['quire_requests_running']}, waiting {v['quire_requests_waiting']}, "
                f"kv blocks used {v['quire_kv_blocks_used']}")
    s, b = raw("GET", "/health")
    check(s == 200, "the server is still up")
    aborted = v.get('quire_requests_total{"finish_reason": "abort"}', 0)
    check(aborted > 0, "some disconnects aborted running requests")
    print(json.dumps({"requests": n, "kinds": counts, "seconds": round(time.time() - t0, 1),
                      "aborted_total": aborted}))


def mode_metrics():
    text, v = metrics()
    fams = {f.name: f.type for f in text_string_to_metric_families(text)}
    want = {
        "quire_requests_running": "gauge", "quire_requests_waiting": "gauge", "quire_kv_blocks_used": "gauge",
        "quire_kv_blocks_total": "gauge", "quire_preemptions": "counter", "quire_prefix_cache_queries": "counter",
        "quire_prefix_cache_hits": "counter", "quire_prompt_tokens": "counter", "quire_generation_tokens": "counter",
        "quire_requests": "counter", "quire_time_to_first_token_seconds": "histogram",
        "quire_inter_token_latency_seconds": "histogram", "quire_e2e_request_latency_seconds": "histogram",
    }
    for name, kind in want.items():
        check(fams.get(name) == kind, f"family {name}: {fams.get(name)} (want {kind})")
    check(v["quire_kv_blocks_total"] > 0, "kv_blocks_total")
    done = sum(val for k, val in v.items() if k.startswith("quire_requests_total{"))
    check(done > 0 and v["quire_generation_tokens_total"] > 0, "counters moved")
    ended = sum(val for k, val in v.items() if k.startswith("quire_requests_total{") and "abort" not in k)
    check(v["quire_e2e_request_latency_seconds_count"] == ended, f"one e2e sample per completed request: {ended}")
    check(v['quire_time_to_first_token_seconds_bucket{"le": "+Inf"}'] == v["quire_time_to_first_token_seconds_count"], "+Inf bucket")
    check(v["quire_prefix_cache_hits_total"] > 0, "repeated prompts hit the prefix cache")
    print(json.dumps({"families": len(fams), "requests_total": done,
                      "generation_tokens_total": v["quire_generation_tokens_total"]}))


def mode_load(n, max_tokens):
    n, max_tokens = int(n), int(max_tokens)

    async def one(ac, i, started):
        text, finish, err = "", None, None
        try:
            s = await ac.completions.create(model=MODEL, prompt=PROMPTS[i % len(PROMPTS)], max_tokens=max_tokens,
                                            temperature=0, stream=True, extra_body={"ignore_eos": True})
            async for chunk in s:
                started.add(i)
                for ch in chunk.choices:
                    text += ch.text
                    finish = ch.finish_reason or finish
        except Exception as e:  # reported, and judged by the Rust test
            err = repr(e)
        return {"finish": finish, "chars": len(text), "error": err}

    async def run():
        ac = aclient()
        started = set()
        tasks = [asyncio.create_task(one(ac, i, started)) for i in range(n)]
        while len(started) < n and not all(t.done() for t in tasks):
            await asyncio.sleep(0.05)
        print("STARTED", flush=True)
        return await asyncio.gather(*tasks)

    results = asyncio.run(run())
    print(json.dumps(results), flush=True)


if __name__ == "__main__":
    mode, args = sys.argv[1], sys.argv[2:]
    {"basic": mode_basic, "concurrent": mode_concurrent, "chaos": mode_chaos, "metrics": mode_metrics,
     "load": mode_load}[mode](*args)
