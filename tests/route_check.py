"""One check the router tests share: bf16 rows take a router's native rule (kernels/route.c) and get the experts and
weights its torch rule gives on the same values."""

from __future__ import annotations

import pytest
import torch


def assert_native_routes_as_torch(router, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`router` on bf16 rows `x` (native) against `router` on their f32 values (torch); returns the torch routes."""
    from colibri.kernels import native

    if not native.available():
        pytest.skip(f"native kernels: {native.why_unavailable()}")
    assert router.native_routing() is not None
    idx, w = router(x.bfloat16())  # native
    ref_idx, ref_w = router(x.bfloat16().float())  # torch, the same values
    a, mine = idx.sort(-1)
    b, theirs = ref_idx.sort(-1)
    assert torch.equal(a, b)
    torch.testing.assert_close(w.gather(1, mine), ref_w.gather(1, theirs), rtol=1e-5, atol=1e-6)
    return ref_idx, ref_w
