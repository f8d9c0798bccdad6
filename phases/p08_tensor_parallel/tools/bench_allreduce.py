"""What one all-reduce costs between two ranks of this machine, at the sizes a decode step sends.

A tensor-parallel step of the default model all-reduces a (B, 576) float32 hidden state 61 times
(twice in each of 30 layers, once after the embedding), B the batch. This starts a second rank
(the same worker mechanism as the engine: a process, a file store in a private directory, a gloo
group on loopback), then times all-reduces of (B, hidden) for each B: the best of `--repeat` runs
of `--iters` each.

    python -m phases.p08_tensor_parallel.tools.bench_allreduce --batch 1 8 32 64 --json OUT.json

Each row: batch, bytes sent by one all-reduce, microseconds per all-reduce, and milliseconds per
step (61 of them). The tensor's size barely matters at these sizes: the time is the round trip.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import secrets
import shutil
import subprocess
import sys
import tempfile
import time

import torch

from phases.p08_tensor_parallel.parallel import RUN_ID_BYTES, TensorParallelGroup, open_store, take_token
from phases.p08_tensor_parallel.worker import worker_env
from tinyvllm.entrypoints.bench.machine import machine_info

ALL_REDUCES_PER_STEP = 61   # the default model: 2 in each of 30 layers, 1 after the embedding


def run_rank(rank: int, store_path: str, token: bytes, run_id: bytes, hidden: int, batches: list[int], iters: int,
             repeat: int) -> list[dict]:
    torch.set_num_threads(1)
    group = TensorParallelGroup(rank, 2)
    group.connect(open_store("file:" + store_path, 2, is_master=rank == 0), token, run_id)
    rows = []
    for b in batches:
        x = torch.randn(b, hidden)
        best = float("inf")
        for _ in range(repeat):
            group.all_reduce(x)              # both ranks start together
            t0 = time.perf_counter()
            for _ in range(iters):
                group.all_reduce(x)
            best = min(best, (time.perf_counter() - t0) / iters)
        rows.append({"batch": b, "bytes": x.numel() * x.element_size(), "allreduce_us": round(best * 1e6, 1),
                     "per_step_ms": round(best * ALL_REDUCES_PER_STEP * 1e3, 2)})
    return rows


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--batch", type=int, nargs="+", default=[1, 8, 32, 64])
    ap.add_argument("--hidden", type=int, default=576)
    ap.add_argument("--iters", type=int, default=200)
    ap.add_argument("--repeat", type=int, default=5)
    ap.add_argument("--json", default=None)
    ap.add_argument("--rank", type=int, default=0, help=argparse.SUPPRESS)
    ap.add_argument("--store", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--run-id", default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.rank == 1:
        run_rank(1, args.store, take_token(), bytes.fromhex(args.run_id), args.hidden, args.batch, args.iters,
                 args.repeat)
        return
    directory, token = tempfile.mkdtemp(prefix="tinyvllm-tp-"), secrets.token_bytes(32)
    run_id = secrets.token_bytes(RUN_ID_BYTES)
    store_path = os.path.join(directory, "store")
    try:
        peer = subprocess.Popen([sys.executable, "-m", "phases.p08_tensor_parallel.tools.bench_allreduce",
                                 "--rank", "1", "--store", store_path, "--run-id", run_id.hex(),
                                 "--hidden", str(args.hidden),
                                 "--iters", str(args.iters), "--repeat", str(args.repeat),
                                 "--batch", *map(str, args.batch)], env=worker_env(token))
        rows = run_rank(0, store_path, token, run_id, args.hidden, args.batch, args.iters, args.repeat)
        peer.wait()
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    for r in rows:
        print(f"batch {r['batch']:4d}  {r['bytes']:8d} bytes  {r['allreduce_us']:8.1f} us  "
              f"{r['per_step_ms']:6.2f} ms a step")
    if args.json:
        report = {"command": "python -m phases.p08_tensor_parallel.tools.bench_allreduce " + " ".join(argv or sys.argv[1:]),
                  "date": datetime.date.today().isoformat(), "machine": machine_info(torch.device("cpu")),
                  "backend": "gloo", "ranks": 2, "rows": rows}
        with open(args.json, "w") as f:
            json.dump(report, f, indent=2)
            f.write("\n")


if __name__ == "__main__":
    main()
