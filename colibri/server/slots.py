"""GET /slots and POST /slots/{id}?action=save|restore|erase: the KV slots, and their caches on disk.

llama-server's slot endpoints: a client saves a free slot's prompt cache (a long system prompt, a
document it asks several questions about) under a name and restores it later, into any free slot
or after a restart, so its next prompt skips that prefix (Engine.save_prompt_cache, engine/kvfile.py).
Files live only in `--slot-save-path`; a name is one plain file name, never a path.
"""

from __future__ import annotations

import asyncio
import re
import time

from fastapi import APIRouter, Request

from ..errors import ColibriError, SlotBusyError
from .protocol import APIError, _Strict, bad_request, parse

router = APIRouter()
_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,127}")


class SlotFile(_Strict):
    filename: str


@router.get("/slots")
async def slots(request: Request) -> list[dict]:
    state = request.app.state.colibri
    return [{**s, "n_ctx": state.engine.ctx_size} for s in state.engine.slot_states()]


@router.post("/slots/{slot_id}")
async def slot_action(slot_id: int, request: Request, action: str = "") -> dict:
    state = request.app.state.colibri
    engine = state.engine
    if not 0 <= slot_id < engine.n_slots:
        raise APIError(404, f"no slot {slot_id}: this server has slots 0..{engine.n_slots - 1}", "slot_not_found")
    if action not in ("save", "restore", "erase"):
        raise bad_request(f"action must be save, restore or erase, got '{action}'", "action")
    t0 = time.perf_counter()
    if action == "erase":
        n = await _run(engine.erase_prompt_cache, slot_id)
        return {"id_slot": slot_id, "n_erased": n}
    if state.slot_dir is None:
        raise APIError(400, "saving and restoring slots needs the server started with --slot-save-path DIR",
                       "slot_save_disabled")
    name = parse(SlotFile, await request.body()).filename
    if not _NAME.fullmatch(name) or ".." in name:
        raise bad_request("filename must be a plain file name (letters, digits, '.', '_', '-'; no path)", "filename")
    path = state.slot_dir / name
    if action == "save":
        n = await _run(engine.save_prompt_cache, path, slot_id)
        if n == 0:  # (no file was written)
            raise APIError(400, f"slot {slot_id} holds no prompt cache: nothing to save", "slot_empty")
        return {"id_slot": slot_id, "filename": name, "n_saved": n, "n_written": path.stat().st_size,
                "timings": {"save_ms": (time.perf_counter() - t0) * 1000}}
    if not path.is_file():
        raise APIError(404, f"no saved slot named '{name}'", "slot_file_not_found", "filename")
    n = await _run(engine.load_prompt_cache, path, slot_id)
    return {"id_slot": slot_id, "filename": name, "n_restored": n, "n_read": path.stat().st_size,
            "timings": {"restore_ms": (time.perf_counter() - t0) * 1000}}


async def _run(fn, *args):
    """Off the event loop (a file of many MiB); a busy slot or a file of another model is a 409/400, a file
    gone meanwhile a 404, one that cannot be written or read (disk full, permissions) a 400 that says why."""
    try:
        return await asyncio.to_thread(fn, *args)
    except SlotBusyError as e:
        raise APIError(409, str(e), "slot_busy") from None
    except ColibriError as e:
        raise bad_request(str(e), "filename") from None
    except FileNotFoundError:
        raise APIError(404, "the saved slot file is gone", "slot_file_not_found", "filename") from None
    except OSError as e:
        raise APIError(400, f"cannot use the slot file: {e.strerror or e}", "slot_file_error", "filename") from None
