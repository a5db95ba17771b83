"""The K/V cache type flags (llama.cpp's -ctk / -ctv), shared by the engine commands and `colibri plan`."""

from __future__ import annotations

import argparse

KV_TYPES = ("bf16", "q8_0", "q4_0")  # layers/kvquant.py's names (not imported: the CLI parses before torch loads)


def add_cache_type_args(p: argparse.ArgumentParser) -> None:
    """-ctk / -ctv, llama.cpp's spellings: the K and V caches' storage (docs/QUANT.md, "The KV cache")."""
    p.add_argument("--cache-type-k", "-ctk", choices=KV_TYPES, default="bf16",
                   help="the K cache's storage: bf16 (the compute dtype), q8_0 (int8, an f16 scale per 32 values: "
                        "~half the bytes) or q4_0 (4 bits: ~a quarter)")
    p.add_argument("--cache-type-v", "-ctv", choices=KV_TYPES, default="bf16",
                   help="the V cache's storage, as --cache-type-k")
