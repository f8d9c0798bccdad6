"""The front door: `LLM`, as in vLLM.

    from tinyvllm import LLM, SamplingParams
    llm = LLM()                                     # the default model, the newest phase
    outs = llm.generate(["Hello"], SamplingParams(temperature=0, max_tokens=32))
    print(outs[0].outputs[0].text)

`LLM(phase=N)` runs an earlier phase's engine. `generate` validates every prompt before it adds
any, so a bad one raises and leaves the engine as it was, ready for the next call. If a step
fails while generating, every request of the call is aborted before the error is raised: the
engine is left empty and consistent, and the next call works.
"""

from __future__ import annotations

import itertools
import sys
from collections.abc import Iterator, Sequence
from typing import Any

import phases
from tinyvllm.inputs import PromptType
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.tokenizer import check_chat_template_kwargs

Conversation = list[dict[str, Any]]


class LLM:
    """An engine plus a tokenizer, with vLLM's offline API.

    Args:
        model: a local Hugging Face folder of a Llama-family model; None: the default model
            (SmolLM2-135M-Instruct), downloaded and converted on first use.
        phase: which phase's engine runs it, 1 to the newest; None: the newest.
        **engine_args: engine arguments with vLLM's names (`dtype`, `device`, `max_model_len`,
            `block_size`, `enable_prefix_caching`, ...); see `EngineConfig`. An argument that
            asks a phase for a feature it does not have yet is refused, naming the first phase
            that has it.
    """

    def __init__(self, model: str | None = None, phase: int | None = None, **engine_args: Any):
        self.phase = phase if phase is not None else phases.latest_phase()
        self.llm_engine = phases.make_engine(phase, model, **engine_args)
        self._ids = itertools.count()

    def get_tokenizer(self):
        return self.llm_engine.tokenizer

    def generate(self, prompts: PromptType | Sequence[PromptType],
                 sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Generate completions for one prompt or a list; returns one RequestOutput per prompt,
        in order. `sampling_params` is one SamplingParams for all, or a list with one each."""
        request_ids = self._add_requests(prompts, sampling_params)
        wanted = {rid: i for i, rid in enumerate(request_ids)}
        results: list[RequestOutput | None] = [None] * len(request_ids)
        for out in self._run(len(request_ids), use_tqdm):
            if out.finished and out.request_id in wanted:
                results[wanted[out.request_id]] = out
        return results  # type: ignore[return-value]

    def _add_requests(self, prompts: PromptType | Sequence[PromptType],
                      sampling_params: SamplingParams | Sequence[SamplingParams] | None) -> list[str]:
        """Validate every prompt, then add them all; their request ids, in order. (`generate`'s
        first half: `tinyvllm generate` runs the second, `_run`, itself, printing as it goes.)"""
        if isinstance(prompts, (str, dict)):
            prompts = [prompts]
        if not isinstance(prompts, (list, tuple)):
            raise TypeError(f"prompts must be a str, a token prompt dict, or a list of them, "
                            f"got {type(prompts).__name__}")
        if sampling_params is None:
            sampling_params = SamplingParams()
        if isinstance(sampling_params, SamplingParams):
            params_list = [sampling_params] * len(prompts)
        elif isinstance(sampling_params, (list, tuple)):
            if len(sampling_params) != len(prompts):
                raise ValueError(f"sampling_params: got {len(sampling_params)} for {len(prompts)} prompts")
            params_list = list(sampling_params)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams or a list of them, "
                            f"got {type(sampling_params).__name__}")
        engine = self.llm_engine
        # Validate all first: one bad prompt must not leave half the batch queued.
        groups = [engine.make_request(str(next(self._ids)), p, sp) for p, sp in zip(prompts, params_list)]
        for g in groups:
            engine.add_group(g)
        return [g.request_id for g in groups]

    def chat(self, messages: Conversation | list[Conversation],
             sampling_params: SamplingParams | Sequence[SamplingParams] | None = None,
             use_tqdm: bool = True, add_generation_prompt: bool = True,
             chat_template_kwargs: dict[str, Any] | None = None) -> list[RequestOutput]:
        """Generate a reply to a conversation (or to each of a list of conversations), using the
        model's chat template; `chat_template_kwargs` are more variables for it (Qwen3's
        `enable_thinking=False`)."""
        extra = check_chat_template_kwargs(chat_template_kwargs)
        conversations = messages if messages and isinstance(messages[0], list) else [messages]
        tok = self.get_tokenizer()
        prompts = [{"prompt": (text := tok.apply_chat_template(c, add_generation_prompt, **extra)),
                    "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
                   for c in conversations]
        return self.generate(prompts, sampling_params, use_tqdm)

    def _run(self, num_requests: int, use_tqdm: bool) -> Iterator[RequestOutput]:
        """Step the engine until it is empty, yielding every output of every step (a request's
        newest state, its last one finished); if a step fails, every request is aborted first."""
        engine = self.llm_engine
        bar = None
        if use_tqdm and sys.stderr.isatty():
            from tqdm import tqdm
            bar = tqdm(total=num_requests, desc="Processed prompts", unit="req", dynamic_ncols=True)
        try:
            while engine.has_unfinished_requests():
                try:
                    outputs = engine.step()
                except Exception:
                    engine.abort_request(engine.unfinished_request_ids())  # the rest of this call, too
                    raise
                for out in outputs:
                    if out.finished and bar is not None:
                        bar.update(1)
                    yield out
        finally:
            if bar is not None:
                bar.close()
