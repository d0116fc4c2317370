//! One pool of KV-cache blocks: the blocks of one KV-cache group (or, in vLLM's stock
//! layout, of all groups), their reference counts, the free queue in eviction order and the
//! prefix cache.
//!
//! Block IDs are scoped to their pool: block 7 of one pool and block 7 of another are
//! different blocks. Block 0 is the null block, a placeholder that vLLM puts in block tables
//! for skipped positions; it is never handed out, cached or freed, and operations that list
//! it among other blocks pass over it.
//!
//! Every operation validates its whole input before it changes anything: on `Err` the pool
//! is exactly as it was.

use crate::error::PoolError;
use crate::free_queue::{FreeQueue, MAX_BLOCKS};
use crate::prefix_cache::{make_key, PrefixCache};

pub type BlockId = u32;

/// The null block's ID in every pool.
pub const NULL_BLOCK_ID: BlockId = 0;

/// Where freed blocks go in the free queue.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum FreeTo {
    /// Reused first: blocks with no cached content (LIFO, for locality).
    Front,
    /// Reused last: cached blocks, kept for prefix hits (LRU).
    Back,
}

#[derive(Debug, Clone)]
pub struct GroupPool {
    ref_cnt: Vec<u32>,
    queue: FreeQueue,
    cache: PrefixCache,
    enable_caching: bool,
    /// Tokens covered by one request block hash (vLLM's `hash_block_size`): the unit of
    /// partial prefix-cache entries.
    hash_block_size: u32,
    /// When on (elastic pools): every block whose count left zero (`true`) or reached it
    /// (`false`), in order, until taken with [`GroupPool::take_live_changes`].
    live_changes: Option<Vec<(BlockId, bool)>>,
}

/// One block to cache in [`GroupPool::cache_full_blocks`].
#[derive(Debug, Clone, Copy)]
pub struct FullBlock<'a> {
    pub block: BlockId,
    pub block_hash: &'a [u8],
    pub num_tokens: u32,
}

impl GroupPool {
    /// A pool of `num_blocks` blocks (block 0 being the null block), all free but the null
    /// block, in ID order. Request block hashes cover `hash_block_size` tokens each.
    /// Sizes are taken as the caller has them (vLLM passes Python ints) and checked here.
    pub fn new(
        num_blocks: i64,
        enable_caching: bool,
        hash_block_size: i64,
    ) -> Result<Self, PoolError> {
        if num_blocks <= 0 {
            return Err(PoolError::InvalidArgument(format!(
                "num_gpu_blocks must be positive, got {num_blocks}"
            )));
        }
        let num_blocks = match usize::try_from(num_blocks) {
            Ok(n) if n <= MAX_BLOCKS => n,
            _ => {
                return Err(PoolError::InvalidSize {
                    requested: num_blocks,
                    max: MAX_BLOCKS,
                })
            }
        };
        let hash_block_size = match u32::try_from(hash_block_size) {
            Ok(n) if n > 0 => n,
            _ => {
                return Err(PoolError::InvalidArgument(format!(
                    "hash_block_size must be positive, got {hash_block_size}"
                )))
            }
        };
        let mut queue = FreeQueue::new_full(num_blocks);
        // The null block leaves the queue for good; its count is never maintained.
        queue.pop_front();
        Ok(GroupPool {
            ref_cnt: vec![0; num_blocks],
            queue,
            cache: PrefixCache::new(num_blocks),
            enable_caching,
            hash_block_size,
            live_changes: None,
        })
    }

    /// Record (or stop recording) which blocks go in and out of use.
    pub fn track_live_changes(&mut self, on: bool) {
        self.live_changes = on.then(Vec::new);
    }

    /// The blocks that went in (`true`) or out (`false`) of use since the last call.
    pub fn take_live_changes(&mut self) -> Vec<(BlockId, bool)> {
        self.live_changes
            .as_mut()
            .map(std::mem::take)
            .unwrap_or_default()
    }

    /// Hand back the buffer of changes [`take_live_changes`](Self::take_live_changes)
    /// returned, once they are applied: emptied, it becomes the log again if nothing was
    /// recorded since, so the next operation logs into memory already there instead of
    /// growing a new buffer page by page (a request's pages are logged at every admission
    /// and every free).
    pub fn recycle_live_changes(&mut self, mut changes: Vec<(BlockId, bool)>) {
        if let Some(log) = self.live_changes.as_mut() {
            if log.is_empty() && log.capacity() < changes.capacity() {
                changes.clear();
                *log = changes;
            }
        }
    }

    /// Put changes taken with [`take_live_changes`](Self::take_live_changes) back in front
    /// of any recorded since (a sync that failed keeps them for the next one).
    pub fn restore_live_changes(&mut self, mut changes: Vec<(BlockId, bool)>) {
        if let Some(log) = self.live_changes.as_mut() {
            changes.append(log);
            *log = changes;
        }
    }

    fn log_live(&mut self, ids: &[BlockId], live: bool) {
        if let Some(log) = self.live_changes.as_mut() {
            log.extend(ids.iter().map(|&id| (id, live)));
        }
    }

    #[inline]
    pub fn num_blocks(&self) -> usize {
        self.ref_cnt.len()
    }

    #[inline]
    pub fn num_free(&self) -> usize {
        self.queue.len()
    }

    #[inline]
    pub fn enable_caching(&self) -> bool {
        self.enable_caching
    }

    #[inline]
    pub fn hash_block_size(&self) -> u32 {
        self.hash_block_size
    }

    /// Fraction of usable blocks (all but the null block) in use.
    pub fn usage(&self) -> f64 {
        let usable = self.num_blocks() - 1;
        if usable == 0 {
            return 0.0;
        }
        1.0 - self.num_free() as f64 / usable as f64
    }

    /// Check that `block_id` names a block of this pool.
    #[inline]
    pub fn check_id(&self, block_id: i64) -> Result<BlockId, PoolError> {
        if block_id >= 0 && (block_id as u64) < self.num_blocks() as u64 {
            Ok(block_id as BlockId)
        } else {
            Err(PoolError::OutOfRange {
                block_id,
                num_blocks: self.num_blocks(),
            })
        }
    }

    pub(crate) fn check_ids(&self, ids: &[BlockId]) -> Result<(), PoolError> {
        for &id in ids {
            self.check_id(id as i64)?;
        }
        Ok(())
    }

    #[inline]
    pub fn ref_cnt(&self, id: BlockId) -> u32 {
        self.ref_cnt.get(id as usize).copied().unwrap_or(0)
    }

    /// Whether `id` is in the free queue (free, possibly still cached).
    #[inline]
    pub fn is_free(&self, id: BlockId) -> bool {
        self.queue.contains(id)
    }

    pub fn queue(&self) -> &FreeQueue {
        &self.queue
    }

    /// Move the free, uncached blocks of `ids` to the back of the free queue (reused
    /// last), in order; blocks in use or cached stay where they are. Reference counts,
    /// the cache and the live changes are untouched: only the order of reuse changes.
    pub fn reuse_last(&mut self, ids: impl Iterator<Item = BlockId>) {
        for id in ids {
            if id != NULL_BLOCK_ID && !self.cache.has_primary(id) && self.queue.remove(id) {
                self.queue.push_back(id);
            }
        }
    }

    pub fn cache(&self) -> &PrefixCache {
        &self.cache
    }

    /// vLLM's `block.block_hash`: the primary prefix-cache key of a block.
    #[inline]
    pub fn block_hash(&self, id: BlockId) -> Option<&[u8]> {
        self.cache.primary(id)
    }

    #[inline]
    pub fn block_hash_num_tokens(&self, id: BlockId) -> Option<u32> {
        self.cache.primary_tokens(id)
    }

    /// vLLM's `is_block_writable`: held by exactly one owner and not cached.
    pub fn is_writable(&self, id: BlockId) -> bool {
        id != NULL_BLOCK_ID && self.ref_cnt(id) == 1 && !self.cache.has_primary(id)
    }

    /// Take `n` blocks from the front of the free queue, evicting their cached hashes
    /// (when caching is on) and giving each one reference. Evicted keys go to `removed`.
    pub fn allocate(
        &mut self,
        n: usize,
        removed: impl FnMut(BlockId, &[u8]),
    ) -> Result<Vec<BlockId>, PoolError> {
        let ids = self.pop_free(n)?;
        self.claim_popped(&ids, removed);
        Ok(ids)
    }

    /// First half of [`allocate`](Self::allocate): take `n` blocks off the free queue and
    /// leave them otherwise untouched (still cached, count 0) so that a caller can notify
    /// reuse watchers in between, as vLLM does.
    pub fn pop_free(&mut self, n: usize) -> Result<Vec<BlockId>, PoolError> {
        // Checked before anything is reserved: `n` comes from the caller.
        if n <= self.num_free() {
            let mut ids = Vec::with_capacity(n);
            if self.queue.pop_front_n(n, &mut ids) {
                // Off the queue is in use: a budget synced now must not count these
                // pages' slabs idle while the caller has not claimed them yet.
                self.log_live(&ids, true);
                return Ok(ids);
            }
        }
        Err(PoolError::NotEnoughFree {
            requested: n,
            free: self.num_free(),
        })
    }

    /// Second half of [`allocate`](Self::allocate), for blocks returned by
    /// [`pop_free`](Self::pop_free).
    pub fn claim_popped(&mut self, ids: &[BlockId], mut removed: impl FnMut(BlockId, &[u8])) {
        for &id in ids {
            if self.enable_caching {
                self.cache.remove_block(id, |k| removed(id, k));
            }
            self.ref_cnt[id as usize] = 1;
        }
    }

    /// Drop one reference to each listed block (a block may be listed as often as it is
    /// referenced). Blocks whose count reaches zero join the free queue: uncached ones at
    /// the front in list order, cached ones at the back in list order. The null block is
    /// passed over.
    pub fn free(&mut self, ids: &[BlockId]) -> Result<(), PoolError> {
        self.check_ids(ids)?;
        // Sized for the common case, every block freed uncached (one allocation, not one
        // per doubling); `back` (cached blocks) allocates only if one comes.
        let mut front = Vec::with_capacity(ids.len());
        let mut back = Vec::new();
        for (k, &id) in ids.iter().enumerate() {
            if id == NULL_BLOCK_ID {
                continue;
            }
            let cnt = &mut self.ref_cnt[id as usize];
            if *cnt == 0 {
                self.undo_decrements(&ids[..k]);
                return Err(PoolError::DoubleFree { block_id: id });
            }
            *cnt -= 1;
            if *cnt == 0 {
                match self.free_destination(id) {
                    FreeTo::Front => front.push(id),
                    FreeTo::Back => back.push(id),
                }
            }
        }
        self.queue.push_front_all(&front);
        self.queue.push_back_all(&back);
        self.log_live(&front, false);
        self.log_live(&back, false);
        Ok(())
    }

    /// Whether [`free`](Self::free) of `ids` would succeed. The pool is left as it was
    /// (counts are lowered as `free` would and then restored), so a caller freeing the
    /// blocks of several pools can check every pool before it frees any.
    pub fn check_free(&mut self, ids: &[BlockId]) -> Result<(), PoolError> {
        self.check_ids(ids)?;
        for (k, &id) in ids.iter().enumerate() {
            if id == NULL_BLOCK_ID {
                continue;
            }
            let cnt = &mut self.ref_cnt[id as usize];
            if *cnt == 0 {
                self.undo_decrements(&ids[..k]);
                return Err(PoolError::DoubleFree { block_id: id });
            }
            *cnt -= 1;
        }
        self.undo_decrements(ids);
        Ok(())
    }

    fn free_destination(&self, id: BlockId) -> FreeTo {
        if self.enable_caching && self.cache.has_primary(id) {
            FreeTo::Back
        } else {
            FreeTo::Front
        }
    }

    fn undo_decrements(&mut self, done: &[BlockId]) {
        for &id in done {
            if id != NULL_BLOCK_ID {
                self.ref_cnt[id as usize] += 1;
            }
        }
    }

    /// Drop one reference to each listed block, like [`free`](Self::free), but every block
    /// that reaches zero goes to the back of the queue whether cached or not: its contents
    /// stay readable until the pool hands it out again (vLLM's `unpin_blocks`). Returns
    /// the blocks released. The null block is refused.
    pub fn unpin(&mut self, ids: &[BlockId]) -> Result<Vec<BlockId>, PoolError> {
        self.check_ids(ids)?;
        if ids.contains(&NULL_BLOCK_ID) {
            return Err(PoolError::NullBlock {
                block_id: NULL_BLOCK_ID,
                op: "unpin",
            });
        }
        let mut released = Vec::new();
        for (k, &id) in ids.iter().enumerate() {
            let cnt = &mut self.ref_cnt[id as usize];
            if *cnt == 0 {
                self.undo_decrements(&ids[..k]);
                return Err(PoolError::DoubleFree { block_id: id });
            }
            *cnt -= 1;
            if *cnt == 0 {
                released.push(id);
            }
        }
        self.queue.push_back_all(&released);
        self.log_live(&released, false);
        Ok(released)
    }

    /// Add one reference to each listed block, taking free ones out of the free queue (a
    /// prefix-cache hit). The null block is passed over.
    pub fn touch(&mut self, ids: &[BlockId]) -> Result<(), PoolError> {
        self.check_touch(ids)?;
        for &id in ids {
            self.touch_checked(id);
        }
        Ok(())
    }

    /// Whether [`touch`](Self::touch) of `ids` would succeed: IDs in range, no count that
    /// could overflow even if every listing were of the same block.
    pub(crate) fn check_touch(&self, ids: &[BlockId]) -> Result<(), PoolError> {
        self.check_ids(ids)?;
        let limit = u32::MAX.saturating_sub(u32::try_from(ids.len()).unwrap_or(u32::MAX));
        for &id in ids {
            if id != NULL_BLOCK_ID && self.ref_cnt[id as usize] >= limit {
                return Err(PoolError::RefOverflow { block_id: id });
            }
        }
        Ok(())
    }

    /// One block of a [`touch`](Self::touch) whose list passed
    /// [`check_touch`](Self::check_touch). The count saturates rather than wraps in case
    /// a caller's callback changed counts between the check and this step.
    pub(crate) fn touch_checked(&mut self, id: BlockId) {
        if id == NULL_BLOCK_ID {
            return;
        }
        let Some(cnt) = self.ref_cnt.get_mut(id as usize) else {
            return;
        };
        let was_free = *cnt == 0;
        *cnt = cnt.saturating_add(1);
        if was_free {
            self.queue.remove(id);
            self.log_live(&[id], true);
        }
    }

    /// How many of the listed blocks a prefix hit would take out of the free queue: free
    /// (count 0) blocks other than the null block. vLLM's managers count this per block
    /// on every admission.
    pub fn count_evictable(&self, ids: &[BlockId]) -> usize {
        ids.iter()
            .filter(|&&id| id != NULL_BLOCK_ID && self.ref_cnt(id) == 0)
            .count()
    }

    /// The most tokens any of the listed blocks' hashes cover (0 if none is cached):
    /// vLLM's `KVCacheManager.estimate_cached_tokens` takes this maximum over a group's
    /// blocks, reading `block_hash_num_tokens` block by block, once per finished prefill.
    pub fn max_block_hash_num_tokens(&self, ids: &[BlockId]) -> u32 {
        ids.iter()
            .filter_map(|&id| self.block_hash_num_tokens(id))
            .max()
            .unwrap_or(0)
    }

    /// Set a held block's reference count directly (vLLM's managers write
    /// `block.ref_cnt += 1` on blocks they hold). Only held, non-null blocks may be set,
    /// and only to a count of at least one: anything else would put a block in the free
    /// queue with references, or out of it without.
    pub fn set_ref_cnt(&mut self, id: BlockId, value: i64) -> Result<(), PoolError> {
        self.check_id(id as i64)?;
        if id == NULL_BLOCK_ID {
            return Err(PoolError::NullBlock {
                block_id: id,
                op: "set the reference count of",
            });
        }
        if self.ref_cnt[id as usize] == 0 {
            return Err(PoolError::BadState {
                block_id: id,
                reason: "the block is free; take a reference with touch() or get_new_blocks()"
                    .into(),
            });
        }
        if value < 1 || value > u32::MAX as i64 / 2 {
            return Err(PoolError::BadState {
                block_id: id,
                reason: format!(
                    "reference count {value} is invalid for a held block; release references with free_blocks()"
                ),
            });
        }
        self.ref_cnt[id as usize] = value as u32;
        Ok(())
    }

    /// Cache full blocks of one group (vLLM's `cache_full_blocks` for the blocks that are
    /// neither null nor masked out). A block that already has a primary key is accepted
    /// only if that key covers fewer tokens (a partial entry being promoted); its old keys
    /// are removed first and reported to `removed`.
    pub fn cache_full_blocks(
        &mut self,
        blocks: &[FullBlock<'_>],
        group_id: u32,
        mut removed: impl FnMut(BlockId, &[u8]),
    ) -> Result<(), PoolError> {
        for fb in blocks {
            self.check_id(fb.block as i64)?;
            if fb.block == NULL_BLOCK_ID {
                return Err(PoolError::NullBlock {
                    block_id: fb.block,
                    op: "cache",
                });
            }
            if self.cache.has_primary(fb.block) && !self.promotes(fb.block, fb.num_tokens) {
                return Err(PoolError::BadState {
                    block_id: fb.block,
                    reason: "the block is already cached as a full block".into(),
                });
            }
        }
        let mut key = Vec::new();
        for fb in blocks {
            if self.cache.has_primary(fb.block) {
                self.cache.remove_block(fb.block, |k| removed(fb.block, k));
            }
            make_key(&mut key, fb.block_hash, group_id);
            self.cache.insert(&key, fb.block, Some(fb.num_tokens));
        }
        Ok(())
    }

    /// Whether an entry covering `num_tokens` promotes block `id`: its primary entry covers
    /// fewer tokens (a partial entry growing towards the full block). A promoted block's
    /// old keys are dropped before the new entry is added.
    pub fn promotes(&self, id: BlockId, num_tokens: u32) -> bool {
        self.cache
            .primary_tokens(id)
            .is_some_and(|covered| covered < num_tokens)
    }

    /// vLLM's `_insert_block_hash`: make `id` reachable from `key` (a full
    /// `BlockHashWithGroupId`).
    pub fn insert_hash(
        &mut self,
        key: &[u8],
        id: BlockId,
        num_tokens: Option<u32>,
    ) -> Result<(), PoolError> {
        self.check_id(id as i64)?;
        if id == NULL_BLOCK_ID {
            return Err(PoolError::NullBlock {
                block_id: id,
                op: "cache",
            });
        }
        self.cache.insert(key, id, num_tokens);
        Ok(())
    }

    /// vLLM's `_remove_cached_block_hashes` / eviction: drop every key of `id`. Returns
    /// how many keys were removed (each reported to `removed`).
    #[inline]
    pub fn evict(
        &mut self,
        id: BlockId,
        mut removed: impl FnMut(BlockId, &[u8]),
    ) -> Result<usize, PoolError> {
        self.check_id(id as i64)?;
        Ok(self.cache.remove_block(id, |k| removed(id, k)))
    }

    /// [`evict`](Self::evict) of each listed block, whose IDs were checked. Returns how
    /// many keys were removed in all.
    pub(crate) fn evict_checked(
        &mut self,
        ids: &[BlockId],
        mut removed: impl FnMut(BlockId, &[u8]),
    ) -> usize {
        let mut count = 0;
        for &id in ids {
            count += self.cache.remove_block(id, |k| removed(id, k));
        }
        count
    }

    /// vLLM's `move_block_hashes`: re-point every key of `src` to `dst`, which must have
    /// none. No keys disappear, so nothing is reported.
    pub fn move_hashes(&mut self, src: BlockId, dst: BlockId) -> Result<(), PoolError> {
        self.check_id(src as i64)?;
        self.check_id(dst as i64)?;
        if dst == NULL_BLOCK_ID || src == NULL_BLOCK_ID {
            return Err(PoolError::NullBlock {
                block_id: NULL_BLOCK_ID,
                op: "move hashes to or from",
            });
        }
        if self.cache.is_cached(dst) {
            return Err(PoolError::BadState {
                block_id: dst,
                reason: "the destination of move_block_hashes already has hashes".into(),
            });
        }
        if src == dst {
            return Ok(());
        }
        let tokens = self.cache.primary_tokens(src);
        let mut keys: Vec<Vec<u8>> = Vec::new();
        self.cache.remove_block(src, |k| keys.push(k.to_vec()));
        for (i, k) in keys.iter().enumerate() {
            // The token count belongs to the first (primary) key only.
            self.cache
                .insert(k, dst, if i == 0 { tokens } else { None });
        }
        Ok(())
    }

    /// The first block cached under `key`.
    #[inline]
    pub fn lookup(&self, key: &[u8]) -> Option<BlockId> {
        self.cache.get_one(key)
    }

    /// Drop every cached key, if no block but the null block is in use. Returns whether
    /// it did.
    pub fn reset_prefix_cache(&mut self) -> bool {
        self.reset_prefix_cache_holding(0)
    }

    /// [`reset_prefix_cache`](Self::reset_prefix_cache) of a pool in which `held` blocks
    /// are held by something other than requests (an elastic pool's pages of slabs other
    /// groups own): no block but those and the null block may be in use.
    pub fn reset_prefix_cache_holding(&mut self, held: usize) -> bool {
        if self.num_free() + 1 + held != self.num_blocks() {
            return false;
        }
        self.cache.clear();
        true
    }

    /// The free blocks in eviction order.
    pub fn free_blocks_in_order(&self) -> Vec<BlockId> {
        self.queue.iter().collect()
    }

    /// Heap bytes of per-block bookkeeping (counts, queue links, hash records).
    pub fn per_block_heap_bytes(&self) -> usize {
        self.ref_cnt.capacity() * std::mem::size_of::<u32>()
            + self.queue.heap_bytes()
            + self.cache.per_block_heap_bytes()
    }

    /// Check the pool's invariants: every block but the null block is either free (count 0,
    /// queued) or held (count > 0, not queued); free + held + null == total; the cache and
    /// the queue are internally consistent.
    pub fn check_invariants(&self) -> Result<(), String> {
        self.queue.check()?;
        self.cache.check()?;
        if self.queue.contains(NULL_BLOCK_ID) {
            return Err("the null block is in the free queue".into());
        }
        let mut held = 0usize;
        for id in 1..self.num_blocks() as u32 {
            let free = self.queue.contains(id);
            let cnt = self.ref_cnt[id as usize];
            if free && cnt != 0 {
                return Err(format!("block {id} is free but has {cnt} references"));
            }
            if !free && cnt == 0 {
                return Err(format!(
                    "block {id} has no references but is not free (leak)"
                ));
            }
            if !free {
                held += 1;
            }
        }
        if held + self.num_free() + 1 != self.num_blocks() {
            return Err("free + held + null != total".into());
        }
        if self.cache.is_cached(NULL_BLOCK_ID) {
            return Err("the null block is cached".into());
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn noop(_: BlockId, _: &[u8]) {}

    fn cache_one(p: &mut GroupPool, id: BlockId, hash: &str, tokens: u32) {
        p.cache_full_blocks(
            &[FullBlock {
                block: id,
                block_hash: hash.as_bytes(),
                num_tokens: tokens,
            }],
            0,
            noop,
        )
        .unwrap();
    }

    fn key(h: &str, g: u32) -> Vec<u8> {
        let mut k = vec![];
        make_key(&mut k, h.as_bytes(), g);
        k
    }

    #[test]
    fn a_recycled_change_buffer_logs_only_what_comes_after() {
        let mut p = GroupPool::new(64, false, 16).unwrap();
        p.track_live_changes(true);
        let a = p.allocate(40, noop).unwrap();
        let taken = p.take_live_changes();
        assert_eq!(taken.len(), 40);
        let capacity = taken.capacity();
        p.recycle_live_changes(taken);
        assert!(
            p.take_live_changes().is_empty(),
            "a recycled buffer came back full"
        );
        // A buffer handed back with items in it is emptied first.
        let mut buffer = Vec::with_capacity(2 * capacity);
        buffer.push((0, true));
        p.recycle_live_changes(buffer);
        p.free(&a[..3]).unwrap();
        let changes = p.take_live_changes();
        assert_eq!(
            changes,
            a[..3].iter().map(|&id| (id, false)).collect::<Vec<_>>()
        );
        assert!(
            changes.capacity() >= 2 * capacity,
            "the buffer was not reused"
        );
        // Changes recorded since the take are never dropped by a recycle.
        p.free(&a[3..5]).unwrap();
        p.recycle_live_changes(Vec::with_capacity(4 * capacity));
        assert_eq!(
            p.take_live_changes(),
            a[3..5].iter().map(|&id| (id, false)).collect::<Vec<_>>()
        );
        // Untracked pools keep no log, recycled or not.
        p.track_live_changes(false);
        p.recycle_live_changes(Vec::with_capacity(8));
        p.free(&a[5..6]).unwrap();
        assert!(p.take_live_changes().is_empty());
    }

    #[test]
    fn new_pool_reserves_the_null_block() {
        let p = GroupPool::new(5, true, 16).unwrap();
        assert_eq!(p.num_free(), 4);
        assert_eq!(p.free_blocks_in_order(), vec![1, 2, 3, 4]);
        assert_eq!(p.usage(), 0.0);
        p.check_invariants().unwrap();
        let single = GroupPool::new(1, true, 16).unwrap();
        assert_eq!((single.num_free(), single.usage()), (0, 0.0));
    }

    #[test]
    fn construction_checks_its_sizes() {
        let err = |n, hbs| GroupPool::new(n, true, hbs).unwrap_err().to_string();
        assert!(err(0, 16).contains("num_gpu_blocks must be positive, got 0"));
        assert!(err(-3, 16).contains("got -3"));
        assert!(err(i64::MAX, 16).contains("at most"));
        assert!(err(4, 0).contains("hash_block_size must be positive"));
        assert!(err(4, 1 << 40).contains("hash_block_size"));
        assert_eq!(GroupPool::new(4, false, 8).unwrap().hash_block_size(), 8);
    }

    #[test]
    fn check_free_changes_nothing_either_way() {
        let mut p = GroupPool::new(6, true, 16).unwrap();
        let a = p.allocate(3, noop).unwrap();
        p.touch(&a[..1]).unwrap();
        let counts = |p: &GroupPool| (0..6).map(|b| p.ref_cnt(b)).collect::<Vec<_>>();
        let before = counts(&p);
        p.check_free(&[a[0], 0, a[0], a[1]]).unwrap();
        assert_eq!(counts(&p), before);
        assert_eq!(
            p.check_free(&[a[1], a[2], a[1]]),
            Err(PoolError::DoubleFree { block_id: a[1] })
        );
        assert!(p.check_free(&[7]).is_err());
        assert_eq!(counts(&p), before);
        assert_eq!(p.num_free(), 2);
        p.check_invariants().unwrap();
    }

    #[test]
    fn count_evictable_counts_free_blocks_but_not_the_null_block() {
        let mut p = GroupPool::new(6, true, 16).unwrap();
        let a = p.allocate(2, noop).unwrap();
        assert_eq!(p.count_evictable(&[0, a[0], a[1], 3, 4, 4]), 3);
        p.free(&a[..1]).unwrap();
        assert_eq!(p.count_evictable(&[0, a[0], a[1]]), 1);
    }

    #[test]
    fn max_block_hash_num_tokens_is_the_largest_cached_span() {
        let mut p = GroupPool::new(6, true, 4).unwrap();
        let a = p.allocate(3, noop).unwrap();
        assert_eq!(p.max_block_hash_num_tokens(&[0, a[0], a[1], a[2]]), 0);
        assert_eq!(p.max_block_hash_num_tokens(&[]), 0);
        cache_one(&mut p, a[0], "h0", 4);
        cache_one(&mut p, a[1], "h1", 8);
        // Listed out of order, with the null block and an uncached block among them.
        assert_eq!(p.max_block_hash_num_tokens(&[a[1], 0, a[0], a[2]]), 8);
        assert_eq!(p.max_block_hash_num_tokens(&[a[0], a[2]]), 4);
    }

    #[test]
    fn allocate_and_free_follow_vllm_order() {
        let mut p = GroupPool::new(6, true, 16).unwrap();
        let a = p.allocate(3, noop).unwrap();
        assert_eq!(a, vec![1, 2, 3]);
        assert!(a.iter().all(|&b| p.ref_cnt(b) == 1));
        // Uncached blocks freed go to the front in list order.
        p.free(&[3, 2, 1]).unwrap();
        assert_eq!(p.free_blocks_in_order(), vec![3, 2, 1, 4, 5]);
        p.check_invariants().unwrap();
    }

    #[test]
    fn cached_blocks_go_to_the_back_and_are_evicted_on_reuse() {
        let mut p = GroupPool::new(4, true, 16).unwrap();
        let a = p.allocate(2, noop).unwrap();
        cache_one(&mut p, a[0], "h1", 16);
        p.free(&[a[1], a[0]]).unwrap();
        assert_eq!(p.free_blocks_in_order(), vec![2, 3, 1]);
        assert_eq!(p.lookup(&key("h1", 0)), Some(1));
        let mut evicted = vec![];
        let b = p
            .allocate(3, |id, k| evicted.push((id, k.to_vec())))
            .unwrap();
        assert_eq!(b, vec![2, 3, 1]);
        assert_eq!(evicted, vec![(1, key("h1", 0))]);
        assert_eq!(p.lookup(&key("h1", 0)), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn touch_takes_a_free_cached_block_back() {
        let mut p = GroupPool::new(4, true, 16).unwrap();
        let a = p.allocate(1, noop).unwrap();
        cache_one(&mut p, a[0], "h", 16);
        p.free(&a).unwrap();
        assert!(p.is_free(1));
        p.touch(&[0, 1, 0]).unwrap();
        assert!(!p.is_free(1) && p.ref_cnt(1) == 1);
        assert_eq!(p.ref_cnt(0), 0, "the null block's count is not kept");
        p.check_invariants().unwrap();
    }

    #[test]
    fn double_free_is_refused_and_changes_nothing() {
        let mut p = GroupPool::new(4, true, 16).unwrap();
        let a = p.allocate(2, noop).unwrap();
        let before = p.free_blocks_in_order();
        assert_eq!(
            p.free(&[a[0], a[1], a[0]]),
            Err(PoolError::DoubleFree { block_id: a[0] })
        );
        assert_eq!(p.free_blocks_in_order(), before);
        assert_eq!((p.ref_cnt(a[0]), p.ref_cnt(a[1])), (1, 1));
        p.check_invariants().unwrap();
        // A block referenced twice may be listed twice.
        p.touch(&[a[0]]).unwrap();
        p.free(&[a[0], a[0]]).unwrap();
        assert!(p.is_free(a[0]));
    }

    #[test]
    fn out_of_range_and_oversized_requests_are_refused() {
        let mut p = GroupPool::new(4, true, 16).unwrap();
        assert!(matches!(p.free(&[9]), Err(PoolError::OutOfRange { .. })));
        assert!(matches!(p.touch(&[4]), Err(PoolError::OutOfRange { .. })));
        assert_eq!(
            p.allocate(4, noop),
            Err(PoolError::NotEnoughFree {
                requested: 4,
                free: 3
            })
        );
        // A huge request is refused before anything is reserved for it.
        assert!(matches!(
            p.allocate(1 << 60, noop),
            Err(PoolError::NotEnoughFree { .. })
        ));
        assert_eq!(p.num_free(), 3);
        assert!(p.check_id(-1).is_err());
        p.check_invariants().unwrap();
    }

    #[test]
    fn caching_twice_is_refused_but_promotion_is_allowed() {
        let mut p = GroupPool::new(4, true, 16).unwrap();
        let a = p.allocate(1, noop).unwrap();
        p.insert_hash(&key("partial", 0), a[0], Some(8)).unwrap();
        let mut removed = vec![];
        p.cache_full_blocks(
            &[FullBlock {
                block: a[0],
                block_hash: b"full",
                num_tokens: 16,
            }],
            0,
            |_, k| removed.push(k.to_vec()),
        )
        .unwrap();
        assert_eq!(removed, vec![key("partial", 0)]);
        assert_eq!(p.block_hash(a[0]), Some(&key("full", 0)[..]));
        let err = p.cache_full_blocks(
            &[FullBlock {
                block: a[0],
                block_hash: b"again",
                num_tokens: 16,
            }],
            0,
            noop,
        );
        assert!(matches!(err, Err(PoolError::BadState { .. })));
        assert_eq!(p.block_hash(a[0]), Some(&key("full", 0)[..]));
        p.check_invariants().unwrap();
    }

    #[test]
    fn move_hashes_repoints_every_key() {
        let mut p = GroupPool::new(4, true, 16).unwrap();
        let a = p.allocate(2, noop).unwrap();
        p.insert_hash(&key("x", 0), a[0], Some(8)).unwrap();
        p.insert_hash(&key("y", 0), a[0], Some(4)).unwrap();
        p.move_hashes(a[0], a[1]).unwrap();
        assert_eq!(p.block_hash(a[0]), None);
        assert_eq!(p.block_hash(a[1]), Some(&key("x", 0)[..]));
        assert_eq!(p.block_hash_num_tokens(a[1]), Some(8));
        assert_eq!(p.lookup(&key("y", 0)), Some(a[1]));
        assert!(
            p.move_hashes(a[0], a[1]).is_err(),
            "destination already cached"
        );
        p.check_invariants().unwrap();
    }

    #[test]
    fn unpin_puts_blocks_at_the_back() {
        let mut p = GroupPool::new(5, true, 16).unwrap();
        let a = p.allocate(2, noop).unwrap();
        let released = p.unpin(&a).unwrap();
        assert_eq!(released, a);
        assert_eq!(p.free_blocks_in_order(), vec![3, 4, 1, 2]);
        assert!(p.unpin(&[0]).is_err());
        assert!(p.unpin(&[1]).is_err(), "a free block cannot be unpinned");
        p.check_invariants().unwrap();
    }

    #[test]
    fn set_ref_cnt_only_on_held_blocks() {
        let mut p = GroupPool::new(4, true, 16).unwrap();
        let a = p.allocate(1, noop).unwrap();
        p.set_ref_cnt(a[0], 2).unwrap();
        assert_eq!(p.ref_cnt(a[0]), 2);
        assert!(p.set_ref_cnt(a[0], 0).is_err());
        assert!(p.set_ref_cnt(2, 1).is_err(), "free block");
        assert!(p.set_ref_cnt(0, 1).is_err(), "null block");
        p.check_invariants().unwrap();
    }

    #[test]
    fn reset_needs_every_block_free() {
        let mut p = GroupPool::new(4, true, 16).unwrap();
        let a = p.allocate(1, noop).unwrap();
        cache_one(&mut p, a[0], "h", 16);
        assert!(!p.reset_prefix_cache());
        p.free(&a).unwrap();
        assert!(p.reset_prefix_cache());
        assert_eq!(p.lookup(&key("h", 0)), None);
        assert_eq!(p.block_hash(a[0]), None);
        p.check_invariants().unwrap();
    }

    #[test]
    fn without_caching_freed_blocks_go_to_the_front() {
        let mut p = GroupPool::new(4, false, 16).unwrap();
        let a = p.allocate(2, noop).unwrap();
        cache_one(&mut p, a[0], "h", 16);
        p.free(&[a[0]]).unwrap();
        assert_eq!(p.free_blocks_in_order()[0], a[0]);
        // Without caching, reuse does not evict (vLLM keeps the hash, as here).
        let b = p
            .allocate(1, |_, _| panic!("no eviction without caching"))
            .unwrap();
        assert_eq!(b, vec![a[0]]);
    }

    /// A pseudo-random walk over every operation (valid and invalid calls alike) against
    /// a model of who holds which block: invariants hold after every step, failed calls
    /// change nothing, reference counts equal the model's holder counts.
    #[test]
    fn random_walk_keeps_invariants() {
        let n = 24usize;
        let mut p = GroupPool::new(n as i64, true, 16).unwrap();
        let mut holders: Vec<Vec<BlockId>> = Vec::new();
        let mut seed = 0x2545f4914f6cdd1du64;
        let mut rnd = |m: usize| {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            (seed % m.max(1) as u64) as usize
        };
        for step in 0..20_000 {
            let before = p.clone();
            let op = rnd(8);
            let res: Result<(), PoolError> = match op {
                0 => p.allocate(rnd(6), noop).map(|ids| holders.push(ids)),
                1 if !holders.is_empty() => {
                    let ids = holders.swap_remove(rnd(holders.len()));
                    let rev: Vec<BlockId> = ids.iter().rev().copied().collect();
                    p.free(&rev)
                }
                2 if !holders.is_empty() => {
                    let h = &holders[rnd(holders.len())];
                    let fb: Vec<FullBlock<'_>> = h
                        .iter()
                        .enumerate()
                        .filter(|_| rnd(2) == 0)
                        .map(|(i, &b)| FullBlock {
                            block: b,
                            block_hash: [b"h0", b"h1", b"h2", b"h3"][i % 4],
                            num_tokens: 16 * (i as u32 + 1),
                        })
                        .collect();
                    p.cache_full_blocks(&fb, 0, noop)
                }
                3 => {
                    // Touch whatever is cached under a key, like a prefix hit.
                    let k = key(["h0", "h1", "h2", "h3"][rnd(4)], 0);
                    match p.lookup(&k) {
                        Some(b) => p.touch(&[b]).map(|_| holders.push(vec![b])),
                        None => Ok(()),
                    }
                }
                4 => p.evict(rnd(n + 2) as BlockId, noop).map(|_| ()),
                5 => {
                    // Bad input: a double free of a free block or an out-of-range ID.
                    let b = rnd(n + 3) as BlockId;
                    if p.ref_cnt(b) == 0 || b as usize >= n {
                        assert!(b == NULL_BLOCK_ID || p.free(&[b]).is_err());
                        assert_eq!(p.free_blocks_in_order(), before.free_blocks_in_order());
                    }
                    Ok(())
                }
                6 => {
                    p.reset_prefix_cache();
                    Ok(())
                }
                _ => p.touch(&[NULL_BLOCK_ID]),
            };
            if res.is_err() {
                assert_eq!(p.free_blocks_in_order(), before.free_blocks_in_order());
                for b in 0..n as u32 {
                    assert_eq!(p.ref_cnt(b), before.ref_cnt(b), "step {step}");
                    assert_eq!(p.block_hash(b), before.block_hash(b), "step {step}");
                }
            }
            p.check_invariants()
                .unwrap_or_else(|e| panic!("step {step} op {op}: {e}"));
            let mut count = vec![0u32; n];
            for h in &holders {
                for &b in h {
                    count[b as usize] += 1;
                }
            }
            for b in 1..n as u32 {
                assert_eq!(p.ref_cnt(b), count[b as usize], "step {step}: block {b}");
            }
        }
    }

    #[test]
    fn per_block_bookkeeping_is_small() {
        let p = GroupPool::new(1 << 20, true, 16).unwrap();
        let per_block = p.per_block_heap_bytes() as f64 / (1 << 20) as f64;
        assert!(per_block <= 20.5, "{per_block} bytes per block");
    }
}
