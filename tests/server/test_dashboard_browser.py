"""GET /dashboard in a real browser: headless Chromium (Debian's, scripts/setup_browser.sh) driven by
Playwright, against a live server with --enable-dashboard and an API key, while requests run.

Where the browser or Playwright is missing the tests skip, unless RADIXSERVE_REQUIRE_BROWSER is set
(scripts/test.sh sets it): then they fail, so CI cannot pass without having run them.
Every wait is on the page's state with a generous timeout, never a sleep sized to this machine.
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any

import httpx
import pytest

from tests.server.conftest import LiveServer, finish, launch

if TYPE_CHECKING:
    from playwright.sync_api import Browser, Page

CHROMIUM = Path("/usr/bin/chromium")
CHROMIUM_ARGS = [
    "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run", "--disable-background-networking",
    "--disable-component-update", "--disable-sync",
]  # fmt: skip
API_KEY = "dashboard-test-key"
# Milliseconds; a 2-core CI machine under load can be very slow, and a pass must not depend on it.
WAIT_MS = 120_000
HOSTILE_RID = '<img src=x onerror="window.__pwned=1">'
HOSTILE_TEXT = "<script>window.__pwned=2</script><b>bold</b> shared prefix"


def artifacts_dir() -> Path:
    named = os.environ.get("RADIXSERVE_TEST_ARTIFACTS")
    path = Path(named) if named else Path(__file__).resolve().parents[2] / "test-artifacts"
    path.mkdir(parents=True, exist_ok=True)
    return path


@pytest.fixture(scope="module")
def browser() -> Iterator[Browser]:
    problem = None
    try:
        from playwright.sync_api import sync_playwright
    except ImportError as exc:
        problem = f"playwright is not importable ({exc})"
    if problem is None and not CHROMIUM.exists():
        problem = f"{CHROMIUM} is absent"
    if problem is not None:
        if os.environ.get("RADIXSERVE_REQUIRE_BROWSER"):
            pytest.fail(f"{problem}, and RADIXSERVE_REQUIRE_BROWSER is set (run scripts/setup_browser.sh)")
        pytest.skip(problem)
    with sync_playwright() as playwright:
        chromium = playwright.chromium.launch(
            executable_path=str(CHROMIUM), args=CHROMIUM_ARGS, headless=True
        )
        yield chromium
        chromium.close()


@pytest.fixture(scope="module")
def dashboard_server(
    tiny_model_dir: Callable[[str], Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[LiveServer]:
    """One server for the module (start_server's machinery, shared): a start is ~10 s of CI."""
    live = launch(
        tiny_model_dir("llama"), tmp_path_factory.mktemp("dashboard"), "--enable-dashboard", api_key=API_KEY
    )
    yield live
    finish(live)


def workload_prompts(tokenizer: Any) -> list[list[int]]:
    """Token ids of prompts under one shared prefix, with branches and twigs below it, so the radix
    tree has levels and hits (text, so the tree's previews are readable on the screenshot)."""
    prefix = "You are a careful assistant who answers in one short paragraph. "
    topics = ["Tell me about the history of ", "Explain how to cook ", "Write a poem about "]
    things = ["bread", "the sea", "old maps", "mountains"]
    return [tokenizer.encode(prefix + topic + thing + ".") for topic in topics for thing in things]


class Workload:
    """Requests in background threads until stopped, two at a time, so some run while others wait."""

    def __init__(self, server: LiveServer, prompts: list[list[int]], threads: int = 2):
        self.server = server
        self.prompts = prompts
        self.stop_event = threading.Event()
        self.errors: list[BaseException] = []
        self.done = 0
        self._next = itertools.cycle(prompts)
        self._threads = [threading.Thread(target=self._run, daemon=True) for _ in range(threads)]

    def _run(self) -> None:
        try:
            with self.server.client() as client:
                while not self.stop_event.is_set():
                    body = {
                        "input_ids": next(self._next),
                        "sampling_params": {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True},
                    }
                    response = client.post("/generate", json=body)
                    response.raise_for_status()
                    self.done += 1
        except BaseException as exc:
            self.errors.append(exc)

    def __enter__(self) -> Workload:
        for thread in self._threads:
            thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        # The server must be idle when the test ends (conftest.finish checks its KV accounting).
        self.stop_event.set()
        for thread in self._threads:
            thread.join(timeout=300)
        assert not any(t.is_alive() for t in self._threads), "workload threads did not stop"


def open_dashboard(browser: Browser, server: LiveServer) -> tuple[Page, list[str]]:
    """A fresh context (no cookie yet) on /dashboard?api_key=...; returns the page and a list that
    collects its uncaught script errors."""
    page = browser.new_context(viewport={"width": 1400, "height": 1000}).new_page()
    errors: list[str] = []
    page.on("pageerror", lambda exc: errors.append(str(exc)))
    try:
        page.goto(f"{server.base_url}/dashboard?api_key={API_KEY}")
        # The server swapped the key for a cookie and redirected: the key is not left in the address bar.
        assert page.url == f"{server.base_url}/dashboard", page.url
    except BaseException:
        page.context.close()
        raise
    return page, errors


def number(page: Page, testid: str) -> float | None:
    text = (page.get_by_test_id(testid).text_content() or "").replace(",", "").strip()
    try:
        return float(text)
    except ValueError:
        return None  # "—": no data yet


def wait_for_js(page: Page, expression: str, arg: Any = None) -> None:
    page.wait_for_function(expression, arg=arg, timeout=WAIT_MS, polling=250)


def numeric_at_least(testid: str) -> str:
    """JS predicate: the element's number (thousands separators dropped) is >= arg."""
    return (
        "(min) => { const el = document.querySelector('[data-testid=\"" + testid + "\"]');"
        " const v = el ? parseFloat(el.textContent.replace(/,/g, '')) : NaN; return v >= min; }"
    )


def count_at_least(testid: str) -> str:
    return f"(min) => document.querySelectorAll('[data-testid=\"{testid}\"]').length >= min"


def test_dashboard_shows_live_state_while_requests_run(
    browser: Browser, dashboard_server: LiveServer, tiny_tokenizer: Any
) -> None:
    from playwright.sync_api import expect

    server = dashboard_server
    # The routes are behind the key: neither the stream nor a snapshot answers without it.
    for path in ("/dashboard/events", "/dashboard/snapshot"):
        with httpx.stream("GET", f"{server.base_url}{path}", timeout=60) as response:
            assert response.status_code == 401, (path, response.status_code)
    with server.client() as client:  # the bearer header works as on every route
        snapshot = client.get("/dashboard/snapshot")
        assert snapshot.status_code == 200, snapshot.text
        assert snapshot.json()["replicas"], snapshot.json()

    with Workload(server, workload_prompts(tiny_tokenizer)) as workload:
        page, page_errors = open_dashboard(browser, server)
        try:
            expect(page.get_by_test_id("status")).to_have_text("live", timeout=WAIT_MS)
            wait_for_js(page, numeric_at_least("updates"), 3)
            wait_for_js(page, numeric_at_least("total-requests"), 0)
            first_total = number(page, "total-requests")
            assert first_total is not None
            wait_for_js(page, numeric_at_least("total-requests"), first_total + 1)
            # Throughput is over the last 5 s, and requests run throughout: it is positive at some point.
            wait_for_js(page, "() => parseFloat(document.querySelector('[data-testid=\"output-tok-s\"]')"
                        ".textContent) > 0")  # fmt: skip
            wait_for_js(page, count_at_least("radix-node"), 2)
            wait_for_js(page, count_at_least("recent-row"), 1)
            expect(page.get_by_test_id("kv-bar")).to_have_count(1, timeout=WAIT_MS)  # one replica
            expect(page.get_by_test_id("radix-tree")).to_have_count(1, timeout=WAIT_MS)
            # A few more seconds of history for the screenshot's sparkline.
            wait_for_js(page, numeric_at_least("updates"), 12)
            assert page_errors == [], page_errors
            shot = artifacts_dir() / "dashboard.png"
            page.screenshot(path=str(shot), full_page=True)
            print(f"dashboard screenshot: {shot}")
        except BaseException:
            failed = artifacts_dir() / "dashboard-failure.png"
            page.screenshot(path=str(failed), full_page=True)
            print(f"dashboard screenshot at the failure: {failed}")
            raise
        finally:
            page.context.close()  # ends the event stream before the server is stopped
    assert not workload.errors, workload.errors
    assert workload.done > 0


def test_user_text_shows_as_text_not_markup(browser: Browser, dashboard_server: LiveServer) -> None:
    from playwright.sync_api import expect

    server = dashboard_server
    page, page_errors = open_dashboard(browser, server)
    try:
        expect(page.get_by_test_id("status")).to_have_text("live", timeout=WAIT_MS)
        with server.client() as client:
            body = {"text": HOSTILE_TEXT, "rid": HOSTILE_RID, "sampling_params": {"max_new_tokens": 4}}
            response = client.post("/generate", json=body)
            assert response.status_code == 200, response.text
        # The rid appears verbatim, as text, in the recent requests...
        row = page.get_by_test_id("recent-row").filter(has_text=HOSTILE_RID)
        expect(row.first).to_be_visible(timeout=WAIT_MS)
        # ...and the prompt's decoded tokens, in the radix tree, as text too.
        wait_for_js(
            page,
            "() => [...document.querySelectorAll('[data-testid=\"radix-node\"] title')]"
            ".some((t) => t.textContent.includes('<scr'))",
        )
        # Nothing of it became an element or ran.
        assert page.evaluate("document.querySelectorAll('img, b').length") == 0
        assert page.evaluate("document.scripts.length") == 1
        assert page.evaluate("window.__pwned") is None
        assert page_errors == [], page_errors
    finally:
        page.context.close()
