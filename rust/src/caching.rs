//! Request-level prefix caching: the rules vLLM applies between a request's block hashes
//! and the pool's cache, built on [`GroupPool`]'s primitives.
//!
//! * lookups: one hash in several KV-cache groups, and the longest cached prefix of a
//!   request over several groups;
//! * caching a span of a request's full blocks (null and masked-out blocks skipped);
//! * partial entries: making a block reachable from a prefix boundary inside it, with
//!   promotion of a shorter entry.
//!
//! Hashes and blocks are read through the caller (a Python list, say) one position at a
//! time, so that nothing is converted that the rule does not look at; a read that fails
//! is returned as [`OpError::Input`], and nothing has changed then.

use crate::error::{OpError, PoolError};
use crate::group_pool::{BlockId, FullBlock, GroupPool, NULL_BLOCK_ID};
use crate::prefix_cache::make_key;

/// A request's block hashes as the caller holds them, read by position.
pub trait HashSource {
    type Hash: AsRef<[u8]>;
    type Error;
    fn num_hashes(&self) -> Result<usize, Self::Error>;
    fn hash_at(&self, index: usize) -> Result<Self::Hash, Self::Error>;
}

impl<T: AsRef<[u8]>> HashSource for [T] {
    type Hash = Vec<u8>;
    type Error = std::convert::Infallible;

    fn num_hashes(&self) -> Result<usize, Self::Error> {
        Ok(self.len())
    }

    /// Past the end: an empty hash (slices are only used by tests, which stay in range).
    fn hash_at(&self, index: usize) -> Result<Vec<u8>, Self::Error> {
        Ok(self
            .get(index)
            .map(|h| h.as_ref().to_vec())
            .unwrap_or_default())
    }
}

/// The span of `cache_full_blocks`: blocks `num_cached..num_full` of a request, each
/// covering `block_size` tokens, cached in KV-cache group `group_id`. Values are as the
/// caller has them; [`GroupPool::cache_span`] checks them.
#[derive(Debug, Clone, Copy)]
pub struct Span {
    pub num_cached: i64,
    pub num_full: i64,
    pub block_size: i64,
    pub group_id: u32,
}

/// A partial entry for `cache_partial_block`: make `block` reachable from the request's
/// prefix hash at `num_tokens` (a hash boundary inside the block) in group `group_id`.
#[derive(Debug, Clone, Copy)]
pub struct PartialEntry {
    pub block: BlockId,
    pub num_tokens: i64,
    pub group_id: u32,
    pub block_size: i64,
    /// The block's contents were replaced: drop every key it has first.
    pub replace_existing: bool,
}

/// What [`GroupPool::cache_partial`] did.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct PartialCached {
    /// The key the block is now reachable from (`BlockHashWithGroupId` bytes).
    pub key: Vec<u8>,
    /// Whether the entry is new (vLLM then emits a `BlockStored` event for it).
    pub newly_cached: bool,
}

/// A `get_cached_block` lookup in progress: the first block cached under one hash in each
/// group given, or nothing as soon as one group misses. The caller reads the group IDs
/// (a Python list, say) and hands them over one at a time.
#[derive(Debug)]
pub struct GroupHits<'a> {
    pool: &'a GroupPool,
    block_hash: &'a [u8],
    key: Vec<u8>,
    found: Vec<BlockId>,
    missed: bool,
}

impl GroupHits<'_> {
    /// Look the hash up in group `group_id`. Returns whether more groups are worth
    /// reading: after a miss the answer is `None` whatever follows.
    #[inline]
    pub fn group(&mut self, group_id: u32) -> bool {
        if self.missed {
            return false;
        }
        make_key(&mut self.key, self.block_hash, group_id);
        match self.pool.lookup(&self.key) {
            Some(id) => self.found.push(id),
            None => self.missed = true,
        }
        !self.missed
    }

    /// The blocks found, one per group in order, or `None` if any group missed.
    #[inline]
    pub fn finish(self) -> Option<Vec<BlockId>> {
        (!self.missed).then_some(self.found)
    }
}

impl GroupPool {
    /// vLLM's `get_cached_block` for `block_hash`: feed the groups to the returned
    /// [`GroupHits`] in order, then [`finish`](GroupHits::finish) it.
    #[inline]
    pub fn cached_block<'a>(&'a self, block_hash: &'a [u8]) -> GroupHits<'a> {
        GroupHits {
            pool: self,
            block_hash,
            key: Vec::with_capacity(block_hash.len() + 4),
            found: Vec::with_capacity(4),
            missed: false,
        }
    }

    /// The longest cached prefix of `block_hashes` (at most `max_blocks` hashes): walk
    /// from the first hash and stop at the first one that misses in any of `group_ids`.
    /// Returns one list of blocks per group, all of the same length. Hashes past the stop
    /// are not read.
    pub fn cached_prefix<H: AsRef<[u8]>, E>(
        &self,
        block_hashes: impl IntoIterator<Item = Result<H, E>>,
        group_ids: &[u32],
        max_blocks: usize,
    ) -> Result<Vec<Vec<BlockId>>, E> {
        let mut found: Vec<Vec<BlockId>> = vec![Vec::new(); group_ids.len()];
        let mut key = Vec::new();
        let mut row: Vec<BlockId> = Vec::with_capacity(group_ids.len());
        let mut hashes = block_hashes.into_iter();
        let mut count = 0usize;
        'walk: while count < max_blocks {
            let Some(hash) = hashes.next() else { break };
            let hash = hash?;
            // A hash counts only if every group has it: look all up before keeping any.
            row.clear();
            for &gid in group_ids {
                make_key(&mut key, hash.as_ref(), gid);
                match self.lookup(&key) {
                    Some(id) => row.push(id),
                    None => break 'walk,
                }
            }
            for (list, &id) in found.iter_mut().zip(&row) {
                list.push(id);
            }
            count += 1;
        }
        Ok(found)
    }

    /// vLLM's `cache_full_blocks` for one group: cache each block of `span` that is
    /// neither the null block nor masked out (`mask[k]` false for `num_cached + k`) under
    /// the hash at its position, covering the tokens up to its end. `block_at(i)` and
    /// `hashes` read the request's blocks and block-size hashes; hashes are read only for
    /// the blocks cached. A block that already has a shorter (partial) entry is promoted:
    /// its old keys go to `removed`.
    ///
    /// Returns the positions cached, in order (what the `BlockStored` event lists), or
    /// `None` when the span is empty. Every block is checked before any is cached.
    #[inline]
    pub fn cache_span<H: HashSource + ?Sized>(
        &mut self,
        span: Span,
        mask: Option<&[bool]>,
        mut block_at: impl FnMut(usize) -> Result<BlockId, H::Error>,
        hashes: &H,
        removed: impl FnMut(BlockId, &[u8]),
    ) -> Result<Option<Vec<usize>>, OpError<H::Error>> {
        if span.num_cached >= span.num_full {
            return Ok(None);
        }
        let invalid = |what: String| {
            OpError::Pool(PoolError::InvalidArgument(format!(
                "cache_full_blocks: {what}"
            )))
        };
        if span.num_cached < 0 || span.block_size <= 0 {
            return Err(invalid(format!(
                "invalid num_cached_blocks={} or block_size={}",
                span.num_cached, span.block_size
            )));
        }
        let (first, len) = (
            span.num_cached as usize,
            (span.num_full - span.num_cached) as usize,
        );
        if let Some(m) = mask {
            if m.len() != len {
                return Err(invalid(format!(
                    "block_mask has {} entries for {len} blocks",
                    m.len()
                )));
            }
        }
        // Gather (block, hash, tokens) first; nothing changes until all are valid. The span
        // comes from the caller (it may be junk): reserve for a bounded part of it.
        let expect = len.min(4096);
        let mut positions: Vec<usize> = Vec::with_capacity(expect);
        let mut picked: Vec<(BlockId, usize, usize, u32)> = Vec::with_capacity(expect);
        let mut arena: Vec<u8> = Vec::with_capacity(expect * 32);
        for k in 0..len {
            let i = first + k;
            let id = block_at(i).map_err(OpError::Input)?;
            self.check_id(id as i64)?;
            if id == NULL_BLOCK_ID || mask.is_some_and(|m| !m[k]) {
                continue;
            }
            let hash = hashes.hash_at(i).map_err(OpError::Input)?;
            let start = arena.len();
            arena.extend_from_slice(hash.as_ref());
            let tokens = (i as i64 + 1)
                .checked_mul(span.block_size)
                .and_then(|t| u32::try_from(t).ok())
                .ok_or_else(|| invalid(format!("block {i} ends past 2^32 tokens")))?;
            positions.push(i);
            picked.push((id, start, arena.len(), tokens));
        }
        let blocks: Vec<FullBlock<'_>> = picked
            .iter()
            .map(|&(block, s, e, num_tokens)| FullBlock {
                block,
                block_hash: &arena[s..e],
                num_tokens,
            })
            .collect();
        self.cache_full_blocks(&blocks, span.group_id, removed)?;
        Ok(Some(positions))
    }

    /// vLLM's `cache_partial_block`: make `entry.block` reachable from the request hash at
    /// `entry.num_tokens` (hashes are chained, so the hash at a boundary fingerprints the
    /// whole prefix). The null block is passed over (`None`). The block's existing keys
    /// are dropped first (to `removed`) when its contents were replaced, or when its
    /// primary entry covers fewer tokens than the new one (promotion).
    pub fn cache_partial<H: HashSource + ?Sized>(
        &mut self,
        entry: PartialEntry,
        hashes: &H,
        mut removed: impl FnMut(BlockId, &[u8]),
    ) -> Result<Option<PartialCached>, OpError<H::Error>> {
        let id = entry.block;
        self.check_id(id as i64)?;
        if id == NULL_BLOCK_ID {
            return Ok(None);
        }
        let hbs = i64::from(self.hash_block_size());
        let num_tokens = match u32::try_from(entry.num_tokens) {
            Ok(t) if t > 0 && entry.num_tokens % hbs == 0 && entry.block_size % hbs == 0 => t,
            _ => {
                return Err(PoolError::InvalidArgument(format!(
                    "cache_partial_block: num_tokens={} and block_size={} must be positive \
                     multiples of hash_block_size={hbs}",
                    entry.num_tokens, entry.block_size
                ))
                .into())
            }
        };
        let needed = (entry.num_tokens / hbs) as usize;
        let available = hashes.num_hashes().map_err(OpError::Input)?;
        if needed > available {
            return Err(PoolError::InvalidArgument(format!(
                "cache_partial_block: block {id}: request has {available} block hashes, \
                 {needed} needed"
            ))
            .into());
        }
        let hash = hashes.hash_at(needed - 1).map_err(OpError::Input)?;
        let mut key = Vec::new();
        make_key(&mut key, hash.as_ref(), entry.group_id);
        let cache = self.cache();
        let mut newly_cached = !(cache.primary(id) == Some(&key[..]) || cache.contains(&key, id));
        let promoted = newly_cached && self.promotes(id, num_tokens);
        if entry.replace_existing || promoted {
            self.evict(id, &mut removed)?;
            newly_cached = true;
        }
        self.insert_hash(&key, id, Some(num_tokens))?;
        Ok(Some(PartialCached { key, newly_cached }))
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use std::convert::Infallible;

    fn noop(_: BlockId, _: &[u8]) {}

    fn key(h: &[u8], g: u32) -> Vec<u8> {
        let mut k = vec![];
        make_key(&mut k, h, g);
        k
    }

    fn hashes(n: usize) -> Vec<Vec<u8>> {
        (0..n).map(|i| format!("h{i}").into_bytes()).collect()
    }

    fn ok<T>(v: impl IntoIterator<Item = T>) -> impl Iterator<Item = Result<T, Infallible>> {
        v.into_iter().map(Ok)
    }

    fn span(num_cached: i64, num_full: i64, block_size: i64) -> Span {
        Span {
            num_cached,
            num_full,
            block_size,
            group_id: 0,
        }
    }

    /// Cache `blocks` (block i at position i) in `group` under `hs`.
    fn cache_all(p: &mut GroupPool, blocks: &[BlockId], hs: &[Vec<u8>], group: u32) {
        let s = Span {
            group_id: group,
            ..span(0, blocks.len() as i64, 4)
        };
        p.cache_span(s, None, |i| Ok(blocks[i]), hs, noop).unwrap();
    }

    #[test]
    fn cached_block_needs_every_group() {
        let mut p = GroupPool::new(8, true, 4).unwrap();
        let a = p.allocate(2, noop).unwrap();
        let hs = hashes(1);
        cache_all(&mut p, &a[..1], &hs, 0);
        cache_all(&mut p, &a[1..], &hs, 2);
        let lookup = |hash: &[u8], groups: &[u32]| {
            let mut hits = p.cached_block(hash);
            let read = groups.iter().take_while(|&&g| hits.group(g)).count();
            (hits.finish(), read)
        };
        assert_eq!(lookup(b"h0", &[0, 2]), (Some(vec![a[0], a[1]]), 2));
        // Groups after the first miss need not be read.
        assert_eq!(lookup(b"h0", &[0, 1, 2]), (None, 1));
        assert_eq!(lookup(b"h1", &[0]), (None, 0));
        assert_eq!(lookup(b"h0", &[]), (Some(vec![]), 0));
        let mut hits = p.cached_block(b"h0");
        assert!(!hits.group(1) && !hits.group(0), "a miss is final");
        assert_eq!(hits.finish(), None);
    }

    #[test]
    fn cached_prefix_stops_at_the_first_miss_in_any_group_and_at_max_blocks() {
        let mut p = GroupPool::new(16, true, 4).unwrap();
        let hs = hashes(5);
        let g0 = p.allocate(5, noop).unwrap();
        let g1 = p.allocate(3, noop).unwrap();
        cache_all(&mut p, &g0, &hs, 0);
        cache_all(&mut p, &g1, &hs[..3], 1);
        let walk = |groups: &[u32], max| p.cached_prefix(ok(hs.iter()), groups, max).unwrap();
        assert_eq!(walk(&[0], 9), vec![g0.clone()]);
        assert_eq!(walk(&[0, 1], 9), vec![g0[..3].to_vec(), g1.clone()]);
        assert_eq!(walk(&[1, 0], 2), vec![g1[..2].to_vec(), g0[..2].to_vec()]);
        assert_eq!(walk(&[0], 0), vec![Vec::<BlockId>::new()]);
        assert_eq!(walk(&[], 3), Vec::<Vec<BlockId>>::new());
        // Hashes past the stop (a miss or the limit) are never read.
        let unreadable = |n| {
            hs.iter()
                .take(n)
                .map(Ok)
                .chain(std::iter::once(Err("unread")))
        };
        assert_eq!(
            p.cached_prefix(unreadable(4), &[0, 1], 9),
            Ok(vec![g0[..3].to_vec(), g1.clone()])
        );
        assert_eq!(
            p.cached_prefix(unreadable(2), &[0], 2),
            Ok(vec![g0[..2].to_vec()])
        );
        assert_eq!(p.cached_prefix(unreadable(1), &[0], 5), Err("unread"));
    }

    #[test]
    fn cache_span_skips_null_and_masked_blocks_and_reports_what_it_cached() {
        let mut p = GroupPool::new(8, true, 4).unwrap();
        let a = p.allocate(4, noop).unwrap();
        let blocks = [a[0], NULL_BLOCK_ID, a[1], a[2], a[3]];
        let hs = hashes(5);
        let got = p.cache_span(
            span(1, 5, 8),
            Some(&[true, true, false, true]),
            |i| Ok(blocks[i]),
            &hs[..],
            noop,
        );
        assert_eq!(got, Ok(Some(vec![2, 4])));
        assert_eq!(p.block_hash(a[1]), Some(&key(b"h2", 0)[..]));
        assert_eq!(p.block_hash_num_tokens(a[1]), Some(24));
        assert_eq!(p.block_hash(a[2]), None, "masked out");
        assert_eq!(p.block_hash_num_tokens(a[3]), Some(40));
        // Only the hashes of cached positions are read; an empty span reads nothing.
        struct Logged<'a>(&'a [Vec<u8>], std::cell::RefCell<Vec<usize>>);
        impl HashSource for Logged<'_> {
            type Hash = Vec<u8>;
            type Error = Infallible;
            fn num_hashes(&self) -> Result<usize, Infallible> {
                Ok(self.0.len())
            }
            fn hash_at(&self, i: usize) -> Result<Vec<u8>, Infallible> {
                self.1.borrow_mut().push(i);
                Ok(self.0[i].clone())
            }
        }
        let logged = Logged(&hs, Default::default());
        let got = p.cache_span(
            span(0, 1, 8),
            Some(&[false]),
            |i| Ok(blocks[i]),
            &logged,
            noop,
        );
        assert_eq!(got, Ok(Some(vec![])));
        let got = p.cache_span(span(3, 3, 8), None, |_| unreachable!(), &logged, noop);
        assert_eq!(got, Ok(None));
        assert!(logged.1.borrow().is_empty());
        p.check_invariants().unwrap();
    }

    #[test]
    fn cache_span_refuses_bad_input_and_changes_nothing() {
        let mut p = GroupPool::new(8, true, 4).unwrap();
        let a = p.allocate(3, noop).unwrap();
        let hs = hashes(3);
        let before = p.clone();
        let same = |p: &GroupPool| {
            (1..8).all(|b| p.block_hash(b) == before.block_hash(b))
                && p.cache().len() == before.cache().len()
        };
        let at = |i: usize| Ok(a[i]);
        let bad = [
            p.cache_span(span(0, 2, 4), Some(&[true]), at, &hs[..], noop),
            p.cache_span(span(-1, 2, 4), None, at, &hs[..], noop),
            p.cache_span(span(0, 2, 0), None, at, &hs[..], noop),
            p.cache_span(span(0, 2, 1 << 31), None, at, &hs[..], noop),
            p.cache_span(span(0, 2, 4), None, |i| Ok([a[0], 99][i]), &hs[..], noop),
        ];
        for r in bad {
            assert!(matches!(r, Err(OpError::Pool(_))), "{r:?}");
            assert!(same(&p));
        }
        // A caller's read failing part-way through changes nothing either.
        let r = p.cache_span(
            span(0, 3, 4),
            None,
            |i| if i < 2 { Ok(a[i]) } else { Err(()) },
            &Failing(&hs),
            noop,
        );
        assert_eq!(r, Err(OpError::Input(())));
        assert!(same(&p));
        // Caching the same full blocks twice is refused as a whole.
        p.cache_span(span(1, 2, 4), None, at, &hs[..], noop)
            .unwrap();
        let r = p.cache_span(span(0, 2, 4), None, at, &hs[..], noop);
        assert!(matches!(r, Err(OpError::Pool(PoolError::BadState { .. }))));
        assert_eq!(p.block_hash(a[0]), None);
        p.check_invariants().unwrap();
    }

    struct Failing<'a>(&'a [Vec<u8>]);
    impl HashSource for Failing<'_> {
        type Hash = Vec<u8>;
        type Error = ();
        fn num_hashes(&self) -> Result<usize, ()> {
            Err(())
        }
        fn hash_at(&self, i: usize) -> Result<Vec<u8>, ()> {
            Ok(self.0[i].clone())
        }
    }

    fn partial(block: BlockId, num_tokens: i64, replace_existing: bool) -> PartialEntry {
        PartialEntry {
            block,
            num_tokens,
            group_id: 0,
            block_size: 16,
            replace_existing,
        }
    }

    #[test]
    fn partial_entries_are_added_promoted_and_replaced() {
        let mut p = GroupPool::new(4, true, 4).unwrap();
        let b = p.allocate(1, noop).unwrap()[0];
        let hs = hashes(8);
        let mut removed = Vec::new();
        let cache = |p: &mut GroupPool, e, removed: &mut Vec<Vec<u8>>| {
            p.cache_partial(e, &hs[..], |_, k| removed.push(k.to_vec()))
                .unwrap()
                .unwrap()
        };
        // First entry: becomes the primary key, covering 4 tokens (hash 0).
        let got = cache(&mut p, partial(b, 4, false), &mut removed);
        assert_eq!(
            got,
            PartialCached {
                key: key(b"h0", 0),
                newly_cached: true
            }
        );
        assert_eq!(p.block_hash_num_tokens(b), Some(4));
        // The same entry again: nothing new.
        let got = cache(&mut p, partial(b, 4, false), &mut removed);
        assert!(!got.newly_cached);
        // A longer entry promotes: the shorter key goes, the longer becomes primary.
        let got = cache(&mut p, partial(b, 12, false), &mut removed);
        assert_eq!(
            got,
            PartialCached {
                key: key(b"h2", 0),
                newly_cached: true
            }
        );
        assert_eq!(removed, vec![key(b"h0", 0)]);
        assert_eq!(p.block_hash_num_tokens(b), Some(12));
        // A shorter entry is added as an extra key, the primary stays.
        let got = cache(&mut p, partial(b, 8, false), &mut removed);
        assert!(got.newly_cached);
        assert_eq!(p.cache().extra_keys(b), vec![&key(b"h1", 0)[..]]);
        assert_eq!(p.block_hash(b), Some(&key(b"h2", 0)[..]));
        // Replacing drops every key, even for an entry the block already has.
        removed.clear();
        let got = cache(&mut p, partial(b, 12, true), &mut removed);
        assert!(got.newly_cached);
        assert_eq!(removed, vec![key(b"h2", 0), key(b"h1", 0)]);
        assert_eq!(p.cache().len(), 1);
        // A full-block span then promotes the partial entry.
        let s = span(0, 1, 16);
        let r = p.cache_span(
            s,
            None,
            |_| Ok(b),
            &hs[3..],
            |_, k| removed.push(k.to_vec()),
        );
        assert_eq!(r, Ok(Some(vec![0])));
        assert_eq!(p.block_hash_num_tokens(b), Some(16));
        p.check_invariants().unwrap();
    }

    #[test]
    fn partial_entries_refuse_bad_input_and_pass_over_the_null_block() {
        let mut p = GroupPool::new(4, true, 4).unwrap();
        let b = p.allocate(1, noop).unwrap()[0];
        let hs = hashes(2);
        assert_eq!(
            p.cache_partial(partial(0, 4, false), &hs[..], noop),
            Ok(None)
        );
        let bad = [
            partial(b, 0, false),
            partial(b, 6, false),
            partial(b, -4, false),
            PartialEntry {
                block_size: 6,
                ..partial(b, 4, false)
            },
            partial(b, 12, false),
            partial(b, 1 << 40, false),
            partial(9, 4, false),
        ];
        for e in bad {
            let r = p.cache_partial(e, &hs[..], noop);
            assert!(matches!(r, Err(OpError::Pool(_))), "{e:?}: {r:?}");
        }
        assert_eq!(
            p.cache_partial(partial(b, 4, false), &Failing(&hs), noop),
            Err(OpError::Input(()))
        );
        assert!(p.cache().is_empty());
        p.check_invariants().unwrap();
    }
}
