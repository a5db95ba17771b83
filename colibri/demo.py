"""The built-in demo model: a small Mixtral-style MoE shipped as an HF folder, converted on first use."""

from __future__ import annotations

import os
import sys
from pathlib import Path

DEMO_HF = Path(__file__).parent / "data" / "demo"
# Its draft model for speculative decoding (a dense Qwen3 of 0.13 M parameters: tools/make_draft_model.py)
DRAFT_HF = Path(__file__).parent / "data" / "demo-draft"
# Its multi-token-prediction layer (tools/make_demo_mtp.py), converted with it for `--spec mtp`
MTP_HF = Path(__file__).parent / "data" / "demo-mtp"
# What bare `colibri` (and scripts/demo.sh without arguments) runs.
DEMO_ARGS = ("--prompt", "Once upon a time", "-n", "64", "--temperature", "0", "--ctx-size", "512")


def cache_dir() -> Path:
    root = os.environ.get("COLIBRI_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME")
                                                         or os.path.expanduser("~/.cache"), "colibri")
    return Path(root)


def demo_model(scheme: str = "bf16", draft: bool = False, mtp: bool = False) -> Path:
    """Path to the demo container (`draft`: its draft model's; `mtp`: with its MTP layer), converting the shipped
    checkpoint the first time."""
    from .convert.converter import convert

    src = DRAFT_HF if draft else DEMO_HF
    kind = "-draft" if draft else "-mtp" if mtp else ""
    out = cache_dir() / f"demo{kind}-{scheme}.coli"
    newest_src = max(f.stat().st_mtime for d in ((src, MTP_HF) if mtp else (src,)) for f in d.iterdir())
    if not out.exists() or out.stat().st_mtime < newest_src:
        out.parent.mkdir(parents=True, exist_ok=True)
        print(f"colibri: converting the built-in demo {kind[1:] + ' ' if kind else ''}model to {out} (once)",
              file=sys.stderr)
        if mtp:
            src = _with_mtp(out.with_suffix(".hf"))
        convert(src, out, scheme, progress=False)
    return out


def _with_mtp(folder: Path) -> Path:
    """The demo's HF folder with its MTP layer beside it (links to the shipped files; the config counts the
    layer), as a released DeepSeek-V3 checkpoint ships one."""
    import json
    import shutil

    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for f in (*DEMO_HF.iterdir(), MTP_HF / "mtp.safetensors"):
        if f.name != "config.json":
            (folder / f.name).symlink_to(f)
    cfg = json.loads((DEMO_HF / "config.json").read_text())
    (folder / "config.json").write_text(json.dumps({**cfg, "num_nextn_predict_layers": 1}))
    return folder
