"""`tinyvllm serve`: its flags and its main (kept beside the server; tinyvllm/entrypoints/cli.py adds it)."""

from __future__ import annotations

import argparse
import os
import sys

import phases
from tinyvllm.secret_env import take_secret

DEFAULT_MAX_NUM_WAITING = 4096   # sequences waiting for a seat: a burst's bound, far above any batch
# the bounds of a connection (tinyvllm/entrypoints/server/connections.py enforces them)
DEFAULT_LIMIT_CONCURRENCY = 512  # connections (or requests in flight) at once
DEFAULT_TIMEOUT_KEEP_ALIVE = 5.0  # seconds an idle kept-alive connection stays open (uvicorn's default)
DEFAULT_HEADER_TIMEOUT = 10.0    # seconds a connection has to send a complete request header
DEFAULT_BODY_TIMEOUT = 30.0      # seconds a request's whole body has, once its header has come


def add_serve_parser(subparsers) -> argparse.ArgumentParser:
    """Add `serve` to the `tinyvllm` parser: model, host, port, phase, api key, limits, engine args."""
    from tinyvllm.entrypoints.engine_flags import add_engine_args
    from tinyvllm.entrypoints.server.limits import CHARS_PER_TOKEN, Limits

    p = subparsers.add_parser(
        "serve", help="an OpenAI-compatible HTTP server (FastAPI + uvicorn) with a live page at /",
        description="Serve a model with OpenAI's API: /v1/completions, /v1/chat/completions, "
                    "/v1/models, /tokenize, /detokenize, /health, /metrics; the live page at /.")
    p.add_argument("model", nargs="?", default=None,
                   help="a local Hugging Face model folder (default: SmolLM2-135M-Instruct)")
    p.add_argument("--model", dest="model_flag", default=None, help="the same, as a flag")
    p.add_argument("--served-model-name", default=None,
                   help="the name clients send as 'model' (default: the folder's name)")
    p.add_argument("--host", default="127.0.0.1", help="address to listen on (default 127.0.0.1)")
    p.add_argument("--port", type=int, default=8000, help="port (default 8000)")
    p.add_argument("--phase", type=int, default=None, metavar="N",
                   help="which phase's engine; default the newest")
    p.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every path but / and /health; an empty "
                        "key is refused. A flag's value shows in `ps` to every user of this machine: "
                        "prefer TINYVLLM_API_KEY, which only you can read (and which tinyvllm takes "
                        "out of its environment before it starts any other process)")
    p.add_argument("--allowed-host", action="append", default=[], metavar="NAME",
                   help="on a loopback --host, answer this Host name too (repeatable; default: only "
                        "localhost, 127.0.0.1 and [::1], against DNS rebinding)")
    p.add_argument("--health-step-timeout", type=float, default=60.0, metavar="S",
                   help="/health answers 503 while one engine step has run longer than S seconds (default 60)")
    p.add_argument("--max-num-waiting", type=int, default=DEFAULT_MAX_NUM_WAITING,
                   help="answer 503 (with Retry-After) when this many sequences already wait for a seat "
                        f"(default {DEFAULT_MAX_NUM_WAITING}: each holds its prompt, so the bound caps "
                        "the memory a burst can take)")
    p.add_argument("--log-level", default="info", help="uvicorn's log level (default info)")
    from tinyvllm.entrypoints.server.reasoning_parsers import REASONING_PARSERS
    from tinyvllm.entrypoints.server.tool_parsers import TOOL_PARSERS
    tools = p.add_argument_group("tool calls and reasoning (vLLM's flags)")
    tools.add_argument("--enable-auto-tool-choice", action="store_true",
                       help='let the model decide whether to call a tool (tool_choice "auto", the default '
                            "when a request has tools); needs --tool-call-parser. Named and \"required\" "
                            "tool choices work without it")
    tools.add_argument("--tool-call-parser", choices=sorted(TOOL_PARSERS), default=None,
                       help="the format the model writes its tool calls in: hermes (<tool_call>{json}"
                            "</tool_call>: Hermes, Qwen2.5, Qwen3) or llama3_json (Llama 3.1/3.2's JSON)")
    tools.add_argument("--reasoning-parser", choices=sorted(REASONING_PARSERS), default=None,
                       help="return a thinking model's reasoning apart, as reasoning_content: qwen3 "
                            "(<think>...</think>)")
    d = Limits()
    lim = p.add_argument_group("limits of one request (each refused with an OpenAI error object)")
    lim.add_argument("--max-request-bytes", type=int, default=d.max_request_bytes,
                     help=f"a body over this is answered 413 (default {d.max_request_bytes})")
    lim.add_argument("--max-prompt-chars", type=int, default=None,
                     help="a prompt (or chat) of more characters is refused before it is tokenized "
                          f"(default: max_model_len x {CHARS_PER_TOKEN})")
    lim.add_argument("--max-n", type=int, default=d.max_n, help=f"the largest n (default {d.max_n})")
    lim.add_argument("--max-prompts", type=int, default=d.max_prompts,
                     help=f"prompts in one /v1/completions request (default {d.max_prompts})")
    lim.add_argument("--max-stop", type=int, default=d.max_stop,
                     help=f"stop strings per request (default {d.max_stop}; each at most "
                          f"{d.max_stop_chars} characters)")
    con = p.add_argument_group("limits of the connections (a client that holds one without using it "
                               "is cut off)")
    con.add_argument("--limit-concurrency", type=int, default=DEFAULT_LIMIT_CONCURRENCY, metavar="N",
                     help="answer 503 (OpenAI's error object, Retry-After) to a request that comes while "
                          "more than N connections are open or more than N requests are in flight "
                          f"(default {DEFAULT_LIMIT_CONCURRENCY}: a full batch of the default --max-num-seqs, "
                          "256, plus as many waiting, and half of the 1024 open files a Linux process "
                          "may hold by default)")
    con.add_argument("--timeout-keep-alive", type=float, default=DEFAULT_TIMEOUT_KEEP_ALIVE, metavar="S",
                     help="close a kept-alive connection that sends no next request in S seconds, or that "
                          "takes longer to finish the body of a request already answered "
                          f"(default {DEFAULT_TIMEOUT_KEEP_ALIVE:g}, as uvicorn)")
    con.add_argument("--header-timeout", type=float, default=DEFAULT_HEADER_TIMEOUT, metavar="S",
                     help="close a connection that has not sent a complete request header S seconds "
                          "after it opened (or after the first bytes of its next request) "
                          f"(default {DEFAULT_HEADER_TIMEOUT:g})")
    con.add_argument("--body-timeout", type=float, default=DEFAULT_BODY_TIMEOUT, metavar="S",
                     help="answer 408 to a request whose whole body has not come S seconds after its "
                          f"header (default {DEFAULT_BODY_TIMEOUT:g}: the default --max-request-bytes "
                          f"at {d.max_request_bytes / DEFAULT_BODY_TIMEOUT / 1000:.0f} KB/s)")
    p.add_argument("--headless", action="store_true",
                   help="run only this host's tensor-parallel ranks, no server: host --node-rank K "
                        "(1 .. --nnodes - 1) of an engine whose node 0 serves (phase 8)")
    add_engine_args(p)
    return p


def is_loopback(host: str) -> bool:
    """Is `host` (the --host to listen on) a loopback address or name?"""
    import ipaddress
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False


def run_headless(phase: int | None, model, engine_args: dict) -> int:
    """Host K >= 1 of an engine over several hosts (vLLM's --headless): its ranks, until they stop."""
    from tinyvllm.download import resolve_model

    if engine_args.get("node_rank", 0) < 1:
        raise ValueError("--headless runs host --node-rank K (1 .. --nnodes - 1) of an engine over "
                         "several hosts; node 0 serves: leave --headless off there")
    first = phases.first_phase_with("nnodes")
    if phase is not None and phase < first:
        raise ValueError(f"--node-rank: phase {phase} has no ranks over several hosts (phase {first} has)")
    from phases.p08_tensor_parallel.worker import run_node

    print(f"tinyvllm: host {engine_args['node_rank']} of {engine_args.get('nnodes', 1)}, its ranks joining "
          f"{engine_args.get('master_addr', '127.0.0.1')}:{engine_args.get('master_port', 29501)}", flush=True)
    return run_node(str(resolve_model(model, engine_args.get("tokenizer"))), engine_args)


def run_serve(args: argparse.Namespace) -> int:
    """Build the engine, then run uvicorn until SIGINT/SIGTERM."""
    import uvicorn

    from tinyvllm.entrypoints.engine_flags import engine_args_from
    from tinyvllm.entrypoints.server.app import LOOPBACK_NAMES, build_app
    from tinyvllm.entrypoints.server.async_engine import AsyncEngine
    from tinyvllm.entrypoints.server.connections import BodyTimeout, bounded_h11
    from tinyvllm.entrypoints.server.limits import Limits

    model = args.model or args.model_flag
    if args.max_num_waiting is not None and args.max_num_waiting < 1:
        raise ValueError(f"--max-num-waiting must be >= 1, got {args.max_num_waiting}")
    for flag in ("max_request_bytes", "max_prompt_chars", "max_n", "max_prompts", "max_stop"):
        value = getattr(args, flag)
        if value is not None and value < 1:
            raise ValueError(f"--{flag.replace('_', '-')} must be >= 1, got {value}")
    api_key = args.api_key if args.api_key is not None else take_secret("TINYVLLM_API_KEY")
    if api_key is not None and not api_key.strip():
        raise ValueError("--api-key (or TINYVLLM_API_KEY) is empty: an empty key would turn "
                         "authentication off; give a key, or leave both unset to serve without one")
    for flag in ("health_step_timeout", "timeout_keep_alive", "header_timeout", "body_timeout"):
        value = getattr(args, flag)
        if not value > 0:   # NaN too
            raise ValueError(f"--{flag.replace('_', '-')} must be > 0, got {value}")
    if args.limit_concurrency < 1:
        raise ValueError(f"--limit-concurrency must be >= 1, got {args.limit_concurrency}")
    from tinyvllm.entrypoints.server.chat_tools import check_parsers
    check_parsers(args.enable_auto_tool_choice, args.tool_call_parser, args.reasoning_parser)
    allowed_hosts = None
    if is_loopback(args.host):
        allowed_hosts = LOOPBACK_NAMES | {h.strip().lower() for h in args.allowed_host}
    limits = Limits(max_request_bytes=args.max_request_bytes, max_prompt_chars=args.max_prompt_chars,
                    max_n=args.max_n, max_prompts=args.max_prompts, max_stop=args.max_stop)
    engine_args = engine_args_from(args)
    if args.headless or engine_args.get("node_rank", 0):
        return run_headless(args.phase, model, engine_args)
    engine = phases.make_engine(args.phase, model, **engine_args)
    server: uvicorn.Server | None = None

    def stop_server() -> None:  # the engine cannot go on: stop serving, exit non-zero
        if server is not None:
            server.should_exit = True

    async_engine = AsyncEngine(engine, max_num_waiting=args.max_num_waiting, on_dead=stop_server)
    name = args.served_model_name or (os.path.basename(os.path.normpath(model)) if model
                                      else "SmolLM2-135M-Instruct")
    app = build_app(async_engine, name, api_key=api_key, max_model_len=engine.max_model_len, limits=limits,
                    allowed_hosts=allowed_hosts, health_step_timeout=args.health_step_timeout,
                    enable_auto_tool_choice=args.enable_auto_tool_choice,
                    tool_call_parser=args.tool_call_parser, reasoning_parser=args.reasoning_parser)
    app.add_middleware(BodyTimeout, seconds=args.body_timeout)   # the outermost of the app's own
    print(f"tinyvllm: serving {name!r} (phase {engine.phase}) on http://{args.host}:{args.port}",
          file=sys.stderr, flush=True)
    # uvicorn's SIGTERM: stop accepting, let open requests finish (at most 30 s), then the
    # lifespan's shutdown stops the engine thread, aborting what still runs.
    server = uvicorn.Server(uvicorn.Config(
        app, host=args.host, port=args.port, log_level=args.log_level, timeout_graceful_shutdown=30,
        timeout_keep_alive=args.timeout_keep_alive,
        http=bounded_h11(header_timeout=args.header_timeout, limit_concurrency=args.limit_concurrency)))
    server.run()
    if async_engine.error is not None:  # a supervisor restarts a server that exits non-zero
        print(f"tinyvllm: the engine stopped: {async_engine.error!r}", file=sys.stderr, flush=True)
        return 1
    return 0
