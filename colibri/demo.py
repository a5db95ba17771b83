"""The built-in demo model: a small Mixtral-style MoE shipped as an HF folder, converted on first use."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEMO_HF = Path(__file__).parent / "data" / "demo"
# Its draft model for speculative decoding (a dense Qwen3 of 0.13 M parameters: tools/make_draft_model.py)
DRAFT_HF = Path(__file__).parent / "data" / "demo-draft"
# What bare `colibri` (and scripts/demo.sh without arguments) runs.
DEMO_ARGS = ("--prompt", "Once upon a time", "-n", "64", "--temperature", "0", "--ctx-size", "512")


def cache_dir() -> Path:
    root = os.environ.get("COLIBRI_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                         or os.path.expanduser("~/.cache"), "colibri")
    return Path(root)


def demo_model(scheme: str = "bf16", draft: bool = False) -> Path:
    """Path to the demo container (`draft`: its draft model's), converting the shipped checkpoint the first time."""
    from .convert.converter import convert

    src = DRAFT_HF if draft else DEMO_HF
    out = cache_dir() / f"demo{'-draft' if draft else ''}-{scheme}.coli"
    newest_src = max(f.stat().st_mtime for f in src.iterdir())
    if not out.exists() or out.stat().st_mtime < newest_src:
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"colibri: converting the built-in demo {'draft ' if draft else ''}model to {out} (once)",
              file=sys.stderr)
        convert(src, out, scheme, progress=False)
    return out
