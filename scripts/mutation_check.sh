#!/usr/bin/env bash
# Show that the state machines catch a deliberately injected allocator bug.
# Builds a mutated copy of the extension in a scratch worktree (the real build is left
# alone), then runs the given tests against it and expects them to FAIL.
#
#   scripts/mutation_check.sh MUTATION [pytest args...]
#   MUTATION: skip-shared-decrement | evict-wrong-block | lifo-cached
set -euo pipefail
root=$(cd "$(dirname "$0")/.." && pwd)
mutation=${1:?mutation name}
shift
venv=$(bash "$root/scripts/setup_env.sh" | tail -n 1)
scratch=$(mktemp -d /tmp/hybrid_alloc_mutant.XXXXXX)
trap 'git -C "$root" worktree remove --force "$scratch/tree" >/dev/null 2>&1 || true; rm -rf "$scratch"' EXIT
git -C "$root" worktree add --detach "$scratch/tree" HEAD >/dev/null
src="$scratch/tree/rust/src/group_pool.rs"
case "$mutation" in
  skip-shared-decrement)
    # free(): a block held twice loses only... nothing: its count is not decremented.
    perl -0pi -e 's/            \*cnt -= 1;\n            if \*cnt == 0 \{\n                match/            if *cnt == 1 { *cnt -= 1; }\n            if *cnt == 0 {\n                match/' "$src" ;;
  evict-wrong-block)
    # evict(): drop the hashes of the next block ID instead of the one named.
    perl -0pi -e 's/Ok\(self\.cache\.remove_block\(id, \|k\| removed\(id, k\)\)\)/let victim = (id + 1) % self.num_blocks() as u32;\n        Ok(self.cache.remove_block(victim, |k| removed(victim, k)))/' "$src" ;;
  lifo-cached)
    # free(): cached blocks go to the front instead of the back (breaks LRU order).
    perl -0pi -e 's/FreeTo::Back => back\.push\(id\)/FreeTo::Back => front.push(id)/' "$src" ;;
  *) echo "unknown mutation $mutation" >&2; exit 2 ;;
esac
if git -C "$scratch/tree" diff --quiet; then
  echo "mutation $mutation did not apply" >&2; exit 2
fi
git -C "$scratch/tree" diff --stat
(cd "$scratch/tree" && CARGO_TARGET_DIR="$scratch/target" "$venv/bin/maturin" build --release -q -o "$scratch/wheel" >/dev/null)
(cd "$scratch" && unzip -q -o wheel/*.whl 'hybrid_alloc/_native*' -d "$scratch/tree/python")
cd "$scratch/tree"
set +e
PYTHONPATH="$scratch/tree/python:$scratch/tree" "$venv/bin/python" -m pytest -q -p no:cacheprovider -p no:logging -x "$@"
rc=$?
set -e
if [ $rc -eq 0 ]; then
  echo "MUTANT SURVIVED: $mutation was not caught" >&2
  exit 1
fi
echo "mutant $mutation caught (pytest exit $rc)"
