"""tinyvllm learn: build a phase yourself, graded by the phase's own checkpoint.

In each phase, the functions that carry its idea are marked in the source:

    # >>> exercise free (1 star): Give every block of `table` back to the pool, and empty the table.
    # hint: release_block(b) for each block, the last one first; then clear block_ids and num_tokens.
    # checked by: test_allocator_never_leaks_or_double_books, test_every_block_is_free_after_generate
    ...the reference body...
    # <<< exercise free

`learn start N` copies phase N into a workspace with each marked body replaced by
`raise NotImplementedError` (phase 1's copy holds the sampler too, `tinyvllm/sampler.py`: phase 1
sets up the one sampler every phase uses); `learn check N` runs phase N's checkpoint and its cases of the shared
suite against that copy (`pytest --workspace`, see phases/workspace.py) and reports each task;
`learn diff N` shows the copy beside the reference; `learn solve N TASK` puts one reference body
back, to move on.
"""

from __future__ import annotations

import argparse
import ast
import difflib
import os
import shutil
import sys
import tempfile
from dataclasses import dataclass
from pathlib import Path

import phases
from phases.workspace import BLANK_RAISED, foundation_files, is_blank
from phases.workspace import regions as _regions
from tinyvllm.entrypoints.learn_run import Case

REPO = Path(phases.__file__).resolve().parent.parent
DEFAULT_WORKSPACE = REPO / "workspace"


@dataclass(frozen=True)
class Exercise:
    phase: int
    name: str
    stars: int
    task: str
    hint: str
    checks: tuple[str, ...]  # the test functions that grade it
    file: str                # the module's file name inside the learner's copy of the phase
    line: int                # the marker's line (1-based) in the reference file
    function: str            # the function it sits in, e.g. BlockAllocator.allocate
    path: str                # the reference file, from the repository's root

    @property
    def package(self) -> str:
        return phase_package(self.phase)


def phase_package(phase: int) -> str:
    if phase not in phases.PHASES:
        raise ValueError(f"phase must be one of {sorted(phases.PHASES)}, got {phase}")
    return phases.PHASES[phase].split(".")[-1]


def phase_files(phase: int) -> list[Path]:
    """The reference files a learner's copy of `phase` holds: its modules, C and C++ sources and README
    (not its tests or tools/, which stay in the repository and grade the copy), then the
    foundation modules the phase teaches (phases/workspace.py's FOUNDATION_COPIES)."""
    folder = REPO / "phases" / phase_package(phase)
    files = sorted(p for p in folder.iterdir() if p.is_file() and p.suffix in (".py", ".c", ".cpp", ".md")
                   and not p.name.startswith("test_"))
    foundation = foundation_files(phase_package(phase))
    if {p.name for p in foundation} & {p.name for p in files}:
        raise ValueError(f"phase {phase}: a foundation module it teaches has the name of one of its own")
    return files + foundation


def exercises(phase: int | None = None) -> list[Exercise]:
    """Every marked task of `phase` (None: of every phase), in file order."""
    out = []
    for p in ([phase] if phase is not None else sorted(phases.PHASES)):
        for path in phase_files(p):
            if path.suffix != ".py":
                continue
            source = path.read_text()
            for f, i, _ in _regions(source):
                out.append(Exercise(p, f["name"], int(f["stars"]), f["task"], f["hint"],
                                    tuple(c.strip() for c in f["checks"].split(",")), path.name, i + 1,
                                    _enclosing(source, i + 1), path.relative_to(REPO).as_posix()))
    return out


def _enclosing(source: str, line: int) -> str:
    """The qualified name of the innermost function around `line` (1-based)."""
    best = ""

    def walk(node, prefix):
        nonlocal best
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef)):
                name = prefix + child.name
                if child.lineno <= line <= child.end_lineno:
                    if not isinstance(child, ast.ClassDef):
                        best = name
                    walk(child, name + ".")

    walk(ast.parse(source), "")
    return best


def exercise_table(phase: int) -> str:
    """The markdown table of phase `phase`'s tasks that its lesson carries (a test compares them)."""
    rows = ["| Task | Difficulty | Function | What to write |", "|---|---|---|---|"]
    for e in exercises(phase):
        task = e.task.replace("|", "\\|")
        link = os.path.relpath(REPO / e.path, REPO / "phases" / e.package).replace(os.sep, "/")
        rows.append(f"| `{e.name}` | {'★' * e.stars} | [`{e.function}`]({link}) | {task} |")
    return "\n".join(rows) + "\n"


def blank(source: str) -> str:
    """`source` with each marked body replaced by a raise naming the task; the markers stay."""
    lines = source.splitlines(keepends=True)
    for f, i, end in reversed(_regions(source)):
        message = f"exercise {f['name']} is not written yet: {f['task']}"
        lines[i + 3:end] = [f"{f['indent']}raise NotImplementedError({message!r})\n"]
    return "".join(lines)


def _body(source: str, name: str) -> list[str] | None:
    """The lines of exercise `name`'s body in `source`, markers excluded (None: no such exercise)."""
    lines = source.splitlines(keepends=True)
    for f, i, end in _regions(source):
        if f["name"] == name:
            return lines[i + 3:end]
    return None


# -- the commands ------------------------------------------------------------------------------

def start(phase: int, folder: Path, force: bool = False, out=None) -> Path:
    """Write the learner's copy of `phase` into `folder`; returns the copy's folder."""
    out = out or sys.stdout
    copy = folder / phase_package(phase)
    if copy.exists() and not force:
        raise FileExistsError(f"{copy} already exists (your work); pass --force to start over")
    if copy.exists():
        shutil.rmtree(copy)
    copy.mkdir(parents=True)
    for path in phase_files(phase):
        text = path.read_text()
        (copy / path.name).write_text(blank(text) if path.suffix == ".py" else text)
    tasks = exercises(phase)
    print(f"Wrote your copy of phase {phase} to {copy}: {len(tasks)} tasks to write.", file=out)
    for e in tasks:
        print(f"  {e.name:<18} {'*' * e.stars:<4} {e.file}: {e.task}", file=out)
    print(f"Grade it with: tinyvllm learn check {phase}" + _dir_flag(folder), file=out)
    return copy


def _dir_flag(folder: Path) -> str:
    return "" if folder.resolve() == DEFAULT_WORKSPACE.resolve() else f" --dir {folder}"


def unwritten(phase: int, folder: Path) -> set[str]:
    """The tasks whose body in the learner's copy is still the blank raise."""
    return {e.name for e, body in _copied_bodies(phase, folder) if body is not None and is_blank(body)}


def as_reference(phase: int, folder: Path) -> set[str]:
    """The tasks whose body in the learner's copy is the reference's (`learn solve` put it there, or
    the learner wrote the same lines): a failure of their checks comes from another task."""
    def lines(body):
        return [ln.rstrip() for ln in body if ln.strip()]
    return {e.name for e, body in _copied_bodies(phase, folder)
            if body is not None and lines(body) == lines(_body((REPO / e.path).read_text(), e.name))}


def _copied_bodies(phase: int, folder: Path):
    copy = folder / phase_package(phase)
    for e in exercises(phase):
        path = copy / e.file
        yield e, (_body(path.read_text(), e.name) if path.exists() else None)


def _blanks_raised(case: Case, names: set[str]) -> list[str]:
    """The blank tasks whose raise is in a failure's text (a blank not probed: in a Triton kernel)."""
    return sorted({n for n in BLANK_RAISED.findall(case.text) if n in names}) if case.outcome == "failed" else []


def _entered(case: Case, names: set[str]) -> set[str]:
    """The blank tasks a check needed: probed (their reference body ran) or raised."""
    return (set(case.blanks) & names) | set(_blanks_raised(case, names))


def grade(tasks: list[Exercise], cases: list[Case], blank_tasks: set[str] = frozenset(),
          reference_tasks: set[str] = frozenset()) -> list[tuple[Exercise, str, str]]:
    """(task, status, detail) per task; status is passed, failed, not written, waits or not run.
    `blank_tasks`: those the copy still leaves blank (not written, whatever their checks say);
    `reference_tasks`: those whose body is the reference's.

    A failed check counts against the tasks it names that the learner wrote (neither blank nor
    the reference's). When it names several, against those that also fail a check of their own
    alone; when it names none (every task it names is blank or the reference's), against the
    written tasks that fail elsewhere: a task filled by `learn solve` is never failed because of
    another. A task's detail is its first failure in the order its marker lists its checks (a
    crash last: the checks that ran are more telling). A task waits on every blank task its checks
    entered, all named at once."""
    names = {e.name for e in tasks}
    namers = {}
    for e in tasks:
        for c in e.checks:
            namers.setdefault(c, []).append(e.name)
    written = names - set(blank_tasks) - set(reference_tasks)
    failed = [c for c in cases if c.outcome == "failed" and not _blanks_raised(c, names)]

    def suspects(c: Case) -> list[str]:
        return [n for n in namers.get(c.test, []) if n in written]

    definite = {suspects(c)[0] for c in failed if len(suspects(c)) == 1}
    failing = {n for c in failed for n in suspects(c)}

    def blamed(c: Case) -> set[str]:
        s = suspects(c)
        if s:
            return (set(s) & definite) or set(s)
        return definite or failing or set(namers.get(c.test, []))

    out = []
    for e in tasks:
        mine = [(k, c) for k, c in enumerate(cases) if c.test in e.checks]
        needs = set().union(*(_entered(c, names) for _, c in mine)) - {e.name}
        own = sorted(((c.crashed, e.checks.index(c.test), k), c) for k, c in mine
                     if c in failed and e.name in blamed(c))
        others = set().union(*(blamed(c) for _, c in mine if c in failed)) - {e.name}
        if e.name in blank_tasks:
            out.append((e, "not written", e.task))
        elif not mine:
            out.append((e, "not run", "none of its checks ran (" + ", ".join(e.checks) + ")"))
        elif own:
            c = own[0][1]
            detail = f"{c.message} while checking {e.name}: {c.id}" if c.crashed else f"{c.test}: {c.message}"
            out.append((e, "failed", detail))
        elif needs or others:
            why = ([f"its checks need {', '.join(sorted(needs))} first"] if needs else []) + (
                [f"its checks fail because of {', '.join(sorted(others))}"] if others else [])
            out.append((e, "waits", "; ".join(why)))
        else:
            out.append((e, "passed", f"{len(mine)} checks"))
    return out


def check(phase: int, folder: Path, pytest_args: list[str] = (), out=None, verbose: bool = False,
          timeout: int = 240) -> int:
    """Grade the learner's copies in `folder` with phase `phase`'s checkpoint and shared cases;
    print a report per task. Returns 0 when every task and every other check passed. A check that
    crashes the process fails the task it checks; the checks after it run in a fresh process
    (tinyvllm/entrypoints/learn_run.py)."""
    from tinyvllm.entrypoints import learn_run

    out = out or sys.stdout
    if not (REPO / "tests").is_dir():
        raise FileNotFoundError(f"tinyvllm learn check needs the repository's tests ({REPO / 'tests'}); "
                                "run it from a clone of the repository")
    copy = folder / phase_package(phase)
    if not copy.is_dir():
        raise FileNotFoundError(f"no copy of phase {phase} in {folder}; make one with: "
                                f"tinyvllm learn start {phase}" + _dir_flag(folder))
    log = folder / f"check-{phase_package(phase)}.log"
    cmd = [sys.executable, "-m", "pytest", f"phases/{phase_package(phase)}", "tests",
           "-m", f"phase{phase:02d} and not docs and not notebooks", f"--workspace={folder.resolve()}",
           f"--check-timeout={timeout}", "-p", "tinyvllm.entrypoints.learn_run", "-p", "no:cacheprovider",
           "-q", "--tb=short", *pytest_args]
    print(f"Grading {_shown(copy)} with phase {phase}'s checks (the full output goes to {_shown(log)}) ...",
          file=out, flush=True)
    env = dict(os.environ)
    env.pop("TINYVLLM_WORKSPACE", None)
    env.setdefault("TINYVLLM_CHECK_KERNELS", "1")  # checked mode: a bookkeeping slip in a task is an error naming it, never a crash
    with tempfile.TemporaryDirectory() as tmp, open(log, "w") as f:
        ran = learn_run.run(cmd, REPO, env, None if verbose else f, Path(tmp), timeout)
    if not ran.cases:
        print(f"pytest stopped before running any check ({ran.note or f'exit {ran.returncode}'}); "
              f"see {_shown(log)}", file=out)
        return ran.returncode or 1
    for nodeid, how in ran.crashes:
        print(f"The process {how} while running {nodeid}; the checks after it ran in a fresh process.", file=out)
    if ran.note:
        print(f"Note: {ran.note} (see {_shown(log)}).", file=out)
    return report(phase, ran.cases, unwritten(phase, folder), out, _shown(log), as_reference(phase, folder), folder)


def report(phase: int, cases: list[Case], blank_tasks: set[str], out, log: Path | str = "pytest's output",
           reference_tasks: set[str] = frozenset(), folder: Path | None = None) -> int:
    """Print the grade of each of phase `phase`'s tasks, the speed checkpoint's verdict and the
    other checks, from pytest's `cases` (`log`: where its full output went; `folder`: the
    workspace, whose copy a task to write or fix is pointed at); 0 when every task and every
    other check passed."""
    tasks = exercises(phase)
    names = {e.name for e in tasks}
    results = grade(tasks, cases, blank_tasks, reference_tasks)
    marks = {"passed": "ok  ", "failed": "FAIL", "not written": "todo", "waits": "wait", "not run": "--  "}
    print(f"\nPhase {phase}, {len(tasks)} tasks:", file=out)
    for e, status, detail in results:
        print(f"  [{marks[status]}] {e.name:<18} {'*' * e.stars:<4} {status}: {detail}", file=out)
        if folder is not None and status in ("failed", "not written"):
            print(f"         {'':<18} {'':<4} in {_shown(task_location(e, folder))}", file=out)
    checked = {t for e in tasks for t in e.checks}
    speed = [c for c in cases if c.test == "test_throughput_checkpoint"]
    failing = [e.name for e, status, _ in results if status in ("failed", "not written", "waits")]
    for c in speed:
        if c.outcome == "passed" and not _entered(c, names):
            print(f"  [ok  ] speed: {c.speed}", file=out)
        elif c.outcome == "passed":
            print(f"  [wait] speed: needs {', '.join(sorted(_entered(c, names)))} first", file=out)
        elif c.outcome == "failed":
            if _entered(c, names):
                why, what = "needs " + ", ".join(sorted(_entered(c, names))), c.speed or c.message
            elif c.speed:  # measured to the end: the ratio is below the claim
                why, what = "too slow", c.speed
            else:  # the engine failed before the speed was known
                why = "not measured" + (f": first make {', '.join(failing)} pass" if failing else "")
                what = c.message
            print(f"  [FAIL] speed ({why}): {what}", file=out)
    others = [c for c in cases if c.test not in checked and c not in speed]
    waiting: dict[str, int] = {}
    own_failures = []
    for c in (c for c in others if c.outcome == "failed"):
        hit = sorted(_entered(c, names))
        if hit:  # counted once, for the first blank it needed
            first = next((n for n in BLANK_RAISED.findall(c.message) if n in hit), hit[0])
            waiting[first] = waiting.get(first, 0) + 1
        else:
            own_failures.append(c)
    n_failed = sum(c.outcome == "failed" for c in others)
    why = f" (they need {', '.join(f'{n}: {k}' for n, k in sorted(waiting.items()))})" if waiting else ""
    print(f"  other checks of phase {phase}: {sum(c.outcome == 'passed' for c in others)} passed, "
          f"{n_failed} failed{why}, {sum(c.outcome == 'skipped' for c in others)} skipped", file=out)
    for c in own_failures[:8]:
        print(f"    {c.id}: {c.message}", file=out)
    if len(own_failures) > 8:
        print(f"    ... and {len(own_failures) - 8} more (see {log})", file=out)
    ok = (all(s in ("passed", "not run") for _, s, _ in results) and not n_failed
          and all(c.outcome != "failed" and not _entered(c, names) for c in speed))
    if ok:
        print(f"Every task of phase {phase} passes.", file=out)
    return 0 if ok else 1


def task_location(e: Exercise, folder: Path) -> str:
    """`<copy's file>:<line of the task's marker>`: in the learner's copy, or where `learn start`
    writes it."""
    path = folder / e.package / e.file
    text = path.read_text() if path.exists() else blank((REPO / e.path).read_text())
    line = next(i for f, i, _ in _regions(text) if f["name"] == e.name) + 1
    return f"{path}:{line}"


def _shown(path) -> str:
    """A path relative to the current folder when it is under it (what a learner types)."""
    path = Path(path)
    try:
        return str(path.resolve().relative_to(Path.cwd().resolve()))
    except ValueError:
        return str(path)


def diff(phase: int, folder: Path, task: str | None = None, out=None) -> int:
    """Print the learner's copy beside the reference, as a unified diff (the reference is the
    solution): one task's body, or every file of the copy."""
    out = out or sys.stdout
    copy = folder / phase_package(phase)
    if not copy.is_dir():
        raise FileNotFoundError(f"no copy of phase {phase} in {folder}")
    for path in phase_files(phase):
        yours = copy / path.name
        if not yours.exists():
            continue
        ref, mine = path.read_text(), yours.read_text()
        if task is not None:
            if _body(ref, task) is None:
                continue
            a, b = _body(mine, task) or [], _body(ref, task)
            label = f"{path.name}, exercise {task}"
        else:
            a, b = mine.splitlines(keepends=True), ref.splitlines(keepends=True)
            label = path.name
        out.writelines(difflib.unified_diff(a, b, f"yours: {label}", f"reference: {label}"))
    if task is not None and task not in {e.name for e in exercises(phase)}:
        raise ValueError(f"phase {phase} has no exercise {task!r}; its tasks: "
                         + ", ".join(e.name for e in exercises(phase)))
    return 0


def solve(phase: int, folder: Path, task: str, out=None) -> None:
    """Put the reference body of `task` into the learner's copy (the markers stay)."""
    out = out or sys.stdout
    matches = [e for e in exercises(phase) if e.name == task]
    if not matches:
        raise ValueError(f"phase {phase} has no exercise {task!r}; its tasks: "
                         + ", ".join(e.name for e in exercises(phase)))
    e = matches[0]
    yours = folder / phase_package(phase) / e.file
    if not yours.exists():
        raise FileNotFoundError(f"no copy of {e.file} in {yours.parent}; run tinyvllm learn start {phase}")
    mine = yours.read_text()
    lines = mine.splitlines(keepends=True)
    for f, i, end in _regions(mine):
        if f["name"] == task:
            lines[i + 3:end] = _body((REPO / e.path).read_text(), task)
            yours.write_text("".join(lines))
            print(f"Put the reference body of {task} into {yours}.", file=out)
            return
    raise ValueError(f"{yours} has lost the markers of exercise {task!r} ('# >>> exercise {task} ...' "
                     f"and '# <<< exercise {task}'); put them back, or start over with --force")


def list_tasks(phase: int | None, folder: Path = DEFAULT_WORKSPACE, out=None) -> None:
    """Each task: its phase, name, difficulty, where it is in the learner's copy (or will be, after
    `learn start`) and what to write."""
    out = out or sys.stdout
    for e in exercises(phase):
        started = "" if (folder / e.package).is_dir() else f" (after tinyvllm learn start {e.phase})"
        print(f"phase {e.phase}  {e.name:<18} {'*' * e.stars:<4} {_shown(task_location(e, folder))}{started}  {e.task}",
              file=out)


def add_learn_parser(sub) -> None:
    p = sub.add_parser("learn", help="build a phase yourself: a copy with the key functions left to "
                                     "write, graded by the phase's checkpoint",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    lsub = p.add_subparsers(dest="learn_command", required=True)

    def command(name, help, task=False):
        c = lsub.add_parser(name, help=help)
        c.add_argument("phase", type=int, help=f"the phase number ({min(phases.PHASES)}-{max(phases.PHASES)})")
        if task:
            c.add_argument("task", help="the exercise's name (tinyvllm learn list shows them)")
        c.add_argument("--dir", type=Path, default=DEFAULT_WORKSPACE,
                       help=f"the workspace folder (default: {DEFAULT_WORKSPACE})")
        return c

    ls = lsub.add_parser("list", help="every phase's tasks, with their difficulty and place in your copy")
    ls.add_argument("phase", type=int, nargs="?", default=None)
    ls.add_argument("--dir", type=Path, default=DEFAULT_WORKSPACE,
                    help=f"the workspace folder (default: {DEFAULT_WORKSPACE})")
    command("start", "copy phase N into the workspace with its tasks left to write").add_argument(
        "--force", action="store_true", help="overwrite an existing copy (your work in it is lost)")
    c = command("check", "grade your copy: each task passed, failed (and why) or not yet written")
    c.add_argument("--verbose", action="store_true", help="show pytest's output as it runs")
    c.add_argument("--timeout", type=int, default=240, metavar="S",
                   help="fail a check that runs longer than S seconds (default 240)")
    c.add_argument("-k", dest="keyword", default=None, metavar="EXPR",
                   help="only the checks whose names match EXPR (pytest -k), e.g. -k allocator")
    command("diff", "your copy beside the reference (the solution)").add_argument(
        "--task", default=None, help="only this task's body")
    command("solve", "put the reference body of one task into your copy, to move on", task=True)


def run_learn(a: argparse.Namespace) -> int:
    if a.learn_command == "list":
        list_tasks(a.phase, a.dir)
        return 0
    if a.learn_command == "start":
        start(a.phase, a.dir, force=a.force)
        return 0
    if a.learn_command == "check":
        return check(a.phase, a.dir, ["-k", a.keyword] if a.keyword else [], verbose=a.verbose,
                     timeout=a.timeout)
    if a.learn_command == "diff":
        return diff(a.phase, a.dir, a.task)
    solve(a.phase, a.dir, a.task)
    return 0
