"""Which phase provides which part of the engine, read from the recipes.

There is one engine loop (phase 1's `Engine.step`: schedule, run the model, sample, update the
requests, outputs), and each part it calls is built by a factory of the phase's recipe
(`Recipe`, phases/p01_naive_attention/parts.py). A phase's recipe is the one before with the
factories it replaces; `parts_table()` finds, for every registered phase, the phase whose module
defines each factory, so the table in docs/architecture.md cannot drift from the code
(tests/test_architecture.py compares them).

    python -m phases.parts_table      # print the table
"""

from __future__ import annotations

import phases

# part: what it does (the order a recipe builds them in)
PARTS: dict[str, str] = {
    "model_loader": "reads the checkpoint: all of it, or a rank's share",
    "model": "the network that runs (its CPU kernels, quantized, fused)",
    "kv_cache": "the pool of K/V blocks",
    "allocator": "hands out the pool's blocks",
    "attention": "the attention of one step, over the cache",
    "sampler": "the tokens, from the logits rows",
    "runner": "the plan as tensors, the model on them, the logits rows",
    "proposer": "draft tokens",
    "scheduler": "who runs each step; the requests after it",
    # not a part of `Parts`: what the caller holds instead of the engine, where a phase says
    "front_end": "what the caller holds: the engine, or a client of it in another process",
}


def provider(phase: int, part: str) -> int | None:
    """The phase whose recipe module defines the factory of `part` for phase `phase` (None: that
    phase's engine has no such part)."""
    factory = getattr(phases.get_recipe(phase), part)
    if factory is None:
        return None
    module = factory.__module__.split(".")
    return int(module[1][1:3]) if len(module) > 1 and module[1][:1] == "p" else None


def parts_table() -> str:
    """A markdown table: a row per part, a column per phase, each cell the phase providing it."""
    numbers = sorted(phases.PHASES)
    lines = ["| part | what it does | " + " | ".join(f"phase {p}" for p in numbers) + " |",
             "| --- | --- | " + " | ".join("---" for _ in numbers) + " |"]
    for part, what in PARTS.items():
        cells = []
        for p in numbers:
            q = provider(p, part)
            cells.append("" if q is None else (f"**{q}**" if q == p else str(q)))
        lines.append(f"| `{part}` | {what} | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(parts_table())
