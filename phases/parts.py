"""Which phase provides which part of the engine, read from the code.

An engine is a fixed loop (phase 3's `step`: schedule, run the model, sample, update the
requests, outputs), and each part it calls is made by a factory hook on the engine. A phase
changes the engine by overriding hooks; `parts_table()` finds, for every registered phase, the
phase whose class defines each hook (the first in its method resolution order), so the table in
docs/architecture.md cannot drift from the code (tests/test_architecture.py compares them).

    python -m phases.parts      # print the table
"""

from __future__ import annotations

import phases

# part: the engine hook that makes it
PARTS: dict[str, str] = {
    "model": "make_model",
    "sampler": "make_sampler",
    "KV cache": "make_kv_cache",
    "block allocator": "make_allocator",
    "model runner": "make_model_runner",
    "attention backend": "make_attention",
    "scheduler": "make_scheduler",
    "proposer (drafts)": "make_proposer",
    "decode runner": "make_decode_runner",
}


def provider(phase: int, hook: str) -> int | None:
    """The phase whose engine class defines `hook` for phase `phase`'s engine (None: none)."""
    for cls in phases.get_engine_class(phase).__mro__:
        if hook in vars(cls):
            return getattr(cls, "phase", None)
    return None


def parts_table() -> str:
    """A markdown table: a row per part, a column per phase, each cell the phase providing it."""
    numbers = sorted(phases.PHASES)
    lines = ["| part | hook | " + " | ".join(f"phase {p}" for p in numbers) + " |",
             "| --- | --- | " + " | ".join("---" for _ in numbers) + " |"]
    for part, hook in PARTS.items():
        cells = []
        for p in numbers:
            q = provider(p, hook)
            cells.append("" if q is None else (f"**{q}**" if q == p else str(q)))
        lines.append(f"| {part} | `{hook}` | " + " | ".join(cells) + " |")
    return "\n".join(lines)


if __name__ == "__main__":
    print(parts_table())
