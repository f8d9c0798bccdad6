"""MkDocs hooks for the tinyvllm site (mkdocs.yml `hooks:`): they put the repository's lessons,
notebooks and code on the site without copying them into docs/.

- Notebooks: every `notebooks/*.ipynb` becomes a page (rendered with its outputs by
  mkdocs-jupyter) and an entry of the nav's "Notebooks" section, so a new notebook shows up
  without editing mkdocs.yml.
- Source pages: every file of `SOURCE_GLOBS` gets a highlighted, line-numbered page at
  `source/<path>/`, so a lesson's link to `engine.py` opens the code beside the lesson, offline.
- Links: a lesson page includes its phase's README (mkdocs-include-markdown-plugin), whose
  links are relative to the phase folder: `[engine.py](engine.py)`,
  `[model.py](../../tinyvllm/model.py)`, `[phase 1](../p01_naive_attention/README.md)`. Any link,
  in a page or a notebook, to a repository file outside docs/ is pointed at that file's page on
  the site: a phase README or folder -> its lesson page, a notebook -> its page, code -> its
  source page (GitHub's `#L10` becomes line 10 there). A link to a file the site does not
  publish is left alone, and `--strict` fails on it.
- Lesson notebooks: on a lesson page `phases/NN-slug.md`, a line `<!-- notebook ... -->` becomes
  a link to `notebooks/NN_slug.ipynb` once that notebook exists (and disappears while it does not).
- Solutions: a notebook cell tagged `solution` (an exercise's answer, collapsed in JupyterLab by
  `jupyter.source_hidden`) is rendered inside a closed `<details>`, opened with a click.
- Lab notes: every `docs/lab/*.md` (a phase's measurements, kernel versions and what did not
  pay, linked from its lesson) is an entry of the nav's "Lab notes" section, in file-name order.
- Optional pages: a nav entry in `OPTIONAL_PAGES` (owned by another part of the project and
  written later) is dropped, with a note, while its file does not exist.
"""

from __future__ import annotations

import logging
import posixpath
import re
from pathlib import Path

from mkdocs.plugins import event_priority
from mkdocs.structure.files import File, Files
from mkdocs.utils import get_relative_url

log = logging.getLogger("mkdocs.hooks.tinyvllm")

REPO = Path(__file__).resolve().parents[1]
NOTEBOOKS_SECTION = "Notebooks"
LAB_SECTION = "Lab notes"
OPTIONAL_PAGES = ("benchmarks.md",)
SOURCE_GLOBS = ("tinyvllm/*.py", "tinyvllm/*.c", "tinyvllm/layers/*.py", "tinyvllm/entrypoints/*.py", "phases/*.py", "phases/*/*.py", "phases/*/tools/*.py", "phases/*/*.c", "phases/*/*.cpp", "tests/*.py",
                "conftest.py", "scripts/*.sh", "scripts/*.py", "Makefile", "pyproject.toml", "mkdocs.yml")
LANGUAGES = {".py": "python", ".c": "c", ".cpp": "cpp", ".sh": "bash", ".toml": "toml", ".yml": "yaml", "Makefile": "make"}
SOURCE_PREFIX = "source/"

# [text](target) and ![alt](target); the target has no spaces (our files have none)
MD_LINK = re.compile(r"(!?\[[^\]\n]*\]\()(<?)([^)\s>]+)(>?)((?:\s+\"[^\"]*\")?\))")
HTML_LINK = re.compile(r"""(\s(?:href|src)=)(["'])([^"']+)\2""")
PHASE_DIR = re.compile(r"^phases/p(\d\d)_([a-z0-9_]+)$")
LESSON_PAGE = re.compile(r"^phases/(\d\d)-([a-z0-9-]+)\.md$")
NOTEBOOK_MARK = re.compile(r"^<!-- notebook\b.*-->$", re.M)
# A notebook cell tagged "solution", and the markup that collapses it
SOLUTION_CELL = re.compile(r"""<div\s[^>]*\bclass=["'][^"']*\bcelltag_solution\b""")
DIV_TAG = re.compile(r"<(/?)div\b[^>]*>")
SOLUTION_OPEN = ('<details class="success tinyvllm-solution">\n'
                 '<summary>Show the solution</summary>\n')


def _notebooks() -> list[Path]:
    return sorted((REPO / "notebooks").glob("*.ipynb"))


def _source_files() -> list[Path]:
    found = {p for pattern in SOURCE_GLOBS for p in REPO.glob(pattern) if p.is_file()}
    return sorted(found)


# -- nav -----------------------------------------------------------------------------------------
def on_config(config):
    docs_dir = Path(config.docs_dir)
    nav = []
    for entry in config.nav or []:
        (title, value), = entry.items() if isinstance(entry, dict) else ((None, entry),)
        if title == NOTEBOOKS_SECTION:
            value = [f"notebooks/{nb.name}" for nb in _notebooks()]
            if not value:
                log.info("no notebooks/*.ipynb yet: the nav has no Notebooks section")
                continue
        elif title == LAB_SECTION:
            value = [f"lab/{p.name}" for p in sorted((docs_dir / "lab").glob("*.md"))]
            if not value:
                continue
        elif isinstance(value, str) and value in OPTIONAL_PAGES and not (docs_dir / value).is_file():
            log.info("%s does not exist yet: left out of the nav", value)
            continue
        nav.append({title: value} if title is not None else value)
    config.nav = nav
    return config


# -- files ---------------------------------------------------------------------------------------
# Before mkdocs-jupyter's on_files (priority 0), which turns *.ipynb files into pages.
@event_priority(50)
def on_files(files: Files, config) -> Files:
    for nb in _notebooks():
        # A real file under the repository root (not File.generated: mkdocs-jupyter's wrapper
        # needs src_dir to find the notebook again)
        files.append(File(f"notebooks/{nb.name}", src_dir=str(REPO), dest_dir=config.site_dir,
                          use_directory_urls=config.use_directory_urls))
    for path in _source_files():
        rel = path.relative_to(REPO).as_posix()
        files.append(File.generated(config, f"{SOURCE_PREFIX}{rel}.md", content=_source_page(path, rel)))
    return files


def _source_page(path: Path, rel: str) -> str:
    code = path.read_text(encoding="utf-8")
    lang = LANGUAGES.get(path.suffix) or LANGUAGES.get(path.name, "text")
    longest = max((len(m) for m in re.findall(r"`+", code)), default=0)
    fence = "`" * max(3, longest + 1)
    return (f"---\nsearch:\n  exclude: true\nhide:\n  - toc\n---\n\n# {rel}\n\n"
            f"{fence}{lang} linenums=\"1\"\n{code}\n{fence}\n")


def on_serve(server, config, builder):
    for folder in ("notebooks", "phases", "tinyvllm"):
        server.watch(str(REPO / folder))
    return server


# -- links ---------------------------------------------------------------------------------------
def _split(target: str) -> tuple[str, str]:
    """'path#frag' -> ('path', '#frag')."""
    for sep in ("#", "?"):
        if sep in target:
            i = target.index(sep)
            return target[:i], target[i:]
    return target, ""


def _is_external(target: str) -> bool:
    return bool(re.match(r"^[a-z][a-z0-9+.-]*:", target, re.I)) or target.startswith(("/", "#"))


def _site_src_uri(repo_path: Path, files: Files, docs_dir: Path) -> str | None:
    """The src_uri of the site page that stands for a repository file or folder, if any."""
    try:
        rel = repo_path.relative_to(REPO).as_posix()
    except ValueError:
        return None  # outside the repository
    if rel == "docs" or rel.startswith("docs/"):
        return None  # already a docs/ file: MkDocs resolves it
    if rel.endswith("/README.md"):
        rel = rel[: -len("/README.md")]
    m = PHASE_DIR.match(rel)
    if m:  # a phase folder or its README -> docs/phases/NN-slug.md
        lesson = f"phases/{m.group(1)}-{m.group(2).replace('_', '-')}.md"
        return lesson if files.get_file_from_path(lesson) else None
    for candidate in (rel, f"{SOURCE_PREFIX}{rel}.md"):
        if files.get_file_from_path(candidate):
            return candidate
    return None


def _rewrite(target: str, base_dir: Path, files: Files, docs_dir: Path) -> str | None:
    """The src_uri (plus fragment) `target`, seen from `base_dir`, should point at; None to
    leave it as it is."""
    if _is_external(target):
        return None
    path, frag = _split(target)
    if not path:
        return None
    src_uri = _site_src_uri((base_dir / path).resolve(), files, docs_dir)
    if src_uri is None:
        return None
    line = re.fullmatch(r"#L(\d+)", frag)
    if line and src_uri.startswith(SOURCE_PREFIX):  # GitHub's line anchors -> pymdownx's
        frag = f"#__codelineno-0-{line.group(1)}"
    return src_uri + frag


def on_page_markdown(markdown: str, page, config, files: Files) -> str:
    """Markdown pages: repository links -> site pages (after include-markdown, priority 100)."""
    if page.file.abs_src_path and not page.file.generated_by:
        base_dir = Path(page.file.abs_src_path).parent
    else:
        base_dir = Path(config.docs_dir) / posixpath.dirname(page.file.src_uri)
    docs_dir = Path(config.docs_dir)
    here = posixpath.dirname(page.file.src_uri)

    def fix(m: re.Match) -> str:
        new = _rewrite(m.group(3), base_dir, files, docs_dir)
        if new is None:
            return m.group(0)
        path, frag = _split(new)
        rel = posixpath.relpath(path, here or ".")
        return f"{m.group(1)}{m.group(2)}{rel}{frag}{m.group(4)}{m.group(5)}"

    return MD_LINK.sub(fix, _notebook_link(markdown, page, files))


def _notebook_link(markdown: str, page, files: Files) -> str:
    m = LESSON_PAGE.match(page.file.src_uri)
    if not m or not NOTEBOOK_MARK.search(markdown):
        return markdown
    nb = f"notebooks/{m.group(1)}_{m.group(2).replace('-', '_')}.ipynb"
    note = ""
    if files.get_file_from_path(nb):
        note = (f'!!! tip "Run it step by step"\n'
                f"    The notebook [{posixpath.basename(nb)}](../{nb}) runs this lesson on the default "
                f"model, one step at a time, with pictures and measurements.")
    return NOTEBOOK_MARK.sub(lambda _: note, markdown)


def on_page_content(html: str, page, config, files: Files) -> str:
    """Notebook pages (HTML from nbconvert, which MkDocs does not resolve): links written
    relative to notebooks/ -> the pages' URLs."""
    if not page.file.src_uri.endswith(".ipynb"):
        return html
    base_dir = Path(page.file.abs_src_path).parent
    docs_dir = Path(config.docs_dir)

    def fix(m: re.Match) -> str:
        target = m.group(3)
        if _is_external(target):
            return m.group(0)
        path, frag = _split(target)
        new = _rewrite(target, base_dir, files, docs_dir)
        if new is None:
            # a docs/ file written relative to notebooks/ (../docs/glossary.md)
            resolved = (base_dir / path).resolve()
            try:
                new = resolved.relative_to(docs_dir.resolve()).as_posix() + frag
            except ValueError:
                return m.group(0)
        new_path, new_frag = _split(new)
        file = files.get_file_from_path(new_path)
        if file is None:
            return m.group(0)
        url = get_relative_url(file.url, page.url)
        return f"{m.group(1)}{m.group(2)}{url}{new_frag}{m.group(2)}"

    return _download_button(page) + _collapse_solutions(HTML_LINK.sub(fix, html))


def _collapse_solutions(html: str) -> str:
    """Each notebook cell tagged `solution` (nbconvert gives its div the class
    `celltag_solution`) goes inside a closed <details>: the learner opens it after trying the
    exercise, as JupyterLab shows it collapsed (`jupyter.source_hidden`). Done here, on the
    built HTML, so the page needs no script."""
    out, pos = [], 0
    for m in SOLUTION_CELL.finditer(html):
        if m.start() < pos:
            continue  # the inner div of a cell already wrapped (the template nests two)
        end = _div_end(html, m.start())
        if end is None:
            log.warning("unbalanced <div> after a solution cell: left as it is")
            break
        out += [html[pos:m.start()], SOLUTION_OPEN, html[m.start():end], "</details>"]
        pos = end
    return "".join(out) + html[pos:]


def _div_end(html: str, start: int) -> int | None:
    """The index just after the </div> that closes the <div> at `start`."""
    depth = 0
    for tag in DIV_TAG.finditer(html, start):
        depth += -1 if tag.group(1) else 1
        if depth == 0:
            return tag.end()
    return None


def _download_button(page) -> str:
    """A "download the .ipynb" button (mkdocs-jupyter's include_source copies the notebook
    beside the page), in Material's style for page actions."""
    name = posixpath.basename(page.file.src_uri)
    return (f'<a href="{name}" download title="Download {name}" class="md-content__button md-icon">'
            '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 24 24">'
            '<path d="M5 20h14v-2H5m14-9h-4V3H9v6H5l7 7z"/></svg></a>\n')
