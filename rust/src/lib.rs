//! hybrid_alloc: KV-cache block pools for vLLM.
//!
//! The crate has two layers:
//! * a pure Rust core that knows nothing about Python and is unit-tested with `cargo test`.
//!   [`GroupPool`] is one pool with its own block-ID space (per-group pool sets are
//!   composed of several, one per KV-cache group, in `hybrid_alloc.integration.scheduler.pool_set`),
//!   built from a [`FreeQueue`] and a [`PrefixCache`]. Every rule of vLLM's `BlockPool`
//!   lives here: request-level caching and lookups ([`caching`]), the order in which
//!   observers are told about blocks ([`notices`], [`reuse`]), and which pool a block
//!   belongs to ([`routing`]);
//! * the PyO3 binding (`binding`, behind the `python` feature), which converts Python
//!   values to the core's and the core's results and errors back, and holds the Python
//!   callables the core's notices are delivered to.

pub mod byte_budget;
pub mod caching;
pub mod elastic;
pub mod error;
pub mod free_queue;
pub mod group_pool;
pub mod notices;
pub mod prefix_cache;
pub mod reuse;
pub mod routing;
pub mod running;

#[cfg(feature = "python")]
mod binding;

pub use byte_budget::{ByteBudget, OwnerChanges, SlabId};
pub use caching::{GroupHits, HashSource, PartialCached, PartialEntry, Span};
pub use elastic::{ElasticPools, GroupAsk, Shortfall};
pub use error::{OpError, PoolError};
pub use free_queue::{FreeQueue, QueueCursor};
pub use group_pool::{BlockId, GroupPool, NULL_BLOCK_ID};
pub use notices::{Notice, Steps};
pub use prefix_cache::PrefixCache;
pub use reuse::ReuseWatchers;
pub use routing::{BlockRef, Routed};
pub use running::{DecodeStep, GroupRule, RunningRequests, StepPlan};
