"""A fresh clone installs what the suite was last green with: every package pyproject.toml asks
for is pinned in constraints.txt (written by scripts/lock.sh), scripts/setup.sh installs with it,
and this environment holds exactly those versions."""

from __future__ import annotations

import re
import tomllib
from importlib import metadata
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
NOT_PINNED = {"torch"}  # setup.sh installs the CPU build of 2.13.0 itself (or CUDA's on a GPU)


def _name(requirement: str) -> str:
    return re.split(r"[\s\[<>=!~;]", requirement, maxsplit=1)[0].lower().replace("_", "-")


def _pins() -> dict[str, str]:
    pins = {}
    for line in (REPO / "constraints.txt").read_text().splitlines():
        if line and not line.startswith("#"):
            name, _, version = line.partition("==")
            assert version, f"constraints.txt: {line!r} is not name==version"
            pins[name.lower().replace("_", "-")] = version
    return pins


def test_every_dependency_is_pinned():
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    wanted = {_name(r) for r in project["dependencies"] + project["optional-dependencies"]["dev"]}
    missing = sorted(wanted - NOT_PINNED - set(_pins()))
    assert not missing, f"constraints.txt lacks {missing}: run `bash scripts/lock.sh` after a green `make test`"


def test_setup_installs_with_the_constraints():
    setup = (REPO / "scripts" / "setup.sh").read_text()
    assert '-c "$constraints" -e ".[dev]"' in setup and "constraints.txt" in setup


def test_this_environment_holds_the_pinned_versions():
    drift = {}
    for name, version in _pins().items():
        try:
            have = metadata.version(name)
        except metadata.PackageNotFoundError:
            continue  # pinned for another platform or an optional path (none here)
        if have != version:
            drift[name] = (have, version)
    assert not drift, (f"installed (have, pinned): {drift}; run scripts/setup.sh again, or re-lock on "
                       f"purpose with scripts/lock.sh")
