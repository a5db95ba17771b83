"""`colibri` command line: one module per command, each with a `main(argv)`, and one dispatcher.

    colibri [run] --model M.coli --prompt "Hello" -n 64 --ctx-size 1024 --threads 2
    colibri serve --model M.coli --port 8000 --slots 4       # OpenAI-compatible HTTP server
    colibri chat --model M.coli                              # multi-turn chat REPL
    colibri convert --input HF_FOLDER --output M.coli --arch moe --quant int8
    colibri inspect M.coli
    colibri plan --model M.coli --mem-budget 3G
    colibri bench --model M.coli --mem-budget 3G --json
    colibri routes TRACE.jsonl --plot out.png --simulate      # routing statistics, cache-policy lab

The engine flags are shared by run, serve, chat and bench (`colibri/cli/common.py`).
"""

from __future__ import annotations

import argparse
import contextlib
import importlib
import shlex
import sys
from collections.abc import Iterator

from ..errors import ColibriError

# command name -> (module, function); a new command adds one line here.
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "run": ("colibri.cli.run", "main"),
    "serve": ("colibri.cli.serve", "main"),
    "chat": ("colibri.cli.chat", "main"),
    "convert": ("colibri.convert.converter", "main"),
    "inspect": ("colibri.format.inspect", "main"),
    "plan": ("colibri.plan", "main"),
    "bench": ("colibri.analysis.bench", "main"),
    "routes": ("colibri.analysis.routes", "main"),
    "perplexity": ("colibri.analysis.perplexity", "main"),
}


@contextlib.contextmanager
def _one_line_usage_errors() -> Iterator[None]:
    """argparse reports a bad flag as a usage block plus `PROG: error: ...` and exit 2; every parser of
    every subcommand raises a ColibriError instead while a command runs, so a flag mistake is the
    same one `colibri: error:` line as any other mistake."""
    def error(self: argparse.ArgumentParser, message: str) -> None:
        # "argument --top-p: --top-p must be ...": the flag once is enough
        head, _, rest = message.partition(": ")
        if head.startswith("argument ") and rest.startswith("-"):
            message = rest
        raise ColibriError(f"{message} (see '{self.prog} --help')")

    saved = argparse.ArgumentParser.error
    argparse.ArgumentParser.error = error  # type: ignore[method-assign]
    try:
        yield
    finally:
        argparse.ArgumentParser.error = saved  # type: ignore[method-assign]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv:  # bare `colibri`: the demo, as `bash scripts/demo.sh` runs it
        from ..demo import DEMO_ARGS

        print(f"colibri: no arguments: running the built-in demo model (colibri {shlex.join(DEMO_ARGS)}); "
              "'colibri --help' lists the flags", file=sys.stderr)
        argv = list(DEMO_ARGS)
    name = argv[0] if argv and argv[0] in SUBCOMMANDS else "run"  # the bare form is `run`
    rest = argv[1:] if argv and argv[0] == name else argv
    mod, fn = SUBCOMMANDS[name]
    try:
        with _one_line_usage_errors():
            return getattr(importlib.import_module(mod), fn)(rest) or 0
    except ColibriError as e:
        print(f"colibri: error: {e}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        print("\ncolibri: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        return 0
    except MemoryError:
        print("colibri: error: out of memory (try a smaller --ctx-size, a lower-bit --quant, or fewer "
              "--ram-layers)", file=sys.stderr)
        return 1


def run_parser():
    """The `run` command's parser (the bare `colibri` form)."""
    from .run import run_parser as parser

    return parser()


if __name__ == "__main__":
    sys.exit(main())
