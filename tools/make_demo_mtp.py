"""Train a multi-token-prediction layer for the demo model, shipped in colibri/data/demo-mtp/ (`--spec mtp`).

Command (from the repository root, CPU only; a few minutes of one core)::

    .venv/bin/python tools/make_demo_mtp.py            # writes colibri/data/demo-mtp/mtp.safetensors

What it makes: DeepSeek-V3's MTP layer on the demo (colibri/layers/mtp.py has the layout): from the demo's final
hidden state h_i (after its final norm) and the embedding of token i + 1, e, it runs eh_proj([enorm(e); hnorm(h)])
through one more Mixtral decoder layer (initialized from the demo's last layer) and the demo's head after its own
norm, trained to predict token i + 2 on the demo's corpus (tools/make_demo_model.py `make_corpus`, the same seed)
while the demo itself stays frozen. The file holds the layer under the names a checkpoint ships it with
(`model.layers.4.*`: the decoder layer in transformers' in-memory layout, enorm, hnorm, eh_proj,
shared_head.norm), bf16; colibri/demo.py `demo_model(mtp=True)` converts the demo with it. Seeded and with a fixed
step count: a re-run reproduces the run on the same machine (bit-identical weights across CPUs are not
guaranteed).

Options: --out DIR, --steps N, --threads N.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from safetensors.torch import save_file
from tokenizers import Tokenizer
from torch import nn
from transformers import MixtralForCausalLM
from transformers.models.mixtral.modeling_mixtral import MixtralDecoderLayer, MixtralRMSNorm

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_demo_model import (  # noqa: E402 - (tools/ is not a package)
    ROOT,
    SEED,
    SEQ_LEN,
    fit,
    held_out,
    make_corpus,
    token_stream,
    tool_args,
)

DEMO = ROOT / "colibri" / "data" / "demo"
DEFAULT_OUT = ROOT / "colibri" / "data" / "demo-mtp"
STEPS = 800
LR = 2e-3
WARMUP = 50


class MTP(nn.Module):
    def __init__(self, demo: MixtralForCausalLM):
        super().__init__()
        cfg = demo.config
        H, n = cfg.hidden_size, cfg.num_hidden_layers
        self.enorm, self.hnorm = MixtralRMSNorm(H, cfg.rms_norm_eps), MixtralRMSNorm(H, cfg.rms_norm_eps)
        self.eh_proj = nn.Linear(2 * H, H, bias=False)
        with torch.no_grad():  # (starts as "h, plus a little of e")
            self.eh_proj.weight.copy_(torch.cat([0.1 * torch.eye(H), torch.eye(H)], 1))
        self.layer = MixtralDecoderLayer(cfg, layer_idx=n - 1)
        self.layer.load_state_dict(demo.model.layers[n - 1].state_dict())
        self.norm = MixtralRMSNorm(H, cfg.rms_norm_eps)
        self.norm.load_state_dict(demo.model.norm.state_dict())

    def forward(self, demo: MixtralForCausalLM, ids: torch.Tensor) -> torch.Tensor:
        """ids [B, S] -> logits [B, S - 1, V]: row i predicts token i + 2."""
        with torch.no_grad():
            h = demo.model(ids).last_hidden_state[:, :-1]  # [B, S - 1, H], after the final norm
            e = demo.model.embed_tokens(ids[:, 1:])
        x = self.eh_proj(torch.cat([self.enorm(e), self.hnorm(h)], -1))
        T = x.shape[1]
        pos = torch.arange(T)[None]
        mask = torch.full((T, T), float("-inf")).triu(1)[None, None]
        y = self.layer(x, position_embeddings=demo.model.rotary_emb(x, pos), attention_mask=mask, position_ids=pos)
        return demo.lm_head(self.norm(y))

    def tensors(self, n: int) -> dict[str, torch.Tensor]:
        """The layer under a checkpoint's names (layer n, past the demo's stack), bf16."""
        out = {f"model.layers.{n}.{k}": v for k, v in self.layer.state_dict().items()}
        for k in ("enorm", "hnorm", "eh_proj"):
            out[f"model.layers.{n}.{k}.weight"] = getattr(self, k).weight
        out[f"model.layers.{n}.shared_head.norm.weight"] = self.norm.weight
        return {k: v.detach().to(torch.bfloat16).contiguous() for k, v in out.items()}


def loss_of(mtp: MTP, demo: MixtralForCausalLM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, top-1 accuracy) of predicting token i + 2."""
    logits = mtp(demo, x)[:, :-1]
    want = x[:, 2:]
    ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1))
    return ce, (logits.argmax(-1) == want).float().mean()


def main() -> None:
    a = tool_args(__doc__, DEFAULT_OUT, STEPS)
    demo = MixtralForCausalLM.from_pretrained(DEMO, dtype=torch.float32, attn_implementation="eager").eval()
    demo.requires_grad_(False)
    data = token_stream(Tokenizer.from_file(str(DEMO / "tokenizer.json")), make_corpus())
    train_ids, val_ids = held_out(data)
    torch.manual_seed(SEED)
    mtp = MTP(demo)
    t0 = time.time()
    ema = fit(list(mtp.parameters()), lambda x: loss_of(mtp, demo, x)[0], train_ids, a.steps, LR, WARMUP)
    with torch.no_grad():
        n = (len(val_ids) - 1) // SEQ_LEN
        held, acc = loss_of(mtp, demo, val_ids[: n * SEQ_LEN].reshape(n, SEQ_LEN))
    print(f"done in {time.time() - t0:.0f}s: train loss (ema) {ema:.3f}, held-out loss {held.item():.3f}, "
          f"held-out top-1 of token i + 2 {acc.item():.3f}")
    a.out.mkdir(parents=True, exist_ok=True)
    path = a.out / "mtp.safetensors"
    save_file(mtp.tensors(demo.config.num_hidden_layers), str(path), metadata={"format": "pt"})
    print(f"wrote {path} ({path.stat().st_size / 2**20:.2f} MiB)")


if __name__ == "__main__":
    main()
