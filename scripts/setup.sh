#!/usr/bin/env bash
# Creates .venv (once) and installs colibri with the pinned CPU torch and the test tools.
# Idempotent: a second run only checks that everything is installed.
set -euo pipefail
cd "$(dirname "$0")/.."
PY=${PYTHON:-python3}
if [ ! -x .venv/bin/python ]; then
  "$PY" -m venv .venv
fi
stamp=.venv/.colibri-setup
if [ ! -f "$stamp" ] || [ requirements-dev.txt -nt "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
  .venv/bin/python -m pip install --quiet --disable-pip-version-check -r requirements-dev.txt
  .venv/bin/python -m pip install --quiet --disable-pip-version-check --no-deps -e .
  touch "$stamp"
fi
# Claude Code's CLI, for the test that runs it against `colibri serve` (tests/test_server_claude_code.py), in the
# ignored .node/; optional: without npm, or offline, that test skips and setup goes on.
claude=.node/node_modules/.bin/claude
if command -v npm >/dev/null 2>&1 && ! "$claude" --version >/dev/null 2>&1; then
  limit=$(command -v timeout >/dev/null 2>&1 && echo "timeout 600" || true)
  $limit npm install --prefix .node --no-audit --no-fund --loglevel=error @anthropic-ai/claude-code >/dev/null 2>&1 || true
  # npm may skip the package's postinstall (which puts the native binary in place): run it then
  if ! "$claude" --version >/dev/null 2>&1 && [ -f .node/node_modules/@anthropic-ai/claude-code/install.cjs ]; then
    (cd .node/node_modules/@anthropic-ai/claude-code && node install.cjs) >/dev/null 2>&1 || true
  fi
  "$claude" --version >/dev/null 2>&1 || echo "setup: Claude Code's CLI could not be installed (its test will skip)" >&2
fi
