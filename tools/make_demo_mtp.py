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

import argparse
import math
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
from make_demo_model import BATCH, ROOT, SEED, SEQ_LEN, make_corpus, token_stream  # noqa: E402 - (not a package)

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


def lr_at(step: int, steps: int) -> float:
    if step < WARMUP:
        return LR * (step + 1) / WARMUP
    return LR * (0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * (step - WARMUP) / max(1, steps - WARMUP))))


def loss_of(mtp: MTP, demo: MixtralForCausalLM, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cross-entropy, top-1 accuracy) of predicting token i + 2."""
    logits = mtp(demo, x)[:, :-1]
    want = x[:, 2:]
    ce = nn.functional.cross_entropy(logits.reshape(-1, logits.shape[-1]), want.reshape(-1))
    return ce, (logits.argmax(-1) == want).float().mean()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    ap.add_argument("--steps", type=int, default=STEPS)
    ap.add_argument("--threads", type=int, default=1)  # (the demo's reason: results depend on the thread count)
    a = ap.parse_args()
    torch.set_num_threads(a.threads)
    demo = MixtralForCausalLM.from_pretrained(DEMO, dtype=torch.float32, attn_implementation="eager").eval()
    demo.requires_grad_(False)
    data = token_stream(Tokenizer.from_file(str(DEMO / "tokenizer.json")), make_corpus())
    n_val = len(data) // 20
    train_ids, val_ids = data[:-n_val], data[-n_val:]
    torch.manual_seed(SEED)
    mtp = MTP(demo)
    opt = torch.optim.AdamW(mtp.parameters(), lr=LR, betas=(0.9, 0.95), weight_decay=0.05)
    gen = torch.Generator().manual_seed(SEED)
    t0, ema = time.time(), float("nan")
    for step in range(a.steps):
        starts = torch.randint(0, len(train_ids) - SEQ_LEN - 1, (BATCH,), generator=gen)
        x = torch.stack([train_ids[s : s + SEQ_LEN] for s in starts.tolist()])
        for group in opt.param_groups:
            group["lr"] = lr_at(step, a.steps)
        loss, _ = loss_of(mtp, demo, x)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(mtp.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        ema = loss.item() if math.isnan(ema) else 0.95 * ema + 0.05 * loss.item()
        if step % 100 == 0 or step == a.steps - 1:
            print(f"step {step:5d}  loss {loss.item():.3f}  (ema {ema:.3f})  {time.time() - t0:.0f}s", flush=True)
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
