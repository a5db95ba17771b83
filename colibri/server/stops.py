"""Stop strings: text is released only once it cannot be the start of a stop string.

Tokens arrive as text pieces; a stop string may be split across several of them ("<|" + "end|>").
`StopMatcher.push` returns the text that is safe to send and whether a stop string was reached;
the matched stop string and anything after it are never sent.
"""

from __future__ import annotations


class StopMatcher:
    def __init__(self, stops: list[str] | tuple[str, ...] = ()):
        self.stops = [s for s in stops if s]
        self.held = ""  # text that could still turn into a stop string
        self.stopped = False
        self.matched: str | None = None  # the stop string that ended the text (Anthropic's stop_sequence)

    def push(self, text: str) -> tuple[str, bool]:
        """Add generated text; returns (text safe to emit now, whether a stop string matched)."""
        if self.stopped:
            return "", True
        buf = self.held + text
        hits = [(i, s) for s in self.stops if (i := buf.find(s)) >= 0]
        if hits:
            at, self.matched = min(hits, key=lambda h: h[0])
            self.held, self.stopped = "", True
            return buf[:at], True
        keep = self._partial_suffix(buf)
        self.held = buf[len(buf) - keep:] if keep else ""
        return buf[: len(buf) - keep], False

    def flush(self) -> str:
        """The held-back text at the end of generation (it turned out not to be a stop string)."""
        out, self.held = ("" if self.stopped else self.held), ""
        return out

    def _partial_suffix(self, buf: str) -> int:
        """Length of the longest end of `buf` that is a proper prefix of some stop string."""
        best = 0
        for s in self.stops:
            for n in range(min(len(s) - 1, len(buf)), best, -1):
                if buf.endswith(s[:n]):
                    best = n
                    break
        return best
