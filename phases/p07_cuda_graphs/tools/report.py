"""The JSON report this phase's tools write: their command, the date, the machine, their rows."""

from __future__ import annotations

import json
import shlex
import sys
import time
from pathlib import Path

import torch

from tinyvllm.entrypoints.bench.machine import machine_info


def write_report(tool: str, argv: list[str] | None, rows: dict, path: str | None) -> dict:
    """The report of `python -m phases.p07_cuda_graphs.tools.<tool> <argv>` with `rows` (e.g.
    {"rows": [...]}), written to `path` when one is given; returned either way."""
    report = {"command": f"python -m phases.p07_cuda_graphs.tools.{tool} " + shlex.join(argv or sys.argv[1:]),
              "date": time.strftime("%Y-%m-%d"), "machine": machine_info(torch.device("cpu")), **rows}
    if path:
        Path(path).write_text(json.dumps(report, indent=1) + "\n")
    return report
