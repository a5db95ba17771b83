"""The chat page at `GET /` in a real headless chromium (skipped without chromium or playwright, as the
dashboard's test): a two-turn conversation streams the answers the API gives for the same messages, a
missing API key shows the server's error instead of an answer, and answers render as sanitized markdown."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from chat_server import KEY
from test_dashboard import CHROMIUM


def test_page_and_assets_are_served(server):
    status, page = server.request("GET", "/")
    assert status == 200 and '<form id="ask">' in page and "http" not in page.replace("http-equiv", "")
    assert server.request("GET", "/ui/chat.js")[0] == 200
    assert server.request("GET", "/ui/nope.js")[0] == 404


def test_chat_page_in_headless_chromium(server, client, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (apt-get install chromium)")

    def api(messages):
        r = client.chat.completions.create(model="tiny", messages=messages, temperature=0, max_tokens=8)
        return r.choices[0].message.content

    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page()
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/")
        page.click("#settings summary")
        page.fill("#temperature", "0")
        page.fill("#max_tokens", "8")

        def send(text: str) -> str:
            n = page.locator(".assistant").count()
            page.fill("#input", text)
            page.keyboard.press("Enter")
            page.wait_for_function(f"document.querySelectorAll('.assistant')[{n}]?.dataset.done === '1'",
                                   timeout=30_000)
            return page.locator(".assistant .text").nth(n).get_attribute("data-raw")  # (as streamed)

        shown = send("Hello")  # no key yet: the server's 401, shown in the answer's place
        assert "API key" in shown and page.locator(".assistant.error").count() == 1
        page.fill("#key", KEY)
        page.dispatch_event("#key", "change")
        page.wait_for_function("document.getElementById('model').textContent === 'tiny'", timeout=10_000)
        first = send("Hello")
        second = send("Tell me more")
        meta = page.locator(".assistant .meta").last.text_content()
        # an answer is shown as markdown, sanitized: what the page's own render() makes of a hostile one
        shown_md = page.evaluate("""() => { const el = document.createElement('div');
            render(el, '# Title\\n\\n**bold** and `x<y`\\n\\n```py\\nprint(1)\\n```\\n\\n'
                       + '<img src=x onerror="window.pwned=1"><script>window.pwned=2</script>');
            return el.innerHTML; }""")
        pwned = page.evaluate("() => window.pwned === undefined")
        page.screenshot(path=os.environ.get("COLIBRI_WEBUI_SHOT", str(tmp_path / "chat.png")), full_page=True)
        browser.close()
    assert errors == []
    assert "<h1>Title</h1>" in shown_md and "<strong>bold</strong>" in shown_md and "<code>x&lt;y</code>" in shown_md
    assert '<pre><code class="language-py">print(1)' in shown_md
    assert "onerror" not in shown_md and "<script" not in shown_md and pwned
    assert first == api([{"role": "user", "content": "Hello"}])
    assert second == api([{"role": "user", "content": "Hello"}, {"role": "assistant", "content": first},
                          {"role": "user", "content": "Tell me more"}])
    assert "tokens" in meta and "tok/s" in meta
