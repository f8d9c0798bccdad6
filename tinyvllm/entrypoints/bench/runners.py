"""Running one workload through one engine, and what one run measured.

A *runner* wraps an engine the benchmark compares: `EngineRunner` for a tinyvllm phase (through
the engine's `add_request` / `step` loop, the same one `LLM.generate` and the server use), and
`HFRunner` (in `hf.py`) for Hugging Face transformers' `generate`. Each `run(workload)` sends the
workload's requests, waits for all of them, and returns a `RunResult`: wall time, the tokens
made, each request's TTFT and TPOT, the engine's cache counters and the peak memory.

Timing definitions (vLLM's):
- TTFT, time to first token: from the request's arrival to its first output token.
- TPOT, time per output token: (last token time - first token time) / (tokens - 1), the pace of
  decoding once it started. A request with one token has no TPOT.
"""

from __future__ import annotations

import functools
import itertools
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import phases
from tinyvllm.sampling_params import SamplingParams

from .machine import PeakMemory
from .roofline import element_size
from .workloads import Workload

# Counters a phase's engine.get_stats() may have; the report gives null for the ones it lacks.
STATS_KEYS = ("num_kv_blocks", "block_size", "peak_kv_blocks_used", "peak_kv_tokens_reserved",
              "peak_kv_tokens_used", "contiguous_kv_tokens_reserved", "prefix_cache_queries",
              "prefix_cache_hits", "num_preemptions", "spec_num_drafts", "spec_num_draft_tokens",
              "spec_num_accepted_tokens")

# Bytes per element of a quantized KV cache, by the name `kv_cache_dtype` gives it.
KV_CACHE_DTYPE_BYTES = {"int8": 1, "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "float16": 2,
                        "bfloat16": 2, "float32": 4}

OnTokens = Callable[[int], None]  # called with the number of new output tokens, for a progress bar


@dataclass(slots=True)
class RunResult:
    """What one run of a workload through one engine measured."""

    wall_s: float
    num_requests: int
    prompt_tokens: int
    output_tokens: int
    ttft_s: list[float]          # one per request, in the workload's order
    tpot_s: list[float]          # one per request that made two tokens or more
    stats: dict = field(default_factory=dict)
    peak_memory_bytes: int = 0
    memory_increase_bytes: int = 0

    @property
    def output_tok_per_s(self) -> float:
        return self.output_tokens / self.wall_s


def check_token_counts(runner: str, workload: Workload, counts: list[int]) -> None:
    """A benchmark that made other tokens than it asked for measured another workload: refuse it."""
    for i, (req, n) in enumerate(zip(workload.requests, counts)):
        if n != req.max_tokens:
            raise RuntimeError(f"{runner}: request {i} made {n} output tokens, but {req.max_tokens} "
                               f"were asked for (ignore_eos); the run does not measure the workload")


def tpot(first: float, last: float, num_tokens: int) -> float | None:
    return (last - first) / (num_tokens - 1) if num_tokens > 1 else None


class EngineRunner:
    """A tinyvllm phase's engine, driven through `add_request` and `step`."""

    kind = "tinyvllm"

    def __init__(self, phase: int, model: str | None, engine_args: dict):

        from tinyvllm.config import unsupported_engine_args
        from tinyvllm.entrypoints.llm import LLM

        self.phase = phase
        # A ladder of phases shares one command line: each phase gets the arguments it acts on
        # (--quantization int8 reaches phases 5 on); the others are listed in the report.
        honoured = phases.get_recipe(phase).engine_args
        self.skipped_engine_args = unsupported_engine_args(engine_args, honoured)
        self.engine_args = {k: v for k, v in engine_args.items() if k not in self.skipped_engine_args}
        start = time.perf_counter()
        self.engine = LLM(model, phase=phase, **self.engine_args).llm_engine
        self.load_s = time.perf_counter() - start   # LLM(): weights read, quantized, fused, KV pool
        self.name = f"phase{phase}"
        self._ids = itertools.count()

    def wait_until_compiled(self, max_batch: int | None = None) -> float:
        """Wait for a decode step compiling in the background (phase 7 on a CPU, by default) to
        be ready, so that the timed rounds run the step users get after the first minute; the
        seconds waited (0 where nothing compiles). Not where the C step (`tinyvllm.cpu_step`)
        serves every decode batch of the workload, up to `max_batch` rows: those steps never use
        the graphs, nor make them due (a user's requests of that size never compile)."""
        if not hasattr(self.engine, "runner"):   # its parts in another process (phase 9): it decides there
            return self.engine.wait_until_compiled(max_batch)
        runner = getattr(self.engine.runner, "decode_runner", None)
        wait, c_step = getattr(runner, "wait_until_compiled", None), getattr(runner, "c_step", None)
        start = time.perf_counter()
        if wait is not None and not (max_batch and c_step and c_step.serves(max_batch)):
            wait()
        return time.perf_counter() - start

    @property
    def label(self) -> str:
        """'phase 2 (paged_kv)', from the phase's folder name."""

        slug = phases.PHASES[self.phase].rsplit(".", 1)[-1].split("_", 1)[-1]
        return f"phase {self.phase} ({slug})"

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def max_concurrency(self) -> int:
        """The most sequences its configuration lets decode together (the roofline's batch)."""
        return self.engine.config.max_num_seqs

    @functools.cached_property
    def model_facts(self) -> dict:
        """The model's bytes a step reads, parameters and kernels, asked of the engine (where it runs)."""
        return self.engine.model_facts()

    @property
    def weight_bytes(self) -> int:
        return self.model_facts["weight_bytes_per_step"]

    @property
    def num_parameters(self) -> int:
        return self.model_facts["num_parameters"]

    @property
    def kv_bytes_per_element(self) -> int:
        kv_dtype = self.engine.config.kv_cache_dtype
        return KV_CACHE_DTYPE_BYTES.get(kv_dtype, element_size(self.engine.dtype))

    def describe(self) -> dict:
        e = self.engine
        return dict(kind=self.kind, phase=self.phase, label=self.label, engine_args=self.engine_args,
                    skipped_engine_args=self.skipped_engine_args,
                    dtype=str(e.dtype).removeprefix("torch."), device=str(e.device),
                    bf16_products_from_rows=e.setup.bf16_rows or None,   # dtype="auto"'s, where it chose them
                    max_model_len=e.max_model_len, max_num_seqs=e.config.max_num_seqs,
                    # the kernels quantized layers choose (phase 5 on), at one row and at many
                    product_kernels=self.model_facts["product_kernels"])

    def run(self, workload: Workload, on_tokens: OnTokens = lambda n: None) -> RunResult:
        """Send the workload's requests (all at once, or one after another), step the engine until
        all have finished, and measure."""
        engine = self.engine
        if engine.has_unfinished_requests():
            raise RuntimeError(f"{self.name}: the engine still has requests from an earlier run")
        rids = [f"bench-{next(self._ids)}" for _ in workload.requests]
        index = {rid: i for i, rid in enumerate(rids)}
        made = [0] * len(rids)             # output tokens seen so far, per request
        finished: dict[int, object] = {}
        waves = [[i] for i in range(len(rids))] if workload.sequential else [list(range(len(rids)))]
        engine.reset_stats()
        memory = PeakMemory(engine.device)
        memory.start()
        t0 = time.perf_counter()
        for wave in waves:
            arrival = time.perf_counter()
            for i in wave:
                req = workload.requests[i]
                params = SamplingParams(temperature=0.0, max_tokens=req.max_tokens, ignore_eos=True)
                engine.add_request(rids[i], {"prompt_token_ids": list(req.prompt_token_ids)}, params,
                                   arrival_time=arrival)
            while engine.has_unfinished_requests():
                for out in engine.step():
                    i = index[out.request_id]
                    n = len(out.outputs[0].token_ids)
                    on_tokens(n - made[i])
                    made[i] = n
                    if out.finished:
                        finished[i] = out
        wall = time.perf_counter() - t0
        memory.stop()
        check_token_counts(self.name, workload, made)
        ttfts, tpots = [], []
        for i in range(len(rids)):
            m = finished[i].metrics
            ttfts.append(m.first_token_time - m.arrival_time)
            t = tpot(m.first_token_time, m.last_token_time, made[i])
            if t is not None:
                tpots.append(t)
        return RunResult(wall_s=wall, num_requests=len(rids), prompt_tokens=workload.num_prompt_tokens,
                         output_tokens=sum(made), ttft_s=ttfts, tpot_s=tpots, stats=engine.get_stats(),
                         peak_memory_bytes=memory.peak, memory_increase_bytes=memory.increase)
