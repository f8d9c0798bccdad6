"""Phase 6 engine (scaffold, being built): phase 5's engine, unchanged so far."""

from __future__ import annotations

from phases.p05_quantization import Engine as Phase5Engine


class Engine(Phase5Engine):
    phase = 6
