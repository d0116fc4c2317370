//! A set of [`GroupPool`]s, one per KV-cache group (or per group of groups that share a
//! page size). Block IDs are scoped to their pool, so every operation names the pool its
//! IDs belong to: a bare ID is never applied to several pools.

use crate::error::PoolError;
use crate::group_pool::{BlockId, GroupPool};

#[derive(Debug, Clone, Default)]
pub struct PoolSet {
    pools: Vec<GroupPool>,
}

impl PoolSet {
    /// One pool per entry of `sizes`, each with its own null block.
    pub fn new(sizes: &[usize], enable_caching: bool) -> Result<Self, PoolError> {
        let pools = sizes
            .iter()
            .map(|&n| GroupPool::new(n, enable_caching))
            .collect::<Result<Vec<_>, _>>()?;
        Ok(PoolSet { pools })
    }

    pub fn len(&self) -> usize {
        self.pools.len()
    }

    pub fn is_empty(&self) -> bool {
        self.pools.is_empty()
    }

    pub fn pool(&self, pool: usize) -> Result<&GroupPool, PoolError> {
        let num_pools = self.pools.len();
        self.pools
            .get(pool)
            .ok_or(PoolError::NoSuchPool { pool, num_pools })
    }

    pub fn pool_mut(&mut self, pool: usize) -> Result<&mut GroupPool, PoolError> {
        let num_pools = self.pools.len();
        self.pools
            .get_mut(pool)
            .ok_or(PoolError::NoSuchPool { pool, num_pools })
    }

    pub fn pools(&self) -> &[GroupPool] {
        &self.pools
    }

    /// Total free blocks over all pools.
    pub fn num_free(&self) -> usize {
        self.pools.iter().map(GroupPool::num_free).sum()
    }

    /// Evict the listed blocks of one pool from its prefix cache. All IDs are checked
    /// before any is evicted. Returns the number of keys removed.
    pub fn evict(
        &mut self,
        pool: usize,
        ids: &[BlockId],
        mut removed: impl FnMut(BlockId, &[u8]),
    ) -> Result<usize, PoolError> {
        let p = self.pool_mut(pool)?;
        for &id in ids {
            p.check_id(id as i64)?;
        }
        let mut n = 0;
        for &id in ids {
            n += p.evict(id, &mut removed)?;
        }
        Ok(n)
    }

    /// Check every pool's invariants.
    pub fn check_invariants(&self) -> Result<(), String> {
        for (i, p) in self.pools.iter().enumerate() {
            p.check_invariants().map_err(|e| format!("pool {i}: {e}"))?;
        }
        Ok(())
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::group_pool::FullBlock;

    #[test]
    fn ids_are_scoped_to_their_pool() {
        let mut set = PoolSet::new(&[4, 4], true).unwrap();
        let a = set.pool_mut(0).unwrap().allocate(1, |_, _| {}).unwrap();
        let b = set.pool_mut(1).unwrap().allocate(1, |_, _| {}).unwrap();
        assert_eq!(a, b, "both pools hand out block 1");
        for (i, id) in [(0usize, a[0]), (1, b[0])] {
            set.pool_mut(i)
                .unwrap()
                .cache_full_blocks(
                    &[FullBlock {
                        block: id,
                        block_hash: b"h",
                        num_tokens: 16,
                    }],
                    i as u32,
                    |_, _| {},
                )
                .unwrap();
        }
        // Evicting block 1 of pool 0 leaves block 1 of pool 1 cached.
        assert_eq!(set.evict(0, &[1], |_, _| {}).unwrap(), 1);
        assert!(set.pool(0).unwrap().block_hash(1).is_none());
        assert!(set.pool(1).unwrap().block_hash(1).is_some());
        assert!(matches!(
            set.evict(2, &[1], |_, _| {}),
            Err(PoolError::NoSuchPool { .. })
        ));
        assert!(set.evict(0, &[1, 7], |_, _| {}).is_err());
        set.check_invariants().unwrap();
    }
}
