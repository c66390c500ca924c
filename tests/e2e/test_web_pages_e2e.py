"""The chat page and the dashboard in a real browser (headless Chromium through Selenium) against the real server
with the bundled model, started with `--api-key` as a deployment open to a network would be.

A person's path through the chat page: the page asks for the key, an answer streams in piece by piece with its
speed line, a follow-up carries the conversation, Stop cancels a long answer and the server frees its KV blocks
at once, the server's 422 and 429 read as messages, and HTML or script in the model's answer stays text. The
dashboard draws its plots from /metrics once requests have run. Screenshots of both pages are saved under
build/test-artifacts/ (tests/e2e/browser.py) for a person to look at.
"""

from __future__ import annotations

import contextlib
import json
import re
import time
from pathlib import Path

import httpx
import numpy as np
import pytest
from safetensors.numpy import save_file
from selenium.webdriver.common.by import By
from selenium.webdriver.common.keys import Keys
from selenium.webdriver.support.ui import WebDriverWait

from kettle.bench.process import KettleServer
from tests.e2e.browser import screenshot, start_chromium, viewport
from tests.e2e.kv_pool import assert_pool_whole, metric

KEY = "kettle-test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}
# Two permits: the 429 test holds both with streams of its own.
MAX_CONCURRENT = 2
# A schema whose answer cannot end before thousands of characters: a stream that is still running when stopped.
LONG_ANSWER = {"type": "object", "properties": {"story": {"type": "string", "minLength": 4000}}, "required": ["story"]}
# Markup a model could write, forced into the answer by a schema constant (the bundled model would not write it).
HOSTILE = (
    "**Hi** <script>window.pwned = 1</script> <img src=x onerror='window.pwned = 2'> [link](javascript:window.pwned=3)"
)
WAIT = 90  # seconds: generous, as a loaded 2-core CI machine decodes slowly

# Records, on the page, the length of the newest answer's text at each change of the conversation: how the answer
# grew on screen.
OBSERVE_GROWTH = """
window.growth = [];
new MutationObserver(() => {
  const answers = document.querySelectorAll('.message.assistant .content');
  if (answers.length) window.growth.push(answers[answers.length - 1].textContent.length);
}).observe(document.getElementById('messages'), {subtree: true, childList: true, characterData: true});
"""
# Records the body of every request the page sends (the page calls the global fetch).
OBSERVE_REQUESTS = """
window.sent = [];
const original = window.fetch;
window.fetch = (url, init) => {
  if (init && init.body) window.sent.push(JSON.parse(init.body));
  return original(url, init);
};
"""


ADAPTER = "kettle-test-adapter"


def write_adapter(folder: Path) -> Path:
    """A random rank-4 PEFT LoRA adapter on q_proj and v_proj for the bundled model's shapes (SmolLM2-135M: 30
    layers, hidden size 576, 3 KV heads of 64), written as PEFT saves one (no model needs building for it)."""
    rng = np.random.default_rng(0)
    tensors = {}
    for layer in range(30):
        for module, out in (("q_proj", 576), ("v_proj", 192)):
            prefix = f"base_model.model.model.layers.{layer}.self_attn.{module}"
            tensors[f"{prefix}.lora_A.weight"] = rng.normal(0, 0.05, (4, 576)).astype(np.float32)
            tensors[f"{prefix}.lora_B.weight"] = rng.normal(0, 0.05, (out, 4)).astype(np.float32)
    folder.mkdir(parents=True)
    save_file(tensors, str(folder / "adapter_model.safetensors"), metadata={"format": "pt"})
    config = {"peft_type": "LORA", "r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"], "bias": "none"}
    (folder / "adapter_config.json").write_text(json.dumps(config))
    return folder


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    adapter = write_adapter(tmp_path_factory.mktemp("web-pages") / "adapter")
    flags = (
        "--api-key",
        KEY,
        "--max-concurrent-requests",
        str(MAX_CONCURRENT),
        "--lora-adapters",
        f"{ADAPTER}={adapter}",
    )
    server = KettleServer(None, *flags)
    yield server
    try:
        assert_pool_whole(server.url)
    finally:
        code = server.stop()
    assert code == 0, server.logs()


@pytest.fixture(scope="module")
def browser():
    driver = start_chromium()
    yield driver
    driver.quit()


def open_page(browser, server, path: str, key: str | None = KEY, **settings: str) -> None:
    """Loads a page with a fresh local storage: the API key (if any) and chat settings as a returning user's."""
    browser.get(f"{server.url}{path}")
    browser.execute_script("localStorage.clear()")
    if key:
        browser.execute_script("localStorage.setItem('kettle.apiKey', arguments[0])", key)
    defaults = {"temperature": "0", "max-tokens": "96"}
    browser.execute_script(
        "localStorage.setItem('kettle.chat.settings', arguments[0])", json.dumps(defaults | settings)
    )
    browser.refresh()
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "model-name").text != "connecting…")


def ask(browser, question: str) -> None:
    prompt = browser.find_element(By.ID, "prompt")
    prompt.send_keys(question)
    prompt.send_keys(Keys.ENTER)


def wait_answered(browser, timeout: float = WAIT):
    """The newest answer once it has ended (its speed line or its error is shown)."""

    def ended(driver):
        answers = driver.find_elements(By.CSS_SELECTOR, ".message.assistant")
        if not answers or answers[-1].get_attribute("aria-busy") == "true":
            return False
        last = answers[-1]
        shown = last.find_element(By.CLASS_NAME, "stats").text or last.find_elements(By.CLASS_NAME, "error")
        return last if shown else False

    return WebDriverWait(browser, timeout).until(ended)


def error_text(answer) -> str:
    return answer.find_element(By.CSS_SELECTOR, ".error[role=alert]").text


def test_root_sends_a_browser_to_the_chat_page_and_stays_a_health_check(server, browser):
    assert httpx.get(f"{server.url}/").status_code == 200  # curl, probes: TGI's health answer
    redirect = httpx.get(f"{server.url}/", headers={"Accept": "text/html"})
    assert redirect.status_code == 307 and redirect.headers["location"] == "/chat"
    browser.get(f"{server.url}/")
    assert browser.current_url == f"{server.url}/chat"


def test_the_page_asks_for_the_key_then_streams_answers_with_their_speed(server, browser):
    open_page(browser, server, "/chat", key=None, system="You are a helpful assistant.", **{"max-tokens": "120"})
    # The header shows the model from /info, and the key field is there before anything is sent.
    assert browser.find_element(By.ID, "model-name").text == "HuggingFaceTB/SmolLM2-135M-Instruct"
    assert "gguf Q4_1 → q4" in browser.find_element(By.ID, "model-quantization").text  # /info's, as served
    assert browser.find_element(By.ID, "model-decode").text.startswith("decode: ")
    assert browser.find_element(By.ID, "api-key").is_displayed()

    ask(browser, "Write a Python function that reverses a string.")
    refused = wait_answered(browser)
    assert "needs an API key" in error_text(refused)
    assert browser.switch_to.active_element == browser.find_element(By.ID, "api-key")

    browser.find_element(By.ID, "api-key").send_keys(KEY)
    browser.execute_script(OBSERVE_GROWTH + OBSERVE_REQUESTS)
    browser.find_element(By.ID, "regenerate").click()
    answer = wait_answered(browser)
    text = answer.find_element(By.CLASS_NAME, "content").text
    assert "def " in text and not answer.find_elements(By.CLASS_NAME, "error")
    assert answer.find_elements(By.CSS_SELECTOR, ".content pre code")  # the code came as a Markdown code block
    growth = [length for length in browser.execute_script("return window.growth") if length]
    # Token by token: the answer was on screen at many lengths on its way to the whole, from a few characters. (Not
    # strictly growing: Markdown's marks vanish as their block or emphasis closes.)
    assert len(set(growth)) >= 5 and growth[0] < len(text) / 4 and max(growth) == growth[-1], growth
    stats = answer.find_element(By.CLASS_NAME, "stats").text
    assert re.fullmatch(r"TTFT \d+ ms|TTFT [\d.]+ s", stats.split(" · ")[0]), stats
    assert re.search(r" · [\d.]+ tok/s · \d+ tokens · (finished \(stop\)|max tokens reached \(length\))$", stats), stats
    assert browser.execute_script("return localStorage.getItem('kettle.apiKey')") == KEY
    assert not browser.find_elements(By.CSS_SELECTOR, ".message.assistant .error")  # the failed try was replaced
    screenshot(browser, "chat.png")

    ask(browser, "Now make it reverse the order of the words instead.")
    follow_up = wait_answered(browser)
    assert " tok/s · " in follow_up.find_element(By.CLASS_NAME, "stats").text
    first, second = browser.execute_script("return window.sent")
    assert first["temperature"] == 0 and first["max_tokens"] == 120 and first["stream"] is True
    # The follow-up carries the conversation: the system prompt, the first question and answer, then the new one.
    assert [message["role"] for message in second["messages"]] == ["system", "user", "assistant", "user"]
    assert second["messages"][0]["content"] == "You are a helpful assistant."
    assert "def " in second["messages"][2]["content"]  # the answer as the model wrote it (Markdown source)
    screenshot(browser, "chat-follow-up.png")
    copy = follow_up.find_element(By.CLASS_NAME, "copy")
    copy.click()
    WebDriverWait(browser, 5).until(lambda d: copy.text == "Copied")
    browser.find_element(By.ID, "clear").click()
    assert (
        not browser.find_elements(By.CSS_SELECTOR, ".message") and browser.find_element(By.ID, "empty").is_displayed()
    )


def test_the_lora_adapter_is_chosen_from_the_servers_list(server, browser):
    open_page(browser, server, "/chat", **{"max-tokens": "8"})
    options = [o.get_attribute("value") for o in browser.find_elements(By.CSS_SELECTOR, "#adapter option")]
    assert options == ["", ADAPTER]  # the base model, then what /v1/models lists
    browser.execute_script(OBSERVE_REQUESTS)
    ask(browser, "Hello!")
    wait_answered(browser)
    browser.find_element(By.CSS_SELECTOR, f"#adapter option[value='{ADAPTER}']").click()
    browser.find_element(By.ID, "regenerate").click()
    answer = wait_answered(browser)
    assert " tok/s · " in answer.find_element(By.CLASS_NAME, "stats").text
    base, adapted = browser.execute_script("return window.sent")
    assert base["model"] == "HuggingFaceTB/SmolLM2-135M-Instruct" and adapted["model"] == ADAPTER
    assert 'kettle_lora_requests_total{adapter="kettle-test-adapter"} 1.0' in httpx.get(f"{server.url}/metrics").text


def test_stop_cancels_the_request_and_the_server_frees_its_kv_blocks(server, browser):
    open_page(browser, server, "/chat", schema=json.dumps(LONG_ANSWER), **{"max-tokens": "2000"})
    succeeded = metric(server.url, "tgi_request_success")
    ask(browser, "Tell me a long story about a kettle.")
    WebDriverWait(browser, WAIT).until(
        lambda d: len(d.find_element(By.CSS_SELECTOR, ".message.assistant .content").text) > 40
    )
    assert metric(server.url, "tgi_batch_current_size") == 1
    assert metric(server.url, "kettle_kv_blocks_free") < metric(server.url, "kettle_kv_blocks_total")
    browser.find_element(By.ID, "stop").click()
    answer = wait_answered(browser, timeout=10)
    assert "stopped by you" in answer.find_element(By.CLASS_NAME, "stats").text
    assert browser.find_element(By.ID, "send").is_displayed() and not browser.find_element(By.ID, "stop").is_displayed()
    # The request ended with the connection: nothing runs, every block is back, and it did not run to its end.
    assert_pool_whole(server.url, timeout=5)
    assert metric(server.url, "tgi_batch_current_size") == 0
    assert metric(server.url, "tgi_request_success") == succeeded


def test_a_schema_the_server_refuses_shows_its_422_message(server, browser):
    open_page(browser, server, "/chat", schema='{"type": "object"}')
    ask(browser, "Answer in JSON.")
    refused = wait_answered(browser)
    message = error_text(refused)
    assert message.startswith("Input validation error: ") and "properties" in message, message

    open_page(browser, server, "/chat", schema="{not json")
    ask(browser, "Answer in JSON.")
    assert "not valid JSON" in error_text(wait_answered(browser))


def test_a_busy_server_reads_as_busy(server, browser):
    open_page(browser, server, "/chat")
    body = {"model": "tgi", "messages": [{"role": "user", "content": "A story"}], "stream": True, "max_tokens": 2000}
    body["response_format"] = {"type": "json_schema", "json_schema": {"name": "story", "schema": LONG_ANSWER}}
    with httpx.Client(headers=AUTH, timeout=WAIT) as client, contextlib.ExitStack() as streams:
        lines = []  # kept: a line iterator that is dropped closes its stream (httpcore closes on GeneratorExit)
        for _ in range(MAX_CONCURRENT):  # every permit taken, each stream running
            response = streams.enter_context(client.stream("POST", f"{server.url}/v1/chat/completions", json=body))
            assert response.status_code == 200
            lines.append(response.iter_lines())
            next(lines[-1])
        ask(browser, "Hello?")
        message = error_text(wait_answered(browser))
    assert "busy" in message and "Retry" in message, message
    assert_pool_whole(server.url)


def test_html_and_script_in_the_answer_stay_text(server, browser):
    schema = {"type": "object", "properties": {"html": {"const": HOSTILE}}, "required": ["html"]}
    open_page(browser, server, "/chat", schema=json.dumps(schema))
    ask(browser, "Write some HTML.")
    answer = wait_answered(browser)
    content = answer.find_element(By.CLASS_NAME, "content")
    assert "<script>window.pwned = 1</script>" in content.text and "<img src=x" in content.text
    assert content.find_elements(By.TAG_NAME, "strong")  # Markdown is rendered...
    # ...and none of the markup became elements: no script, no image with a handler, no javascript: link.
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages script, #messages img, #messages [onerror]")
    assert not browser.find_elements(By.CSS_SELECTOR, "#messages a[href^='javascript']")
    time.sleep(0.5)  # an image's error handler would have fired by now
    assert browser.execute_script("return window.pwned") is None


def test_keyboard_labels_phone_width_and_dark_theme(server, browser):
    viewport(browser, 390, 760, mobile=True)
    try:
        open_page(browser, server, "/chat")
        # Every control has a name a screen reader can say.
        unnamed = browser.execute_script(
            "return [...document.querySelectorAll('input, textarea, select')].filter(e => !e.labels.length)"
            ".map(e => e.id).concat([...document.querySelectorAll('button')]"
            ".filter(b => !(b.textContent.trim() || b.getAttribute('aria-label'))).map(b => b.id))"
        )
        assert unnamed == []
        # A phone-width window: settings folded, the message box in view, nothing wider than the screen.
        assert browser.find_element(By.ID, "settings").get_attribute("open") is None
        assert browser.find_element(By.ID, "prompt").is_displayed()
        assert browser.execute_script("return document.documentElement.scrollWidth") <= 390
        # Shift+Enter is a new line, not a send.
        prompt = browser.find_element(By.ID, "prompt")
        prompt.send_keys("first line", Keys.SHIFT, Keys.ENTER, Keys.NULL, "second line")
        assert prompt.get_attribute("value") == "first line\nsecond line"
        assert not browser.find_elements(By.CSS_SELECTOR, ".message")
        browser.find_element(By.ID, "theme-toggle").click()
        background = browser.execute_script("return getComputedStyle(document.body).backgroundColor")
        assert browser.execute_script("return document.documentElement.dataset.theme") == "dark"
        assert background == "rgb(21, 23, 26)"
        screenshot(browser, "chat-phone-dark.png")
    finally:
        browser.execute_script("localStorage.removeItem('kettle.theme')")
        viewport(browser, 1280, 800)


# Pixels of a plot's first series (its colour, #e0703b, give or take the line's anti-aliasing).
SERIES_PIXELS = """
const canvas = document.querySelector(arguments[0] + ' canvas');
const data = canvas.getContext('2d').getImageData(0, 0, canvas.width, canvas.height).data;
let count = 0;
for (let i = 0; i < data.length; i += 4) {
  if (Math.abs(data[i] - 0xe0) < 40 && Math.abs(data[i + 1] - 0x70) < 40 && Math.abs(data[i + 2] - 0x3b) < 40
      && data[i + 3] > 100) count++;
}
return count;
"""


def test_the_dashboard_plots_what_the_server_does(server, browser):
    viewport(browser, 1280, 1000)
    open_page(browser, server, "/dashboard", key=None)  # /metrics is open: the dashboard needs no key...
    WebDriverWait(browser, 20).until(lambda d: d.find_element(By.ID, "updated").text.startswith("Updated"))
    assert not browser.find_element(By.ID, "key-row").is_displayed()  # ...and does not ask for one
    time.sleep(1.5)  # a second scrape: the first rates
    for panel in ("#panel-ttft", "#panel-itl"):  # nothing finished since the page opened: no line yet
        assert browser.execute_script(SERIES_PIXELS, panel) == 0
    for question in ("What is 2 + 2?", "Name a colour.", "Say hello."):
        body = {"model": "tgi", "messages": [{"role": "user", "content": question}], "max_tokens": 8}
        response = httpx.post(f"{server.url}/v1/chat/completions", json=body, headers=AUTH, timeout=WAIT)
        assert response.status_code == 200, response.text

    def value(panel: str, part: str = "value") -> str:
        return browser.find_element(By.CSS_SELECTOR, f"#panel-{panel} .{part}").text

    def number(panel: str) -> float:
        first = value(panel).split()[0] if value(panel) else "–"
        return float(first) if first != "–" else 0.0

    WebDriverWait(browser, 20).until(lambda d: number("ttft") > 0 and number("requests") > 0)
    assert "p50" in value("ttft") and "p99" in value("ttft", "detail") and number("itl") > 0
    assert "blocks" in value("kv", "detail") and number("memory") > 0
    # The percentile lines are drawn (from their second point on; the requests plot's line was there from the start,
    # at zero).
    for panel in ("#panel-ttft", "#panel-itl"):
        WebDriverWait(browser, 10).until(lambda d, panel=panel: d.execute_script(SERIES_PIXELS, panel) > 20)
    legend = browser.find_element(By.CSS_SELECTOR, "#panel-memory .u-legend").text
    assert "router" in legend and "shard-0" in legend
    time.sleep(1)
    screenshot(browser, "dashboard.png")
    viewport(browser, 1280, 800)
