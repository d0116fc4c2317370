"""The byte budget elastic per-group pools share (``rust/src/byte_budget.rs``), as a
hypothesis state machine against a plain model.

The model keeps, per slab, its owner and the pages pinned in it, and decides whether a
set of needs can be had by trying every way of handing the fully free slabs to the groups
(admission itself is the elastic pools' plan: ``test_elastic_pools.py``). Rules: memory
lent to a group and given back, pages pinned and unpinned as a pool would, a set of needs
that fits taken (free pages of partly used slabs first, then the group's idle slabs, then
unowned slabs, then idle slabs reclaimed from other groups), and refused calls that must
change nothing. After every step the budget's counts equal the model's.
"""

from __future__ import annotations

import itertools
from typing import Any

import hypothesis.strategies as st
import pytest
from hypothesis import assume, settings
from hypothesis.stateful import initialize, invariant, rule

from hybrid_alloc._native import NativeByteBudget
from tests.helpers import CountingMachine, budget, stepping


def _snapshot(b: NativeByteBudget) -> Any:
    slabs = range(b.num_slabs)
    return (
        [b.owner(s) for s in slabs],
        [b.live(s) for s in slabs],
        [b.owner_changes(g) for g in range(b.num_groups)],
    )


class ByteBudgetMachine(CountingMachine):
    MACHINE = "byte_budget"

    def __init__(self) -> None:
        super().__init__()
        self.owner: dict[int, int] = {}  # slab -> group
        self.pinned: dict[int, set[int]] = {}  # group -> pinned pages
        self.moves: list[list[int]] = []  # group -> [granted, released]

    @initialize(
        slab=st.integers(16, 200),
        num_slabs=st.integers(2, 6),
        pages=st.lists(st.integers(1, 200), min_size=1, max_size=3),
        first=st.lists(st.integers(0, 2), max_size=4),
    )
    def build(self, slab: int, num_slabs: int, pages: list[int], first: list[int]) -> None:
        """The budget, then a few slabs lent (every example starts with owners)."""
        pages = [min(p, slab) for p in pages]
        try:
            self.b = NativeByteBudget(slab, num_slabs, pages)
        except ValueError as e:
            # Some slab edge leaves no whole page of some group: refused, and said so.
            assert "cannot always hold one page" in str(e), e
            assume(False)
        self.pages = pages
        self.slab = slab
        self.pinned = {g: set() for g in range(len(pages))}
        self.moves = [[0, 0] for _ in pages]
        self.reclaims = 0
        for g in first:
            self._grant(g)

    # ---------------------------------------------------------------- the plain model
    def pps(self, g: int) -> int:
        """Pages of group g that fit whole in every slab, by brute force over the slabs."""
        page, slab = self.pages[g], self.slab
        # Slab starts fall on every alignment to the pages within `page` slabs.
        return min(((s + 1) * slab) // page - -(-(s * slab) // page) for s in range(page))

    def live(self, s: int) -> int:
        g = self.owner.get(s)
        if g is None:
            return 0
        return sum(1 for p in self.pinned[g] if self.b.slab_of(g, p) == s)

    def fully_free(self) -> list[int]:
        return [s for s in range(1, self.b.num_slabs) if s not in self.owner or self.live(s) == 0]

    def own_free(self, g: int) -> int:
        return sum(
            self.pps(g) - self.live(s) for s, o in self.owner.items() if o == g and self.live(s) > 0
        )

    def model_fits(self, needs: list[int]) -> bool:
        groups = range(len(needs))
        free = self.fully_free()
        for choice in itertools.product([*groups, None], repeat=len(free)):
            got = [self.own_free(g) for g in groups]
            for g in choice:
                if g is not None:
                    got[g] += self.pps(g)
            if all(got[g] >= needs[g] for g in groups):
                return True
        return False

    def free_page(self, g: int, s: int) -> int | None:
        first, end = self.b.pages_in(g, s)
        return next((p for p in range(first, end) if p not in self.pinned[g]), None)

    # ---------------------------------------------------------------------- rules
    @rule(g=st.integers(0, 2))
    @stepping
    def grant(self, g: int) -> None:
        self._grant(g)

    def _grant(self, g: int) -> None:
        g %= len(self.pages)
        unowned = [s for s in range(1, self.b.num_slabs) if s not in self.owner]
        got = self.b.grant(g)
        assert got == (min(unowned) if unowned else None)
        if got is not None:
            self.owner[got] = g
            self.moves[g][0] += 1

    @rule(g=st.integers(0, 2), pick=st.integers(0, 10))
    @stepping
    def release(self, g: int, pick: int) -> None:
        g %= len(self.pages)
        s = pick % self.b.num_slabs
        if self.owner.get(s) == g and self.live(s) == 0:
            self.b.release(g, s)
            del self.owner[s]
            self.moves[g][1] += 1
            return
        before = _snapshot(self.b)
        try:
            self.b.release(g, s)
        except ValueError as e:
            assert f"slab {s}" in str(e), e
        else:
            raise AssertionError(f"slab {s} given back by group {g}: not its, or blocks live")
        assert _snapshot(self.b) == before, "a refused release changed the budget"

    @rule(g=st.integers(0, 2), pick=st.integers(0, 10))
    @stepping
    def pin(self, g: int, pick: int) -> None:
        g %= len(self.pages)
        owned = sorted(s for s, o in self.owner.items() if o == g)
        page = self.free_page(g, owned[pick % len(owned)]) if owned else None
        if page is None:
            return
        self.b.pin(g, page)
        self.pinned[g].add(page)

    @rule(g=st.integers(0, 2), pick=st.integers(0, 50), n=st.integers(1, 4))
    @stepping
    def unpin(self, g: int, pick: int, n: int) -> None:
        """A request of the group finishes: some of its pages go back."""
        g %= len(self.pages)
        for _ in range(n):
            if not self.pinned[g]:
                return
            page = sorted(self.pinned[g])[pick % len(self.pinned[g])]
            self.b.unpin(g, page)
            self.pinned[g].discard(page)

    @rule(g=st.integers(0, 2), page=st.integers(0, 400))
    @stepping
    def refused_pin(self, g: int, page: int) -> None:
        """A block of a slab the group does not own, or one that no slab lends."""
        g %= len(self.pages)
        s = self.b.slab_of(g, page)
        if s is not None and self.owner.get(s) == g:
            return
        before = _snapshot(self.b)
        with pytest.raises(ValueError, match=f"block {page}|slab"):
            self.b.pin(g, page)
        assert _snapshot(self.b) == before, "a refused pin changed the budget"

    @rule(needs=st.lists(st.integers(0, 5), min_size=3, max_size=3))
    @stepping
    def admit(self, needs: list[int]) -> None:
        """Pages for every group, when the model finds a way to give them (the elastic
        pools' plan decides admission; here the budget's accounting is driven): every page
        is had, partly used slabs first, then idle, unowned and taken-back slabs."""
        needs = needs[: len(self.pages)]
        if not self.model_fits(needs):
            return
        for g, need in enumerate(needs):
            for _ in range(need):
                self._take_one(g)

    def _take_one(self, g: int) -> None:
        owned = sorted(s for s, o in self.owner.items() if o == g)
        partly = [s for s in owned if self.live(s) > 0 and self.free_page(g, s) is not None]
        idle = [s for s in owned if self.live(s) == 0]
        s = partly[0] if partly else idle[0] if idle else self.b.grant(g)
        if s is None:
            # Reclaim another group's idle slab: admission counted it.
            others = [t for t, o in self.owner.items() if o != g and self.live(t) == 0]
            assert others, "admitted, but no slab left to take"
            t = min(others)
            self.reclaims += 1
            self.b.release(self.owner[t], t)
            self.moves[self.owner.pop(t)][1] += 1
            s = self.b.grant(g)
            assert s == t
        if s not in self.owner:
            self.owner[s] = g
            self.moves[g][0] += 1
        page = self.free_page(g, s)
        assert page is not None
        self.b.pin(g, page)
        self.pinned[g].add(page)

    # ------------------------------------------------------------------ invariants
    @invariant()
    def counts_match_the_model(self) -> None:
        """Every count of the budget is the model's (and the step is counted if any moved)."""
        if not hasattr(self, "b"):
            return
        b = self.b
        b.check_invariants()
        for s in range(b.num_slabs):
            assert b.owner(s) == self.owner.get(s), f"slab {s}: owner"
            assert b.live(s) == self.live(s), f"slab {s}: live pages"
        for g in range(b.num_groups):
            assert b.pages_per_slab(g) == self.pps(g), f"group {g}: pages per slab"
            assert list(b.owner_changes(g)) == self.moves[g], f"group {g}: owner changes"
            assert b.partly_used_free_pages(g) == self.own_free(g), f"group {g}: own free"
        assert b.num_fully_free == len(self.fully_free()), "fully free slabs"
        stranded = sum(self.own_free(g) * self.pages[g] for g in range(b.num_groups))
        assert b.stranded_bytes == stranded
        self.account(_snapshot(b))


ByteBudgetMachine.TestCase.settings = settings(max_examples=budget(150), stateful_step_count=50)
test_byte_budget_machine = ByteBudgetMachine.TestCase


def test_bad_arguments_name_what_is_wrong() -> None:
    with pytest.raises(ValueError, match="at least 2 slabs"):
        NativeByteBudget(64, 1, [16])
    with pytest.raises(ValueError, match="group 0: page_bytes"):
        NativeByteBudget(64, 4, [65])
    b = NativeByteBudget(64, 4, [16, 32])
    with pytest.raises(ValueError, match="group 2 is not in this byte budget"):
        b.grant(2)
    with pytest.raises(ValueError, match="group -1 is not a group index"):
        b.num_owned(-1)
    with pytest.raises(ValueError, match="slab 9 is not in this byte budget"):
        b.owner(9)
    with pytest.raises(ValueError, match="is not a block ID"):
        b.pin(0, 1 << 40)
    s = b.grant(0)
    assert s == 1
    first, _ = b.pages_in(0, s)
    b.pin(0, first)
    with pytest.raises(ValueError, match="cannot give back slab 1: 1 of its blocks are in use"):
        b.release(0, s)
    with pytest.raises(ValueError, match="group 0 owns it"):
        b.pin(1, b.pages_in(1, s)[0])
