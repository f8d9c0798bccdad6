"""Benchmark workloads: the requests every engine of one run is given, made from a seed.

Three workloads, after the three questions people ask of an inference engine:

- `throughput`: many requests submitted at once, offline, as `LLM.generate` on a list does. How
  many output tokens per second can the engine produce? Prompts are chat conversations (the
  model's chat template around a question), `reuse` chat prompts whose answers copy the prompt,
  or random tokens; each request's `max_tokens` is
  drawn from a range, and `ignore_eos` holds it to exactly that many tokens.
- `latency`: one request alone (or several, each sent when the one before has finished). How long
  until its first token (TTFT), and how long for each token after that (TPOT)?
- `prefix`: requests that share a long system prompt, sent one after another. The first finds
  nothing cached (cold); the rest may reuse the shared prefix's KV (cached). Compare their TTFT,
  and read the prefix cache's hit rate.
- `offload`: many distinct long prefixes, cycled through `passes` times (default 2), one request
  after another: the first pass (cold) computes them, the later ones (cached) find them again, if
  anything kept them. With a
  KV pool that holds only a few, the prefix cache has evicted each before it comes back; an
  offload tier past the pool (phase 10) still has it.

Every request is a list of token ids, so every engine, ours or Hugging Face's, sees exactly the
same input. The same seed gives the same requests, on any machine.
"""

from __future__ import annotations

import random
from dataclasses import dataclass, field, replace

WORKLOADS = ("throughput", "latency", "prefix", "offload")
DATASETS = ("chat", "random", "reuse")

# What each workload uses when a flag is not given. Lengths are "N" or "LO-HI" (inclusive).
DEFAULTS: dict[str, dict] = {
    "throughput": dict(num_prompts=64, dataset="chat", input_len="128", output_len="32-128"),
    "latency": dict(num_prompts=1, dataset="random", input_len="128", output_len="128"),
    "prefix": dict(num_prompts=8, dataset="random", input_len="32", output_len="16", prefix_len=512),
    # num_prompts distinct prefixes, each sent `passes` times: passes * num_prompts requests
    "offload": dict(num_prompts=64, dataset="random", input_len="16", output_len="4", prefix_len=1000, passes=2),
}

# The questions of the `chat` dataset, each wrapped in the model's chat template. Varied in
# length on purpose, so prompts are not all the same size.
CHAT_QUESTIONS = (
    "What is the capital of France?",
    "Explain photosynthesis to a ten-year-old.",
    "Write a haiku about the sea.",
    "How do vaccines train the immune system?",
    "Give me three tips for writing clear code.",
    "What is the difference between weather and climate?",
    "Summarize the plot of Romeo and Juliet in two sentences.",
    "Why is the sky blue?",
    "How does a hash table work, and what makes lookups fast on average?",
    "Suggest a name for a small bakery that sells bread made with old grains.",
    "What are prime numbers? List the first ten.",
    "Translate 'good morning, how are you?' into Spanish and French.",
    "Describe how a bill becomes a law, step by step.",
    "What should I pack for a three-day hiking trip in the mountains in autumn?",
    "Explain recursion with an example in Python.",
    "What causes the seasons on Earth?",
    "Write a short, friendly email declining a meeting invitation.",
    "How do airplanes stay in the air?",
    "What is the Pythagorean theorem, and where is it used in everyday life?",
    "Compare cats and dogs as pets for a family living in a small apartment.",
    "Tell me a fun fact about octopuses.",
    "How do I make a cup of green tea properly?",
    "What is inflation, and why do central banks care about it?",
    "Give a simple explanation of how the internet routes a message from one computer to another.",
    "What is a black hole?",
    "List five healthy breakfast ideas that take under ten minutes.",
    "How does a compiler differ from an interpreter?",
    "Write a limerick about a forgetful robot.",
    "Why do leaves change color in the fall?",
    "Explain what a neural network is, without using any math.",
    "What were the main causes of the French Revolution?",
    "How can I improve my sleep?",
)

# The `reuse` dataset (speculative decoding's case): chat prompts whose answers copy much of
# the prompt: edit a piece of code, reformat records, extract lines. Made from the seed.
_NAMES = ("alice", "bruno", "chen", "dana", "emeka", "fatima", "goran", "hana", "ivan", "julia")
_CITIES = ("Paris", "Lagos", "Osaka", "Lima", "Oslo", "Cairo", "Quito", "Perth", "Delhi", "Turin")


def reuse_prompt(rng: random.Random, kind: int) -> str:
    """One seeded task whose answer repeats most of its prompt: kind 0 edits a function, 1
    reformats records, 2 extracts lines. Eight items each, so that the part of the answer that
    copies is longer than the bench's usual 64 new tokens. Records and lines come in a fenced
    block, the function without one: the default model copied more faithfully that way."""
    people = rng.sample(_NAMES, 8)
    if kind == 0:
        old, new = rng.sample(("total", "count", "result", "value", "acc"), 2)
        body = "\n".join(f"        {old} = {old} + item.{n}_score * {rng.randint(2, 9)}" for n in people)
        code = f"def summarize(items):\n    {old} = 0\n    for item in items:\n{body}\n    return {old}"
        return f"Rename the variable `{old}` to `{new}` in this Python function. Reply with the whole function only.\n\n{code}"
    rows = [(n, rng.randint(18, 80), rng.choice(_CITIES)) for n in people]
    if kind == 1:
        text = "\n".join(f"name={n}; age={a}; city={c}" for n, a, c in rows)
        return f"Reformat these records as CSV lines with the header name,age,city. Keep every record.\n\n```\n{text}\n```"
    text = "\n".join(f"{n.title()} ({a}) lives in {c} and writes to {n}@example.org." for n, a, c in rows)
    return f"Copy every line of this text that mentions an email address, unchanged, one per line.\n\n```\n{text}\n```"


# Warm-up runs cap every request at this many new tokens: enough to run prefill and a few
# decode steps (first-call allocations, thread pools, lazy imports) without a second full run.
WARMUP_MAX_TOKENS = 4


@dataclass(frozen=True, slots=True)
class BenchRequest:
    """One request of a workload: its prompt as token ids, and exactly how many tokens to make."""

    prompt_token_ids: tuple[int, ...]
    max_tokens: int


@dataclass(slots=True)
class Workload:
    """The requests of one benchmark, and how they are sent.

    `sequential`: each request is sent when the one before it has finished (latency, prefix), so
    its TTFT is its own, not time spent queueing behind the others. Otherwise all are sent at
    once (throughput).

    Every prompt starts with one *salt* token slot, filled per run by `for_run`: each run (the
    warm-up, each repeat) gets its own salt, so an engine with a prefix cache never finds a
    previous run's prompts in it, as if it were freshly started. Within a run, prompts that share
    a beginning still share it. The salt counts toward the prompt length.
    """

    name: str
    requests: list[BenchRequest]
    sequential: bool
    params: dict = field(default_factory=dict)
    salt_token_ids: tuple[int, ...] = ()  # the tokens salts are drawn from

    @property
    def num_requests(self) -> int:
        return len(self.requests)

    @property
    def num_output_tokens(self) -> int:
        return sum(r.max_tokens for r in self.requests)

    @property
    def num_prompt_tokens(self) -> int:
        return sum(len(r.prompt_token_ids) for r in self.requests)

    def describe(self) -> str:
        """The workload in words, as a run starts: `one request of 128 prompt tokens and 32 output
        tokens`, or how many requests, how they are sent, and their prompt and output lengths."""
        def span(values: list[int]) -> str:
            return str(values[0]) if min(values) == max(values) else f"{min(values)}-{max(values)}"

        prompts = [len(r.prompt_token_ids) for r in self.requests]
        outputs = [r.max_tokens for r in self.requests]
        if len(self.requests) == 1:
            return f"one request of {prompts[0]} prompt tokens and {outputs[0]} output tokens"
        how = "one after another" if self.sequential else "at once"
        return (f"{len(self.requests)} requests {how}, {span(prompts)} prompt tokens and {span(outputs)} output "
                f"tokens each ({sum(prompts)} and {sum(outputs)} in all)")

    @property
    def max_request_len(self) -> int:
        """The most tokens any one request holds at its end: prompt + max_tokens."""
        return max(len(r.prompt_token_ids) + r.max_tokens for r in self.requests)

    def salts(self, num_runs: int, seed: int) -> list[int]:
        """`num_runs` distinct salt tokens, the same for the same seed."""
        if num_runs > len(self.salt_token_ids):
            raise ValueError(f"repeat: at most {len(self.salt_token_ids) - 1} runs fit this vocabulary")
        return random.Random(f"salt-{seed}").sample(self.salt_token_ids, num_runs)

    def for_run(self, salt: int, max_tokens_cap: int | None = None) -> Workload:
        """The requests of one run: the salt in each prompt's first slot, and optionally every
        max_tokens capped (for the warm-up)."""
        reqs = [BenchRequest((salt,) + r.prompt_token_ids[1:],
                             r.max_tokens if max_tokens_cap is None else min(r.max_tokens, max_tokens_cap))
                for r in self.requests]
        return replace(self, requests=reqs)


def parse_len_range(flag: str, value: str | int) -> tuple[int, int]:
    """'N' or 'LO-HI' -> (lo, hi), both >= 1. `flag` names the option in errors."""
    text = str(value).strip()
    try:
        lo, _, hi = text.partition("-")
        lo, hi = int(lo), int(hi or lo)
    except ValueError:
        raise ValueError(f"{flag} must be a length N or a range LO-HI, like 64 or 32-128; got {value!r}") from None
    if lo < 1 or hi < lo:
        raise ValueError(f"{flag} must be >= 1, with LO <= HI in LO-HI; got {value!r}")
    return lo, hi


def usable_token_ids(vocab_size: int, special_ids: list[int]) -> list[int]:
    """Token ids for random prompts and salts: the vocabulary less its special tokens (a stray
    end-of-turn token in a prompt would make it read like a different conversation)."""
    special = set(special_ids)
    ids = [t for t in range(vocab_size) if t not in special]
    if len(ids) < 2:
        raise ValueError("model: its vocabulary has fewer than two ordinary tokens")
    return ids


def make_workload(name: str, tokenizer, vocab_size: int, *, num_prompts: int | None = None,
                  dataset: str | None = None, input_len: str | int | None = None,
                  output_len: str | int | None = None, prefix_len: int | None = None,
                  passes: int | None = None, seed: int = 0) -> Workload:
    """Build a workload's requests from the seed. Arguments left None take `DEFAULTS[name]`.

    `tokenizer` is a `tinyvllm.tokenizer.Tokenizer` (for the chat template and special tokens).
    `input_len` is the prompt length for `random` prompts (for `prefix`: the part after the
    shared prefix); `output_len` the range max_tokens is drawn from.
    """
    if name not in WORKLOADS:
        raise ValueError(f"workload must be one of {', '.join(WORKLOADS)}; got {name!r}")
    d = DEFAULTS[name]
    if dataset is not None and dataset not in DATASETS:
        raise ValueError(f"--dataset must be one of {', '.join(DATASETS)}; got {dataset!r}")
    if name in ("prefix", "offload") and dataset in ("chat", "reuse"):
        raise ValueError(f"--dataset: the {name} workload uses random tokens (random prefixes)")
    if dataset in ("chat", "reuse") and input_len is not None:
        raise ValueError(f"--input-len applies to --dataset random; {dataset} prompts have their own lengths")
    if prefix_len is not None and name not in ("prefix", "offload"):
        raise ValueError("--prefix-len applies to the prefix and offload workloads only")
    if passes is not None and name != "offload":
        raise ValueError("--passes applies to the offload workload only")
    if name == "offload":
        passes = d["passes"] if passes is None else passes
        if isinstance(passes, bool) or not isinstance(passes, int) or passes < 2:
            raise ValueError(f"--passes must be an integer >= 2 (one cold, the rest cached); got {passes!r}")
    num_prompts = d["num_prompts"] if num_prompts is None else num_prompts
    if isinstance(num_prompts, bool) or not isinstance(num_prompts, int) or num_prompts < 1:
        raise ValueError(f"--num-prompts must be an integer >= 1; got {num_prompts!r}")
    if name == "prefix" and num_prompts < 2:
        raise ValueError("--num-prompts must be >= 2 for the prefix workload (one cold, the rest cached)")
    dataset = dataset or d["dataset"]
    in_lo, in_hi = parse_len_range("--input-len", d["input_len"] if input_len is None else input_len)
    out_lo, out_hi = parse_len_range("--output-len", d["output_len"] if output_len is None else output_len)
    if name in ("prefix", "offload"):
        prefix_len = d["prefix_len"] if prefix_len is None else prefix_len
        if isinstance(prefix_len, bool) or not isinstance(prefix_len, int) or prefix_len < 1:
            raise ValueError(f"--prefix-len must be an integer >= 1; got {prefix_len!r}")

    rng = random.Random(seed)
    vocab = usable_token_ids(vocab_size, tokenizer.all_special_ids)

    def random_tokens(n: int) -> tuple[int, ...]:
        return tuple(rng.choice(vocab) for _ in range(n))

    requests: list[BenchRequest] = []
    if name == "prefix":
        # the salt slot, then prefix_len - 1 shared tokens; the salt is part of the shared prefix
        shared = (vocab[0],) + random_tokens(prefix_len - 1)
        for _ in range(num_prompts):
            suffix = random_tokens(rng.randint(in_lo, in_hi))
            requests.append(BenchRequest(shared + suffix, rng.randint(out_lo, out_hi)))
    elif name == "offload":
        # each prefix: the salt slot, then prefix_len - 1 tokens of its own; sent once per pass,
        # each time with a suffix of its own, every prefix of a pass before the next pass
        prefixes = [(vocab[0],) + random_tokens(prefix_len - 1) for _ in range(num_prompts)]
        for _ in range(passes):
            for prefix in prefixes:
                suffix = random_tokens(rng.randint(in_lo, in_hi))
                requests.append(BenchRequest(prefix + suffix, rng.randint(out_lo, out_hi)))
    elif dataset in ("chat", "reuse"):
        for i in range(num_prompts):
            question = rng.choice(CHAT_QUESTIONS) if dataset == "chat" else reuse_prompt(rng, i % 3)
            text = tokenizer.apply_chat_template([{"role": "user", "content": question}],
                                                 add_generation_prompt=True)
            ids = tokenizer.encode(text, add_special_tokens=False)
            requests.append(BenchRequest((vocab[0],) + tuple(ids), rng.randint(out_lo, out_hi)))
    else:
        for _ in range(num_prompts):
            n = rng.randint(in_lo, in_hi)
            requests.append(BenchRequest((vocab[0],) + random_tokens(n - 1), rng.randint(out_lo, out_hi)))

    params = dict(num_prompts=num_prompts, dataset=dataset, output_len=[out_lo, out_hi], seed=seed,
                  ignore_eos=True, temperature=0.0)
    if dataset == "random":
        params["input_len"] = [in_lo, in_hi]
    if name in ("prefix", "offload"):
        params["prefix_len"] = prefix_len
    if name == "offload":
        params["passes"] = passes
    sequential = name in ("latency", "prefix", "offload")
    params["submission"] = "one after another" if sequential else "all at once"
    return Workload(name, requests, sequential, params, tuple(vocab))
