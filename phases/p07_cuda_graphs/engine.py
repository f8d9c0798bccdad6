"""Phase 7 engine (scaffold, being built): phase 6's engine, unchanged so far."""

from __future__ import annotations

from phases.p06_speculative_decoding import Engine as Phase6Engine


class Engine(Phase6Engine):
    phase = 7
