//! The prefix-hash cache: which blocks hold the KV of a given prefix hash, and which
//! hashes each block is reachable from.
//!
//! Keys are vLLM's `BlockHashWithGroupId` bytes: the block hash followed by the KV-cache
//! group ID as 4 big-endian bytes. Each key is stored once, in a slot of an interner; the
//! hash table and the per-block records refer to slots by a `u32`, so a block that is not
//! cached costs 8 bytes here (its primary slot and the token count of that entry).
//!
//! A key may be held by several blocks (vLLM does not de-duplicate identical blocks, so
//! block tables stay append-only); lookups return the earliest holder still present, as
//! vLLM's insertion-ordered dict does. A block has at most one *primary* key (what vLLM
//! exposes as `block.block_hash`) and any number of extra keys (partial-block entries).

use hashbrown::HashTable;
use rustc_hash::{FxHashMap, FxHasher};
use std::hash::Hasher;

const NONE: u32 = u32::MAX;

/// The blocks holding one key, in insertion order.
#[derive(Debug, Clone)]
enum Holders {
    One(u32),
    Many(Vec<u32>),
}

impl Holders {
    fn first(&self) -> Option<u32> {
        match self {
            Holders::One(b) => Some(*b),
            Holders::Many(v) => v.first().copied(),
        }
    }

    fn contains(&self, block: u32) -> bool {
        match self {
            Holders::One(b) => *b == block,
            Holders::Many(v) => v.contains(&block),
        }
    }

    fn push(&mut self, block: u32) {
        match self {
            Holders::One(b) => *self = Holders::Many(vec![*b, block]),
            Holders::Many(v) => v.push(block),
        }
    }

    /// Remove `block`; returns (removed, now_empty).
    fn remove(&mut self, block: u32) -> (bool, bool) {
        match self {
            Holders::One(b) => {
                if *b == block {
                    (true, true)
                } else {
                    (false, false)
                }
            }
            Holders::Many(v) => match v.iter().position(|&b| b == block) {
                Some(pos) => {
                    v.remove(pos);
                    (true, v.is_empty())
                }
                None => (false, false),
            },
        }
    }

    fn iter(&self) -> impl Iterator<Item = u32> + '_ {
        let (one, many) = match self {
            Holders::One(b) => (Some(*b), &[][..]),
            Holders::Many(v) => (None, v.as_slice()),
        };
        one.into_iter().chain(many.iter().copied())
    }
}

#[derive(Debug, Clone)]
struct KeySlot {
    key: Box<[u8]>,
    holders: Holders,
}

fn hash_key(key: &[u8]) -> u64 {
    let mut h = FxHasher::default();
    h.write(key);
    h.finish()
}

/// Build a vLLM `BlockHashWithGroupId` key into `buf`.
pub fn make_key(buf: &mut Vec<u8>, block_hash: &[u8], group_id: u32) {
    buf.clear();
    buf.extend_from_slice(block_hash);
    buf.extend_from_slice(&group_id.to_be_bytes());
}

/// The group ID of a key (its last 4 bytes), if it has them.
pub fn key_group(key: &[u8]) -> Option<u32> {
    let n = key.len();
    let tail: [u8; 4] = key.get(n.checked_sub(4)?..)?.try_into().ok()?;
    Some(u32::from_be_bytes(tail))
}

#[derive(Debug, Clone)]
pub struct PrefixCache {
    slots: Vec<Option<KeySlot>>,
    free_slots: Vec<u32>,
    table: HashTable<u32>,
    /// Per block: slot of its primary key plus one; 0 for none (zeroed memory is a valid
    /// empty cache, so a new pool needs no initialisation pass).
    primary: Vec<u32>,
    /// Per block: prefix tokens covered by its primary key plus one; 0 for none/unknown.
    primary_tokens: Vec<u32>,
    /// Extra keys per block, for the few blocks that have them.
    extras: FxHashMap<u32, Vec<u32>>,
}

impl PrefixCache {
    pub fn new(num_blocks: usize) -> Self {
        PrefixCache {
            slots: Vec::new(),
            free_slots: Vec::new(),
            table: HashTable::new(),
            primary: vec![0; num_blocks],
            primary_tokens: vec![0; num_blocks],
            extras: FxHashMap::default(),
        }
    }

    /// Number of distinct keys cached.
    pub fn len(&self) -> usize {
        self.table.len()
    }

    pub fn is_empty(&self) -> bool {
        self.table.is_empty()
    }

    /// Slot of the primary key of block `b`, or NONE.
    #[inline]
    fn prim(&self, b: usize) -> u32 {
        self.primary[b].wrapping_sub(1)
    }

    fn find_slot(&self, key: &[u8]) -> Option<u32> {
        let slots = &self.slots;
        self.table
            .find(hash_key(key), |&s| {
                slots[s as usize].as_ref().is_some_and(|ks| &*ks.key == key)
            })
            .copied()
    }

    /// The slot `s`. Only slot numbers held by the table, a primary record or an extra-key
    /// list are passed here, and a slot is emptied only after its last holder is unlinked
    /// from all three (`remove_block`, `clear`), so the slot is always occupied: the
    /// `expect` documents an internal invariant, not a condition a caller can trigger.
    fn slot(&self, s: u32) -> &KeySlot {
        self.slots[s as usize]
            .as_ref()
            .expect("prefix cache slot referenced but empty")
    }

    /// The first block holding `key`.
    pub fn get_one(&self, key: &[u8]) -> Option<u32> {
        self.find_slot(key)
            .and_then(|s| self.slot(s).holders.first())
    }

    /// All blocks holding `key`, in insertion order.
    pub fn holders(&self, key: &[u8]) -> Vec<u32> {
        self.find_slot(key)
            .map(|s| self.slot(s).holders.iter().collect())
            .unwrap_or_default()
    }

    /// Whether `block` holds `key`.
    pub fn contains(&self, key: &[u8], block: u32) -> bool {
        self.find_slot(key)
            .is_some_and(|s| self.slot(s).holders.contains(block))
    }

    /// The primary key of `block`.
    pub fn primary(&self, block: u32) -> Option<&[u8]> {
        match self.primary.get(block as usize).map(|s| s.wrapping_sub(1)) {
            Some(s) if s != NONE => Some(&self.slot(s).key),
            _ => None,
        }
    }

    /// Tokens covered by the primary key of `block` (None if it has no primary key or the
    /// count was not given).
    pub fn primary_tokens(&self, block: u32) -> Option<u32> {
        match self
            .primary_tokens
            .get(block as usize)
            .map(|t| t.wrapping_sub(1))
        {
            Some(t) if t != NONE => Some(t),
            _ => None,
        }
    }

    pub fn has_primary(&self, block: u32) -> bool {
        self.primary.get(block as usize).is_some_and(|&s| s != 0)
    }

    /// Whether `block` is reachable from any key.
    pub fn is_cached(&self, block: u32) -> bool {
        self.has_primary(block) || self.extras.contains_key(&block)
    }

    /// Extra (non-primary) keys of `block`, in insertion order.
    pub fn extra_keys(&self, block: u32) -> Vec<&[u8]> {
        self.extras
            .get(&block)
            .map(|v| v.iter().map(|&s| &*self.slot(s).key).collect())
            .unwrap_or_default()
    }

    pub fn has_extras(&self, block: u32) -> bool {
        self.extras.contains_key(&block)
    }

    fn intern(&mut self, key: &[u8]) -> (u32, bool) {
        if let Some(s) = self.find_slot(key) {
            return (s, false);
        }
        let slot = KeySlot {
            key: key.into(),
            holders: Holders::Many(Vec::new()),
        };
        let s = match self.free_slots.pop() {
            Some(s) => {
                self.slots[s as usize] = Some(slot);
                s
            }
            None => {
                self.slots.push(Some(slot));
                (self.slots.len() - 1) as u32
            }
        };
        let slots = &self.slots;
        self.table.insert_unique(hash_key(key), s, |&t| {
            slots[t as usize].as_ref().map_or(0, |ks| hash_key(&ks.key))
        });
        (s, true)
    }

    fn release_slot(&mut self, s: u32) -> Box<[u8]> {
        let hash = hash_key(&self.slot(s).key);
        if let Ok(entry) = self.table.find_entry(hash, |&t| t == s) {
            entry.remove();
        }
        self.free_slots.push(s);
        self.slots[s as usize]
            .take()
            .map(|ks| ks.key)
            .unwrap_or_default()
    }

    /// Make `block` reachable from `key` (vLLM's `_insert_block_hash`): a no-op if it
    /// already is; the key becomes the primary key if the block has none, an extra key
    /// otherwise. `tokens` is recorded only with a primary key.
    pub fn insert(&mut self, key: &[u8], block: u32, tokens: Option<u32>) {
        let b = block as usize;
        let (s, fresh) = self.intern(key);
        if !fresh && (self.prim(b) == s || self.slot(s).holders.contains(block)) {
            return;
        }
        if let Some(ks) = self.slots[s as usize].as_mut() {
            match &mut ks.holders {
                Holders::Many(v) if v.is_empty() => ks.holders = Holders::One(block),
                h => h.push(block),
            }
        }
        if self.prim(b) == NONE {
            self.primary[b] = s.wrapping_add(1);
            self.primary_tokens[b] = tokens.unwrap_or(NONE).wrapping_add(1);
        } else {
            self.extras.entry(block).or_default().push(s);
        }
    }

    /// Remove every key of `block` (primary first, then extras in insertion order) and clear
    /// its primary. Keys actually unlinked are passed to `removed` (vLLM emits one
    /// `BlockRemoved` per such key). Returns how many keys were unlinked.
    pub fn remove_block(&mut self, block: u32, mut removed: impl FnMut(&[u8])) -> usize {
        let b = block as usize;
        let mut keys: Vec<u32> = Vec::new();
        if let Some(s) = self.primary.get(b).map(|s| s.wrapping_sub(1)) {
            if s != NONE {
                keys.push(s);
            }
        }
        if let Some(extra) = self.extras.remove(&block) {
            keys.extend(extra);
        }
        if keys.is_empty() {
            return 0;
        }
        let mut count = 0;
        for s in keys {
            let Some(ks) = self.slots[s as usize].as_mut() else {
                continue;
            };
            let (was_held, now_empty) = ks.holders.remove(block);
            if was_held {
                count += 1;
                removed(&ks.key);
            }
            if now_empty {
                self.release_slot(s);
            }
        }
        self.primary[b] = 0;
        self.primary_tokens[b] = 0;
        count
    }

    /// Forget every key.
    pub fn clear(&mut self) {
        self.slots.clear();
        self.free_slots.clear();
        self.table.clear();
        self.primary.fill(0);
        self.primary_tokens.fill(0);
        self.extras.clear();
    }

    /// Iterate (key, holders) over every cached key, in no particular order.
    pub fn entries(&self) -> impl Iterator<Item = (&[u8], Vec<u32>)> + '_ {
        self.slots
            .iter()
            .flatten()
            .map(|ks| (&*ks.key, ks.holders.iter().collect()))
    }

    /// Heap bytes used by the per-block records (not the keys themselves).
    pub fn per_block_heap_bytes(&self) -> usize {
        (self.primary.capacity() + self.primary_tokens.capacity()) * std::mem::size_of::<u32>()
    }

    /// Heap bytes used by keys, slots and the table (grows with cached keys).
    pub fn key_heap_bytes(&self) -> usize {
        let keys: usize = self
            .slots
            .iter()
            .flatten()
            .map(|ks| {
                ks.key.len()
                    + match &ks.holders {
                        Holders::One(_) => 0,
                        Holders::Many(v) => v.capacity() * 4,
                    }
            })
            .sum();
        keys + self.slots.capacity() * std::mem::size_of::<Option<KeySlot>>()
            + self.table.capacity() * (std::mem::size_of::<u32>() + 1)
            + self.extras.capacity() * 32
    }

    /// Check that keys and blocks agree both ways.
    pub fn check(&self) -> Result<(), String> {
        let mut live = 0usize;
        for (s, slot) in self.slots.iter().enumerate() {
            let Some(ks) = slot else { continue };
            live += 1;
            if self.find_slot(&ks.key) != Some(s as u32) {
                return Err(format!("key slot {s} is not reachable through the table"));
            }
            let holders: Vec<u32> = ks.holders.iter().collect();
            if holders.is_empty() {
                return Err(format!("key slot {s} has no holder"));
            }
            for b in holders {
                let is_primary = self.prim(b as usize) == s as u32;
                let is_extra = self.extras.get(&b).is_some_and(|v| v.contains(&(s as u32)));
                if is_primary == is_extra {
                    return Err(format!(
                        "block {b} holds key slot {s} but records it {} times",
                        if is_primary { 2 } else { 0 }
                    ));
                }
            }
        }
        if live != self.table.len() {
            return Err("table size differs from live key slots".into());
        }
        for b in 0..self.primary.len() {
            let s = self.prim(b);
            if s != NONE && !self.slot(s).holders.contains(b as u32) {
                return Err(format!("block {b} has a primary key that does not list it"));
            }
            if s == NONE && self.primary_tokens[b] != 0 {
                return Err(format!("block {b} has a token count but no primary key"));
            }
            if s == NONE && self.extras.contains_key(&(b as u32)) {
                return Err(format!("block {b} has extra keys but no primary key"));
            }
        }
        for (&b, v) in &self.extras {
            if v.is_empty() {
                return Err(format!("block {b} has an empty extra-key list"));
            }
            for &s in v {
                if !self.slot(s).holders.contains(b) {
                    return Err(format!("block {b} has an extra key that does not list it"));
                }
            }
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    fn key(h: &str, g: u32) -> Vec<u8> {
        let mut k = vec![];
        make_key(&mut k, h.as_bytes(), g);
        k
    }

    #[test]
    fn key_layout_matches_vllm() {
        let k = key("ab", 258);
        assert_eq!(k, vec![b'a', b'b', 0, 0, 1, 2]);
        assert_eq!(key_group(&k), Some(258));
        assert_eq!(key_group(b"ab"), None);
    }

    #[test]
    fn primary_then_extra_keys() {
        let mut c = PrefixCache::new(4);
        c.insert(&key("a", 0), 1, Some(16));
        c.insert(&key("b", 0), 1, Some(32));
        assert_eq!(c.primary(1), Some(&key("a", 0)[..]));
        assert_eq!(c.primary_tokens(1), Some(16));
        assert_eq!(c.extra_keys(1), vec![&key("b", 0)[..]]);
        assert_eq!(c.get_one(&key("b", 0)), Some(1));
        c.check().unwrap();
        let mut removed = vec![];
        assert_eq!(c.remove_block(1, |k| removed.push(k.to_vec())), 2);
        assert_eq!(removed, vec![key("a", 0), key("b", 0)]);
        assert!(c.is_empty());
        assert!(!c.is_cached(1));
        c.check().unwrap();
    }

    #[test]
    fn duplicate_insert_is_a_noop() {
        let mut c = PrefixCache::new(4);
        c.insert(&key("a", 0), 2, Some(16));
        c.insert(&key("a", 0), 2, Some(99));
        assert_eq!(c.primary_tokens(2), Some(16));
        assert!(c.extra_keys(2).is_empty());
        c.check().unwrap();
    }

    #[test]
    fn shared_key_returns_earliest_holder() {
        let mut c = PrefixCache::new(8);
        c.insert(&key("a", 0), 3, Some(16));
        c.insert(&key("a", 0), 5, Some(16));
        c.insert(&key("a", 0), 1, Some(16));
        assert_eq!(c.get_one(&key("a", 0)), Some(3));
        c.remove_block(3, |_| {});
        assert_eq!(c.get_one(&key("a", 0)), Some(5));
        assert_eq!(c.holders(&key("a", 0)), vec![5, 1]);
        c.insert(&key("a", 0), 3, Some(16));
        assert_eq!(c.holders(&key("a", 0)), vec![5, 1, 3]);
        c.check().unwrap();
    }

    #[test]
    fn groups_are_distinct_keys() {
        let mut c = PrefixCache::new(4);
        c.insert(&key("a", 0), 1, Some(16));
        c.insert(&key("a", 1), 2, Some(16));
        assert_eq!(c.get_one(&key("a", 0)), Some(1));
        assert_eq!(c.get_one(&key("a", 1)), Some(2));
        assert_eq!(c.get_one(&key("a", 2)), None);
        assert!(c.contains(&key("a", 1), 2) && !c.contains(&key("a", 1), 1));
    }

    #[test]
    fn slots_are_reused_after_removal() {
        let mut c = PrefixCache::new(4);
        for round in 0..100 {
            let k = key(&format!("k{round}"), 0);
            c.insert(&k, 0, Some(1));
            c.remove_block(0, |_| {});
        }
        assert!(c.slots.len() <= 1);
        c.check().unwrap();
    }

    #[test]
    fn clear_forgets_everything() {
        let mut c = PrefixCache::new(4);
        c.insert(&key("a", 0), 1, Some(16));
        c.insert(&key("b", 0), 1, None);
        c.clear();
        assert!(c.is_empty() && !c.is_cached(1) && c.get_one(&key("a", 0)).is_none());
        c.check().unwrap();
    }
}
