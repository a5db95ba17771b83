"""Train the demo's draft model shipped in colibri/data/demo-draft/ (speculative decoding's `--draft-model`).

Command (from the repository root, CPU only; ~1-2 minutes of one core)::

    .venv/bin/python tools/make_draft_model.py            # writes colibri/data/demo-draft/

What it makes: a dense Qwen3-architecture model (transformers' Qwen3ForCausalLM: 2 layers, hidden 64, 2 heads of
32, one K/V head, MLP 192, tied embeddings) with the demo's own tokenizer (colibri/data/demo/tokenizer.json,
copied: a draft's ids must be its target's), trained from scratch on the demo's corpus (tools/make_demo_model.py
`make_corpus`, the same seed: the stories the demo model learnt), so that its greedy continuations are often the
demo's. About 0.14 M parameters, bf16, under 0.4 MiB. Seeded and with a fixed step count: a re-run reproduces the
run on the same machine (bit-identical weights across CPUs are not guaranteed).

Options: --out DIR, --steps N, --threads N.
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch
from tokenizers import Tokenizer
from transformers import Qwen3Config, Qwen3ForCausalLM

sys.path.insert(0, str(Path(__file__).resolve().parent))
from make_demo_model import (  # noqa: E402 - (tools/ is not a package)
    BOS_ID,
    EOS_ID,
    PAD_ID,
    ROOT,
    SEED,
    SEQ_LEN,
    VOCAB_SIZE,
    fit,
    held_out,
    make_corpus,
    save,
    token_stream,
    tool_args,
)

DEMO = ROOT / "colibri" / "data" / "demo"
DEFAULT_OUT = ROOT / "colibri" / "data" / "demo-draft"
MODEL = dict(vocab_size=VOCAB_SIZE, hidden_size=64, intermediate_size=192, num_hidden_layers=2,
             num_attention_heads=2, num_key_value_heads=1, head_dim=32, max_position_embeddings=2048,
             rope_theta=10000.0, tie_word_embeddings=True, bos_token_id=BOS_ID, eos_token_id=EOS_ID,
             pad_token_id=PAD_ID)
STEPS = 1200
LR = 5e-3
WARMUP = 60


def train(tok: Tokenizer, steps: int) -> Qwen3ForCausalLM:
    data = token_stream(tok, make_corpus())
    train_ids, val_ids = held_out(data)
    torch.manual_seed(SEED)
    model = Qwen3ForCausalLM(Qwen3Config(**MODEL))
    print(f"model: {sum(p.numel() for p in model.parameters()) / 1e6:.3f} M parameters, {len(data)} tokens")
    model.train()
    t0 = time.time()
    ema = fit(list(model.parameters()), lambda x: model(input_ids=x, labels=x).loss, train_ids, steps, LR, WARMUP)
    model.eval()
    with torch.no_grad():
        n = (len(val_ids) - 1) // SEQ_LEN
        val = model(input_ids=val_ids[: n * SEQ_LEN].reshape(n, SEQ_LEN), labels=None)
        logits = val.logits[:, :-1].reshape(-1, VOCAB_SIZE)
        held = torch.nn.functional.cross_entropy(logits, val_ids[: n * SEQ_LEN].reshape(n, SEQ_LEN)[:, 1:].reshape(-1))
    print(f"done in {time.time() - t0:.0f}s: train loss (ema) {ema:.3f}, held-out loss {held.item():.3f}")
    return model


def main() -> None:
    a = tool_args(__doc__, DEFAULT_OUT, STEPS)
    tok = Tokenizer.from_file(str(DEMO / "tokenizer.json"))
    model = train(tok, a.steps)
    ids = torch.tensor([tok.encode("Once upon a time").ids])
    out = model.generate(ids, max_new_tokens=40, do_sample=False, eos_token_id=EOS_ID, pad_token_id=PAD_ID)
    print(f"greedy> {tok.decode(out[0].tolist(), skip_special_tokens=True)!r}")
    save(model, tok, a.out)


if __name__ == "__main__":
    main()
