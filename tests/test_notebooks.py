"""Every guided notebook in notebooks/ runs from top to bottom without an error.

Each notebook is executed with nbclient in a temporary copy, so the committed file and its saved
outputs stay as they are. A cell that raises fails the test with the cell and its traceback.
They take minutes on a CPU (phase 1 recomputes everything), so they have their own marker:

    .venv/bin/python -m pytest -m notebooks

The selected notebooks run NOTEBOOK_WORKERS at a time, each kernel with one thread for PyTorch
(OMP_NUM_THREADS=1): on the 2-core machine CI runs on, two one-thread kernels finish the eight
notebooks sooner than one two-thread kernel after another (small matrices gain little from a
second thread, and notebook 04's Triton interpreter uses one core anyway). The numbers a notebook
prints are not checked here; its committed outputs were executed alone, in full. So that the
suite stays within CI's time, each benchmark cell (`run_bench`) runs one round without its
warm-up here (`QUICK_BENCH`, a cell put first in the copy): the same code, fewer repeats.
"""

from __future__ import annotations

import os
import shutil
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
NOTEBOOK_WORKERS = 2
# Started first, so the short ones fill the other worker: alone, on the idle 2-core machine
# (pytest --durations, 2026-11-23), these took 130, 115 and 101 s; the other five 8 to 35 s each.
LONGEST_FIRST = ("03_continuous_batching", "01_naive_attention", "02_paged_kv")
# Run first in each copy: `run_bench` with repeat=1 and no warm-up, whatever the cell asks (the
# notebooks import it from the harness after this cell, so they get this one).
QUICK_BENCH = """\
import tinyvllm.bench.harness as _harness  # put here by tests/test_notebooks.py: one round per benchmark
_run_bench = _harness.run_bench
_harness.run_bench = lambda *args, **kwargs: _run_bench(*args, **{**kwargs, "repeat": 1, "warmup": False})
"""


def execute(path: Path, folder: Path) -> str | None:
    """Run a copy of the notebook in `folder`; None, or the first error as 'name: value'."""
    import nbclient
    import nbformat

    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    nb.cells.insert(0, nbformat.v4.new_code_cell(QUICK_BENCH))
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
    try:
        client.execute(env={**os.environ, "OMP_NUM_THREADS": "1"})
    except nbclient.exceptions.CellExecutionError as e:  # names the cell and its traceback
        return f"{path.name}: {e}"
    errors = [o for cell in nb.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    return f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}" if errors else None


@pytest.fixture(scope="module")
def executed(request, tmp_path_factory) -> dict:
    """Every notebook this session selected, run NOTEBOOK_WORKERS at a time: {path: error}."""
    pytest.importorskip("nbformat", reason="notebooks need the dev extras: pip install -e '.[dev]'")
    pytest.importorskip("nbclient", reason="notebooks need the dev extras: pip install -e '.[dev]'")
    chosen = [item.callspec.params["path"] for item in request.session.items
              if getattr(item, "originalname", None) == "test_notebook_executes"]
    chosen.sort(key=lambda p: LONGEST_FIRST.index(p.stem) if p.stem in LONGEST_FIRST else len(LONGEST_FIRST))
    root = tmp_path_factory.mktemp("notebooks")
    with ThreadPoolExecutor(NOTEBOOK_WORKERS) as pool:
        errors = pool.map(lambda p: execute(p, root / p.stem), chosen)
        return dict(zip(chosen, errors))


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, executed: dict):
    assert executed[path] is None, executed[path]
