"""The speculative-decoding flags of run, chat, serve and bench (engine/speculative.py, engine/draft.py)."""

from __future__ import annotations

import argparse
import logging

from ..errors import ColibriError
from .common import bounded

log = logging.getLogger("colibri")


def add_spec_args(p: argparse.ArgumentParser) -> None:
    """--spec, --draft-max, --draft-model, --draft-p-min: the engine's speculative decoding (engine/speculative.py)
    and the defaults of requests that do not say."""
    from ..engine.draft import P_MIN
    from ..engine.speculative import CAP, DRAFT_MAX

    g = p.add_argument_group("speculative decoding (the same greedy tokens, the same sampling distribution, "
                             "fewer forwards)")
    g.add_argument("--spec", type=_spec_mode, default=None, metavar="auto|off|lookup|draft|mtp",
                   help="auto: prompt-lookup drafts where the measured gate says they pay (and the draft model's "
                        "where lookup finds no match); lookup: every match verified; draft: the draft model's; "
                        "mtp: the model's own multi-token-prediction layer's (DeepSeek-V3/V3.2, GLM-4.5/4.7/5, "
                        "Qwen3-Next/3.5: loaded for it); off: one token per forward (default: draft with "
                        "--draft-model, else auto)")
    g.add_argument("--draft-max", type=bounded("--draft-max", 0, CAP - 1), default=DRAFT_MAX, metavar="N",
                   help="most drafted tokens verified per forward")
    g.add_argument("--draft-model", "-md", metavar="PATH", default=None,
                   help="a smaller .coli of the same tokenizer proposing the drafts (run in this process); "
                        "'demo': the built-in demo model's draft")
    g.add_argument("--draft-p-min", type=_probability, default=P_MIN, metavar="P",
                   help=f"the draft model (or MTP layer) proposes a token while it gives it at least this "
                        f"probability ({P_MIN})")


def _probability(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        v = -1.0
    if not 0.0 <= v <= 1.0:
        raise argparse.ArgumentTypeError(f"must be a probability in [0, 1], got {text!r}")
    return v


def _spec_mode(text: str) -> str:
    from ..engine.speculative import DRAFT_MAX, check

    try:
        check(text, DRAFT_MAX)
    except ColibriError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    return text


def spec_mode(a: argparse.Namespace) -> str | None:
    """--spec as given, else "draft" where --draft-model is (engine_from_args refused --spec draft without one)."""
    return getattr(a, "spec", None) or ("draft" if getattr(a, "draft_model", None) else None)


def apply_spec_args(llm, a: argparse.Namespace) -> None:
    """The engine's defaults from --spec / --draft-max / --draft-p-min (a namespace built without them keeps the
    engine's)."""
    asked = spec_mode(a)
    llm.speculative = asked or ("auto" if hasattr(a, "spec") else llm.speculative)
    if asked not in (None, "off") and (why := llm._runner.spec.why_not):  # (not for the default's "auto")
        log.warning("colibri: --spec %s: this model decodes without drafts: %s", llm.speculative, why)
    llm.draft_max = getattr(a, "draft_max", llm.draft_max)
    for src in (llm._draft, llm._mtp):  # (the draft model's and the MTP layer's confidence cut)
        if src is not None:
            src.p_min = getattr(a, "draft_p_min", src.p_min)
