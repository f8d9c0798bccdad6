"""The line protocol every peer worker speaks (see `tinyvllm/entrypoints/bench/peers.py`).

Imported by the workers as a sibling module (a script's folder is first on its sys.path), so it
uses only the standard library. The protocol gets the process's stdout to itself: whatever the
engine prints (vLLM logs to stdout) is sent to stderr instead.
"""

import json
import os
import resource
import sys
import time

_out = None


def open_channel() -> None:
    """Keep stdout for the protocol; point file descriptor 1 (and sys.stdout) at stderr."""
    global _out
    _out = os.fdopen(os.dup(1), "w", buffering=1)
    os.dup2(2, 1)
    sys.stdout = sys.stderr


def send(**message) -> None:
    _out.write(json.dumps(message) + "\n")
    _out.flush()


def _hwm_bytes(pid: str) -> int:
    """A process's peak resident memory (VmHWM: kept per address space, so unlike ru_maxrss it
    does not start from the parent's when a process is forked and then exec'ed)."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def _descendants(pid: str) -> list[str]:
    kids = []
    try:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/children") as f:
                kids += f.read().split()
    except OSError:
        return []
    return kids + [d for k in kids for d in _descendants(k)]


def peak_memory_bytes() -> int:
    """The peak resident memory of this worker and of every process it started (vLLM runs its
    engine in others); off Linux, this process's ru_maxrss."""
    me = str(os.getpid())
    if not os.path.exists(f"/proc/{me}/status"):
        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    return sum(_hwm_bytes(p) for p in [me, *_descendants(me)])


def serve(load_s: float, info: dict, run_job) -> int:
    """Say ready, then answer each job line on stdin: `run_job(requests, sequential, t0, starts,
    times)` fills each request's start and token times (seconds since t0) and calls
    `send(tokens=k)` as tokens come."""
    send(ready={"load_s": load_s, **info})
    for line in sys.stdin:
        job = json.loads(line)
        reqs = job["requests"]
        starts, times = [0.0] * len(reqs), [[] for _ in reqs]
        run_job(reqs, job["sequential"], time.perf_counter(), starts, times)
        send(result={"start": starts, "times": times, "max_rss_bytes": peak_memory_bytes()})
    return 0
