#!/usr/bin/env bash
# The demo: install everything (scripts/setup_env.sh), write a tiny random-weight hybrid
# model, serve it with a real vLLM engine once per backend (stock pool, Rust pool) and
# print capacity, speed and whether the outputs match token for token.
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
venv=$(bash "$root/scripts/setup_env.sh" 0.32 | tail -n 1)
cd "$root"
PYTHONPATH="$root${PYTHONPATH:+:$PYTHONPATH}" exec "$venv/bin/python" examples/demo.py "$@"
