"""The routing debug log: one stderr line per (token, MoE layer), prompt and generated tokens alike.

    [req-3 pos 12 tok 2341 ' fox'] layer  4: 17:0.412 3:0.301 ...

A step listener (Engine.add_step_listener): it sees every row of every step, so prompt tokens,
the first generated token and the last are all there.
"""

from __future__ import annotations

import logging

log = logging.getLogger("colibri")


class RouteLogger:
    def __init__(self, tokenizer, logger: logging.Logger = log):
        self.tok, self.log = tokenizer, logger

    def __call__(self, step) -> None:
        if not self.log.isEnabledFor(logging.DEBUG) or not step.routes:
            return
        layers = sorted(step.routes)
        routes = {layer: (step.routes[layer][0].tolist(), step.routes[layer][1].tolist()) for layer in layers}
        for r, (req, pos, tok) in enumerate(step.rows):
            label = f"[{req} pos {pos} tok {tok} {self.tok.decode([tok], skip_special_tokens=False)!r}]"
            for layer in layers:
                ids, ws = routes[layer][0][r], routes[layer][1][r]
                pairs = " ".join(f"{e}:{w:.3f}" for e, w in zip(ids, ws))
                self.log.debug("%s layer %2d: %s", label, layer, pairs)
