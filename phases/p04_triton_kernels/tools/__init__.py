"""Measurement and checking tools for this phase: run as `python -m phases.<phase>.tools.<name>`; not part of the engine."""
