"""The ctypes declarations of a kernel file's entry points (each native_*.py's `_lib`), made once on first use: the
library itself loads (and builds) lazily in native.py, so the declarations cannot run at import."""

from __future__ import annotations

import ctypes
from collections.abc import Callable

from . import native

# a signature's letters: int, long, pointer, float (the kernels' argument types)
TYPES = {"i": ctypes.c_int, "l": ctypes.c_long, "p": ctypes.c_void_p, "f": ctypes.c_float}


def declared(specs: dict[str, str]) -> Callable[[], ctypes.CDLL]:
    """() -> the native library with `specs`' functions (name -> signature letters, `TYPES`; each returns an int
    status) declared."""
    done = False

    def lib() -> ctypes.CDLL:
        nonlocal done
        out = native.lib()
        if not done:  # (declaring twice from two threads is harmless: the same values)
            for name, sig in specs.items():
                fn = getattr(out, name)
                fn.argtypes, fn.restype = [TYPES[c] for c in sig], ctypes.c_int
            done = True
        return out

    return lib
