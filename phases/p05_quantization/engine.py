"""Phase 5 engine (scaffold, being built): phase 4's engine, unchanged so far."""

from __future__ import annotations

from phases.p04_triton_kernels import Engine as Phase4Engine


class Engine(Phase4Engine):
    phase = 5
