"""A learner's copy of a phase stands in for the reference one (`tinyvllm learn`).

`use_workspace(folder)` makes `import phases.p02_paged_kv` load `folder/p02_paged_kv/` where the
learner has a copy of that phase, and the reference package everywhere else. Every importer gets
the same module, so phase 3 built on the learner's phase 2 runs the learner's allocator. A copied
package also looks in the reference folder for what the copy lacks (the phase's tests, tools/),
so `pytest phases/p02_paged_kv --workspace workspace` grades the learner's code with the
reference tests. The folder travels to subprocesses (server and interpreter tests) as
$TINYVLLM_WORKSPACE, which `phases/__init__.py` reads.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

ENV_VAR = "TINYVLLM_WORKSPACE"
REFERENCE = Path(__file__).resolve().parent


class WorkspaceFinder(importlib.abc.MetaPathFinder):
    """Finds `phases.pNN_name` in the workspace folder when the learner has a copy of it."""

    def __init__(self, folder: Path):
        self.folder = folder

    def find_spec(self, fullname, path=None, target=None):
        top, _, name = fullname.partition(".")
        if top != "phases" or not name or "." in name:
            return None  # only the phase packages themselves; their modules follow __path__
        copy = self.folder / name
        if not (copy / "__init__.py").is_file():
            return None
        return importlib.util.spec_from_file_location(
            fullname, copy / "__init__.py",
            submodule_search_locations=[str(copy), str(REFERENCE / name)])


def use_workspace(folder: str | os.PathLike) -> list[str]:
    """Import phases from `folder` where it holds a copy; returns the copied phases' package names.
    Call it before any phase is imported."""
    folder = Path(folder).resolve()
    if not folder.is_dir():
        raise FileNotFoundError(f"workspace {str(folder)!r} does not exist (tinyvllm learn start N makes it)")
    copies = sorted(p.name for p in folder.iterdir() if (p / "__init__.py").is_file()
                    and (REFERENCE / p.name).is_dir())
    imported = [n for n in copies if f"phases.{n}" in sys.modules]
    if imported:
        raise RuntimeError(f"use_workspace: {imported} were imported before the workspace was set")
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, WorkspaceFinder)]
    sys.meta_path.insert(0, WorkspaceFinder(folder))
    os.environ[ENV_VAR] = str(folder)
    return copies
