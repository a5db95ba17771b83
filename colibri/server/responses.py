"""OpenAI response bodies: chat completions, text completions, their stream chunks, logprobs."""

from __future__ import annotations

import json
import time

from ..engine.request import TokenEvent
from ..tokenizer import Tokenizer


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int = 0) -> dict:
    """OpenAI's usage object; `cached_tokens`: prompt tokens whose K/V a slot already held."""
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens,
            "prompt_tokens_details": {"cached_tokens": cached_tokens}}


class TokenText:
    """Each token id's own text (special tokens included), for logprobs."""

    def __init__(self, tok: Tokenizer):
        self.tok, self.cache, self.shown = tok, {}, {}

    def __call__(self, token: int) -> str:
        if (s := self.cache.get(token)) is None:
            s = self.cache[token] = self.tok.decode([token], skip_special_tokens=False)
        return s

    def visible_len(self, token: int) -> int:
        """Characters the token adds to decoded text (0 for special tokens, which decoding skips)."""
        if (n := self.shown.get(token)) is None:
            n = self.shown[token] = len(self.tok.decode([token]))
        return n


def chat_logprobs(events: list[TokenEvent], text_of: TokenText) -> dict:
    """`choices[].logprobs` of a chat completion: one entry per generated token."""
    def entry(token: int, lp: float) -> dict:
        s = text_of(token)
        return {"token": s, "logprob": lp, "bytes": list(s.encode())}

    return {"content": [{**entry(ev.token, ev.logprob),
                         "top_logprobs": [entry(t, lp) for t, lp in (ev.top or [])]} for ev in events]}


def completion_logprobs(entries: list[tuple[int, float | None, list[tuple[int, float]] | None]],
                        text_of: TokenText, offset: int = 0) -> dict:
    """`choices[].logprobs` of a text completion (legacy shape): tokens, token_logprobs, top_logprobs
    (a {token text: logprob} dict per token; None for the first prompt token), text_offset."""
    out: dict = {"tokens": [], "token_logprobs": [], "top_logprobs": [], "text_offset": []}
    for token, lp, top in entries:
        s = text_of(token)
        out["tokens"].append(s)
        out["token_logprobs"].append(lp)
        out["top_logprobs"].append(None if top is None else {text_of(t): v for t, v in top})
        out["text_offset"].append(offset)
        offset += text_of.visible_len(token)
    return out


async def chunk_dicts(events):
    """The chunk objects of an OpenAI stream's SSE events (what the chat and completion handlers yield),
    up to its `[DONE]`: what the other APIs' streams (Responses, Ollama) are translated from."""
    async for ev in events:
        if ev.get("data") == "[DONE]":
            return
        yield json.loads(ev["data"])


def merge_tool_deltas(acc: dict[int, dict], deltas: list[dict]) -> list[int]:
    """Stream tool-call deltas (by index: the first with the call's id and name, then pieces of its
    arguments) into whole calls in `acc`; the indices this batch of deltas opened."""
    opened = []
    for d in deltas:
        if d["index"] not in acc:
            acc[d["index"]] = {"id": d.get("id"), "type": "function", "function": {"name": "", "arguments": ""}}
            opened.append(d["index"])
        fn, c = d.get("function") or {}, acc[d["index"]]["function"]
        c["name"] = fn.get("name") or c["name"]
        c["arguments"] += fn.get("arguments") or ""
    return opened


class ChatBodies:
    def __init__(self, rid: str, model: str):
        self.base = {"id": rid, "created": int(time.time()), "model": model, "system_fingerprint": None}

    def full(self, choices: list[dict], use: dict) -> dict:
        return {**self.base, "object": "chat.completion", "choices": choices, "usage": use}

    @staticmethod
    def choice(index: int, text: str | None, finish: str, logprobs: dict | None, tool_calls: list | None = None,
               reasoning: str | None = None) -> dict:
        msg: dict = {"role": "assistant", "content": text}
        if reasoning:
            msg["reasoning_content"] = reasoning
        if tool_calls:
            msg["tool_calls"] = tool_calls
        return {"index": index, "message": msg, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, delta: dict, finish: str | None = None, logprobs: dict | None = None,
              with_usage: bool = False, index: int = 0) -> dict:
        out = {**self.base, "object": "chat.completion.chunk",
               "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if with_usage:
            out["usage"] = None  # only the extra last chunk carries usage (stream_options.include_usage)
        return out

    def usage_chunk(self, use: dict) -> dict:
        return {**self.base, "object": "chat.completion.chunk", "choices": [], "usage": use}


class CompletionBodies:
    def __init__(self, rid: str, model: str):
        self.base = {"id": rid, "object": "text_completion", "created": int(time.time()), "model": model,
                     "system_fingerprint": None}

    def full(self, choices: list[dict], use: dict) -> dict:
        return {**self.base, "choices": choices, "usage": use}

    @staticmethod
    def choice(index: int, text: str, finish: str | None, logprobs: dict | None) -> dict:
        return {"index": index, "text": text, "logprobs": logprobs, "finish_reason": finish}

    def chunk(self, index: int, text: str, finish: str | None = None, logprobs: dict | None = None,
              with_usage: bool = False) -> dict:
        out = {**self.base, "choices": [self.choice(index, text, finish, logprobs)]}
        if with_usage:
            out["usage"] = None
        return out

    def usage_chunk(self, use: dict) -> dict:
        return {**self.base, "choices": [], "usage": use}
