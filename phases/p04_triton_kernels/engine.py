"""Phase 4 engine (scaffold, being built): phase 3's engine, unchanged so far."""

from __future__ import annotations

from phases.p03_continuous_batching import Engine as Phase3Engine


class Engine(Phase3Engine):
    phase = 4
