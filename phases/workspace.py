"""A learner's copy of a phase stands in for the reference one (`tinyvllm learn`).

`use_workspace(folder)` makes `import phases.p02_paged_kv` load `folder/p02_paged_kv/` where the
learner has a copy of that phase, and the reference package everywhere else. Every importer gets
the same module, so phase 3 built on the learner's phase 2 runs the learner's allocator. A copied
package also looks in the reference folder for what the copy lacks (the phase's tests, tools/),
so `pytest phases/p02_paged_kv --workspace workspace` grades the learner's code with the
reference tests. The folder travels to subprocesses (server and interpreter tests) as
$TINYVLLM_WORKSPACE, which `phases/__init__.py` reads.

A phase may teach a module of the foundation too (`FOUNDATION_COPIES`): phase 1 sets up the one
sampler every phase uses, so a copy of phase 1 holds `sampler.py`, and while it is there
`import tinyvllm.sampler` loads the learner's, as every phase built on the learner's phase 1
runs the learner's engine loop.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import os
import sys
from pathlib import Path

ENV_VAR = "TINYVLLM_WORKSPACE"
REFERENCE = Path(__file__).resolve().parent
# phase package -> the foundation modules its copy holds (as <name>.py beside the phase's modules)
FOUNDATION_COPIES: dict[str, tuple[str, ...]] = {"p01_naive_attention": ("tinyvllm.sampler",)}


def foundation_files(package: str) -> list[Path]:
    """The reference files of the foundation modules that a copy of phase `package` holds."""
    return [REFERENCE.parent / (module.replace(".", "/") + ".py") for module in FOUNDATION_COPIES.get(package, ())]


class WorkspaceFinder(importlib.abc.MetaPathFinder):
    """Finds `phases.pNN_name` in the workspace folder when the learner has a copy of it."""

    def __init__(self, folder: Path, modules: dict[str, Path] | None = None):
        self.folder = folder
        self.modules = modules or {}  # a foundation module -> the learner's copy of it

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.modules:
            return importlib.util.spec_from_file_location(fullname, self.modules[fullname])
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
    modules = {m: folder / c / (m.rpartition(".")[2] + ".py") for c in copies
               for m in FOUNDATION_COPIES.get(c, ())}
    modules = {m: path for m, path in modules.items() if path.is_file()}
    imported = [f"phases.{n}" for n in copies if f"phases.{n}" in sys.modules] + [m for m in modules if m in sys.modules]
    if imported:
        raise RuntimeError(f"use_workspace: {imported} were imported before the workspace was set")
    sys.meta_path[:] = [f for f in sys.meta_path if not isinstance(f, WorkspaceFinder)]
    sys.meta_path.insert(0, WorkspaceFinder(folder, modules))
    os.environ[ENV_VAR] = str(folder)
    return copies
