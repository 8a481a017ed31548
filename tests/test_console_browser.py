"""The web console in a real browser: Playwright driving Debian's chromium (installed by `make test`)
against a real `tokenmill serve` on the default model. Screenshots go to a temp directory
(TOKENMILL_SCREENSHOT_DIR to choose it); the README's two pictures are made by this test."""

from __future__ import annotations

import json
import os
import shutil
import threading
import time
from pathlib import Path

import pytest

from server_harness import start_server, wait_until

playwright_api = pytest.importorskip("playwright.sync_api")

pytestmark = pytest.mark.slow

CHROMIUM = shutil.which("chromium") or shutil.which("chromium-browser")
if CHROMIUM is None:
    if os.environ.get("CI"):  # make test / .ci/run install it: missing there is a failure, not a skip
        raise RuntimeError("chromium is not installed; `make test` installs it with apt")
    pytest.skip("chromium is not installed (make test installs it)", allow_module_level=True)

API_KEY = "console-test-key-5f2e"


@pytest.fixture(scope="module")
def screenshot_dir(tmp_path_factory) -> Path:
    chosen = os.environ.get("TOKENMILL_SCREENSHOT_DIR")
    path = Path(chosen) if chosen else tmp_path_factory.mktemp("screenshots")
    path.mkdir(parents=True, exist_ok=True)
    print(f"console screenshots: {path}")
    return path


@pytest.fixture(scope="module")
def browser():
    with playwright_api.sync_playwright() as p:
        launched = p.chromium.launch(executable_path=CHROMIUM, headless=True)
        yield launched
        launched.close()


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    process = start_server(["--cost-per-hour", "0.40", "--max-num-seqs", "16", "--peak-tflops", "2.0",
                            "--peak-bandwidth-gbs", "24"], tmp_path_factory.mktemp("console"))
    yield process
    assert process.stop() == 0, process.log()
    assert "Traceback" not in process.log()


@pytest.fixture
def page(browser, server):
    context = browser.new_context(viewport={"width": 1360, "height": 900})
    opened = context.new_page()
    opened.errors = []
    opened.on("pageerror", lambda exc: opened.errors.append(str(exc)))
    opened.on("console", lambda msg: opened.errors.append(msg.text) if msg.type == "error" else None)
    opened.goto(server.base_url + "/")
    yield opened
    context.close()


def stat(page, key: str) -> float | None:
    raw = page.get_attribute(f'[data-stat="{key}"] .value', "data-raw")
    return float(raw) if raw else None


def engine_stats(server) -> dict:
    return server.request("GET", "/v1/stats").json()["engine"]


def send_background_load(server, stop: threading.Event) -> threading.Thread:
    def run():
        i = 0
        while not stop.is_set():
            server.post("/v1/completions", {"prompt": f"Request {i}: the history of bread is", "max_tokens": 48,
                                            "temperature": 0.8, "seed": i})
            i += 1

    threads = [threading.Thread(target=run, daemon=True) for _ in range(4)]
    for thread in threads:
        thread.start()
    return threads


def test_dashboard_numbers_move_under_load(page, server, screenshot_dir):
    page.wait_for_selector("#connection.live")
    assert page.text_content("#model-name") == "SmolLM2-135M-Instruct"
    facts = page.text_content("#facts")
    assert "SmolLM2-135M-Instruct.Q4_1.gguf" in facts and "llama" in facts and "int4 g32" in facts
    generated_before = stat(page, "generation_tokens")
    stop = threading.Event()
    threads = send_background_load(server, stop)
    try:
        assert wait_until(lambda: (stat(page, "running") or 0) >= 2, timeout=60)
        assert wait_until(lambda: (stat(page, "output_tps") or 0) > 0 and (stat(page, "kv_usage") or 0) > 0)
        first = stat(page, "generation_tokens")
        assert first > (generated_before or 0)
        assert wait_until(lambda: stat(page, "generation_tokens") > first, timeout=10)  # live, not a snapshot
        assert wait_until(lambda: stat(page, "cost_output") is not None and stat(page, "itl_p50") is not None)
        assert (stat(page, "mfu") or 0) > 0 and (stat(page, "mbu") or 0) > 0  # against the given peaks
        assert "2.00 TFLOP/s, 24.0 GB/s" in page.text_content("#facts")
        assert page.locator("#recent tbody tr").count() > 0
        time.sleep(4)  # a few more points on the charts
        page.screenshot(path=str(screenshot_dir / "dashboard.png"), full_page=True)
    finally:
        stop.set()
        for thread in threads:
            thread.join(120)
    assert wait_until(lambda: stat(page, "running") == 0 and stat(page, "kv_usage") == 0, timeout=30)
    assert page.errors == []


def test_playground_streams_a_reply_token_by_token(page, server, screenshot_dir):
    page.click("#tab-playground")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "120")
    page.fill("#pg-input", "Write a short Python function that reverses a string, in a code block.")
    page.click("#pg-send")
    lengths = []
    deadline = time.time() + 60
    while time.time() < deadline:
        text = page.text_content(".message.assistant .content") or ""
        if not lengths or len(text) != lengths[-1]:
            lengths.append(len(text))
        if page.is_enabled("#pg-send") and page.get_attribute(".reply-stats", "data-finish"):
            break
        time.sleep(0.02)
    stats = page.locator(".reply-stats")
    assert stats.get_attribute("data-finish") in ("stop", "length")
    # seen growing, not arriving whole (markdown may shorten the text a little when a ** closes)
    assert len([n for n in lengths if n > 0]) >= 5, lengths
    assert float(stats.get_attribute("data-ttft")) > 0
    assert float(stats.get_attribute("data-tokens-per-second")) > 0
    assert int(stats.get_attribute("data-completion-tokens")) > 1
    assert int(stats.get_attribute("data-prompt-tokens")) > 10
    assert page.locator(".message.assistant .content pre code").count() >= 1  # the code block, rendered
    page.fill("#pg-input", "Now say hello in French.")
    page.click("#pg-send")
    assert wait_until(lambda: page.locator(".reply-stats").count() == 2
                      and page.locator(".reply-stats").nth(1).get_attribute("data-finish"), timeout=60)
    assert page.locator(".message.user").count() == 2  # the conversation is kept
    page.screenshot(path=str(screenshot_dir / "playground.png"), full_page=True)
    assert page.errors == []


def test_stop_aborts_the_reply_and_frees_its_kv_blocks(page, server):
    page.click("#tab-playground")
    page.fill("#pg-temperature", "0")  # greedy: this reply runs for hundreds of tokens, it ends by Stop
    page.fill("#pg-max-tokens", "2000")
    page.fill("#pg-input", "Tell me a very long story about a lighthouse keeper, with many chapters.")
    page.click("#pg-send")
    assert wait_until(lambda: len(page.text_content(".message.assistant .content") or "") > 40, timeout=60)
    assert engine_stats(server)["kv_cache"]["num_used_blocks"] > 0
    page.click("#pg-stop-button")
    page.wait_for_selector('.reply-stats[data-finish="stopped"]', timeout=10_000)
    stopped_at = len(page.text_content(".message.assistant .content"))
    assert wait_until(lambda: engine_stats(server)["kv_cache"]["num_used_blocks"] == 0, timeout=10)
    page.click("#tab-dashboard")
    assert wait_until(lambda: stat(page, "kv_usage") == 0 and stat(page, "running") == 0, timeout=10)
    request_id = page.get_attribute(".message.assistant", "data-id")
    row = page.locator("#recent tbody tr", has=page.locator(f'td:text-is("{request_id[:12]}")'))
    assert row.get_attribute("data-status") == "aborted"
    time.sleep(0.5)
    page.click("#tab-playground")
    assert len(page.text_content(".message.assistant .content")) == stopped_at  # nothing more arrived
    assert page.errors == []


def test_playground_sends_its_settings_and_the_server_honours_them(page, server):
    settings = {"temperature": 0.9, "top_p": 0.8, "max_tokens": 12, "seed": 1234, "stop": ["END", "STOP"]}
    messages = [{"role": "system", "content": "Answer with one word."}, {"role": "user", "content": "Name a colour."}]
    # the reference first: the page's request then finds the same prompt prefix cached, as this one's
    # repeat does (a bf16 prefix-cache hit may move a sampled token against a cold prompt)
    server.post("/v1/chat/completions", {"messages": messages, **settings})
    expected = server.post("/v1/chat/completions", {"messages": messages, **settings}).json()
    page.click("#tab-playground")
    page.fill("#pg-system", "Answer with one word.")
    page.fill("#pg-temperature", "0.9")
    page.fill("#pg-top-p", "0.8")
    page.fill("#pg-max-tokens", "12")
    page.fill("#pg-seed", "1234")
    page.fill("#pg-stop", "END\nSTOP")
    page.fill("#pg-input", "Name a colour.")
    with page.expect_request("**/v1/chat/completions") as sent:
        page.click("#pg-send")
    body = json.loads(sent.value.post_data)
    assert body["messages"] == messages
    assert {key: body[key] for key in settings} == settings and body["stream"] is True
    page.wait_for_selector(".reply-stats[data-finish]:not([data-finish=''])")
    shown = page.text_content(".message.assistant .content")
    assert shown == expected["choices"][0]["message"]["content"].strip()  # seeded: the same sample
    page.click("#pg-clear")
    assert page.locator(".message").count() == 0
    assert page.errors == []


def test_raw_completion_streams_emoji_whole(page, server):
    """Raw-completion mode; the streamed text (emoji: several tokens and SSE chunks each) equals
    the server's unstreamed completion of the same request."""
    prompt = "Emoji list: \U0001F600 \U0001F603 \U0001F604 \U0001F601 \U0001F606 \U0001F605 \U0001F602"
    expected = server.post("/v1/completions", {"prompt": prompt, "max_tokens": 24, "temperature": 0}).json()
    expected_text = expected["choices"][0]["text"]
    assert "\U0001F60A" in expected_text  # the model's greedy continuation: more emoji
    page.click("#tab-playground")
    page.select_option("#pg-mode", "completion")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "24")
    page.fill("#pg-input", prompt)
    page.click("#pg-send")
    page.wait_for_selector(".reply-stats[data-finish]:not([data-finish=''])")
    assert page.text_content(".message.prompt .content") == prompt
    assert page.text_content(".message.completion .content") == expected_text
    assert page.get_attribute(".reply-stats", "data-completion-tokens") == "24"
    assert page.errors == []


def test_a_real_reply_with_a_script_tag_is_text(page, server):
    """The default model, greedy, answers this with an HTML page holding a <script> (in a code block
    on a cold server, as bare text after the earlier tests' prefix-cache hits: bf16 numerics)."""
    dialogs = []
    page.on("dialog", lambda dialog: (dialogs.append(dialog.message), dialog.dismiss()))
    page.click("#tab-playground")
    page.fill("#pg-temperature", "0")
    page.fill("#pg-max-tokens", "120")
    page.fill("#pg-input", "Write a minimal HTML page with a <script> tag that shows an alert.")
    page.click("#pg-send")
    page.wait_for_selector(".reply-stats[data-finish]:not([data-finish=''])")
    content = page.locator(".message.assistant .content")
    assert "<script>" in content.text_content()
    assert content.locator("script, html, body, div, h1").count() == 0
    assert dialogs == [] and page.errors == []


HOSTILE_REPLY = ('Here: <script>window.__pwned = 1</script> <img src=x onerror="window.__pwned = 2"> '
                 '**bold** and `<b>code</b>`\n\n```html\n<script>window.__pwned = 3</script>\n```\n'
                 '[click](javascript:window.__pwned=4) [site](https://example.com/)')


def test_model_output_with_html_is_shown_as_text(page, server):
    """The reply comes from a stream this test writes (a real model will not reliably say <script>);
    the page parses and renders it exactly as it does the server's."""
    chunks = [HOSTILE_REPLY[i:i + 7] for i in range(0, len(HOSTILE_REPLY), 7)]
    events = "".join("data: " + json.dumps({"choices": [{"index": 0, "delta": {"content": c}, "finish_reason": None}]})
                     + "\n\n" for c in chunks)
    events += "data: " + json.dumps({"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}) + "\n\n"
    events += "data: [DONE]\n\n"
    page.route("**/v1/chat/completions", lambda route: route.fulfill(
        status=200, headers={"content-type": "text/event-stream"}, body=events))
    page.click("#tab-playground")
    page.fill("#pg-input", "say something hostile")
    page.click("#pg-send")
    page.wait_for_selector('.reply-stats[data-finish="stop"]')
    content = page.locator(".message.assistant .content")
    text = content.text_content()
    assert "<script>window.__pwned = 1</script>" in text and 'onerror="window.__pwned = 2"' in text
    assert content.locator("script, img").count() == 0
    assert content.locator("strong").text_content() == "bold"
    assert content.locator("pre code").text_content() == "<script>window.__pwned = 3</script>"
    links = content.locator("a")
    assert links.count() == 1 and links.get_attribute("href") == "https://example.com/"  # no javascript: link
    assert page.evaluate("window.__pwned") is None


@pytest.fixture(scope="module")
def keyed_server(tiny_llama_dir, tmp_path_factory):
    process = start_server(["--model", str(tiny_llama_dir), "--dtype", "float32"],
                           tmp_path_factory.mktemp("console-key"), api_key=API_KEY)
    yield process
    assert process.stop() == 0, process.log()
    assert API_KEY not in process.log()


def test_api_key_prompt_and_nothing_loads_without_the_key(browser, keyed_server):
    context = browser.new_context()
    page = context.new_page()
    urls, statuses = [], {}
    page.on("request", lambda request: urls.append(request.url))
    page.on("response", lambda response: statuses.setdefault(response.url.split("?")[0], []).append(response.status))
    page.goto(keyed_server.base_url + "/")
    page.wait_for_selector("#key-dialog[open]")
    time.sleep(1.5)
    feed = keyed_server.base_url + "/v1/stats/stream"
    assert statuses[feed] and set(statuses[feed]) == {401}
    assert page.get_attribute('[data-stat="running"] .value', "data-raw") is None  # no figure shown
    assert page.text_content("#facts") == ""
    page.fill("#key-input", "wrong-key")
    page.click("#key-submit")
    page.wait_for_selector("#key-error:not([hidden])")
    assert page.is_visible("#key-dialog")
    page.fill("#key-input", API_KEY)
    page.click("#key-submit")
    page.wait_for_selector("#connection.live")
    assert not page.is_visible("#key-dialog")
    assert page.get_attribute('[data-stat="running"] .value', "data-raw") == "0"
    page.click("#tab-playground")
    page.fill("#pg-max-tokens", "8")
    page.fill("#pg-input", "hello")
    page.click("#pg-send")
    page.wait_for_selector(".reply-stats[data-finish]:not([data-finish=''])")
    assert page.get_attribute(".reply-stats", "data-finish") in ("stop", "length")
    assert all(API_KEY not in url for url in urls)
    context.close()
