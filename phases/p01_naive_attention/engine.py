"""The engine: one loop that every phase runs, written once. A phase changes what runs by giving
it other parts (its recipe), never by changing this file.

    step():  plan    = scheduler.schedule()           who runs, and how many tokens each
             out     = runner.execute(plan)           the model over the flat batch -> logits rows
             sampled = sampler.sample(out)            a token per row (drafts: the verified ones)
             scheduler.update(plan, sampled)          append the tokens; free, roll back, cache
             return the outputs of the requests that got tokens

It is vLLM V1's `EngineCore.step` (schedule, execute_model, sample, update_from_output) and
nano-vllm's five-line `LLMEngine.step`. Around the loop: requests come in (`add_request`, which
checks them first), leave (`abort_request`), and are counted (`get_stats`).

The loop lives in phase 1 because it is the first thing to build: with phase 1's parts (one
request at a time, the whole sequence recomputed at every step) it is already a working engine,
and every later phase runs the same loop with better parts.
"""

from __future__ import annotations

import functools

import torch

from tinyvllm.errors import StepError
from tinyvllm.inputs import PromptType, parse_prompt
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import SequenceGroup
from tinyvllm.step import SamplerOutput
from tinyvllm.structured_output import StructuredOutputManager
from tinyvllm.weights import model_facts, weight_bytes

from .parts import EngineSetup, Parts


def checked_args(request_id: str, params: SamplingParams | None, running) -> SamplingParams:
    """A request's id and sampling params checked where no part is needed (the default params when
    none are given): a TypeError or ValueError naming the argument, an id still in `running`
    refused."""
    if params is None:
        params = SamplingParams()
    if not isinstance(params, SamplingParams):
        raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
    if not isinstance(request_id, str):
        raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
    if request_id in running:
        raise ValueError(f"request_id {request_id!r} is already running")
    return params


class Engine:
    """Runs requests through the parts a recipe built (`phases.make_engine(N)` builds phase N's).

    Args:
        setup: the resolved engine arguments, model and tokenizer.
        parts: the model, scheduler, runner, sampler and the rest (`Parts`).
    """

    def __init__(self, setup: EngineSetup, parts: Parts):
        self.setup, self.parts = setup, parts
        self.phase = parts.phase
        self.config, self.tokenizer = setup.config, setup.tokenizer
        self.device, self.dtype, self.model_path = setup.device, setup.dtype, setup.model_path
        self.model_config, self.max_model_len = setup.model_config, setup.max_model_len
        self.eos_token_ids = setup.eos_token_ids
        self.scheduler, self.runner, self.sampler = parts.scheduler, parts.runner, parts.sampler
        self.rng = torch.Generator().manual_seed(self.config.seed)  # seeds for unseeded requests
        self.groups: dict[str, SequenceGroup] = {}                 # unfinished requests by id

    # the parts a reader (or a test) looks at most, by name
    model = property(lambda self: self.parts.model)
    kv_cache = property(lambda self: self.parts.kv_cache)
    allocator = property(lambda self: self.parts.allocator)

    @functools.cached_property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Compiles requests' structured_outputs into grammars (made on first use)."""
        return StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    # -- requests in ---------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                     arrival_time: float | None = None) -> SequenceGroup:
        """Validate a request and build its state, without adding it (raises on bad input)."""
        params = checked_args(request_id, params, self.groups)
        text, ids = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        grammar = self.check_request(len(ids), params)
        group = SequenceGroup(request_id, text, ids, params, self.tokenizer if self.setup.detokenize else None,
                              self.eos_token_ids, self.max_model_len, self.device, self.rng, arrival_time)
        if grammar is not None:  # each sequence parses its own output
            for seq in group.seqs:
                seq.grammar = self.structured_output_manager.matcher(grammar)
        return group

    def check_request(self, num_prompt_tokens: int, params: SamplingParams):
        """The checks of a request that need the model and the parts (the vocabulary, the pool's
        size, the grammar of its structured output); its compiled grammar, or None (raises on bad
        input). A front in another process asks the engine this before it queues a request."""
        params.check_vocab(self.model_config.vocab_size)
        self.scheduler.check_fits(num_prompt_tokens, params)
        structured = params.structured_outputs
        return self.structured_output_manager.compile(structured) if structured is not None else None

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request; it runs in later calls to `step`."""
        self.add_group(self.make_request(request_id, prompt, params, arrival_time))

    def add_group(self, group: SequenceGroup) -> None:
        """Queue a request `make_request` built."""
        self.groups[group.request_id] = group
        for seq in group.seqs:
            self.scheduler.add(seq)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.groups)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop a request (or several) now: its sequences leave the scheduler and give their KV
        blocks back at once. Unknown ids are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for seq in group.seqs:
                seq.abort()
                self.scheduler.finish(seq)

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Schedule, run the model, sample, update the requests; the outputs of those that got
        tokens. If running, sampling or updating fails, the step's requests are aborted (their
        blocks freed) and a `StepError` names them; the engine stays consistent and the others
        go on."""
        # >>> exercise engine_step (2 stars): The engine's step: the scheduler's plan, the runner on it, the sampler on the runner's rows, the scheduler's update, and the outputs of the requests that got tokens.
        # hint: an empty plan (nothing scheduled) gives []; if execute, sample or update raises, abort plan.request_ids() and raise StepError(ids, e) from e; self.outputs(sampled) builds the outputs.
        # checked by: test_every_step_recomputes_the_whole_sequence, test_a_failed_step_aborts_its_requests_and_the_engine_goes_on, test_greedy_matches_transformers
        plan = self.scheduler.schedule()
        if not plan.scheduled:
            return []
        try:
            out = self.runner.execute(plan)
            sampled = self.sampler.sample(out)
            self.scheduler.update(plan, sampled)
        except Exception as e:
            failed = plan.request_ids()
            self.abort_request(failed)
            raise StepError(failed, e) from e
        return self.outputs(sampled)
        # <<< exercise engine_step

    def outputs(self, sampled: SamplerOutput) -> list[RequestOutput]:
        """A `RequestOutput` for each request that got tokens this step; the finished ones leave."""
        outputs = []
        for group in dict.fromkeys(seq.group for seq in sampled.seqs):  # unique, in order
            outputs.append(group.to_output())
            if group.is_finished:
                self.groups.pop(group.request_id, None)
        return outputs

    # -- numbers, for the bench and a server ---------------------------------------------------
    def get_stats(self) -> dict[str, float]:
        """The weights' bytes as stored, and the parts' counters (`stats()` of each part that keeps
        some: a KV pool's peak use, a scheduler's preemptions, a sampler's accepted drafts)."""
        stats: dict[str, float] = {"weight_bytes": weight_bytes(self.model)}
        for part in self._counting_parts():
            stats.update(part.stats())
        return stats

    def reset_stats(self) -> None:
        """Zero the counters and peaks of `get_stats` (between benchmark runs)."""
        for part in self._counting_parts():
            part.reset_stats()

    def model_facts(self) -> dict:
        """The model's size and kernels as plain data, for a benchmark report (`weights.model_facts`)."""
        return model_facts(self.model)

    def _counting_parts(self) -> list:
        parts = (self.parts.allocator, self.parts.scheduler, self.parts.sampler, self.parts.runner)
        return [p for p in dict.fromkeys(parts) if callable(getattr(p, "stats", None))]

    def snapshot(self) -> dict:
        """The engine's state as plain data: every running and waiting sequence with its KV blocks
        (those shared through the prefix cache apart), the pool, and the counters. A server's live
        page and metrics read this, never the parts themselves."""
        sched, alloc = self.scheduler, self.parts.allocator
        ref_counts = alloc.ref_counts if alloc is not None else []

        def describe(seq) -> dict:
            blocks = list(seq.block_table.block_ids) if seq.block_table is not None else []
            return {"request_id": seq.group.request_id, "index": seq.index,
                    "num_prompt_tokens": len(seq.group.prompt_token_ids),
                    "num_output_tokens": seq.num_output_tokens, "blocks": blocks,
                    "shared_blocks": [b for b in blocks if ref_counts[b] > 1]}

        stats = self.get_stats()
        num_blocks = alloc.num_blocks if alloc is not None else 0
        num_free = alloc.num_free_blocks if alloc is not None else 0
        return {
            "phase": self.phase,
            "running": [describe(s) for s in list(sched.running)],
            "waiting": [describe(s) for s in list(sched.waiting)],
            "num_running": len(sched.running), "num_waiting": len(sched.waiting),
            "num_blocks": num_blocks, "num_free_blocks": num_free,
            "block_size": self.config.block_size,
            "kv_cache_usage_perc": 1.0 - num_free / max(num_blocks, 1) if num_blocks else 0.0,
            "num_preemptions": int(stats.get("num_preemptions", 0)),
            "prefix_cache_queries": int(stats.get("prefix_cache_queries", 0)),
            "prefix_cache_hits": int(stats.get("prefix_cache_hits", 0)),
            # a KV connector's (phase 10): blocks loaded from and saved to its tier
            "kv_offload_loaded_blocks": int(stats.get("kv_offload_loaded_blocks", 0)),
            "kv_offload_saved_blocks": int(stats.get("kv_offload_saved_blocks", 0)),
        }

    def check_health(self) -> None:
        """Raise `EngineDeadError` when the engine can run nothing more; one in this process always
        can (phase 9's client of an engine core in another process asks whether it still lives)."""

    def shutdown(self) -> None:
        """Let go of what the parts hold outside this process (worker processes, say)."""
        self.parts.close()

