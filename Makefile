# The two commands of the README. Each does its own setup (scripts/setup.sh), reused after.
.PHONY: setup demo test test-fast test-kinds learn learn-check

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

## test-kinds: the tests of every path the platform chooses by CPU kind (marker `kinds`), once for each
## kind this CPU can act as (TINYVLLM_CPU_KIND: amx contains avx512_vnni contains avx2; "other" has
## no hand-written kernels), so one machine checks every kind's paths; KINDS="avx2 other" picks some.
## The kinds run at once (mostly one-thread work: three took 68 s together, 164 one after another on
## 2 cores), each into its own log, printed when all have ended; each collects only the test files
## that name the marker (the three, collecting the whole suite: 83 s; only those files: 70 s)
test-kinds: setup
	@kinds="$(KINDS)"; [ -n "$$kinds" ] || kinds=$$($(PY) -m tinyvllm.platform --acting-kinds); \
	logs=$$(mktemp -d); \
	files=$$(grep -l kinds -r tests phases --include='test_*.py'); \
	for kind in $$kinds; do \
	  TINYVLLM_CPU_KIND=$$kind $(PY) -m pytest -q -m "kinds and not slow" -p no:cacheprovider $$files \
	    > $$logs/$$kind.log 2>&1 && echo ok > $$logs/$$kind.rc & \
	done; wait; failed=; \
	for kind in $$kinds; do \
	  echo "== TINYVLLM_CPU_KIND=$$kind: the kind-keyed tests"; cat $$logs/$$kind.log; \
	  [ -f $$logs/$$kind.rc ] || failed="$$failed $$kind"; \
	done; rm -rf $$logs; \
	if [ -n "$$failed" ]; then echo "the kind-keyed tests failed as:$$failed"; exit 1; fi

## learn: copy phase PHASE into workspace/ with its key functions left to write (tinyvllm learn start)
learn: setup
	@test -n "$(PHASE)" || { echo "usage: make learn PHASE=2"; exit 2; }
	@.venv/bin/tinyvllm learn start $(PHASE)

## learn-check: grade workspace/'s copy of phase PHASE, task by task (tinyvllm learn check)
learn-check: setup
	@test -n "$(PHASE)" || { echo "usage: make learn-check PHASE=2"; exit 2; }
	@.venv/bin/tinyvllm learn check $(PHASE)
