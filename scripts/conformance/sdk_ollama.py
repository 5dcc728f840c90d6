"""The official `ollama` Python package against a live mlxd (the Ollama API subset).

Usage: sdk_ollama.py BASE_URL. Each check prints `ok` or `FAIL` with the reason; the exit
status is the number of failures (0: all passed). Generations are short and greedy; the
JSON schema is what makes the small default model's structured output well-formed.
"""
import datetime
import json
import sys
import time
import urllib.error
import urllib.request

import jsonschema
import ollama
from harness import check, finish

BASE = sys.argv[1]
MODEL = "smollm2-135m"
client = ollama.Client(host=BASE)
GREEDY = {"temperature": 0, "num_predict": 8}

PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
    },
    "required": ["name", "age"],
    "additionalProperties": False,
}
WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string"}},
            "required": ["city"],
        },
    },
}

def assert_done(r):
    """The final object: done, a reason, counts and durations in nanoseconds."""
    assert r.done is True, r
    assert r.done_reason in ("stop", "length"), r.done_reason
    assert r.prompt_eval_count and r.prompt_eval_count > 0, r
    assert r.eval_count and 1 <= r.eval_count <= GREEDY["num_predict"], r
    assert r.total_duration and r.total_duration >= r.eval_duration > 0, r
    assert r.load_duration is not None and r.prompt_eval_duration is not None, r
    assert r.model == MODEL and r.created_at, r


@check("version")
def _():
    v = json.load(urllib.request.urlopen(f"{BASE}/api/version"))
    assert isinstance(v["version"], str) and v["version"], v
    return v["version"]


@check("list (/api/tags)")
def _():
    names = [m.model for m in client.list().models]
    assert MODEL in names, names
    m = next(m for m in client.list().models if m.model == MODEL)
    assert m.details.family == "llama", m.details
    assert m.size and m.size > 0 and m.digest and m.modified_at, m
    return f"{names}, {m.details.parameter_size} {m.details.quantization_level}"


@check("chat")
def _():
    r = client.chat(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], options=GREEDY)
    assert r.message.role == "assistant" and r.message.content, r.message
    assert_done(r)
    return repr(r.message.content)


@check("chat stream")
def _():
    parts = list(
        client.chat(
            model=MODEL, messages=[{"role": "user", "content": "Say hello."}], options=GREEDY, stream=True
        )
    )
    assert all(not p.done for p in parts[:-1]) and len(parts) >= 2, parts
    text = "".join(p.message.content for p in parts)
    assert text, parts
    assert_done(parts[-1])
    whole = client.chat(model=MODEL, messages=[{"role": "user", "content": "Say hello."}], options=GREEDY)
    assert text == whole.message.content, (text, whole.message.content)
    return f"{len(parts)} parts, {text!r}"


@check("generate and generate stream (system, options)")
def _():
    r = client.generate(model=MODEL, prompt="The capital of France is", system="Answer briefly.", options=GREEDY)
    assert r.response, r
    assert_done(r)
    parts = list(
        client.generate(
            model=MODEL, prompt="The capital of France is", system="Answer briefly.", options=GREEDY, stream=True
        )
    )
    assert "".join(p.response for p in parts) == r.response, (parts, r.response)
    assert_done(parts[-1])
    return repr(r.response)


@check("generate raw")
def _():
    r = client.generate(model=MODEL, prompt="One, two, three,", raw=True, options=GREEDY)
    assert r.response and r.done, r
    return repr(r.response)


@check("chat format: JSON schema")
def _():
    r = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "Invent a person."}],
        format=PERSON,
        options={"temperature": 0, "num_predict": 48},
    )
    jsonschema.validate(json.loads(r.message.content), PERSON)
    return r.message.content


@check("chat format: json")
def _():
    r = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "A JSON object with a key a."}],
        format="json",
        options={"temperature": 0, "num_predict": 16},
    )
    if r.done_reason == "stop":
        assert isinstance(json.loads(r.message.content), dict), r.message.content
    else:
        assert r.message.content.lstrip().startswith("{"), r.message.content
    return r.message.content


@check("chat with tools and a tool result")
def _():
    r = client.chat(
        model=MODEL,
        messages=[{"role": "user", "content": "What is the weather in Paris?"}],
        tools=[WEATHER],
        options={"temperature": 0, "num_predict": 32},
    )
    assert r.done, r
    for call in r.message.tool_calls or []:
        assert isinstance(call.function.arguments, dict), call
    r = client.chat(
        model=MODEL,
        messages=[
            {"role": "user", "content": "What is the weather in Paris?"},
            {"role": "assistant", "content": "", "tool_calls": [
                {"function": {"name": "get_weather", "arguments": {"city": "Paris"}}}]},
            {"role": "tool", "content": "sunny, 21 C", "tool_name": "get_weather"},
        ],
        tools=[WEATHER],
        options=GREEDY,
    )
    assert r.message.content or r.message.tool_calls, r
    return repr(r.message.content)


@check("ps (/api/ps)")
def _():
    models = client.ps().models
    m = next(m for m in models if m.model == MODEL)
    assert m.size and m.size > 0 and m.expires_at and m.digest, m
    assert m.details.family == "llama", m.details
    return f"size {m.size}, expires {m.expires_at}"


@check("show (/api/show)")
def _():
    s = client.show(MODEL)
    assert s.details.family == "llama", s.details
    assert s.template and "completion" in s.capabilities, s
    assert s.modelinfo["general.architecture"] == "llama", s.modelinfo
    assert s.modelinfo["llama.context_length"] > 0, s.modelinfo
    return f"{s.capabilities}, {s.details.parameter_size}"


@check("pull (/api/pull) with progress")
def _():
    statuses = [p.status for p in client.pull(MODEL, stream=True)]
    assert statuses[0] == "pulling manifest" and statuses[-1] == "success", statuses
    assert client.pull(MODEL).status == "success"
    return f"{len(statuses)} lines"


def expect_error(status, needle, f):
    try:
        f()
    except ollama.ResponseError as e:
        assert e.status_code == status, (e.status_code, e.error)
        assert needle in e.error, e.error
        return f"{e.status_code} {e.error!r}"
    raise AssertionError(f"no error (expected {status})")


@check("bad requests: a wrong option type, an unknown model, suffix, num_predict, embeddings")
def _():
    out = [
        expect_error(400, "temperature", lambda: client.chat(
            model=MODEL, messages=[{"role": "user", "content": "x"}], options={"temperature": "hot"})),
        expect_error(404, "not found", lambda: client.chat(
            model="no-such-model", messages=[{"role": "user", "content": "x"}])),
        expect_error(400, "suffix", lambda: client.generate(model=MODEL, prompt="x", suffix="y")),
        expect_error(400, "num_predict", lambda: client.generate(
            model=MODEL, prompt="x", options={"num_predict": -3})),
        expect_error(501, "embeddings", lambda: client.embed(model=MODEL, input="x")),
        expect_error(501, "embeddings", lambda: client.embeddings(model=MODEL, prompt="x")),
    ]
    # What the client itself refuses to send, sent raw.
    req = urllib.request.Request(
        f"{BASE}/api/generate", data=json.dumps({"model": MODEL, "prompt": "x", "format": "yaml"}).encode()
    )
    try:
        urllib.request.urlopen(req)
        raise AssertionError("format yaml accepted")
    except urllib.error.HTTPError as e:
        assert e.code == 400, e.code
        body = json.load(e)
        assert list(body) == ["error"] and "invalid format" in body["error"], body
        out.append(f"400 {body['error']!r}")
    return "; ".join(out)


def expires_in():
    """Seconds until /api/ps says the model is unloaded."""
    m = next(m for m in client.ps().models if m.model == MODEL)
    return (m.expires_at - datetime.datetime.now(datetime.timezone.utc)).total_seconds()


@check("keep_alive durations: kept by later requests, forever, and a short one unloads")
def _():
    r = client.generate(model=MODEL, prompt="Hi", options=GREEDY, keep_alive="1h")
    assert r.done, r
    assert 3590 <= expires_in() <= 3601, expires_in()
    client.chat(model=MODEL, messages=[{"role": "user", "content": "Hi"}], options=GREEDY)
    assert 3590 <= expires_in() <= 3601, "a request without keep_alive changed it"
    client.generate(model=MODEL, keep_alive=-1)
    assert expires_in() > 100 * 365 * 86400, expires_in()
    client.generate(model=MODEL, keep_alive=1.5)
    deadline = time.monotonic() + 30
    while MODEL in [m.model for m in client.ps().models]:
        assert time.monotonic() < deadline, "not unloaded after keep_alive 1.5 s"
        time.sleep(0.1)
    r = client.generate(model=MODEL)
    assert r.done_reason == "load", r
    assert 200 <= expires_in() <= 301, "the configured ttl is back"
    return None


@check("keep_alive 0 unloads the model")
def _():
    r = client.generate(model=MODEL, prompt="Hi", options=GREEDY, keep_alive=0)
    assert r.done, r
    r = client.generate(model=MODEL, keep_alive=0)
    assert r.done_reason == "unload", r
    assert MODEL not in [m.model for m in client.ps().models]
    r = client.generate(model=MODEL)
    assert r.done_reason == "load", r
    assert MODEL in [m.model for m in client.ps().models]
    return None


finish()
