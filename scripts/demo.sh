#!/usr/bin/env bash
# Sets everything up, then runs colibri on the built-in demo model (a small Mixtral-style MoE
# shipped in colibri/data/demo, converted to a container on first use). Extra args go to colibri.
set -euo pipefail
cd "$(dirname "$0")/.."
bash scripts/setup.sh
if [ $# -eq 0 ]; then
  set -- --prompt "Once upon a time" -n 64 --temperature 0 --ctx-size 512
fi
exec .venv/bin/colibri "$@"
