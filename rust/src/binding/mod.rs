//! The PyO3 binding: the only part of the crate that knows about Python. It converts
//! Python values to the core's and back, turns the core's errors into Python exceptions,
//! and holds the Python callables the core's notices are delivered to; the rules are the
//! core's.
//!
//! * [`block`]: `KVCacheBlock`, the block handle vLLM's managers hold (one object per
//!   block), the table of handles a pool has handed out, and `block_ids`, a group's
//!   handles as IDs;
//! * [`pool`]: `NativeBlockPool`, one core pool as a Python class, which
//!   `hybrid_alloc.integration.scheduler.block_pool.BlockPool` subclasses;
//! * [`elastic`]: `NativeElasticPools`, the byte budget that elastic per-group pools share
//!   over the `NativeBlockPool`s of the groups (memory lent on allocation, live changes
//!   passed on); the budget's own accounting is tested in the core
//!   (`byte_budget.rs`), through no binding of its own;
//! * [`running`]: `NativeRunningRequests`, what a coordinator knows of its running
//!   requests' block tables (quiet decode steps, decode room);
//! * [`views`]: `pool.blocks`, `pool.free_block_queue` and its iterator;
//! * [`convert`]: errors, iterables, block hashes and removed keys.

mod block;
mod convert;
mod elastic;
mod pool;
mod running;
mod views;

use pyo3::prelude::*;

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<block::Block>()?;
    m.add_class::<elastic::NativeElasticPools>()?;
    m.add_class::<pool::NativeBlockPool>()?;
    m.add_class::<running::NativeRunningRequests>()?;
    m.add_class::<views::BlockTable>()?;
    m.add_class::<views::FreeQueueView>()?;
    m.add_class::<views::FreeBlockIterator>()?;
    m.add_function(wrap_pyfunction!(block::block_ids, m)?)?;
    m.add("STEP_REMOVE_SKIPPED", running::PHASE_REMOVE_SKIPPED)?;
    m.add("STEP_CACHE_BLOCKS", running::PHASE_CACHE)?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
