//! hybrid_alloc: KV-cache block pools for vLLM.
//!
//! The crate has two layers:
//! * a pure Rust core ([`FreeQueue`], [`PrefixCache`], [`GroupPool`]) that knows nothing
//!   about Python and is unit-tested with `cargo test`. One `GroupPool` is one pool with its
//!   own block-ID space; per-group pool sets are composed of several (one per KV-cache
//!   group) in `hybrid_alloc.pool_set`;
//! * the PyO3 binding (`binding`, behind the `python` feature) that exposes the core to vLLM
//!   as a call-compatible `BlockPool`.

pub mod error;
pub mod free_queue;
pub mod group_pool;
pub mod prefix_cache;

#[cfg(feature = "python")]
mod binding;

pub use error::PoolError;
pub use free_queue::FreeQueue;
pub use group_pool::{BlockId, GroupPool, NULL_BLOCK_ID};
pub use prefix_cache::PrefixCache;
