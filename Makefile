# The two commands of the README. Each does its own setup (scripts/setup.sh), reused after.
.PHONY: setup demo test test-fast

PY := .venv/bin/python

setup:
	@bash scripts/setup.sh

## demo: ask the default model a question through the newest phase, and print its speed
demo: setup
	@.venv/bin/tinyvllm chat --message "What is the capital of France?"

## test: the whole suite: the shared tests in tests/ and every phase's checkpoint in phases/
test: setup
	@$(PY) -m pytest

## test-fast: the inner loop: no default-model runs, speed checkpoints, notebooks, docs build,
## server or Triton interpreter
test-fast: setup
	@$(PY) -m pytest -m "not slow and not throughput and not notebooks and not docs and not server and not interpreter"
