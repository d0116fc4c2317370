//! Reuse watchers: who wants to know when a block released by `unpin_blocks` is handed out
//! again (its contents stay readable until then).
//!
//! A block has at most one watcher; watching it again replaces the watcher but keeps the
//! block's place in the order, as vLLM's insertion-ordered dict does. The watcher type `W`
//! is the caller's (the binding stores Python callables): the core only decides which
//! watchers fire, and in which order.

use crate::group_pool::BlockId;
use rustc_hash::FxHashMap;

#[derive(Debug, Clone)]
pub struct ReuseWatchers<W> {
    next_seq: u64,
    /// Per watched block: the order it was first watched in, and its watcher.
    by_block: FxHashMap<BlockId, (u64, W)>,
}

impl<W> Default for ReuseWatchers<W> {
    fn default() -> Self {
        ReuseWatchers {
            next_seq: 0,
            by_block: FxHashMap::default(),
        }
    }
}

impl<W> ReuseWatchers<W> {
    pub fn is_empty(&self) -> bool {
        self.by_block.is_empty()
    }

    pub fn len(&self) -> usize {
        self.by_block.len()
    }

    /// Watch every listed block with a watcher made by `make` (one per block).
    pub fn watch(&mut self, ids: &[BlockId], mut make: impl FnMut() -> W) {
        for &id in ids {
            let seq = match self.by_block.get(&id) {
                Some((seq, _)) => *seq,
                None => {
                    self.next_seq += 1;
                    self.next_seq
                }
            };
            self.by_block.insert(id, (seq, make()));
        }
    }

    /// Remove and return the watchers of the listed blocks that have one, in list order:
    /// blocks handed out in one call are reported in the order they are handed out.
    pub fn take_listed(&mut self, ids: &[BlockId]) -> Vec<(BlockId, W)> {
        if self.by_block.is_empty() {
            return Vec::new();
        }
        ids.iter()
            .filter_map(|&id| self.by_block.remove(&id).map(|(_, w)| (id, w)))
            .collect()
    }

    /// Remove and return every watcher, in the order the blocks were first watched (a
    /// prefix-cache reset tells all of them).
    pub fn take_all(&mut self) -> Vec<(BlockId, W)> {
        let mut all: Vec<(u64, BlockId, W)> = self
            .by_block
            .drain()
            .map(|(id, (seq, w))| (seq, id, w))
            .collect();
        all.sort_unstable_by_key(|&(seq, _, _)| seq);
        all.into_iter().map(|(_, id, w)| (id, w)).collect()
    }

    /// Every watcher, in no particular order (for the binding's GC traversal).
    pub fn iter(&self) -> impl Iterator<Item = &W> + '_ {
        self.by_block.values().map(|(_, w)| w)
    }

    pub fn clear(&mut self) {
        self.by_block.clear();
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn handout_order_is_list_order_and_each_watcher_fires_once() {
        let mut w = ReuseWatchers::default();
        w.watch(&[5, 2], || "first");
        w.watch(&[9], || "second");
        assert_eq!(w.take_listed(&[9, 7, 5]), vec![(9, "second"), (5, "first")]);
        assert_eq!(w.take_listed(&[9, 5]), vec![]);
        assert_eq!(w.len(), 1);
    }

    #[test]
    fn reset_order_is_first_watched_order_and_rewatching_keeps_the_place() {
        let mut w = ReuseWatchers::default();
        w.watch(&[3, 1, 2], || 'a');
        w.watch(&[3], || 'b');
        w.watch(&[0], || 'c');
        assert_eq!(w.take_all(), vec![(3, 'b'), (1, 'a'), (2, 'a'), (0, 'c')]);
        assert!(w.is_empty());
        // A block watched again after it fired goes to the end of the order.
        w.watch(&[1, 2], || 'd');
        w.take_listed(&[1]);
        w.watch(&[1], || 'e');
        assert_eq!(w.take_all(), vec![(2, 'd'), (1, 'e')]);
    }

    #[test]
    fn one_watcher_is_made_per_block() {
        let mut made = 0;
        let mut w = ReuseWatchers::default();
        w.watch(&[1, 2, 1], || {
            made += 1;
            made
        });
        assert_eq!(made, 3);
        assert_eq!(w.take_all(), vec![(1, 3), (2, 2)]);
        assert_eq!(w.iter().count(), 0);
    }
}
