"""`colibri inspect FILE`: print the header summary and verify every checksum."""

from __future__ import annotations

import argparse
import os
import sys
import time

from ..errors import ColibriError
from ..progress import Progress
from .container import Container


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="colibri inspect",
                                description="Print a container's header summary and verify every checksum.")
    p.add_argument("file", help="path to a .coli container")
    p.add_argument("--no-verify", action="store_true", help="only print the header (skip the checksum pass)")
    p.add_argument("--tensors", action="store_true", help="also list every tensor (name, dtype, shape, bytes)")
    a = p.parse_args(argv)
    if os.path.isfile(os.path.join(a.file, "config.json")):
        raise ColibriError(f"{a.file} is a Hugging Face folder: convert it first: "
                           f"colibri convert -i {a.file} -o OUT.coli")
    with Container(a.file) as c:
        print(c.summary())
        fallback = c.meta.get("quant_fallback")  # weights the converter stored as int8 (docs/QUANT.md)
        if isinstance(fallback, dict) and fallback:  # (meta is free-form: a foreign value is ignored)
            print(f"fallback:    {len(fallback)} weights not in {c.quant.get('scheme')}:")
            for name, why in fallback.items():
                print(f"  {name}: {why}")
        if a.tensors:
            for name in c.names():
                e = c.info(name)
                print(f"  {name:64s} {e['dtype']:>4s} {str(tuple(e['shape'])):>20s} {e['nbytes']:>12d}")
        if a.no_verify:
            return 0
        t0 = time.perf_counter()
        with Progress(c.file_size, "verifying checksums") as bar:
            last = [0]

            def progress(done: int, total: int) -> None:
                bar.update(done - last[0])
                last[0] = done

            c.verify(progress)
        n = len(c.names())
        print(f"checksums OK: {n} tensors verified in {time.perf_counter() - t0:.2f}s", file=sys.stderr)
    return 0
