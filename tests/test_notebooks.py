"""Every guided notebook in notebooks/ runs from top to bottom without an error.

Each notebook is executed with nbclient in a temporary copy, so the committed file and its saved
outputs stay as they are. A cell that raises fails the test with the cell and its traceback.
They take minutes on a CPU (phase 1 recomputes everything), so they have their own marker:

    .venv/bin/python -m pytest -m notebooks
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pytest

NOTEBOOK_DIR = Path(__file__).resolve().parent.parent / "notebooks"
NOTEBOOKS = sorted(NOTEBOOK_DIR.glob("*.ipynb"))
CELL_TIMEOUT_S = 600


@pytest.mark.notebooks
@pytest.mark.slow
@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path: Path, tmp_path: Path):
    nbformat = pytest.importorskip("nbformat", reason="notebooks need the dev extras: pip install -e '.[dev]'")
    nbclient = pytest.importorskip("nbclient", reason="notebooks need the dev extras: pip install -e '.[dev]'")
    copy = tmp_path / path.name
    shutil.copy(path, copy)
    nb = nbformat.read(copy, as_version=4)
    client = nbclient.NotebookClient(nb, timeout=CELL_TIMEOUT_S, kernel_name="python3",
                                     resources={"metadata": {"path": str(tmp_path)}})
    client.execute()  # raises CellExecutionError, naming the cell, on the first error
    errors = [o for cell in nb.cells if cell.cell_type == "code"
              for o in cell.get("outputs", []) if o.get("output_type") == "error"]
    assert not errors, f"{path.name}: {errors[0]['ename']}: {errors[0]['evalue']}"
