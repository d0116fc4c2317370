//! Operations that tell observers about each block as they go: vLLM's metrics collector
//! (blocks allocated, accessed, evicted) and the reuse watchers of `unpin_blocks`.
//!
//! Observers are the caller's code and may read the pool while they run, so the core
//! cannot call them while it holds the pool. Instead such an operation is a [`Steps`]
//! value: each call of [`Steps::next_notice`] carries the operation forward to the next
//! point where vLLM notifies someone and returns that [`Notice`]; the caller delivers it
//! with the pool released, then asks for the next. The core decides what is notified and
//! in which order; the caller only maps each notice to its callable. Without observers the
//! first call runs the whole operation and returns `None`.

use crate::error::PoolError;
use crate::group_pool::{BlockId, GroupPool};
use crate::reuse::ReuseWatchers;

/// Something to tell an observer, in the order vLLM tells it.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum Notice<W> {
    /// A block watched since `unpin_blocks` is being handed out again: its watcher, to be
    /// called before the block changes.
    Reused(BlockId, W),
    /// The block's cached hashes are about to be dropped (metrics: `on_block_evicted`).
    Evicting(BlockId),
    /// The block was handed out with one reference (metrics: `on_block_allocated`).
    Allocated(BlockId),
    /// A prefix hit took a reference to the block (metrics: `on_block_accessed`).
    Accessed(BlockId),
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    /// `get_new_blocks`: the blocks are already off the free queue; each is claimed.
    HandOut,
    /// `evict_blocks` / `_maybe_evict_cached_block`: each block's hashes are dropped.
    Evict,
    /// `touch`: each block takes a reference.
    Touch,
}

/// An operation in progress. Drive it with [`next_notice`](Self::next_notice) until that
/// returns `None`; if delivering a notice fails, call [`abandon`](Self::abandon) so the
/// pool is left consistent.
#[must_use = "the operation is only carried out as its notices are taken"]
#[derive(Debug)]
pub struct Steps<W> {
    kind: Kind,
    ids: Vec<BlockId>,
    reused: std::vec::IntoIter<(BlockId, W)>,
    /// Index in `ids` of the next block to change.
    next: usize,
    /// Whether the notice that comes before changing `ids[next]` was given.
    announced: bool,
    /// Whether metrics notices are wanted (a metrics collector is set).
    observed: bool,
    keys_removed: usize,
}

impl<W> Steps<W> {
    fn new(kind: Kind, ids: Vec<BlockId>, reused: Vec<(BlockId, W)>, observed: bool) -> Self {
        Steps {
            kind,
            ids,
            reused: reused.into_iter(),
            next: 0,
            announced: false,
            observed,
            keys_removed: 0,
        }
    }

    /// The blocks the operation covers, in order (for `get_new_blocks`, the blocks
    /// handed out).
    pub fn ids(&self) -> &[BlockId] {
        &self.ids
    }

    /// Cached keys dropped so far (for `evict`: whether anything was evicted).
    pub fn keys_removed(&self) -> usize {
        self.keys_removed
    }

    /// Carry the operation forward to its next notice. Keys dropped on the way are passed
    /// to `removed`. `None`: the operation is complete.
    pub fn next_notice(
        &mut self,
        pool: &mut GroupPool,
        mut removed: impl FnMut(BlockId, &[u8]),
    ) -> Option<Notice<W>> {
        // vLLM tells reuse watchers first, right after taking the blocks off the queue.
        if let Some((id, w)) = self.reused.next() {
            return Some(Notice::Reused(id, w));
        }
        if !self.observed {
            // Nobody to tell: the rest of the operation in one pass.
            let rest = self.ids.get(self.next..).unwrap_or_default();
            self.next = self.ids.len();
            match self.kind {
                Kind::HandOut => pool.claim_popped(rest, removed),
                // IDs were checked when the steps were made.
                Kind::Evict => self.keys_removed += pool.evict_checked(rest, removed),
                Kind::Touch => rest.iter().for_each(|&id| pool.touch_checked(id)),
            }
            return None;
        }
        while let Some(&id) = self.ids.get(self.next) {
            if !self.announced {
                self.announced = true;
                let evicts = match self.kind {
                    Kind::HandOut => pool.enable_caching(),
                    Kind::Evict => true,
                    Kind::Touch => false,
                };
                if evicts {
                    return Some(Notice::Evicting(id));
                }
            }
            self.next += 1;
            self.announced = false;
            match self.kind {
                Kind::HandOut => {
                    pool.claim_popped(&[id], &mut removed);
                    return Some(Notice::Allocated(id));
                }
                Kind::Evict => {
                    self.keys_removed += pool.evict_checked(&[id], &mut removed);
                }
                Kind::Touch => {
                    pool.touch_checked(id);
                    return Some(Notice::Accessed(id));
                }
            }
        }
        None
    }

    /// Stop after a notice could not be delivered. Blocks taken off the free queue for a
    /// hand-out are claimed all the same (with their hashes dropped) so that none is left
    /// neither free nor held; watchers not yet told are dropped, as their blocks are
    /// handed out now. Evictions and touches not yet made are not made.
    pub fn abandon(mut self, pool: &mut GroupPool, mut removed: impl FnMut(BlockId, &[u8])) {
        if self.kind == Kind::HandOut {
            let rest = self.ids.split_off(self.next.min(self.ids.len()));
            pool.claim_popped(&rest, &mut removed);
        }
    }
}

impl GroupPool {
    /// vLLM's `get_new_blocks`: take `num_blocks` blocks from the front of the free queue.
    /// Steps, in vLLM's order: each block with a reuse watcher, in hand-out order, is
    /// reported to its watcher (`Reused`); then block by block, when `observed`,
    /// `Evicting` (with caching on), the hashes are dropped and one reference taken, and
    /// `Allocated`.
    pub fn hand_out<W>(
        &mut self,
        num_blocks: i64,
        watchers: &mut ReuseWatchers<W>,
        observed: bool,
    ) -> Result<Steps<W>, PoolError> {
        let n = usize::try_from(num_blocks).map_err(|_| {
            PoolError::InvalidArgument(format!(
                "cannot get a negative number of blocks ({num_blocks})"
            ))
        })?;
        let ids = self.pop_free(n)?;
        let reused = watchers.take_listed(&ids);
        Ok(Steps::new(Kind::HandOut, ids, reused, observed))
    }

    /// vLLM's `evict_blocks` (and `_maybe_evict_cached_block` for one block): drop the
    /// cached hashes of every listed block; held blocks stay held. Every ID is checked
    /// before any block is evicted. When `observed`, each block is announced
    /// (`Evicting`) before its hashes go, cached or not, as vLLM does.
    pub fn evict_steps<W>(&self, block_ids: &[i64], observed: bool) -> Result<Steps<W>, PoolError> {
        let mut ids = Vec::with_capacity(block_ids.len());
        for &id in block_ids {
            ids.push(self.check_id(id)?);
        }
        Ok(Steps::new(Kind::Evict, ids, Vec::new(), observed))
    }

    /// vLLM's `touch`, checked as a whole first: each block takes a reference (free ones
    /// leave the free queue), then, when `observed`, is reported (`Accessed`). Every
    /// listed block is reported, the null block included, as vLLM 0.32 does.
    pub fn touch_steps<W>(&self, ids: Vec<BlockId>, observed: bool) -> Result<Steps<W>, PoolError> {
        self.check_touch(&ids)?;
        Ok(Steps::new(Kind::Touch, ids, Vec::new(), observed))
    }

    /// vLLM's `unpin_blocks`: drop one reference to each block (blocks reaching zero go to
    /// the back of the free queue, contents kept) and watch every listed block with a
    /// watcher made by `make`, which fires when the block is handed out again or the
    /// prefix cache is reset.
    pub fn unpin_watched<W>(
        &mut self,
        ids: &[BlockId],
        watchers: &mut ReuseWatchers<W>,
        make: impl FnMut() -> W,
    ) -> Result<(), PoolError> {
        self.unpin(ids)?;
        watchers.watch(ids, make);
        Ok(())
    }

    /// vLLM's `reset_prefix_cache`: refused (`None`) while any block is in use; otherwise
    /// every cached key is dropped and every reuse watcher is returned, to be told in the
    /// order the blocks were first watched.
    pub fn reset_watched<W>(
        &mut self,
        watchers: &mut ReuseWatchers<W>,
        held: usize,
    ) -> Option<Vec<(BlockId, W)>> {
        self.reset_prefix_cache_holding(held)
            .then(|| watchers.take_all())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group_pool::FullBlock;

    fn noop(_: BlockId, _: &[u8]) {}

    /// Drive `steps` to the end, logging each notice with the block's state at that time.
    fn drive(
        pool: &mut GroupPool,
        mut steps: Steps<&'static str>,
    ) -> (Vec<(Notice<&'static str>, u32)>, usize) {
        let mut log = Vec::new();
        let mut keys = 0;
        while let Some(n) = steps.next_notice(pool, |_, _| keys += 1) {
            let id = match &n {
                Notice::Reused(id, _)
                | Notice::Evicting(id)
                | Notice::Allocated(id)
                | Notice::Accessed(id) => *id,
            };
            log.push((n, pool.ref_cnt(id)));
        }
        (log, keys)
    }

    fn cached_free_pool() -> GroupPool {
        let mut p = GroupPool::new(5, true, 4).unwrap();
        let a = p.allocate(2, noop).unwrap();
        let fb = [FullBlock {
            block: a[0],
            block_hash: b"h",
            num_tokens: 4,
        }];
        p.cache_full_blocks(&fb, 0, noop).unwrap();
        p.free(&a).unwrap();
        p
    }

    #[test]
    fn hand_out_tells_watchers_first_then_evicts_and_allocates_block_by_block() {
        let mut p = cached_free_pool();
        assert_eq!(p.free_blocks_in_order(), vec![2, 3, 4, 1]);
        let mut w = ReuseWatchers::default();
        let b = p.allocate(1, noop).unwrap();
        p.unpin_watched(&b, &mut w, || "w2").unwrap();
        assert_eq!(p.free_blocks_in_order(), vec![3, 4, 1, 2]);
        let steps = p.hand_out(4, &mut w, true).unwrap();
        assert_eq!(steps.ids(), &[3, 4, 1, 2]);
        let (log, keys) = drive(&mut p, steps);
        use Notice::*;
        assert_eq!(
            log,
            vec![
                (Reused(2, "w2"), 0),
                (Evicting(3), 0),
                (Allocated(3), 1),
                (Evicting(4), 0),
                (Allocated(4), 1),
                (Evicting(1), 0),
                (Allocated(1), 1),
                (Evicting(2), 0),
                (Allocated(2), 1),
            ]
        );
        assert_eq!(keys, 1, "block 1's hash was dropped");
        assert!(w.is_empty());
        p.check_invariants().unwrap();
    }

    #[test]
    fn unobserved_operations_run_in_one_step() {
        let mut p = cached_free_pool();
        let mut w: ReuseWatchers<&str> = ReuseWatchers::default();
        let steps = p.hand_out(4, &mut w, false).unwrap();
        let (log, keys) = drive(&mut p, steps);
        assert!(log.is_empty());
        assert_eq!(keys, 1);
        let mut steps = p.touch_steps::<&str>(vec![1, 0, 2], false).unwrap();
        assert_eq!(steps.next_notice(&mut p, noop), None);
        assert_eq!((p.ref_cnt(1), p.ref_cnt(2)), (2, 2));
        p.check_invariants().unwrap();
    }

    #[test]
    fn without_caching_hand_out_does_not_announce_evictions() {
        let mut p = GroupPool::new(3, false, 4).unwrap();
        let mut w: ReuseWatchers<&str> = ReuseWatchers::default();
        let steps = p.hand_out(2, &mut w, true).unwrap();
        let (log, _) = drive(&mut p, steps);
        assert_eq!(
            log,
            vec![(Notice::Allocated(1), 1), (Notice::Allocated(2), 1)]
        );
    }

    #[test]
    fn touch_reports_each_block_after_its_reference_and_evict_before_its_hashes_go() {
        let mut p = cached_free_pool();
        let steps = p.touch_steps(vec![1, 0], true).unwrap();
        let (log, _) = drive(&mut p, steps);
        assert_eq!(
            log,
            vec![(Notice::Accessed(1), 1), (Notice::Accessed(0), 0)]
        );
        let mut steps = p.evict_steps::<&str>(&[1, 3], true).unwrap();
        let mut hashes = Vec::new();
        let mut seen = Vec::new();
        while let Some(n) = steps.next_notice(&mut p, |_, k| hashes.push(k.to_vec())) {
            seen.push((n, p.block_hash(1).is_some()));
        }
        assert_eq!(
            seen,
            vec![(Notice::Evicting(1), true), (Notice::Evicting(3), false)]
        );
        assert_eq!((steps.keys_removed(), hashes.len()), (1, 1));
        p.check_invariants().unwrap();
    }

    #[test]
    fn bad_requests_change_nothing() {
        let mut p = cached_free_pool();
        let before = p.free_blocks_in_order();
        let mut w: ReuseWatchers<&str> = ReuseWatchers::default();
        assert!(matches!(
            p.hand_out(-1, &mut w, false),
            Err(PoolError::InvalidArgument(_))
        ));
        assert!(matches!(
            p.hand_out(5, &mut w, false),
            Err(PoolError::NotEnoughFree { .. })
        ));
        assert!(matches!(
            p.evict_steps::<&str>(&[1, 5], false),
            Err(PoolError::OutOfRange { block_id: 5, .. })
        ));
        assert!(p.touch_steps::<&str>(vec![9], true).is_err());
        assert_eq!(p.free_blocks_in_order(), before);
        assert_eq!(p.block_hash(1).map(<[u8]>::len), Some(5));
    }

    #[test]
    fn an_abandoned_hand_out_still_claims_its_blocks() {
        let mut p = GroupPool::new(5, true, 4).unwrap();
        let mut w = ReuseWatchers::default();
        let a = p.allocate(1, noop).unwrap();
        p.unpin_watched(&a, &mut w, || "w").unwrap();
        let mut steps = p.hand_out(4, &mut w, true).unwrap();
        assert_eq!(
            steps.next_notice(&mut p, noop),
            Some(Notice::Reused(1, "w"))
        );
        // Delivering the watcher failed: give up.
        steps.abandon(&mut p, noop);
        p.check_invariants().unwrap();
        assert_eq!(p.num_free(), 0);
        assert_eq!(p.ref_cnt(1), 1);
    }

    #[test]
    fn reset_tells_every_watcher_in_first_watched_order() {
        let mut p = GroupPool::new(5, true, 4).unwrap();
        let mut w = ReuseWatchers::default();
        let a = p.allocate(3, noop).unwrap();
        p.unpin_watched(&[a[2]], &mut w, || "c").unwrap();
        p.unpin_watched(&[a[0], a[1]], &mut w, || "ab").unwrap();
        assert_eq!(
            p.reset_watched(&mut w, 0),
            Some(vec![(3, "c"), (1, "ab"), (2, "ab")])
        );
        let b = p.allocate(1, noop).unwrap();
        p.unpin_watched(&b, &mut w, || "held").unwrap();
        p.touch(&b).unwrap();
        assert_eq!(p.reset_watched(&mut w, 0), None, "a block is in use");
        assert_eq!(w.len(), 1);
    }
}
