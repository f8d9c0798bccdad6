"""What a chat request's `tools` and `tool_choice` change, from the request to the answer.

    tool_choice   what the model writes                      how it becomes tool_calls
    "none"        text (the tools are still in the prompt)    it does not
    "auto"        text, maybe with calls in its family's       the --tool-call-parser reads them
                  format (needs --enable-auto-tool-choice)
    named         the function's arguments: JSON constrained   all of the output is the arguments
                  by the function's parameters schema
    "required"    a JSON array of {"name", "arguments"}:       the array, parsed
                  constrained by a schema built from every
                  tool (the name an enum, the arguments its
                  function's schema)

The forced choices go through the engine's structured outputs (`tinyvllm/structured_output.py`),
so the arguments are valid against the function's schema whatever the weights (a random model's
too), unless max_tokens cuts them short (then finish_reason is "length"). vLLM builds the same
kind of schema for "required" (its array items name the arguments "parameters"; here they are
"arguments", as Hermes-style models and OpenAI's own tool calls name them).

`template_messages` gives the history to the chat template as transformers passes it (an
assistant's tool calls, "tool" results), and `ChoiceParser` turns one choice's text, streamed or
whole, into the answer's fields: `reasoning_content` (with --reasoning-parser), `content` and
`tool_calls`. `check_parsers` checks the server's flags when it starts.
"""

from __future__ import annotations

import copy
import json
from typing import Any

from tinyvllm.entrypoints.server.reasoning_parsers import REASONING_PARSERS
from tinyvllm.entrypoints.server.serving_engine import APIError
from tinyvllm.entrypoints.server.tool_parsers import TOOL_PARSERS, ToolCall, call_from_json

# a function without parameters takes none
NO_PARAMETERS = {"type": "object", "properties": {}, "additionalProperties": False}


def tool_mode(req, enable_auto_tool_choice: bool) -> str:
    """Check a chat request's tools and tool_choice; its mode: "none", "auto", "named" or
    "required". Every refusal is a 400 naming `tools` or `tool_choice`, as vLLM's checks."""
    tools, choice = req.tools, req.tool_choice
    if tools:
        check_tool_schemas(tools)
    if choice is None:                     # OpenAI's default: "auto" with tools, "none" without
        choice = "auto" if tools else "none"
    if choice == "none":
        return "none"
    if not tools:
        raise APIError(400, f"tool_choice: {_choice_text(choice)} needs tools: give `tools`, or leave "
                            f"tool_choice out", param="tool_choice")
    if choice == "auto":
        if not enable_auto_tool_choice:
            raise APIError(400, 'tool_choice: "auto" tool choice requires --enable-auto-tool-choice and '
                                '--tool-call-parser to be set (or name a function, or "required")',
                           param="tool_choice")
        return "auto"
    if choice == "required":
        return "required"
    names = [t.function.name for t in tools]
    if choice.function.name not in names:
        raise APIError(400, f"tool_choice: the function {choice.function.name!r} is not one of the tools "
                            f"({', '.join(map(repr, names))})", param="tool_choice")
    return "named"


def _choice_text(choice) -> str:
    return json.dumps(choice) if isinstance(choice, str) else f"function {choice.function.name!r}"


def check_tool_schemas(tools) -> None:
    """Each function's name given once, and its parameters a JSON schema the grammar engine
    compiles (the same check a forced call's constraint meets); a 400 naming `tools`."""
    from llguidance import LLMatcher

    seen = set()
    for i, tool in enumerate(tools):
        name = tool.function.name
        if name in seen:
            raise APIError(400, f"tools[{i}].function.name: {name!r} is given twice; each function "
                                f"needs a name of its own", param="tools")
        seen.add(name)
        params = tool.function.parameters
        if params is None:
            continue
        try:
            error = LLMatcher.validate_grammar(LLMatcher.grammar_from_json_schema(params), None)
        except Exception as e:  # noqa: BLE001 -- whatever the grammar engine raises, the schema is bad
            error = str(e) or type(e).__name__
        if error:
            raise APIError(400, f"tools[{i}].function.parameters: not a valid JSON schema: "
                                f"{error.splitlines()[0]}", param="tools")


def forced_schema(req, mode: str) -> dict:
    """The JSON schema a forced choice constrains the output to (module docstring)."""
    tools = req.tools
    if mode == "named":
        tool = next(t for t in tools if t.function.name == req.tool_choice.function.name)
        return tool.function.parameters or NO_PARAMETERS
    root: dict[str, Any] = {}
    items = []
    for i, tool in enumerate(tools):
        params = copy.deepcopy(tool.function.parameters or NO_PARAMETERS)
        # a function's "$defs" are referred to from its schema's root ("#/$defs/x"): they move
        # to the root of the array's schema, where the same references find them
        for key in ("$defs", "definitions"):
            for name, definition in (params.pop(key, None) or {}).items():
                if root.setdefault(key, {}).setdefault(name, definition) != definition:
                    raise APIError(400, f"tools[{i}].function.parameters: its {key} entry {name!r} "
                                        f"differs from another tool's of the same name; tool_choice "
                                        f"\"required\" needs them to agree (rename one)", param="tools")
        items.append({"type": "object",
                      "properties": {"name": {"type": "string", "enum": [tool.function.name]},
                                     "arguments": params},
                      "required": ["name", "arguments"], "additionalProperties": False})
    schema = {"type": "array", "items": {"anyOf": items}, "minItems": 1}
    if req.parallel_tool_calls is False:
        schema["maxItems"] = 1
    return {**schema, **root}


def forced_constraint(req, mode: str) -> dict | None:
    """The structured-outputs constraint of a forced choice (None for "none" and "auto"). It
    allows no whitespace between JSON tokens: a call cannot spend its tokens on blank space."""
    if mode not in ("named", "required"):
        return None
    if req.response_format is not None or req.structured_outputs is not None:
        raise APIError(400, "tool_choice: a named or \"required\" tool choice constrains the output "
                            "itself; leave out response_format / structured_outputs", param="tool_choice")
    return {"json": forced_schema(req, mode), "disable_any_whitespace": True}


def check_parsers(enable_auto_tool_choice: bool, tool_call_parser: str | None,
                  reasoning_parser: str | None) -> None:
    """The server's parser flags, as vLLM checks them: a ValueError naming the flag."""
    if tool_call_parser is not None and tool_call_parser not in TOOL_PARSERS:
        raise ValueError(f"--tool-call-parser: {tool_call_parser!r} is not one of {', '.join(TOOL_PARSERS)}")
    if enable_auto_tool_choice and tool_call_parser is None:
        raise ValueError("--enable-auto-tool-choice needs --tool-call-parser (one of "
                         f"{', '.join(TOOL_PARSERS)}): the format the model writes its calls in")
    if reasoning_parser is not None and reasoning_parser not in REASONING_PARSERS:
        raise ValueError(f"--reasoning-parser: {reasoning_parser!r} is not one of {', '.join(REASONING_PARSERS)}")


def template_messages(messages) -> list[dict]:
    """The messages as a chat template reads them, as transformers passes them: an assistant
    message's tool calls with their arguments as objects (OpenAI sends JSON text; templates
    write `arguments | tojson`), its content None when it has none; a tool result as given."""
    out = []
    for m in messages:
        d = m.model_dump(exclude_none=True)
        calls = d.get("tool_calls")
        if isinstance(calls, list):
            d.setdefault("content", None)
            d["tool_calls"] = [_template_call(c) for c in calls]
        out.append(d)
    return out


def _template_call(call):
    fn = call.get("function") if isinstance(call, dict) else None
    if isinstance(fn, dict) and isinstance(fn.get("arguments"), str):
        try:
            args = json.loads(fn["arguments"])
        except json.JSONDecodeError:
            return call
        if isinstance(args, dict):
            return {**call, "function": {**fn, "arguments": args}}
    return call


class ChoiceParser:
    """One choice's output -> the answer's fields, a delta at a time (`feed`, then `finish`).

    The text goes through the reasoning parser (if any: its reasoning is `reasoning_content`,
    the rest goes on), then by the mode: "auto" through the tool parser; "named": all of it is
    the arguments of one call, streamed as they come (the first delta names the call); "required":
    the array, parsed at the end. A forced choice's output is JSON from its first token (the
    constraint leaves no room to think), so it skips the reasoning parser. A "required" output
    that is not whole JSON (cut by max_tokens) is returned as content; a named call keeps the
    arguments that came, and finish_reason "length" says they were cut."""

    def __init__(self, mode: str, tool_parser: str | None, reasoning_parser: str | None,
                 prompt: str, function_name: str | None = None):
        self.mode = mode
        self.reasoning = (REASONING_PARSERS[reasoning_parser](prompt)
                          if reasoning_parser and mode not in ("named", "required") else None)
        self.tools = TOOL_PARSERS[tool_parser]() if mode == "auto" else None
        self.function_name = function_name
        self.calls: list[ToolCall] = []      # every call so far
        self._text = ""                       # a forced output so far

    @property
    def active(self) -> bool:
        """Does this choice's text need parsing at all (else it is content as it comes)?"""
        return self.mode != "none" or self.reasoning is not None

    def feed(self, text: str) -> dict:
        """A delta of text -> the delta's fields: reasoning_content, content, tool_calls."""
        return self._step(text, final=False)

    def finish(self) -> dict:
        """The output ended: what was held back."""
        return self._step("", final=True)

    def _step(self, text: str, final: bool) -> dict:
        reasoning = ""
        if self.reasoning is not None:
            reasoning, text = self.reasoning.feed(text)
            if final:
                r, c = self.reasoning.finish()
                reasoning, text = reasoning + r, text + c
        content, call_deltas = text, []
        if self.mode == "named":
            content, call_deltas = "", self._named(text, final)
        else:
            new_calls = []
            if self.mode == "auto":
                content, new_calls = self.tools.feed(text)
                if final:
                    c, calls = self.tools.finish()
                    content, new_calls = content + c, new_calls + calls
            elif self.mode == "required":
                self._text += text
                content = ""
                if final:
                    new_calls = _required_calls(self._text)
                    content = "" if new_calls else self._text
            call_deltas = [c.to_openai(len(self.calls) + k) for k, c in enumerate(new_calls)]
            self.calls.extend(new_calls)
        delta: dict[str, Any] = {}
        if reasoning:
            delta["reasoning_content"] = reasoning
        if content:
            delta["content"] = content
        if call_deltas:
            delta["tool_calls"] = call_deltas
        return delta

    def _named(self, text: str, final: bool) -> list[dict]:
        """The one call: its first delta names it, the later ones add to its arguments."""
        if not self.calls:
            if not text and not final:
                return []
            self.calls.append(ToolCall(self.function_name, text))
            return [self.calls[0].to_openai(0)]
        self.calls[0].arguments += text
        return [{"index": 0, "function": {"arguments": text}}] if text else []

    def message(self, text: str) -> dict:
        """A whole output as OpenAI's message: `feed` of all of it, then `finish`."""
        first, last = self.feed(text), self.finish()
        calls = [c.to_openai() for c in self.calls]
        content = first.get("content", "") + last.get("content", "") or None
        reasoning = first.get("reasoning_content", "") + last.get("reasoning_content", "") or None
        if not calls and content is None:
            content = ""
        msg = {"role": "assistant", "content": content}
        if self.reasoning is not None:
            msg["reasoning_content"] = reasoning
        if calls:
            msg["tool_calls"] = calls
        return msg

    def finish_reason(self, engine_reason: str | None) -> str | None:
        """"tool_calls" when the output called a tool and ended by itself; else the engine's."""
        return "tool_calls" if self.calls and engine_reason == "stop" else engine_reason


def _required_calls(text: str) -> list[ToolCall]:
    try:
        value = json.loads(text)
    except json.JSONDecodeError:
        return []
    calls = [call_from_json(v) for v in value] if isinstance(value, list) else []
    return calls if calls and all(c is not None for c in calls) else []
