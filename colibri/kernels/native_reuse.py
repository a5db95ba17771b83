"""ctypes side of kernels/reuse.c: the expert cache's reuse policy on its per-fetch path (store/reuse.py,
store/cache.py)."""

from __future__ import annotations

import ctypes

from . import native

_D, _L, _P, _I = ctypes.c_double, ctypes.c_long, ctypes.c_void_p, ctypes.c_int
_SIGS = {"coli_reuse_observe": (_I, [_P, _P, _P, _P, _P, _L, _P, _I, _D, _D, _P, _P, _D, _L]),
         "coli_reuse_rescore": (_I, [_P, _P, _P, _L, _L, _P, _L]),
         "coli_reuse_order": (_L, [_P, _P, _P, _L, _P, _L])}
MAX_EXPERTS = 4096  # reuse.c MAX_E: a layer with more expert ids stays on the numpy path
_lib: ctypes.PyDLL | None = None
_tried = False


def lib() -> ctypes.PyDLL | None:
    """reuse.c's functions, or None without the native kernels. Bound through PyDLL, which keeps the GIL: each
    call takes microseconds, made from the engine's layer hook while the reader threads wait for the GIL;
    releasing it there would hand it to them mid-hook."""
    global _lib, _tried
    if not _tried:
        base = native.lib()
        if base is not None:
            out = ctypes.PyDLL(base._name)
            for name, (res, args) in _SIGS.items():
                fn = getattr(out, name)
                fn.restype, fn.argtypes = res, args
            _lib = out
        _tried = True
    return _lib
