"""The documentation site: it builds with `mkdocs build --strict`, every internal link of the
built site resolves, and its pages render in headless Chromium without a console error. The home
page shows the phase ladder chart (a bench plot from docs/assets/bench/), the glossary defines
every term the lessons use, and each notebook's exercise solution stays in a closed <details>
until it is clicked.

`pytest -m docs` runs only these. The site is served from a temporary folder by a local HTTP
server on 127.0.0.1; Chromium (Debian's `chromium`, which scripts/setup.sh installs) is driven
over the DevTools protocol, which reports console messages, uncaught exceptions and failed loads.
Chromium resolves no host but 127.0.0.1, so a page that needs the network fails here, as it would
for a learner offline.

Set TINYVLLM_DOCS_SCREENSHOTS=<folder> to keep a screenshot of every page the browser opens.
"""

from __future__ import annotations

import base64
import functools
import importlib.util
import json
import os
import shutil
import subprocess
import sys
import tempfile
import threading
import time
import urllib.error
import urllib.request
from concurrent.futures import Future, wait
from html.parser import HTMLParser
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import unquote, urldefrag, urljoin, urlsplit

import pytest
from conftest import BACKGROUND_RUNS

pytestmark = pytest.mark.docs

REPO = Path(__file__).resolve().parents[1]
CHROMIUM_NAMES = ("chromium", "chromium-browser", "google-chrome")
CHROMIUM_FLAGS = [
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
    "--disable-extensions", "--disable-dev-shm-usage", "--window-size=1280,1600",
    "--host-resolver-rules=MAP * ~NOTFOUND, EXCLUDE 127.0.0.1",
]


# The words the glossary must define, each under a heading of its own (the lessons link to them)
GLOSSARY_TERMS = ("KV cache", "Block", "Slot", "Block table", "Prefill", "Decode",
                  "Chunked prefill", "Preemption", "Prefix cache", "TTFT", "TPOT",
                  "Grouped-query attention", "Online softmax", "Split-KV", "Quantization",
                  "Speculative decoding", "CUDA graph", "Batch invariance", "VNNI",
                  "Memory-bound and compute-bound", "Roofline", "W8A16 and W8A8", "e4m3", "AMX",
                  "oneDNN", "fbgemm", "Warp", "Structured outputs", "Persistent batch",
                  "Operator dispatch", "Inductor", "GGUF", "Rejection sampling",
                  "Acceptance rate", "Perplexity", "Tensor parallelism", "All-reduce",
                  "Custom operator", "Guard", "Engine core", "GIL", "KV connector", "Offload tier")
SOLUTION_TAG = "solution"


def _first_heading(markdown: str) -> str:
    return next(line[2:].strip() for line in markdown.splitlines() if line.startswith("# "))


def _slug(heading: str) -> str:
    """The id Python-Markdown's toc extension gives a plain heading."""
    return "-".join(heading.lower().split())


def _solution_cells(nb: Path) -> list[dict]:
    return [c for c in json.loads(nb.read_text())["cells"]
            if SOLUTION_TAG in c.get("metadata", {}).get("tags", [])]


# -- build and serve -----------------------------------------------------------------------------
DOCS_MODULES = ("mkdocs", "material", "mkdocstrings_handlers.python", "mkdocs_jupyter",
                "mkdocs_include_markdown_plugin")


def build(out: Path, env: dict[str, str]) -> str | None:
    """`mkdocs build --strict` into `out`: None, or what failed or warned."""
    env = {k: v for k, v in env.items() if k not in ("SITE_URL", "REPO_URL")}
    env["NO_MKDOCS_2_WARNING"] = "1"
    # not --quiet: with it mkdocs hides the warnings and exits 0 despite --strict
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict",
                        "-f", str(REPO / "mkdocs.yml"), "-d", str(out)],
                       cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    warnings = [line for line in (r.stdout + r.stderr).splitlines() if line.startswith("WARNING")]
    if r.returncode == 0 and not warnings:
        return None
    return "mkdocs build --strict failed or warned:\n" + "\n".join(warnings) + f"\n{r.stderr[-6000:]}"


def build_in_background(after: list[Future]) -> Future | None:
    """Build the site in a thread once `after` (the notebooks' runs) are done, and return at once a
    Future of (folder, error or None): like the notebooks, the build (half a minute of one core)
    runs beside the other tests. A test that needs the site before the build has started cancels
    the Future and builds it itself (`site`). None where the dev extras are missing (they skip)."""
    if any(importlib.util.find_spec(m.split(".")[0]) is None for m in DOCS_MODULES):
        return None
    future, env = Future(), dict(os.environ)   # the environment now, before a test changes it

    def run():
        wait(after)
        if future.set_running_or_notify_cancel():   # False: a test took the build over
            out = Path(tempfile.mkdtemp(prefix="tinyvllm-site-"))
            try:
                future.set_result((out, build(out, env)))
            except BaseException as e:
                future.set_exception(e)
    threading.Thread(target=run, name="docs", daemon=True).start()
    return future


@pytest.fixture(scope="module")
def site(request, tmp_path_factory) -> Path:
    for module in DOCS_MODULES:
        pytest.importorskip(module, reason="the docs need the dev extras: pip install -e '.[dev]'")
    run = request.config.stash.get(BACKGROUND_RUNS, {}).get("site")
    if run is None or run.cancel():   # not started in the background: build it here, now
        out = tmp_path_factory.mktemp("site")
        error = build(out, dict(os.environ))
    else:
        out, error = run.result()
    assert error is None, error
    return out


class _QuietHandler(SimpleHTTPRequestHandler):
    def log_message(self, *args) -> None:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True

    def handle_error(self, request, client_address) -> None:
        if not isinstance(sys.exc_info()[1], ConnectionError):  # a browser that hung up early
            super().handle_error(request, client_address)


@pytest.fixture(scope="module")
def base_url(site):
    server = _Server(("127.0.0.1", 0), functools.partial(_QuietHandler, directory=str(site)))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}/"
    server.shutdown()
    server.server_close()


def test_site_has_every_lesson_and_notebook(site):
    """A lesson page for every phase README, a page for every notebook, the glossary, the API."""
    for readme in sorted(REPO.glob("phases/p[0-9][0-9]_*/README.md")):
        number, slug = readme.parent.name[1:3], readme.parent.name[4:].replace("_", "-")
        page = site / "phases" / f"{number}-{slug}" / "index.html"
        assert page.is_file(), f"no lesson page for {readme.relative_to(REPO)}: add docs/phases/{number}-{slug}.md"
        html = page.read_text()
        assert _first_heading(readme.read_text()) in html
        notebook = REPO / "notebooks" / f"{number}_{readme.parent.name[4:]}.ipynb"
        if notebook.is_file():
            assert f"notebooks/{notebook.stem}/" in html, f"the {number} lesson does not link to {notebook.name}"
    for nb in sorted(REPO.glob("notebooks/*.ipynb")):
        assert (site / "notebooks" / nb.stem / "index.html").is_file(), f"no page for {nb.name}"
    for page in ("glossary", "api/llm", "api/engines"):
        assert (site / page / "index.html").is_file(), page


def test_glossary_defines_every_term(site):
    """Every term the lessons rely on is a heading of docs/glossary.md with a definition under it,
    and the built page has its anchor (glossary/#kv-cache, ...)."""
    sections: dict[str, str] = {}
    heading = None
    for line in (REPO / "docs" / "glossary.md").read_text().splitlines():
        if line.startswith("## "):
            heading = line[3:].strip()
            sections[heading] = ""
        elif heading is not None:
            sections[heading] += line + "\n"
    html = (site / "glossary" / "index.html").read_text()
    for term in GLOSSARY_TERMS:
        assert term in sections, f"docs/glossary.md has no '## {term}'"
        assert len(sections[term].split()) >= 15, f"the glossary's {term!r} has no real definition"
        assert f'id="{_slug(term)}"' in html, f"the glossary page has no #{_slug(term)}"


class _Solutions(HTMLParser):
    """The cells of a notebook page (ids `cell-id=...`), and for each whether it sits inside a
    closed <details> (one without `open`)."""

    def __init__(self) -> None:
        super().__init__()
        self.stack: list[bool] = []  # per open div/details: is it (or an ancestor) a closed details
        self.hidden: dict[str, bool] = {}

    def handle_starttag(self, tag, attrs):
        if tag not in ("div", "details"):
            return
        a = dict(attrs)
        inside = bool(self.stack and self.stack[-1])
        self.stack.append(inside or (tag == "details" and "open" not in a))
        if (a.get("id") or "").startswith("cell-id="):
            self.hidden[a["id"][len("cell-id="):]] = inside

    def handle_endtag(self, tag):
        if tag in ("div", "details") and self.stack:
            self.stack.pop()


def test_notebook_solutions_are_collapsed(site):
    """Every notebook has an exercise whose solution cell is tagged `solution` and hidden
    in JupyterLab (`jupyter.source_hidden`, `outputs_hidden`), and on the site it is inside a
    closed <details>, while every other cell is not."""
    notebooks = sorted(REPO.glob("notebooks/*.ipynb"))
    assert notebooks
    for nb in notebooks:
        cells = json.loads(nb.read_text())["cells"]
        headings = [line for c in cells if c["cell_type"] == "markdown"
                    for line in "".join(c["source"]).splitlines() if line.startswith("## ")]
        assert "## Exercise" in headings, f"{nb.name} has no '## Exercise'"
        solutions = _solution_cells(nb)
        assert solutions, f"{nb.name}: no cell tagged {SOLUTION_TAG!r} (the exercise's solution)"
        for cell in solutions:
            assert cell["cell_type"] == "code", \
                f"{nb.name}: a {cell['cell_type']} cell is tagged {SOLUTION_TAG!r}"
            jupyter = cell["metadata"].get("jupyter", {})
            assert jupyter.get("source_hidden") is True and jupyter.get("outputs_hidden") is True, \
                f"{nb.name}: solution cell {cell['id']} is not collapsed in JupyterLab: {jupyter}"
        parser = _Solutions()
        parser.feed((site / "notebooks" / nb.stem / "index.html").read_text(encoding="utf-8"))
        expected = {c["id"]: SOLUTION_TAG in c.get("metadata", {}).get("tags", []) for c in cells}
        hidden = sorted(k for k, v in parser.hidden.items() if v)
        assert parser.hidden == expected, f"{nb.name}: the cells in a closed <details> on its page " \
            f"are {hidden}, its solution cells {sorted(k for k, v in expected.items() if v)}"


# -- links -------------------------------------------------------------------------------------
class _Links(HTMLParser):
    """The ids of a page, and every URL it links to or loads."""

    def __init__(self) -> None:
        super().__init__()
        self.ids: set[str] = set()
        self.urls: list[str] = []

    def handle_starttag(self, tag, attrs):
        a = dict(attrs)
        for name in ("id", "name"):
            if a.get(name) and (name == "id" or tag == "a"):
                self.ids.add(a[name])
        if tag in ("a", "link") and a.get("href"):
            self.urls.append(a["href"])
        if tag in ("script", "img", "iframe", "source") and a.get("src"):
            self.urls.append(a["src"])


def test_no_broken_internal_links(site, base_url):
    """Every link and resource of every built page resolves (served over HTTP), and every
    #fragment names an element of its target page."""
    pages: dict[str, _Links] = {}
    for html in sorted(site.rglob("*.html")):
        parser = _Links()
        parser.feed(html.read_text(encoding="utf-8"))
        rel = html.relative_to(site).as_posix()
        url = urljoin(base_url, rel[: -len("index.html")] if rel.endswith("index.html") else rel)
        pages[url] = parser
    status: dict[str, int] = {}
    broken = []
    for page_url, parser in pages.items():
        for link in parser.urls:
            target, frag = urldefrag(urljoin(page_url, link))
            if not target.startswith(base_url):
                continue  # another site: not ours to check (and the network is closed)
            if target not in status:
                try:
                    with urllib.request.urlopen(target, timeout=10) as resp:
                        status[target] = resp.status
                except urllib.error.HTTPError as e:
                    status[target] = e.code
            if status[target] != 200:
                broken.append(f"{page_url}: {link} -> HTTP {status[target]}")
            elif frag and target in pages and unquote(frag) not in pages[target].ids:
                broken.append(f"{page_url}: {link} -> no id {frag!r} in the target")
    assert len(pages) > 10 and len(status) > 20, (len(pages), len(status))
    assert not broken, f"{len(broken)} broken internal links:\n" + "\n".join(broken[:50])


# -- the browser ---------------------------------------------------------------------------------
class Chromium:
    """A headless Chromium with one tab, driven over the DevTools protocol (websocket-client)."""

    def __init__(self, binary: str, profile: Path):
        import websocket

        self.proc = subprocess.Popen(
            [binary, *CHROMIUM_FLAGS, f"--user-data-dir={profile}", "--remote-debugging-port=0",
             "about:blank"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        port_file = profile / "DevToolsActivePort"
        deadline = time.monotonic() + 60
        while not (port_file.is_file() and len(port_file.read_text().split()) >= 2):
            if self.proc.poll() is not None or time.monotonic() > deadline:
                self.close()
                raise RuntimeError(f"{binary} did not start (exit code {self.proc.returncode})")
            time.sleep(0.1)
        port = int(port_file.read_text().split()[0])
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=10) as resp:
                tab = next(t for t in json.load(resp) if t["type"] == "page")
            self.ws = websocket.create_connection(tab["webSocketDebuggerUrl"], timeout=30,
                                                  suppress_origin=True)
        except Exception:
            self.close()
            raise
        self.next_id = 0
        self.events: list[dict] = []
        for domain in ("Page", "Runtime", "Log"):
            self.send(f"{domain}.enable")

    def close(self) -> None:
        if getattr(self, "ws", None) is not None:
            self.ws.close()
        self.proc.terminate()
        try:
            self.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()

    def _recv(self, timeout: float) -> dict | None:
        import websocket

        self.ws.settimeout(max(timeout, 0.01))
        try:
            return json.loads(self.ws.recv())
        except websocket.WebSocketTimeoutException:
            return None

    def send(self, method: str, params: dict | None = None, timeout: float = 30) -> dict:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params or {}}))
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            msg = self._recv(deadline - time.monotonic())
            if msg is None:
                continue
            if msg.get("id") == self.next_id:
                if "error" in msg:
                    raise RuntimeError(f"{method}: {msg['error']}")
                return msg.get("result", {})
            if "method" in msg:
                self.events.append(msg)
        raise TimeoutError(f"{method}: no answer in {timeout} s")

    def wait_for(self, event: str, timeout: float = 30) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if any(e["method"] == event for e in self.events):
                return
            msg = self._recv(deadline - time.monotonic())
            if msg is not None and "method" in msg:
                self.events.append(msg)
        raise TimeoutError(f"no {event} in {timeout} s")

    def drain(self, seconds: float) -> None:
        """Keep collecting events for `seconds` (scripts that run after the load event)."""
        deadline = time.monotonic() + seconds
        while (remaining := deadline - time.monotonic()) > 0:
            msg = self._recv(remaining)
            if msg is not None and "method" in msg:
                self.events.append(msg)

    def open(self, url: str) -> None:
        self.events.clear()
        result = self.send("Page.navigate", {"url": url})
        if result.get("errorText"):
            raise AssertionError(f"{url}: {result['errorText']}")
        self.wait_for("Page.loadEventFired")
        self.drain(0.5)

    def evaluate(self, expression: str):
        result = self.send("Runtime.evaluate", {"expression": expression, "returnByValue": True})
        if "exceptionDetails" in result:
            raise RuntimeError(f"{expression}: {result['exceptionDetails']}")
        return result["result"].get("value")

    def screenshot(self, path: Path) -> None:
        data = self.send("Page.captureScreenshot", {"format": "png"})["data"]
        path.write_bytes(base64.b64decode(data))

    def console_errors(self) -> list[str]:
        errors = []
        for e in self.events:
            p = e.get("params", {})
            if e["method"] == "Runtime.exceptionThrown":
                d = p["exceptionDetails"]
                errors.append(f"uncaught: {d.get('exception', {}).get('description') or d.get('text')}")
            elif e["method"] == "Runtime.consoleAPICalled" and p.get("type") in ("error", "assert"):
                errors.append("console.error: " + " ".join(
                    str(a.get("value", a.get("description", ""))) for a in p.get("args", [])))
            elif e["method"] == "Log.entryAdded" and p["entry"]["level"] == "error":
                errors.append(f"{p['entry']['source']}: {p['entry']['text']} {p['entry'].get('url', '')}")
        return errors


@pytest.fixture(scope="module")
def browser(tmp_path_factory):
    pytest.importorskip("websocket", reason="the browser test needs websocket-client: pip install -e '.[dev]'")
    binary = next((b for name in CHROMIUM_NAMES if (b := shutil.which(name))), None)
    if binary is None:
        pytest.skip("Chromium is not installed (on Debian, scripts/setup.sh installs it)")
    chrome = Chromium(binary, tmp_path_factory.mktemp("chromium-profile"))
    yield chrome
    chrome.close()


def _pages_to_open() -> list:
    """(path, texts the page must show): the home page, a lesson, a notebook, and more."""
    lesson = REPO / "phases" / "p01_naive_attention" / "README.md"
    pages = [
        ("", ["The phase ladder", "make demo", "make test"]),
        ("phases/01-naive-attention/", [_first_heading(lesson.read_text()), "The checkpoint"]),
        ("glossary/", list(GLOSSARY_TERMS)),
        ("api/llm/", ["LLM", "SamplingParams", "max_tokens"]),
    ]
    notebooks = sorted(REPO.glob("notebooks/[0-9][0-9]_*.ipynb"))
    lessons = [nb for nb in notebooks if not nb.name.startswith("00_")]
    for nb in (lessons or notebooks)[:1]:
        cells = json.loads(nb.read_text())["cells"]
        heading = _first_heading("\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "markdown"))
        pages.append((f"notebooks/{nb.stem}/", [heading]))
    return [pytest.param(path, texts, id=path.strip("/") or "home") for path, texts in pages]


@pytest.mark.parametrize("path, texts", _pages_to_open())
def test_page_renders_without_console_errors(browser, base_url, path, texts):
    browser.open(base_url + path)
    shots = os.environ.get("TINYVLLM_DOCS_SCREENSHOTS")
    if shots:
        Path(shots).mkdir(parents=True, exist_ok=True)
        browser.screenshot(Path(shots) / f"{path.strip('/').replace('/', '_') or 'home'}.png")
    text = browser.evaluate("document.body.innerText")
    for expected in texts:
        assert expected in text, f"{path or '/'}: {expected!r} is not on the page"
    # Material's layout ran: the navigation and the search box exist
    assert browser.evaluate("!!document.querySelector('nav.md-nav--primary') && "
                            "!!document.querySelector('.md-search__input')")
    if path.startswith("notebooks/"):
        nb = REPO / "notebooks" / f"{path.split('/')[1]}.ipynb"
        cells = json.loads(nb.read_text())["cells"]
        if any(c.get("outputs") for c in cells if c["cell_type"] == "code"):
            assert browser.evaluate("document.querySelectorAll('.jp-OutputArea-output').length") > 0, \
                f"{nb.name} has outputs, but its page shows none"
    if path == "":
        # the phase ladder chart: a committed bench plot, loaded, its caption naming the command
        # that made it and linking to the benchmarks page
        charts = browser.evaluate("""[...document.querySelectorAll('article figure img')]
            .filter(img => new URL(img.src).pathname.includes('/assets/bench/'))
            .map(img => ({src: img.src, loaded: img.complete && img.naturalWidth > 0,
                          shown: img.getBoundingClientRect().width > 0,
                          caption: img.closest('figure').querySelector('figcaption')?.innerText,
                          links: [...img.closest('figure').querySelectorAll('figcaption a')]
                                 .map(a => a.href)}))""")
        assert charts, "the home page shows no bench plot (docs/assets/bench/*.png) in a figure"
        for chart in charts:
            assert chart["loaded"] and chart["shown"], f"the home page's chart is not shown: {chart['src']}"
            assert "tinyvllm bench" in (chart["caption"] or ""), \
                f"its caption names no command: {chart['caption']!r}"
            assert any(urlsplit(link).path.endswith("/benchmarks/") for link in chart["links"]), \
                f"its caption does not link to the benchmarks page: {chart['links']}"
    errors = browser.console_errors()
    assert not errors, f"{path or '/'}: console errors:\n" + "\n".join(errors)


def test_notebook_solution_opens_on_click(browser, base_url):
    """On a notebook page the exercise's solution is hidden in a closed <details> until its
    summary is clicked (a real mouse click), and then shows its code and output."""
    notebooks = sorted(REPO.glob("notebooks/[0-9][0-9]_*.ipynb"))
    nb = next((n for n in notebooks if not n.name.startswith("00_") and _solution_cells(n)), None)
    if nb is None:
        pytest.skip("no notebook has a solution cell yet")
    cell = _solution_cells(nb)[0]
    first_line = next(line.strip() for line in "".join(cell["source"]).splitlines() if line.strip())
    browser.open(f"{base_url}notebooks/{nb.stem}/")
    state = f"""(() => {{
        const cell = document.getElementById({json.dumps("cell-id=" + cell["id"])});
        const details = cell && cell.closest('details');
        return {{found: !!cell, details: !!details, open: !!(details && details.open),
                 visible: !!cell && cell.checkVisibility(),
                 text: document.body.innerText.includes({json.dumps(first_line)})}};
    }})()"""
    before = browser.evaluate(state)
    hidden = {"found": True, "details": True, "open": False, "visible": False, "text": False}
    assert before == hidden, f"{nb.name}: the solution is not hidden in a closed <details>: {before}"
    box = browser.evaluate(f"""(() => {{
        const summary = document.getElementById({json.dumps("cell-id=" + cell["id"])})
            .closest('details').querySelector('summary');
        summary.scrollIntoView({{block: 'center'}});
        const r = summary.getBoundingClientRect();
        return {{x: r.left + Math.min(40, r.width / 2), y: r.top + r.height / 2}};
    }})()""")
    for kind in ("mousePressed", "mouseReleased"):
        browser.send("Input.dispatchMouseEvent", {"type": kind, "x": box["x"], "y": box["y"],
                                                  "button": "left", "clickCount": 1})
    browser.drain(0.3)
    after = browser.evaluate(state)
    assert after == {"found": True, "details": True, "open": True, "visible": True, "text": True}, \
        f"{nb.name}: clicking the summary did not show the solution: {after}"
    errors = browser.console_errors()
    assert not errors, f"notebooks/{nb.stem}/: console errors:\n" + "\n".join(errors)
