#!/usr/bin/env bash
# Run every check and test of the project: Rust format, lints and unit tests, Python lints,
# then pytest (differential, manager-level, bad-input, fuzzing and end-to-end engine tests).
# Installs what it needs first (scripts/setup_env.sh). Extra arguments go to pytest.
#
#   HYBRID_ALLOC_HYPOTHESIS_PROFILE=long   deeper fuzzing (default: ci, derandomized)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"

venv=$(bash scripts/setup_env.sh | tail -n 1)
export PATH="$venv/bin:$PATH"
export PYO3_PYTHON="$venv/bin/python"

echo "== cargo fmt --check"
cargo fmt --all -- --check
echo "== cargo clippy (core and binding) -D warnings"
cargo clippy --quiet --all-targets -- -D warnings
cargo clippy --quiet --all-targets --features python -- -D warnings
echo "== cargo test"
cargo test --quiet
echo "== ruff"
ruff check python tests benches scripts
ruff format --check python tests benches scripts
echo "== pytest"
python -m pytest -q -p no:cacheprovider "$@"
