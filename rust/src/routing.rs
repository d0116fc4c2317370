//! Which pool a block belongs to.
//!
//! Block IDs are scoped to their pool, so a block is named by the pool it belongs to and
//! its ID there. The core does not know how a caller identifies pools: it takes a *pool
//! token* of any type that can be compared (the binding uses the identity of the pool
//! object), and decides from tokens alone whether a block may be used here and where each
//! block of a mixed list goes.

use crate::error::{OpError, PoolError};
use crate::group_pool::BlockId;

/// A block as a caller names it: its pool's token and its ID in that pool.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct BlockRef<T> {
    pub pool: T,
    pub id: BlockId,
}

/// The ID of `block` if it belongs to the pool `this`; operations that change or read one
/// pool refuse other pools' blocks (`op` names the operation in the error).
#[inline]
pub fn own_id<T: PartialEq>(
    this: &T,
    op: &'static str,
    block: BlockRef<T>,
) -> Result<BlockId, PoolError> {
    if block.pool == *this {
        Ok(block.id)
    } else {
        Err(PoolError::ForeignBlock {
            block_id: block.id,
            op,
        })
    }
}

/// The IDs of `blocks`, which must all belong to the pool `this`. Stops at the first block
/// that cannot be read or belongs elsewhere.
#[inline]
pub fn own_ids<T: PartialEq, E>(
    this: &T,
    op: &'static str,
    blocks: impl IntoIterator<Item = Result<BlockRef<T>, E>>,
) -> Result<Vec<BlockId>, OpError<E>> {
    let blocks = blocks.into_iter();
    let mut ids = Vec::with_capacity(blocks.size_hint().0);
    for block in blocks {
        ids.push(own_id(this, op, block.map_err(OpError::Input)?)?);
    }
    Ok(ids)
}

/// A mixed list of blocks sorted by pool.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Routed<T, V> {
    /// The blocks of the pool the list was given to, in list order.
    pub own: Vec<V>,
    /// The blocks of every other pool, one run per pool in the order the pools first
    /// appear in the list, each run in list order.
    pub others: Vec<(T, Vec<V>)>,
}

/// Sort `(pool token, item)` pairs into the items of the pool `this` and one run per other
/// pool (vLLM's deferred frees mix pools, and each pool must get its own blocks in the
/// order they were listed). Stops at the first pair that cannot be read.
#[inline]
pub fn route<T: PartialEq, V, E>(
    this: &T,
    items: impl IntoIterator<Item = Result<(T, V), E>>,
) -> Result<Routed<T, V>, E> {
    let items = items.into_iter();
    let mut routed = Routed {
        own: Vec::with_capacity(items.size_hint().0),
        others: Vec::new(),
    };
    for item in items {
        let (pool, value) = item?;
        if pool == *this {
            routed.own.push(value);
            continue;
        }
        // Mixed lists name few pools: a linear search beats hashing tokens.
        match routed.others.iter_mut().find(|(p, _)| *p == pool) {
            Some((_, run)) => run.push(value),
            None => routed.others.push((pool, vec![value])),
        }
    }
    Ok(routed)
}

#[cfg(test)]
mod tests {
    use super::*;

    fn ok<T>(items: Vec<T>) -> impl Iterator<Item = Result<T, ()>> {
        items.into_iter().map(Ok)
    }

    #[test]
    fn own_ids_accepts_only_this_pools_blocks() {
        let mine = |id| BlockRef { pool: 'a', id };
        assert_eq!(
            own_ids(&'a', "touch", ok(vec![mine(3), mine(1)])),
            Ok(vec![3, 1])
        );
        let mixed = ok(vec![mine(3), BlockRef { pool: 'b', id: 5 }, mine(1)]);
        assert_eq!(
            own_ids(&'a', "touch", mixed),
            Err(OpError::Pool(PoolError::ForeignBlock {
                block_id: 5,
                op: "touch"
            }))
        );
        let unreadable = vec![Ok(mine(3)), Err("not a block")];
        assert_eq!(
            own_ids(&'a', "touch", unreadable),
            Err(OpError::Input("not a block"))
        );
        assert_eq!(own_id(&'a', "x", mine(7)), Ok(7));
    }

    #[test]
    fn route_keeps_list_order_within_each_pool_and_first_seen_pool_order() {
        let items = ok(vec![
            ('c', 1),
            ('a', 2),
            ('b', 3),
            ('c', 4),
            ('a', 5),
            ('b', 6),
        ]);
        let routed = route(&'a', items).unwrap();
        assert_eq!(routed.own, vec![2, 5]);
        assert_eq!(routed.others, vec![('c', vec![1, 4]), ('b', vec![3, 6])]);
    }

    #[test]
    fn route_stops_at_the_first_unreadable_item() {
        let items = vec![Ok(('a', 1)), Err("bad"), Ok(('b', 2))];
        assert_eq!(route(&'a', items), Err("bad"));
        let empty: Vec<Result<(char, u32), ()>> = vec![];
        let routed = route(&'a', empty).unwrap();
        assert!(routed.own.is_empty() && routed.others.is_empty());
    }
}
