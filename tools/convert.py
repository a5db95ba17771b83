#!/usr/bin/env python3
"""`colibri convert` for scripts that call the converter by path, installed or not:
`python tools/convert.py --input HF_DIR --output M.coli --arch moe`.

Same flags as `colibri convert`.
"""

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from colibri.cli import main  # noqa: E402

if __name__ == "__main__":
    sys.exit(main(["convert", *sys.argv[1:]]))
