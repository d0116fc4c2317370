//! hybrid_alloc: KV-cache block pools for vLLM.
//!
//! The crate has two layers:
//! * a pure Rust core ([`FreeQueue`], [`PrefixCache`], [`GroupPool`], [`PoolSet`]) that knows
//!   nothing about Python and is unit-tested with `cargo test`;
//! * the PyO3 binding (`binding`, behind the `python` feature) that exposes the core to vLLM
//!   as a call-compatible `BlockPool`.

pub mod error;
pub mod free_queue;
pub mod group_pool;
pub mod pool_set;
pub mod prefix_cache;

#[cfg(feature = "python")]
mod binding;

pub use error::PoolError;
pub use free_queue::FreeQueue;
pub use group_pool::{BlockId, GroupPool, NULL_BLOCK_ID};
pub use pool_set::PoolSet;
pub use prefix_cache::PrefixCache;
