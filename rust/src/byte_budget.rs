//! One KV-cache byte budget shared by the pools of several KV-cache groups: which group
//! owns which memory, which blocks pin it, and which slabs are idle. Accounting
//! only; the bytes themselves are the caller's (torch tensors on the device).
//!
//! The budget is `num_slabs` slabs of `slab_bytes` each, laid end to end. A group owns a
//! slab while it uses it and carves it into its own pages (`page_bytes[g]`: what one block
//! of the group takes). Page `p` of group `g` covers bytes `p * page_bytes[g] ..
//! (p + 1) * page_bytes[g]` of the budget, so a group's block IDs are positions in the same
//! bytes every other group sees at its own page size: the worker views one buffer per group
//! at that group's page size, and memory moves between groups without copying anything.
//! Slab 0 is never lent: it holds every group's null block (page 0).
//!
//! Every slab gives a group the same number of pages ([`ByteBudget::pages_per_slab`]): those
//! that fit whole in a slab however the slab is aligned to the group's pages. A page that
//! straddles two slabs is never used; [`ByteBudget::slab_waste_bytes`] is what that costs.
//!
//! The budget does not decide what to lend: the allocation policy and a step's admission
//! are [`crate::elastic`]'s (a step is planned on a virtual copy of the budget and its
//! pools, then reserved), and they call [`ByteBudget::grant_slab`], [`ByteBudget::release`],
//! [`ByteBudget::pin`] and [`ByteBudget::unpin`] here.
//!
//! Every operation checks its whole input first: on `Err` nothing has changed.

use std::collections::BTreeSet;
use std::ops::Range;

use crate::error::PoolError;

pub type SlabId = u32;
pub type GroupIndex = usize;

/// The slab that holds every group's null block.
pub const NULL_SLAB: SlabId = 0;

/// Pages counted per group: IDs must fit the pools' `u32` block IDs.
const MAX_PAGES: u64 = u32::MAX as u64;
/// In the page-to-slab table, a page no slab lends (slab IDs are below `u32::MAX`: the
/// slab count is a `u32`).
const NO_SLAB: SlabId = SlabId::MAX;

fn gcd(mut a: u64, mut b: u64) -> u64 {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a
}

#[derive(Debug, Clone, Copy, PartialEq, Eq, Default)]
pub struct OwnerChanges {
    /// Slabs this group took from the budget.
    pub granted: u64,
    /// Slabs this group gave back.
    pub released: u64,
}

#[derive(Debug, Clone)]
pub struct ByteBudget {
    slab_bytes: u64,
    page_bytes: Vec<u64>,
    pages_per_slab: Vec<u32>,
    /// Per slab: the group that owns it.
    owner: Vec<Option<u16>>,
    /// Per slab: its owner's pages in use (reference count above zero).
    live: Vec<u32>,
    /// Unowned slabs, the lowest ID on top (lent first: keeps the budget's used part dense).
    unowned: Vec<SlabId>,
    /// Per group: slabs owned, and slabs owned with no live page.
    owned: Vec<u32>,
    idle: Vec<u32>,
    /// Per group: its pages in use.
    live_pages: Vec<u64>,
    /// Per group: idle pages kept, per page in use, that no other group may take back
    /// (see [`ByteBudget::set_kept_per_live`]).
    kept_per_live: Vec<u32>,
    /// Per group: its owned slabs with no live page, keyed by when each became idle: the
    /// slab idle the longest is taken back first, so the cached pages another group's need
    /// evicts are the least recently used ones, whichever group cached them. One set per
    /// owner, so that a group looking for other groups' idle slabs never walks its own.
    idle_slabs: Vec<BTreeSet<(u64, SlabId)>>,
    /// Per slab: the tick of `clock` at which it last became idle (its key in `idle_slabs`).
    idle_since: Vec<u64>,
    /// Per group, per page: the tick of `clock` at which it last went out of use. The
    /// allocation policy compares a group's least recently freed cached page with another
    /// group's slab idle the longest on this one clock, so the cached pages evicted are the
    /// oldest whichever group holds them, as in vLLM's one shared queue.
    freed_at: Vec<Vec<u64>>,
    /// Per group, per page: the slab that lends it, or [`NO_SLAB`] (a page straddling two
    /// slabs). Every page a pool takes, frees or names is looked up here, more than once an
    /// operation; a table of 4 bytes a page costs one load where the arithmetic costs a
    /// 64-bit division.
    slab_of_page: Vec<Vec<SlabId>>,
    /// Slabs whose last live page went out of use since the list was last emptied (each
    /// sync empties it; the caller may reuse their pages last).
    went_idle: Vec<SlabId>,
    clock: u64,
    changes: Vec<OwnerChanges>,
}

impl ByteBudget {
    /// A budget of `num_slabs` slabs of `slab_bytes` (slab 0 reserved for the null
    /// blocks) shared by groups whose blocks take `page_bytes[g]` bytes each.
    pub fn new(slab_bytes: i64, num_slabs: i64, page_bytes: &[i64]) -> Result<Self, PoolError> {
        let bad = |what: String| Err(PoolError::InvalidArgument(what));
        let slab = match u64::try_from(slab_bytes) {
            Ok(n) if n > 0 => n,
            _ => return bad(format!("slab_bytes must be positive, got {slab_bytes}")),
        };
        let slabs = match u32::try_from(num_slabs) {
            Ok(n) if n >= 2 => n,
            _ => {
                return bad(format!(
                    "a byte budget needs at least 2 slabs (slab 0 holds the null blocks), \
                     got {num_slabs}"
                ))
            }
        };
        if page_bytes.is_empty() || page_bytes.len() > usize::from(u16::MAX) {
            return bad(format!(
                "a byte budget serves 1..{} groups, got {}",
                u16::MAX,
                page_bytes.len()
            ));
        }
        let total = match slab.checked_mul(u64::from(slabs)) {
            Some(t) => t,
            None => return bad(format!("{num_slabs} slabs of {slab_bytes} bytes overflow")),
        };
        let mut pages = Vec::with_capacity(page_bytes.len());
        let mut per_slab = Vec::with_capacity(page_bytes.len());
        for (g, &p) in page_bytes.iter().enumerate() {
            let page = match u64::try_from(p) {
                Ok(n) if n > 0 && n <= slab => n,
                _ => {
                    return bad(format!(
                        "group {g}: page_bytes must be in 1..={slab} (one slab), got {p}"
                    ))
                }
            };
            if total / page > MAX_PAGES {
                return bad(format!(
                    "group {g}: {} pages of {page} bytes exceed the block-ID range",
                    total / page
                ));
            }
            // Where a slab starts within the group's pages is a multiple of gcd(slab,
            // page) short of a page boundary, at most page - gcd: that many bytes may be
            // lost at the slab's start, and whatever does not fill a page at its end.
            let fit = (slab - page + gcd(slab, page)) / page;
            if fit == 0 {
                return bad(format!(
                    "group {g}: a slab of {slab} bytes cannot always hold one page of {page} \
                     bytes (slab edges); use a slab that is a multiple of the page"
                ));
            }
            pages.push(page);
            per_slab.push(fit as u32);
        }
        let groups = page_bytes.len();
        let freed_at = pages
            .iter()
            .map(|&p| vec![0; (total / p) as usize])
            .collect();
        let slab_of_page = pages
            .iter()
            .zip(&per_slab)
            .map(|(&page, &fit)| {
                let mut table = vec![NO_SLAB; (total / page) as usize];
                for s in 0..slabs {
                    // The first page that starts in slab `s`, and `fit` pages from there
                    // (all of them end within it: `pages_in`).
                    let first = (u64::from(s) * slab).div_ceil(page) as usize;
                    table[first..first + fit as usize].fill(s);
                }
                table
            })
            .collect();
        Ok(ByteBudget {
            slab_bytes: slab,
            page_bytes: pages,
            pages_per_slab: per_slab,
            owner: vec![None; slabs as usize],
            live: vec![0; slabs as usize],
            unowned: (1..slabs).rev().collect(),
            owned: vec![0; groups],
            idle: vec![0; groups],
            live_pages: vec![0; groups],
            kept_per_live: vec![0; groups],
            idle_slabs: vec![BTreeSet::new(); groups],
            idle_since: vec![0; slabs as usize],
            freed_at,
            slab_of_page,
            went_idle: Vec::new(),
            clock: 0,
            changes: vec![OwnerChanges::default(); groups],
        })
    }

    pub fn num_groups(&self) -> usize {
        self.page_bytes.len()
    }

    pub fn num_slabs(&self) -> u32 {
        self.owner.len() as u32
    }

    pub fn slab_bytes(&self) -> u64 {
        self.slab_bytes
    }

    pub fn page_bytes(&self, g: GroupIndex) -> u64 {
        self.page_bytes[g]
    }

    /// Pages of group `g` in any one slab.
    pub fn pages_per_slab(&self, g: GroupIndex) -> u32 {
        self.pages_per_slab[g]
    }

    /// Bytes of a slab that group `g` cannot use (pages straddling its edges).
    pub fn slab_waste_bytes(&self, g: GroupIndex) -> u64 {
        self.slab_bytes - u64::from(self.pages_per_slab[g]) * self.page_bytes[g]
    }

    /// The size of group `g`'s block-ID space: every page that lies in the budget.
    pub fn num_pages(&self, g: GroupIndex) -> u32 {
        (self.slab_bytes * u64::from(self.num_slabs()) / self.page_bytes[g]) as u32
    }

    /// Group `g`'s pages in slab `s`: the first page that starts in the slab, and the
    /// group's pages-per-slab from there (all of them end within the slab).
    pub fn pages_in(&self, g: GroupIndex, s: SlabId) -> Range<u32> {
        let page = self.page_bytes[g];
        let first = (u64::from(s) * self.slab_bytes).div_ceil(page) as u32;
        first..first + self.pages_per_slab[g]
    }

    /// The slab whose pages of group `g` include `page`, or `None` for a page no slab
    /// lends (one straddling two slabs, or past the last) or a group not in this budget.
    pub fn slab_of(&self, g: GroupIndex, page: u32) -> Option<SlabId> {
        self.slab_of_page
            .get(g)?
            .get(page as usize)
            .copied()
            .filter(|&s| s != NO_SLAB)
    }

    pub fn owner(&self, s: SlabId) -> Option<GroupIndex> {
        self.owner
            .get(s as usize)
            .copied()
            .flatten()
            .map(usize::from)
    }

    pub fn live(&self, s: SlabId) -> u32 {
        self.live.get(s as usize).copied().unwrap_or(0)
    }

    pub fn num_unowned(&self) -> u32 {
        self.unowned.len() as u32
    }

    /// Slabs group `g` owns.
    pub fn num_owned(&self, g: GroupIndex) -> u32 {
        self.owned[g]
    }

    /// Slabs group `g` owns that hold no live page (given back whenever another group
    /// needs them, after their cached pages are evicted).
    pub fn num_idle(&self, g: GroupIndex) -> u32 {
        self.idle[g]
    }

    /// Group `g`'s pages in use.
    pub fn live_pages(&self, g: GroupIndex) -> u64 {
        self.live_pages[g]
    }

    /// The share of the lendable bytes (every slab but the null blocks') that live pages
    /// take, over every group: the usage vLLM reads every step (its shared pool's
    /// `get_usage`), from the running counts.
    pub fn usage(&self) -> f64 {
        let lendable = u64::from(self.num_slabs().saturating_sub(1)) * self.slab_bytes;
        if lendable == 0 {
            return 0.0;
        }
        let live: u64 = (0..self.num_groups())
            .map(|g| self.live_pages[g] * self.page_bytes[g])
            .sum();
        live as f64 / lendable as f64
    }

    /// Keep `n` idle pages of group `g` per page it has in use out of other groups'
    /// reach: its idle slabs are taken back only beyond that many pages' slabs. An
    /// 'align'-mode Mamba/GDN group needs a second page whenever a request crosses a
    /// block boundary (the state moves to a new block while the old one is read); when
    /// another group has taken that page's slab, only a whole idle slab of the other
    /// group can give it back, and memory fragmented in partly used slabs cannot, so the
    /// crossing preempts a request. The static split keeps the same pages per request.
    pub fn set_kept_per_live(&mut self, g: GroupIndex, n: u32) -> Result<(), PoolError> {
        self.check_group(g)?;
        self.kept_per_live[g] = n;
        Ok(())
    }

    pub fn kept_per_live(&self, g: GroupIndex) -> u32 {
        self.kept_per_live[g]
    }

    /// Idle slabs of group `g` that other groups may not take back while it has
    /// `live_pages` pages in use.
    pub fn kept_idle_slabs(&self, g: GroupIndex, live_pages: u64) -> u64 {
        (live_pages * u64::from(self.kept_per_live[g])).div_ceil(u64::from(self.pages_per_slab[g]))
    }

    /// Owned slabs with no live page, the one idle the longest first.
    pub fn idle_slabs(&self) -> impl Iterator<Item = SlabId> + '_ {
        self.idle_slabs_except(None)
    }

    /// [`ByteBudget::idle_slabs`] of every group but `g`, in the same order.
    pub fn idle_slabs_of_others(&self, g: GroupIndex) -> impl Iterator<Item = SlabId> + '_ {
        self.idle_slabs_except(Some(g))
    }

    /// The owners' idle sets merged by idle time (a handful of groups: the smallest head
    /// is found by looking at each).
    fn idle_slabs_except(&self, skip: Option<GroupIndex>) -> impl Iterator<Item = SlabId> + '_ {
        let mut heads: Vec<_> = (0..self.num_groups())
            .filter(|&h| Some(h) != skip)
            .map(|h| self.idle_slabs[h].iter().peekable())
            .collect();
        std::iter::from_fn(move || {
            let at = heads
                .iter_mut()
                .enumerate()
                .filter_map(|(i, it)| it.peek().map(|&&key| (key, i)))
                .min()?
                .1;
            heads[at].next().map(|&(_, s)| s)
        })
    }

    /// The tick at which slab `s` last became idle (0 for one never owned).
    pub fn idle_since(&self, s: SlabId) -> u64 {
        self.idle_since.get(s as usize).copied().unwrap_or(0)
    }

    /// The tick at which group `g`'s page `page` last went out of use (0: never in use).
    pub fn freed_at(&self, g: GroupIndex, page: u32) -> u64 {
        self.freed_at
            .get(g)
            .and_then(|pages| pages.get(page as usize))
            .copied()
            .unwrap_or(0)
    }

    /// The slabs whose last live page went out of use since the list was last emptied
    /// ([`ByteBudget::forget_went_idle_after`] with 0), in that order (a slab in use
    /// again since is still listed).
    pub fn went_idle(&self) -> &[SlabId] {
        &self.went_idle
    }

    /// Forget the slabs listed after the first `n` (0: empty the list; a refused sync
    /// forgets those its undone changes listed).
    pub fn forget_went_idle_after(&mut self, n: usize) {
        self.went_idle.truncate(n);
    }

    /// Stamp group `g`'s `pages` as going out of use now, in order (called once the
    /// changes that freed them are all applied, so a refused sync stamps nothing).
    pub fn stamp_freed(&mut self, g: GroupIndex, pages: impl Iterator<Item = u32>) {
        let Some(stamps) = self.freed_at.get_mut(g) else {
            return;
        };
        for page in pages {
            if let Some(t) = stamps.get_mut(page as usize) {
                self.clock += 1;
                *t = self.clock;
            }
        }
    }

    fn mark_idle(&mut self, g: GroupIndex, s: SlabId) {
        self.clock += 1;
        self.idle_since[s as usize] = self.clock;
        self.idle_slabs[g].insert((self.clock, s));
    }

    fn unmark_idle(&mut self, g: GroupIndex, s: SlabId) {
        self.idle_slabs[g].remove(&(self.idle_since[s as usize], s));
    }

    /// The unowned slab [`ByteBudget::grant`] lends next.
    pub fn next_unowned(&self) -> Option<SlabId> {
        self.unowned.last().copied()
    }

    /// Unowned slabs, in the order they are lent.
    pub fn unowned_slabs(&self) -> impl Iterator<Item = SlabId> + '_ {
        self.unowned.iter().rev().copied()
    }

    /// Slabs any group can have now: unowned ones and every group's idle ones.
    pub fn num_fully_free(&self) -> u32 {
        self.num_unowned() + self.idle.iter().sum::<u32>()
    }

    /// Free pages of group `g` that only `g` can use: those in its slabs holding live pages.
    /// From the running counts, not a walk over the slabs: the simulator reads it every step,
    /// and an 80 GiB budget has hundreds of thousands of slabs. Every live page of `g` sits
    /// in a slab `g` owns that is not idle, so those slabs' pages less the live ones are the
    /// free ones (the random walk checks it against a recount).
    pub fn partly_used_free_pages(&self, g: GroupIndex) -> u64 {
        let in_use = u64::from(self.owned[g] - self.idle[g]);
        in_use * u64::from(self.pages_per_slab[g]) - self.live_pages[g]
    }

    /// Group `g`'s slabs, in ID order: a walk over every slab, for tests only (the counts
    /// production reads are kept as slabs change owner).
    #[cfg(test)]
    pub(crate) fn owned_slabs(&self, g: GroupIndex) -> impl Iterator<Item = SlabId> + '_ {
        let g = g as u16;
        (0..self.num_slabs()).filter(move |&s| self.owner[s as usize] == Some(g))
    }

    /// How often memory changed owner, per group.
    pub fn owner_changes(&self, g: GroupIndex) -> OwnerChanges {
        self.changes[g]
    }

    /// `Ok` for a group of this budget; every method that takes a group index and returns
    /// no `Result` expects one.
    pub fn check_group(&self, g: GroupIndex) -> Result<(), PoolError> {
        if g < self.num_groups() {
            Ok(())
        } else {
            Err(PoolError::InvalidArgument(format!(
                "group {g} is not in this byte budget (it has {} groups)",
                self.num_groups()
            )))
        }
    }

    /// Lend group `g` an unowned slab; `None` when there is none (take an idle slab of
    /// another group with [`ByteBudget::release`] first).
    pub fn grant(&mut self, g: GroupIndex) -> Result<Option<SlabId>, PoolError> {
        self.check_group(g)?;
        let Some(s) = self.next_unowned() else {
            return Ok(None);
        };
        self.grant_slab(g, s)?;
        Ok(Some(s))
    }

    /// Lend group `g` the unowned slab `s` (the one a plan chose).
    pub fn grant_slab(&mut self, g: GroupIndex, s: SlabId) -> Result<(), PoolError> {
        self.check_group(g)?;
        self.check_slab(s)?;
        let Some(at) = self.unowned.iter().rposition(|&u| u == s) else {
            return Err(PoolError::InvalidArgument(format!(
                "group {g} cannot be lent slab {s}: {}",
                match self.owner(s) {
                    Some(o) => format!("group {o} owns it"),
                    None => "it holds the null blocks".to_string(),
                }
            )));
        };
        self.unowned.remove(at);
        self.owner[s as usize] = Some(g as u16);
        self.owned[g] += 1;
        self.idle[g] += 1;
        self.mark_idle(g, s);
        self.changes[g].granted += 1;
        Ok(())
    }

    /// Group `g` gives slab `s` back. The slab must be `g`'s and hold no live page (its
    /// pages leave `g`'s free queue and prefix cache first: the caller's part).
    pub fn release(&mut self, g: GroupIndex, s: SlabId) -> Result<(), PoolError> {
        self.check_group(g)?;
        self.check_owned(g, s, "give back")?;
        if self.live[s as usize] > 0 {
            return Err(PoolError::InvalidArgument(format!(
                "group {g} cannot give back slab {s}: {} of its blocks are in use",
                self.live[s as usize]
            )));
        }
        self.owner[s as usize] = None;
        self.owned[g] -= 1;
        self.idle[g] -= 1;
        self.unmark_idle(g, s);
        self.changes[g].released += 1;
        // Keep the lowest ID on top.
        let at = self.unowned.partition_point(|&u| u > s);
        self.unowned.insert(at, s);
        Ok(())
    }

    /// `Ok` for a slab of this budget.
    pub fn check_slab(&self, s: SlabId) -> Result<(), PoolError> {
        if s < self.num_slabs() {
            Ok(())
        } else {
            Err(PoolError::InvalidArgument(format!(
                "slab {s} is not in this byte budget (it has slabs 0..{})",
                self.num_slabs()
            )))
        }
    }

    fn check_owned(&self, g: GroupIndex, s: SlabId, op: &str) -> Result<(), PoolError> {
        match self.owner(s) {
            Some(o) if o == g => Ok(()),
            owner => Err(PoolError::InvalidArgument(format!(
                "group {g} cannot {op} slab {s}: {}",
                match owner {
                    Some(o) => format!("group {o} owns it"),
                    None if s < self.num_slabs() => "no group owns it".to_string(),
                    None => format!("the byte budget has slabs 0..{}", self.num_slabs()),
                }
            ))),
        }
    }

    fn slab_of_owned(&self, g: GroupIndex, page: u32, op: &str) -> Result<SlabId, PoolError> {
        self.check_group(g)?;
        let s = self.slab_of(g, page).ok_or_else(|| {
            PoolError::InvalidArgument(format!(
                "group {g} cannot {op} block {page}: no slab lends that block"
            ))
        })?;
        self.check_owned(g, s, op)?;
        Ok(s)
    }

    /// Group `g`'s block `page` went from free to in use.
    pub fn pin(&mut self, g: GroupIndex, page: u32) -> Result<(), PoolError> {
        let s = self.slab_of_owned(g, page, "pin")? as usize;
        if self.live[s] == self.pages_per_slab[g] {
            return Err(PoolError::BadState {
                block_id: page,
                reason: format!("slab {s} of group {g} has no free block left to pin"),
            });
        }
        if self.live[s] == 0 {
            self.idle[g] -= 1;
            self.unmark_idle(g, s as SlabId);
        }
        self.live[s] += 1;
        self.live_pages[g] += 1;
        Ok(())
    }

    /// Group `g`'s block `page` went from in use to free (cached or not).
    pub fn unpin(&mut self, g: GroupIndex, page: u32) -> Result<(), PoolError> {
        let s = self.slab_of_owned(g, page, "unpin")? as usize;
        if self.live[s] == 0 {
            return Err(PoolError::BadState {
                block_id: page,
                reason: format!("slab {s} of group {g} has no block in use"),
            });
        }
        self.live[s] -= 1;
        self.live_pages[g] -= 1;
        if self.live[s] == 0 {
            self.idle[g] += 1;
            self.mark_idle(g, s as SlabId);
            self.went_idle.push(s as SlabId);
        }
        Ok(())
    }

    /// [`ByteBudget::pin`] `k` of group `g`'s pages of slab `s` at once, with one check:
    /// `true` if done; `false` (nothing changed) where one of those pins would be refused
    /// (the caller pins them one by one to learn which and why).
    pub fn pin_many(&mut self, g: GroupIndex, s: SlabId, k: u32) -> bool {
        let i = s as usize;
        let fits = g < self.num_groups()
            && self.owner(s) == Some(g)
            && self.live[i]
                .checked_add(k)
                .is_some_and(|n| n <= self.pages_per_slab[g]);
        if !fits {
            return false;
        }
        if k > 0 && self.live[i] == 0 {
            self.idle[g] -= 1;
            self.unmark_idle(g, s);
        }
        self.live[i] += k;
        self.live_pages[g] += u64::from(k);
        true
    }

    /// [`ByteBudget::unpin`] `k` of group `g`'s pages of slab `s` at once, with one check
    /// (see [`ByteBudget::pin_many`]).
    pub fn unpin_many(&mut self, g: GroupIndex, s: SlabId, k: u32) -> bool {
        let i = s as usize;
        if g >= self.num_groups() || self.owner(s) != Some(g) || self.live[i] < k {
            return false;
        }
        if k == 0 {
            return true;
        }
        self.live[i] -= k;
        self.live_pages[g] -= u64::from(k);
        if self.live[i] == 0 {
            self.idle[g] += 1;
            self.mark_idle(g, s);
            self.went_idle.push(s);
        }
        true
    }

    /// Free bytes that only their owner can use: free pages in partly used slabs.
    pub fn stranded_bytes(&self) -> u64 {
        (0..self.num_groups())
            .map(|g| self.partly_used_free_pages(g) * self.page_bytes[g])
            .sum()
    }

    /// Bytes lent out that no page can use (slab edges), over every owned slab.
    pub fn edge_waste_bytes(&self) -> u64 {
        (0..self.num_groups())
            .map(|g| u64::from(self.owned[g]) * self.slab_waste_bytes(g))
            .sum()
    }

    /// Recount everything from the per-slab state; `Err` names the first mismatch.
    pub fn check_invariants(&self) -> Result<(), String> {
        let groups = self.num_groups();
        let mut owned = vec![0u32; groups];
        let mut idle = vec![0u32; groups];
        let mut live_pages = vec![0u64; groups];
        for s in 0..self.num_slabs() {
            let live = self.live[s as usize];
            match self.owner(s) {
                Some(g) => {
                    if s == NULL_SLAB {
                        return Err("slab 0 (the null blocks) is lent".into());
                    }
                    if live > self.pages_per_slab[g] {
                        return Err(format!("slab {s}: {live} live pages, room for fewer"));
                    }
                    owned[g] += 1;
                    live_pages[g] += u64::from(live);
                    if live == 0 {
                        idle[g] += 1;
                    }
                }
                None if live > 0 => return Err(format!("slab {s} unowned with {live} live")),
                None => {}
            }
        }
        if live_pages != self.live_pages {
            return Err(format!(
                "live pages per group {:?}, the slabs hold {live_pages:?}",
                self.live_pages
            ));
        }
        let idle_set: BTreeSet<(GroupIndex, SlabId)> = (0..self.num_slabs())
            .filter_map(|s| {
                self.owner(s)
                    .filter(|_| self.live[s as usize] == 0)
                    .map(|g| (g, s))
            })
            .collect();
        // Each entry's key is its slab's stamp, so no slab can appear twice in a set.
        let keyed: BTreeSet<(GroupIndex, SlabId)> = self
            .idle_slabs
            .iter()
            .enumerate()
            .flat_map(|(g, set)| set.iter().map(move |&(_, s)| (g, s)))
            .collect();
        let stale = self
            .idle_slabs
            .iter()
            .flatten()
            .any(|&(t, s)| self.idle_since[s as usize] != t);
        let counted: usize = self.idle_slabs.iter().map(BTreeSet::len).sum();
        if idle_set != keyed || stale || counted != keyed.len() {
            return Err("the idle set differs from the owned slabs without live pages".into());
        }
        if owned != self.owned || idle != self.idle {
            return Err(format!(
                "counts: owned {:?} / idle {:?}, recounted {owned:?} / {idle:?}",
                self.owned, self.idle
            ));
        }
        let mut unowned: Vec<SlabId> = (1..self.num_slabs())
            .filter(|&s| self.owner(s).is_none())
            .collect();
        unowned.reverse();
        if unowned != self.unowned {
            return Err("the unowned list differs from the unowned slabs".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn rejects_bad_geometry() {
        assert!(ByteBudget::new(0, 4, &[1]).is_err());
        assert!(ByteBudget::new(64, 1, &[16]).is_err());
        assert!(ByteBudget::new(64, 4, &[]).is_err());
        assert!(ByteBudget::new(64, 4, &[65]).is_err());
        assert!(ByteBudget::new(64, 4, &[0]).is_err());
        assert!(ByteBudget::new(i64::MAX, 4, &[1]).is_err());
        assert!(
            ByteBudget::new(1 << 40, 1 << 10, &[1]).is_err(),
            "page IDs overflow u32"
        );
        // 100-byte slabs start 10 bytes into a 70-byte page somewhere: no page fits there.
        let err = ByteBudget::new(100, 8, &[70]).unwrap_err().to_string();
        assert!(err.contains("cannot always hold one page"), "{err}");
    }

    #[test]
    fn pages_lie_whole_in_their_slab_and_never_overlap() {
        for (slab, pages) in [
            (96u64, vec![16i64, 36, 96]),
            (100, vec![7, 33, 50, 100]),
            (1000, vec![1, 3, 7, 333, 334, 499]),
            (12_288, vec![4_096, 6_000, 3_001]),
        ] {
            let b = ByteBudget::new(slab as i64, 9, &pages).unwrap();
            for g in 0..b.num_groups() {
                let p = b.page_bytes(g);
                let mut seen = 0u32;
                for s in 0..b.num_slabs() {
                    let r = b.pages_in(g, s);
                    assert_eq!(r.len() as u32, b.pages_per_slab(g));
                    assert!(u64::from(r.start) * p >= u64::from(s) * slab);
                    assert!(u64::from(r.end) * p <= u64::from(s + 1) * slab);
                    for page in r.clone() {
                        assert_eq!(b.slab_of(g, page), Some(s));
                    }
                    seen += r.len() as u32;
                }
                // Every page is in one slab's range or in none.
                let lent = (0..b.num_pages(g) + 3)
                    .filter(|&q| b.slab_of(g, q).is_some())
                    .count();
                assert_eq!(lent as u32, seen);
                // The table answers what the bytes say: the slab a page starts in, if the
                // page is among the slab's first pages-per-slab pages that start in it.
                let per_slab = u64::from(b.pages_per_slab(g));
                for q in 0..b.num_pages(g) + 3 {
                    let s = u64::from(q) * p / slab;
                    let first = (s * slab).div_ceil(p);
                    let lent = s < u64::from(b.num_slabs()) && u64::from(q) < first + per_slab;
                    assert_eq!(b.slab_of(g, q), lent.then_some(s as SlabId), "page {q}");
                }
                assert_eq!(b.pages_in(g, NULL_SLAB).start, 0, "page 0 is in slab 0");
                let waste = b.slab_waste_bytes(g);
                assert!(waste < 2 * p, "group {g}: {waste} bytes lost per slab");
            }
        }
        // A slab that is a multiple of the page loses nothing.
        let b = ByteBudget::new(96, 3, &[16, 32, 48, 96]).unwrap();
        assert!((0..4).all(|g| b.slab_waste_bytes(g) == 0));
    }

    #[test]
    fn grant_pin_release_move_memory_between_groups() {
        let mut b = ByteBudget::new(64, 3, &[16, 64]).unwrap();
        assert_eq!(b.num_fully_free(), 2);
        let s = b.grant(0).unwrap().unwrap();
        assert_eq!(s, 1, "lowest slab first");
        let page = b.pages_in(0, s).start;
        b.pin(0, page).unwrap();
        assert_eq!(b.partly_used_free_pages(0), 3);
        // Live memory is not handed back, and group 1 cannot touch group 0's slab.
        let err = b.release(0, s).unwrap_err().to_string();
        assert!(err.contains("slab 1") && err.contains("in use"), "{err}");
        assert!(b.release(1, s).is_err());
        assert!(b.pin(1, b.pages_in(1, s).start).is_err());
        b.unpin(0, page).unwrap();
        assert!(b.unpin(0, page).is_err(), "unpin below zero");
        assert_eq!(b.num_idle(0), 1);
        b.release(0, s).unwrap();
        let t = b.grant(1).unwrap().unwrap();
        assert_eq!(t, s, "the same bytes, now group 1's");
        assert_eq!(b.grant(1).unwrap(), Some(2));
        assert_eq!(b.grant(0).unwrap(), None);
        assert_eq!(
            b.owner_changes(0),
            OwnerChanges {
                granted: 1,
                released: 1
            }
        );
        assert_eq!(b.owner_changes(1).granted, 2);
        b.check_invariants().unwrap();
    }

    #[test]
    fn the_slab_idle_longest_is_taken_back_first() {
        // Three slabs of group 0, each pinned once; they go idle in the order 3, 1, 2, so
        // that is the order another group's need takes them back, whatever their IDs.
        let mut b = ByteBudget::new(64, 5, &[16, 64]).unwrap();
        let slabs: Vec<SlabId> = (0..3).map(|_| b.grant(0).unwrap().unwrap()).collect();
        assert_eq!(slabs, [1, 2, 3]);
        for &s in &slabs {
            b.pin(0, b.pages_in(0, s).start).unwrap();
        }
        for s in [3, 1, 2] {
            b.unpin(0, b.pages_in(0, s).start).unwrap();
        }
        assert_eq!(b.idle_slabs().collect::<Vec<_>>(), [3, 1, 2]);
        // Used again, slab 3 is no longer the oldest: idle again, it is the newest.
        b.pin(0, b.pages_in(0, 3).start).unwrap();
        b.unpin(0, b.pages_in(0, 3).start).unwrap();
        assert_eq!(b.idle_slabs().collect::<Vec<_>>(), [1, 2, 3]);
        b.release(0, 1).unwrap();
        assert_eq!(b.idle_slabs().collect::<Vec<_>>(), [2, 3]);
        b.check_invariants().unwrap();
    }

    /// xorshift64*: a seeded stream for the random walk below (no dependency needed).
    struct Stream(u64);

    impl Stream {
        fn next(&mut self) -> u64 {
            self.0 ^= self.0 >> 12;
            self.0 ^= self.0 << 25;
            self.0 ^= self.0 >> 27;
            self.0.wrapping_mul(0x2545_F491_4F6C_DD1D)
        }

        fn below(&mut self, n: u64) -> u64 {
            self.next() % n.max(1)
        }
    }

    /// The plain model of a budget: who owns each slab, which pages each group holds,
    /// and how often memory changed owner.
    struct Model {
        slab: u64,
        pages: Vec<u64>,
        owner: Vec<Option<GroupIndex>>,
        pinned: Vec<BTreeSet<u32>>,
        moves: Vec<(u64, u64)>,
    }

    impl Model {
        /// Pages of group `g` that lie whole in every slab, by brute force over where a
        /// slab can start within the group's pages.
        fn pages_per_slab(&self, g: GroupIndex) -> u64 {
            let (page, slab) = (self.pages[g], self.slab);
            (0..page)
                .map(|s| ((s + 1) * slab) / page - (s * slab).div_ceil(page))
                .min()
                .unwrap_or(0)
        }

        fn live(&self, b: &ByteBudget, s: SlabId) -> u32 {
            self.owner[s as usize].map_or(0, |g| {
                self.pinned[g]
                    .iter()
                    .filter(|&&p| b.slab_of(g, p) == Some(s))
                    .count() as u32
            })
        }

        fn partly_used_free(&self, b: &ByteBudget, g: GroupIndex) -> u64 {
            (1..b.num_slabs())
                .filter(|&s| self.owner[s as usize] == Some(g))
                .map(|s| u64::from(self.live(b, s)))
                .filter(|&live| live > 0)
                .map(|live| self.pages_per_slab(g) - live)
                .sum()
        }

        fn free_page(&self, b: &ByteBudget, g: GroupIndex, s: SlabId) -> Option<u32> {
            b.pages_in(g, s).find(|p| !self.pinned[g].contains(p))
        }

        fn owned(&self, g: GroupIndex) -> Vec<SlabId> {
            (0..self.owner.len() as SlabId)
                .filter(|&s| self.owner[s as usize] == Some(g))
                .collect()
        }

        /// Every count the budget reports equals the model's.
        fn check(&self, b: &ByteBudget, step: &str) {
            b.check_invariants()
                .unwrap_or_else(|e| panic!("{step}: {e}"));
            for s in 0..b.num_slabs() {
                assert_eq!(b.owner(s), self.owner[s as usize], "{step}: slab {s} owner");
                assert_eq!(b.live(s), self.live(b, s), "{step}: slab {s} live pages");
            }
            let mut fully_free = 0;
            for s in 1..b.num_slabs() {
                if self.live(b, s) == 0 {
                    fully_free += 1;
                }
            }
            assert_eq!(b.num_fully_free(), fully_free, "{step}: fully free slabs");
            let mut stranded = 0;
            for g in 0..b.num_groups() {
                assert_eq!(u64::from(b.pages_per_slab(g)), self.pages_per_slab(g));
                let changes = b.owner_changes(g);
                assert_eq!((changes.granted, changes.released), self.moves[g], "{step}");
                assert_eq!(b.live_pages(g), self.pinned[g].len() as u64, "{step}");
                let free = self.partly_used_free(b, g);
                assert_eq!(b.partly_used_free_pages(g), free, "{step}: group {g}");
                stranded += free * self.pages[g];
            }
            assert_eq!(b.stranded_bytes(), stranded, "{step}: stranded bytes");
            let live_bytes: u64 = (0..b.num_groups())
                .map(|g| self.pinned[g].len() as u64 * self.pages[g])
                .sum();
            let lendable = u64::from(b.num_slabs() - 1) * b.slab_bytes();
            assert_eq!(
                b.usage(),
                live_bytes as f64 / lendable as f64,
                "{step}: usage"
            );
        }
    }

    /// Memory lent and given back, pages pinned and unpinned as pools would, and calls
    /// the budget must refuse (leaving it exactly as it was), against the plain model:
    /// ~18,000 steps over random geometries.
    #[test]
    fn a_random_walk_matches_a_plain_model() {
        let mut rng = Stream(0x9E37_79B9_7F4A_7C15);
        let mut walks = 0;
        // (slabs given back, releases refused, pages pinned, slabs lent): the walk must
        // reach every kind of step, or it proves little.
        let mut seen = [0u32; 4];
        while walks < 300 {
            let slab = 16 + rng.below(185);
            let num_slabs = 2 + rng.below(5);
            let groups = 1 + rng.below(3) as usize;
            let pages: Vec<u64> = (0..groups).map(|_| 1 + rng.below(slab)).collect();
            let as_i64: Vec<i64> = pages.iter().map(|&p| p as i64).collect();
            let mut b = match ByteBudget::new(slab as i64, num_slabs as i64, &as_i64) {
                Ok(b) => b,
                Err(e) => {
                    assert!(e.to_string().contains("cannot always hold one page"), "{e}");
                    continue;
                }
            };
            walks += 1;
            let mut m = Model {
                slab,
                pages,
                owner: vec![None; num_slabs as usize],
                pinned: vec![BTreeSet::new(); groups],
                moves: vec![(0, 0); groups],
            };
            for step in 0..60 {
                let g = rng.below(groups as u64) as GroupIndex;
                let label = format!("walk {walks} step {step}");
                match rng.below(6) {
                    0 => {
                        let lowest =
                            (1..num_slabs as SlabId).find(|&s| m.owner[s as usize].is_none());
                        assert_eq!(b.grant(g).unwrap(), lowest, "{label}: grant");
                        if let Some(s) = lowest {
                            m.owner[s as usize] = Some(g);
                            m.moves[g].0 += 1;
                            seen[3] += 1;
                        }
                    }
                    1 => {
                        let s = rng.below(num_slabs + 1) as SlabId;
                        let ok = s < num_slabs as SlabId
                            && m.owner[s as usize] == Some(g)
                            && m.live(&b, s) == 0;
                        let before = format!("{b:?}");
                        match b.release(g, s) {
                            Ok(()) => {
                                assert!(ok, "{label}: slab {s} given back by group {g}");
                                m.owner[s as usize] = None;
                                m.moves[g].1 += 1;
                                seen[0] += 1;
                            }
                            Err(e) => {
                                assert!(!ok, "{label}: release refused: {e}");
                                assert!(e.to_string().contains(&format!("slab {s}")), "{e}");
                                assert_eq!(before, format!("{b:?}"), "{label}: refused release");
                                seen[1] += 1;
                            }
                        }
                    }
                    2 | 3 => {
                        let owned = m.owned(g);
                        if owned.is_empty() {
                            continue;
                        }
                        let s = owned[rng.below(owned.len() as u64) as usize];
                        if let Some(page) = m.free_page(&b, g, s) {
                            b.pin(g, page).unwrap();
                            m.pinned[g].insert(page);
                            seen[2] += 1;
                        }
                    }
                    4 => {
                        let held: Vec<u32> = m.pinned[g].iter().copied().collect();
                        for _ in 0..=rng.below(3) {
                            if held.is_empty() {
                                break;
                            }
                            let page = held[rng.below(held.len() as u64) as usize];
                            if m.pinned[g].remove(&page) {
                                b.unpin(g, page).unwrap();
                            }
                        }
                    }
                    _ => {
                        // A block of a slab the group does not own, or one no slab lends.
                        let page = rng.below(u64::from(b.num_pages(g)) + 8) as u32;
                        let s = b.slab_of(g, page);
                        if s.is_some_and(|s| m.owner[s as usize] == Some(g)) {
                            continue;
                        }
                        let before = format!("{b:?}");
                        assert!(b.pin(g, page).is_err(), "{label}: pin of block {page}");
                        assert!(b.unpin(g, page).is_err(), "{label}: unpin of block {page}");
                        assert_eq!(before, format!("{b:?}"), "{label}: refused pin");
                    }
                }
                m.check(&b, &label);
            }
        }
        assert!(
            seen.iter().all(|&n| n > 200),
            "steps of each kind: {seen:?}"
        );
    }

    #[test]
    fn failed_calls_change_nothing() {
        let mut b = ByteBudget::new(64, 4, &[16, 32]).unwrap();
        let s = b.grant(0).unwrap().unwrap();
        b.pin(0, b.pages_in(0, s).start).unwrap();
        let before = format!("{b:?}");
        assert!(b.release(0, s).is_err());
        assert!(b.release(1, s).is_err());
        assert!(b.release(0, 99).is_err());
        assert!(b.grant(5).is_err());
        assert!(b.pin(1, 3).is_err());
        assert!(b.pin(0, 1_000_000).is_err());
        assert!(b.unpin(1, b.pages_in(1, s).start).is_err());
        assert_eq!(before, format!("{b:?}"));
    }
}
