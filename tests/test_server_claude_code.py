"""Claude Code's CLI (npm's @anthropic-ai/claude-code) against a real `colibri serve` with the demo model, offline:
the client the Anthropic Messages API (server/anthropic.py) is for. Skips where Node.js or the CLI is missing
(scripts/setup.sh installs the CLI into the ignored .node/ where npm exists)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess

import pytest
from chat_server import KEY
from serve_proc import ROOT, Server


def _claude() -> str | None:
    """Claude Code's CLI: scripts/setup.sh's project-local install (.node/), else one on PATH."""
    local = ROOT / ".node" / "node_modules" / ".bin" / "claude"
    return str(local) if local.exists() else shutil.which("claude")


def test_claude_code_cli_completes_a_turn(tmp_path, monkeypatch):
    """Claude Code's CLI (npm's @anthropic-ai/claude-code), offline against `colibri serve` with the demo model:
    print mode completes a turn, exits 0 and prints the server's answer (its tokens are the ones the server
    logged generating)."""
    if shutil.which("node") is None:
        pytest.skip("Node.js is not installed")
    if (claude := _claude()) is None:
        pytest.skip("Claude Code's CLI is not installed (scripts/setup.sh puts it in .node/ where npm exists)")
    from colibri.demo import demo_model

    monkeypatch.setenv("COLIBRI_CACHE", str(tmp_path / "cache"))
    # (Claude Code sends no temperature: a sampled story, a few hundred tokens, once 683 of a 1024 context, where
    # the CLI's "continue" request after max_tokens overflowed it; 4096 leaves room: 120 replays, longest 649)
    s = Server(demo_model(), "--api-key", KEY, "--ctx-size", "4096")
    env = {**os.environ, "HOME": str(tmp_path), "CLAUDE_CONFIG_DIR": str(tmp_path / ".claude"),
           "ANTHROPIC_BASE_URL": s.url, "ANTHROPIC_API_KEY": KEY, "CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC": "1",
           "DISABLE_AUTOUPDATER": "1", "DISABLE_TELEMETRY": "1"}
    try:
        plain = subprocess.run([claude, "--bare", "-p", "Tell me a story."], env=env, cwd=tmp_path,
                               capture_output=True, text=True, timeout=180)
        assert plain.returncode == 0, plain.stdout + plain.stderr
        assert plain.stdout.strip()
        run = subprocess.run([claude, "--bare", "-p", "Tell me a story.", "--output-format", "json"], env=env,
                             cwd=tmp_path, capture_output=True, text=True, timeout=180)
        assert run.returncode == 0, run.stdout + run.stderr
    finally:
        out = s.stop()
    result = json.loads(run.stdout)
    assert result["is_error"] is False and result["result"].strip()
    lines = [ln for ln in out.splitlines() if " messages: prompt " in ln]
    assert len(lines) == 2 and "Traceback" not in out, out
    done = [int(re.search(r"completion (\d+) tok", ln).group(1)) for ln in lines]
    assert result["usage"]["output_tokens"] == done[1]
