"""The one timing helper every measurement uses: the bench's kernel and limit timings, and each
phase's tools (`phases/pNN_*/tools/`).

    elapsed(fn)                          # seconds of one call
    times(fn, repeat=7)                  # seconds of `repeat` calls, after one untimed call
    best(times(fn)), median(times(fn))   # what to report: the fastest run is the least disturbed
                                         # (noise only adds time); a median for interleaved steps

On a GPU a call only queues work: pass `sync=torch.cuda.synchronize` so the clock waits for it.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable


def elapsed(fn: Callable[[], object], sync: Callable[[], object] | None = None) -> float:
    """Seconds one call of `fn` takes (after `sync`, before and after, where given)."""
    if sync is not None:
        sync()
    start = time.perf_counter()
    fn()
    if sync is not None:
        sync()
    return time.perf_counter() - start


def times(fn: Callable[[], object], repeat: int = 7, warmup: int = 1,
          sync: Callable[[], object] | None = None) -> list[float]:
    """Seconds of each of `repeat` calls of `fn`, after `warmup` untimed ones."""
    for _ in range(warmup):
        fn()
    return [elapsed(fn, sync) for _ in range(repeat)]


def best(samples: list[float]) -> float:
    return min(samples)


def median(samples: list[float]) -> float:
    return statistics.median(samples)
