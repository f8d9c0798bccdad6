"""Every lesson keeps one shape and reads in one sitting: at most about 2,000 words outside code, a
section on how vLLM does the same job (with paths in vLLM's repository), its exercises, its
checkpoint, a link to its notebook and to its lab note where it has one, and no sentence about the
project's own history (that is what lab notes and closing notes are for)."""

from __future__ import annotations

import re
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
LESSONS = sorted(REPO.glob("phases/p[0-9][0-9]_*/README.md"))
MAX_WORDS = 2200
HISTORY = re.compile(r"the issue|failed CI|slow moment|was [0-9.]+x before|last week|this session", re.I)


def prose(text: str) -> str:
    """The lesson without its fenced code blocks (code and program output are not reading time)."""
    return re.sub(r"^```.*?^```", "", text, flags=re.S | re.M)


def ids(path: Path) -> str:
    return path.parent.name


@pytest.mark.parametrize("readme", LESSONS, ids=ids)
def test_a_lesson_reads_in_one_sitting(readme):
    words = len(prose(readme.read_text()).split())
    assert words <= MAX_WORDS, f"{ids(readme)}: {words} words outside code (at most {MAX_WORDS}); move logs to a lab note"


@pytest.mark.parametrize("readme", LESSONS, ids=ids)
def test_a_lesson_keeps_the_shape(readme):
    text = readme.read_text()
    for heading in ("## How vLLM does it", "## Exercises", "## Next"):
        assert f"\n{heading}" in text, f"{ids(readme)} has no '{heading}' section"
    assert re.search(r"^## .*checkpoint", text, re.M | re.I), f"{ids(readme)} does not say what its checkpoint checks"
    vllm = text.split("## How vLLM does it", 1)[1].split("\n## ", 1)[0]
    assert re.search(r"`vllm/[\w/]+\.py`", vllm), f"{ids(readme)}: 'How vLLM does it' names no file of vLLM's repository"
    n = ids(readme)[1:3]
    assert re.search(rf"notebooks/{n}_\w+\.ipynb", text), f"{ids(readme)} does not link its notebook"
    lab = sorted(REPO.glob(f"docs/lab/{n}-*.md"))
    if lab:
        assert f"docs/lab/{lab[0].name}" in text, f"{ids(readme)} does not link its lab note {lab[0].name}"


@pytest.mark.parametrize("readme", LESSONS, ids=ids)
def test_a_lesson_speaks_of_the_engine(readme):
    found = HISTORY.search(readme.read_text())
    assert not found, f"{ids(readme)} tells the project's history: {found.group(0)!r}"


def test_every_lab_note_is_linked_from_its_lesson():
    """A phase's lab note (docs/lab/NN-*.md) from its lesson; the platform's (00-*), which no one
    phase owns, from the architecture page."""
    for note in sorted(REPO.glob("docs/lab/*.md")):
        n = note.name[:2]
        if n == "00":
            assert f"lab/{note.name}" in (REPO / "docs/architecture.md").read_text(), f"{note.name} is not linked"
            continue
        readme = next(REPO.glob(f"phases/p{n}_*/README.md"))
        assert f"docs/lab/{note.name}" in readme.read_text(), f"{note.name} is not linked from phase {n}'s lesson"


@pytest.mark.parametrize("notebook", sorted(REPO.glob("notebooks/[0-9][0-9]_*.ipynb")), ids=lambda p: p.stem)
def test_a_notebook_speaks_of_the_engine(notebook):
    import json
    text = "\n".join("".join(c["source"]) for c in json.loads(notebook.read_text())["cells"] if c["cell_type"] == "markdown")
    found = HISTORY.search(text)
    assert not found, f"{notebook.name} tells the project's history: {found.group(0)!r}"
