"""Tool calls and reasoning on the server (`tools`, `tool_choice`, `tool_calls`,
`reasoning_content`), as vLLM's server answers them.

The parsers are tested on text: the Hermes and Llama 3 tool-call formats, Qwen3's think blocks,
each fed whole and in random pieces (a stream and a plain answer must agree). The forced choices
(a named function, "required") are tested on the engine: random small tool schemas, the output
constrained by the schema the server builds, every call's arguments valid against its function's
schema. Then a real `tinyvllm serve` with vLLM's flags, driven by the official `openai` client:
the tiny random model is made to call a tool (forced, or through structured outputs for the
parsers), the client reads `tool_calls`, sends the result back as a "tool" message, and gets an
answer.
"""

from __future__ import annotations

import json
import os
import random
import subprocess
from pathlib import Path

import httpx
import pytest

from tinyvllm import SamplingParams
from tinyvllm.entrypoints.server.chat_tools import ChoiceParser, forced_constraint, forced_schema, tool_mode
from tinyvllm.entrypoints.server.protocol import ChatCompletionRequest
from tinyvllm.entrypoints.server.reasoning_parsers import Qwen3ReasoningParser
from tinyvllm.entrypoints.server.serving_engine import APIError
from tinyvllm.entrypoints.server.tool_parsers import HermesToolParser, Llama3JsonToolParser

openai = pytest.importorskip("openai")
jsonschema = pytest.importorskip("jsonschema")

ROOT = Path(__file__).resolve().parents[1]
WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 6},
                                                    "unit": {"enum": ["C", "F"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "parameters": {"type": "object", "properties": {"hour": {
        "type": "integer", "minimum": 0, "maximum": 23}}, "required": ["hour"], "additionalProperties": False}}}


def _pieces(text: str, rng: random.Random) -> list[str]:
    cuts = sorted(rng.sample(range(1, len(text)), min(len(text) - 1, rng.randint(0, 12)))) if len(text) > 1 else []
    return [text[a:b] for a, b in zip([0, *cuts], [*cuts, len(text)])]


def _streamed(parser, text: str, rng: random.Random):
    """Feed `text` in random pieces; the parts joined (text fields) and listed (calls)."""
    outs = [parser.feed(p) for p in _pieces(text, rng)] + [parser.finish()]
    second = ([c for o in outs for c in o[1]] if isinstance(outs[-1][1], list)
              else "".join(o[1] for o in outs))
    return "".join(o[0] for o in outs), second


def _calls(calls) -> list[tuple[str, dict]]:
    return [(c.name, json.loads(c.arguments)) for c in calls]


# -- the parsers, on text ------------------------------------------------------------------------
HERMES = [
    # (model output, content, calls)
    ('Let me look.\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>',
     "Let me look.\n", [("get_weather", {"city": "Paris"})]),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call>\n<tool_call>{"name": "b", "arguments": '
     '{"x": [1, 2]}}</tool_call>\n', "", [("a", {}), ("b", {"x": [1, 2]})]),
    ("no call at all, a < sign and <tool", "no call at all, a < sign and <tool", []),
    # never closed: a whole call is still a call (vLLM's rule); a cut one is content, tags and all
    ('<tool_call>{"name": "a", "arguments": {"k": 1}}', "", [("a", {"k": 1})]),
    ('x <tool_call>{"name": "a", "argum', 'x <tool_call>{"name": "a", "argum', []),
    # a block that is not a call is content
    ("<tool_call>not json</tool_call> after", "<tool_call>not json</tool_call> after", []),
    ('<tool_call>{"name": "a", "arguments": {}}</tool_call> and more text',
     " and more text", [("a", {})]),
]


@pytest.mark.parametrize("text,content,calls", HERMES)
def test_hermes_parser_whole_and_in_pieces(text, content, calls):
    got_content, got_calls = HermesToolParser().parse(text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    rng = random.Random(0)
    for _ in range(20):
        c, cs = _streamed(HermesToolParser(), text, rng)
        assert (c, _calls(cs)) == (content, calls)
    assert all(c.id.startswith("chatcmpl-tool-") for c in got_calls)


def test_arguments_with_a_lone_surrogate_stay_escaped():
    """JSON may escape half a surrogate pair; the answer's JSON must still encode as UTF-8."""
    (call,) = HermesToolParser().parse('<tool_call>{"name": "a", "arguments": {"s": "\\ud800 \\u00e9"}}</tool_call>')[1]
    call.arguments.encode("utf-8")
    assert json.loads(call.arguments) == {"s": "\ud800 \u00e9"}


LLAMA3 = [
    ('{"name": "get_weather", "parameters": {"city": "Paris"}}', "", [("get_weather", {"city": "Paris"})]),
    ('<|python_tag|>{"name": "a", "arguments": {}}; {"name": "b", "parameters": {"y": 2}}', "",
     [("a", {}), ("b", {"y": 2})]),
    ("Hello! {not a call}", "Hello! {not a call}", []),
    ('{"name": "a", "parameters": {"k": ', '{"name": "a", "parameters": {"k": ', []),   # cut: content
    ('{"city": "Paris"}', '{"city": "Paris"}', []),                                    # no name: content
]


@pytest.mark.parametrize("text,content,calls", LLAMA3)
def test_llama3_json_parser_whole_and_in_pieces(text, content, calls):
    got_content, got_calls = Llama3JsonToolParser().parse(text)
    assert (got_content, _calls(got_calls)) == (content, calls)
    rng = random.Random(1)
    for _ in range(20):
        c, cs = _streamed(Llama3JsonToolParser(), text, rng)
        assert (c, _calls(cs)) == (content, calls)


QWEN3 = [
    # (prompt's end, model output, reasoning, content)
    ("<|im_start|>assistant\n", "<think>\nGreet back.\n</think>\n\nHello!", "\nGreet back.\n", "Hello!"),
    ("<|im_start|>assistant\n<think>\n", "Greet back.</think>Hello!", "Greet back.", "Hello!"),
    ("<|im_start|>assistant\n<think>\n\n</think>\n\n", "Hello!", "", "Hello!"),   # enable_thinking false
    ("<|im_start|>assistant\n", "Hello!", "", "Hello!"),
    ("<|im_start|>assistant\n", "<think>cut short by max_tok", "cut short by max_tok", ""),   # never content
    ("<|im_start|>assistant\n", "<think>a</thi", "a</thi", ""),
    ("<|im_start|>assistant\n", "<thi", "<thi", ""),                        # cut inside the tag
]


@pytest.mark.parametrize("prompt,text,reasoning,content", QWEN3)
def test_qwen3_reasoning_parser_whole_and_in_pieces(prompt, text, reasoning, content):
    assert Qwen3ReasoningParser(prompt).parse(text) == (reasoning, content)
    rng = random.Random(2)
    for _ in range(20):
        assert _streamed(Qwen3ReasoningParser(prompt), text, rng) == (reasoning, content)


def test_reasoning_then_a_tool_call_in_pieces():
    """With both parsers, the reasoning goes first, and the tool parser sees only the answer."""
    text = '<think>I need the weather.</think>\n\n<tool_call>{"name": "get_weather", "arguments": {"city": "Oslo"}}</tool_call>'
    whole = ChoiceParser("auto", "hermes", "qwen3", "<|im_start|>assistant\n").message(text)
    assert whole["reasoning_content"] == "I need the weather." and whole["content"] is None
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in whole["tool_calls"]] == [
        ("get_weather", '{"city": "Oslo"}')]
    rng = random.Random(3)
    for _ in range(20):
        parser = ChoiceParser("auto", "hermes", "qwen3", "<|im_start|>assistant\n")
        deltas = [parser.feed(p) for p in _pieces(text, rng)] + [parser.finish()]
        assert "".join(d.get("reasoning_content", "") for d in deltas) == "I need the weather."
        assert "".join(d.get("content", "") for d in deltas) == ""
        calls = [c for d in deltas for c in d.get("tool_calls", [])]
        assert [(c["index"], c["function"]["name"]) for c in calls] == [(0, "get_weather")]
        assert parser.finish_reason("stop") == "tool_calls" and parser.finish_reason("length") == "length"


# -- the request's checks -------------------------------------------------------------------------
def _req(**body) -> ChatCompletionRequest:
    return ChatCompletionRequest(messages=[{"role": "user", "content": "hi"}], **body)


@pytest.mark.parametrize("body,param,words", [
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "no-such-type"}}}],
      "tool_choice": "required"}, "tools", "tools[0].function.parameters: not a valid JSON schema"),
    ({"tools": [WEATHER, {"type": "function", "function": {"name": "g", "parameters": {
        "type": "object", "properties": {"a": 5}}}}], "tool_choice": "none"}, "tools", "tools[1]"),
    ({"tools": [WEATHER, WEATHER], "tool_choice": "required"}, "tools", "given twice"),
    ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice", "'nope' is not one of the tools"),
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tool_choice": {"type": "function", "function": {"name": "f"}}}, "tool_choice", "needs tools"),
    ({"tools": [WEATHER]}, "tool_choice", "--enable-auto-tool-choice"),        # "auto" by default
])
def test_bad_tools_are_refused_naming_the_field(body, param, words):
    with pytest.raises(APIError) as e:
        tool_mode(_req(**body), enable_auto_tool_choice=False)
    assert e.value.status == 400 and e.value.param == param and words in e.value.message, e.value.message


def test_the_required_schema_lifts_each_tools_defs_to_its_root():
    with_defs = {"type": "function", "function": {"name": "h", "parameters": {
        "type": "object", "properties": {"p": {"$ref": "#/$defs/point"}}, "required": ["p"],
        "$defs": {"point": {"type": "array", "items": {"type": "integer"}, "maxItems": 2}}}}}
    req = _req(tools=[TIME, with_defs], tool_choice="required", parallel_tool_calls=False)
    schema = forced_schema(req, tool_mode(req, False))
    assert schema["$defs"] == with_defs["function"]["parameters"]["$defs"] and schema["maxItems"] == 1
    jsonschema.validate([{"name": "h", "arguments": {"p": [1, 2]}}], schema)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate([{"name": "h", "arguments": {"p": ["x"]}}], schema)
    clash = json.loads(json.dumps(with_defs).replace('"h"', '"h2"').replace('"integer"', '"string"'))
    req = _req(tools=[with_defs, clash], tool_choice="required")
    with pytest.raises(APIError, match="differs from another tool's"):
        forced_schema(req, tool_mode(req, False))


def test_the_flags_are_checked_before_the_engine_is_built(tiny_model_dir, capsys):
    from tinyvllm.entrypoints.cli import main
    assert main(["serve", str(tiny_model_dir), "--enable-auto-tool-choice"]) == 2
    assert "--enable-auto-tool-choice needs --tool-call-parser" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        main(["serve", str(tiny_model_dir), "--tool-call-parser", "nope"])
    err = capsys.readouterr().err
    assert "--tool-call-parser" in err and "hermes" in err and "llama3_json" in err


# -- forced choices on the engine: a property test over random small tool schemas ---------------
def _random_property(rng: random.Random, depth: int = 0) -> dict:
    kind = rng.choice(["string", "integer", "number", "boolean", "enum", "array", "object"][:7 - 2 * (depth > 0)])
    if kind == "string":
        return {"type": "string", "maxLength": rng.randint(1, 6)}
    if kind == "integer":
        lo = rng.randint(-50, 50)
        return {"type": "integer", "minimum": lo, "maximum": lo + rng.randint(0, 100)}
    if kind == "number":
        return {"type": "number", "minimum": 0, "maximum": 10}
    if kind == "enum":
        return {"enum": rng.sample(["red", "green", "blue", 1, 2, True, None], rng.randint(1, 3))}
    if kind == "array":
        return {"type": "array", "items": _random_property(rng, depth + 1), "maxItems": rng.randint(0, 3)}
    if kind == "object":
        return _random_object(rng, depth + 1)
    return {"type": "boolean"}


def _random_object(rng: random.Random, depth: int = 0) -> dict:
    names = rng.sample(["city", "unit", "n", "flag", "tags", "where", "x_1"], rng.randint(0, 3))
    return {"type": "object", "properties": {n: _random_property(rng, depth) for n in names},
            "required": [n for n in names if rng.random() < 0.7], "additionalProperties": False}


def test_forced_tool_calls_are_always_valid_against_their_schemas(tiny_model_dir, make_llm):
    """24 random tool sets, each forced as a named call and as "required", sampled at a
    temperature: every call names one of the tools, and its arguments fit that tool's schema.
    (A random model would list calls until max_tokens: "required" asks for one at a time,
    parallel_tool_calls false, as an agent that runs one tool a turn does.)"""
    rng = random.Random(1234)
    llm = make_llm(tiny_model_dir, 3)
    requests = []
    for i in range(24):
        tools = [{"type": "function", "function": {"name": f"tool_{i}_{k}", "parameters": _random_object(rng)}}
                 for k in range(rng.randint(1, 3))]
        named = {"type": "function", "function": {"name": rng.choice(tools)["function"]["name"]}}
        for choice in (named, "required"):
            req = _req(tools=tools, tool_choice=choice, parallel_tool_calls=False)
            requests.append((req, tool_mode(req, False)))
    params = [SamplingParams(temperature=1.0, seed=i, max_tokens=200,
                             structured_outputs=forced_constraint(req, mode)) for i, (req, mode) in enumerate(requests)]
    outs = llm.generate(["call a tool"] * len(requests), params, use_tqdm=False)
    for (req, mode), out in zip(requests, outs):
        c = out.outputs[0]
        parser = ChoiceParser(mode, None, None, "", req.tool_choice.function.name if mode == "named" else None)
        message = parser.message(c.text)
        assert parser.finish_reason(c.finish_reason) == "tool_calls", (c.finish_reason, c.text)
        schemas = {t.function.name: t.function.parameters for t in req.tools}
        assert message["tool_calls"] and message["content"] is None, message
        for call in message["tool_calls"]:
            jsonschema.validate(json.loads(call["function"]["arguments"]), schemas[call["function"]["name"]])
        assert len(message["tool_calls"]) == 1
        if mode == "named":
            assert message["tool_calls"][0]["function"]["name"] == req.tool_choice.function.name


# -- end to end: tinyvllm serve with vLLM's flags, the openai client ------------------------------
@pytest.fixture(scope="module")
def tools_model_dir(tmp_path_factory) -> Path:
    from tinyvllm.testing import TOOLS_CHAT_TEMPLATE, make_tiny_llama, use_chat_template
    # room for a chat with tools in a byte-level tokenizer
    folder = make_tiny_llama(tmp_path_factory.mktemp("tiny-tools"), max_position_embeddings=2048)
    return use_chat_template(folder, TOOLS_CHAT_TEMPLATE)


@pytest.fixture(scope="module")
def server(tools_model_dir):
    from tinyvllm.entrypoints.bench.serve import start_builtin_server
    proc, url = start_builtin_server(
        [str(tools_model_dir), "--log-level", "warning", "--served-model-name", "tiny", "--max-num-seqs", "8",
         "--enable-auto-tool-choice", "--tool-call-parser", "hermes", "--reasoning-parser", "qwen3"],
        timeout=120, cwd=ROOT, env={**os.environ, "PYTHONPATH": str(ROOT)},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    yield url
    proc.terminate()
    proc.wait(30)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server + "/v1", api_key="none")


USER = [{"role": "user", "content": "What is the weather in Paris?"}]


def _stream(client, **kw):
    chunks = list(client.chat.completions.create(stream=True, **kw))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    return deltas, finish


def _joined_calls(deltas) -> list[dict]:
    """A stream's tool call deltas put together, by index, as the openai client's users do."""
    calls: dict[int, dict] = {}
    for d in deltas:
        for tc in d.tool_calls or []:
            call = calls.setdefault(tc.index, {"id": None, "name": None, "arguments": ""})
            call["id"] = tc.id or call["id"]
            call["name"] = (tc.function.name if tc.function and tc.function.name else call["name"])
            call["arguments"] += (tc.function.arguments or "") if tc.function else ""
    return [calls[i] for i in sorted(calls)]


@pytest.mark.server
def test_the_openai_tool_calling_flow_end_to_end(server, client):
    """A named tool choice: the client reads the call, runs the tool, sends its result back as a
    "tool" message with the assistant's call before it, and gets an answer."""
    kw = {"model": "tiny", "messages": USER, "tools": [WEATHER, TIME], "max_tokens": 60, "temperature": 0,
          "tool_choice": {"type": "function", "function": {"name": "get_weather"}}}
    first = client.chat.completions.create(**kw)
    choice = first.choices[0]
    # the prompt is the chat template's, given the tools (vLLM's /tokenize takes them too)
    tokens = httpx.post(server + "/tokenize", json={"messages": USER, "tools": [WEATHER, TIME]},
                        timeout=60).json()["tokens"]
    assert len(tokens) == first.usage.prompt_tokens
    assert choice.finish_reason == "tool_calls" and choice.message.content is None, choice
    (call,) = choice.message.tool_calls
    assert call.type == "function" and call.id.startswith("chatcmpl-tool-") and call.function.name == "get_weather"
    args = json.loads(call.function.arguments)
    jsonschema.validate(args, WEATHER["function"]["parameters"])

    # streamed: the call's id and name first, its arguments as they come, the same as unstreamed
    deltas, finish = _stream(client, **kw)
    (streamed,) = _joined_calls(deltas)
    assert streamed["name"] == "get_weather" and streamed["arguments"] == call.function.arguments
    assert streamed["id"].startswith("chatcmpl-tool-") and finish == ["tool_calls"]
    assert next(d for d in deltas if d.tool_calls).tool_calls[0].function.name == "get_weather"

    history = [*USER, choice.message.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temp_c": 21})}]
    answer = client.chat.completions.create(model="tiny", messages=history, tools=[WEATHER, TIME],
                                            tool_choice="none", max_tokens=8, temperature=0)
    assert isinstance(answer.choices[0].message.content, str) and not answer.choices[0].message.tool_calls
    assert answer.choices[0].finish_reason in ("stop", "length")
    # the template saw the call and the result: the prompt grew by both
    assert answer.usage.prompt_tokens > first.usage.prompt_tokens + 20


@pytest.mark.server
def test_required_calls_streamed_and_not(client):
    kw = {"model": "tiny", "messages": USER, "tools": [WEATHER, TIME], "tool_choice": "required",
          "max_tokens": 120, "temperature": 0}
    msg = client.chat.completions.create(**kw).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.tool_calls
    schemas = {t["function"]["name"]: t["function"]["parameters"] for t in (WEATHER, TIME)}
    for call in msg.message.tool_calls:
        jsonschema.validate(json.loads(call.function.arguments), schemas[call.function.name])
    deltas, finish = _stream(client, **kw)
    assert [(c["name"], c["arguments"]) for c in _joined_calls(deltas)] == [
        (c.function.name, c.function.arguments) for c in msg.message.tool_calls]
    assert finish == ["tool_calls"]


HERMES_OUTPUT = r'Checking\. <tool_call>\{"name": "get_weather", "arguments": \{"city": "[a-z]{1,5}", "unit": "C"\}\}</tool_call>'


@pytest.mark.server
def test_auto_tool_choice_parses_the_models_hermes_calls(client):
    """tool_choice "auto" (the default with tools): the hermes parser finds the call in what the
    model wrote (made to write one with structured outputs), streamed or not."""
    kw = {"model": "tiny", "messages": USER, "tools": [WEATHER], "max_tokens": 200, "temperature": 0,
          "extra_body": {"structured_outputs": {"regex": HERMES_OUTPUT}}}
    msg = client.chat.completions.create(**kw).choices[0]
    assert msg.finish_reason == "tool_calls" and msg.message.content == "Checking. "
    (call,) = msg.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments)["unit"] == "C"
    deltas, finish = _stream(client, **kw)
    assert "".join(d.content or "" for d in deltas) == "Checking. " and finish == ["tool_calls"]
    assert [(c["name"], c["arguments"]) for c in _joined_calls(deltas)] == [("get_weather", call.function.arguments)]

    # a call opened and never closed: the text is content, finish_reason the engine's
    cut = {**kw, "extra_body": {"structured_outputs": {"regex": r'<tool_call>\{"name": "get_w'}}}
    msg = client.chat.completions.create(**cut).choices[0]
    assert (msg.message.content, msg.message.tool_calls, msg.finish_reason) == ('<tool_call>{"name": "get_w', None, "stop")
    deltas, finish = _stream(client, **cut)
    assert "".join(d.content or "" for d in deltas) == '<tool_call>{"name": "get_w' and finish == ["stop"]


@pytest.mark.server
def test_reasoning_content_is_split_out_and_never_leaks(client):
    kw = {"model": "tiny", "messages": USER, "max_tokens": 60, "temperature": 0,
          "extra_body": {"structured_outputs": {"regex": r"<think>\n[a-z ]{1,12}\n</think>\n\n[a-z]{1,6}"}}}
    msg = client.chat.completions.create(**kw).choices[0].message
    reasoning = msg.model_extra["reasoning_content"]
    assert reasoning.startswith("\n") and reasoning.strip() and "think>" not in msg.content
    assert msg.content.isalpha() and reasoning.strip() not in msg.content
    deltas, _ = _stream(client, **kw)
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == reasoning
    assert "".join(d.content or "" for d in deltas) == msg.content
    # cut inside the thinking: all of it is reasoning
    for max_tokens in (3, 12):
        cut = client.chat.completions.create(**{**kw, "max_tokens": max_tokens}).choices[0]
        assert cut.finish_reason == "length" and not cut.message.content, cut
        assert cut.message.model_extra["reasoning_content"]


@pytest.mark.server
def test_bad_tools_get_a_400_naming_the_field_and_the_server_goes_on(server):
    for body, param in [
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nope"}}}]}, "tools"),
            ({"tools": [{"type": "function", "function": {"name": "f", "parameters": "not a dict"}}]}, "tools"),
            ({"tools": [WEATHER], "tool_choice": {"type": "function", "function": {"name": "g"}}}, "tool_choice"),
            ({"tool_choice": "required"}, "tool_choice"),
            ({"tools": [WEATHER], "tool_choice": "sometimes"}, "tool_choice"),
            ({"tools": [WEATHER], "tool_choice": "required", "response_format": {"type": "json_object"}},
             "tool_choice")]:
        r = httpx.post(server + "/v1/chat/completions", json={"messages": USER, "max_tokens": 4, **body}, timeout=60)
        assert r.status_code == 400 and r.json()["error"]["param"] == param, (body, r.text)
    ok = httpx.post(server + "/v1/chat/completions", json={"messages": USER, "max_tokens": 2}, timeout=60)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] is not None
