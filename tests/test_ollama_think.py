"""Ollama's `think`: the template variables it sets, and /api/generate's `thinking` field from the chat
stream's (the live routes: tests/test_server_apis.py)."""

from __future__ import annotations

import asyncio
import json

import pytest

pytest.importorskip("fastapi")

from colibri.server.ollama import _generate_lines, _think, _thinks  # noqa: E402


def test_think_sets_the_template_switches() -> None:
    assert _think(None) == {}
    assert _think(False) == {"chat_template_kwargs": {"enable_thinking": False, "thinking": False}}
    assert _think(True)["chat_template_kwargs"]["enable_thinking"] is True
    assert _think("high") == {"chat_template_kwargs": {"reasoning_effort": "high"}}
    assert _thinks("{% if enable_thinking %}<think>{% endif %}") and not _thinks("{{ messages }}")


def test_generate_lines_carry_thinking_apart_from_the_response() -> None:
    chat = [{"model": "m", "message": {"role": "assistant", "content": "", "thinking": "plan"}, "done": False},
            {"model": "m", "message": {"role": "assistant", "content": "Hi"}, "done": False},
            {"model": "m", "message": {"role": "assistant", "content": ""}, "done": True}]

    async def lines():
        for obj in chat:
            yield json.dumps(obj) + "\n"

    async def collect():
        return [json.loads(x) async for x in _generate_lines(lines())]

    out = asyncio.run(collect())
    assert [(o["response"], o.get("thinking"), o["done"]) for o in out] == [("", "plan", False), ("Hi", None, False),
                                                                             ("", None, True)]
    assert all("message" not in o for o in out)
