"""`tinyvllm bench accuracy`: what quantization and bfloat16 cost in accuracy, measured through the
public API.

For each `dtype` x `quantization` x `kv_cache_dtype`, against the unquantized engine of the first
dtype (quantization=None, kv_cache_dtype="auto"; float32 where asked first) on the same model:

- perplexity on a fixed English text shipped with tinyvllm (`tinyvllm/data/python_reference.txt`,
  the Python Language Reference's prose, ~24k tokens), cut into windows of `window` tokens, each
  scored with `SamplingParams(prompt_logprobs=0)`: exp(-mean log p(token | tokens before it)).
- mean KL divergence KL(float || quantized) of the next-token distributions at the first
  `kl_tokens` positions of the text (the full distributions, taken from the prompt rows' logits).
- greedy top-1 agreement: the float engine answers the bench's chat prompts greedily; each
  engine then scores prompt + that answer (teacher forcing), and we count the answer tokens it
  ranks first too.

    tinyvllm bench accuracy --quantization-list none int8 int4 --kv-cache-dtypes auto int8 --json acc.json
    tinyvllm bench accuracy --dtypes float32 bfloat16 --quantization-list none int8 --json acc.json
"""

from __future__ import annotations

import json
import math
import os
import sys
import time
from pathlib import Path
from unittest import mock

import torch

TEXT_PATH = Path(__file__).resolve().parents[2] / "data" / "python_reference.txt"  # tinyvllm/data


def load_text() -> str:
    """The shipped text, without its license header (everything after the ==== line)."""
    return TEXT_PATH.read_text().split("=" * 72 + "\n", 1)[1]


def _windows(ids: list[int], window: int, max_tokens: int | None) -> list[list[int]]:
    ids = ids[:max_tokens] if max_tokens else ids
    return [ids[i: i + window] for i in range(0, len(ids), window) if len(ids[i: i + window]) > 1]


def score(llm, prompts: list[list[int]], capture_tokens: int = 0):
    """prompt_logprobs of each prompt; also the full log-softmax of the first `capture_tokens`
    prompt rows (for KL), caught where the engine turns those rows into logprobs."""
    from tinyvllm import SamplingParams

    engine = llm.llm_engine
    captured: list[torch.Tensor] = []
    original = engine.sampler.prompt_logprobs

    def capture(logits, tokens, k):
        have = sum(len(c) for c in captured)
        if have < capture_tokens:
            captured.append(torch.log_softmax(logits.float(), -1)[: capture_tokens - have].clone())
        return original(logits, tokens, k)

    engine.sampler.prompt_logprobs = capture
    try:
        outs = llm.generate([{"prompt_token_ids": p} for p in prompts],
                            SamplingParams(temperature=0, max_tokens=1, prompt_logprobs=0), use_tqdm=False)
    finally:
        del engine.sampler.prompt_logprobs
    logprobs = [[entry[tok] for entry, tok in zip(o.prompt_logprobs[1:], p[1:])] for o, p in zip(outs, prompts)]
    return logprobs, (torch.cat(captured) if captured else None)


def run_accuracy(model=None, quantizations=(None, "int8", "int4"), kv_cache_dtypes=("auto", "int8"),
                 group_size: int | None = None, window: int = 512, max_text_tokens: int | None = None,
                 kl_tokens: int = 512, num_chat: int = 8, chat_tokens: int = 32, phase: int | None = None,
                 progress: bool = False, dtypes=("auto",), **engine_args) -> dict:
    """Run every configuration and return the report (see the module docstring). group_size None:
    the engine's default for int4 (the report records the group each int4 engine used). Each row
    names the dtype its engine computed in (what "auto" became)."""
    from tinyvllm import LLM, SamplingParams

    from .workloads import CHAT_QUESTIONS

    def make(dtype, q, kv):
        # `score` catches the logits in the engine's sampler: an engine core that runs in a process
        # of its own (phase 9) runs in this one here, the same parts and numbers
        with mock.patch.dict(os.environ, {"TINYVLLM_ENABLE_MULTIPROCESSING": "0"}):
            return LLM(model, phase=phase, quantization=q, quantization_group_size=group_size,
                       kv_cache_dtype=kv, dtype=dtype, **engine_args)

    base = make(dtypes[0], None, "auto")
    tok = base.llm_engine.tokenizer
    text_windows = _windows(tok.encode(load_text()), window, max_text_tokens)
    chats = [tok.apply_chat_template([{"role": "user", "content": q}], add_generation_prompt=True)
             if tok.chat_template else q for q in CHAT_QUESTIONS[:num_chat]]
    answers = base.generate(chats, SamplingParams(temperature=0, max_tokens=chat_tokens), use_tqdm=False)
    forced = [list(a.prompt_token_ids) + list(a.outputs[0].token_ids) for a in answers]
    answer_lens = [len(a.outputs[0].token_ids) for a in answers]

    def measure(llm):
        t = time.perf_counter()
        lps, dist = score(llm, text_windows, kl_tokens)
        flat = [lp.logprob for w in lps for lp in w]
        chat_lps, _ = score(llm, forced)
        ranks = [lp.rank for w, n in zip(chat_lps, answer_lens) for lp in w[len(w) - n:]]
        return dict(perplexity=math.exp(-sum(flat) / len(flat)), num_text_tokens=len(flat),
                    top1_agreement=sum(r == 1 for r in ranks) / max(1, len(ranks)),
                    num_answer_tokens=len(ranks), seconds=time.perf_counter() - t), dist

    ref, ref_dist = measure(base)
    ref["mean_kl"] = 0.0
    if progress:
        print(f"float: perplexity {ref['perplexity']:.3f} over {ref['num_text_tokens']} tokens",
              file=sys.stderr, flush=True)
    rows = [dict(dtype=_dtype_name(base), quantization=None, kv_cache_dtype="auto", **ref)]
    del base
    for dtype, q, kv in ((d, q, kv) for d in dtypes for q in quantizations for kv in kv_cache_dtypes):
        if (dtype, q, kv) == (dtypes[0], None, "auto"):
            continue
        llm = make(dtype, q, kv)
        row, dist = measure(llm)
        if q == "int4":  # the group the engine used, asked for or its default
            row["group_size"] = next(m.group_size for m in llm.llm_engine.model.modules()
                                     if getattr(m, "method", None) == "int4")
        name = _dtype_name(llm)
        del llm
        n = min(len(dist), len(ref_dist))
        kl = (ref_dist[:n].exp() * (ref_dist[:n] - dist[:n])).sum(-1).mean().item()
        row.update(mean_kl=kl, perplexity_change=row["perplexity"] / ref["perplexity"] - 1)
        rows.append(dict(dtype=name, quantization=q, kv_cache_dtype=kv, **row))
        if progress:  # each row as it is measured: a run of many engines takes minutes
            print(f"dtype={name} quantization={q} kv_cache_dtype={kv}: perplexity {row['perplexity']:.3f} "
                  f"({row['perplexity_change'] * 100:+.2f}%), mean KL {kl:.5f}, top-1 "
                  f"{row['top1_agreement'] * 100:.1f}%", file=sys.stderr, flush=True)
    used = [r["group_size"] for r in rows if "group_size" in r]
    return dict(workload="accuracy", model=str(model or "default"), group_size=group_size or
                (used[0] if used else None), window=window,
                text=TEXT_PATH.name, results=rows)


def _dtype_name(llm) -> str:
    """The dtype an engine's weights are kept in, "float32" or "bfloat16" (what "auto" became),
    and "float32+bf16 products" where its products of many rows are bfloat16's."""
    name = str(llm.llm_engine.dtype).removeprefix("torch.")
    return f"{name}+bf16 products" if llm.llm_engine.setup.bf16_rows else name


def format_accuracy(report: dict) -> str:
    lines = [f"{'dtype':>22} {'quantization':>12} {'kv':>8} {'perplexity':>10} {'change':>8} {'mean KL':>9} "
             f"{'top-1':>7}"]
    for r in report["results"]:
        change = f"{r.get('perplexity_change', 0) * 100:+.2f}%"
        lines.append(f"{r.get('dtype', 'float32'):>22} {str(r['quantization']):>12} {r['kv_cache_dtype']:>8} "
                     f"{r['perplexity']:10.3f} "
                     f"{change:>8} {r['mean_kl']:9.5f} {r['top1_agreement'] * 100:6.1f}%")
    return "\n".join(lines)


def add_accuracy_args(p) -> None:
    g = p.add_argument_group("accuracy (workload accuracy)")
    g.add_argument("--quantization-list", nargs="+", default=["none", "int8", "int4"],
                   help="weight formats to compare with float (none, int8, int4)")
    g.add_argument("--kv-cache-dtypes", nargs="+", default=["auto", "int8"], help="auto, int8, fp8")
    g.add_argument("--dtypes", nargs="+", default=None,
                   help="dtypes to compare (auto, float32, bfloat16, float16), the first the reference "
                        "(default: --dtype alone)")
    g.add_argument("--window", type=int, default=512, help="tokens per perplexity window (default 512)")
    g.add_argument("--max-text-tokens", type=int, default=None, help="score only this many tokens of the text")
    g.add_argument("--kl-tokens", type=int, default=512, help="positions the KL divergence averages over")
    g.add_argument("--num-chat", type=int, default=8, help="chat prompts for top-1 agreement (default 8)")
    g.add_argument("--chat-tokens", type=int, default=32, help="greedy answer tokens per chat prompt")


def run_accuracy_command(args, engine_args: dict) -> int:
    engine_args = {k: v for k, v in engine_args.items()
                   if k not in ("quantization", "kv_cache_dtype", "quantization_group_size")}
    dtypes = args.dtypes or [engine_args.get("dtype", "auto")]
    engine_args.pop("dtype", None)
    report = run_accuracy(
        args.model, [None if q == "none" else q for q in args.quantization_list], args.kv_cache_dtypes,
        group_size=getattr(args, "quantization_group_size", None), window=args.window,
        max_text_tokens=args.max_text_tokens, kl_tokens=args.kl_tokens, num_chat=args.num_chat,
        chat_tokens=args.chat_tokens, progress=args.progress, dtypes=dtypes, **engine_args)
    print(format_accuracy(report))
    if args.json_path:
        Path(args.json_path).write_text(json.dumps(report, indent=2))
    return 0
