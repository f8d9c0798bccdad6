"""One platform decides (`tinyvllm.platform`): every choice that depends on the CPU's kind is a row
of its rules, with the committed report that chose it; no other module asks what CPU this is or
keeps a table by kind; `TINYVLLM_CPU_KIND` makes the platform act as any kind this CPU can run, and
is refused by name otherwise, before anything starts."""

from __future__ import annotations

import ast
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinyvllm import platform
from tinyvllm.hardware import AMX_BF16_FLAGS, AVX2_FLAGS, AVX512_VNNI_FLAGS, kind_of

pytestmark = pytest.mark.kinds   # paths the platform chooses by CPU kind (make test-kinds)

REPO = Path(__file__).resolve().parents[1]
KIND_NAMES = set(platform.KINDS) - {"other"}   # "other" is also an ordinary word


def _kind_tables(path: Path) -> list[str]:
    """Module- or class-level names bound to a literal dict keyed by kind names, or a tuple, list
    or set of them: a choice by kind kept outside the platform."""
    found = []
    tree = ast.parse(path.read_text())
    scopes = [tree] + [n for n in ast.walk(tree) if isinstance(n, ast.ClassDef)]
    for scope in scopes:
        for node in scope.body:
            if not isinstance(node, (ast.Assign, ast.AnnAssign)) or node.value is None:
                continue
            value = node.value
            strings = []
            if isinstance(value, ast.Dict):
                strings = [k.value for k in value.keys if isinstance(k, ast.Constant)]
            elif isinstance(value, (ast.Tuple, ast.List, ast.Set)):
                strings = [e.value for e in value.elts if isinstance(e, ast.Constant)]
            if KIND_NAMES & {s for s in strings if isinstance(s, str)}:
                found.append(f"{path.relative_to(REPO)}:{node.lineno}")
    return found


def _engine_sources() -> list[Path]:
    """The engine's Python (the foundation, the phases and their tools, the scripts), not its
    tests nor a phase's throughput claims (what a test asserts on each kind, not a choice)."""
    files = [*REPO.glob("tinyvllm/**/*.py"), *REPO.glob("phases/**/*.py"), *REPO.glob("scripts/*.py")]
    return [f for f in files if not f.name.startswith("test_") and f.name != "throughput.py"
            and f.relative_to(REPO).as_posix() != "tinyvllm/platform.py"]


def test_no_module_but_the_platform_asks_the_cpu_kind_or_keeps_a_kind_table():
    """`grep` finds no `cpu_kind(` call, no kind read from the machine's flags, and no table keyed by
    kind anywhere in the engine but tinyvllm/platform.py (and tinyvllm/hardware.py, which only
    reads the machine)."""
    calls, tables = [], []
    for path in _engine_sources():
        text = path.read_text()
        if path.relative_to(REPO).as_posix() == "tinyvllm/hardware.py":
            continue   # the machine's reader: its flag names ("avx2") are not a choice by kind
        calls += [f"{path.relative_to(REPO)}: {m.group(0)}" for m in re.finditer(r"cpu_kind\(\)|kind_of\(", text)]
        tables += _kind_tables(path)
    assert calls == [] and tables == [], (calls, tables)


def test_the_scan_finds_a_kind_table(tmp_path):
    """The test above is not blind: a module with a table keyed by kind, or a tuple of kinds, is
    found."""
    (tmp_path / "x.py").write_text('GEMV = {"avx2": 8}\nclass L:\n    KINDS = ("amx",)\nOK = {"float32": 1}\n')
    global REPO
    saved, REPO = REPO, tmp_path
    try:
        assert _kind_tables(tmp_path / "x.py") == ["x.py:1", "x.py:3"]
    finally:
        REPO = saved


def test_every_rule_answers_every_kind_with_its_reason_in_a_committed_report():
    """Each rule has a value on each kind and a reason naming what chose it: every report it
    names is committed under docs/assets/bench/, every lab note under docs/lab/. "other" (a CPU
    with no hand-written kernel) takes the plain path on every rule."""
    reports = {p.name for p in (REPO / "docs/assets/bench").iterdir()}
    for name, rule in platform.RULES.items():
        named = re.findall(r"[\w.-]+\.(?:json|txt)", rule.why)
        assert named or "lab note" in rule.why, f"{name}: no report or lab note named"
        assert [r for r in named if r not in reports] == [], f"{name} names a report that is not committed"
        assert rule.other in (0, False, None), f"{name} on 'other' is not the plain path"
    for note in re.findall(r"lab note (\d)", " ".join(r.why for r in platform.RULES.values())):
        assert list((REPO / "docs/lab").glob(f"0{note}-*.md")), f"lab note {note}"


def test_this_machine_acts_as_its_own_kind_and_every_kind_it_contains():
    """amx contains avx512_vnni contains avx2; "other" runs on any CPU. Acting as a kind hides the
    flags it does not have: a kernel built for a richer kind does not load."""
    native = platform.native_kind()
    kinds = platform.acting_kinds()
    order = ["other", "avx2", "avx512_vnni", "amx"]
    assert kinds[-1:] == ["other"] and native in kinds
    assert set(kinds) == set(order[: order.index(native) + 1])
    for kind in kinds:
        p = platform.platform_as(kind)
        assert p.kind == kind and (kind_of(set(p.flags)) == kind or kind == "other")
        assert p.has(AVX2_FLAGS) == (kind != "other")
        assert p.has(AVX512_VNNI_FLAGS) == (kind in ("avx512_vnni", "amx"))
        assert not p.has(AMX_BF16_FLAGS) or kind == "amx"
        assert p.onednn is False or kind != "other"


def test_a_kind_this_cpu_cannot_run_is_refused_by_name(monkeypatch):
    """An unknown kind, or one whose instructions this CPU lacks (here: a CPU with AVX2 only),
    is refused with the variable's name and the kinds this machine can act as."""
    with pytest.raises(ValueError, match=r"TINYVLLM_CPU_KIND='zen9' is not a CPU kind.*can act as"):
        platform.platform_as("zen9")
    monkeypatch.setattr(platform, "cpu_flags", lambda: frozenset({"avx", "avx2", "fma", "f16c"}))
    monkeypatch.setattr(platform, "_x86", lambda: True)
    assert platform.acting_kinds() == ["avx2", "other"]
    with pytest.raises(ValueError, match=r"TINYVLLM_CPU_KIND='amx'.*cannot run.*can act as avx2, other"):
        platform.platform_as("amx")


def _run(code: str, kind: str) -> subprocess.CompletedProcess:
    env = {**os.environ, "TINYVLLM_CPU_KIND": kind, "PYTHONPATH": str(REPO)}
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=REPO)


def test_the_environment_picks_the_kind_and_a_bad_one_starts_nothing(tiny_model_dir):
    """$TINYVLLM_CPU_KIND sets the kind the engine acts as (its reports record it); a value this
    machine cannot act as stops `LLM()` and `tinyvllm generate` before a model is read, with the
    variable named."""
    acting = platform.acting_kinds()[-2]          # the plainest kind with hand-written kernels, or "other"
    out = _run("from tinyvllm import platform; print(platform.current().kind)", acting)
    assert out.returncode == 0 and out.stdout.strip() == acting
    bad = _run(f"from tinyvllm import LLM; LLM({str(tiny_model_dir)!r})", "zen9")
    assert bad.returncode != 0 and "TINYVLLM_CPU_KIND='zen9'" in bad.stderr
    cli = subprocess.run([str(Path(sys.executable).with_name("tinyvllm")), "generate", "--model", str(tiny_model_dir),
                          "--prompt", "hi", "--max-tokens", "2"], capture_output=True, text=True,
                         env={**os.environ, "TINYVLLM_CPU_KIND": "zen9"})
    assert cli.returncode != 0 and "TINYVLLM_CPU_KIND" in cli.stderr and "Traceback" not in cli.stderr


def test_using_another_platform_is_undone_after_the_block():
    """`platform.using` stands in for the machine within its block (a tool building an engine
    with other rules), and `with_rules` refuses a rule that does not exist."""
    before = platform.current()
    with platform.using(before.with_rules(gemv_max_rows=3)) as p:
        assert platform.current() is p and p.rule("gemv_max_rows") == 3 and p.kind == before.kind
    assert platform.current() is before
    with pytest.raises(ValueError, match="no such rule"):
        before.with_rules(gemv_rows=3)


def test_the_platform_prints_its_rules_and_the_kinds_make_test_kinds_runs():
    """`python -m tinyvllm.platform` prints every rule on this kind; `--acting-kinds` and
    `--other-kinds` (CI's: all but this CPU's own) print the kinds on one line, as a make variable
    and a shell loop take them."""
    def run(*args):
        out = subprocess.run([sys.executable, "-m", "tinyvllm.platform", *args], capture_output=True, text=True,
                             cwd=REPO, env={**os.environ, "PYTHONPATH": str(REPO)})
        assert out.returncode == 0, out.stderr
        return out.stdout
    rules = run()
    assert f"kind: {platform.current().kind}" in rules
    assert all(f"  {name} = " in rules for name in platform.RULES)
    assert run("--acting-kinds") == " ".join(platform.acting_kinds()) + "\n"
    assert run("--other-kinds") == " ".join(k for k in platform.acting_kinds() if k != platform.native_kind()) + "\n"
