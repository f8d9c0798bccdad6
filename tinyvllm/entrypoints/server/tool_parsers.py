"""Tool-call parsers (vLLM's `--tool-call-parser`): a model's text -> content and tool calls.

A model that was trained to call tools writes its calls as text in a format of its family:

    hermes       Hermes 2 Pro, Qwen2.5, Qwen3:  text <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    llama3_json  Llama 3.1 / 3.2:               {"name": ..., "parameters": {...}}  (the whole output; ";" between calls)

A parser reads that text as it streams and turns it into OpenAI's answer: the text outside the
calls is `content`, each call a `ToolCall` whose `arguments` is a JSON string. Every parser is a
small state machine fed one text delta at a time (`feed`), then told the output ended
(`finish`); the whole output at once is the same two calls (`parse`), so a stream and a plain
response can never disagree. A call is given whole, once its closing tag (or the output's end)
is seen; text that only might be the start of a tag is held back until it is known.

What is not a call stays text: a `<tool_call>` block whose body is not a JSON object with a
string `name` is returned as content, tags and all; so is a block the output opens and never
closes, unless its body is already a whole call (vLLM parses that one too). The request's
finish_reason is then the engine's ("length" for an output cut short), as on vLLM.

vLLM's parsers (`vllm/entrypoints/openai/tool_parsers/hermes_tool_parser.py`,
`llama_tool_parser.py`) also stream a call's arguments as they grow, by parsing partial JSON;
here a call comes in one delta.
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field


def make_tool_call_id() -> str:
    """A call's id, as vLLM makes them: "chatcmpl-tool-" and 32 random hex digits."""
    return f"chatcmpl-tool-{uuid.uuid4().hex}"


@dataclass
class ToolCall:
    """One call the model made: the function's name and its arguments as JSON text."""

    name: str
    arguments: str
    id: str = field(default_factory=make_tool_call_id)

    def to_openai(self, index: int | None = None) -> dict:
        """OpenAI's tool call object; with `index`, as a stream's delta carries it."""
        call = {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}
        return call if index is None else {"index": index, **call}


def call_from_json(obj) -> ToolCall | None:
    """A call from a parsed JSON value, if it is one: an object with a string "name" and its
    arguments under "arguments" (Hermes) or "parameters" (Llama 3), an object or JSON text."""
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str) or not obj["name"]:
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):        # some models write the arguments as a JSON string
        try:
            args = json.loads(args)
        except json.JSONDecodeError:
            return None
    if not isinstance(args, dict):
        return None
    return ToolCall(obj["name"], arguments_json(args))


def arguments_json(args) -> str:
    """Arguments as JSON text (vLLM's `json.dumps(..., ensure_ascii=False)`), but a lone surrogate
    (JSON's "\\ud800" escape parses to one) stays escaped: no UTF-8 encoder takes it."""
    text = json.dumps(args, ensure_ascii=False)
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        text = json.dumps(args)
    return text


def held_back(text: str, tag: str) -> int:
    """How many characters at the end of `text` could be the start of `tag` (so must wait)."""
    for k in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:k]):
            return k
    return 0


class ToolParser:
    """The interface: `feed(delta)` and `finish()` each return (content delta, calls completed)."""

    name = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def finish(self) -> tuple[str, list[ToolCall]]:
        raise NotImplementedError

    def parse(self, text: str) -> tuple[str, list[ToolCall]]:
        """A whole output: its content and its calls."""
        c1, calls1 = self.feed(text)
        c2, calls2 = self.finish()
        return c1 + c2, calls1 + calls2


class HermesToolParser(ToolParser):
    """`<tool_call>{json}</tool_call>` blocks anywhere in the text (Hermes, Qwen2.5, Qwen3).

    Text before the first call is content, streamed as it comes. After a call, text between
    blocks is content only if it is more than whitespace (a model writes a newline between two
    calls), so it is held until the next block or the end decides."""

    name = "hermes"
    OPEN, CLOSE = "<tool_call>", "</tool_call>"

    def __init__(self):
        self._buf = ""            # text not yet decided
        self._in_call = False     # inside <tool_call> ... (the body is in _buf)
        self._called = False      # a call was made: text outside blocks waits in _between
        self._between = ""

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        self._buf += text
        content, calls = [], []
        while True:
            if not self._in_call:
                i = self._buf.find(self.OPEN)
                if i < 0:
                    keep = held_back(self._buf, self.OPEN)
                    content.append(self._text(self._buf[:len(self._buf) - keep]))
                    self._buf = self._buf[len(self._buf) - keep:]
                    break
                content.append(self._text(self._buf[:i]) + self._flush_between())
                self._buf, self._in_call = self._buf[i + len(self.OPEN):], True
            j = self._buf.find(self.CLOSE)
            if j < 0:
                break
            body, self._buf, self._in_call = self._buf[:j], self._buf[j + len(self.CLOSE):], False
            call = _loads_call(body)
            if call is None:      # not a call: the block is text, tags and all
                content.append(self._text(self.OPEN + body + self.CLOSE))
            else:
                calls.append(call)
                self._called = True
        return "".join(content), calls

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        calls = []
        if self._in_call:         # opened, never closed: a call only if its body is whole
            call = _loads_call(rest)
            if call is not None:
                calls.append(call)
                self._called = True
                rest = ""
            else:
                rest = self.OPEN + rest
            self._in_call = False
        content = self._text(rest) + self._flush_between()
        return content, calls

    def _text(self, text: str) -> str:
        """Text outside blocks: content now, or (after a call) kept until it is decided."""
        if not self._called:
            return text
        self._between += text
        return ""

    def _flush_between(self) -> str:
        between, self._between = self._between, ""
        return between if between.strip() else ""


class Llama3JsonToolParser(ToolParser):
    """Llama 3's JSON calls: an output that starts with `{` (or `<|python_tag|>`) is one or more
    JSON objects `{"name": ..., "parameters": {...}}` separated by ";", and nothing else; any
    other output is content. A call's output is held whole until the end, then parsed: if any
    part is not a call, all of it is returned as content."""

    name = "llama3_json"
    PYTHON_TAG = "<|python_tag|>"

    def __init__(self):
        self._buf = ""
        self._mode = "start"      # start -> json (held) | text (streamed)

    def feed(self, text: str) -> tuple[str, list[ToolCall]]:
        if self._mode == "text":
            return text, []
        self._buf += text
        if self._mode == "start":
            head = self._buf.lstrip()
            if head.startswith("{") or head.startswith(self.PYTHON_TAG):
                self._mode = "json"
            elif head and not self.PYTHON_TAG.startswith(head):
                self._mode, out, self._buf = "text", self._buf, ""
                return out, []
        return "", []

    def finish(self) -> tuple[str, list[ToolCall]]:
        rest, self._buf = self._buf, ""
        if self._mode != "json":
            return rest, []
        calls = _loads_calls(rest.strip().removeprefix(self.PYTHON_TAG))
        return ("", calls) if calls else (rest, [])


def _loads_call(body: str) -> ToolCall | None:
    try:
        return call_from_json(json.loads(body))
    except json.JSONDecodeError:
        return None


def _loads_calls(text: str) -> list[ToolCall]:
    """JSON objects separated by ";" and whitespace, each a call; [] if any part is not."""
    decoder, calls, i = json.JSONDecoder(), [], 0
    while True:
        while i < len(text) and (text[i].isspace() or (text[i] == ";" and calls)):
            i += 1
        if i == len(text):
            return calls
        try:
            obj, i = decoder.raw_decode(text, i)
        except json.JSONDecodeError:
            return []
        call = call_from_json(obj)
        if call is None:
            return []
        calls.append(call)


# vLLM's names for them (`--tool-call-parser NAME`)
TOOL_PARSERS: dict[str, type[ToolParser]] = {p.name: p for p in (HermesToolParser, Llama3JsonToolParser)}
