"""The front's output processing: a sequence's text, made of the token ids the engine core sends.

    core: SeqDelta (new token ids, their logprobs, how it ended)  -->  FrontSequence.take
                                                                        text (SequenceText): the
                                                                        detokenizer, stop strings,
                                                                        held-back characters
                                                                   -->  CompletionOutput

The core samples and decides what only sampling can: EOS, stop token ids, max_tokens and the
context length, the grammar's refusal. Everything about text is decided here, as vLLM's
`OutputProcessor` and `IncrementalDetokenizer` do in its front process
(vllm/v1/engine/output_processor.py, vllm/v1/engine/detokenizer.py): the same `SequenceText` a
sequence keeps in one process, so the text, and the tokens a stop string ends at, are the same.

A stop string found here ends the sequence at the token that completed it; the core, which
cannot know, runs on until the client's abort reaches it (`EngineCoreClient._apply`), and what it
sent after that token is dropped here. With `n` > 1 the core stops a request, not one of its
sequences: a sequence a stop string ended runs on in the core until the others end (its tokens
dropped), as phase 8's engine has no abort of one sequence.
"""

from __future__ import annotations

from tinyvllm.outputs import CompletionOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import SequenceText
from tinyvllm.tokenizer import Tokenizer

from . import serial
from .serial import SeqDelta

# How the core ends a sequence with its last token out of the text: EOS or a stop token id
# ("stop"; stop strings are the front's), or a token the grammar refused ("abort")
LAST_TOKEN_OUT_OF_TEXT = ("stop", "abort")


class FrontSequence:
    """One sequence of an open request, as the front holds it: the token ids (and logprobs) the
    core sent, the text made of them, and how it ended."""

    def __init__(self, index: int, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.index, self.params = index, params
        self.text = SequenceText(tokenizer, prompt_token_ids, params)
        self.token_ids: list[int] = []
        self.logprobs: list | None = [] if params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None

    def take(self, delta: SeqDelta) -> None:
        """Add the core's new tokens: their text, a stop string each may complete, how it ended."""
        if self.finish_reason is not None:   # a stop string ended it here: the rest is not its
            return
        rows = serial.logprobs_from_wire(delta.new_logprobs) if delta.new_logprobs is not None else None
        last_out = delta.finish_reason in LAST_TOKEN_OUT_OF_TEXT
        for j, token in enumerate(delta.new_token_ids):
            self.token_ids.append(token)
            if rows is not None and self.logprobs is not None:
                self.logprobs.append(rows[j])
                self.cumulative_logprob += rows[j][token].logprob
            if last_out and j == len(delta.new_token_ids) - 1:
                break
            stop = self.text.add(token, len(self.token_ids) > self.params.min_tokens)
            if stop is not None:
                self.finish_reason, self.stop_reason = "stop", stop
                return
        if delta.finish_reason is not None:
            self.finish_reason, self.stop_reason = delta.finish_reason, delta.stop_reason
            if delta.finish_reason == "length":
                self.text.flush()

    def to_output(self) -> CompletionOutput:
        """What the engine in one process would return for it now (lists copied: a reader may hold
        this output while the next delta comes)."""
        return CompletionOutput(
            self.index, self.text.visible(self.finish_reason is not None), list(self.token_ids),
            self.cumulative_logprob if self.logprobs is not None else None,
            None if self.logprobs is None else list(self.logprobs), self.finish_reason, self.stop_reason)
