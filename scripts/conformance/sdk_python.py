"""The official `openai` and `anthropic` Python packages against a live mlxd.

Usage: sdk_python.py BASE_URL. Each check prints `ok` or `FAIL` with the reason; the exit
status is the number of failures (0: all passed). Generations are short (CPU MLX is slow)
and greedy; forced tool choice and JSON schemas are what make the small default model's
output well-formed.
"""
import json
import sys

import anthropic
import jsonschema
import openai
from harness import check, finish

BASE = sys.argv[1]
MODEL = "smollm2-135m"
oa = openai.OpenAI(base_url=f"{BASE}/v1", api_key="unused", max_retries=0)
an = anthropic.Anthropic(base_url=BASE, api_key="unused", max_retries=0)

WEATHER = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "The current weather in a city.",
        "parameters": {
            "type": "object",
            "properties": {"city": {"type": "string", "maxLength": 24}},
            "required": ["city"],
            "additionalProperties": False,
        },
    },
}
PERSON = {
    "type": "object",
    "properties": {
        "name": {"type": "string", "maxLength": 16},
        "age": {"type": "integer", "minimum": 0, "maximum": 120},
        "colour": {"enum": ["red", "green", "blue"]},
    },
    "required": ["name", "age", "colour"],
    "additionalProperties": False,
}

@check("models.list")
def _():
    ids = [m.id for m in oa.models.list()]
    assert MODEL in ids, ids
    return ids


@check("chat.completions")
def _():
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Say hello."}], max_tokens=8, temperature=0
    )
    c = r.choices[0]
    assert c.message.role == "assistant" and c.message.content, c
    assert c.finish_reason in ("stop", "length"), c.finish_reason
    assert r.usage.completion_tokens >= 1, r.usage
    return repr(c.message.content)


@check("chat.completions stream with include_usage, user, service_tier, unknown fields")
def _():
    stream = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Say hello."}],
        max_completion_tokens=8,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
        user="conformance",
        service_tier="auto",
        extra_body={"an_unknown_field": 1},
    )
    text, usage, finish = "", None, None
    for chunk in stream:
        if chunk.usage:
            usage = chunk.usage
        for ch in chunk.choices:
            text += ch.delta.content or ""
            finish = ch.finish_reason or finish
    assert text and finish in ("stop", "length"), (text, finish)
    assert usage and usage.completion_tokens >= 1, usage
    return repr(text)


@check("chat.completions n=2")
def _():
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, n=2, temperature=0.8, seed=1
    )
    assert [c.index for c in r.choices] == [0, 1], r.choices
    return None


@check("completions")
def _():
    r = oa.completions.create(model=MODEL, prompt="The capital of France is", max_tokens=6, temperature=0)
    assert r.choices[0].text, r
    return repr(r.choices[0].text)


@check("completions stream")
def _():
    text = "".join(
        c.choices[0].text
        for c in oa.completions.create(
            model=MODEL, prompt="One, two, three,", max_tokens=6, temperature=0, stream=True
        )
        if c.choices
    )
    assert text, text
    return repr(text)


@check("chat.completions logprobs and top_logprobs, whole and streamed")
def _():
    r = oa.chat.completions.create(
        model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
        logprobs=True, top_logprobs=3,
    )
    content = r.choices[0].logprobs.content
    assert 1 <= len(content) <= r.usage.completion_tokens, content
    for t in content:
        assert t.logprob <= 0 and len(t.top_logprobs) == 3, t
        # Greedy: the chosen token is the likeliest.
        assert t.top_logprobs[0].token == t.token, t
    text = b"".join(bytes(t.bytes) for t in content).decode("utf-8", "replace")
    assert text.strip() == r.choices[0].message.content.strip(), (text, r)
    streamed = [
        t
        for c in oa.chat.completions.create(
            model=MODEL, messages=[{"role": "user", "content": "Hi"}], max_tokens=4, temperature=0,
            logprobs=True, stream=True,
        )
        if c.choices and c.choices[0].logprobs
        for t in c.choices[0].logprobs.content
    ]
    assert [t.token for t in streamed] == [t.token for t in content], (streamed, content)
    return f"{len(content)} tokens, first {content[0].token!r} {content[0].logprob:.3f}"


@check("completions n=2 with logprobs")
def _():
    r = oa.completions.create(
        model=MODEL, prompt="The capital of France is", max_tokens=4, n=2, temperature=0.8, seed=3, logprobs=2
    )
    assert [c.index for c in r.choices] == [0, 1], r.choices
    for c in r.choices:
        lp = c.logprobs
        assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == len(lp.text_offset), lp
        assert all(len(alts) <= 2 for alts in lp.top_logprobs), lp
    return repr([c.text for c in r.choices])


def forced_call(stream):
    messages = [{"role": "user", "content": "What is the weather in Paris?"}]
    args = dict(
        model=MODEL,
        messages=messages,
        tools=[WEATHER],
        tool_choice={"type": "function", "function": {"name": "get_weather"}},
        max_tokens=48,
        temperature=0,
    )
    if not stream:
        r = oa.chat.completions.create(**args)
        msg = r.choices[0].message
        assert r.choices[0].finish_reason == "tool_calls", r.choices[0]
        return messages, msg.tool_calls, msg
    calls = {}
    finish = None
    for chunk in oa.chat.completions.create(**args, stream=True):
        for ch in chunk.choices:
            finish = ch.finish_reason or finish
            for d in ch.delta.tool_calls or []:
                slot = calls.setdefault(d.index, {"id": None, "name": "", "arguments": ""})
                slot["id"] = d.id or slot["id"]
                slot["name"] += d.function.name or ""
                slot["arguments"] += d.function.arguments or ""
    assert finish == "tool_calls", finish
    return messages, calls, None


@check("tool call, forced by name, and the round trip")
def _():
    messages, calls, msg = forced_call(stream=False)
    assert len(calls) == 1 and calls[0].function.name == "get_weather", calls
    args = json.loads(calls[0].function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])
    messages = messages + [
        {"role": "assistant", "content": None, "tool_calls": [c.model_dump() for c in calls]},
        {"role": "tool", "tool_call_id": calls[0].id, "content": json.dumps({"temperature_c": 21})},
    ]
    r = oa.chat.completions.create(model=MODEL, messages=messages, tools=[WEATHER], max_tokens=12, temperature=0)
    assert r.choices[0].message.content is not None or r.choices[0].message.tool_calls, r
    return args


@check("tool call, required, streamed")
def _():
    _, calls, _ = forced_call(stream=True)
    assert len(calls) == 1, calls
    call = calls[0]
    assert call["id"] and call["name"] == "get_weather", call
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["function"]["parameters"])
    return call["arguments"]


@check("response_format json_schema")
def _():
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON, "strict": True}},
        max_tokens=64,
        temperature=0,
    )
    value = json.loads(r.choices[0].message.content)
    jsonschema.validate(value, PERSON)
    return value


@check("response_format json_schema, streamed, sampled")
def _():
    text = ""
    for chunk in oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "A person as JSON."}],
        response_format={"type": "json_schema", "json_schema": {"name": "person", "schema": PERSON}},
        max_tokens=64,
        temperature=1.0,
        seed=3,
        stream=True,
    ):
        for ch in chunk.choices:
            text += ch.delta.content or ""
    jsonschema.validate(json.loads(text), PERSON)
    return text


@check("response_format json_object")
def _():
    r = oa.chat.completions.create(
        model=MODEL,
        messages=[{"role": "user", "content": "Give me a JSON object."}],
        response_format={"type": "json_object"},
        max_tokens=40,
        temperature=0,
    )
    c = r.choices[0]
    if c.finish_reason == "stop":
        assert isinstance(json.loads(c.message.content), dict), c.message.content
    return repr(c.message.content)


def expect(exc_type, f, *, field=None):
    try:
        f()
    except exc_type as e:
        # The SDKs' messages leave out OpenAI's `param`; the body has it.
        message = f"{e} {json.dumps(getattr(e, 'body', None))}"
        if field:
            assert field in message, f"{field!r} not named in {message!r}"
        return f"{exc_type.__name__}: {message[:120]}"
    raise AssertionError(f"no {exc_type.__name__}")


@check("errors: unknown model is NotFoundError")
def _():
    return expect(
        openai.NotFoundError,
        lambda: oa.chat.completions.create(model="no-such-model", messages=[{"role": "user", "content": "x"}]),
    )


@check("errors: bad request is BadRequestError")
def _():
    return expect(
        openai.BadRequestError,
        lambda: oa.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "x"}], max_tokens=0),
        field="max_tokens",
    )


@check("bad input: invalid schema")
def _():
    return expect(
        openai.BadRequestError,
        lambda: oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            response_format={"type": "json_schema", "json_schema": {"name": "s", "schema": {"type": "nonsense"}}},
        ),
        field="response_format.json_schema.schema",
    )


@check("bad input: unknown tool in tool_choice")
def _():
    return expect(
        openai.BadRequestError,
        lambda: oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}],
            tools=[WEATHER],
            tool_choice={"type": "function", "function": {"name": "nope"}},
        ),
        field="tool_choice",
    )


@check("bad input: tool result without a matching call")
def _():
    return expect(
        openai.BadRequestError,
        lambda: oa.chat.completions.create(
            model=MODEL,
            messages=[{"role": "user", "content": "x"}, {"role": "tool", "tool_call_id": "call_x", "content": "1"}],
        ),
        field="tool_call_id",
    )


ANTH_WEATHER = {
    "name": "get_weather",
    "description": "The current weather in a city.",
    "input_schema": WEATHER["function"]["parameters"],
}


@check("anthropic messages")
def _():
    r = an.messages.create(
        model=MODEL,
        max_tokens=8,
        system="Be brief.",
        messages=[{"role": "user", "content": "Say hello."}],
        extra_body={"temperature": 0},
        metadata={"user_id": "conformance"},
    )
    assert r.role == "assistant" and r.content and r.content[0].type == "text", r
    assert r.stop_reason in ("end_turn", "max_tokens"), r.stop_reason
    assert r.usage.output_tokens >= 1, r.usage
    return repr(r.content[0].text)


@check("anthropic messages stream")
def _():
    events = []
    with an.messages.stream(
        model=MODEL, max_tokens=8, messages=[{"role": "user", "content": "Say hello."}], extra_body={"temperature": 0}
    ) as stream:
        for e in stream:
            events.append(e.type)
        final = stream.get_final_message()
    for want in ("message_start", "content_block_start", "content_block_delta", "content_block_stop", "message_delta", "message_stop"):
        assert want in events, (want, events)
    assert final.content and final.content[0].text, final
    return repr(final.content[0].text)


@check("anthropic tool_use round trip, streamed tool call")
def _():
    messages = [{"role": "user", "content": "What is the weather in Oslo?"}]
    with an.messages.stream(
        model=MODEL,
        max_tokens=48,
        messages=messages,
        tools=[ANTH_WEATHER],
        tool_choice={"type": "tool", "name": "get_weather"},
        extra_body={"temperature": 0},
    ) as stream:
        final = stream.get_final_message()
    uses = [b for b in final.content if b.type == "tool_use"]
    assert final.stop_reason == "tool_use" and len(uses) == 1, final
    jsonschema.validate(uses[0].input, ANTH_WEATHER["input_schema"])
    messages += [
        {"role": "assistant", "content": [b.model_dump() for b in final.content]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": uses[0].id, "content": "Sunny, 21 C"}]},
    ]
    r = an.messages.create(model=MODEL, max_tokens=12, messages=messages, tools=[ANTH_WEATHER], extra_body={"temperature": 0})
    assert r.content is not None, r
    n = an.messages.count_tokens(model=MODEL, messages=messages, tools=[ANTH_WEATHER])
    assert n.input_tokens > 10, n
    return uses[0].input


@check("anthropic tool_choice any (non-streaming)")
def _():
    r = an.messages.create(
        model=MODEL,
        max_tokens=48,
        messages=[{"role": "user", "content": "Weather in Rome?"}],
        tools=[ANTH_WEATHER],
        tool_choice={"type": "any"},
        extra_body={"temperature": 0},
    )
    uses = [b for b in r.content if b.type == "tool_use"]
    assert r.stop_reason == "tool_use" and uses, r
    jsonschema.validate(uses[0].input, ANTH_WEATHER["input_schema"])
    return uses[0].input


@check("anthropic structured output (output_config json_schema)")
def _():
    r = an.messages.create(
        model=MODEL,
        max_tokens=64,
        messages=[{"role": "user", "content": "Describe a person as JSON."}],
        output_config={"format": {"type": "json_schema", "schema": PERSON}},
        extra_body={"temperature": 0},
    )
    value = json.loads(r.content[0].text)
    jsonschema.validate(value, PERSON)
    return value


@check("anthropic count_tokens")
def _():
    n = an.messages.count_tokens(model=MODEL, system="Be brief.", messages=[{"role": "user", "content": "Hello"}])
    assert n.input_tokens > 3, n
    return n.input_tokens


@check("anthropic errors: unknown model is NotFoundError")
def _():
    return expect(
        anthropic.NotFoundError,
        lambda: an.messages.create(model="no-such-model", max_tokens=4, messages=[{"role": "user", "content": "x"}]),
    )


@check("anthropic errors: unsupported block type is BadRequestError")
def _():
    return expect(
        anthropic.BadRequestError,
        lambda: an.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png", "data": ""}}]}],
        ),
        field="messages[0].content[0]",
    )


@check("anthropic bad input: tool_result without a matching tool_use")
def _():
    return expect(
        anthropic.BadRequestError,
        lambda: an.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_x", "content": "1"}]}],
        ),
        field="tool_use_id",
    )


@check("anthropic bad input: unknown tool in tool_choice")
def _():
    return expect(
        anthropic.BadRequestError,
        lambda: an.messages.create(
            model=MODEL,
            max_tokens=4,
            messages=[{"role": "user", "content": "x"}],
            tools=[ANTH_WEATHER],
            tool_choice={"type": "tool", "name": "nope"},
        ),
        field="tool_choice",
    )


finish()
