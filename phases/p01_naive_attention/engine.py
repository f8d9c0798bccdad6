"""Phase 1 engine: correct and simple, and slow on purpose.

Requests run one at a time. To produce each new token the engine runs the model over the
*whole* sequence (prompt plus everything generated so far) and keeps only the last row of
logits. Nothing is remembered between steps, so generating n tokens after a prompt of p tokens
costs about sum_{t=p}^{p+n} t token-passes through the model, and attention over each pass builds
a t x t score matrix: the work grows with the square of the length.

The parts every later phase keeps live here too: loading the model and tokenizer, validating
requests (`add_request`), the `step()` loop, and turning sampled tokens into outputs. Later
phases subclass `Engine` and replace `step` (what runs) and the attention backend (how).
"""

from __future__ import annotations

import functools
import time
from collections import deque
from pathlib import Path

import torch

from tinyvllm.config import EngineConfig, ModelConfig, unsupported_engine_args
from tinyvllm.download import resolve_model
from tinyvllm.inputs import PromptType, parse_prompt
from tinyvllm.outputs import RequestOutput
from tinyvllm.sampler import Sampler
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.sequence import Sequence, SequenceGroup
from tinyvllm.structured_output import StructuredOutputManager
from tinyvllm.tokenizer import Tokenizer
from tinyvllm.weights import load_model, resolve_device, resolve_dtype

from .attention import NaiveAttention


class Engine:
    """The phase 1 engine: full recompute, one request at a time."""

    phase = 1
    # The engine arguments this phase acts on. Each later phase adds the ones of its features;
    # any other argument set to a value that asks for something is refused (check_engine_args).
    ENGINE_ARGS = frozenset({"dtype", "device", "seed", "max_model_len", "disable_log_stats"})

    def __init__(self, model: str | Path | None = None, **engine_args):
        self.config = EngineConfig.from_kwargs(**engine_args)
        self.check_engine_args(engine_args)
        self.model_path = resolve_model(model)
        self.device = resolve_device(self.config.device)
        self.dtype = resolve_dtype(self.config.dtype, self.device)
        self.model_config = ModelConfig.from_pretrained(self.model_path)
        limit = self.model_config.max_position_embeddings
        self.max_model_len = min(self.config.max_model_len or limit, limit)
        self.tokenizer = Tokenizer(self.model_path)
        self.eos_token_ids = _eos_token_ids(self.model_path, self.model_config, self.tokenizer)
        self.model = self.make_model()
        self.sampler = self.make_sampler()
        self.rng = torch.Generator().manual_seed(self.config.seed)  # seeds for unseeded requests
        self.groups: dict[str, SequenceGroup] = {}                 # unfinished requests by id
        self.queue: deque[Sequence] = deque()                      # phase 1: one at a time, FIFO

    def make_model(self):
        """The model with its weights loaded, on the engine's device and dtype (a later phase may
        keep only its share of them)."""
        return load_model(self.model_path, self.dtype, self.device, self.max_model_len)

    def make_sampler(self) -> Sampler:
        """The part that picks each next token from its logits (`tinyvllm.sampler`)."""
        return Sampler(self.tokenizer)

    @functools.cached_property
    def structured_output_manager(self) -> StructuredOutputManager:
        """Compiles requests' structured_outputs into grammars (made on first use)."""
        return self.make_structured_output_manager()

    def make_structured_output_manager(self) -> StructuredOutputManager:
        """The part behind structured outputs (`tinyvllm.structured_output`)."""
        return StructuredOutputManager(self.tokenizer, self.model_config.vocab_size, self.eos_token_ids)

    @classmethod
    def check_engine_args(cls, engine_args: dict) -> None:
        """Refuse an argument this phase would ignore (`quantization="int4"` on phase 3): the
        user asked for a feature, and silently getting something else would mislead them."""
        import phases  # the registry: which phase has the feature

        for name in unsupported_engine_args(engine_args, cls.ENGINE_ARGS):
            first = phases.first_phase_with(name)
            where = (f"phase {first} is the first that has it: LLM(phase={first}) or later"
                     if first else "no registered phase has it yet")
            raise ValueError(f"{name}={engine_args[name]!r}: phase {cls.phase} does not have this "
                             f"feature ({where}); or leave {name} at its default")

    # -- requests in ---------------------------------------------------------------------------
    def make_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                     arrival_time: float | None = None) -> SequenceGroup:
        """Validate a request and build its state, without adding it (raises on bad input)."""
        if params is None:
            params = SamplingParams()
        if not isinstance(params, SamplingParams):
            raise TypeError(f"sampling_params must be a SamplingParams, got {type(params).__name__}")
        if not isinstance(request_id, str):
            raise TypeError(f"request_id must be a str, got {type(request_id).__name__}")
        if request_id in self.groups:
            raise ValueError(f"request_id {request_id!r} is already running")
        text, ids = parse_prompt(prompt, self.tokenizer, self.model_config.vocab_size, self.max_model_len)
        self.check_fits(len(ids), params)
        structured = params.structured_outputs
        grammar = self.structured_output_manager.compile(structured) if structured is not None else None
        group = SequenceGroup(request_id, text, ids, params, self.tokenizer, self.eos_token_ids,
                              self.max_model_len, self.device, self.rng, arrival_time)
        if grammar is not None:  # each sequence parses its own output
            for seq in group.seqs:
                seq.grammar = self.structured_output_manager.matcher(grammar)
        return group

    def check_fits(self, num_prompt_tokens: int, params: SamplingParams) -> None:
        """Raise if a request can never run. Phase 1 has no limit beyond max_model_len."""

    def add_request(self, request_id: str, prompt: PromptType, params: SamplingParams | None = None,
                    arrival_time: float | None = None) -> None:
        """Queue a request; it runs in later calls to `step`."""
        self.add_group(self.make_request(request_id, prompt, params, arrival_time))

    def add_group(self, group: SequenceGroup) -> None:
        self.groups[group.request_id] = group
        self.queue.extend(group.seqs)

    def has_unfinished_requests(self) -> bool:
        return bool(self.groups)

    def unfinished_request_ids(self) -> list[str]:
        return list(self.groups)

    def abort_request(self, request_id: str | list[str]) -> None:
        """Stop a request (or several) now; later phases free its blocks at once. Unknown ids
        are ignored."""
        for rid in [request_id] if isinstance(request_id, str) else request_id:
            group = self.groups.pop(rid, None)
            if group is None:
                continue
            for seq in group.seqs:
                seq.abort()
                self.release(seq)

    def release(self, seq: Sequence) -> None:
        """Forget an aborted sequence: phase 1 only queues it (later phases free its blocks)."""
        if seq in self.queue:
            self.queue.remove(seq)

    def get_stats(self) -> dict[str, float]:
        """Counters for `tinyvllm bench`. Phase 1 keeps no cache, so it has none. Later phases add
        num_kv_blocks, block_size, peak_kv_blocks_used, peak_kv_tokens_reserved,
        peak_kv_tokens_used, contiguous_kv_tokens_reserved, prefix_cache_queries,
        prefix_cache_hits and num_preemptions."""
        return {}

    def reset_stats(self) -> None:
        """Zero the counters and peaks of `get_stats` (between benchmark runs)."""

    # -- one step ------------------------------------------------------------------------------
    @torch.inference_mode()
    def step(self) -> list[RequestOutput]:
        """Generate one token for the sequence at the head of the queue."""
        # >>> exercise recompute_step (1 star): One step of phase 1: run the model over the whole sequence of the queue's first request, and sample its next token from the last row.
        # hint: torch.arange gives the positions; NaiveAttention() is the backend; compute_logits on hidden[-1:]; append_tokens samples; pop the request once it is finished.
        # checked by: test_every_step_recomputes_the_whole_sequence, test_greedy_matches_transformers
        if not self.queue:
            return []
        seq = self.queue[0]
        if seq.group.metrics.first_scheduled_time is None:
            seq.group.metrics.first_scheduled_time = time.perf_counter()
        ids = torch.tensor(seq.token_ids, device=self.device)             # (T,)
        positions = torch.arange(len(ids), device=self.device)             # (T,)
        hidden = self.model(ids, positions, NaiveAttention())              # (T, D): all of it again
        self.record_prompt_logprobs(hidden, [(seq, 0, len(ids), 0)])
        logits = self.model.compute_logits(hidden[-1:])                   # (1, V): only the last row
        self.append_tokens([seq], logits)
        if seq.is_finished:
            self.queue.popleft()
        return self.collect_outputs([seq.group])
        # <<< exercise recompute_step

    def record_prompt_logprobs(self, hidden: torch.Tensor, spans: list[tuple[Sequence, int, int, int]]) -> None:
        record_prompt_logprobs(self.model, self.sampler, hidden, spans)

    def append_tokens(self, seqs: list[Sequence], logits: torch.Tensor) -> None:
        """Sample one token per sequence from its row of logits and record it."""
        tokens, logprobs = self.sample(logits, seqs)
        now = time.perf_counter()
        for seq, token, lp in zip(seqs, tokens, logprobs):
            seq.append_token(token, lp)
            seq.group.record_token_time(now)

    def sample(self, logits: torch.Tensor, seqs: list[Sequence]) -> tuple[list[int], list]:
        """The sampler's token (and logprobs) for each row: an extension point, for an engine
        that samples a batch another way."""
        return self.sampler(logits, seqs)

    def collect_outputs(self, groups: list[SequenceGroup]) -> list[RequestOutput]:
        """The outputs of the groups that changed this step; forget the finished ones."""
        outputs = []
        for group in dict.fromkeys(groups):  # unique, in order
            outputs.append(group.to_output())
            if group.is_finished:
                self.groups.pop(group.request_id, None)
        return outputs


def record_prompt_logprobs(model, sampler, hidden: torch.Tensor, spans: list[tuple[Sequence, int, int, int]]) -> None:
    """For requests with `prompt_logprobs`: the logits of the prompt rows this step computed,
    and only those (a prompt's rows are otherwise never turned into logits). `spans`: (seq,
    first position, positions computed, its first row in `hidden` (N, D))."""
    for seq, start, num_new, row in spans:
        group = seq.group
        if group is None:  # a sequence that belongs to no request (an engine's own)
            continue
        positions = group.prompt_rows_wanted(start, num_new)
        if positions:
            rows = torch.tensor([row + p - start for p in positions], device=hidden.device)
            logits = model.compute_logits(hidden[rows])                      # (P, V)
            targets = [group.prompt_token_ids[p + 1] for p in positions]
            group.record_prompt_logprobs(sampler.prompt_logprobs(logits, targets, group.params.prompt_logprobs))


def _eos_token_ids(folder: Path, config: ModelConfig, tokenizer: Tokenizer) -> frozenset[int]:
    """End-of-sequence ids: generation_config.json's (what transformers' generate uses), else
    config.json's, plus the tokenizer's eos token."""
    import json

    ids = set(config.eos_token_id)
    gen = folder / "generation_config.json"
    if gen.is_file():
        eos = json.loads(gen.read_text()).get("eos_token_id")
        if eos is not None:
            ids = set([eos] if isinstance(eos, int) else eos)
    if tokenizer.eos_token_id is not None:
        ids.add(tokenizer.eos_token_id)
    return frozenset(ids)
