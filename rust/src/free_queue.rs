//! The free-block queue: an intrusive doubly linked list threaded through two flat arrays.
//!
//! vLLM keeps its free blocks in a linked list of Python objects so that a block hit by the
//! prefix cache can be taken out of the middle in O(1). The same list here costs 8 bytes per
//! block (two `u32` links) and no allocation per operation. The order is the eviction order:
//! the front is evicted (reused) first.

/// Link value of a block that is not in the queue.
const DETACHED: u32 = u32::MAX;
/// Link value at either end of the queue (before the first block, after the last).
const END: u32 = u32::MAX - 1;

/// The largest number of blocks a queue (and so a pool) can index: two link values are reserved.
pub const MAX_BLOCKS: usize = (u32::MAX - 1) as usize;

/// Links are stored XOR-ed with their value in the initial, ID-ordered queue, so a stored 0
/// means "the neighbour by ID". A new queue is two zeroed arrays, which the allocator hands
/// out without writing them: a 1M-block pool is built in microseconds and its pages are
/// faulted in as blocks are first used.
#[derive(Debug, Clone)]
pub struct FreeQueue {
    prev: Vec<u32>,
    next: Vec<u32>,
    head: u32,
    tail: u32,
    len: usize,
}

impl FreeQueue {
    /// A queue over blocks `0..capacity`, holding all of them in ID order.
    ///
    /// # Panics
    /// If `capacity > MAX_BLOCKS`; [`crate::GroupPool::new`] checks this first.
    pub fn new_full(capacity: usize) -> Self {
        assert!(
            capacity <= MAX_BLOCKS,
            "free queue capacity {capacity} too large"
        );
        let n = capacity as u32;
        let (head, tail) = if n == 0 { (END, END) } else { (0, n - 1) };
        FreeQueue {
            prev: vec![0; capacity],
            next: vec![0; capacity],
            head,
            tail,
            len: capacity,
        }
    }

    /// The initial next link of block `i` (what a stored 0 stands for).
    #[inline]
    fn default_next(&self, i: usize) -> u32 {
        if i + 1 == self.next.len() {
            END
        } else {
            i as u32 + 1
        }
    }

    #[inline]
    fn default_prev(i: usize) -> u32 {
        if i == 0 {
            END
        } else {
            i as u32 - 1
        }
    }

    #[inline]
    fn get_next(&self, i: usize) -> u32 {
        self.next[i] ^ self.default_next(i)
    }

    #[inline]
    fn get_prev(&self, i: usize) -> u32 {
        self.prev[i] ^ Self::default_prev(i)
    }

    #[inline]
    fn set_next(&mut self, i: usize, v: u32) {
        self.next[i] = v ^ self.default_next(i);
    }

    #[inline]
    fn set_prev(&mut self, i: usize, v: u32) {
        self.prev[i] = v ^ Self::default_prev(i);
    }

    /// Number of blocks in the queue.
    #[inline]
    pub fn len(&self) -> usize {
        self.len
    }

    #[inline]
    pub fn is_empty(&self) -> bool {
        self.len == 0
    }

    /// Number of blocks the queue can index.
    #[inline]
    pub fn capacity(&self) -> usize {
        self.prev.len()
    }

    /// Whether `id` is in the queue. IDs past the capacity are not.
    #[inline]
    pub fn contains(&self, id: u32) -> bool {
        (id as usize) < self.prev.len() && self.get_prev(id as usize) != DETACHED
    }

    /// The first block (next to be reused), if any.
    #[inline]
    pub fn front(&self) -> Option<u32> {
        (self.head != END).then_some(self.head)
    }

    /// Remove and return the first block.
    pub fn pop_front(&mut self) -> Option<u32> {
        let id = self.front()?;
        self.unlink(id);
        Some(id)
    }

    /// Remove the first `n` blocks, appending them to `out` in queue order.
    /// Returns false (and changes nothing) if fewer than `n` are queued.
    pub fn pop_front_n(&mut self, n: usize, out: &mut Vec<u32>) -> bool {
        if n > self.len {
            return false;
        }
        out.reserve(n);
        let mut cur = self.head;
        for _ in 0..n {
            let i = cur as usize;
            out.push(cur);
            cur = self.get_next(i);
            self.set_prev(i, DETACHED);
            self.set_next(i, DETACHED);
        }
        self.head = cur;
        if cur == END {
            self.tail = END;
        } else {
            self.set_prev(cur as usize, END);
        }
        self.len -= n;
        true
    }

    /// Take `id` out of the queue wherever it is. Returns false if it was not queued.
    pub fn remove(&mut self, id: u32) -> bool {
        if !self.contains(id) {
            return false;
        }
        self.unlink(id);
        true
    }

    fn unlink(&mut self, id: u32) {
        let i = id as usize;
        let (p, n) = (self.get_prev(i), self.get_next(i));
        if p == END {
            self.head = n;
        } else {
            self.set_next(p as usize, n);
        }
        if n == END {
            self.tail = p;
        } else {
            self.set_prev(n as usize, p);
        }
        self.set_prev(i, DETACHED);
        self.set_next(i, DETACHED);
        self.len -= 1;
    }

    /// Put a detached block at the back (reused last).
    pub fn push_back(&mut self, id: u32) {
        debug_assert!(!self.contains(id));
        let i = id as usize;
        self.set_prev(i, self.tail);
        self.set_next(i, END);
        if self.tail == END {
            self.head = id;
        } else {
            self.set_next(self.tail as usize, id);
        }
        self.tail = id;
        self.len += 1;
    }

    /// Put a detached block at the front (reused first).
    pub fn push_front(&mut self, id: u32) {
        debug_assert!(!self.contains(id));
        let i = id as usize;
        self.set_next(i, self.head);
        self.set_prev(i, END);
        if self.head == END {
            self.tail = id;
        } else {
            self.set_prev(self.head as usize, id);
        }
        self.head = id;
        self.len += 1;
    }

    /// Append detached blocks at the back, in the given order.
    pub fn push_back_all(&mut self, ids: &[u32]) {
        for &id in ids {
            self.push_back(id);
        }
    }

    /// Put detached blocks at the front so that `ids[0]` becomes the first block and the
    /// previous front follows `ids[last]` (vLLM's `prepend_n` order).
    pub fn push_front_all(&mut self, ids: &[u32]) {
        for &id in ids.iter().rev() {
            self.push_front(id);
        }
    }

    /// The block after `id` in queue order (`None` at the back or if `id` is not queued).
    pub fn next_of(&self, id: u32) -> Option<u32> {
        if id as usize >= self.next.len() {
            return None;
        }
        match self.get_next(id as usize) {
            END | DETACHED => None,
            n => Some(n),
        }
    }

    /// The block before `id` in queue order (`None` at the front or if `id` is not queued).
    pub fn prev_of(&self, id: u32) -> Option<u32> {
        if id as usize >= self.prev.len() {
            return None;
        }
        match self.get_prev(id as usize) {
            END | DETACHED => None,
            p => Some(p),
        }
    }

    /// Iterate the queue from front to back.
    pub fn iter(&self) -> QueuedIds<'_> {
        QueuedIds {
            queue: self,
            cur: self.head,
        }
    }

    /// Bytes of heap memory the queue uses.
    pub fn heap_bytes(&self) -> usize {
        (self.prev.capacity() + self.next.capacity()) * std::mem::size_of::<u32>()
    }

    /// Check the list structure: links agree both ways and the length matches.
    pub fn check(&self) -> Result<(), String> {
        let mut count = 0usize;
        let mut prev = END;
        let mut cur = self.head;
        while cur != END {
            let i = cur as usize;
            if i >= self.prev.len() {
                return Err(format!("free queue links to block {cur} past capacity"));
            }
            if self.get_prev(i) != prev {
                return Err(format!("free queue back link of block {cur} is broken"));
            }
            count += 1;
            if count > self.len {
                return Err("free queue is longer than its length (cycle?)".into());
            }
            prev = cur;
            cur = self.get_next(i);
        }
        if prev != self.tail {
            return Err("free queue tail does not match its last block".into());
        }
        if count != self.len {
            return Err(format!(
                "free queue holds {count} blocks but records {}",
                self.len
            ));
        }
        let detached = (0..self.prev.len())
            .filter(|&i| self.get_prev(i) == DETACHED)
            .count();
        if detached + count != self.prev.len() {
            return Err("free queue detached count does not add up".into());
        }
        Ok(())
    }
}

/// The IDs in a queue, front to back (a borrow: the queue cannot change meanwhile).
pub struct QueuedIds<'a> {
    queue: &'a FreeQueue,
    cur: u32,
}

impl Iterator for QueuedIds<'_> {
    type Item = u32;

    fn next(&mut self) -> Option<u32> {
        if self.cur == END {
            return None;
        }
        let id = self.cur;
        self.cur = self.queue.get_next(id as usize);
        Some(id)
    }
}

/// A position in a queue that may change between steps (vLLM's
/// `free_block_queue.iter_blocks_after(cursor)`, used while the pool keeps working): each
/// step follows the queue as it is at that moment.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum QueueCursor {
    /// Before the first block.
    Front,
    /// After this block.
    After(u32),
    /// Past the end (stays there, as Python iterators do once exhausted).
    Done,
}

impl QueueCursor {
    /// Move to the next block and return it. A cursor whose block has left the queue has
    /// no next block.
    pub fn advance(&mut self, queue: &FreeQueue) -> Option<u32> {
        let next = match *self {
            QueueCursor::Front => queue.front(),
            QueueCursor::After(id) => queue.next_of(id),
            QueueCursor::Done => None,
        };
        *self = next.map_or(QueueCursor::Done, QueueCursor::After);
        next
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn order(q: &FreeQueue) -> Vec<u32> {
        q.iter().collect()
    }

    #[test]
    fn starts_full_in_id_order() {
        let q = FreeQueue::new_full(5);
        assert_eq!(order(&q), vec![0, 1, 2, 3, 4]);
        assert_eq!(q.len(), 5);
        q.check().unwrap();
    }

    #[test]
    fn empty_queue() {
        let mut q = FreeQueue::new_full(0);
        assert!(q.is_empty());
        assert_eq!(q.pop_front(), None);
        let mut out = vec![];
        assert!(q.pop_front_n(0, &mut out));
        assert!(!q.pop_front_n(1, &mut out));
        q.check().unwrap();
    }

    #[test]
    fn pop_front_n_takes_the_front() {
        let mut q = FreeQueue::new_full(6);
        let mut out = vec![];
        assert!(q.pop_front_n(4, &mut out));
        assert_eq!(out, vec![0, 1, 2, 3]);
        assert_eq!(order(&q), vec![4, 5]);
        assert!(
            !q.pop_front_n(3, &mut out),
            "asking for too many changes nothing"
        );
        assert_eq!(order(&q), vec![4, 5]);
        assert!(q.pop_front_n(2, &mut out));
        assert!(q.is_empty());
        q.check().unwrap();
    }

    #[test]
    fn remove_from_middle_front_and_back() {
        let mut q = FreeQueue::new_full(5);
        assert!(q.remove(2));
        assert!(!q.remove(2), "a detached block cannot be removed twice");
        assert!(q.remove(0));
        assert!(q.remove(4));
        assert_eq!(order(&q), vec![1, 3]);
        assert!(!q.contains(0) && q.contains(1));
        assert!(!q.remove(99), "out of range is not queued");
        q.check().unwrap();
    }

    #[test]
    fn push_front_all_keeps_vllm_prepend_order() {
        let mut q = FreeQueue::new_full(6);
        let mut out = vec![];
        q.pop_front_n(3, &mut out);
        q.push_front_all(&[2, 0, 1]);
        assert_eq!(order(&q), vec![2, 0, 1, 3, 4, 5]);
        q.check().unwrap();
    }

    #[test]
    fn push_back_all_appends_in_order() {
        let mut q = FreeQueue::new_full(4);
        let mut out = vec![];
        q.pop_front_n(4, &mut out);
        q.push_back_all(&[3, 1]);
        q.push_back(0);
        assert_eq!(order(&q), vec![3, 1, 0]);
        assert_eq!(q.next_of(3), Some(1));
        assert_eq!(q.prev_of(3), None);
        assert_eq!(q.next_of(0), None);
        assert_eq!(q.next_of(2), None, "detached block has no neighbours");
        q.check().unwrap();
    }

    #[test]
    fn matches_a_vecdeque_model() {
        // A deterministic pseudo-random walk compared against a simple Vec model.
        let n = 64u32;
        let mut q = FreeQueue::new_full(n as usize);
        let mut model: Vec<u32> = (0..n).collect();
        let mut held: Vec<u32> = vec![];
        let mut seed = 0x9e3779b97f4a7c15u64;
        for _ in 0..5000 {
            seed ^= seed << 13;
            seed ^= seed >> 7;
            seed ^= seed << 17;
            match seed % 5 {
                0 if !model.is_empty() => {
                    let k = (seed >> 8) as usize % (model.len().min(4) + 1);
                    let mut out = vec![];
                    assert!(q.pop_front_n(k, &mut out));
                    let expect: Vec<u32> = model.drain(..k).collect();
                    assert_eq!(out, expect);
                    held.extend(out);
                }
                1 if !held.is_empty() => {
                    let id = held.swap_remove((seed >> 8) as usize % held.len());
                    q.push_back(id);
                    model.push(id);
                }
                2 if !held.is_empty() => {
                    let id = held.swap_remove((seed >> 8) as usize % held.len());
                    q.push_front(id);
                    model.insert(0, id);
                }
                3 if !model.is_empty() => {
                    let pos = (seed >> 8) as usize % model.len();
                    let id = model.remove(pos);
                    assert!(q.remove(id));
                    held.push(id);
                }
                _ => {}
            }
            assert_eq!(q.len(), model.len());
        }
        assert_eq!(order(&q), model);
        q.check().unwrap();
    }

    #[test]
    fn cursor_follows_the_queue_as_it_changes() {
        let mut q = FreeQueue::new_full(5);
        let mut c = QueueCursor::Front;
        assert_eq!(c.advance(&q), Some(0));
        assert_eq!(c.advance(&q), Some(1));
        q.remove(2);
        assert_eq!(c.advance(&q), Some(3));
        q.push_back(2);
        assert_eq!(c.advance(&q), Some(4));
        assert_eq!(c.advance(&q), Some(2));
        assert_eq!(c.advance(&q), None);
        q.remove(0);
        q.push_back(0);
        assert_eq!(c.advance(&q), None, "an exhausted cursor stays exhausted");
        let mut detached = QueueCursor::After(1);
        q.remove(1);
        assert_eq!(detached.advance(&q), None);
        assert_eq!(detached, QueueCursor::Done);
    }
}
