//! Elastic per-group pools: every group keeps its own [`GroupPool`] (page size, free queue,
//! prefix cache, pool-scoped block IDs) while one [`ByteBudget`] decides whose pages the
//! bytes are at the moment.
//!
//! A group's pool spans every page of the budget at the group's page size. A page whose
//! slab the group does not own is *held by the budget*: one reference in the pool, outside
//! the free queue and the prefix cache, so no pool operation can hand it out, and all the
//! pool's own invariants hold unchanged. Lending a slab to a group frees its pages into
//! the group's queue (uncached, at the front); taking a slab back evicts its pages' hashes
//! and holds them again. The pools record which blocks go in and out of use
//! ([`GroupPool::track_live_changes`]); [`sync`] passes that on to the budget.
//!
//! Allocation policy for `n` new pages of group `g` ([`allocate`]: [`prepare`], then the
//! pool's own pop of `n` pages from the front of its queue):
//! 1. empty pages: as many as the front of `g`'s queue holds before its first cached page;
//! 2. then unowned slabs, lent to `g` (memory nobody uses, before any eviction);
//! 3. then, oldest first on the budget's one clock, `g`'s own cached pages (least recently
//!    freed first, as its queue holds them) and idle slabs (no page in use) of other
//!    groups (the one idle the longest first), taken back (their cached pages evicted)
//!    and lent to `g`: a slab idle since before `g`'s next cached page was freed goes
//!    first, so the cached pages evicted are the least recently used of all groups, slab
//!    by slab, as in vLLM's one shared queue (a group that owns many slabs of old cached
//!    pages no longer keeps them while another evicts its newer ones). Slabs a group
//!    keeps for its live pages ([`ByteBudget::set_kept_per_live`]: an 'align'-mode state
//!    group's next block) are never taken;
//! 4. else the allocation is refused and nothing changes.
//!
//! Admission ([`plan`]) runs that policy for a whole step (every group's prefix hits first,
//! then every group's new pages, in group order, as vLLM's managers call them) on a virtual
//! copy of the state. The same calls made for real then take the same pages, so a step it
//! admits cannot run short and a step it refuses would: exact for this policy, at a cost of
//! the pages asked for.
//!
//! Every operation on one group's pool (pop, free, touch, unpin, reference-count write, key
//! insert or move) runs through [`operate`]: the pages it names checked, the pool call, the
//! budget synced, in one core call; the binding's pool methods and [`ElasticPools`] both
//! call it, so the core's tests run the path the engine runs. The functions take the pools
//! as references so that each pool can live where its caller keeps it (the binding keeps
//! one per Python object); [`ElasticPools`] owns them all.

use std::ops::Range;

use rustc_hash::{FxHashMap, FxHashSet};

use crate::byte_budget::{ByteBudget, GroupIndex, SlabId};
use crate::error::PoolError;
use crate::group_pool::{BlockId, GroupPool, NULL_BLOCK_ID};

/// Slabs a step holds or counts on (FxHash: a plan looks them up per page).
pub type SlabSet = FxHashSet<SlabId>;

/// What one group asks of a step: prefix-cache hits it takes a reference to, and new pages.
#[derive(Debug, Clone, Default)]
pub struct GroupAsk {
    pub hits: Vec<BlockId>,
    pub new: usize,
}

/// Why a step does not fit: the first group that could not have its pages.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Shortfall {
    pub group: GroupIndex,
    pub missing: usize,
}

/// Whether group `g`'s page is lent to it (else the budget holds it).
pub fn is_lent(budget: &ByteBudget, g: GroupIndex, page: BlockId) -> bool {
    budget
        .slab_of(g, page)
        .is_some_and(|s| budget.owner(s) == Some(g))
}

/// Make `pool` group `g`'s pool over `budget`: the budget holds every page (the pool must
/// be new: every block but the null block free), and the pool records its live changes.
pub fn adopt(budget: &ByteBudget, g: GroupIndex, pool: &mut GroupPool) -> Result<(), PoolError> {
    budget.check_group(g)?;
    let n = budget.num_pages(g) as usize;
    if pool.num_blocks() != n || pool.num_free() + 1 != n {
        return Err(PoolError::InvalidArgument(format!(
            "group {g}: an elastic pool must be new with {n} blocks (the budget's pages), \
             it has {} blocks, {} free",
            pool.num_blocks(),
            pool.num_free()
        )));
    }
    pool.allocate(n - 1, |_, _| {})?;
    pool.track_live_changes(true);
    pool.take_live_changes();
    Ok(())
}

/// Pass group `g`'s recorded live changes on to the budget, all or none: if one is refused
/// (the budget and the pool disagree), those made are undone and the pool keeps every
/// change for a later sync.
pub fn sync(budget: &mut ByteBudget, g: GroupIndex, pool: &mut GroupPool) -> Result<(), PoolError> {
    let idle_before = budget.went_idle().len();
    let changes = pool.take_live_changes();
    // Changes come in runs of one direction in one slab (a request's pages, freed or
    // taken together): each run is applied with one check ([`ByteBudget::pin_many`]). A
    // run refused, or a page no slab lends, goes page by page, which finds the change
    // refused and its error; the changes before it are then undone.
    let mut next = 0;
    let refused = loop {
        let Some(&(page, live)) = changes.get(next) else {
            break None;
        };
        let mut end = next + 1;
        if let Some(s) = budget.slab_of(g, page) {
            while changes
                .get(end)
                .is_some_and(|&(p, l)| l == live && budget.slab_of(g, p) == Some(s))
            {
                end += 1;
            }
            let k = (end - next) as u32;
            let applied = if live {
                budget.pin_many(g, s, k)
            } else {
                budget.unpin_many(g, s, k)
            };
            if applied {
                next = end;
                continue;
            }
        }
        match (next..end).find_map(|i| {
            apply_change(budget, g, changes[i].0, changes[i].1)
                .err()
                .map(|e| (i, e))
        }) {
            Some(refused) => break Some(refused),
            None => next = end,
        }
    };
    if let Some((done, e)) = refused {
        return undo_refused_sync(budget, g, pool, changes, done, idle_before, e);
    }
    settle_synced(budget, g, pool, &changes);
    pool.recycle_live_changes(changes);
    Ok(())
}

/// One live change passed to the budget: page `page` of group `g` into use or out of it.
fn apply_change(
    budget: &mut ByteBudget,
    g: GroupIndex,
    page: BlockId,
    live: bool,
) -> Result<(), PoolError> {
    if live {
        budget.pin(g, page)
    } else {
        budget.unpin(g, page)
    }
}

/// A [`sync`] refused at `changes[done]` (error `e`): the changes before it undone, the
/// pool given every change back for a later sync, the idle list as it was; answers `e`.
fn undo_refused_sync(
    budget: &mut ByteBudget,
    g: GroupIndex,
    pool: &mut GroupPool,
    changes: Vec<(BlockId, bool)>,
    done: usize,
    idle_before: usize,
    e: PoolError,
) -> Result<(), PoolError> {
    for &(page, live) in changes[..done].iter().rev() {
        // The exact inverse of a change just made cannot be refused.
        apply_change(budget, g, page, !live)?;
    }
    pool.restore_live_changes(changes);
    budget.forget_went_idle_after(idle_before);
    Err(e)
}

/// The end of a [`sync`] whose changes are all applied: slabs that went idle are queued to
/// be reused last, and the freed pages are stamped.
fn settle_synced(
    budget: &mut ByteBudget,
    g: GroupIndex,
    pool: &mut GroupPool,
    changes: &[(BlockId, bool)],
) {
    if !budget.went_idle().is_empty() {
        // A slab whose last page went out of use is reused last: the group's next pages
        // come from its partly used slabs first, so this one can stay idle, for another
        // group to take back, instead of being filled again at once (freed uncached
        // pages go to the front of the queue). Only where the pool caches nothing: its
        // queue's back then holds no cached page for these to queue behind. The list is
        // emptied either way (it keeps its capacity: no allocation per idle slab).
        if pool.cache().is_empty() {
            for &s in budget.went_idle() {
                if budget.live(s) == 0 && budget.owner(s) == Some(g) {
                    pool.reuse_last(budget.pages_in(g, s));
                }
            }
        }
        budget.forget_went_idle_after(0);
    }
    budget.stamp_freed(
        g,
        changes
            .iter()
            .filter(|&&(_, live)| !live)
            .map(|&(page, _)| page),
    );
}

/// `Ok` if `page` may be named in an operation of group `g`: the null block, or a page of a
/// slab `g` owns.
pub fn check_usable(
    budget: &ByteBudget,
    g: GroupIndex,
    pool: &GroupPool,
    page: BlockId,
    op: &'static str,
) -> Result<(), PoolError> {
    pool.check_id(i64::from(page))?;
    check_lent(budget, g, page, op)
}

/// [`check_usable`] for a page already known to be in range: `Ok` for the null block or a
/// page of a slab `g` owns (the caching calls check each block as they read it).
pub fn check_lent(
    budget: &ByteBudget,
    g: GroupIndex,
    page: BlockId,
    op: &'static str,
) -> Result<(), PoolError> {
    if page != NULL_BLOCK_ID && !is_lent(budget, g, page) {
        return Err(PoolError::ForeignBlock { block_id: page, op });
    }
    Ok(())
}

/// `Ok` if group `g` may name every page of `ids` (see [`check_usable`]): the check each
/// elastic operation and caching call makes before it changes anything.
pub fn check_named(
    budget: &ByteBudget,
    g: GroupIndex,
    pool: &GroupPool,
    ids: &[BlockId],
    op: &'static str,
) -> Result<(), PoolError> {
    budget.check_group(g)?;
    // Pages of one slab come together (a request's table): the slab's owner is looked
    // at once per run.
    let mut lent_slab = None;
    for &page in ids {
        pool.check_id(i64::from(page))?;
        if page == NULL_BLOCK_ID {
            continue;
        }
        let s = budget.slab_of(g, page);
        if s.is_none() || s != lent_slab {
            check_lent(budget, g, page, op)?;
            lent_slab = s;
        }
    }
    Ok(())
}

/// One operation on group `g`'s pool, as every elastic operation runs (the binding's pops,
/// frees, touches, unpins and reference-count writes, and [`ElasticPools`]'s calls): the
/// pages it names are checked first ([`check_named`]: a refused call changes nothing),
/// then `op` runs on the pool, then the pages it took into or out of use reach the budget
/// ([`sync`]) before the caller can run anything else. Should the budget refuse them, the
/// pool keeps them for a later sync and the error is returned.
pub fn operate<T>(
    budget: &mut ByteBudget,
    g: GroupIndex,
    pool: &mut GroupPool,
    named: &[BlockId],
    what: &'static str,
    op: impl FnOnce(&mut GroupPool) -> Result<T, PoolError>,
) -> Result<T, PoolError> {
    check_named(budget, g, pool, named, what)?;
    let done = op(pool);
    // Synced whatever `op` answered: a failed pool call changes nothing, but should one
    // have changed something the budget still hears of it.
    let synced = sync(budget, g, pool);
    let value = done?;
    synced?;
    Ok(value)
}

/// What the policy lends one group for one allocation: unowned slabs, then idle slabs of
/// other groups taken back, each in the order they are lent.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
struct Lending {
    unowned: Vec<SlabId>,
    reclaimed: Vec<SlabId>,
}

/// Pages of a group's queue the policy looks ahead at most when it weighs a slab of
/// another group against the group's own cached pages ([`Virtual::victims_to_take`]).
const WINDOW_LOOKAHEAD: usize = 64;

/// The virtual state [`plan`] walks.
struct Virtual<'a> {
    budget: &'a ByteBudget,
    pools: &'a [&'a GroupPool],
    /// Per group: prefix hits virtually taken out of the free queue, wherever they are
    /// in it. Pages the walks take need no set: they lie before the group's cursor, and
    /// no walk looks there again.
    hit_pages: Vec<FxHashSet<BlockId>>,
    /// Per group: free pages still in the virtual queue.
    free: Vec<usize>,
    /// Per group: the next queue page not yet looked at (None: the end).
    cursor: Vec<Option<BlockId>>,
    /// Live pages added per slab.
    pinned: FxHashMap<SlabId, u32>,
    /// Live pages added per group.
    pinned_pages: Vec<u64>,
    /// Slabs virtually lent (unowned before, or taken back): never idle within the step.
    lent: SlabSet,
    /// Slabs virtually taken back: their pages are gone from their owner's queue.
    reclaimed: SlabSet,
    unowned_used: usize,
    /// Per group: pages of slabs lent in this step that its allocations have not popped
    /// yet. A lent slab's pages all go to the front of the queue, so a later allocation
    /// of the same group in the step pops them first.
    spare: Vec<usize>,
}

impl Virtual<'_> {
    fn gone(&self, g: GroupIndex, page: BlockId) -> bool {
        // Both sets are empty in most steps: no hashing, no slab division, then.
        (!self.hit_pages[g].is_empty() && self.hit_pages[g].contains(&page))
            || (!self.reclaimed.is_empty()
                && self
                    .budget
                    .slab_of(g, page)
                    .is_some_and(|s| self.reclaimed.contains(&s)))
    }

    /// The first page of `g`'s virtual queue from `at` on (pages gone in this step skipped).
    fn skip_gone(&self, g: GroupIndex, mut at: Option<BlockId>) -> Option<BlockId> {
        while let Some(p) = at.filter(|&p| self.gone(g, p)) {
            at = self.pools[g].queue().next_of(p);
        }
        at
    }

    /// Up to `n` pages from the front of `g`'s virtual queue, stopping at the first cached
    /// one if `uncached_only`; taken (and their slabs pinned) only if `take`.
    fn walk(&mut self, g: GroupIndex, n: usize, uncached_only: bool, take: bool) -> usize {
        if !take && self.queue_is_plain(g, uncached_only) {
            let count = n.min(self.free[g]);
            debug_assert_eq!(count, self.walk_queue(g, n, uncached_only, false));
            return count;
        }
        self.walk_queue(g, n, uncached_only, take)
    }

    /// [`walk`](Self::walk), page by page.
    fn walk_queue(&mut self, g: GroupIndex, n: usize, uncached_only: bool, take: bool) -> usize {
        let pool = self.pools[g];
        let mut at = self.cursor[g];
        let mut count = 0;
        // The slab of the pages pinned last, its pages and how many of them this walk
        // pinned so far: pages taken in a row mostly share a slab (a lent slab's pages
        // enter the queue together), so the map is touched once per slab, not per page.
        let mut run: Option<(SlabId, Range<BlockId>, u32)> = None;
        while count < n {
            let Some(p) = self.skip_gone(g, at) else {
                break;
            };
            at = pool.queue().next_of(p);
            if uncached_only && pool.cache().is_cached(p) {
                break;
            }
            count += 1;
            if take {
                self.free[g] = self.free[g].saturating_sub(1);
                self.pinned_pages[g] += 1;
                match &mut run {
                    Some((_, pages, k)) if pages.contains(&p) => *k += 1,
                    _ => {
                        if let Some(s) = self.budget.slab_of(g, p) {
                            if let Some((done, _, k)) = run.take() {
                                *self.pinned.entry(done).or_insert(0) += k;
                            }
                            run = Some((s, self.budget.pages_in(g, s), 1));
                        }
                    }
                }
                self.cursor[g] = at;
            }
        }
        if let Some((done, _, k)) = run {
            *self.pinned.entry(done).or_insert(0) += k;
        }
        count
    }

    /// Whether a count of `g`'s virtual queue needs no walk: no prefix hit and no slab
    /// taken back has left a page of it behind in this step (nothing is [`gone`]), so
    /// from the cursor on it is the pool's queue, `free[g]` pages long; and, when the
    /// count stops at cached pages, the pool caches nothing (where prefix caching is off:
    /// every step of a 'none'-mode engine). A page count then costs no pointer chase per
    /// page (a prefill chunk of 8,192 tokens asks 512 pages of a 16-token group).
    ///
    /// [`gone`]: Self::gone
    fn queue_is_plain(&self, g: GroupIndex, uncached_only: bool) -> bool {
        self.hit_pages[g].is_empty()
            && self.reclaimed.is_empty()
            && (!uncached_only || self.pools[g].cache().is_empty())
    }

    fn is_idle(&self, s: SlabId) -> bool {
        self.budget.live(s) + self.pinned.get(&s).copied().unwrap_or(0) == 0
            && !self.lent.contains(&s)
    }

    /// Up to `want` idle slabs of groups other than `g`, the one idle the longest first,
    /// leaving each group the idle slabs it keeps for its live pages
    /// ([`ByteBudget::set_kept_per_live`]).
    fn victims(&self, g: GroupIndex, want: usize) -> Vec<SlabId> {
        let budget = self.budget;
        let groups = budget.num_groups();
        if (0..groups).all(|h| h == g || budget.kept_per_live(h) == 0) {
            // Nobody keeps pages (the default): the idle slabs in order, nothing counted.
            return budget
                .idle_slabs_of_others(g)
                .filter(|&s| self.is_idle(s))
                .take(want)
                .collect();
        }
        let mut idle_left = vec![0u64; groups];
        for s in budget.idle_slabs().filter(|&s| self.is_idle(s)) {
            if let Some(h) = budget.owner(s) {
                idle_left[h] += 1;
            }
        }
        let kept: Vec<u64> = (0..groups)
            .map(|h| budget.kept_idle_slabs(h, budget.live_pages(h) + self.pinned_pages[h]))
            .collect();
        let mut victims = Vec::with_capacity(want);
        for s in budget.idle_slabs() {
            if victims.len() == want {
                break;
            }
            let Some(h) = budget.owner(s) else { continue };
            if h == g || !self.is_idle(s) {
                continue;
            }
            if kept[h] > 0 {
                if idle_left[h] <= kept[h] {
                    continue;
                }
                idle_left[h] -= 1;
            }
            victims.push(s);
        }
        victims
    }

    /// Group `g`'s `n` new pages by the policy; `Err(missing)` if it runs short.
    fn allocate(&mut self, g: GroupIndex, n: usize) -> Result<Lending, usize> {
        self.lend_for(g, n, true)
    }

    /// [`allocate`](Self::allocate), with `then_take`: whether the pages it takes from
    /// `g`'s queue are then taken in the virtual state (cursor moved on, slabs pinned),
    /// which only later allocations of the same step read. The lending is the same
    /// either way.
    fn lend_for(&mut self, g: GroupIndex, n: usize, then_take: bool) -> Result<Lending, usize> {
        let per_slab = self.budget.pages_per_slab(g) as usize;
        let from_spare = n.min(self.spare[g]);
        self.spare[g] -= from_spare;
        let n = n - from_spare;
        let empty = self.walk(g, n, true, false);
        let mut fresh = 0usize;
        let mut lending = Lending::default();
        if n > empty {
            let unowned: Vec<SlabId> = self
                .budget
                .unowned_slabs()
                .skip(self.unowned_used)
                .take((n - empty).div_ceil(per_slab))
                .collect();
            self.unowned_used += unowned.len();
            fresh += unowned.len() * per_slab;
            self.lent.extend(unowned.iter().copied());
            lending.unowned = unowned;
        }
        let need = n.saturating_sub(fresh);
        if need > empty {
            let victims = self.victims_to_take(g, need, per_slab)?;
            let budget = self.budget;
            fresh += victims.len() * per_slab;
            // Their pages leave their owners' virtual queues (see `gone`).
            for &s in &victims {
                if let Some(h) = budget.owner(s) {
                    let pages = budget.pages_per_slab(h) as usize;
                    self.free[h] = self.free[h].saturating_sub(pages);
                }
            }
            self.reclaimed.extend(victims.iter().copied());
            self.lent.extend(victims.iter().copied());
            lending.reclaimed = victims;
        }
        if then_take {
            // The pool pops fresh pages first (they were pushed to the front), then its
            // queue.
            self.walk(g, n.saturating_sub(fresh), false, true);
            self.spare[g] += fresh.saturating_sub(n);
        }
        Ok(lending)
    }

    /// The idle slabs of other groups that `g`'s next `need` pages (beyond its unowned
    /// slabs) take back, in order: those its queue cannot give, and before each cached
    /// page the queue would evict, any slab idle since before that page was freed, so the
    /// cached pages evicted are the least recently used of all groups (slab by slab), as
    /// in vLLM's one shared queue. `Err(missing)` if the queue and the slabs fall short.
    fn victims_to_take(
        &self,
        g: GroupIndex,
        need: usize,
        per_slab: usize,
    ) -> Result<Vec<SlabId>, usize> {
        let available = self.free[g];
        let must = need.saturating_sub(available).div_ceil(per_slab);
        let candidates = self.victims(g, need.div_ceil(per_slab));
        if candidates.len() < must {
            return Err((need - available - candidates.len() * per_slab).min(need));
        }
        let (budget, pool) = (self.budget, self.pools[g]);
        let skip_gone = |at: Option<BlockId>| self.skip_gone(g, at);
        let mut taken = 0;
        let mut popped = 0;
        let mut next = skip_gone(self.cursor[g]);
        // The last of the `per_slab` queue pages from `next` on (or the queue's last page):
        // a slab taken back spares that many of `g`'s pages, the same bytes, so the slab
        // goes first only if it has been idle since before the most recently freed of
        // them was freed: of two equal amounts of memory, the one used least recently
        // is evicted. The queue is in the order its pages were freed, so the page
        // `WINDOW_LOOKAHEAD` on stands for the rest of a larger window (a bounded walk).
        // Set at the first cached page, then moved on with `next`.
        let mut window_end: Option<BlockId> = None;
        while popped + taken * per_slab < need {
            let older_slab = candidates.get(taken).is_some_and(|&s| match next {
                Some(p) if pool.cache().is_cached(p) => {
                    let end = *window_end.get_or_insert_with(|| {
                        let mut end = p;
                        for _ in 1..per_slab.min(WINDOW_LOOKAHEAD) {
                            match skip_gone(pool.queue().next_of(end)) {
                                Some(q) => end = q,
                                None => break,
                            }
                        }
                        end
                    });
                    budget.idle_since(s) < budget.freed_at(g, end)
                }
                Some(_) => false,
                None => true,
            });
            if older_slab {
                taken += 1;
            } else if let Some(p) = next {
                popped += 1;
                next = skip_gone(pool.queue().next_of(p));
                if let Some(end) = window_end {
                    window_end = Some(skip_gone(pool.queue().next_of(end)).unwrap_or(end));
                }
            } else {
                // Unreachable: `must` slabs cover what the queue cannot give.
                return Err(need - popped - taken * per_slab);
            }
        }
        Ok(candidates[..taken].to_vec())
    }

    /// Whether [`allocate`](Self::allocate) of `n` pages for `g` would succeed, counted
    /// without walking the queue: `Ok` exactly when it would be `Ok`, leaving the
    /// virtual state as it was; otherwise its `Err`. Which pages and slabs it would take
    /// only matters to later allocations of the step, so a step's last allocation needs
    /// no walk. It fits when its pages fit in what its queue holds (cached pages
    /// included: they are evicted), the unowned slabs left and the idle slabs of other
    /// groups. `allocate` takes unowned slabs for the pages its queue cannot give
    /// without eviction; that changes where its pages come from, not whether they fit.
    fn fits(&mut self, g: GroupIndex, asked: usize) -> Result<(), usize> {
        let per_slab = self.budget.pages_per_slab(g) as usize;
        let n = asked - asked.min(self.spare[g]);
        if n <= self.free[g] {
            return Ok(());
        }
        let beyond_queue = n - self.free[g];
        let unowned = self
            .budget
            .unowned_slabs()
            .skip(self.unowned_used)
            .take(beyond_queue.div_ceil(per_slab))
            .count();
        let fresh = unowned * per_slab;
        if beyond_queue <= fresh {
            return Ok(());
        }
        let want = (beyond_queue - fresh).div_ceil(per_slab);
        if self.victims(g, want).len() == want {
            return Ok(());
        }
        // Short: the walk gives the exact shortfall (the same answer, see above).
        self.allocate(g, asked).map(|_| ())
    }
}

/// The virtual state at the start of a plan. `reserved`: slabs a step admitted earlier has
/// been lent or counts on (see [`reserve_steps`]): never idle while that step runs.
fn new_virtual<'a>(
    budget: &'a ByteBudget,
    pools: &'a [&'a GroupPool],
    reserved: &SlabSet,
) -> Virtual<'a> {
    Virtual {
        budget,
        pools,
        hit_pages: vec![FxHashSet::default(); pools.len()],
        free: pools.iter().map(|p| p.num_free()).collect(),
        cursor: pools.iter().map(|p| p.queue().front()).collect(),
        pinned: FxHashMap::default(),
        pinned_pages: vec![0; pools.len()],
        lent: reserved.clone(),
        reclaimed: SlabSet::default(),
        unowned_used: 0,
        spare: vec![0; pools.len()],
    }
}

fn check_pools(budget: &ByteBudget, n: usize) -> Result<(), PoolError> {
    if n != budget.num_groups() {
        return Err(PoolError::InvalidArgument(format!(
            "{n} pools for a byte budget of {} groups",
            budget.num_groups()
        )));
    }
    Ok(())
}

/// Run the policy for a whole step on a virtual copy: `Ok(Ok(()))` if every group gets its
/// hits and new pages, `Ok(Err(_))` naming the first group short and by how much.
pub fn plan(
    budget: &ByteBudget,
    pools: &[&GroupPool],
    asks: &[GroupAsk],
) -> Result<Result<(), Shortfall>, PoolError> {
    if asks.len() != pools.len() {
        return Err(PoolError::InvalidArgument(format!(
            "a step names {} groups, the pools have {}",
            asks.len(),
            pools.len()
        )));
    }
    let hits: Vec<&[BlockId]> = asks.iter().map(|a| a.hits.as_slice()).collect();
    let news: Vec<(GroupIndex, usize)> = asks.iter().map(|a| a.new).enumerate().collect();
    plan_steps(budget, pools, &hits, &news, &SlabSet::default())
}

/// [`plan`] for a step whose allocations come in a given order: `hits[g]` are taken first
/// (all groups), then `news` in order, each `(group, new pages)` (a pool several KV-cache
/// groups share is asked once per group, in the managers' order). `reserved`: slabs a
/// step being served holds (see [`reserve_steps`]).
pub fn plan_steps(
    budget: &ByteBudget,
    pools: &[&GroupPool],
    hits: &[&[BlockId]],
    news: &[(GroupIndex, usize)],
    reserved: &SlabSet,
) -> Result<Result<(), Shortfall>, PoolError> {
    Ok(walk_steps(budget, pools, hits, news, reserved, true)?.map(|_| ()))
}

/// What a planned step lends: per allocation of `news`, its group and [`Lending`]; and
/// the slabs the step counts on (lent, or holding pages it takes).
struct StepLending {
    lendings: Vec<(GroupIndex, Lending)>,
    holds: SlabSet,
}

/// The policy for a whole step on a virtual copy. `count_last`: the last allocation is
/// only counted ([`Virtual::fits`]): for a plan, whose lendings nobody carries out, so
/// asks of many pages at its end (the room of running requests) cost no walk.
fn walk_steps(
    budget: &ByteBudget,
    pools: &[&GroupPool],
    hits: &[&[BlockId]],
    news: &[(GroupIndex, usize)],
    reserved: &SlabSet,
    count_last: bool,
) -> Result<Result<StepLending, Shortfall>, PoolError> {
    check_pools(budget, pools.len())?;
    if hits.len() != pools.len() {
        return Err(PoolError::InvalidArgument(format!(
            "hits name {} groups, the pools have {}",
            hits.len(),
            pools.len()
        )));
    }
    for (g, ids) in hits.iter().enumerate() {
        for &p in ids.iter() {
            check_usable(budget, g, pools[g], p, "take a prefix hit on")?;
        }
    }
    for &(g, _) in news {
        budget.check_group(g)?;
    }
    let mut v = new_virtual(budget, pools, reserved);
    for (g, ids) in hits.iter().enumerate() {
        for &p in ids.iter() {
            if p != NULL_BLOCK_ID && pools[g].ref_cnt(p) == 0 && v.hit_pages[g].insert(p) {
                v.free[g] = v.free[g].saturating_sub(1);
                v.pinned_pages[g] += 1;
                if let Some(s) = budget.slab_of(g, p) {
                    *v.pinned.entry(s).or_insert(0) += 1;
                }
            }
        }
    }
    let mut lendings = Vec::with_capacity(news.len());
    for (i, &(g, new)) in news.iter().enumerate() {
        let answer = if count_last && i + 1 == news.len() {
            v.fits(g, new).map(|()| Lending::default())
        } else {
            v.allocate(g, new)
        };
        match answer {
            Ok(lending) => lendings.push((g, lending)),
            Err(missing) => return Ok(Err(Shortfall { group: g, missing })),
        }
    }
    let mut holds: SlabSet = v.lent;
    holds.extend(v.pinned.keys().copied());
    Ok(Ok(StepLending { lendings, holds }))
}

/// A slab taken back from group `group`: all its pages (the budget holds them now, so
/// their `unpin_blocks` watchers must be told they are reused) and those whose cached
/// keys were evicted (metrics: evicted blocks), in page order.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct TakenBack {
    pub group: GroupIndex,
    pub pages: Vec<BlockId>,
    pub evicted: Vec<BlockId>,
}

/// Carry out `lending` for group `g`: grant its unowned slabs, take its idle slabs back
/// from their owners, and lend each to `g`.
fn apply_lending(
    budget: &mut ByteBudget,
    pools: &mut [&mut GroupPool],
    g: GroupIndex,
    lending: &Lending,
    removed: &mut impl FnMut(GroupIndex, BlockId, &[u8]),
    taken: &mut Vec<TakenBack>,
) -> Result<(), PoolError> {
    for &s in &lending.unowned {
        budget.grant_slab(g, s)?;
        lend(budget, &mut *pools[g], g, s)?;
    }
    for &victim in &lending.reclaimed {
        let h = budget.owner(victim).ok_or_else(|| {
            PoolError::InvalidArgument(format!("the policy took back slab {victim}, unowned"))
        })?;
        taken.push(take_back(budget, &mut *pools[h], h, victim, removed)?);
        budget.grant_slab(g, victim)?;
        lend(budget, &mut *pools[g], g, victim)?;
    }
    Ok(())
}

/// Make group `g`'s next `n` pops of its free queue follow the policy: lend it the unowned
/// slabs and take back the idle slabs the policy calls for (evicted keys go to `removed`
/// with their group; the slabs taken back are returned). Slabs in `reserved` are never
/// taken back. Refused, with nothing changed, when the policy runs short.
pub fn prepare(
    budget: &mut ByteBudget,
    pools: &mut [&mut GroupPool],
    g: GroupIndex,
    n: usize,
    reserved: &SlabSet,
    mut removed: impl FnMut(GroupIndex, BlockId, &[u8]),
) -> Result<Vec<TakenBack>, PoolError> {
    check_pools(budget, pools.len())?;
    budget.check_group(g)?;
    let lending = {
        let view: Vec<&GroupPool> = pools.iter().map(|p| &**p).collect();
        let mut v = new_virtual(budget, &view, reserved);
        // One allocation: nothing reads the virtual state after it, so its pages are not
        // walked again to be taken there (the pool's pop takes them).
        v.lend_for(g, n, false)
            .map_err(|missing| PoolError::NotEnoughFree {
                requested: n,
                free: n - missing,
            })?
    };
    let mut taken = Vec::new();
    apply_lending(budget, pools, g, &lending, &mut removed, &mut taken)?;
    Ok(taken)
}

/// `n` new pages for group `g` in one core call, as every elastic allocation runs: the
/// memory the policy lends ([`prepare`]; evicted keys go to `removed` with their group),
/// then `pop` (the pool's pop of `n` pages, given `removed` too) as one [`operate`] on
/// `g`'s pool, so the pages are claimed in the budget before the caller runs anything
/// else. Returns the pop's answer and the slabs taken back (their watchers are the
/// caller's to tell). Refused, with nothing changed, when the policy runs short.
pub fn allocate<T, R: FnMut(GroupIndex, BlockId, &[u8])>(
    budget: &mut ByteBudget,
    pools: &mut [&mut GroupPool],
    g: GroupIndex,
    n: usize,
    reserved: &SlabSet,
    mut removed: R,
    pop: impl FnOnce(&mut GroupPool, &mut R) -> Result<T, PoolError>,
) -> Result<(T, Vec<TakenBack>), PoolError> {
    let taken = prepare(budget, pools, g, n, reserved, &mut removed)?;
    let got = operate(budget, g, &mut *pools[g], &[], "allocate", |pool| {
        pop(pool, &mut removed)
    })?;
    Ok((got, taken))
}

/// Admission as a reservation: plan the step (`hits` taken first, then `news` in order,
/// as [`plan_steps`]) and, if it fits, lend every slab the plan lends at once. The slabs
/// the step counts on join `reserved` until the step ends, so no allocation of the step
/// can take them from another of its groups: once every group holds its memory, each
/// group's pops come from its own queue and the step gets its pages in whatever order its
/// groups allocate. A refused step changes nothing.
#[allow(clippy::too_many_arguments)]
pub fn reserve_steps(
    budget: &mut ByteBudget,
    pools: &mut [&mut GroupPool],
    hits: &[&[BlockId]],
    news: &[(GroupIndex, usize)],
    reserved: &mut SlabSet,
    mut removed: impl FnMut(GroupIndex, BlockId, &[u8]),
) -> Result<Result<Vec<TakenBack>, Shortfall>, PoolError> {
    let planned = {
        let view: Vec<&GroupPool> = pools.iter().map(|p| &**p).collect();
        match walk_steps(budget, &view, hits, news, reserved, false)? {
            Ok(p) => p,
            Err(short) => return Ok(Err(short)),
        }
    };
    let mut taken = Vec::new();
    for (g, lending) in &planned.lendings {
        apply_lending(budget, pools, *g, lending, &mut removed, &mut taken)?;
    }
    reserved.extend(planned.holds);
    Ok(Ok(taken))
}

/// Free slab `s`'s pages into `g`'s queue: they were held by the budget.
fn lend(
    budget: &ByteBudget,
    pool: &mut GroupPool,
    g: GroupIndex,
    s: SlabId,
) -> Result<(), PoolError> {
    let pages: Vec<BlockId> = budget.pages_in(g, s).collect();
    pool.free(&pages)?;
    // Held pages going back to the queue are not pages going out of use.
    pool.take_live_changes();
    Ok(())
}

/// Take idle slab `s` back from its owner `h`: its pages' keys are evicted and the budget
/// holds the pages again.
fn take_back(
    budget: &mut ByteBudget,
    pool: &mut GroupPool,
    h: GroupIndex,
    s: SlabId,
    removed: &mut impl FnMut(GroupIndex, BlockId, &[u8]),
) -> Result<TakenBack, PoolError> {
    if budget.live(s) > 0 {
        return Err(PoolError::InvalidArgument(format!(
            "slab {s} of group {h} has blocks in use"
        )));
    }
    // Pending changes of `h` belong to the budget before the slab changes hands.
    sync(budget, h, pool)?;
    let pages: Vec<BlockId> = budget.pages_in(h, s).collect();
    let mut evicted = Vec::new();
    for &p in &pages {
        if pool.evict(p, |id, k| removed(h, id, k))? > 0 {
            evicted.push(p);
        }
    }
    pool.touch(&pages)?;
    pool.take_live_changes();
    budget.release(h, s)?;
    Ok(TakenBack {
        group: h,
        pages,
        evicted,
    })
}

/// Blocks of group `g`'s pool that the budget holds (pages of slabs `g` does not own).
pub fn held_pages(budget: &ByteBudget, g: GroupIndex) -> usize {
    let lent = budget.num_owned(g) as usize * budget.pages_per_slab(g) as usize;
    budget.num_pages(g) as usize - 1 - lent
}

/// Check a group pool against the budget: pages of slabs it does not own are held once and
/// uncached; returns its live pages per slab.
fn check_group(
    budget: &ByteBudget,
    g: GroupIndex,
    pool: &GroupPool,
    live: &mut FxHashMap<SlabId, u32>,
) -> Result<(), String> {
    pool.check_invariants()
        .map_err(|e| format!("group {g}: {e}"))?;
    for p in 1..pool.num_blocks() as BlockId {
        if is_lent(budget, g, p) {
            if pool.ref_cnt(p) > 0 {
                let s = budget.slab_of(g, p).unwrap_or(0);
                *live.entry(s).or_insert(0) += 1;
            }
        } else if pool.ref_cnt(p) != 1 || pool.cache().is_cached(p) {
            return Err(format!(
                "group {g}: block {p} is not lent but has {} references{}",
                pool.ref_cnt(p),
                if pool.cache().is_cached(p) {
                    " and a hash"
                } else {
                    ""
                }
            ));
        }
    }
    Ok(())
}

/// Check every pool, the budget, and that they agree (live pages per slab).
pub fn check_invariants(budget: &ByteBudget, pools: &[&GroupPool]) -> Result<(), String> {
    budget.check_invariants()?;
    let mut live: FxHashMap<SlabId, u32> = FxHashMap::default();
    for (g, pool) in pools.iter().enumerate() {
        check_group(budget, g, pool, &mut live)?;
    }
    for s in 0..budget.num_slabs() {
        let want = live.get(&s).copied().unwrap_or(0);
        if budget.live(s) != want {
            return Err(format!(
                "slab {s}: the budget counts {} live pages, the pools {want}",
                budget.live(s)
            ));
        }
    }
    Ok(())
}

/// A budget and every group's pool in one place (the core's tests and benchmarks; the
/// binding keeps the pools apart).
#[derive(Debug, Clone)]
pub struct ElasticPools {
    budget: ByteBudget,
    pools: Vec<GroupPool>,
    /// Slabs the step being served holds (see [`reserve_steps`]); empty between steps.
    reserved: SlabSet,
}

impl ElasticPools {
    /// Pools for groups whose blocks take `page_bytes[g]` bytes, over `num_slabs` slabs of
    /// `slab_bytes` (slab 0 holds the null blocks), with no slab lent yet.
    pub fn new(
        slab_bytes: i64,
        num_slabs: i64,
        page_bytes: &[i64],
        enable_caching: bool,
        hash_block_size: i64,
    ) -> Result<Self, PoolError> {
        let budget = ByteBudget::new(slab_bytes, num_slabs, page_bytes)?;
        let mut pools = Vec::with_capacity(page_bytes.len());
        for g in 0..budget.num_groups() {
            let n = budget.num_pages(g);
            let mut pool = GroupPool::new(i64::from(n), enable_caching, hash_block_size)?;
            adopt(&budget, g, &mut pool)?;
            pools.push(pool);
        }
        Ok(ElasticPools {
            budget,
            pools,
            reserved: SlabSet::default(),
        })
    }

    /// See [`ByteBudget::set_kept_per_live`].
    pub fn set_kept_per_live(&mut self, g: GroupIndex, n: u32) -> Result<(), PoolError> {
        self.budget.set_kept_per_live(g, n)
    }

    pub fn budget(&self) -> &ByteBudget {
        &self.budget
    }

    pub fn pool(&self, g: GroupIndex) -> &GroupPool {
        &self.pools[g]
    }

    pub fn num_groups(&self) -> usize {
        self.pools.len()
    }

    fn refs(&self) -> Vec<&GroupPool> {
        self.pools.iter().collect()
    }

    pub fn plan(&self, asks: &[GroupAsk]) -> Result<Result<(), Shortfall>, PoolError> {
        plan(&self.budget, &self.refs(), asks)
    }

    /// [`plan_steps`] on these pools.
    pub fn plan_steps(
        &self,
        hits: &[&[BlockId]],
        news: &[(GroupIndex, usize)],
    ) -> Result<Result<(), Shortfall>, PoolError> {
        plan_steps(&self.budget, &self.refs(), hits, news, &self.reserved)
    }

    /// [`reserve_steps`] on these pools: a step admitted here gets its pages whatever the
    /// order its groups then allocate in, until [`end_step`](Self::end_step).
    pub fn reserve(
        &mut self,
        hits: &[&[BlockId]],
        news: &[(GroupIndex, usize)],
        removed: impl FnMut(GroupIndex, BlockId, &[u8]),
    ) -> Result<Result<Vec<TakenBack>, Shortfall>, PoolError> {
        let mut refs: Vec<&mut GroupPool> = self.pools.iter_mut().collect();
        reserve_steps(
            &mut self.budget,
            &mut refs,
            hits,
            news,
            &mut self.reserved,
            removed,
        )
    }

    /// The reserved step is over: its slabs may be taken back again.
    pub fn end_step(&mut self) {
        self.reserved.clear();
    }

    pub fn pool_mut(&mut self, g: GroupIndex) -> &mut GroupPool {
        &mut self.pools[g]
    }

    /// [`operate`] on group `g`'s pool.
    fn operate<T>(
        &mut self,
        g: GroupIndex,
        named: &[BlockId],
        what: &'static str,
        op: impl FnOnce(&mut GroupPool) -> Result<T, PoolError>,
    ) -> Result<T, PoolError> {
        self.budget.check_group(g)?;
        operate(&mut self.budget, g, &mut self.pools[g], named, what, op)
    }

    /// Take one reference to each hit (a free one leaves the queue and pins its slab).
    pub fn touch(&mut self, g: GroupIndex, hits: &[BlockId]) -> Result<(), PoolError> {
        self.operate(g, hits, "touch", |pool| pool.touch(hits))
    }

    /// Drop one reference per listing; pages left with none unpin their slab.
    pub fn free(&mut self, g: GroupIndex, ids: &[BlockId]) -> Result<(), PoolError> {
        self.operate(g, ids, "free", |pool| pool.free(ids))
    }

    /// Set a held page's reference count (vLLM's managers write `ref_cnt`).
    pub fn set_ref_cnt(&mut self, g: GroupIndex, id: BlockId, value: i64) -> Result<(), PoolError> {
        self.operate(g, &[id], "set the reference count of", |pool| {
            pool.set_ref_cnt(id, value)
        })
    }

    /// Give page `id` of group `g` the prefix-cache key `key` (vLLM's `_insert_block_hash`);
    /// a page the budget holds may not be given one.
    pub fn insert_hash(
        &mut self,
        g: GroupIndex,
        key: &[u8],
        id: BlockId,
        num_tokens: Option<u32>,
    ) -> Result<(), PoolError> {
        self.operate(g, &[id], "cache", |pool| {
            pool.insert_hash(key, id, num_tokens)
        })
    }

    /// `n` new pages for group `g` ([`allocate`]). Evicted keys go to `removed` with their
    /// group.
    pub fn allocate(
        &mut self,
        g: GroupIndex,
        n: usize,
        removed: impl FnMut(GroupIndex, BlockId, &[u8]),
    ) -> Result<Vec<BlockId>, PoolError> {
        self.budget.check_group(g)?;
        let mut refs: Vec<&mut GroupPool> = self.pools.iter_mut().collect();
        let (got, _) = allocate(
            &mut self.budget,
            &mut refs,
            g,
            n,
            &self.reserved,
            removed,
            |pool, removed| pool.allocate(n, |id, k| removed(g, id, k)),
        )?;
        Ok(got)
    }

    pub fn check_invariants(&self) -> Result<(), String> {
        check_invariants(&self.budget, &self.refs())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn lcg(state: &mut u64) -> u64 {
        *state = state
            .wrapping_mul(6364136223846793005)
            .wrapping_add(1442695040888963407);
        *state >> 33
    }

    fn key(n: u64) -> Vec<u8> {
        n.to_le_bytes().to_vec()
    }

    /// A request finishes: the first half of its pages in each group cached under fresh
    /// keys, then all of them freed.
    fn finish(e: &mut ElasticPools, req: &[Vec<BlockId>], next_key: &mut u64) {
        for (g, held) in req.iter().enumerate() {
            for &p in held.iter().take(held.len() / 2) {
                if !e.pools[g].cache().is_cached(p) {
                    e.insert_hash(g, &key(*next_key), p, None).unwrap();
                    *next_key += 1;
                }
            }
            e.free(g, held).unwrap();
        }
    }

    /// `news` allocated in order on a copy of `e`: the copy and each group's pages, or
    /// None if one allocation ran short.
    fn allocated_for_real(
        e: &ElasticPools,
        news: &[(GroupIndex, usize)],
    ) -> Option<(ElasticPools, Vec<Vec<BlockId>>)> {
        let mut trial = e.clone();
        let mut req = vec![Vec::new(); e.pools.len()];
        for &(g, n) in news {
            req[g].extend(trial.allocate(g, n, |_, _, _| {}).ok()?);
        }
        Some((trial, req))
    }

    #[test]
    fn memory_moves_both_ways() {
        // Slabs of 64 bytes: four 16-byte attention pages or one 64-byte state page.
        let mut e = ElasticPools::new(64, 4, &[16, 64], true, 16).unwrap();
        let none = |_: GroupIndex, _: BlockId, _: &[u8]| {};
        let a = e.allocate(0, 8, none).unwrap(); // two slabs for group 0
        assert_eq!(e.budget().num_owned(0), 2);
        let m = e.allocate(1, 1, none).unwrap(); // the last slab
        assert!(
            e.allocate(1, 1, none).is_err(),
            "nothing left, nothing idle"
        );
        e.check_invariants().unwrap();
        // Group 0 finishes and caches its pages; group 1 takes one of its slabs back.
        let mut pool_keys = 0;
        for (i, &p) in a.iter().enumerate() {
            e.insert_hash(0, &key(i as u64), p, None).unwrap();
            pool_keys += 1;
        }
        e.free(0, &a).unwrap();
        assert_eq!(e.budget().num_idle(0), 2);
        let mut evicted = Vec::new();
        let m2 = e.allocate(1, 1, |g, id, _| evicted.push((g, id))).unwrap();
        assert_eq!(evicted.len(), 4, "one slab of group 0's cached pages");
        assert!(evicted.iter().all(|&(g, _)| g == 0));
        assert_eq!(e.budget().owner_changes(0).released, 1);
        assert_eq!(e.budget().owner_changes(1).granted, 2);
        e.check_invariants().unwrap();
        // And back: group 1 frees, group 0 grows again.
        e.free(1, &m).unwrap();
        e.free(1, &m2).unwrap();
        let again = e.allocate(0, 8, none).unwrap();
        assert_eq!(again.len(), 8);
        assert!(e.budget().owner_changes(1).released >= 1);
        assert!(pool_keys > 0);
        e.check_invariants().unwrap();
    }

    #[test]
    fn a_slab_that_goes_idle_is_reused_last_where_nothing_is_cached() {
        // No caching ('none' mode): four attention pages (group 0) or one state page
        // (group 1) a slab.
        let mut e = ElasticPools::new(64, 4, &[16, 64], false, 16).unwrap();
        let none = |_: GroupIndex, _: BlockId, _: &[u8]| {};
        let first = e.allocate(0, 4, none).unwrap(); // a whole slab
        let second = e.allocate(0, 2, none).unwrap(); // half of the next one
        let slab = |e: &ElasticPools, p: BlockId| e.budget().slab_of(0, p);
        e.free(0, &first).unwrap();
        assert_eq!(e.budget().num_idle(0), 1);
        assert!(
            e.budget().went_idle().is_empty(),
            "each sync empties the list"
        );
        // Freed pages go to the front of the queue, but the slab that went idle goes to
        // the back: the next pages fill the partly used slab.
        let next = e.allocate(0, 2, none).unwrap();
        assert!(next.iter().all(|&p| slab(&e, p) == slab(&e, second[0])));
        assert_eq!(e.budget().num_idle(0), 1, "the idle slab was filled again");
        // So the state group finds two slabs: the unowned one and the idle one.
        assert_eq!(e.allocate(1, 2, none).unwrap().len(), 2);
        e.check_invariants().unwrap();
    }

    #[test]
    fn a_state_group_keeps_a_slab_per_live_state() {
        // Slabs of 64 bytes: four attention pages or one state page; the state group keeps
        // one idle page per live page out of the attention group's reach.
        let mut e = ElasticPools::new(64, 5, &[16, 64], true, 16).unwrap();
        e.set_kept_per_live(1, 1).unwrap();
        let none = |_: GroupIndex, _: BlockId, _: &[u8]| {};
        let states = e.allocate(1, 3, none).unwrap();
        let attn = e.allocate(0, 4, none).unwrap(); // the last unowned slab
        e.free(1, &states[1..]).unwrap(); // one live state, two idle slabs
        assert_eq!(e.budget().num_idle(1), 2);
        // One idle slab is the live state's: the attention group may take only the other.
        let more = e.allocate(0, 4, none).unwrap();
        assert_eq!(e.budget().num_idle(1), 1);
        let view: Vec<&GroupPool> = e.pools.iter().collect();
        let ask = [
            GroupAsk {
                hits: vec![],
                new: 1,
            },
            GroupAsk::default(),
        ];
        assert_eq!(
            plan(e.budget(), &view, &ask).unwrap(),
            Err(Shortfall {
                group: 0,
                missing: 1
            }),
            "the plan took back the slab kept for the live state"
        );
        assert!(e.allocate(0, 1, none).is_err());
        // The state crosses a block boundary: its next page is there.
        let next = e.allocate(1, 1, none).unwrap();
        e.free(1, &states[..1]).unwrap();
        // Nothing live is left in the kept slab's place once the old state is freed: the
        // live state keeps one idle slab, and the attention group may take none.
        assert_eq!(e.budget().live_pages(1), 1);
        assert!(e.allocate(0, 1, none).is_err());
        e.free(1, &next).unwrap();
        // No live state: every idle state slab may go.
        let rest = e.allocate(0, 8, none).unwrap();
        assert_eq!(rest.len(), 8);
        assert_eq!(e.budget().num_owned(1), 0);
        e.free(0, &attn).unwrap();
        e.free(0, &more).unwrap();
        e.check_invariants().unwrap();
    }

    #[test]
    fn unowned_memory_before_evicting_cached_pages() {
        let mut e = ElasticPools::new(64, 4, &[16, 64], true, 16).unwrap();
        let a = e.allocate(0, 4, |_, _, _| {}).unwrap();
        for (i, &p) in a.iter().enumerate() {
            e.insert_hash(0, &key(i as u64), p, None).unwrap();
        }
        e.free(0, &a).unwrap();
        let mut evicted = 0;
        let b = e.allocate(0, 4, |_, _, _| evicted += 1).unwrap();
        assert_eq!(evicted, 0, "a cached page evicted while a slab was unowned");
        assert!(b.iter().all(|p| !a.contains(p)));
        // With every slab owned, the group's own least recently used page goes next,
        // before another group's idle slab.
        e.allocate(1, 1, |_, _, _| {}).unwrap();
        let c = e.allocate(0, 1, |_, _, _| evicted += 1).unwrap();
        assert_eq!((c[0], evicted), (a[0], 1));
        e.check_invariants().unwrap();
    }

    #[test]
    fn cached_pages_are_evicted_least_recently_freed_first_across_groups() {
        // Slabs of 64 bytes: four attention pages (group 0) or one state page (group 1).
        let mut e = ElasticPools::new(64, 4, &[16, 64], true, 16).unwrap();
        let none = |_: GroupIndex, _: BlockId, _: &[u8]| {};
        let state = e.allocate(1, 1, none).unwrap();
        e.insert_hash(1, &key(100), state[0], None).unwrap();
        let attention = e.allocate(0, 8, none).unwrap();
        for (i, &p) in attention.iter().enumerate() {
            e.insert_hash(0, &key(i as u64), p, None).unwrap();
        }
        // The state is freed first: its slab has been idle since before any attention
        // page was freed, so group 0's next page takes that slab back (evicting the older
        // state) instead of evicting its own least recently freed page.
        e.free(1, &state).unwrap();
        e.free(0, &attention).unwrap();
        assert!(
            e.budget().went_idle().is_empty(),
            "each sync empties the list"
        );
        let mut evicted = Vec::new();
        let got = e.allocate(0, 1, |g, id, _| evicted.push((g, id))).unwrap();
        assert_eq!(evicted, [(1, state[0])]);
        assert!(!attention.contains(&got[0]));
        assert!(attention.iter().all(|&p| e.pool(0).cache().is_cached(p)));
        e.check_invariants().unwrap();
        // The other way round: group 0's cached pages were freed before the state, so its
        // own least recently freed page goes before the state's idle slab.
        let mut e = ElasticPools::new(64, 4, &[16, 64], true, 16).unwrap();
        let attention = e.allocate(0, 4, none).unwrap();
        let state = e.allocate(1, 1, none).unwrap();
        let _live = e.allocate(0, 4, none).unwrap(); // the last slab, in use
        for (i, &p) in attention.iter().enumerate() {
            e.insert_hash(0, &key(i as u64), p, None).unwrap();
        }
        e.insert_hash(1, &key(100), state[0], None).unwrap();
        e.free(0, &attention).unwrap();
        e.free(1, &state).unwrap();
        evicted.clear();
        let got = e.allocate(0, 1, |g, id, _| evicted.push((g, id))).unwrap();
        assert_eq!(evicted, [(0, attention[0])]);
        assert_eq!(got, [attention[0]]);
        assert!(e.pool(1).cache().is_cached(state[0]));
        e.check_invariants().unwrap();
    }

    #[test]
    fn a_slab_taken_back_leaves_its_owner_queue_within_the_step() {
        // Three groups of four pages per slab; group 1 owns both slabs, all cached and free.
        let mut e = ElasticPools::new(64, 3, &[16, 16, 16], true, 16).unwrap();
        let mut b = e.allocate(1, 8, |_, _, _| {}).unwrap();
        for (i, &p) in b.iter().enumerate() {
            e.insert_hash(1, &key(i as u64), p, None).unwrap();
        }
        // Slab 1's pages first in the queue (least recently used).
        b.sort_unstable();
        e.free(1, &b).unwrap();
        assert_eq!(e.pool(1).queue().front(), Some(4));
        // Group 0 takes slab 1 back; group 1's one page then comes from slab 2, which is
        // no longer idle, so group 2 finds nothing.
        let ask = |new: [usize; 3]| {
            new.iter()
                .map(|&n| GroupAsk {
                    hits: Vec::new(),
                    new: n,
                })
                .collect::<Vec<_>>()
        };
        assert_eq!(
            e.plan(&ask([4, 1, 4])).unwrap(),
            Err(Shortfall {
                group: 2,
                missing: 4
            })
        );
        assert_eq!(e.plan(&ask([4, 0, 4])).unwrap(), Ok(()));
        let mut real = e.clone();
        real.allocate(0, 4, |_, _, _| {}).unwrap();
        real.allocate(1, 1, |_, _, _| {}).unwrap();
        assert!(real.allocate(2, 4, |_, _, _| {}).is_err());
        real.check_invariants().unwrap();
    }

    #[test]
    fn pages_not_lent_are_refused_and_change_nothing() {
        let mut e = ElasticPools::new(64, 4, &[16, 64], false, 16).unwrap();
        let a = e.allocate(0, 1, |_, _, _| {}).unwrap();
        let before = format!("{e:?}");
        let err = e.touch(1, &[1]).unwrap_err().to_string();
        assert!(err.contains("block 1"), "{err}");
        assert!(e.free(0, &[a[0] + 4]).is_err(), "a page of an unowned slab");
        assert!(e.free(0, &[99]).is_err());
        assert!(
            e.free(0, &[a[0] + 1]).is_err(),
            "lent but free: a double free"
        );
        assert!(e.allocate(2, 1, |_, _, _| {}).is_err());
        assert!(
            e.allocate(1, 3, |_, _, _| {}).is_err(),
            "two slabs left, three asked"
        );
        assert!(e.plan(&[GroupAsk::default()]).is_err());
        assert_eq!(before, format!("{e:?}"));
    }

    /// Random steps: requests in two or three groups admitted by `plan`, allocated group by
    /// group (never failing once admitted), cached, freed, hit again. After each step the
    /// invariants hold and no two groups' lent pages overlap in bytes.
    #[test]
    fn admitted_steps_never_fail_and_groups_never_share_bytes() {
        let mut rng = 11u64;
        let mut admitted = 0;
        let mut refused = 0;
        let mut moves = 0;
        for round in 0..150 {
            let pages: &[i64] = match round % 3 {
                0 => &[16, 48],
                1 => &[8, 24, 96],
                _ => &[12, 32, 48],
            };
            let mut e = ElasticPools::new(96, 7, pages, true, 16).unwrap();
            let groups = pages.len();
            // Live requests: per group, the pages they hold.
            let mut live: Vec<Vec<Vec<BlockId>>> = Vec::new();
            let mut next_key = 0u64;
            for _ in 0..80 {
                if lcg(&mut rng) % 3 == 0 && !live.is_empty() {
                    let i = lcg(&mut rng) as usize % live.len();
                    finish(&mut e, &live.swap_remove(i), &mut next_key);
                } else {
                    // A new request: some hits on free cached pages, some new pages.
                    let mut asks = vec![GroupAsk::default(); groups];
                    for (g, ask) in asks.iter_mut().enumerate() {
                        ask.new = (lcg(&mut rng) % 6) as usize;
                        let cached: Vec<BlockId> = e.pools[g]
                            .queue()
                            .iter()
                            .filter(|&p| e.pools[g].cache().is_cached(p))
                            .take((lcg(&mut rng) % 3) as usize)
                            .collect();
                        ask.hits = cached;
                    }
                    let snapshot = e.clone();
                    if e.plan(&asks).unwrap().is_err() {
                        refused += 1;
                        // Exact: the same calls made for real fail somewhere.
                        let mut trial = snapshot;
                        let ok =
                            asks.iter()
                                .enumerate()
                                .all(|(g, ask)| trial.touch(g, &ask.hits).is_ok())
                                && asks.iter().enumerate().all(|(g, ask)| {
                                    trial.allocate(g, ask.new, |_, _, _| {}).is_ok()
                                });
                        assert!(!ok, "refused a step the policy could serve");
                        continue;
                    }
                    admitted += 1;
                    let mut req = vec![Vec::new(); groups];
                    for (g, ask) in asks.iter().enumerate() {
                        e.touch(g, &ask.hits).unwrap();
                        req[g].extend(&ask.hits);
                    }
                    for (g, ask) in asks.iter().enumerate() {
                        let got = e
                            .allocate(g, ask.new, |_, _, _| {})
                            .expect("admitted, then short");
                        req[g].extend(got);
                    }
                    live.push(req);
                }
                e.check_invariants().unwrap();
                // No two groups' lent pages share a byte.
                let mut spans: Vec<(u64, u64, usize)> = Vec::new();
                for g in 0..groups {
                    let size = e.budget().page_bytes(g);
                    for s in e.budget().owned_slabs(g) {
                        for p in e.budget().pages_in(g, s) {
                            spans.push((u64::from(p) * size, u64::from(p + 1) * size, g));
                        }
                    }
                }
                spans.sort();
                for w in spans.windows(2) {
                    assert!(w[0].1 <= w[1].0, "pages overlap: {w:?}");
                }
            }
            moves += (0..groups)
                .map(|g| e.budget().owner_changes(g).released)
                .sum::<u64>();
        }
        assert!(
            admitted > 1000 && refused > 50,
            "{admitted} admitted, {refused} refused"
        );
        assert!(moves > 100, "memory changed owner {moves} times");
    }

    #[test]
    fn a_group_asked_twice_in_a_step_gets_the_rest_of_its_lent_slab() {
        // Slabs of 72 bytes: nine 8-byte pages of group 0 or one 72-byte page of group 1;
        // one slab holds the null blocks, three are lendable.
        let e = ElasticPools::new(72, 4, &[8, 72], true, 16).unwrap();
        let refs = e.refs();
        let plan = |news: &[(GroupIndex, usize)]| {
            plan_steps(e.budget(), &refs, &[&[], &[]], news, &SlabSet::default())
                .unwrap()
                .is_ok()
        };
        assert!(plan(&[(0, 18), (1, 1)]));
        // 5 pages lend a slab of 9; the next 13 take its 4 other pages and one more slab.
        assert!(plan(&[(0, 5), (1, 1), (0, 13)]));
        assert!(plan(&[(0, 5), (0, 4), (0, 9), (1, 1)]));
        assert!(!plan(&[(0, 5), (1, 1), (0, 14)]));
    }

    #[test]
    fn steps_with_repeated_groups_are_planned_exactly() {
        // Random steps asking each group one to three times, in a random order: the plan
        // admits a step exactly when the same allocations, made for real, all succeed.
        let mut rng = 5u64;
        let (mut admitted, mut refused) = (0, 0);
        for round in 0..120 {
            let pages: &[i64] = if round % 2 == 0 {
                &[16, 48]
            } else {
                &[8, 24, 96]
            };
            let mut e = ElasticPools::new(96, 6, pages, true, 16).unwrap();
            let groups = pages.len();
            let mut live: Vec<Vec<Vec<BlockId>>> = Vec::new();
            let mut next_key = 0u64;
            for _ in 0..60 {
                if lcg(&mut rng) % 3 == 0 && !live.is_empty() {
                    let i = lcg(&mut rng) as usize % live.len();
                    finish(&mut e, &live.swap_remove(i), &mut next_key);
                    continue;
                }
                let mut news: Vec<(GroupIndex, usize)> = Vec::new();
                for g in 0..groups {
                    for _ in 0..=(lcg(&mut rng) % 3) {
                        news.push((g, (lcg(&mut rng) % 5) as usize));
                    }
                }
                for i in (1..news.len()).rev() {
                    news.swap(i, lcg(&mut rng) as usize % (i + 1));
                }
                let fits = {
                    let refs = e.refs();
                    let no_hits: Vec<&[BlockId]> = vec![&[]; groups];
                    plan_steps(e.budget(), &refs, &no_hits, &news, &SlabSet::default())
                        .unwrap()
                        .is_ok()
                };
                let made = allocated_for_real(&e, &news);
                let real = made.is_some();
                assert_eq!(fits, real, "plan {fits}, for real {real}: {news:?}");
                if let Some((trial, req)) = made {
                    admitted += 1;
                    e = trial;
                    live.push(req);
                } else {
                    refused += 1;
                }
                e.check_invariants().unwrap();
            }
        }
        assert!(
            admitted > 500 && refused > 50,
            "{admitted} admitted, {refused} refused"
        );
    }

    #[test]
    fn a_counted_last_allocation_answers_as_the_walked_one() {
        // Random states and steps whose last allocation is large (the running requests'
        // room at the end of an admission's plan): counting it answers exactly as walking
        // it, shortfall included.
        let mut rng = 31u64;
        let (mut fits, mut short) = (0, 0);
        for round in 0..80 {
            let pages: &[i64] = if round % 2 == 0 {
                &[16, 48]
            } else {
                &[8, 24, 96]
            };
            let mut e = ElasticPools::new(96, 8, pages, true, 16).unwrap();
            let groups = pages.len();
            let mut live: Vec<Vec<Vec<BlockId>>> = Vec::new();
            let mut next_key = 0u64;
            for _ in 0..50 {
                if lcg(&mut rng) % 3 == 0 && !live.is_empty() {
                    let i = lcg(&mut rng) as usize % live.len();
                    finish(&mut e, &live.swap_remove(i), &mut next_key);
                    continue;
                }
                let mut news: Vec<(GroupIndex, usize)> = (0..groups)
                    .map(|g| (g, (lcg(&mut rng) % 4) as usize))
                    .collect();
                let last = lcg(&mut rng) as usize % groups;
                news.push((last, (lcg(&mut rng) % 40) as usize));
                let no_hits: Vec<&[BlockId]> = vec![&[]; groups];
                let refs = e.refs();
                let walked = walk_steps(
                    e.budget(),
                    &refs,
                    &no_hits,
                    &news,
                    &SlabSet::default(),
                    false,
                )
                .unwrap()
                .map(|_| ());
                let counted =
                    plan_steps(e.budget(), &refs, &no_hits, &news, &SlabSet::default()).unwrap();
                assert_eq!(counted, walked, "{news:?}");
                if walked.is_ok() {
                    fits += 1;
                } else {
                    short += 1;
                }
                // Keep the step's first allocations, as an admission without the room.
                if let Some((trial, req)) = allocated_for_real(&e, &news[..groups]) {
                    e = trial;
                    live.push(req);
                }
            }
        }
        assert!(fits > 300 && short > 300, "{fits} fit, {short} short");
    }

    #[test]
    fn a_reserved_step_gets_its_pages_in_any_order() {
        // Random steps, each reserved with its allocations in one order and then made in
        // another (as vLLM's phases do): a reserved step never runs short, a refused one
        // changes nothing, and between steps nothing stays reserved.
        let mut rng = 23u64;
        let (mut reserved, mut refused, mut reordered) = (0, 0, 0);
        for round in 0..120 {
            let pages: &[i64] = if round % 2 == 0 {
                &[16, 32]
            } else {
                &[8, 24, 96]
            };
            let mut e = ElasticPools::new(96, 6, pages, true, 16).unwrap();
            let groups = pages.len();
            let mut live: Vec<Vec<Vec<BlockId>>> = Vec::new();
            let mut next_key = 0u64;
            for _ in 0..60 {
                if lcg(&mut rng) % 3 == 0 && !live.is_empty() {
                    let i = lcg(&mut rng) as usize % live.len();
                    finish(&mut e, &live.swap_remove(i), &mut next_key);
                    continue;
                }
                let mut news: Vec<(GroupIndex, usize)> = Vec::new();
                for g in 0..groups {
                    for _ in 0..=(lcg(&mut rng) % 2) {
                        news.push((g, (lcg(&mut rng) % 6) as usize));
                    }
                }
                let no_hits: Vec<&[BlockId]> = vec![&[]; groups];
                let before = format!("{e:?}");
                match e.reserve(&no_hits, &news, |_, _, _| {}).unwrap() {
                    Err(_) => {
                        refused += 1;
                        assert_eq!(before, format!("{e:?}"), "a refused step changed state");
                        continue;
                    }
                    Ok(_) => reserved += 1,
                }
                // Every group's pops in reverse group order.
                let mut order = news.clone();
                order.sort_by_key(|&(g, _)| std::cmp::Reverse(g));
                reordered += usize::from(order != news);
                let mut req = vec![Vec::new(); groups];
                for &(g, n) in &order {
                    let got = e
                        .allocate(g, n, |_, _, _| {})
                        .expect("a reserved step ran short");
                    req[g].extend(got);
                }
                e.end_step();
                e.check_invariants().unwrap();
                live.push(req);
            }
        }
        assert!(
            reserved > 500 && refused > 50 && reordered > 500,
            "{reserved} reserved, {refused} refused, {reordered} reordered"
        );
    }

    #[test]
    fn a_failed_sync_changes_nothing_and_keeps_every_change() {
        let mut e = ElasticPools::new(64, 4, &[16, 64], true, 16).unwrap();
        let a = e.allocate(0, 2, |_, _, _| {}).unwrap();
        let slab = e.budget().slab_of(0, a[0]).unwrap();
        assert_eq!(e.budget().live(slab), 2);
        // Behind the budget's back: one valid free, then a free of a page the budget holds.
        let held = e.budget().pages_in(0, slab + 1).start;
        assert!(!is_lent(e.budget(), 0, held));
        e.pool_mut(0).free(&[a[0]]).unwrap();
        e.pool_mut(0).free(&[held]).unwrap();
        let budget_before = format!("{:?}", e.budget());
        let (budget, pools) = (&mut e.budget, &mut e.pools);
        assert!(sync(budget, 0, &mut pools[0]).is_err());
        assert_eq!(
            budget_before,
            format!("{:?}", e.budget()),
            "half a sync applied"
        );
        assert_eq!(
            e.pools[0].take_live_changes(),
            vec![(a[0], false), (held, false)],
            "the changes were lost"
        );
    }

    #[test]
    fn taking_a_slab_back_reports_its_pages_and_the_evicted_ones() {
        // Slabs of 64 bytes: four 16-byte pages of group 0, one 64-byte page of group 1.
        let mut e = ElasticPools::new(64, 3, &[16, 64], true, 16).unwrap();
        let a = e.allocate(0, 8, |_, _, _| {}).unwrap();
        // Three of each slab's four pages cached.
        let cached: Vec<BlockId> = a.iter().copied().filter(|p| p % 4 != 3).collect();
        for (i, &p) in cached.iter().enumerate() {
            e.insert_hash(0, &key(i as u64), p, None).unwrap();
        }
        e.free(0, &a).unwrap();
        let mut refs: Vec<&mut GroupPool> = e.pools.iter_mut().collect();
        let taken = prepare(
            &mut e.budget,
            &mut refs,
            1,
            1,
            &SlabSet::default(),
            |_, _, _| {},
        )
        .unwrap();
        assert_eq!(taken.len(), 1);
        let t = &taken[0];
        assert_eq!(t.group, 0);
        let slab = e.budget().slab_of(0, t.pages[0]).unwrap();
        assert_eq!(t.pages, e.budget().pages_in(0, slab).collect::<Vec<_>>());
        let want: Vec<BlockId> = t.pages.iter().copied().filter(|p| p % 4 != 3).collect();
        assert_eq!((t.evicted.clone(), want.len()), (want, 3));
        assert!(t.pages.iter().all(|&p| !e.pools[0].cache().is_cached(p)));
        e.check_invariants().unwrap();
    }

    #[test]
    fn popped_pages_pin_their_slab_before_they_are_claimed() {
        let mut e = ElasticPools::new(64, 3, &[16, 64], true, 16).unwrap();
        let mut refs: Vec<&mut GroupPool> = e.pools.iter_mut().collect();
        prepare(
            &mut e.budget,
            &mut refs,
            0,
            2,
            &SlabSet::default(),
            |_, _, _| {},
        )
        .unwrap();
        let popped = e.pools[0].pop_free(2).unwrap();
        let (budget, pools) = (&mut e.budget, &mut e.pools);
        sync(budget, 0, &mut pools[0]).unwrap();
        let slab = e.budget().slab_of(0, popped[0]).unwrap();
        assert_eq!(
            e.budget().live(slab),
            2,
            "popped but unclaimed pages left the slab idle"
        );
        // So another group cannot take the slab back in between.
        assert!(e.allocate(1, 2, |_, _, _| {}).is_err());
        e.pools[0].claim_popped(&popped, |_, _| {});
        e.check_invariants().unwrap();
    }

    /// [`sync`] as it was before runs: every change pinned or unpinned on its own.
    fn sync_page_by_page(
        budget: &mut ByteBudget,
        g: GroupIndex,
        pool: &mut GroupPool,
    ) -> Result<(), PoolError> {
        let idle_before = budget.went_idle().len();
        let changes = pool.take_live_changes();
        for (done, &(page, live)) in changes.iter().enumerate() {
            if let Err(e) = apply_change(budget, g, page, live) {
                return undo_refused_sync(budget, g, pool, changes, done, idle_before, e);
            }
        }
        settle_synced(budget, g, pool, &changes);
        Ok(())
    }

    #[test]
    fn a_sync_by_runs_ends_where_page_by_page_would() {
        // Slabs of 64 bytes: four 16-byte pages of group 0 (runs of up to four pages),
        // one 64-byte page of group 1.
        let mut state = 7u64;
        let (mut refused, mut multi_page_runs) = (0, 0);
        for _ in 0..300 {
            let mut e = ElasticPools::new(64, 9, &[16, 64], true, 16).unwrap();
            let mut held: Vec<BlockId> = Vec::new();
            for _ in 0..12 {
                // Pages lent the way the engine lends them, then a batch of live changes
                // made behind the budget's back: pops, frees (in any order), and now and
                // then a free of a page the budget holds.
                if let Ok(ids) = e.allocate(0, 1 + lcg(&mut state) as usize % 9, |_, _, _| {}) {
                    held.extend(ids);
                }
                let mut changed = false;
                if lcg(&mut state) % 2 == 0 {
                    let n = 1 + lcg(&mut state) as usize % 4;
                    if let Ok(ids) = e.pools[0].allocate(n, |_, _| {}) {
                        held.extend(ids);
                        changed = true;
                    }
                }
                let n = lcg(&mut state) as usize % (held.len() + 1);
                let mut freed: Vec<BlockId> = held.drain(..n).collect();
                if lcg(&mut state) % 2 == 0 {
                    freed.reverse();
                }
                if !freed.is_empty() {
                    e.pools[0].free(&freed).unwrap();
                    changed = true;
                }
                if lcg(&mut state) % 8 == 0 {
                    let s = lcg(&mut state) as u32 % e.budget().num_slabs();
                    let page = e.budget().pages_in(0, s).start;
                    if page != NULL_BLOCK_ID && !is_lent(e.budget(), 0, page) {
                        e.pools[0].free(&[page]).unwrap();
                        changed = true;
                    }
                }
                if !changed {
                    continue;
                }
                let changes = e.pools[0].take_live_changes();
                multi_page_runs += changes
                    .windows(2)
                    .filter(|w| {
                        w[0].1 == w[1].1
                            && e.budget().slab_of(0, w[0].0) == e.budget().slab_of(0, w[1].0)
                    })
                    .count();
                e.pools[0].restore_live_changes(changes);
                let mut reference = e.clone();
                let by_runs = {
                    let (budget, pools) = (&mut e.budget, &mut e.pools);
                    sync(budget, 0, &mut pools[0])
                };
                let page_by_page = {
                    let (budget, pools) = (&mut reference.budget, &mut reference.pools);
                    sync_page_by_page(budget, 0, &mut pools[0])
                };
                assert_eq!(
                    by_runs.as_ref().map_err(ToString::to_string),
                    page_by_page.as_ref().map_err(ToString::to_string)
                );
                assert_eq!(
                    format!("{:?}", e.budget()),
                    format!("{:?}", reference.budget())
                );
                assert_eq!(
                    format!("{:?}", e.pools[0]),
                    format!("{:?}", reference.pools[0])
                );
                if by_runs.is_err() {
                    refused += 1;
                    break;
                }
                e.check_invariants().unwrap();
            }
        }
        assert!(
            refused > 10 && multi_page_runs > 1000,
            "{refused} refused, {multi_page_runs} runs"
        );
    }
}
