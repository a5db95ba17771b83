"""A thinking model's reasoning apart from its answer: `<think> ... </think>` -> `reasoning_content`.

Qwen3, DeepSeek-R1-style and GLM-4.5 models write their reasoning between `<think>` and `</think>`
before the answer (or their template opens the `<think>` in the prompt). OpenAI clients show
`content`; llama-server and vLLM move the reasoning to `message.reasoning_content` (llama-server's
`--reasoning-format deepseek`, its default). `ThinkSplit` does that for a whole answer or piece by
piece while it streams, holding back only a tail that may be the start of a tag.
"""

from __future__ import annotations

OPEN, CLOSE = "<think>", "</think>"


def held_tail(text: str, tag: str) -> int:
    """Length of the longest end of `text` that is a proper start of `tag` (it may grow into the tag)."""
    return next((n for n in range(min(len(tag) - 1, len(text)), 0, -1) if tag.startswith(text[-n:])), 0)


class ThinkSplit:
    """push(piece) -> (reasoning, content) that are certain so far; finish() -> the rest. `opened`: the
    prompt itself ends inside a `<think>` (the template opened it). `ends`: text that ends the reasoning
    without a `</think>` and starts the content itself (Kimi-K2-Thinking opens its tool calls inside its
    reasoning). `tags`: the reasoning's opening and closing text where the model writes other ones (Gemma 4's
    thought channel, `<|channel>thought` ... `<channel|>`)."""

    def __init__(self, opened: bool = False, ends: tuple[str, ...] = (), tags: tuple[str, str] = (OPEN, CLOSE)):
        self.state = "think" if opened else "start"
        self.buf = ""
        self.strip = opened  # the reasoning's and the answer's leading whitespace is dropped
        self.ends = ends
        self.open, self.close = tags

    def push(self, piece: str) -> tuple[str, str]:
        self.buf += piece
        if self.state == "start":
            s = self.buf.lstrip()
            if s.startswith(self.open):
                self.state, self.buf, self.strip = "think", s[len(self.open):], True
            elif self.open.startswith(s):
                return "", ""  # (nothing yet, or part of the tag)
            else:
                self.state = "content"
        if self.state == "think":
            if self.strip:
                self.buf = self.buf.lstrip()
                self.strip = not self.buf
            at, tag = min(((i, t) for t in (self.close, *self.ends) if (i := self.buf.find(t)) >= 0), default=(-1, ""))
            if at < 0:  # hold a tail that may open a tag, and trailing whitespace (dropped before it)
                cut = len(self.buf) - max(held_tail(self.buf, t) for t in (self.close, *self.ends))
                cut = len(self.buf[:cut].rstrip())
                out, self.buf = self.buf[:cut], self.buf[cut:]
                return out, ""
            # </think> is dropped; an `ends` marker begins the content
            reasoning, self.buf = self.buf[:at].rstrip(), self.buf[at + (len(self.close) if tag == self.close else 0):]
            self.state, self.strip = "content", True
            return reasoning, self._content()
        return "", self._content()

    def _content(self) -> str:
        if self.strip:
            self.buf = self.buf.lstrip()
            self.strip = not self.buf
        out, self.buf = self.buf, ""
        return out

    def finish(self) -> tuple[str, str]:
        """What was held back: a reasoning never closed (the answer was cut) stays reasoning."""
        out, self.buf = self.buf, ""
        if self.state == "think":
            return out.rstrip(), ""
        return "", out


def opens_thinking(prompt: str, tags: tuple[str, str] = (OPEN, CLOSE)) -> bool:
    """Whether a rendered prompt ends inside an open `<think>` (DeepSeek-R1-style templates), or the `tags` given."""
    at = prompt.rfind(tags[0])
    return at >= 0 and tags[1] not in prompt[at:] and not prompt[at + len(tags[0]):].strip()


ANSWER_OPEN, ANSWER_CLOSE = "<answer>", "</answer>"


class AnswerTags:
    """Hunyuan-A13B writes its answer between `<answer>` and `</answer>` after its reasoning: the tags leave the
    content (as vLLM's hunyuan_a13b reasoning parser drops them), streamed or whole; an answer without them
    passes unchanged. push(piece) -> the content certain so far; finish() -> the rest."""

    def __init__(self):
        self.started, self.buf, self.cut = False, "", False

    def push(self, piece: str) -> str:
        self.buf += piece
        if not self.started:
            s = self.buf.lstrip()
            if s.startswith(ANSWER_OPEN):
                self.buf, self.cut = s[len(ANSWER_OPEN):].lstrip(), True
            elif ANSWER_OPEN.startswith(s):
                return ""  # (nothing yet, or part of the tag)
            self.started = True
        if not self.cut:
            out, self.buf = self.buf, ""
            return out
        self.buf = self.buf.replace(ANSWER_CLOSE, "")
        keep = len(self.buf) - held_tail(self.buf, ANSWER_CLOSE)
        keep = len(self.buf[:keep].rstrip())  # (whitespace before a closing tag is dropped with it)
        out, self.buf = self.buf[:keep], self.buf[keep:]
        return out

    def finish(self) -> str:
        out, self.buf = self.buf, ""
        return out.replace(ANSWER_CLOSE, "").rstrip() if self.cut else out
