"""`colibri serve`: the OpenAI-compatible HTTP server (docs/SERVER.md).

    colibri serve --model M.coli [--host 127.0.0.1] [--port 8000] [--slots 4] [--api-key KEY] [--shutdown-grace 10]
                  [--slot-save-path DIR]
"""

from __future__ import annotations

import argparse

from ..server.tool_formats import NAMES as TOOL_FORMATS
from .common import HelpFormatter, add_engine_args, bounded
from .specflags import add_spec_args


def serve_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="colibri serve", formatter_class=HelpFormatter,
                                description="Serve a model over an OpenAI-compatible HTTP API "
                                            "(/v1/chat/completions with tools and JSON modes, /v1/completions, "
                                            "/v1/models, /tokenize, /detokenize, /slots, /health, /metrics, "
                                            "/dashboard; docs/SERVER.md).")
    h = p.add_argument_group("HTTP")
    h.add_argument("--host", default="127.0.0.1", help="address to bind (0.0.0.0 exposes it to the network)")
    h.add_argument("--port", type=bounded("--port", 1, 65535), default=8000, help="TCP port")
    h.add_argument("--api-key", default=None,
                   help="require 'Authorization: Bearer KEY' on every /v1, /tokenize, /detokenize and /slots "
                        "request (default: no key)")
    h.add_argument("--model-id", default=None,
                   help="the model name clients send and /v1/models lists (default: the file's stem)")
    h.add_argument("--shutdown-grace", type=bounded("--shutdown-grace", 0, 86400), default=10, metavar="S",
                   help="after SIGINT/SIGTERM, seconds running requests may go on before they are cancelled")
    h.add_argument("--allowed-origins", default=None, metavar="ORIGINS",
                   help="comma-separated origins whose web pages may call the API from a browser (CORS), "
                        "e.g. 'http://localhost:3000', or '*' for any (default: none)")
    h.add_argument("--reasoning-format", choices=("deepseek", "none"), default="deepseek",
                   help="deepseek: a thinking model's <think>...</think> goes to message.reasoning_content "
                        "(llama-server's default); none: it stays in content")
    h.add_argument("--tool-parser", choices=("auto", *TOOL_FORMATS), default="auto",
                   help="how the model writes tool calls (tool_choice auto): hermes <tool_call>{json}, glm45 "
                        "<arg_key>/<arg_value>, qwen3_coder <function=NAME><parameter=K>, mistral [TOOL_CALLS], "
                        "deepseek <｜tool▁call▁begin｜>, harmony "
                        "(gpt-oss channels); auto: the one the chat template shows")
    h.add_argument("--slot-save-path", default=None, metavar="DIR",
                   help="enable POST /slots/{id}?action=save|restore: slot prompt caches are saved to and "
                        "restored from files in DIR (created if missing)")
    h.add_argument("--replicas", type=bounded("--replicas", 1, 1024), default=None, metavar="N",
                   help="N whole engines behind this one endpoint, through Ray Serve: one a node offering 'colibri' "
                        "on the --cluster (without it: N on this machine); /health and /metrics cover them all "
                        "(docs/CLUSTER.md)")
    add_spec_args(p)  # (the defaults of requests that do not say: the body's `speculative` field)
    add_engine_args(p, slots=4)
    p.set_defaults(log_level="info")  # one line per request
    return p


def main(argv: list[str] | None = None) -> int:
    a = serve_parser().parse_args(argv)
    if a.replicas is not None:
        from ..cli.common import setup_logging
        from ..server.replicas import serve_replicas

        setup_logging(a.log_level)
        return serve_replicas(a)
    from ..server.main import serve

    return serve(a)
