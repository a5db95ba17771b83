"""Where a GPU run of a quantized model parts from the CPU's torch path: per layer, the attention and MoE
outputs and the routes of one prompt (a device-check aid; run by hand: python3 tests/cuda_diag.py FAMILY SCHEME)."""

from __future__ import annotations

import os
import sys
import tempfile
from pathlib import Path

os.environ.setdefault("COLIBRI_NATIVE", "0")  # the CPU side on torch's ops, as the GPU runs them
sys.path.insert(0, str(Path(__file__).parent))

import torch  # noqa: E402
from conftest import Checkpoints  # noqa: E402
from test_tiers import PROMPT  # noqa: E402

from colibri.api import Engine  # noqa: E402
from colibri.format.container import Container  # noqa: E402
from colibri.store import Placement, model_sizes  # noqa: E402


def trace(path: Path, tier: str, device: str, gen: int = 0) -> dict[str, torch.Tensor]:
    n = model_sizes(Container(path)).n_layers
    llm = Engine(path, ctx_size=128, threads=2, placement=Placement([tier] * n), gpu_device=device)
    seen: dict[str, torch.Tensor] = {}
    hooks = []
    for i, block in enumerate(llm.model.model.layers):
        for name in ("self_attn", "mlp", "mlp.gate"):
            mod = block.get_submodule(name) if hasattr(block.mlp, "gate") or name != "mlp.gate" else None
            if mod is None:
                continue

            def hook(m, args, out, key=f"{i}.{name}"):
                o = out[0] if isinstance(out, tuple) else out
                seen[key] = o.detach().float().cpu()
                if isinstance(out, tuple):
                    seen[key + ".w"] = out[1].detach().float().cpu()
            hooks.append(mod.register_forward_hook(hook))
    if gen:  # greedy tokens first, as tests/test_cuda.py's run() (the hooks record the logits call's)
        seen["tokens"] = torch.tensor(list(llm.generate_ids(PROMPT, gen, temperature=0, ignore_eos=True)))
    logits = llm.logits(PROMPT * 3).float().cpu()
    seen["logits"] = logits
    llm.close()
    return seen


def main() -> None:
    family, scheme = sys.argv[1], sys.argv[2]
    ck = Checkpoints(Path(tempfile.mkdtemp()))
    path = ck.coli(family, scheme)
    dev = os.environ.get("DIAG_DEVICE", "cuda")
    gen = int(sys.argv[3]) if len(sys.argv) > 3 else 0
    cpu, gpu = trace(path, "ram", dev, gen), trace(path, "gpu", dev, gen)
    if gen:
        print("tokens", cpu.pop("tokens").tolist(), gpu.pop("tokens").tolist())
    for key in cpu:
        a, b = cpu[key], gpu[key]
        if a.dtype == torch.float32 and key.endswith("gate") and a.shape == b.shape:
            print(f"{key:20s} routes equal {torch.equal(a, b)}")
            continue
        rel = ((a - b).abs().max() / a.abs().max().clamp_min(1e-30)).item()
        print(f"{key:20s} {tuple(a.shape)} {a.dtype} rel {rel:.3e}")


if __name__ == "__main__":
    main()
