"""Reasoning parsers (vLLM's `--reasoning-parser`): a thinking model's text -> its reasoning and
its answer, returned apart as `reasoning_content` and `content`.

Qwen3 thinks first, between `<think>` and `</think>`, then answers:

    <think>\\nThe user greets me; answer briefly.\\n</think>\\n\\nHello!
    |-------------- reasoning_content -------------|       |content|

Its chat template either lets the model write `<think>` itself (Qwen3), opens it at the end of
the prompt (later templates; then the output holds only `</think>`), or, with
`chat_template_kwargs={"enable_thinking": false}`, writes an empty `<think>\\n\\n</think>` into
the prompt, so that the output is all answer. The parser starts in the reasoning when the prompt
ends with an open `<think>`; otherwise an output that begins with `<think>` is reasoning up to
`</think>`, and any other output is all content.

Reasoning never leaks into content: an output cut before `</think>` (max_tokens) is reasoning
to its end (a cut `<th` too), and text that might be the start of `</think>` is held back until it is known. As
the tool parsers (`tool_parsers.py`), the parser is a state machine fed one delta at a time;
the whole output is `parse`, the same two calls, so a stream and a plain response agree.

vLLM's `vllm/reasoning/qwen3_reasoning_parser.py` does this job on token ids as well as text
(Qwen3's think tags are single tokens); the text alone is enough here.
"""

from __future__ import annotations

from tinyvllm.entrypoints.server.tool_parsers import held_back


class Qwen3ReasoningParser:
    """`feed(delta)` and `finish()` each return (reasoning delta, content delta)."""

    name = "qwen3"
    START, END = "<think>", "</think>"

    def __init__(self, prompt: str = ""):
        # start: is the output's first text "<think>"?  reasoning: inside it  after: the blank
        # lines after </think>  content: the answer, streamed as it comes
        self._state = "reasoning" if prompt.rstrip().endswith(self.START) else "start"
        self._buf = ""

    def feed(self, text: str) -> tuple[str, str]:
        self._buf += text
        reasoning = content = ""
        if self._state == "start":
            head = self._buf.lstrip()
            if head.startswith(self.START):
                self._state, self._buf = "reasoning", head[len(self.START):]
            elif head and not self.START.startswith(head):
                self._state = "content"
            else:
                return "", ""     # nothing yet, or a prefix of "<think>": wait
        if self._state == "reasoning":
            i = self._buf.find(self.END)
            if i < 0:
                keep = held_back(self._buf, self.END)
                reasoning, self._buf = self._buf[:len(self._buf) - keep], self._buf[len(self._buf) - keep:]
                return reasoning, ""
            reasoning, self._buf, self._state = self._buf[:i], self._buf[i + len(self.END):], "after"
        if self._state == "after":    # the template writes "\n\n" between reasoning and answer
            self._buf = self._buf.lstrip("\n")
            if not self._buf:
                return reasoning, ""
            self._state = "content"
        content, self._buf = self._buf, ""
        return reasoning, content

    def finish(self) -> tuple[str, str]:
        rest, self._buf = self._buf, ""
        if self._state == "reasoning":
            return rest, ""       # cut inside the thinking: still reasoning
        if self._state == "start" and rest.strip():
            return rest, ""       # cut inside "<think>" itself: the thinking had begun
        return "", rest if self._state in ("start", "content") else ""

    def parse(self, text: str) -> tuple[str, str]:
        """A whole output: (reasoning, content)."""
        r1, c1 = self.feed(text)
        r2, c2 = self.finish()
        return r1 + r2, c1 + c2


# vLLM's names for them (`--reasoning-parser NAME`)
REASONING_PARSERS = {p.name: p for p in (Qwen3ReasoningParser,)}
