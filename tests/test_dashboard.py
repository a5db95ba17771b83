"""The live dashboard of `colibri serve`: the stats JSON it polls, and the page itself in a real headless
chromium (skipped when chromium or the playwright package is missing: CI needs `apt-get install chromium`
and `pip install playwright`, never `playwright install`)."""

from __future__ import annotations

import os
import shutil
import time
from pathlib import Path

import pytest
from serve_proc import Server

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"


class DashServer(Server):
    def __init__(self, model: Path):
        super().__init__(model, "--slots", "2", "--ram-layers", "1", "--disk-layers", "2")

    def complete(self, prompt: str, n: int) -> dict:
        model = self.request("GET", "/v1/models")[1]["data"][0]["id"]
        status, body = self.request("POST", "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": n,
                                                                "temperature": 0, "ignore_eos": True})
        assert status == 200, body
        return body


@pytest.fixture()
def server(ckpt):
    s = DashServer(ckpt.coli("mixtral", "f32"))  # 3 MoE layers, 4 experts, top-2; 2 of them on disk
    yield s
    s.stop()


def test_stats_count_every_routed_token(server):
    status, page = server.request("GET", "/dashboard")
    assert status == 200 and "<canvas id=\"heat\"" in page and "http" not in page.replace("http-equiv", "")
    assert server.request("GET", "/dashboard/dashboard.js")[0] == 200
    _, before = server.request("GET", "/v1/colibri/stats")
    assert before["heat"]["layers"] == [0, 1, 2] and sum(map(sum, before["heat"]["counts"])) == 0
    body = server.complete("Once upon a time", 6)
    time.sleep(0.3)  # the last step's listeners run just after the response is complete
    _, s = server.request("GET", "/v1/colibri/stats")
    rows = body["usage"]["prompt_tokens"] + body["usage"]["completion_tokens"]
    for counts in s["heat"]["counts"]:
        assert sum(counts) == 2 * rows  # top-2 per routed row: every prompt and generated token
    assert s["tiers"]["ram"] > 0 and s["tiers"]["disk"] > 0  # layers 1-2 stream their experts from disk
    assert s["store"]["lookups"] > 0 and s["series"]
    (r,) = s["requests"]
    assert r["prompt_tokens"] == body["usage"]["prompt_tokens"] and r["ttft_s"] > 0 and r["tok_s"] > 0


def test_dashboard_in_headless_chromium(server, tmp_path):
    sync_api = pytest.importorskip("playwright.sync_api")
    if not Path(CHROMIUM).exists():
        pytest.skip("chromium is not installed (apt-get install chromium)")
    errors: list[str] = []
    with sync_api.sync_playwright() as p:
        browser = p.chromium.launch(executable_path=CHROMIUM, args=["--no-sandbox"])
        page = browser.new_page(viewport={"width": 960, "height": 900})
        page.on("console", lambda m: errors.append(m.text) if m.type == "error" else None)
        page.on("pageerror", lambda e: errors.append(str(e)))
        page.goto(server.url + "/dashboard")
        page.wait_for_function("document.getElementById('heat').dataset.total === '0'", timeout=20_000)
        heat0 = page.evaluate("document.getElementById('heat').toDataURL()")
        server.complete("Once upon a time there was", 8)
        server.complete("The old woman", 8)
        page.wait_for_function("Number(document.getElementById('heat').dataset.total) > 0", timeout=20_000)
        page.wait_for_function("document.querySelectorAll('#reqs tbody tr').length === 2", timeout=20_000)
        heat1 = page.evaluate("document.getElementById('heat').toDataURL()")
        shot = Path(os.environ.get("COLIBRI_DASHBOARD_SHOT", tmp_path / "dashboard.png"))
        page.screenshot(path=str(shot), full_page=True)
        status = page.text_content("#status")
        browser.close()
    assert errors == []
    assert heat1 != heat0  # the heat map was redrawn with the requests' routing
    assert "steps" in status and shot.stat().st_size > 1000
