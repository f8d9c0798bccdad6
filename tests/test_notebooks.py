"""Every guided notebook in notebooks/ runs from top to bottom without an error.

Each notebook is executed with nbclient in a temporary copy, so the committed file and its saved
outputs stay as they are. A cell that raises fails the test with the cell and its traceback.
They take minutes on a CPU (phase 1 recomputes everything), so they have their own marker:

    .venv/bin/python -m pytest -m notebooks

The selected notebooks start as soon as the session is collected (conftest.py), one at a time in
a background thread, each kernel with one thread for PyTorch (OMP_NUM_THREADS=1), and run beside
the other tests: on the 2-core machine CI runs on, those leave a core idle much of the time (small
matrices gain little from a second thread, and notebook 04's Triton interpreter uses one core
anyway). The notebook tests run after the others and collect the results; the tests that time
something wait for the notebooks to finish. The numbers a notebook prints are not checked here;
its committed outputs were executed alone, in full. So that the
suite stays within CI's time, the copy does less of the same work: each benchmark cell
(`run_bench`) runs one round without its warm-up, on at most 8 of its requests with at most 16 new
tokens each (`QUICK_BENCH`, a cell put first in the copy), and the cells that time a long run make a
shorter one (`QUICK_SOURCE`): the same code, less of it.
"""

from __future__ import annotations

import os
import shutil
import tempfile
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path

import pytest
from conftest import BACKGROUND_RUNS

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600
NOTEBOOK_WORKERS = 1   # kernels at once, beside the rest of the suite
# Run first in each copy: `run_bench` with repeat=1, no warm-up and a smaller workload, whatever
# the cell asks (the notebooks import it from the harness after this cell, so they get this one).
QUICK_BENCH = """\
import dataclasses as _dc  # put here by tests/test_notebooks.py: a smaller benchmark, one round
import tinyvllm.entrypoints.bench.harness as _harness
_run_bench = _harness.run_bench
def _quick_bench(workload, *args, **kwargs):
    requests = [_dc.replace(r, max_tokens=min(r.max_tokens, 16)) for r in workload.requests[:8]]
    return _run_bench(_dc.replace(workload, requests=requests), *args,
                      **{**kwargs, "repeat": 1, "warmup": False})
_harness.run_bench = _quick_bench
"""
# Source changed in the copy: {notebook: [(text, replacement)]}; each text must be found.
QUICK_SOURCE = {
    # phase 1 recomputing 48 tokens three times: 94 s (one thread: 25 s for one run)
    "01_naive_attention": [("num_runs = 3", "num_runs = 1"), ("max_tokens=48, ignore_eos=True", "max_tokens=16, ignore_eos=True")],
    "02_paged_kv": [("contexts, step_ms = [16, 256, 1024], []", "contexts, step_ms = [16, 256], []")],
    "03_continuous_batching": [("answer_lengths = [6, 40, 12, 30, 8, 24, 16, 36]",
                                "answer_lengths = [3, 20, 6, 15, 4, 12, 8, 18]"), ("n=16):", "n=6):")],
    # timing the verify pass three times, and 20,000 / 4,000 draws of the rejection sampler in Python
    "06_speculative_decoding": [("context=128, repeat=3", "context=128, repeat=1"), ("n = 20000", "n = 4000"),
                                ("passes = 4000", "passes = 800")],
}


def execute(path: Path, folder: Path, env: dict[str, str] | None = None) -> str | None:
    """Run a copy of the notebook in `folder` (its kernel with `env`, by default this process's
    environment); None, or the first error as 'name: value'."""
    import nbclient
    import nbformat

    folder.mkdir(parents=True, exist_ok=True)
    copy = folder / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    for text, replacement in QUICK_SOURCE.get(path.stem, []):
        cells = [c for c in nb.cells if c.cell_type == "code" and text in c.source]
        if len(cells) != 1:
            return f"{path.name}: QUICK_SOURCE expects {text!r} in exactly one code cell, found {len(cells)}"
        cells[0].source = cells[0].source.replace(text, replacement)
    nb.cells.insert(0, nbformat.v4.new_code_cell(QUICK_BENCH))
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(folder)}})
    try:
        client.execute(env={**(os.environ if env is None else env), "OMP_NUM_THREADS": "1"})
    except nbclient.exceptions.CellExecutionError as e:  # names the cell and its traceback
        return f"{path.name}: {e}"
    errors = [o for cell in nb.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    return f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}" if errors else None


def start_in_background(paths: list[Path]) -> dict[Path, Future]:
    """Start running `paths` (NOTEBOOK_WORKERS at a time, each in a temporary folder) and return
    at once: {path: a Future of its first error, or None}. A notebook that cannot run for want of
    the dev extras gets that as its error."""
    try:
        import nbclient  # noqa: F401
        import nbformat  # noqa: F401
    except ImportError:
        return {}   # the tests skip, with the reason
    root = Path(tempfile.mkdtemp(prefix="tinyvllm-notebooks-"))
    # the environment now, before any test changes it: a kernel started later must not get a
    # test's monkeypatched variables (a cache folder in a temporary directory, say)
    env = dict(os.environ)
    pool = ThreadPoolExecutor(NOTEBOOK_WORKERS, thread_name_prefix="notebook")
    runs = {p: pool.submit(execute, p, root / p.stem, env) for p in paths}
    pool.shutdown(wait=False)   # its threads end when the last notebook has run
    return runs


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, request):
    pytest.importorskip("nbformat", reason="notebooks need the dev extras: pip install -e '.[dev]'")
    pytest.importorskip("nbclient", reason="notebooks need the dev extras: pip install -e '.[dev]'")
    runs = request.config.stash.get(BACKGROUND_RUNS, {})
    run = runs.get(path) or start_in_background([path])[path]   # not started by the session: now
    error = run.result()
    assert error is None, error
