"""Mutation check: deliberately broken copies of the allocator must be caught by the tests.

    python scripts/mutation_check.py [--list] [--keep] [MUTANT ...]

For each mutant (all by default) the script copies the sources into a scratch directory,
applies one small textual change (it must apply exactly once, or the check stops with an
error), builds the extension there when the change is in Rust (the shipped `.so` is copied
for Python mutants), and runs the mutant's named tests against that copy: pytest files, or
the core's own tests (``cargo:FILTER``, run with ``cargo test --lib``, no extension built).
A mutant counts as *caught* only when at least one of its named tests reports a test
failure (pytest's ``<failure>``: an assertion, a failed ``pytest.raises``, a state machine's
falsified invariant; a failed cargo test); a build error, a collection error or a setup
error is a broken harness, not a catch, and stops the check with exit status 2. Any
surviving mutant makes the exit status 1.

Run by ``scripts/test.sh`` after the test suite (the unmutated tests must pass first).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
import xml.etree.ElementTree as ET
import zipfile
from dataclasses import dataclass
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
COPIED = ("Cargo.toml", "Cargo.lock", "pyproject.toml", "README.md", "rust", "python", "tests")


@dataclass(frozen=True)
class Mutant:
    name: str
    why: str
    path: str
    old: str
    new: str
    tests: tuple[str, ...]
    """pytest paths, or ``cargo:FILTER`` for the core's own tests (``cargo test --lib``)."""

    @property
    def in_rust(self) -> bool:
        return self.path.startswith("rust/")

    @property
    def pytest_paths(self) -> tuple[str, ...]:
        return tuple(t for t in self.tests if not t.startswith(CARGO))

    @property
    def cargo_filters(self) -> tuple[str, ...]:
        return tuple(t.removeprefix(CARGO) for t in self.tests if t.startswith(CARGO))


CARGO = "cargo:"


MUTANTS = (
    Mutant(
        "skip-shared-decrement",
        "free() of a block held twice leaves its count alone",
        "rust/src/group_pool.rs",
        "            *cnt -= 1;\n"
        "            if *cnt == 0 {\n                match self.free_destination(id)",
        "            if *cnt == 1 {\n                *cnt -= 1;\n            }\n"
        "            if *cnt == 0 {\n                match self.free_destination(id)",
        ("tests/pool/test_differential.py",),
    ),
    Mutant(
        "lifo-cached",
        "freed cached blocks go to the front of the free queue (breaks LRU eviction order)",
        "rust/src/group_pool.rs",
        "FreeTo::Back => back.push(id)",
        "FreeTo::Back => front.push(id)",
        ("tests/pool/test_differential.py",),
    ),
    Mutant(
        "evict-wrong-block",
        "eviction by ID drops the hashes of the next block instead of the one named",
        "rust/src/group_pool.rs",
        "            count += self.cache.remove_block(id, |k| removed(id, k));",
        "            let victim = (id + 1) % self.num_blocks() as BlockId;\n"
        "            count += self.cache.remove_block(victim, |k| removed(victim, k));",
        ("tests/pool/test_differential.py",),
    ),
    Mutant(
        "free-to-wrong-pool",
        "a mixed free hands other pools' blocks to the pool it was called on",
        "rust/src/routing.rs",
        "        if pool == *this {\n            routed.own.push(value);",
        "        if pool == *this || routed.own.len() < usize::MAX {\n"
        "            routed.own.push(value);",
        ("tests/pool_set/test_fuzz_pool_set.py", "tests/pool_set/test_pool_set.py"),
    ),
    Mutant(
        "skip-fixed-pool-admission",
        "admission compares only the growing pool's free count (a full Mamba pool admits)",
        "python/hybrid_alloc/integration/scheduler/coordinator.py",
        "            if idx != primary and need[idx] > free:",
        "            if idx != primary and need[idx] > free and False:",
        ("tests/manager/test_per_group_manager.py",),
    ),
    Mutant(
        "evict-by-bare-id",
        "a bare set of block IDs is applied to every pool (IDs are pool-scoped)",
        "python/hybrid_alloc/integration/scheduler/pool_set.py",
        "        if not isinstance(block_ids, Mapping):\n            raise TypeError(",
        "        if not isinstance(block_ids, Mapping):\n"
        "            block_ids = {g: list(block_ids) for g in range(self.num_groups)}\n"
        "        if not isinstance(block_ids, Mapping):\n            raise TypeError(",
        ("tests/pool_set/test_pool_set.py", "tests/pool_set/test_fuzz_pool_set.py"),
    ),
    Mutant(
        "release-live-slab",
        "the byte budget takes a slab back while a block in it is live",
        "rust/src/byte_budget.rs",
        "        if self.live[s as usize] > 0 {\n            return Err(",
        "        if self.live[s as usize] > u32::MAX - 1 {\n            return Err(",
        # The core's budget tests: a refused release of a live slab, and the random walk's
        # "release refused" / "refused release" checks against its plain model.
        ("cargo:byte_budget::tests",),
    ),
    Mutant(
        "usage-one-page-size",
        "the usage vLLM reads every step counts every group's live pages at group 0's page size",
        "rust/src/byte_budget.rs",
        "            .map(|g| self.live_pages[g] * self.page_bytes[g])",
        "            .map(|g| self.live_pages[g] * self.page_bytes[0])",
        # The random walk's usage check against its plain model.
        ("cargo:byte_budget::tests",),
    ),
    Mutant(
        "evict-own-cache-first",
        "a group evicts its own cached pages before another group's slab idle since longer "
        "(each group's cache kept in the slabs it happens to own, not one LRU order)",
        "rust/src/elastic.rs",
        "budget.idle_since(s) < budget.freed_at(g, end)",
        "budget.idle_since(s) > u64::MAX - 1",
        ("cargo:elastic::tests::cached_pages_are_evicted",),
    ),
    Mutant(
        "idle-slab-reused-first",
        "a slab whose last page goes out of use is filled again first (its freed pages at the "
        "front of the queue), so partly used slabs strand memory another group could take",
        "rust/src/elastic.rs",
        "            if budget.live(s) == 0 && budget.owner(s) == Some(g) {",
        "            if budget.live(s) == 0 && budget.owner(s).is_none() {",
        ("cargo:elastic::tests::a_slab_that_goes_idle",),
    ),
    Mutant(
        "admission-merged-order",
        "an admitted step is not reserved: only the plan of each group's blocks as one ask, "
        "which vLLM's order (every group's loaded-token blocks, then every group's new "
        "blocks) can run short",
        "python/hybrid_alloc/integration/scheduler/coordinator.py",
        "        short = e.reserve(hits, news)",
        "        short = None",
        # assert_admitted_step_served: "admitted step ran short in vLLM's order".
        ("tests/manager/test_elastic_step_order.py",),
    ),
    Mutant(
        "admission-without-decode-room",
        "elastic pools admit a request into the last free pages, leaving the running "
        "requests no room to decode (they preempt within their next steps)",
        "python/hybrid_alloc/integration/scheduler/coordinator.py",
        "            extra += self._decode_room_asks(request_id)",
        "            pass",
        # test_running_requests_decode_into_their_room: the admission is not refused.
        ("tests/manager/test_decode_room.py",),
    ),
    Mutant(
        "nixl-reads-every-region",
        "a NIXL transfer reads a group's block IDs in every layer's region, other groups' "
        "included (IDs are pool-scoped)",
        "python/hybrid_alloc/integration/kv_transfer/nixl.py",
        "        regions = np.flatnonzero(groups == group)",
        "        regions = np.flatnonzero(groups >= 0)",
        ("tests/engine/test_nixl_layout.py",),
    ),
    Mutant(
        "divisor-block-halves",
        "HYBRID_ALLOC_FINE_ALIGN_BLOCKS=divisor halves vLLM's block whether or not the half "
        "divides it",
        "python/hybrid_alloc/sizing.py",
        "    return unit * (parts // smallest)",
        "    return hybrid // 2 // unit * unit",
        ("tests/engine/test_integration.py",),
    ),
    Mutant(
        "take-back-tells-nobody",
        "a slab taken back from a group evicts and holds its pages without telling their "
        "unpin_blocks watchers or the metrics collector",
        "rust/src/elastic.rs",
        "        taken.push(take_back(budget, &mut *pools[h], h, victim, removed)?);",
        "        take_back(budget, &mut *pools[h], h, victim, removed)?;",
        # "watchers of a slab taken back not told".
        ("tests/pool_set/test_elastic_pools.py",),
    ),
    Mutant(
        "elastic-unchecked-operation",
        "an elastic operation (pop, free, touch, unpin, reference-count write, key insert) "
        "runs on pages of slabs its group does not own",
        "rust/src/elastic.rs",
        "    check_named(budget, g, pool, named, what)?;\n    let done = op(pool);",
        "    let done = op(pool);",
        # The core's refusals of pages the budget holds ("a page of an unowned slab").
        ("cargo:elastic::tests",),
    ),
    Mutant(
        "elastic-keeps-freed-pinned",
        "a block freed in an elastic pool still pins its slab (it never goes back)",
        "rust/src/elastic.rs",
        "            } else {\n                budget.unpin_many(g, s, k)\n            };",
        "            } else {\n                true\n            };",
        # ElasticMachine's invariant: check_invariants ("the budget counts N live pages").
        ("tests/pool_set/test_elastic_pools.py",),
    ),
    Mutant(
        "decode-growth-unplanned",
        "a decode step that only takes full-attention pages skips the elastic plan (it "
        "takes pages the budget had promised elsewhere, or runs the budget dry)",
        "rust/src/binding/elastic.rs",
        "        if Self::reserve_checked(slf, &no_hits, &groups)?.is_some() {",
        "        if Self::reserve_checked(slf, &no_hits, &[])?.is_some() {",
        # Decode growth in one core call (`NativeElasticPools.grow`): vLLM's whole
        # `allocate_slots` refuses where the mutant raises, and the machine's `grow` rule.
        ("tests/manager/test_quiet_steps.py", "tests/pool_set/test_elastic_pools.py"),
    ),
    Mutant(
        "grown-keeps-old-counts",
        "after a decode step took full-attention blocks the running table keeps the counts "
        "it had (its next answers are those of a request with fewer blocks)",
        "rust/src/running.rs",
        "            if let Some(h) = held {\n                *h += n;",
        "            if let Some(h) = held {\n                *h += n - n;",
        ("cargo:running::tests::grown_records_what_a_sync_of_the_new_counts_would",),
    ),
    Mutant(
        "quiet-step-ignores-window",
        "a decode step is answered as quiet while a block of the request leaves its "
        "sliding window (vLLM would free it there)",
        "rust/src/running.rs",
        "            phases.remove_skipped |= last > entry.removed[g];\n",
        "            phases.remove_skipped |= last > entry.removed[g] && offset == 0;\n",
        # test_quiet_steps_change_nothing[full+swa+mamba_none-*]: block IDs differ.
        ("tests/manager/test_quiet_steps.py",),
    ),
    Mutant(
        "removal-step-while-growing",
        "a decode step that frees a window's blocks and takes blocks in another group is "
        "answered as a removal step (its new blocks never allocated)",
        "rust/src/running.rs",
        "        (false, true) => StepPlan::VllmPath,\n",
        "        (false, true) => StepPlan::Only(phases),\n",
        ("cargo:running::tests::a_step_past_held_blocks",),
    ),
    Mutant(
        "removal-step-frees-in-flight",
        "a removal step gives vLLM's remove_skipped_blocks the computed tokens, in-flight "
        "ones included (vLLM frees on the processed prefix only)",
        "python/hybrid_alloc/integration/scheduler/coordinator.py",
        "            max(0, computed - request.num_in_flight_tokens),\n",
        "            max(0, computed),\n",
        # The differentials drive async in-flight tokens: block IDs or free counts differ.
        ("tests/manager/test_quiet_steps.py", "tests/manager/test_quiet_steps_caching.py"),
    ),
    Mutant(
        "phases-step-skips-cache",
        "a decode step that takes no block but fills one skips vLLM's cache_blocks "
        "(vLLM would cache the full block there)",
        "python/hybrid_alloc/integration/scheduler/coordinator.py",
        "        if phases & STEP_CACHE_BLOCKS:\n",
        "        if phases & 0:\n",
        # test_caching_quiet_steps_change_nothing: the prefix caches differ.
        ("tests/manager/test_quiet_steps_caching.py",),
    ),
    Mutant(
        "caching-growth-without-lookahead",
        "a decode step with prefix caching on counts full-attention blocks for its own "
        "tokens only, without the lookahead slots vLLM allocates for drafts",
        "rust/src/running.rs",
        "            let need = step.slots().div_ceil(size).saturating_sub(held);\n",
        "            let need = step.main().div_ceil(size).saturating_sub(held);\n",
        # test_caching_quiet_steps_change_nothing: block IDs or answers differ.
        ("tests/manager/test_quiet_steps_caching.py",),
    ),
    Mutant(
        "quiet-step-skips-caching",
        "a decode step whose tokens fill a block is answered as quiet with prefix caching "
        "on (vLLM would cache the full block there)",
        "rust/src/running.rs",
        "    let fills = cached_tokens / size > entry.cached[g];\n",
        "    let fills = cached_tokens / size > entry.cached[g] + 1;\n",
        # test_caching_quiet_steps_change_nothing: the prefix caches differ.
        ("tests/manager/test_quiet_steps_caching.py",),
    ),
    Mutant(
        "quiet-step-keeps-stale-state",
        "a Mamba 'align' decode step is answered as quiet while the state block of two "
        "steps ago is still to be freed (vLLM frees it there)",
        "rust/src/running.rs",
        "stale.saturating_add(1) < processed.div_ceil(size));\n",
        "stale.saturating_add(1) < processed.div_ceil(size) && size == 0);\n",
        # In vLLM's flow the retired blocks' rule fires on the same steps; the core's test
        # holds the guard to vLLM's own rule.
        ("cargo:running::tests::align_state",),
    ),
    Mutant(
        "eviction-unheard-by-table",
        "vLLM's evict_blocks does not reach the running-requests table, which then answers "
        "quiet a step where vLLM registers an evicted partial entry again",
        "python/hybrid_alloc/integration/scheduler/coordinator.py",
        "            self._running.cache_evicted()\n",
        "            pass\n",
        # test_caching_quiet_steps_hear_of_evictions: the prefix caches differ.
        ("tests/manager/test_quiet_steps_caching.py",),
    ),
    Mutant(
        "eviction-keeps-facts",
        "the running-requests table keeps its caching facts after an eviction",
        "rust/src/running.rs",
        "            entry.settled = false;\n            entry.partial_done.fill(false);\n",
        "",
        ("cargo:running::tests::an_eviction",),
    ),
    Mutant(
        "gate-answer-outlives-a-free",
        "elastic pools reuse the admission gate's plan for the step although blocks were "
        "freed between the two asks",
        "python/hybrid_alloc/integration/scheduler/coordinator.py",
        "                and gate[2] == self._pools_state()\n",
        "",
        # test_a_change_to_the_pools_between_the_asks_plans_again: the plan is not run again.
        ("tests/manager/test_gate_answer.py",),
    ),
    Mutant(
        "block-ids-none-beside-a-block",
        "the scheduler output's block IDs read None (nothing allocated) when one group is "
        "empty and another took a block",
        "python/hybrid_alloc/integration/scheduler/manager_patches.py",
        "    if allow_none and not any(groups):\n",
        "    if allow_none and not all(groups):\n",
        # test_get_block_ids_answers_as_vllm: None where vLLM lists the other group's IDs.
        ("tests/manager/test_block_ids.py",),
    ),
    Mutant(
        "cached-estimate-skips-caching",
        "the prefill statistics' cached-token estimate answers 0 with prefix caching on too",
        "python/hybrid_alloc/integration/scheduler/manager_patches.py",
        "    if not manager.enable_caching:\n",
        "    if True:\n",
        # The per-group machine's invariant: ours against vLLM's loop over the handles.
        ("tests/manager/test_fuzz_per_group.py",),
    ),
)


class HarnessError(RuntimeError):
    """The check itself failed (a mutant that does not apply or build, a collection error)."""


def copy_sources(dest: Path) -> None:
    ignore = shutil.ignore_patterns("target", "__pycache__", "*.so", ".hypothesis")
    dest.mkdir(parents=True)
    for name in COPIED:
        src = ROOT / name
        if src.is_dir():
            shutil.copytree(src, dest / name, ignore=ignore)
        else:
            shutil.copy2(src, dest / name)


def apply(mutant: Mutant, tree: Path) -> None:
    path = tree / mutant.path
    text = path.read_text()
    count = text.count(mutant.old)
    if count != 1:
        raise HarnessError(
            f"{mutant.name}: the text to mutate occurs {count} times in {mutant.path} "
            "(the code changed: update the mutant)"
        )
    path.write_text(text.replace(mutant.old, mutant.new))


def shipped_extension() -> Path:
    found = sorted((ROOT / "python" / "hybrid_alloc").glob("_native*.so"))
    if not found:
        raise HarnessError("no built extension in python/hybrid_alloc (run scripts/setup_env.sh)")
    return found[0]


def build_extension(tree: Path, target: Path) -> None:
    """Build the mutated extension, optimised less than a release (the mutants only need
    to run the tests, and one compile per mutant is most of this check's time)."""
    env = dict(os.environ)
    env.update(
        CARGO_TARGET_DIR=str(target),
        CARGO_PROFILE_RELEASE_LTO="off",
        CARGO_PROFILE_RELEASE_OPT_LEVEL="1",
        CARGO_PROFILE_RELEASE_CODEGEN_UNITS="16",
        CARGO_PROFILE_RELEASE_INCREMENTAL="true",
    )
    wheels = tree / "wheels"
    maturin = Path(sys.executable).with_name("maturin")
    proc = subprocess.run(
        [str(maturin), "build", "--release", "-q", "-o", str(wheels)],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if proc.returncode != 0:
        raise HarnessError(f"build failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    (wheel,) = wheels.glob("*.whl")
    with zipfile.ZipFile(wheel) as zf:
        for member in zf.namelist():
            if member.startswith("hybrid_alloc/_native") and member.endswith(".so"):
                (tree / "python" / member).write_bytes(zf.read(member))
                return
    raise HarnessError(f"no extension module in {wheel.name}")


def run_cargo_tests(mutant: Mutant, tree: Path, target: Path) -> tuple[bool, str]:
    """Run the core's tests matching the mutant's filters; (caught, what failed). A build
    error is a broken harness, not a catch."""
    env = dict(os.environ, CARGO_TARGET_DIR=str(target))
    failures = []
    for name in mutant.cargo_filters:
        proc = subprocess.run(
            ["cargo", "test", "--lib", "--no-fail-fast", name],
            cwd=tree,
            env=env,
            capture_output=True,
            text=True,
            check=False,
        )
        out = proc.stdout + proc.stderr
        if "test result:" not in out:
            raise HarnessError(f"{mutant.name}: cargo test did not run:\n{out[-3000:]}")
        failures += [
            f"cargo {line.split()[1]}"
            for line in out.splitlines()
            if line.startswith("test ") and line.endswith("FAILED")
        ]
    return bool(failures), "; ".join(failures)[:400]


def run_tests(mutant: Mutant, tree: Path) -> tuple[bool, str]:
    """Run the named pytest tests on the mutated tree; (caught, what failed)."""
    report = tree / "junit.xml"
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join([str(tree / "python"), str(tree)])
    env.setdefault("HYBRID_ALLOC_HYPOTHESIS_PROFILE", "mutants")  # no shrinking
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "pytest",
            "-q",
            "-x",
            "-p",
            "no:cacheprovider",
            "-m",
            "not e2e",
            f"--junitxml={report}",
            *mutant.pytest_paths,
        ],
        cwd=tree,
        env=env,
        capture_output=True,
        text=True,
        check=False,
    )
    if not report.exists():
        raise HarnessError(f"{mutant.name}: pytest wrote no report:\n{proc.stdout[-3000:]}")
    failures, errors = [], []
    for case in ET.parse(report).getroot().iter("testcase"):
        name = f"{case.get('classname')}::{case.get('name')}"
        for child in case:
            if child.tag == "failure":
                failures.append(f"{name}: {(child.get('message') or '').splitlines()[:1]}")
            elif child.tag == "error":
                errors.append(f"{name}: {(child.get('message') or '').splitlines()[:1]}")
    if errors or (proc.returncode not in (0, 1)):
        raise HarnessError(
            f"{mutant.name}: collection/setup errors, not test failures "
            f"(pytest exit {proc.returncode}): {errors}\n{proc.stdout[-3000:]}"
        )
    return bool(failures), "; ".join(failures)[:400]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("mutants", nargs="*", help="names (default: all)")
    parser.add_argument("--list", action="store_true", help="list the mutants and exit")
    parser.add_argument(
        "--names",
        choices=("rust", "python"),
        help="print the names of the mutants in Rust (or in Python) and exit",
    )
    parser.add_argument("--keep", action="store_true", help="keep the scratch directory")
    args = parser.parse_args(argv)
    by_name = {m.name: m for m in MUTANTS}
    if args.names:
        print(" ".join(m.name for m in MUTANTS if m.in_rust == (args.names == "rust")))
        return 0
    if args.list:
        for m in MUTANTS:
            print(f"{m.name:28} {m.path}: {m.why}")
        return 0
    unknown = [n for n in args.mutants if n not in by_name]
    if unknown:
        parser.error(f"unknown mutants {unknown}; known: {', '.join(by_name)}")
    chosen = [by_name[n] for n in args.mutants] if args.mutants else list(MUTANTS)
    scratch = Path(tempfile.mkdtemp(prefix="hybrid_alloc_mutants."))
    survived: list[str] = []
    try:
        for mutant in chosen:
            t0 = time.perf_counter()
            tree = scratch / mutant.name
            copy_sources(tree)
            apply(mutant, tree)
            caught, what = False, ""
            if mutant.cargo_filters:
                caught, what = run_cargo_tests(mutant, tree, scratch / "cargo-target")
            if mutant.pytest_paths and not caught:
                if mutant.in_rust:
                    build_extension(tree, scratch / "target")
                else:
                    shutil.copy2(shipped_extension(), tree / "python" / "hybrid_alloc")
                caught, what = run_tests(mutant, tree)
            took = time.perf_counter() - t0
            if caught:
                print(f"mutant {mutant.name}: caught in {took:.0f} s by {what}", flush=True)
            else:
                print(f"MUTANT SURVIVED: {mutant.name} ({mutant.why})", flush=True)
                survived.append(mutant.name)
    except HarnessError as exc:
        print(f"mutation check harness error: {exc}", file=sys.stderr)
        return 2
    finally:
        if args.keep:
            print(f"scratch kept in {scratch}")
        else:
            shutil.rmtree(scratch, ignore_errors=True)
    print(f"mutation check: {len(chosen) - len(survived)} of {len(chosen)} mutants caught")
    return 1 if survived else 0


if __name__ == "__main__":
    sys.exit(main())
