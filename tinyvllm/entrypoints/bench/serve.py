"""`tinyvllm bench serve`: a load test of an OpenAI-compatible server.

Requests arrive as a Poisson process at --request-rate per second (inf: all at once), each a
streamed /v1/completions call with its prompt as token ids and an exact output length
(ignore_eos), taken from the bench's seeded workloads. Per request it records the time to the
first token (TTFT), the time per output token after it (TPOT), the gaps between tokens (ITL)
and the end-to-end latency; the report gives their mean, median and p99, the request and
output-token throughput, and the goodput: requests per second that met every --goodput target.
With --background-rate, long prompts (--background-input-len tokens, --background-output-len
out) keep arriving beside them until they are done, reported apart (`background`): how much a
prefill elsewhere in the batch, or on another server, lengthens their gaps between tokens.
Without --base-url it starts `tinyvllm serve` itself; with one it measures any such server
(vLLM, llama.cpp's server, an earlier phase).

The JSON report names its machine (`machine`: the CPU, its kind, the load average before and
after) and carries the run as one table row (`rows`: server, output tok/s, TTFT, TPOT and ITL),
so a page renders it with scripts/bench_tables.py, two servers' reports side by side.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import socket
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import torch

from tinyvllm.entrypoints.engine_flags import engine_flags_from

from .machine import load_average, machine_info


@dataclass(slots=True)
class RequestResult:
    """What one request measured (seconds)."""

    ok: bool
    prompt_len: int
    output_len: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    error: str = ""

    @property
    def tpot(self) -> float:
        return (self.e2e - self.ttft) / (self.output_len - 1) if self.output_len > 1 else 0.0


def parse_goodput(items: list[str] | None) -> dict[str, float]:
    """['ttft:500', 'tpot:50'] -> {'ttft': 0.5, 'tpot': 0.05} (milliseconds in, seconds out)."""
    targets = {}
    for item in items or []:
        name, _, ms = item.partition(":")
        if name not in ("ttft", "tpot", "e2e") or not ms:
            raise ValueError(f"--goodput: expected ttft:MS, tpot:MS or e2e:MS, got {item!r}")
        try:
            targets[name] = float(ms) / 1000
        except ValueError:
            raise ValueError(f"--goodput: {item!r}: MS must be a number") from None
    return targets


async def _one(client, url: str, model: str | None, req, headers) -> RequestResult:
    body = {"prompt": list(req.prompt_token_ids), "max_tokens": req.max_tokens, "temperature": 0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
    if model:
        body["model"] = model
    res = RequestResult(ok=False, prompt_len=len(req.prompt_token_ids))
    start = last = time.perf_counter()
    try:
        async with client.stream("POST", url + "/v1/completions", json=body, headers=headers) as r:
            if r.status_code != 200:
                res.error = f"{r.status_code}: {(await r.aread())[:200]!r}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data:") or line.strip() == "data: [DONE]":
                    continue
                chunk = json.loads(line[5:])
                now = time.perf_counter()
                if chunk.get("usage"):
                    res.output_len = chunk["usage"]["completion_tokens"]
                if not chunk.get("choices") or not chunk["choices"][0].get("text"):
                    continue
                if res.ttft == 0.0:
                    res.ttft = now - start
                else:
                    res.itl.append(now - last)
                last = now
        res.e2e = time.perf_counter() - start
        res.ok = True
    except Exception as e:  # noqa: BLE001 -- a failed request is counted, not fatal
        res.error = repr(e)
    return res


async def run_load(url: str, requests, request_rate: float, model: str | None = None,
                   api_key: str | None = None, seed: int = 0, background=None,
                   background_rate: float = 0.0) -> tuple[list[RequestResult], float, list[RequestResult]]:
    """Send `requests` with Poisson arrivals; return their results, the wall time and those of
    the `background` requests, sent beside them at `background_rate` a second (Poisson too) until
    the last of `requests` has its answer; a background request still running then is dropped."""
    import httpx

    rng, bg_rng = random.Random(seed), random.Random(seed + 1)
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as client:
        tasks, bg_tasks, done = [], [], asyncio.Event()

        async def send_background():
            for req in background or ():
                bg_tasks.append(asyncio.create_task(_one(client, url, model, req, headers)))
                try:
                    await asyncio.wait_for(done.wait(), bg_rng.expovariate(background_rate))
                    return
                except asyncio.TimeoutError:
                    pass

        sender = asyncio.create_task(send_background())
        t0 = time.perf_counter()
        for req in requests:
            tasks.append(asyncio.create_task(_one(client, url, model, req, headers)))
            if math.isfinite(request_rate):
                await asyncio.sleep(rng.expovariate(request_rate))
        results = await asyncio.gather(*tasks)
        duration = time.perf_counter() - t0
        done.set()
        await sender
        for task in bg_tasks:
            if not task.done():
                task.cancel()
        finished = [t.result() for t in bg_tasks if t.done() and not t.cancelled()]
        return results, duration, finished


def summarize(results: list[RequestResult], duration: float, goodput: dict[str, float]) -> dict:
    """The report's numbers: latency stats in milliseconds, throughputs per second."""
    done = [r for r in results if r.ok]

    def stats(values: list[float]) -> dict:
        if not values:
            return {"mean_ms": None, "median_ms": None, "p99_ms": None}
        v = sorted(values)
        p99 = v[min(len(v) - 1, math.ceil(0.99 * len(v)) - 1)]
        return {"mean_ms": 1000 * statistics.fmean(v), "median_ms": 1000 * statistics.median(v),
                "p99_ms": 1000 * p99}

    good = [r for r in done if all(getattr(r, k) <= t for k, t in goodput.items())]
    out_tokens = sum(r.output_len for r in done)
    return {
        "completed": len(done), "failed": len(results) - len(done),
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration,
        "total_input_tokens": sum(r.prompt_len for r in done), "total_output_tokens": out_tokens,
        "request_throughput": len(done) / duration, "output_throughput": out_tokens / duration,
        "goodput": len(good) / duration if goodput else None,
        "goodput_targets_ms": {k: 1000 * v for k, v in goodput.items()},
        "ttft": stats([r.ttft for r in done]), "tpot": stats([r.tpot for r in done if r.output_len > 1]),
        "itl": stats([x for r in done for x in r.itl]), "e2e": stats([r.e2e for r in done]),
    }


def table_row(s: dict, server: str) -> dict:
    """The run as one row of a page's table (scripts/bench_tables.py's `columns: key = header`)."""
    bg = s.get("background")
    return {"server": server, "clients": s["num_prompts"], "output_tok_s": round(s["output_throughput"], 1),
            "ttft_median_ms": s["ttft"]["median_ms"], "tpot_median_ms": s["tpot"]["median_ms"],
            "itl_median_ms": s["itl"]["median_ms"], "itl_p99_ms": s["itl"]["p99_ms"],
            "failed": s["failed"],
            "background": f"{bg['input_len']}-token prompts at {bg['request_rate']:g}/s" if bg else "none"}


def format_summary(s: dict, title: str) -> str:
    lines = [title,
             f"  completed {s['completed']}, failed {s['failed']} in {s['duration_s']:.2f} s",
             (f"  request throughput {s['request_throughput']:.2f} req/s, "
              f"output {s['output_throughput']:.1f} tok/s")]
    if s["goodput"] is not None:
        lines.append(f"  goodput {s['goodput']:.2f} req/s under {s['goodput_targets_ms']} ms")
    lines.append(f"  {'':6} {'mean ms':>10} {'median ms':>10} {'p99 ms':>10}")
    for k in ("ttft", "tpot", "itl", "e2e"):
        v = s[k]
        if v["mean_ms"] is None:
            lines.append(f"  {k.upper():6} {'-':>10} {'-':>10} {'-':>10}")
        else:
            lines.append(f"  {k.upper():6} {v['mean_ms']:>10.1f} {v['median_ms']:>10.1f} {v['p99_ms']:>10.1f}")
    for e in s["errors"]:
        lines.append(f"  error: {e}")
    return "\n".join(lines)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_builtin_server(serve_args: list[str], timeout: float = 600, **popen_kwargs):
    """`tinyvllm serve *serve_args` in a subprocess on a free port; (process, url) once /health
    answers. `popen_kwargs` go to subprocess.Popen (the tests capture its output)."""
    import httpx

    port = _free_port()
    cmd = [sys.executable, "-m", "tinyvllm.entrypoints.cli", "serve", "--port", str(port), *serve_args]
    proc = subprocess.Popen(cmd, **popen_kwargs)
    url = f"http://127.0.0.1:{port}"
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc.poll() is not None:
            out = proc.stdout.read() if proc.stdout else ""
            raise RuntimeError(f"the server exited ({proc.returncode}) {out}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            time.sleep(0.3)
    proc.kill()
    raise RuntimeError(f"the server did not start in {timeout:.0f} s")


def run_serve_bench(args, engine_args: dict, command: str) -> int:
    """`tinyvllm bench serve`: build the workload, start or reach the server, load it, report."""
    from tinyvllm.config import ModelConfig
    from tinyvllm.download import resolve_model
    from tinyvllm.tokenizer import Tokenizer

    from .workloads import make_workload

    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf: all at once), got {args.request_rate}")
    goodput = parse_goodput(args.goodput)
    model_path = resolve_model(args.model)
    tokenizer, vocab_size = Tokenizer(model_path), ModelConfig.from_pretrained(model_path).vocab_size
    workload = make_workload("throughput", tokenizer, vocab_size,
                             num_prompts=args.num_prompts, dataset=args.dataset, input_len=args.input_len,
                             output_len=args.output_len, seed=args.seed)
    requests = workload.requests
    background = []
    if args.background_rate:
        if args.background_rate < 0 or not math.isfinite(args.background_rate):
            raise ValueError(f"--background-rate must be a number of requests a second > 0, "
                             f"got {args.background_rate}")
        background = make_workload("throughput", tokenizer, vocab_size, num_prompts=args.background_num_prompts,
                                   dataset="random", input_len=args.background_input_len,
                                   output_len=args.background_output_len, seed=args.seed + 1).requests
    proc, phase = None, None
    url = args.base_url
    load_before = load_average()
    if url is None:
        if args.phases is not None:
            from .harness import parse_phases
            phase_list = parse_phases(args.phases)
            if len(phase_list) != 1:
                raise ValueError("--phases: bench serve runs one phase's server; give one, e.g. --phases 3")
            phase = phase_list[0]
        # every request may be in flight at once (--request-rate inf): room for all of them
        serve_args = ["--log-level", "warning", "--limit-concurrency", str(max(512, 2 * args.num_prompts)),
                      *([args.model] if args.model else []),
                      *(["--phase", str(phase)] if phase else []), *engine_flags_from(engine_args)]
        proc, url = start_builtin_server(serve_args)
    try:
        results, duration, bg_results = asyncio.run(run_load(
            url.rstrip("/"), requests, args.request_rate, model=args.served_model_name, api_key=args.api_key,
            seed=args.seed, background=background, background_rate=args.background_rate))
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(60)
    summary = summarize(results, duration, goodput)
    summary.update(command=command, base_url=args.base_url or "built-in", request_rate=args.request_rate,
                   num_prompts=len(requests), model=model_path.name)
    if background:
        summary["background"] = dict(summarize(bg_results, duration, {}), request_rate=args.background_rate,
                                     input_len=args.background_input_len, output_len=args.background_output_len)
    summary.update(machine=dict(machine_info(torch.device("cpu")), load_average_1min_before=load_before,
                                load_average_1min_after=load_average()),
                   rows=[table_row(summary, args.label or args.base_url or f"phase {phase or 'newest'}'s server")])
    print(format_summary(summary, f"tinyvllm bench serve: {len(requests)} requests at "
                                  f"{args.request_rate} req/s against {summary['base_url']}"))
    if background:
        print(format_summary(summary["background"], f"beside them, {len(bg_results)} background requests of "
                                                    f"{args.background_input_len} prompt tokens answered at "
                                                    f"{args.background_rate} req/s"))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(summary, indent=2) + "\n")
        print(f"wrote {args.json_path}", file=sys.stderr)
    if args.plot_path:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
        fig, ax = plt.subplots(figsize=(7, 3.5))
        keys = ["ttft", "tpot", "itl", "e2e"]
        for i, stat in enumerate(("mean_ms", "median_ms", "p99_ms")):
            ax.bar([k + i * 0.27 for k in range(4)], [summary[k][stat] or 0 for k in keys], 0.27, label=stat[:-3])
        ax.set_xticks([k + 0.27 for k in range(4)], [k.upper() for k in keys])
        ax.set_ylabel("ms")
        ax.set_yscale("log")
        ax.legend()
        ax.set_title(f"{summary['model']}: {len(requests)} requests at {args.request_rate} req/s")
        fig.tight_layout()
        fig.savefig(args.plot_path)
        print(f"wrote {args.plot_path}", file=sys.stderr)
    return 0 if summary["failed"] == 0 else 1
