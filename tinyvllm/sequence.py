"""One request's state as it is generated: `Sequence` (one completion stream) and
`SequenceGroup` (the request: its prompt and its `n` sequences).

This is the bookkeeping every phase shares: appending a sampled token, streaming its text, and
deciding when to stop (EOS, stop token ids, stop strings, max_tokens, the context length).
Phases differ only in *how* they compute the next token's logits.
"""

from __future__ import annotations

import itertools
import time
from enum import IntEnum

import torch

from tinyvllm.outputs import CompletionOutput, Logprob, RequestMetrics, RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import IncrementalDetokenizer, Tokenizer

_seq_ids = itertools.count()


class SequenceStatus(IntEnum):
    """Where a sequence is in its life, for a scheduler with waiting and running queues. An
    IntEnum: hot checks are integer compares."""

    WAITING = 0
    RUNNING = 1
    PREEMPTED = 2
    FINISHED_STOPPED = 3
    FINISHED_LENGTH = 4
    FINISHED_ABORTED = 5

    @staticmethod
    def finished(reason: str) -> "SequenceStatus":
        return {"stop": SequenceStatus.FINISHED_STOPPED, "length": SequenceStatus.FINISHED_LENGTH,
                "abort": SequenceStatus.FINISHED_ABORTED}[reason]


class SequenceText:
    """A sequence's text as its tokens come: incremental detokenization, the stop strings, and the
    characters held back while they may be the start of one. Each `Sequence` keeps one where its
    engine makes the text; phase 9's front process keeps one per sequence, its engine core sending
    token ids only."""

    def __init__(self, tokenizer: Tokenizer, prompt_token_ids: list[int], params: SamplingParams):
        self.params = params
        self.detokenizer = IncrementalDetokenizer(tokenizer, prompt_token_ids, params.skip_special_tokens)
        self.text = ""
        # The longest stop string, less one char, is held back from streamed text: it may be the
        # start of a stop string that the next token completes.
        self.holdback = max((len(s) for s in params.stop_strings), default=1) - 1

    def add(self, token_id: int, may_stop: bool) -> str | None:
        """Append a token's text; the stop string it completed (the text cut there), or None."""
        delta = self.detokenizer.add_token(token_id)
        self.text += delta
        if not (may_stop and delta and self.params.stop_strings):
            return None
        # Only a match that overlaps the new text can be new.
        start = max(0, len(self.text) - len(delta) - self.holdback)
        best = None
        for s in self.params.stop_strings:
            i = self.text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = self.text[: i + len(s) if self.params.include_stop_str_in_output else i]
        return s

    def flush(self) -> None:
        """Nothing more will come: show any incomplete character."""
        self.text += self.detokenizer.flush()

    def visible(self, finished: bool) -> str:
        if finished or self.holdback == 0:
            return self.text
        return self.text[: max(0, len(self.text) - self.holdback)]


class Sequence:
    """One stream of generated tokens for one prompt."""

    def __init__(self, group: "SequenceGroup", index: int, generator: torch.Generator | None,
                 tokenizer: Tokenizer | None, eos_token_ids: frozenset[int], max_model_len: int):
        self.seq_id = next(_seq_ids)
        self.group = group
        self.index = index
        self.params: SamplingParams = group.params
        self.prompt_token_ids: list[int] = group.prompt_token_ids
        self.token_ids: list[int] = list(group.prompt_token_ids)  # prompt + output, grows
        self.num_prompt_tokens = len(group.prompt_token_ids)
        self.generator = generator  # None for greedy
        self.eos_token_ids = frozenset() if self.params.ignore_eos else eos_token_ids
        self.max_model_len = max_model_len
        # its text, where this process makes it (None: tokenizer None, token ids only)
        self.text_state = (SequenceText(tokenizer, group.prompt_token_ids, self.params)
                           if tokenizer is not None else None)
        self.logprobs: list[dict[int, Logprob]] | None = [] if self.params.logprobs is not None else None
        self.cumulative_logprob = 0.0
        self.finish_reason: str | None = None
        self.stop_reason: int | str | None = None
        # KV-cache bookkeeping, used from phase 2 on: how many of token_ids have their K/V in the
        # cache, and which cache blocks hold them.
        self.num_computed_tokens = 0
        self.block_table = None
        # where it is in its life (SequenceStatus), kept by a scheduler with waiting and running
        # queues; None where the scheduler keeps no track of it
        self.status: SequenceStatus | None = None
        # with params.structured_outputs: the grammar's parser state (a GrammarMatcher, set by
        # the engine): which tokens may come next
        self.grammar = None

    # -- sizes ---------------------------------------------------------------------------------
    @property
    def num_tokens(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens:]

    @property
    def is_finished(self) -> bool:
        return self.finish_reason is not None

    @property
    def min_tokens_pending(self) -> bool:
        """True while EOS and stop tokens must not be sampled yet (min_tokens)."""
        return self.num_output_tokens < self.params.min_tokens

    # -- one new token -------------------------------------------------------------------------
    def append_token(self, token_id: int, logprobs: dict[int, Logprob] | None = None) -> None:
        """Record a sampled token, stream its text, and check every stop condition."""
        self.token_ids.append(token_id)
        if logprobs is not None and self.logprobs is not None:
            self.logprobs.append(logprobs)
            self.cumulative_logprob += logprobs[token_id].logprob
        if self.grammar is not None and not self.grammar.accept(token_id):
            # the grammar could not take it (a limit, or a token it refuses): the sequence ends
            # with the error, the token out of its text; it never goes on unconstrained
            self._finish("abort", self.grammar.error)
            return
        params = self.params
        may_stop = self.num_output_tokens > params.min_tokens
        if may_stop and token_id in self.eos_token_ids:
            self._finish("stop")
        elif may_stop and params.is_stop_token(token_id):
            self._finish("stop", token_id)
        if not self.is_finished and self.text_state is not None:  # EOS and stop token ids stay out of the text
            stop = self.text_state.add(token_id, may_stop)
            if stop is not None:
                self._finish("stop", stop)
        if not self.is_finished:
            if params.max_tokens is not None and self.num_output_tokens >= params.max_tokens:
                self._finish("length")
            elif self.num_tokens >= self.max_model_len:
                self._finish("length")

    def _finish(self, reason: str, stop_reason: int | str | None = None) -> None:
        self.finish_reason, self.stop_reason = reason, stop_reason
        if reason == "length" and self.text_state is not None:  # nothing more will come
            self.text_state.flush()

    def abort(self) -> None:
        if not self.is_finished:
            self.finish_reason = "abort"

    @property
    def text(self) -> str:
        return self.text_state.text if self.text_state is not None else ""

    def visible_text(self) -> str:
        return self.text_state.visible(self.is_finished) if self.text_state is not None else ""

    def to_output(self) -> CompletionOutput:
        return CompletionOutput(
            index=self.index, text=self.visible_text(), token_ids=self.output_token_ids,
            cumulative_logprob=self.cumulative_logprob if self.logprobs is not None else None,
            logprobs=self.logprobs, finish_reason=self.finish_reason, stop_reason=self.stop_reason)


class SequenceGroup:
    """One request: a prompt, its sampling params, and `params.n` sequences."""

    def __init__(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                 params: SamplingParams, tokenizer: Tokenizer | None, eos_token_ids: frozenset[int],
                 max_model_len: int, device: torch.device, rng: torch.Generator,
                 arrival_time: float | None = None):
        self.request_id = request_id
        self.prompt = prompt
        self.prompt_token_ids = prompt_token_ids
        self.params = params
        self.metrics = RequestMetrics(arrival_time=arrival_time or time.perf_counter())
        self.num_cached_tokens = 0
        # with params.prompt_logprobs: entry i is prompt token i's logprobs (the first has none)
        self.prompt_logprobs: list | None = None if params.prompt_logprobs is None else [None]
        self.seqs = [
            Sequence(self, i, _make_generator(params, i, device, rng), tokenizer, eos_token_ids,
                     max_model_len)
            for i in range(params.n)
        ]

    @property
    def is_finished(self) -> bool:
        return all(s.is_finished for s in self.seqs)

    def record_token_time(self, now: float) -> None:
        if self.metrics.first_token_time is None:
            self.metrics.first_token_time = now
        self.metrics.last_token_time = now
        if self.is_finished and self.metrics.finished_time is None:
            self.metrics.finished_time = now

    def to_output(self) -> RequestOutput:
        return RequestOutput(
            request_id=self.request_id, prompt=self.prompt, prompt_token_ids=self.prompt_token_ids,
            outputs=[s.to_output() for s in self.seqs], finished=self.is_finished,
            metrics=self.metrics, num_cached_tokens=self.num_cached_tokens,
            prompt_logprobs=self.prompt_logprobs)

    def prompt_rows_wanted(self, start: int, num_new: int) -> list[int]:
        """Of the positions start..start+num_new-1 computed in a step, those whose logits give a
        prompt token's logprobs not yet recorded (position p predicts prompt token p + 1; a
        recomputed or second sequence's position is not recorded twice)."""
        if self.prompt_logprobs is None:
            return []
        first = max(start, len(self.prompt_logprobs) - 1)
        return list(range(first, min(start + num_new, len(self.prompt_token_ids) - 1)))

    def record_prompt_logprobs(self, logprobs: list[dict[int, Logprob]]) -> None:
        """Append the logprobs of the next prompt tokens, in order (from `prompt_rows_wanted`)."""
        self.prompt_logprobs.extend(logprobs)


def _make_generator(params: SamplingParams, index: int, device: torch.device,
                    rng: torch.Generator) -> torch.Generator | None:
    """Each sequence owns its random stream, so its tokens do not depend on its batch-mates.

    With `seed`, sequence i of the request is seeded with seed + i. Without one, the seed is
    drawn from the engine's generator, itself seeded by the engine's `seed` argument, so whole
    runs are reproducible too.
    """
    if params.is_greedy:
        return None
    seed = params.seed + index if params.seed is not None else int(
        torch.randint(0, 2**62, (1,), generator=rng).item())
    return torch.Generator(device=device).manual_seed(seed)
