"""The layers import in one direction, read from the source (and, for the foundation, at run time):

    front door (tinyvllm.entrypoints: LLM, the CLI, the server, the bench) -> phases -> foundation (tinyvllm.*)

- the foundation never imports `phases` nor the front door (and, run in a fresh process,
  importing it leaves no phase imported);
- phase N imports only phases before it, never the front door (its measurement tools, in
  `phases/pNN_*/tools/`, may use the bench's helpers), and never a private name (one that starts
  with "_") of another phase;
- no two modules import each other, directly or through others (no cycles), counting the imports
  inside functions too;
- there is one engine: phase 1's `Engine` and its `step`, written once; every phase is a recipe
  of parts (`RECIPE`), and one decode step of the newest single-process phase reads as a short
  path through them (scripts/trace_step.py);
- every part each phase builds has what the engine asks of it (the Protocols of
  phases/p01_naive_attention/parts.py; these tests build the engines).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest
from conftest import phase_params

REPO = Path(__file__).resolve().parents[1]
FRONT_DOOR = ("tinyvllm.entrypoints",)
# `tinyvllm` itself (its __init__) is the public face, `from tinyvllm import LLM`: front-door level


def _front_door(module: str) -> bool:
    return module == "tinyvllm" or _is(module, FRONT_DOOR)


def _is_tool(module: str) -> bool:
    """A phase's measurement tools (phases/pNN_*/tools/): they may use the bench's helpers."""
    return ".tools." in module + "." and module.startswith("phases.")


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(REPO).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _modules() -> dict[str, Path]:
    files = [p for p in REPO.glob("tinyvllm/**/*.py")] + [p for p in REPO.glob("phases/**/*.py")]
    return {_module_name(p): p for p in files if not p.name.startswith("test_")}


def _from_module(node: ast.ImportFrom, package: str) -> str:
    """The absolute name of the module a `from ... import` reads (relative ones resolved)."""
    if not node.level:
        return node.module
    base = package.split(".")
    return ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else []))


def _imports(name: str, path: Path) -> list[tuple[str, list[str]]]:
    """(module imported, names taken from it) for every import in the file, functions included."""
    tree = ast.parse(path.read_text())
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(a.name, []) for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            module = _from_module(node, package)
            # `from tinyvllm import platform` imports the module tinyvllm.platform
            submodules = [a.name for a in node.names if f"{module}.{a.name}" in MODULES]
            found += [(f"{module}.{a}", []) for a in submodules]
            names = [a.name for a in node.names if a.name not in submodules]
            if names or not submodules:
                found.append((module, names))
    return found


def _is(module: str, prefixes) -> bool:
    return any(module == p or module.startswith(p + ".") for p in prefixes)


def _phase_of(module: str) -> int | None:
    parts = module.split(".")
    if parts[0] == "phases" and len(parts) > 1 and parts[1][:1] == "p" and parts[1][1:3].isdigit():
        return int(parts[1][1:3])
    return None


MODULES = _modules()


@pytest.mark.parametrize("name", sorted(n for n in MODULES if n.startswith("tinyvllm")))
def test_the_foundation_never_imports_phases_or_the_front_door(name):
    if _front_door(name):
        return
    for module, _ in _imports(name, MODULES[name]):
        assert not _is(module, ("phases",)), f"{name} (foundation) imports {module}"
        assert not _front_door(module), f"{name} (foundation) imports {module} (front door)"


def test_importing_the_foundation_imports_no_phase():
    """The same direction at run time, where the package's own __init__ counts too: `tinyvllm`
    imports `LLM` (the front door, which imports the phases) only when it is first asked for."""
    import os
    import subprocess
    import sys

    code = ("import sys\n"
            "import tinyvllm, tinyvllm.model, tinyvllm.sampler, tinyvllm.weights, tinyvllm.config\n"
            "print(sorted(m for m in sys.modules if m == 'phases' or m.startswith('phases.')))\n"
            "from tinyvllm import LLM\n"
            "print(LLM.__module__, 'phases' in sys.modules)\n")
    env = {k: v for k, v in os.environ.items() if k != "TINYVLLM_WORKSPACE"}  # a learner's copies: see __init__
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, env=env, capture_output=True, text=True,
                         check=True).stdout.splitlines()
    assert out[0] == "[]", f"importing the foundation imported {out[0]}"
    assert out[1] == "tinyvllm.entrypoints.llm True"


@pytest.mark.parametrize("name", sorted(n for n in MODULES if _phase_of(n) is not None))
def test_a_phase_imports_only_earlier_phases_and_no_private_name(name):
    phase = _phase_of(name)
    for module, names in _imports(name, MODULES[name]):
        assert _is_tool(name) or not _front_door(module), f"{name} imports the front door ({module})"
        other = _phase_of(module)
        if other is None:
            continue
        assert other <= phase, f"{name} (phase {phase}) imports phase {other} ({module})"
        if other != phase:
            private = [n for n in names if n.startswith("_")]
            assert not private, f"{name} imports private names {private} of phase {other} ({module})"


def test_no_import_cycles():
    """Between our own modules, counting the imports inside functions as well as the module-level
    ones: an import inside a function hides a circle, it does not remove it."""
    graph: dict[str, set[str]] = {}
    for name, path in MODULES.items():
        deps = set()
        for module, names in _imports(name, path):
            deps.add(module)
            deps |= {f"{module}.{n}" for n in names}
        graph[name] = {d for d in deps if d in MODULES and d != name}
    # a package's __init__ importing its own submodules is how packages work: not a cycle
    for name in graph:
        graph[name] = {d for d in graph[name] if not d.startswith(name + ".")}
    state: dict[str, int] = {}
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for dep in sorted(graph[node]):
            if state.get(dep) == 1:
                cycle = path[path.index(dep):] + [dep]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if dep not in state:
                visit(dep)
        path.pop()
        state[node] = 2

    for name in sorted(graph):
        if name not in state:
            visit(name)


def test_the_parts_table_of_the_architecture_page_is_the_code_s():
    """docs/architecture.md's table of which phase provides which part is `python -m
    phases.parts_table`'s output, so it cannot drift from the recipes."""
    from phases.parts_table import PARTS, parts_table, provider

    page = (REPO / "docs" / "architecture.md").read_text()
    start = page.index("<!-- parts-table")
    table = page[page.index("\n", start) + 1: page.index("<!-- /parts-table -->")].strip()
    assert table == parts_table(), "regenerate docs/architecture.md's table with `python -m phases.parts_table`"
    assert provider(7, "runner") == 7 and provider(3, "scheduler") == 3 and provider(8, "model_loader") == 8
    assert all(provider(1, part) in (None, 1) for part in PARTS)


# every phase's parts as it builds them by default, the parts phase 6 builds only for drafts, and
# those phase 10 builds only for a KV connector
PARTS_CASES = [pytest.param(p.values[0], {}, id=p.id, marks=p.marks) for p in phase_params()] + [
    pytest.param(6, {"speculative_config": {"method": "ngram", "num_speculative_tokens": 2}}, id="phase6-ngram",
                 marks=pytest.mark.phase06),
    pytest.param(6, {"speculative_config": {"method": "draft_model", "model": "TINY", "num_speculative_tokens": 2}},
                 id="phase6-draft-model", marks=pytest.mark.phase06),
    pytest.param(10, {"kv_transfer_config": {"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
                                             "kv_connector_extra_config": {"cpu_bytes_to_use": 1 << 22}}},
                 id="phase10-offload", marks=pytest.mark.phase10),
]


@pytest.mark.parametrize("phase, engine_args", PARTS_CASES)
def test_every_part_has_what_the_engine_asks_of_it(phase, engine_args, tiny_model_dir, monkeypatch):
    """Each part a phase builds is an instance of its Protocol (phases/p01_naive_attention/parts.py):
    a part that lost a method the engine loop or another part calls fails here, when it is built."""
    import phases

    # the parts built here, in this process (phase 9's engine core builds the same ones in its own)
    monkeypatch.setenv("TINYVLLM_ENABLE_MULTIPROCESSING", "0")
    from phases.p01_naive_attention import parts as p1

    interfaces = {"scheduler": p1.SchedulerInterface, "allocator": p1.BlockAllocatorInterface,
                  "attention": p1.AttentionInterface, "runner": p1.ModelRunnerInterface,
                  "sampler": p1.SamplerInterface, "proposer": p1.ProposerInterface}
    spec = engine_args.get("speculative_config")
    if spec and spec.get("model") == "TINY":
        engine_args = {"speculative_config": dict(spec, model=str(tiny_model_dir))}
    if "num_kv_blocks" in phases.get_recipe(phase).engine_args:
        engine_args = dict(engine_args, num_kv_blocks=32)
    engine = phases.make_engine(phase, tiny_model_dir, **engine_args)
    try:
        for name, interface in interfaces.items():
            part = getattr(engine.parts, name)
            if part is None:
                continue
            missing = [m for m in [*vars(interface), *interface.__annotations__]
                       if not m.startswith("_") and not hasattr(part, m)]
            assert isinstance(part, interface), \
                f"phase {phase}'s {name} ({type(part).__name__}) is no {interface.__name__}: it lacks {missing}"
        if spec:
            assert engine.parts.proposer is not None
    finally:
        engine.shutdown()


def test_a_part_that_lost_a_method_is_no_longer_one():
    """The check above catches a missing method; and phase 8's executor is a runner."""
    from phases.p01_naive_attention import FifoScheduler
    from phases.p01_naive_attention.parts import ModelRunnerInterface, SchedulerInterface
    from phases.p08_tensor_parallel import TensorParallelExecutor

    assert isinstance(FifoScheduler(), SchedulerInterface)
    assert not isinstance(type("NoFinish", (FifoScheduler,), {"finish": None})(), SchedulerInterface)
    assert issubclass(TensorParallelExecutor, ModelRunnerInterface)   # with several ranks, the runner part


def _classes_and_functions(path: Path) -> tuple[list[ast.ClassDef], list[tuple[str, str]]]:
    tree = ast.parse(path.read_text())
    classes = [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    methods = [(c.name, f.name) for c in classes for f in c.body if isinstance(f, ast.FunctionDef)]
    return classes, methods


def test_one_engine_class_and_one_step():
    """The engine is one class, phase 1's, never subclassed, and `step` is written once: in it.
    Every phase is its recipe (`RECIPE`, built by the registry), not an engine of its own."""
    import phases

    engines, steps = [], []
    for name, path in MODULES.items():
        classes, methods = _classes_and_functions(path)
        engines += [f"{name}.{c.name}" for c in classes if c.name.endswith("Engine") and not name.startswith("tinyvllm")]
        engines += [f"{name}.{c.name}({b.id})" for c in classes for b in c.bases
                    if isinstance(b, ast.Name) and b.id.endswith("Engine") and not name.startswith("tinyvllm")]
        steps += [f"{name}.{cls}.step" for cls, fn in methods if fn == "step" and _phase_of(name) is not None]
    assert engines == ["phases.p01_naive_attention.engine.Engine"], engines
    # a front end's step (phase 9's client of its engine core) runs no part: it returns what the
    # one loop, run in the core's process, sent. Phase 9's batch queue is the one other driver of
    # the parts, as vLLM's `step_with_batch_queue` is beside `EngineCore.step`: the same schedule,
    # execute, sample, update, two steps deep, and `Engine.step` itself where a step cannot run ahead
    others = ["phases.p09_engine_core.core_client.EngineCoreClient.step",
              "phases.p09_engine_core.batch_queue.BatchQueue.step"]
    assert [s for s in steps if s not in others] == ["phases.p01_naive_attention.engine.Engine.step"], steps
    for phase in phases.PHASES:
        assert phases.get_recipe(phase).phase == phase


def test_one_decode_step_reads_as_a_short_path():
    """One decode step of the newest single-process phase (phase 7's parts; a tiny model, greedy)
    enters at most 19 project files (phase 2's paged_attention.py for checked mode's
    `check_metadata`), and its functions' phase packages, in the order each is first called,
    change at most 11 times (scripts/trace_step.py)."""
    import sys

    sys.path.insert(0, str(REPO / "scripts"))
    try:
        import trace_step
    finally:
        sys.path.pop(0)
    result = trace_step.measure(7, {})
    assert result["num_files"] <= 19, result["files"]
    assert result["phase_changes_of_functions"] <= 11, result["phase_order_of_functions"]


def _code_lines(path: Path) -> int:
    """Lines of code: not blank, not a comment, not a docstring, not an import (so a part moved to
    a module of its own costs nothing)."""
    text = path.read_text()
    skipped: set[int] = set()
    for node in ast.walk(ast.parse(text)):
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            skipped |= set(range(node.lineno, node.end_lineno + 1))
        if isinstance(node, (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)) and node.body:
            first = node.body[0]
            if isinstance(first, ast.Expr) and isinstance(getattr(first, "value", None), ast.Constant) \
                    and isinstance(first.value.value, str):
                skipped |= set(range(first.lineno, first.end_lineno + 1))
    return sum(1 for i, line in enumerate(text.splitlines(), start=1)
               if line.strip() and not line.strip().startswith("#") and i not in skipped)


# Lines of engine code a phase may hold: a few hundred, what a learner reads in a sitting. Phase 4
# teaches kernels for two kinds of device (Triton's on a GPU; on a CPU, C kernels for attention,
# the products, the norms and AMX tiles), so it holds two sets of parts. Phase 7 holds three ways
# to run one decode step (a CUDA graph, a compiled forward, one C call) around the persistent
# batch, which checked mode also checks, and refuses by name a model none of them runs (a sliding
# window, Gemma 3's layers). Phase 8 runs over several hosts, where anything on the
# network reaches its rendezvous: every value there is signed for the run and every wait bounded
# (rendezvous.py), beside the collectives the lesson is about; its ranks may build a later
# phase's parts (`run_on_ranks`: phase 11's groups of layers), and its signing serves phase 10's
# block transfers in pieces, unjoined (`sign_parts`). Phase 9 holds both sides of a
# process boundary, the core's loop and the front's client with its output processing (the text
# and its stop strings), and the typed records between them, every field of which is checked
# before anything acts on it (serial.py); and the scheduler one step ahead of the model, with its
# batch queue (async_scheduler.py, batch_queue.py).
CODE_BUDGET = {"p04_triton_kernels": 800, "p07_cuda_graphs": 625, "p08_tensor_parallel": 810,
               "p09_engine_core": 870}


def test_a_recipe_file_is_short_and_a_phase_s_code_within_budget():
    """A phase's recipe.py says which parts it replaces (under 250 lines, as phase 1's engine.py,
    the loop); the phase's engine code (tools, tests, the throughput checkpoints that
    tests/test_throughput.py runs, and C excluded; lines of code, not comments, docstrings or
    imports) stays within 600 (`CODE_BUDGET` for a phase that says why it needs more)."""
    for folder in sorted((REPO / "phases").glob("p0*")):
        for short in ("recipe.py", "engine.py"):
            path = folder / short
            if path.exists():
                assert len(path.read_text().splitlines()) < 250, f"{path} is long: move a part out of it"
        assert (folder / "recipe.py").exists(), f"{folder.name} has no recipe.py"
        code = sum(_code_lines(p) for p in folder.glob("*.py")
                   if not p.name.startswith("test_") and p.name != "throughput.py")
        assert code <= CODE_BUDGET.get(folder.name, 600), f"phases.{folder.name}: {code} lines of engine code"


def test_every_c_kernel_ships_as_package_data():
    """Each C or C++ file a kernel is built from on first use is in pyproject.toml's package data,
    so that an installed (not editable) tinyvllm has it: without, the kernel's caller warns and
    takes a slower path."""
    import tomllib

    data = tomllib.loads((REPO / "pyproject.toml").read_text())["tool"]["setuptools"]["package-data"]
    sources = [*REPO.glob("tinyvllm/**/*.c"), *REPO.glob("phases/**/*.c"), *REPO.glob("phases/**/*.cpp")]
    assert len(sources) >= 10
    for src in sources:
        package = ".".join(src.parent.relative_to(REPO).parts)
        assert any(src.match(pattern) for pattern in data.get(package, [])), \
            f"{src.relative_to(REPO)} is not package data of {package} (pyproject.toml)"
