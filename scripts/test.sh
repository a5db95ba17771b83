#!/usr/bin/env bash
# Sets everything up, then runs the linter and the whole test suite (extra args go to pytest).
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
.venv/bin/ruff check colibri tests benchmarks tools
.venv/bin/python -m pytest "$@"
