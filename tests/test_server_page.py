"""The live page at GET / in headless Chromium (the docs test's browser helper): it loads, a chat
message streams an answer, and a burst shows several running requests and their KV blocks."""

from __future__ import annotations

import time

import pytest
from test_docs import browser  # noqa: F401 -- the fixture: a headless Chromium, or a skip with its reason
from test_server import API_KEY, start_server

from tinyvllm.testing import make_tiny_llama

pytestmark = pytest.mark.server


@pytest.fixture(scope="module")
def page_server(tmp_path_factory):
    # a tiny model wider and deeper than the suite's: its steps last long enough that the page's
    # polls (which the browser queues behind the burst's streams) see the burst running, on a
    # loaded machine too
    model = make_tiny_llama(tmp_path_factory.mktemp("page-model"), hidden_size=384, num_layers=8)
    proc, url = start_server(model, "--max-num-seqs", "4", "--api-key", API_KEY)
    yield url
    proc.terminate()
    proc.wait(30)


def _wait(browser, expression: str, timeout: float = 60):  # noqa: F811
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        value = browser.evaluate(expression)
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"not true within {timeout} s: {expression}")


def test_live_page_chat_and_burst(browser, page_server):  # noqa: F811
    browser.open(page_server + "/")
    assert browser.evaluate("document.title").startswith("tinyvllm")
    # the server has a key: the page says so until it is typed in
    _wait(browser, "document.getElementById('keynote').textContent.includes('API key')")
    browser.evaluate(f"const k = document.getElementById('key'); k.value = '{API_KEY}';"
                     "k.dispatchEvent(new Event('change')); true")
    _wait(browser, "document.getElementById('keynote').textContent === ''")
    _wait(browser, "document.getElementById('total').textContent !== '0'")   # the state arrived
    # a chat message streams an answer into the log
    browser.evaluate("document.getElementById('msg').value = 'hello there';"
                     "document.getElementById('chat').requestSubmit(); true")
    _wait(browser, "document.querySelector('#log .assistant') && "
                   "document.querySelector('#log .assistant').textContent.length > 0")
    # the burst: several requests running at once, each drawn with its blocks in the pool
    browser.evaluate("document.getElementById('burst').click(); true")
    running = _wait(browser, "(() => { const n = +document.getElementById('running').textContent;"
                             " return n >= 2 ? n : 0; })()")
    assert running >= 2
    rows = _wait(browser, "document.querySelectorAll('#requests tr.req').length >= 2 && "
                          "document.querySelectorAll('#requests tr.req').length")
    cells = _wait(browser, "document.querySelectorAll('#pool .cell.used').length")
    assert rows >= 2 and cells >= 2
    # with 4 seats and 10 requests, some wait; they all drain afterwards
    _wait(browser, "document.getElementById('running').textContent === '0' && "
                   "document.getElementById('waiting').textContent === '0'", timeout=120)
    # the page's polls before the key was typed were refused (the browser logs each 401); no other error
    assert not [e for e in browser.console_errors() if not ("401" in e and e.endswith("/v1/engine/state"))]
