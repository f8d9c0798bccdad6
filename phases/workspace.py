"""A learner's copy of a phase stands in for the reference one (`tinyvllm learn`).

`use_workspace(folder)` makes `import phases.p02_paged_kv` load `folder/p02_paged_kv/` where the
learner has a copy of that phase, and the reference package everywhere else. Every importer gets
the same module, so phase 3 built on the learner's phase 2 runs the learner's allocator. A copied
package also looks in the reference folder for what the copy lacks (the phase's tests, tools/),
so `pytest phases/p02_paged_kv --workspace workspace` grades the learner's code with the
reference tests. The folder travels to subprocesses (server and interpreter tests) as
$TINYVLLM_WORKSPACE, which `phases/__init__.py` reads.

A phase may teach a module of the foundation too (`FOUNDATION_COPIES`): phase 1 sets up the one
sampler every phase uses, so a copy of phase 1 holds `sampler.py` (and the C file it builds), and
while it is there `import tinyvllm.sampler` loads the learner's, as every phase built on the
learner's phase 1 runs the learner's engine loop.

The exercise markers are read here too (`regions`): `tinyvllm learn` blanks and grades what they
mark. While `tinyvllm learn check` grades a copy ($TINYVLLM_LEARN_HITS names a file), a task still
blank is *probed*: its body runs the reference's, after writing the task's name to that file. So a
check that needs three unwritten tasks names all three in one run (the learner's report lists
what each task waits on at once), and a written task is graded beside the others' reference
bodies instead of stopping at the first blank.
"""

from __future__ import annotations

import ast
import importlib.abc
import importlib.util
import os
import re
import sys
from pathlib import Path

ENV_VAR = "TINYVLLM_WORKSPACE"
HITS_ENV = "TINYVLLM_LEARN_HITS"   # set by tinyvllm learn check: probe blank tasks, note them here
REFERENCE = Path(__file__).resolve().parent
# phase package -> the foundation modules its copy holds (as <name>.py beside the phase's modules)
FOUNDATION_COPIES: dict[str, tuple[str, ...]] = {"p01_naive_attention": ("tinyvllm.sampler",)}
# foundation module -> the files beside it that it loads (its C kernel): they travel with it
FOUNDATION_DATA: dict[str, tuple[str, ...]] = {"tinyvllm.sampler": ("cpu_argmax.c",)}

START = re.compile(r"^(?P<indent>[ \t]*)# >>> exercise (?P<name>\w+) \((?P<stars>\d) stars?\): (?P<task>.+)$")
_HINT = re.compile(r"^[ \t]*# hint: (?P<hint>.+)$")
_CHECKS = re.compile(r"^[ \t]*# checked by: (?P<checks>.+)$")
# What a blank task raises; the grader finds the task's name in a failure by this pattern.
BLANK_RAISED = re.compile(r"exercise (\w+) is not written yet")


def regions(source: str) -> list[tuple[dict, int, int]]:
    """(fields, first line of the marker, line of the end marker) for every exercise in `source`,
    0-based. The fields are the marker's name, stars, task, hint, checks and indent."""
    lines = source.splitlines()
    found = []
    for i, line in enumerate(lines):
        m = START.match(line)
        if not m:
            continue
        hint = _HINT.match(lines[i + 1]) if i + 1 < len(lines) else None
        checks = _CHECKS.match(lines[i + 2]) if i + 2 < len(lines) else None
        if not (hint and checks):
            raise ValueError(f"exercise {m['name']}: the marker needs '# hint:' and '# checked by:' lines after it")
        end = next((j for j in range(i + 3, len(lines))
                    if lines[j].strip() == f"# <<< exercise {m['name']}"), None)
        if end is None:
            raise ValueError(f"exercise {m['name']}: no '# <<< exercise {m['name']}' line closes it")
        found.append((dict(m.groupdict(), hint=hint["hint"], checks=checks["checks"]), i, end))
    return found


def is_blank(body: list[str]) -> bool:
    """The body `tinyvllm learn start` wrote: one raise naming the task."""
    return len(body) == 1 and bool(BLANK_RAISED.search(body[0]))


def foundation_files(package: str) -> list[Path]:
    """The reference files of the foundation modules that a copy of phase `package` holds, and the
    files they load."""
    files = []
    for module in FOUNDATION_COPIES.get(package, ()):
        path = REFERENCE.parent / (module.replace(".", "/") + ".py")
        files += [path] + [path.with_name(name) for name in FOUNDATION_DATA.get(module, ())]
    return files


# -- probing the blank tasks while a copy is graded --------------------------------------------------

def blank_hit(name: str) -> None:
    """A probed blank task ran (its reference body follows): note its name for the grader."""
    path = os.environ.get(HITS_ENV)
    if path:
        with open(path, "a") as f:
            f.write(name + "\n")


def _statements_in(tree: ast.Module, first: int, last: int) -> list[ast.stmt]:
    """The statements of `tree` from line `first` to `last` (1-based) in one block, outermost first."""
    for node in ast.walk(tree):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if isinstance(block, list):
                inside = [s for s in block if isinstance(s, ast.stmt) and first <= s.lineno and s.end_lineno <= last]
                if inside:
                    return inside
    return []


def probed(source: str, reference: str) -> ast.Module:
    """`source` (a learner's module) parsed, with each blank task's raise replaced by a note of the
    task (`blank_hit`) and the reference's body, whose lines all point at the raise's line."""
    tree = ast.parse(source)
    bodies = {f["name"]: (i, end) for f, i, end in regions(reference)}
    lines = source.splitlines()
    ref = ast.parse(reference)
    for f, i, end in regions(source):
        if f["name"] not in bodies or not is_blank(lines[i + 3:end]):
            continue
        line = i + 4                                           # the raise, 1-based
        ref_first, ref_end = bodies[f["name"]]
        body = [ast.parse(f"__import__('phases.workspace').workspace.blank_hit({f['name']!r})").body[0],
                *_statements_in(ref, ref_first + 4, ref_end)]
        for stmt in body:
            for node in ast.walk(stmt):
                if "lineno" in node._attributes:
                    node.lineno = node.end_lineno = line
        for node in ast.walk(tree):
            for field in ("body", "orelse", "finalbody"):
                block = getattr(node, field, None)
                if isinstance(block, list):
                    for k, stmt in enumerate(block):
                        if isinstance(stmt, ast.Raise) and stmt.lineno == line:
                            block[k:k + 1] = body
    return tree


class ProbingLoader(importlib.abc.SourceLoader):
    """Loads a learner's module whose blank tasks run the reference bodies (`probed`). No bytecode
    is read or written for it: what runs depends on the reference too."""

    def __init__(self, path: Path, reference: Path):
        self.path, self.reference = path, reference

    def get_filename(self, fullname):
        return str(self.path)

    def get_data(self, path):
        return Path(path).read_bytes()

    def source_to_code(self, data, path, *, _optimize=-1):
        return compile(probed(data.decode(), self.reference.read_text()), path, "exec", dont_inherit=True)


def _spec(fullname: str, path: Path, reference: Path, **kwargs):
    """A module's spec; with $TINYVLLM_LEARN_HITS set and a blank task in it, a probing one."""
    if (os.environ.get(HITS_ENV) and path.suffix == ".py" and reference.is_file()
            and BLANK_RAISED.search(path.read_text())):
        return importlib.util.spec_from_file_location(fullname, path, loader=ProbingLoader(path, reference), **kwargs)
    return importlib.util.spec_from_file_location(fullname, path, **kwargs)


class WorkspaceFinder(importlib.abc.MetaPathFinder):
    """Finds `phases.pNN_name` (and its modules) in the workspace folder when the learner has a
    copy of it."""

    def __init__(self, folder: Path, modules: dict[str, Path] | None = None):
        self.folder = folder
        self.modules = modules or {}  # a foundation module -> the learner's copy of it

    def find_spec(self, fullname, path=None, target=None):
        if fullname in self.modules:
            reference = REFERENCE.parent / (fullname.replace(".", "/") + ".py")
            return _spec(fullname, self.modules[fullname], reference)
        top, _, name = fullname.partition(".")
        package, _, module = name.partition(".")
        if top != "phases" or not package or not (self.folder / package / "__init__.py").is_file():
            return None
        copy = self.folder / package
        if not module:
            return importlib.util.spec_from_file_location(
                fullname, copy / "__init__.py", submodule_search_locations=[str(copy), str(REFERENCE / package)])
        if "." in module or not (copy / f"{module}.py").is_file():
            return None  # tools/, tests: the reference's, found through __path__
        return _spec(fullname, copy / f"{module}.py", REFERENCE / package / f"{module}.py")


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
