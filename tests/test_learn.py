"""tinyvllm learn: the exercise markers, the learner's workspace and the grading of it.

The grading runs pytest in a subprocess on a copy of phase 2 (the other phases' copies work the
same way): made from the reference it passes every check; with one task blank, that task is
named as not written and the tasks whose checks need it wait for it; with an allocator that never
frees, the report says which blocks were not given back.
"""

from __future__ import annotations

import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

import phases
from tinyvllm.entrypoints import learn
from tinyvllm.entrypoints.cli import main as cli_main

REPO = Path(__file__).resolve().parent.parent


def test_every_phase_has_two_to_six_marked_tasks():
    for phase in phases.PHASES:
        tasks = learn.exercises(phase)
        assert 2 <= len(tasks) <= 6, f"phase {phase} has {len(tasks)} tasks"
        for e in tasks:
            assert e.task and e.hint and e.checks and e.function and 1 <= e.stars <= 3, e
    names = [e.name for e in learn.exercises()]
    assert len(names) == len(set(names)), "two tasks share a name"


# Collects the suite once, in a process of its own, and prints each test's id and markers as JSON.
_COLLECT = """
import json, sys, pytest
class Markers:
    def pytest_collection_finish(self, session):
        self.items = [(i.nodeid, sorted({m.name for m in i.iter_markers()})) for i in session.items]
plugin = Markers()
pytest.main(["--collect-only", "-q", "-p", "no:cacheprovider", "-m", "not docs and not notebooks",
             "phases", "tests"], plugins=[plugin])
print(json.dumps(plugin.items))
"""


def _markers(items) -> list[tuple[str, list[str]]]:
    return [(i.nodeid, sorted({m.name for m in i.iter_markers()})) for i in items]


@pytest.fixture(scope="module")
def collected_items(request) -> list[tuple[str, list[str]]]:
    """Every test of the suite and its markers: this session's own where it collected the whole
    suite (a plain `pytest`, as `make test` runs it), else a collection in a process of its own."""
    config = request.config
    if (config.args_source == pytest.Config.ArgsSource.TESTPATHS and not config.option.keyword
            and not config.option.markexpr and not config.getoption("deselect")
            and not config.getoption("lf", False) and not config.getoption("stepwise", False)):
        return _markers(request.session.items)
    out = subprocess.run([sys.executable, "-c", _COLLECT], cwd=REPO, capture_output=True, text=True, check=True)
    return json.loads(out.stdout.strip().splitlines()[-1])


def _collected(items, phase: int) -> set[str]:
    """The test functions `tinyvllm learn check N` runs: marked phaseNN, in the phase's folder or
    in tests/."""
    where = (f"phases/{learn.phase_package(phase)}/", "tests/")
    return {re.search(r"::(test_\w+)", nodeid).group(1) for nodeid, markers in items
            if f"phase{phase:02d}" in markers and nodeid.startswith(where) and "::test_" in nodeid}


@pytest.mark.parametrize("phase", sorted(phases.PHASES))
def test_every_check_a_task_names_runs_in_its_phase(phase, collected_items):
    collected = _collected(collected_items, phase)
    for e in learn.exercises(phase):
        missing = set(e.checks) - collected
        assert not missing, f"exercise {e.name} names checks that phase {phase}'s run does not have: {missing}"


def test_a_blank_copy_raises_each_task_and_solving_restores_the_reference(tmp_path):
    for phase in phases.PHASES:
        learn.start(phase, tmp_path, out=io.StringIO())
        copy = tmp_path / learn.phase_package(phase)
        for e in learn.exercises(phase):
            body = learn._body((copy / e.file).read_text(), e.name)
            assert len(body) == 1 and f"exercise {e.name} is not written yet" in body[0], body
            compile((copy / e.file).read_text(), e.file, "exec")
        assert learn.unwritten(phase, tmp_path) == {e.name for e in learn.exercises(phase)}
        for e in learn.exercises(phase):
            learn.solve(phase, tmp_path, e.name, out=io.StringIO())
        for ref in learn.phase_files(phase):
            assert (copy / ref.name).read_text() == ref.read_text(), f"{ref.name} differs after solving"
        assert learn.unwritten(phase, tmp_path) == set()


@pytest.mark.parametrize("phase", sorted(phases.PHASES))
def test_the_lesson_lists_every_task(phase):
    lesson = (REPO / "phases" / learn.phase_package(phase) / "README.md").read_text()
    assert "## Exercises" in lesson and f"tinyvllm learn start {phase}" in lesson
    assert learn.exercise_table(phase) in lesson, (
        f"the Exercises table of phase {phase}'s README is not the one its markers give:\n"
        + learn.exercise_table(phase))


def test_a_copy_stands_in_for_the_reference_phase(tmp_path):
    """Phase 3 built on the learner's phase 2 gets the learner's allocator; the tests stay found."""
    learn.start(2, tmp_path, out=io.StringIO())
    code = ("import phases.p03_continuous_batching as p3, phases.p02_paged_kv as p2, importlib.util, inspect\n"
            "print(p2.__file__)\n"
            "print(inspect.getfile(p2.BlockAllocator))\n"
            "print(p3.__file__)\n"
            "print(importlib.util.find_spec('phases.p02_paged_kv.test_p02_checkpoint').origin)\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env=dict(os.environ, TINYVLLM_WORKSPACE=str(tmp_path))).stdout.split()
    copy = tmp_path.resolve() / "p02_paged_kv"
    assert out[0] == str(copy / "__init__.py") and out[1] == str(copy / "block_allocator.py")
    assert out[2] == str(REPO / "phases" / "p03_continuous_batching" / "__init__.py")
    assert out[3] == str(REPO / "phases" / "p02_paged_kv" / "test_p02_checkpoint.py")


def test_a_copy_holds_every_file_its_code_loads(tmp_path):
    """A module that loads a file beside it (a C kernel: `Path(__file__).with_name("x.c")`, `HERE /
    "x.c"`) finds it in the learner's copy too: `learn start` copies it."""
    for phase in phases.PHASES:
        copy = learn.start(phase, tmp_path, out=io.StringIO())
        for module in copy.glob("*.py"):
            text = module.read_text()
            for name in re.findall(r'(?:with_name\(|HERE / )"([\w.]+)"', text):
                assert (copy / name).is_file(), f"phase {phase}: {module.name} loads {name}, which its copy lacks"
            assert "parents[2]" not in text, (f"phase {phase}: {module.name} finds the repository from its own path, "
                                             "which in a learner's copy is elsewhere (phases.workspace.REFERENCE)")


def test_phase_1_s_copy_holds_the_sampler_every_phase_uses(tmp_path):
    """The sampler is the foundation's, taught in phase 1: a copy of phase 1 holds sampler.py, and
    with it `tinyvllm.sampler` is the learner's, for every phase (the engine's samplers included)."""
    learn.start(1, tmp_path, out=io.StringIO())
    copy = tmp_path.resolve() / "p01_naive_attention"
    assert {"draw", "filter_probs"} <= {e.name for e in learn.exercises(1) if e.file == "sampler.py"}
    assert "exercise draw is not written yet" in (copy / "sampler.py").read_text()
    code = ("import tinyvllm.sampler as s, phases.p03_continuous_batching as p3, inspect\n"
            "from phases.p01_naive_attention.recipe import Sampler\n"
            "print(s.__file__)\nprint(inspect.getfile(Sampler))\nprint(p3.__file__)\nprint(s.ARGMAX.source.is_file())\n")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True,
                         env=dict(os.environ, TINYVLLM_WORKSPACE=str(tmp_path))).stdout.split()
    assert out[0] == out[1] == str(copy / "sampler.py")
    assert out[2] == str(REPO / "phases" / "p03_continuous_batching" / "__init__.py")
    assert out[3] == "True", "the copied sampler's C kernel (cpu_argmax.c) is beside it"
    learn.solve(1, tmp_path, "draw", out=io.StringIO())
    assert learn.unwritten(1, tmp_path) == {e.name for e in learn.exercises(1)} - {"draw"}


def _workspace(tmp_path, blank=(), edit=None) -> Path:
    """A copy of phase 2 with every task solved but those in `blank`; `edit(text)` changes
    block_allocator.py after."""
    learn.start(2, tmp_path, out=io.StringIO())
    for e in learn.exercises(2):
        if e.name not in blank:
            learn.solve(2, tmp_path, e.name, out=io.StringIO())
    if edit:
        path = tmp_path / "p02_paged_kv" / "block_allocator.py"
        path.write_text(edit(path.read_text()))
    return tmp_path


def _check(folder, *pytest_args) -> tuple[int, dict[str, str], str]:
    out = io.StringIO()
    rc = learn.check(2, folder, list(pytest_args), out=out, timeout=120)
    report = out.getvalue()
    status = {m.group(1): m.group(2) for m in re.finditer(r"\] (\w+)\s+\*+\s+(.*)", report)}
    return rc, status, report


ALLOCATOR_CHECKS = "allocator_never_leaks or every_block_is_free or small_pool"


@pytest.mark.slow
def test_a_copy_of_the_reference_passes_every_check(tmp_path):
    """The checks every task names (the rest of the phase's run is the suite itself, which the
    reference passes: its speed checkpoint too, which the next test's report stands for; so is
    transformers' reference, 40 s to load, which prepare_inputs' two other checks stand in for
    here)."""
    checks = sorted({c for e in learn.exercises(2) for c in e.checks})
    checks.remove("test_greedy_matches_transformers")
    rc, status, report = _check(_workspace(tmp_path), "-k", " or ".join(checks))
    assert rc == 0, report
    assert set(status) == {e.name for e in learn.exercises(2)}
    assert all(s.startswith("passed") for s in status.values()), report
    assert "Every task of phase 2 passes" in report


def test_the_report_gives_the_speed_checkpoint_s_verdict():
    """A learner's copy that passes every check but is too slow is told so, with the numbers;
    one fast enough is told that too."""
    tasks = learn.exercises(2)
    passed = [learn.Case(c, f"t::{c}", "passed", "", "") for e in tasks for c in e.checks]
    speed = "one request's long generation: {:.2f}x the speed of phase 1, needs 3.00x"
    for ratio, outcome in ((3.46, "passed"), (1.90, "failed")):
        case = learn.Case("test_throughput_checkpoint", "t::test_throughput_checkpoint[phase2-vs-1-0]", outcome,
                          "phase 2 over phase 1 ..." if outcome == "failed" else "", "", speed.format(ratio))
        out = io.StringIO()
        rc = learn.report(2, passed + [case], set(), out)
        if outcome == "passed":
            assert rc == 0 and f"[ok  ] speed: {speed.format(ratio)}" in out.getvalue()
            assert "Every task of phase 2 passes" in out.getvalue()
        else:
            assert rc == 1 and f"[FAIL] speed (too slow): {speed.format(ratio)}" in out.getvalue()
    # an engine that failed before its speed was measured is not "too slow"
    broken = learn.Case("test_throughput_checkpoint", "t::test_throughput_checkpoint[phase2-vs-1-0]", "failed",
                        "RuntimeError: phase2: the engine still has requests from an earlier run", "")
    out = io.StringIO()
    assert learn.report(2, passed + [broken], {"allocate"}, out) == 1
    assert "too slow" not in out.getvalue()
    assert "[FAIL] speed (not measured: first make allocate pass): RuntimeError: phase2: the engine" in out.getvalue()


def _cases(outcomes: dict[str, str], message: str = "wrong") -> list:
    return [learn.Case(t, f"t::{t}", o, message if o == "failed" else "", "") for t, o in outcomes.items()]


def test_a_task_whose_body_is_the_reference_is_never_failed_because_of_another():
    """preempt written wrong, schedule filled by `learn solve`: the checks both name fail, and
    only preempt is failed for them (its own check that names it alone failed too); with
    preempt's checks all shared, still only the task the learner wrote is blamed."""
    tasks = learn.exercises(3)
    solved = {"schedule", "match_prefix", "cache_full_blocks"}
    outcomes = {t: "passed" for e in tasks for t in e.checks}
    outcomes.update(test_preemption_takes_the_newest_first="failed", test_heavy_preemption_keeps_outputs="failed",
                    test_seeded_sampling_survives_preemption="failed")
    status = {e.name: (s, d) for e, s, d in learn.grade(tasks, _cases(outcomes), set(), solved)}
    assert status["preempt"][0] == "failed" and status["preempt"][1].startswith("test_preemption_takes_the_newest_first")
    assert status["schedule"] == ("waits", "its checks fail because of preempt")
    assert status["match_prefix"] == ("waits", "its checks fail because of preempt")
    assert status["cache_full_blocks"][0] == "passed"
    outcomes["test_seeded_sampling_survives_preemption"] = "passed"
    status = {e.name: s for e, s, _ in learn.grade(tasks, _cases(outcomes), set(), solved)}
    assert status["preempt"] == "failed" and status["schedule"] == "waits"
    # nobody wrote schedule's checks' other tasks: a failure there is schedule's own
    status = {e.name: s for e, s, _ in learn.grade(tasks, _cases(outcomes), set(), solved - {"schedule"})}
    assert status["preempt"] == status["schedule"] == "failed"


def test_the_first_failure_is_the_one_the_marker_lists_first_and_a_crash_last():
    tasks = learn.exercises(2)
    prepare = next(e for e in tasks if e.name == "prepare_inputs")
    outcomes = {t: "passed" for e in tasks for t in e.checks}
    cases = _cases(outcomes)
    late, first = prepare.checks[-1], prepare.checks[0]
    for c in cases:
        if c.test == late:
            c.outcome, c.message, c.crashed = "failed", "the process crashed (signal 11)", True
        if c.test == prepare.checks[1]:
            c.outcome, c.message = "failed", "tokens differ"
    cases.sort(key=lambda c: c.test != late)      # the crash ran first
    status = {e.name: (s, d) for e, s, d in learn.grade(tasks, cases, set(), {e.name for e in tasks} - {"prepare_inputs"})}
    assert status["prepare_inputs"] == ("failed", f"{prepare.checks[1]}: tokens differ")
    for c in cases:
        c.outcome = "passed" if c.test != late else c.outcome
    status = {e.name: (s, d) for e, s, d in learn.grade(tasks, cases, set(), {e.name for e in tasks} - {"prepare_inputs"})}
    assert status["prepare_inputs"] == ("failed", f"the process crashed (signal 11) while checking prepare_inputs: t::{late}")
    assert first != late


def test_one_blank_task_fails_that_task_only(tmp_path):
    rc, status, report = _check(_workspace(tmp_path, blank={"free"}), "-k", ALLOCATOR_CHECKS)
    assert rc == 1
    assert status["free"].startswith("not written: Give every block"), report
    assert status["allocate"] == "waits: its checks need free first", report
    assert status["prepare_inputs"].startswith("not run") and status["decode_gather"].startswith("not run")


def test_an_allocator_that_never_frees_is_told_so(tmp_path):
    def never_frees(text: str) -> str:
        body = "self.release_block(block_id)"
        assert body in text
        return text.replace(body, "pass")

    rc, status, report = _check(_workspace(tmp_path, edit=never_frees), "-k", ALLOCATOR_CHECKS)
    assert rc == 1
    assert status["free"].startswith("failed: test_"), report
    assert re.search(r"blocks (are free|were not given back)|a block leaked", status["free"]), report


def test_learn_commands(tmp_path, capsys):
    assert cli_main(["learn", "start", "2", "--dir", str(tmp_path)]) == 0
    assert "tinyvllm learn check 2 --dir" in capsys.readouterr().out
    assert cli_main(["learn", "start", "2", "--dir", str(tmp_path)]) == 2
    assert "--force" in capsys.readouterr().err
    assert cli_main(["learn", "diff", "2", "--task", "free", "--dir", str(tmp_path)]) == 0
    diff = capsys.readouterr().out
    assert "-        raise NotImplementedError('exercise free is not written yet" in diff
    assert "+            self.release_block(block_id)" in diff
    assert cli_main(["learn", "solve", "2", "frees", "--dir", str(tmp_path)]) == 2
    assert "no exercise 'frees'" in capsys.readouterr().err
    assert cli_main(["learn", "check", "3", "--dir", str(tmp_path)]) == 2
    assert "tinyvllm learn start 3" in capsys.readouterr().err
    assert cli_main(["learn", "list", "2", "--dir", str(tmp_path)]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert [ln.split()[2] for ln in lines] == [e.name for e in learn.exercises(2)]
    # each task where it is in the learner's copy (not the reference, which is the answer)
    copy = tmp_path.resolve() / "p02_paged_kv"
    for ln, e in zip(lines, learn.exercises(2)):
        where = ln.split()[4] if ln.split()[3].startswith("*") else ln.split()[3]
        path, line = where.rsplit(":", 1)
        assert Path(path).resolve() == copy / e.file, ln
        assert f"# >>> exercise {e.name} " in (copy / e.file).read_text().splitlines()[int(line) - 1], ln
    assert cli_main(["learn", "list", "3", "--dir", str(tmp_path)]) == 0
    assert "(after tinyvllm learn start 3)" in capsys.readouterr().out


_FAKE_CHECKS = """
import os, signal, time

def test_a():
    pass

def test_b():
    os.kill(os.getpid(), signal.SIGSEGV)

def test_c():
    signal.pthread_sigmask(signal.SIG_BLOCK, [signal.SIGALRM])   # as C code that never returns to Python
    time.sleep(60)

def test_d():
    assert 1 == 2, "d is wrong"
"""


def test_a_check_that_crashes_or_hangs_is_attributed_and_the_rest_run(tmp_path):
    """A check that kills its own process (SIGSEGV) or hangs where Python cannot stop it is
    recorded as failed, with how the process ended; the checks after it run in a fresh process."""
    from tinyvllm.entrypoints import learn_run

    (tmp_path / "test_fake.py").write_text(_FAKE_CHECKS)
    cmd = [sys.executable, "-m", "pytest", "test_fake.py", "-p", "tinyvllm.entrypoints.learn_run", "-q",
           "-p", "no:cacheprovider", f"--rootdir={tmp_path}", "-p", "no:faulthandler"]
    work = tmp_path / "work"
    work.mkdir()
    env = dict(os.environ, PYTHONPATH=str(REPO))
    with open(tmp_path / "log", "w") as log:
        ran = learn_run.run(cmd, tmp_path, env, log, work, timeout=1, kill_grace=2)
    got = {c.test: (c.outcome, c.message, c.crashed) for c in ran.cases}
    assert got["test_a"] == ("passed", "", False)
    assert got["test_b"] == ("failed", "the process crashed (signal 11)", True)
    assert got["test_c"][0] == "failed" and got["test_c"][2] and "hung (no answer for" in got["test_c"][1]
    assert got["test_d"] == ("failed", "d is wrong", False)
    assert [c.test for c in ran.cases] == ["test_a", "test_b", "test_c", "test_d"] and len(ran.crashes) == 2
    assert not ran.note


def _phase_copy(tmp_path, phase, blank=(), change=None) -> Path:
    """A copy of `phase` with every task solved but those in `blank`; `change(task)` -> (old, new)
    pieces of the reference body to swap, for the tasks it names."""
    learn.start(phase, tmp_path, out=io.StringIO())
    for e in learn.exercises(phase):
        if e.name not in blank:
            learn.solve(phase, tmp_path, e.name, out=io.StringIO())
        if change and e.name in change:
            path = tmp_path / e.package / e.file
            old, new = change[e.name]
            assert path.read_text().count(old) == 1, old
            path.write_text(path.read_text().replace(old, new))
    return tmp_path


def _grade(phase, folder, *pytest_args) -> tuple[int, dict[str, str], str]:
    out = io.StringIO()
    rc = learn.check(phase, folder, list(pytest_args), out=out, timeout=120)
    report = out.getvalue()
    return rc, {m.group(1): m.group(2) for m in re.finditer(r"\] (\w+)\s+\*+\s+(.*)", report)}, report


def test_a_wrong_task_is_graded_beside_blank_ones_that_are_all_named(tmp_path):
    """Phase 3 with schedule and match_prefix blank and preempt written with the back of the
    waiting queue (issue 74's slip): preempt fails, saying where a preempted sequence goes, though
    the tasks it runs with are blank (each blank runs its reference body while graded); a task
    that needs both blanks names both at once."""
    folder = _phase_copy(tmp_path, 3, blank={"schedule", "match_prefix"},
                         change={"preempt": ("self.waiting.appendleft(seq)", "self.waiting.append(seq)")})
    rc, status, report = _grade(3, folder, "-k", "preemption_takes or prefix_cache")
    assert rc == 1
    assert status["preempt"].startswith("failed: test_preemption_takes_the_newest_first: a preempted sequence "
                                        "goes back to the front of the waiting queue"), report
    assert status["schedule"].startswith("not written") and status["match_prefix"].startswith("not written"), report
    assert status["cache_full_blocks"] == "waits: its checks need match_prefix, schedule first", report


def test_a_check_that_crashes_the_process_fails_its_task_and_the_rest_run(tmp_path):
    """free written so that it kills the process (as a bad index fed to a C kernel does): its
    check is reported as the crash, naming free; allocate, filled by `learn solve`, is not
    failed for it; write_kv's check runs after, in a fresh process, and passes."""
    crash = "__import__('os').kill(__import__('os').getpid(), 11)"
    folder = _phase_copy(tmp_path, 2, change={"free": ("self.release_block(block_id)", crash)})
    rc, status, report = _grade(2, folder, "-k", "allocator_never_leaks or kv_write_puts")
    assert rc == 1
    assert status["free"].startswith("failed: the process crashed (signal 11) while checking free: "
                                     "phases/p02_paged_kv/test_p02_checkpoint.py::test_allocator_never_leaks"), report
    assert status["allocate"] == "waits: its checks fail because of free", report
    assert status["write_kv"].startswith("passed"), report
    assert "The process crashed (signal 11) while running" in report


@pytest.mark.slow  # phase 7's engines: ~20 s
def test_remove_row_with_the_moved_row_left_stale_is_reported_as_remove_row(tmp_path):
    """Issue 79's slip: the request moved into the hole keeps its old row_of entry. The report
    fails remove_row, about the moved row; the tasks whose checks it breaks wait for it."""
    folder = _phase_copy(tmp_path, 7, change={"remove_row": ("            self.row_of[self.seqs[r].seq_id] = r\n", "")})
    rc, status, report = _grade(7, folder, "-k", "swap_copies or shrink_grow or bucket_for")
    assert rc == 1
    assert status["remove_row"].startswith("failed: test_swap_copies_valid_tokens_only: the request moved from the "
                                           "last row into the hole must be found there"), report
    assert not [t for t, st in status.items() if t != "remove_row" and st.startswith("failed")], report


@pytest.mark.parametrize("set_by_user", [None, "0"])
def test_the_checks_run_in_checked_mode_unless_the_user_says_otherwise(tmp_path, monkeypatch, set_by_user):
    """learn check's pytest runs with TINYVLLM_CHECK_KERNELS=1 (a bookkeeping slip in a task is an
    error naming it, not a crash), unless the learner set the variable; the workspace variable is
    left out (the run points at the copy by --workspace)."""
    from tinyvllm.entrypoints import learn_run

    seen: dict = {}

    def run(cmd, cwd, env, log, workdir, timeout=0, **kw):
        seen.update(env)
        return learn_run.Run(cases=[], crashes=[], returncode=3, note="stopped here by the test")

    monkeypatch.setattr(learn_run, "run", run)
    if set_by_user is None:
        monkeypatch.delenv("TINYVLLM_CHECK_KERNELS", raising=False)
    else:
        monkeypatch.setenv("TINYVLLM_CHECK_KERNELS", set_by_user)
    monkeypatch.setenv("TINYVLLM_WORKSPACE", str(tmp_path))
    (tmp_path / learn.phase_package(2)).mkdir()
    assert learn.check(2, tmp_path, out=io.StringIO()) == 3
    assert seen["TINYVLLM_CHECK_KERNELS"] == (set_by_user or "1")
    assert "TINYVLLM_WORKSPACE" not in seen
