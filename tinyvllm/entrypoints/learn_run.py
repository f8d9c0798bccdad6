"""Running a phase's checks for `tinyvllm learn check`: a pytest process that records each check as
it ends, so that a crash loses nothing that ran.

The child is pytest with this module as a plugin (`-p tinyvllm.entrypoints.learn_run
--record FILE`): it appends a JSON line when a check starts and another when it ends (its outcome,
the first line of what went wrong, the whole text, the blank tasks it entered). If the process dies
(a signal: a segmentation fault in a C kernel fed a bad index, the kernel's out-of-memory killer) or
a check hangs where Python cannot stop it (inside C code, past the timeout: the parent kills it),
the check that started and never ended is the one that crashed. The parent records it as failed,
with how the process ended, and runs the checks not yet run in a fresh process (`--record-skip`):
pytest-forked's isolation of each test, paid for with a new process only after a crash.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import time
from dataclasses import dataclass
from pathlib import Path

# the file a probed blank task notes its name in (phases/workspace.py): the parent sets it, the
# recorder empties it before each check and reads it after
from phases.workspace import HITS_ENV

# Crashes after which the rest of a run is given up (each costs a fresh process).
MAX_CRASHES = 8
# Seconds past the check timeout before the parent kills a child whose check never returns.
KILL_GRACE = 30


@dataclass
class Case:
    """One check's outcome."""
    test: str        # the test function's name, parameters left off
    id: str          # pytest's node id
    outcome: str     # passed, failed or skipped
    message: str     # the first line of what went wrong ('' when it passed)
    text: str        # the whole failure text (tracebacks, a subprocess's stderr)
    speed: str = ""  # a throughput checkpoint's verdict
    blanks: tuple[str, ...] = ()  # the blank tasks it entered (each ran its reference body)
    crashed: bool = False         # the process died while it ran


@dataclass
class Run:
    """What a run of the checks gave: the cases in the order they ran, the crashes, and how the
    last process ended (`note`: why the run stopped early, '' when it reached the end)."""
    cases: list[Case]
    crashes: list[tuple[str, str]]   # (node id, how the process ended)
    returncode: int
    note: str = ""


def plain(message: str) -> str:
    """A failure's first line, without pytest's decoration."""
    first = next((ln.strip() for ln in message.splitlines() if ln.strip()), "")
    for prefix in ("AssertionError: ", "Failed: ", "failed on setup with ", '"'):
        first = first.removeprefix(prefix)
    first = first.removesuffix('"')
    return first if len(first) <= 240 else first[:237] + "..."


def test_name(nodeid: str) -> str:
    """The test function's name in a node id: `path::Class::test_x[params]` -> test_x."""
    return nodeid.rpartition("::")[2].split("[")[0]


def how_it_ended(returncode: int, hung: float | None = None) -> str:
    """A child's end in words: `crashed (signal 11)`, `was killed (signal 9: out of memory?)`."""
    if hung is not None:
        return f"hung (no answer for {hung:.0f} s, past the check timeout) and was stopped"
    if returncode < 0:
        sig = -returncode
        if sig == signal.SIGKILL:
            return f"was killed (signal {sig}: the system's out-of-memory killer?)"
        return f"crashed (signal {sig})"
    return f"stopped (exit {returncode})"


# -- the child: a pytest plugin --------------------------------------------------------------------

def pytest_addoption(parser):
    group = parser.getgroup("tinyvllm learn")
    group.addoption("--record", default=None, metavar="FILE",
                    help="append a JSON line to FILE as each test starts and ends (tinyvllm learn check)")
    group.addoption("--record-skip", default=None, metavar="FILE",
                    help="a JSON list of node ids not to run (they ran before a crash)")


def pytest_configure(config):
    if config.getoption("--record"):
        config.pluginmanager.register(Recorder(config.getoption("--record")), "learn-recorder")


def pytest_collection_modifyitems(config, items):
    path = config.getoption("--record-skip")
    if not path:
        return
    skip = set(json.loads(Path(path).read_text()))
    keep = [i for i in items if i.nodeid not in skip]
    config.hook.pytest_deselected(items=[i for i in items if i.nodeid in skip])
    items[:] = keep


class Recorder:
    """Writes `{"start": id}` before a check and `{"end": id, ...}` after it, each line flushed."""

    def __init__(self, path: str):
        self.path = path
        self.reports: dict[str, list] = {}
        self.hits = os.environ.get(HITS_ENV)

    def _write(self, record: dict) -> None:
        with open(self.path, "a") as f:   # closed at once: on the disk before the check runs
            f.write(json.dumps(record) + "\n")

    def pytest_runtest_logstart(self, nodeid, location):
        if self.hits:
            Path(self.hits).write_text("")
        self.reports[nodeid] = []
        self._write({"start": nodeid, "time": time.time()})

    def pytest_runtest_logreport(self, report):
        self.reports.setdefault(report.nodeid, []).append(report)

    def pytest_runtest_logfinish(self, nodeid, location):
        reports = self.reports.pop(nodeid, [])
        bad = next((r for r in reports if r.failed), None)
        outcome = "failed" if bad else "skipped" if any(r.skipped for r in reports) else "passed"
        message = text = ""
        if bad is not None:
            crash = getattr(bad.longrepr, "reprcrash", None)
            message = crash.message if crash is not None else str(bad.longrepr)
            if bad.when != "call":
                message = f"failed on {bad.when} with {message}"
            text = message + "\n" + bad.longreprtext
        props = {k: v for r in reports for k, v in r.user_properties}
        blanks = sorted(set(Path(self.hits).read_text().split())) if self.hits and Path(self.hits).exists() else []
        self._write({"end": nodeid, "outcome": outcome, "message": message, "text": text,
                     "speed": str(props.get("speed", "")), "blanks": blanks})


# -- the parent ------------------------------------------------------------------------------------

def _read(path: Path) -> tuple[list[dict], dict[str, float]]:
    """The ended checks' records, in order, and the start time of each check that started."""
    ended, started = [], {}
    if path.exists():
        for line in path.read_text().splitlines():
            try:
                r = json.loads(line)
            except json.JSONDecodeError:   # a line cut by the crash
                continue
            if "start" in r:
                started[r["start"]] = r["time"]
            else:
                ended.append(r)
    return ended, started


def _case(r: dict) -> Case:
    return Case(test_name(r["end"]), r["end"], r["outcome"], plain(r["message"]), r["text"], r["speed"],
                tuple(r["blanks"]))


def run(cmd: list[str], cwd: Path, env: dict, log, workdir: Path, timeout: int = 0,
        kill_grace: float = KILL_GRACE) -> Run:
    """Run pytest's `cmd` (without --record) in `cwd` until every check it collects has ended or
    crashed: after a crash, a fresh process runs the checks that had not run. `log`: a file the
    processes' output goes to (None: the terminal). `timeout`: the check timeout (s) the child
    enforces itself; a check still running `kill_grace` s past it is killed from here."""
    record, skip, hits = workdir / "record.jsonl", workdir / "skip.json", workdir / "hits.txt"
    env = {**env, HITS_ENV: str(hits)}
    cases: list[Case] = []
    crashes: list[tuple[str, str]] = []
    done: list[str] = []
    while True:
        record.write_text("")
        skip.write_text(json.dumps(done))
        proc = subprocess.Popen([*cmd, f"--record={record}", f"--record-skip={skip}"], cwd=cwd, env=env,
                                stdout=log, stderr=subprocess.STDOUT if log is not None else None,
                                start_new_session=True)
        hung = _wait(proc, record, timeout, kill_grace)
        ended, started = _read(record)
        cases += [_case(r) for r in ended]
        done += [r["end"] for r in ended]
        running = [n for n in started if n not in {r["end"] for r in ended}]
        if not running:
            if proc.returncode < 0 or proc.returncode not in (0, 1, 5):
                note = (f"pytest {how_it_ended(proc.returncode)} outside any check"
                        + (" (before running any)" if not started and not cases else ""))
                return Run(cases, crashes, proc.returncode, note)
            return Run(cases, crashes, proc.returncode)
        nodeid = running[-1]
        how = how_it_ended(proc.returncode, hung)
        crashes.append((nodeid, how))
        cases.append(Case(test_name(nodeid), nodeid, "failed", f"the process {how}", "", crashed=True))
        done.append(nodeid)
        if len(crashes) >= MAX_CRASHES:
            return Run(cases, crashes, proc.returncode,
                       f"the process crashed {len(crashes)} times; the checks after the last crash did not run")


def _wait(proc: subprocess.Popen, record: Path, timeout: int, kill_grace: float) -> float | None:
    """Wait for the child; kill it if one check runs `kill_grace` s past `timeout` (0: never).
    Returns how long the check had run when it was killed (None: it ended by itself)."""
    while True:
        try:
            proc.wait(timeout=1.0)
            return None
        except subprocess.TimeoutExpired:
            pass
        if not timeout:
            continue
        ended, started = _read(record)
        ended_ids = {r["end"] for r in ended}
        running = [t for n, t in started.items() if n not in ended_ids]
        if running and time.time() - running[-1] > timeout + kill_grace:
            took = time.time() - running[-1]
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            return took
