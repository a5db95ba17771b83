"""`colibri chat`: a multi-turn chat over the model's chat template, streaming each answer.

    colibri chat --model M.coli [--system "You are terse."] [--prompt-cache chat.kv]

Commands: /reset (forget the conversation), /system TEXT (set the system message and reset),
/exit. Ctrl-C stops the current answer (not the program); Ctrl-D exits. From a pipe, each input
line is one user message and only the answers are printed, one per line.

A thinking model's reasoning (`<think> ... </think>`, or gpt-oss's analysis channel) goes to stderr,
dimmed in a terminal; stdout and the conversation's history get the answer only (as the server's
`reasoning_content` split, colibri/server/answer.py).
"""

from __future__ import annotations

import argparse
import logging
import sys

from ..errors import ColibriError
from .common import HelpFormatter, add_engine_args, engine_from_args, positive, setup_logging
from .run import (
    add_sampling_args,
    check_prompt_cache,
    grammar_from_args,
    load_prompt_cache,
    save_prompt_cache,
    stats_line,
    validate_sampling,
)
from .specflags import add_spec_args, apply_spec_args

log = logging.getLogger("colibri")
HELP = "commands: /reset  /system TEXT  /exit   (Ctrl-C stops an answer, Ctrl-D exits)"


def chat_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri chat", formatter_class=HelpFormatter,
                                description="Chat with a model in the terminal (multi-turn, over its chat template).")
    g = p.add_argument_group("chat")
    g.add_argument("--system", default=None, help="system message that starts the conversation")
    g.add_argument("-n", "--n-predict", type=positive("-n"), default=1024,
                   help="most tokens per answer (an answer also ends at the context's end)")
    g.add_argument("--stats", action="store_true", help="print a stats line to stderr after each answer")
    g.add_argument("--prompt-cache", metavar="FILE", default=None,
                   help="load the K/V of an earlier chat from FILE (a conversation that starts the same, e.g. its "
                        "system message, is not computed again) and save the conversation's to it after each answer")
    add_sampling_args(p)
    add_spec_args(p)
    add_engine_args(p)
    return p


class Conversation:
    def __init__(self, system: str | None):
        self.system, self.turns = system, []

    def messages(self, user: str | None = None) -> list[dict]:
        msgs = [{"role": "system", "content": self.system}] if self.system else []
        msgs += self.turns
        return msgs + ([{"role": "user", "content": user}] if user is not None else [])


def _fit(llm, template, conv: Conversation, user: str) -> tuple[list[int], str]:
    """Prompt ids (and text) for the next answer; the oldest turns are dropped when the context is too short."""
    while True:
        text = template.render(conv.messages(user))
        ids = llm.tokenizer.encode(text, add_special_tokens=False)
        if len(ids) < llm.ctx_size or not conv.turns:
            break
        conv.turns = conv.turns[2:]
        log.warning("colibri: the conversation no longer fits --ctx-size %d: dropped the oldest turn",
                    llm.ctx_size)
    if len(ids) >= llm.ctx_size:
        raise ColibriError(f"this message ({len(ids)} tokens with the template) does not fit --ctx-size "
                           f"{llm.ctx_size}")
    return ids, text


class _Show:
    """Reasoning to stderr (dimmed on a terminal), the answer to stdout."""

    def __init__(self):
        self.dim = sys.stderr.isatty()
        self.thinking = False

    def __call__(self, reasoning: str, content: str) -> None:
        if reasoning:
            sys.stderr.write(f"\x1b[2m{reasoning}\x1b[0m" if self.dim else reasoning)
            sys.stderr.flush()
            self.thinking = True
        if content:
            if self.thinking:  # the reasoning's line ends where the answer starts
                sys.stderr.write("\n")
                self.thinking = False
            sys.stdout.write(content)
            sys.stdout.flush()


def _answer(llm, template, prompt: tuple[list[int], str], a: argparse.Namespace) -> str:
    """Stream one answer to stdout (its reasoning to stderr); Ctrl-C stops it (what came so far is kept)."""
    from ..server.answer import keep_ids, splitter
    from ..server.reasoning import opens_thinking
    from ..server.tool_formats import detect
    from ..tokenizer import StreamDecoder

    ids, text = prompt
    fmt = detect(template.source)
    split = splitter(fmt, None, True, opens_thinking(text), True, "<answer>" in template.source)
    h = llm.submit(ids, min(a.n_predict, llm.ctx_size - len(ids)), stop_ids=() if a.ignore_eos else template.stop_ids,
                   ignore_eos=a.ignore_eos, temperature=a.temperature, top_k=a.top_k, top_p=a.top_p, min_p=a.min_p,
                   repeat_penalty=a.repeat_penalty, repeat_last_n=a.repeat_last_n, seed=a.seed,
                   grammar=a.grammar_text)
    dec, parts, show = StreamDecoder(llm.tokenizer, keep_ids(llm.tokenizer, fmt)), [], _Show()
    interrupted = False
    try:
        for ev in h:
            if piece := dec.push(ev.token):
                reasoning, content = split.push(piece)
                parts.append(content)
                show(reasoning, content)
    except KeyboardInterrupt:
        h.cancel()
        for _ in h:  # the engine stops it at its next step
            pass
        interrupted = True
    reasoning, content = split.push(dec.flush())
    more, rest, _ = split.finish()
    parts += [content, rest]
    show(reasoning + more, content + rest)
    sys.stdout.write(" [interrupted]\n" if interrupted else "\n")
    sys.stdout.flush()
    if a.stats:
        print(stats_line(h.stats), file=sys.stderr)
    return "".join(parts)


def main(argv: list[str] | None = None) -> int:
    a = chat_parser().parse_args(argv)
    setup_logging(a.log_level)
    validate_sampling(a)
    check_prompt_cache(a)
    a.grammar_text = grammar_from_args(a)  # every answer follows it (checked before loading)
    llm = engine_from_args(a)
    apply_spec_args(llm, a)
    try:
        if a.prompt_cache:
            load_prompt_cache(llm, a.prompt_cache)
        template = llm.tokenizer.template()
        interactive = sys.stdin.isatty()
        conv = Conversation(a.system)
        template.render(conv.messages("hello"))  # a broken template fails now, not after the first message
        if interactive:
            print(f"colibri chat: {a.model} ({a.ctx_size} ctx). {HELP}", file=sys.stderr)
        while True:
            try:
                line = input("> ") if interactive else sys.stdin.readline()
            except KeyboardInterrupt:
                print("\n(Ctrl-D or /exit to quit)", file=sys.stderr)
                continue
            except EOFError:  # Ctrl-D
                print(file=sys.stderr)
                break
            if not interactive and not line:  # the end of the piped input
                break
            text = line.rstrip("\n")
            cmd = text.strip()
            if not cmd:
                continue
            if cmd in ("/exit", "/quit"):
                break
            if cmd == "/reset":
                conv.turns = []
                print("(conversation reset)", file=sys.stderr)
                continue
            if cmd == "/system" or cmd.startswith("/system "):
                conv.system, conv.turns = cmd[len("/system"):].strip() or None, []
                print("(system message set; conversation reset)", file=sys.stderr)
                continue
            if cmd.startswith("/") and cmd.split()[0] in ("/help", "/?"):
                print(HELP, file=sys.stderr)
                continue
            reply = _answer(llm, template, _fit(llm, template, conv, text), a)
            conv.turns += [{"role": "user", "content": text}, {"role": "assistant", "content": reply}]
            if a.prompt_cache:  # after each answer: a killed session keeps what it computed
                save_prompt_cache(llm, a.prompt_cache)
    finally:
        llm.close()
    return 0
