//! `NativeBlockPool`: one core [`GroupPool`] as a Python class, subclassed in Python by
//! `hybrid_alloc.integration.scheduler.block_pool.BlockPool` (which builds vLLM's event objects).
//!
//! Each method converts its arguments, makes one core call and converts the answer back;
//! the rules (what is valid, what changes, in which order observers hear of it) are the
//! core's. Every bulk operation crosses the boundary once: a list of blocks in, a list out.

use super::block::{block_ref, handle_ref, Block, HandleTable, PoolToken};
use super::convert::{
    group_id, hash_bytes, items, op_error, pool_error, saturating_int, type_name,
    with_removed_sink, wrong_type, Indexed, PyHashes, RemovedKeys,
};
use super::elastic::{ElasticLink, NativeElasticPools};
use super::views::{BlockTable, FreeQueueView};
use crate::byte_budget::GroupIndex;
use crate::caching::{PartialEntry, Span};
use crate::error::PoolError;
use crate::group_pool::{BlockId, GroupPool};
use crate::notices::{Notice, Steps};
use crate::reuse::ReuseWatchers;
use crate::routing::{self, BlockRef};
use pyo3::exceptions::{PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBytes, PyInt, PyList, PyTuple};
use pyo3::{PyTraverseError, PyVisit};

/// The callables vLLM's metrics collector is told through, in the order of
/// `Notice::Evicting`, `Notice::Allocated`, `Notice::Accessed`. The Python layer passes
/// them (bound methods of the collector), so that no method name is spelt here.
struct BlockObservers {
    evicted: Py<PyAny>,
    allocated: Py<PyAny>,
    accessed: Py<PyAny>,
}

impl BlockObservers {
    fn clone_ref(&self, py: Python<'_>) -> Self {
        BlockObservers {
            evicted: self.evicted.clone_ref(py),
            allocated: self.allocated.clone_ref(py),
            accessed: self.accessed.clone_ref(py),
        }
    }
}

/// The native half of `hybrid_alloc.BlockPool`: one pool of blocks.
#[pyclass(subclass, module = "hybrid_alloc._native", name = "NativeBlockPool")]
pub struct NativeBlockPool {
    pub(super) core: GroupPool,
    handles: HandleTable,
    pub(super) watchers: ReuseWatchers<Py<PyAny>>,
    observers: Option<BlockObservers>,
    /// Called with a list of removed keys when events are on (builds `BlockRemoved`).
    removed_sink: Option<Py<PyAny>>,
    enable_kv_cache_events: bool,
    pub(super) label: String,
    /// Set when the pool is one group of elastic pools (its pages lent by a shared budget).
    pub(super) elastic: Option<ElasticLink>,
}

impl NativeBlockPool {
    fn error(&self, e: PoolError) -> PyErr {
        pool_error(&self.label, e)
    }

    /// The handle of block `id`, created on first use.
    pub(super) fn handle(slf: &Bound<'_, Self>, id: BlockId) -> PyResult<Py<Block>> {
        let mut this = slf.try_borrow_mut()?;
        let n = this.core.num_blocks();
        this.handles.get(slf, n, id)
    }

    /// The handles of `ids`, as a list.
    pub(super) fn handle_list<'py>(
        slf: &Bound<'py, Self>,
        ids: &[BlockId],
    ) -> PyResult<Bound<'py, PyList>> {
        let mut this = slf.try_borrow_mut()?;
        let n = this.core.num_blocks();
        this.handles.list(slf, n, ids)
    }

    /// The ID of `obj`, which must be a handle of this pool.
    pub(super) fn own_id(
        slf: &Bound<'_, Self>,
        obj: &Bound<'_, PyAny>,
        op: &'static str,
    ) -> PyResult<BlockId> {
        let this = slf.try_borrow()?;
        let block = block_ref(slf, &this.label, op, obj)?;
        routing::own_id(&PoolToken::This, op, block).map_err(|e| this.error(e))
    }

    /// The IDs of `blocks` (a list or any iterable), which must all be handles of this pool.
    pub(super) fn own_ids(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        op: &'static str,
    ) -> PyResult<Vec<BlockId>> {
        let this = slf.try_borrow()?;
        let label = &this.label;
        let refs = items(blocks)?.map(|item| block_ref(slf, label, op, &item?));
        routing::own_ids(&PoolToken::This, op, refs).map_err(|e| op_error(label, e))
    }

    /// Pass the blocks that went in or out of use to the elastic budget, if any.
    pub(super) fn sync_elastic(&mut self, py: Python<'_>) -> PyResult<()> {
        let Some(link) = &self.elastic else {
            return Ok(());
        };
        let owner = link.owner.clone_ref(py);
        let mut budget = owner.bind(py).try_borrow_mut()?;
        budget
            .sync(link.group, &mut self.core)
            .map_err(|e| pool_error(&self.label, e))
    }

    /// Run `op` on the core pool: in elastic pools as the core's elastic operation (the
    /// named blocks checked, `op`, the budget synced: `elastic::operate`), else directly.
    /// Takes the pool's parts so that `op` may borrow its other fields.
    pub(super) fn operate_on<T>(
        py: Python<'_>,
        elastic: Option<&ElasticLink>,
        label: &str,
        core: &mut GroupPool,
        named: &[BlockId],
        what: &'static str,
        op: impl FnOnce(&mut GroupPool) -> Result<T, PoolError>,
    ) -> PyResult<T> {
        let done = match elastic {
            None => op(core),
            Some(link) => link
                .owner
                .bind(py)
                .try_borrow_mut()?
                .operate(link.group, core, named, what, op),
        };
        done.map_err(|e| pool_error(label, e))
    }

    /// [`Self::operate_on`] for an `op` that needs only the core pool.
    pub(super) fn operate<T>(
        &mut self,
        py: Python<'_>,
        named: &[BlockId],
        what: &'static str,
        op: impl FnOnce(&mut GroupPool) -> Result<T, PoolError>,
    ) -> PyResult<T> {
        Self::operate_on(
            py,
            self.elastic.as_ref(),
            &self.label,
            &mut self.core,
            named,
            what,
            op,
        )
    }

    /// In elastic pools, refuse blocks the budget holds (pages of slabs this group does not
    /// own): the core's check (`elastic::check_named`) without an operation.
    pub(super) fn check_elastic(
        &self,
        py: Python<'_>,
        ids: &[BlockId],
        op: &'static str,
    ) -> PyResult<()> {
        Self::check_linked(py, self.elastic.as_ref(), &self.label, &self.core, ids, op)
    }

    /// [`Self::check_elastic`] from the pool's parts.
    fn check_linked(
        py: Python<'_>,
        elastic: Option<&ElasticLink>,
        label: &str,
        core: &GroupPool,
        ids: &[BlockId],
        op: &'static str,
    ) -> PyResult<()> {
        let Some(link) = elastic else {
            return Ok(());
        };
        let owner = link.owner.bind(py).try_borrow()?;
        owner
            .check_named(link.group, core, ids, op)
            .map_err(|e| pool_error(label, e))
    }

    /// The elastic budget's check for one block named by a caching call (`Ok` outside
    /// elastic pools), made while the pool is borrowed: a block the budget holds may not
    /// be given a key.
    fn elastic_check_one(
        py: Python<'_>,
        link: Option<&(Py<NativeElasticPools>, GroupIndex)>,
        label: &str,
        id: BlockId,
        op: &'static str,
    ) -> PyResult<()> {
        let Some((owner, group)) = link else {
            return Ok(());
        };
        owner
            .bind(py)
            .try_borrow()?
            .check_lent(*group, id, op)
            .map_err(|e| pool_error(label, e))
    }

    fn elastic_link(&self, py: Python<'_>) -> Option<(Py<NativeElasticPools>, GroupIndex)> {
        self.elastic
            .as_ref()
            .map(|l| (l.owner.clone_ref(py), l.group))
    }

    /// Pages of a slab the budget took back from this pool (see
    /// `elastic::TakenBack`): their `unpin_blocks` watchers are told the pages are reused,
    /// in page order, then the observers hear of each page whose keys were evicted.
    pub(super) fn taken_back(
        slf: &Bound<'_, Self>,
        pages: &[BlockId],
        evicted: &[BlockId],
    ) -> PyResult<()> {
        let py = slf.py();
        let (watchers, observers) = {
            let mut this = slf.try_borrow_mut()?;
            let watchers = this.watchers.take_listed(pages);
            let observers = this.observers.as_ref().map(|o| o.clone_ref(py));
            (watchers, observers)
        };
        for (id, watcher) in watchers {
            watcher.call1(py, (Self::handle(slf, id)?,))?;
        }
        if let Some(o) = observers {
            for &id in evicted {
                o.evicted.call1(py, (Self::handle(slf, id)?,))?;
            }
        }
        Ok(())
    }

    pub(super) fn removed_keys(&self) -> RemovedKeys {
        RemovedKeys::new(self.removed_sink.is_some())
    }

    /// Hand removed keys to the Python layer's sink (it appends `BlockRemoved` events).
    pub(super) fn emit_removed(slf: &Bound<'_, Self>, keys: RemovedKeys) -> PyResult<()> {
        let py = slf.py();
        let Some(list) = keys.into_list(py)? else {
            return Ok(());
        };
        let sink = slf
            .try_borrow()?
            .removed_sink
            .as_ref()
            .map(|s| s.clone_ref(py));
        match sink {
            Some(sink) => sink.call1(py, (list,)).map(drop),
            None => Ok(()),
        }
    }

    /// Take the blocks of `get_new_blocks` and their handles; with `ints`, the handles'
    /// `block_id` ints are pushed there too.
    fn take_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: &Bound<'py, PyAny>,
        ints: Option<&mut Vec<Py<PyInt>>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let num_blocks = saturating_int(num_blocks)?;
        let (link, observed) = {
            let this = slf.try_borrow()?;
            let link = this
                .elastic
                .as_ref()
                .map(|l| (l.owner.clone_ref(slf.py()), l.group));
            (link, this.observers.is_some())
        };
        let (steps, told) = match link {
            // The memory lent, the pop, and the budget's sync are one core call
            // (`elastic::allocate`; the pool is not borrowed here: taking a slab back
            // may evict in another group's pool).
            Some((owner, group)) => {
                let n = usize::try_from(num_blocks).map_err(|_| {
                    let this = slf.try_borrow();
                    let label = this.as_ref().map(|t| t.label.as_str()).unwrap_or("pool");
                    PyValueError::new_err(format!("{label}: cannot get {num_blocks} blocks"))
                })?;
                NativeElasticPools::allocate(owner.bind(slf.py()), group, n, |core, watchers| {
                    core.hand_out(num_blocks, watchers, observed)
                })?
            }
            None => {
                let mut guard = slf.try_borrow_mut()?;
                let this = &mut *guard;
                let steps = this
                    .core
                    .hand_out(num_blocks, &mut this.watchers, observed)
                    .map_err(|e| pool_error(&this.label, e))?;
                (steps, Ok(()))
            }
        };
        let mut guard = slf.try_borrow_mut()?;
        let this = &mut *guard;
        let list = this
            .handles
            .list_recording_ids(slf, this.core.num_blocks(), steps.ids(), ints);
        // The blocks are off the free queue: claim them even if the list failed, or a
        // watcher of a slab taken back for them raised.
        let driven = Self::drive(slf, guard, steps);
        told?;
        let list = list?;
        driven?;
        Ok(list)
    }

    /// Carry out an operation notice by notice. The first stretch runs under the caller's
    /// borrow `this` (without observers that is the whole operation); each notice is then
    /// delivered to its Python callable with the pool released (callbacks may read it).
    /// Returns the keys the operation removed. If a callback raises, the operation is
    /// abandoned (see [`Steps::abandon`]), the keys removed so far are still emitted, and
    /// the callback's exception is returned.
    fn drive(
        slf: &Bound<'_, Self>,
        mut this: PyRefMut<'_, Self>,
        mut steps: Steps<Py<PyAny>>,
    ) -> PyResult<usize> {
        let py = slf.py();
        let mut keys = this.removed_keys();
        let first = with_removed_sink!(keys, |sink| steps.next_notice(&mut this.core, sink));
        // The budget hears of every change before any callback can run (a callback may
        // allocate in another group, which must not take a slab this one just filled).
        let mut synced = this.sync_elastic(py);
        let observers = match first {
            Some(_) => this.observers.as_ref().map(|o| o.clone_ref(py)),
            None => None,
        };
        drop(this);
        let mut notice = first;
        let outcome = loop {
            let Some(current) = notice else {
                break Ok(steps.keys_removed());
            };
            if let Err(e) = Self::deliver(slf, observers.as_ref(), current) {
                let mut this = slf.try_borrow_mut()?;
                with_removed_sink!(keys, |sink| steps.abandon(&mut this.core, sink));
                synced = synced.and(this.sync_elastic(py));
                break Err(e);
            }
            let mut this = slf.try_borrow_mut()?;
            notice = with_removed_sink!(keys, |sink| steps.next_notice(&mut this.core, sink));
            synced = synced.and(this.sync_elastic(py));
        };
        let emitted = Self::emit_removed(slf, keys);
        let removed = outcome?;
        synced?;
        emitted.map(|_| removed)
    }

    fn deliver(
        slf: &Bound<'_, Self>,
        observers: Option<&BlockObservers>,
        notice: Notice<Py<PyAny>>,
    ) -> PyResult<()> {
        let py = slf.py();
        let (callable, id) = match (&notice, observers) {
            (Notice::Reused(id, watcher), _) => (watcher, *id),
            (Notice::Evicting(id), Some(o)) => (&o.evicted, *id),
            (Notice::Allocated(id), Some(o)) => (&o.allocated, *id),
            (Notice::Accessed(id), Some(o)) => (&o.accessed, *id),
            // Metrics notices come only when observers were set.
            (_, None) => return Ok(()),
        };
        callable.call1(py, (Self::handle(slf, id)?,)).map(drop)
    }

    /// What `free_blocks` makes of one listed object: its pool's token and the block's ID
    /// there, or for a block of a pool of another kind, its index in `others.objects`.
    fn route_item<'py>(
        slf: &Bound<'py, Self>,
        label: &str,
        obj: Bound<'py, PyAny>,
        others: &mut OtherPools<'py>,
    ) -> PyResult<(PoolToken, u32)> {
        if let Ok(block) = obj.cast::<Block>() {
            let block = block.get();
            let BlockRef { pool, id } = handle_ref(slf, block);
            if pool != PoolToken::This {
                others.keep_pool(block.pool.get(slf.py(), id)?.as_any());
            }
            return Ok((pool, id));
        }
        // Not one of our handles: a block of another pool type, routed through its `pool`.
        let pool = match obj.getattr("pool") {
            Ok(p) if !p.is_none() => p,
            _ => {
                return Err(wrong_type(
                    label,
                    "free_blocks",
                    "KVCacheBlock objects",
                    &obj,
                ))
            }
        };
        if let Ok(native) = pool.cast::<NativeBlockPool>() {
            // A foreign block type that claims a pool of ours: refuse rather than guess.
            let owner = if native.is(slf) {
                label.to_string()
            } else {
                native.try_borrow()?.label.clone()
            };
            return Err(PyTypeError::new_err(format!(
                "{owner}: free_blocks: a {} claims this pool but is not one of its handles",
                type_name(&obj)
            )));
        }
        let token = PoolToken::Foreign(pool.as_ptr() as usize);
        others.keep_pool(&pool);
        others.objects.push(obj);
        Ok((token, (others.objects.len() - 1) as u32))
    }
}

/// The objects behind the tokens of other pools in one `free_blocks` call, kept alive
/// while tokens are compared and to hand each pool its blocks.
#[derive(Default)]
struct OtherPools<'py> {
    pools: Vec<Bound<'py, PyAny>>,
    /// Blocks of pools of another kind, passed on as they are.
    objects: Vec<Bound<'py, PyAny>>,
}

impl<'py> OtherPools<'py> {
    fn keep_pool(&mut self, pool: &Bound<'py, PyAny>) {
        if !self.pools.iter().any(|p| p.is(pool)) {
            self.pools.push(pool.clone());
        }
    }

    fn pool(&self, addr: usize) -> PyResult<&Bound<'py, PyAny>> {
        self.pools
            .iter()
            .find(|p| p.as_ptr() as usize == addr)
            .ok_or_else(|| PyRuntimeError::new_err("free_blocks: a pool token has no pool"))
    }

    /// The run of one other pool, ready to free.
    fn run(&self, token: PoolToken, values: Vec<u32>) -> PyResult<OtherRun<'py>> {
        match token {
            PoolToken::Native(addr) => {
                let pool = self.pool(addr)?.cast::<NativeBlockPool>()?.clone();
                Ok(OtherRun::Native(pool, values))
            }
            PoolToken::Foreign(addr) => {
                let objects = values
                    .iter()
                    .filter_map(|&i| self.objects.get(i as usize).cloned())
                    .collect();
                Ok(OtherRun::Python(self.pool(addr)?.clone(), objects))
            }
            PoolToken::This => Err(PyRuntimeError::new_err("free_blocks: misrouted block")),
        }
    }
}

/// One other pool's share of a `free_blocks` call.
enum OtherRun<'py> {
    /// A pool of ours: freed here, in Rust.
    Native(Bound<'py, NativeBlockPool>, Vec<BlockId>),
    /// Any other pool: its own `free_blocks` is called with its blocks.
    Python(Bound<'py, PyAny>, Vec<Bound<'py, PyAny>>),
}

#[pymethods]
impl NativeBlockPool {
    #[new]
    #[pyo3(signature = (num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events=false, label=None))]
    fn new(
        num_gpu_blocks: &Bound<'_, PyAny>,
        enable_caching: bool,
        hash_block_size: i64,
        enable_kv_cache_events: bool,
        label: Option<String>,
    ) -> PyResult<Self> {
        let label = label.unwrap_or_else(|| "BlockPool".to_string());
        let n: i64 = num_gpu_blocks.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{label}: num_gpu_blocks must be an int, got {}",
                type_name(num_gpu_blocks)
            ))
        })?;
        let core = GroupPool::new(n, enable_caching, hash_block_size)
            .map_err(|e| pool_error(&label, e))?;
        Ok(NativeBlockPool {
            core,
            handles: HandleTable::default(),
            watchers: ReuseWatchers::default(),
            observers: None,
            removed_sink: None,
            enable_kv_cache_events,
            label,
            elastic: None,
        })
    }

    #[getter]
    fn num_gpu_blocks(&self) -> usize {
        self.core.num_blocks()
    }

    #[getter]
    fn enable_caching(&self) -> bool {
        self.core.enable_caching()
    }

    #[getter]
    fn hash_block_size(&self) -> u32 {
        self.core.hash_block_size()
    }

    #[getter]
    fn enable_kv_cache_events(&self) -> bool {
        self.enable_kv_cache_events
    }

    /// A short name for the pool used in error messages.
    #[getter]
    fn label(&self) -> String {
        self.label.clone()
    }

    /// Install the callable that turns removed keys into `BlockRemoved` events.
    fn _set_removed_sink(&mut self, sink: Option<Py<PyAny>>) {
        self.removed_sink = sink;
    }

    /// Install the callables told about blocks evicted, allocated and accessed (vLLM's
    /// metrics collector), or None for none.
    fn _set_block_observers(&mut self, observers: Option<(Py<PyAny>, Py<PyAny>, Py<PyAny>)>) {
        self.observers = observers.map(|(evicted, allocated, accessed)| BlockObservers {
            evicted,
            allocated,
            accessed,
        });
    }

    fn get_num_free_blocks(&self) -> usize {
        self.core.num_free()
    }

    fn get_usage(&self) -> f64 {
        self.core.usage()
    }

    /// Take `num_blocks` blocks from the front of the free queue (evicting their cached
    /// hashes) and give each one reference.
    pub(crate) fn get_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        Self::take_new_blocks(slf, num_blocks, None)
    }

    /// `get_new_blocks`, and the new blocks' IDs as a second list (the ints the handles
    /// hold, not new ones): what vLLM's `allocate_new_blocks` records for zeroing, without
    /// its walk over the handles (a generator, about 28 ns a block).
    fn get_new_blocks_with_ids<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: &Bound<'py, PyAny>,
    ) -> PyResult<(Bound<'py, PyList>, Bound<'py, PyList>)> {
        let mut ids = Vec::new();
        let blocks = Self::take_new_blocks(slf, num_blocks, Some(&mut ids))?;
        Ok((blocks, PyList::new(slf.py(), ids)?))
    }

    /// Drop one reference to each block; blocks reaching zero become free (uncached ones
    /// reused first, cached ones last). Blocks of other pools are freed in their own pool.
    /// Every pool of ours is checked before any block is freed.
    fn free_blocks(slf: &Bound<'_, Self>, ordered_blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut others = OtherPools::default();
        let routed = {
            // Shared while the iterable runs: a generator may read the pool.
            let this = slf.try_borrow()?;
            let label = &this.label;
            let pairs =
                items(ordered_blocks)?.map(|item| Self::route_item(slf, label, item?, &mut others));
            routing::route(&PoolToken::This, pairs)?
        };
        let mut this = slf.try_borrow_mut()?;
        if routed.others.is_empty() {
            let own = &routed.own;
            return this.operate(slf.py(), own, "free", |core| core.free(own));
        }
        this.check_elastic(slf.py(), &routed.own, "free")?;
        let runs = routed
            .others
            .into_iter()
            .map(|(token, values)| others.run(token, values))
            .collect::<PyResult<Vec<_>>>()?;
        // Check every pool of ours before freeing in any: a refusal changes nothing.
        this.core
            .check_free(&routed.own)
            .map_err(|e| this.error(e))?;
        for run in &runs {
            if let OtherRun::Native(pool, ids) = run {
                let mut other = pool.try_borrow_mut()?;
                other.check_elastic(slf.py(), ids, "free")?;
                other.core.check_free(ids).map_err(|e| other.error(e))?;
            }
        }
        let own = &routed.own;
        this.operate(slf.py(), own, "free", |core| core.free(own))?;
        drop(this);
        for run in runs {
            match run {
                OtherRun::Native(pool, ids) => {
                    let mut other = pool.try_borrow_mut()?;
                    other.operate(slf.py(), &ids, "free", |core| core.free(&ids))?;
                }
                OtherRun::Python(pool, objs) => {
                    pool.call_method1("free_blocks", (PyList::new(slf.py(), objs)?,))?;
                }
            }
        }
        Ok(())
    }

    /// Add one reference to each block (a prefix-cache hit), taking free ones out of the
    /// free queue. The null block is passed over.
    fn touch(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = Self::own_ids(slf, blocks, "touch")?;
        let mut this = slf.try_borrow_mut()?;
        let observed = this.observers.is_some();
        // The references are taken notice by notice (`drive`, which syncs the budget).
        let steps = this.operate(slf.py(), &ids, "touch", |core| {
            core.touch_steps(ids.clone(), observed)
        })?;
        Self::drive(slf, this, steps).map(drop)
    }

    /// Release references to blocks whose contents stay readable until the pool hands
    /// them out again; `on_reuse(block)` is called then.
    fn unpin_blocks(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        on_reuse: Py<PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let ids = Self::own_ids(slf, blocks, "unpin_blocks")?;
        let mut guard = slf.try_borrow_mut()?;
        let this = &mut *guard;
        let watchers = &mut this.watchers;
        let (elastic, label) = (this.elastic.as_ref(), &this.label);
        Self::operate_on(py, elastic, label, &mut this.core, &ids, "unpin", |core| {
            core.unpin_watched(&ids, watchers, || on_reuse.clone_ref(py))
        })
    }

    fn is_block_writable(slf: &Bound<'_, Self>, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let id = Self::own_id(slf, block, "is_block_writable")?;
        Ok(slf.try_borrow()?.core.is_writable(id))
    }

    /// How many of `blocks` are free but cached: blocks a prefix hit would take out of the
    /// free queue (vLLM's managers count this per block on every admission).
    fn count_evictable(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<usize> {
        let ids = Self::own_ids(slf, blocks, "count_evictable")?;
        Ok(slf.try_borrow()?.core.count_evictable(&ids))
    }

    /// The most tokens any of `blocks`' hashes cover, 0 if none is cached (vLLM's
    /// `estimate_cached_tokens` reads `block_hash_num_tokens` block by block for this).
    fn max_block_hash_num_tokens(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
    ) -> PyResult<u32> {
        let ids = Self::own_ids(slf, blocks, "max_block_hash_num_tokens")?;
        Ok(slf.try_borrow()?.core.max_block_hash_num_tokens(&ids))
    }

    /// The first cached block for `block_hash` in each listed group, or None if any group
    /// misses.
    fn get_cached_block<'py>(
        slf: &Bound<'py, Self>,
        block_hash: &[u8],
        kv_cache_group_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let mut guard = slf.try_borrow_mut()?;
        let this = &mut *guard;
        let mut hits = this.core.cached_block(block_hash);
        for group in items(kv_cache_group_ids)? {
            if !hits.group(group_id(&this.label, "get_cached_block", &group?)?) {
                break;
            }
        }
        match hits.finish() {
            Some(ids) => Ok(Some(this.handles.list(
                slf,
                this.core.num_blocks(),
                &ids,
            )?)),
            None => Ok(None),
        }
    }

    /// Batched prefix lookup: walk `block_hashes` from the start and stop at the first
    /// hash that misses in any group; at most `max_blocks` hashes. Returns one list of
    /// blocks per group (a tuple), all of the same length.
    fn get_cached_prefix<'py>(
        slf: &Bound<'py, Self>,
        block_hashes: &Bound<'py, PyAny>,
        kv_cache_group_ids: &Bound<'py, PyAny>,
        max_blocks: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyTuple>> {
        const OP: &str = "get_cached_prefix";
        let mut guard = slf.try_borrow_mut()?;
        let this = &mut *guard;
        let label = &this.label;
        let kv_cache_group_ids = items(kv_cache_group_ids)?
            .map(|g| group_id(label, OP, &g?))
            .collect::<PyResult<Vec<u32>>>()?;
        let max_blocks = saturating_int(max_blocks)?;
        let max_blocks = usize::try_from(max_blocks).map_err(|_| {
            PyValueError::new_err(format!(
                "{label}: {OP}: max_blocks must be >= 0, got {max_blocks}"
            ))
        })?;
        let hashes = items(block_hashes)?.map(|h| hash_bytes(label, OP, h?));
        let found = this
            .core
            .cached_prefix(hashes, &kv_cache_group_ids, max_blocks)?;
        let num_blocks = this.core.num_blocks();
        let lists = found
            .iter()
            .map(|ids| this.handles.list(slf, num_blocks, ids))
            .collect::<PyResult<Vec<_>>>()?;
        PyTuple::new(slf.py(), lists)
    }

    /// The core of `cache_full_blocks`: cache `blocks[num_cached_blocks:num_full_blocks]`
    /// under `block_hashes` at the same positions, skipping null and masked-out blocks.
    /// Returns the positions cached when KV events are on (the Python layer builds the
    /// `BlockStored` event from them), None when they are off or the span is empty.
    #[pyo3(signature = (blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask=None))]
    #[allow(clippy::too_many_arguments)]
    fn _cache_full_blocks(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        num_cached_blocks: &Bound<'_, PyAny>,
        num_full_blocks: &Bound<'_, PyAny>,
        block_size: &Bound<'_, PyAny>,
        kv_cache_group_id: &Bound<'_, PyAny>,
        block_mask: Option<Vec<bool>>,
    ) -> PyResult<Option<Vec<usize>>> {
        const OP: &str = "cache_full_blocks";
        let (label, mut keys, events_on) = {
            let this = slf.try_borrow()?;
            (
                this.label.clone(),
                this.removed_keys(),
                this.enable_kv_cache_events,
            )
        };
        let span = Span {
            num_cached: saturating_int(num_cached_blocks)?,
            num_full: saturating_int(num_full_blocks)?,
            block_size: saturating_int(block_size)?,
            group_id: group_id(&label, OP, kv_cache_group_id)?,
        };
        let hashes = PyHashes {
            seq: Indexed::new(block_hashes),
            label: &label,
            op: OP,
        };
        let blocks = Indexed::new(blocks);
        let link = slf.try_borrow()?.elastic_link(slf.py());
        // Blocks are read while the pool is borrowed: reading a handle needs no borrow.
        let block_at = |i: usize| {
            let block = block_ref(slf, &label, OP, &blocks.get(i)?)?;
            let id =
                routing::own_id(&PoolToken::This, OP, block).map_err(|e| pool_error(&label, e))?;
            Self::elastic_check_one(slf.py(), link.as_ref(), &label, id, "cache")?;
            Ok(id)
        };
        let kept = {
            let mut this = slf.try_borrow_mut()?;
            let mask = block_mask.as_deref();
            with_removed_sink!(keys, |sink| this
                .core
                .cache_span(span, mask, block_at, &hashes, sink))
            .map_err(|e| op_error(&label, e))?
        };
        Self::emit_removed(slf, keys)?;
        Ok(kept.filter(|_| events_on))
    }

    /// The pool's part of `cache_partial_block`: make `block` reachable from the request
    /// hash at `num_tokens`, promoting or replacing its existing entries (removed keys are
    /// emitted). Returns None for the null block, else `(key, stored_event_due)`: whether
    /// the entry is new with KV events on, for the Python layer's `BlockStored`.
    #[pyo3(signature = (block_hashes, block, num_tokens, kv_cache_group_id, block_size, replace_existing_hashes=false))]
    fn _cache_partial_block<'py>(
        slf: &Bound<'py, Self>,
        block_hashes: &Bound<'py, PyAny>,
        block: &Bound<'py, PyAny>,
        num_tokens: i64,
        kv_cache_group_id: u32,
        block_size: i64,
        replace_existing_hashes: bool,
    ) -> PyResult<Option<(Bound<'py, PyBytes>, bool)>> {
        let id = Self::own_id(slf, block, "cache_partial_block")?;
        {
            let this = slf.try_borrow()?;
            this.check_elastic(slf.py(), &[id], "cache")?;
        }
        let entry = PartialEntry {
            block: id,
            num_tokens,
            group_id: kv_cache_group_id,
            block_size,
            replace_existing: replace_existing_hashes,
        };
        let (label, mut keys, events_on) = {
            let this = slf.try_borrow()?;
            (
                this.label.clone(),
                this.removed_keys(),
                this.enable_kv_cache_events,
            )
        };
        let hashes = PyHashes {
            seq: Indexed::new(block_hashes),
            label: &label,
            op: "cache_partial_block",
        };
        let cached = {
            let mut this = slf.try_borrow_mut()?;
            with_removed_sink!(keys, |sink| this.core.cache_partial(entry, &hashes, sink))
                .map_err(|e| op_error(&label, e))?
        };
        Self::emit_removed(slf, keys)?;
        Ok(cached.map(|c| (PyBytes::new(slf.py(), &c.key), c.newly_cached && events_on)))
    }

    /// vLLM's `_insert_block_hash`.
    #[pyo3(signature = (block_hash_with_group_id, block, num_tokens=None))]
    fn _insert_block_hash(
        slf: &Bound<'_, Self>,
        block_hash_with_group_id: &[u8],
        block: &Bound<'_, PyAny>,
        num_tokens: Option<u32>,
    ) -> PyResult<()> {
        let id = Self::own_id(slf, block, "_insert_block_hash")?;
        let mut this = slf.try_borrow_mut()?;
        this.operate(slf.py(), &[id], "cache", |core| {
            core.insert_hash(block_hash_with_group_id, id, num_tokens)
        })
    }

    /// vLLM's `_remove_cached_block_hashes`: unlink every key of `block` and return the
    /// keys removed (no events; the caller emits them).
    fn _remove_cached_block_hashes<'py>(
        slf: &Bound<'py, Self>,
        block: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let id = Self::own_id(slf, block, "_remove_cached_block_hashes")?;
        let mut keys = Vec::new();
        let mut this = slf.try_borrow_mut()?;
        this.core
            .evict(id, |_, k| keys.push(PyBytes::new(py, k)))
            .map_err(|e| pool_error(&this.label, e))?;
        PyList::new(py, keys)
    }

    /// vLLM's `_emit_block_removed_events`: emit `BlockRemoved` events for keys (when
    /// events are on).
    fn _emit_block_removed_events(slf: &Bound<'_, Self>, keys: Vec<Vec<u8>>) -> PyResult<()> {
        let mut removed = slf.try_borrow()?.removed_keys();
        keys.iter().for_each(|k| removed.push(k));
        Self::emit_removed(slf, removed)
    }

    /// Whether `key` maps to block `block_id`.
    fn _hash_maps_to(&self, key: &[u8], block_id: i64) -> PyResult<bool> {
        let id = self.core.check_id(block_id).map_err(|e| self.error(e))?;
        Ok(self.core.cache().contains(key, id))
    }

    /// The extra (non-primary) keys of a block: vLLM's `cached_block_hashes_by_block`.
    fn _extra_block_hashes<'py>(
        &self,
        py: Python<'py>,
        block_id: i64,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let id = self.core.check_id(block_id).map_err(|e| self.error(e))?;
        Ok(self
            .core
            .cache()
            .extra_keys(id)
            .into_iter()
            .map(|k| PyBytes::new(py, k))
            .collect())
    }

    /// The first block cached under a full key, or None.
    fn _lookup_key(slf: &Bound<'_, Self>, key: &[u8]) -> PyResult<Option<Py<Block>>> {
        let id = slf.try_borrow()?.core.lookup(key);
        id.map(|id| Self::handle(slf, id)).transpose()
    }

    /// Number of cached keys.
    fn _num_cached_keys(&self) -> usize {
        self.core.cache().len()
    }

    /// vLLM's private `_maybe_evict_cached_block`, used by its Mamba manager. Returns
    /// whether any key was removed.
    fn _maybe_evict_cached_block(
        slf: &Bound<'_, Self>,
        block: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let id = Self::own_id(slf, block, "_maybe_evict_cached_block")?;
        let this = slf.try_borrow_mut()?;
        let steps = this
            .core
            .evict_steps(&[i64::from(id)], this.observers.is_some())
            .map_err(|e| this.error(e))?;
        Ok(Self::drive(slf, this, steps)? > 0)
    }

    /// Re-point `src_block`'s prefix-cache entries to `dst_block` (no events).
    fn move_block_hashes(
        slf: &Bound<'_, Self>,
        src_block: &Bound<'_, PyAny>,
        dst_block: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let src = Self::own_id(slf, src_block, "move_block_hashes")?;
        let dst = Self::own_id(slf, dst_block, "move_block_hashes")?;
        let mut this = slf.try_borrow_mut()?;
        this.operate(slf.py(), &[src, dst], "move the keys of", |core| {
            core.move_hashes(src, dst)
        })
    }

    /// Evict blocks from the prefix cache by ID (IDs of this pool). Every ID is checked
    /// before any block is evicted. Referenced blocks stay allocated.
    fn evict_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let ids = {
            let this = slf.try_borrow()?;
            let ids = items(block_ids)?;
            let mut out = Vec::with_capacity(ids.size_hint().0);
            for item in ids {
                let item = item?;
                out.push(saturating_int(&item).map_err(|_| {
                    wrong_type(&this.label, "evict_blocks", "block IDs as ints", &item)
                })?);
            }
            out
        };
        let this = slf.try_borrow_mut()?;
        let steps = this
            .core
            .evict_steps(&ids, this.observers.is_some())
            .map_err(|e| this.error(e))?;
        Self::drive(slf, this, steps).map(drop)
    }

    /// Blocks the elastic budget holds in this pool (pages of slabs the group does not
    /// own); 0 outside elastic pools.
    fn _held_by_budget(slf: &Bound<'_, Self>) -> PyResult<usize> {
        match &slf.try_borrow()?.elastic {
            Some(link) => Ok(link
                .owner
                .bind(slf.py())
                .try_borrow()?
                .held_pages(link.group)),
            None => Ok(0),
        }
    }

    /// Clear the prefix cache if no block is in use, and tell every reuse watcher. Returns
    /// whether it did (the Python layer logs, resets metrics and emits the event).
    fn _reset_prefix_cache(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let py = slf.py();
        let watchers = {
            let held = match &slf.try_borrow()?.elastic {
                Some(link) => link.owner.bind(py).try_borrow()?.held_pages(link.group),
                None => 0,
            };
            let mut guard = slf.try_borrow_mut()?;
            let this = &mut *guard;
            this.core.reset_watched(&mut this.watchers, held)
        };
        let Some(watchers) = watchers else {
            return Ok(false);
        };
        for (id, watcher) in watchers {
            watcher.call1(py, (Self::handle(slf, id)?,))?;
        }
        Ok(true)
    }

    /// The handle of block `block_id`.
    fn _block(slf: &Bound<'_, Self>, block_id: i64) -> PyResult<Py<Block>> {
        let id = {
            let this = slf.try_borrow()?;
            this.core.check_id(block_id).map_err(|e| this.error(e))?
        };
        Self::handle(slf, id)
    }

    /// A sequence view of every block, indexable by ID (vLLM's `pool.blocks`).
    fn _block_table(slf: &Bound<'_, Self>) -> BlockTable {
        BlockTable::new(slf)
    }

    /// A view of the free queue (vLLM's `pool.free_block_queue`).
    fn _free_queue_view(slf: &Bound<'_, Self>) -> FreeQueueView {
        FreeQueueView::new(slf)
    }

    /// IDs of the free blocks in eviction order.
    fn free_block_ids(&self) -> Vec<BlockId> {
        self.core.free_blocks_in_order()
    }

    /// Reference count of every block, by ID (the null block reads 0).
    fn ref_counts(&self) -> Vec<u32> {
        (0..self.core.num_blocks() as u32)
            .map(|id| self.core.ref_cnt(id))
            .collect()
    }

    /// Every cached key with the IDs holding it, sorted by key.
    fn cache_entries<'py>(&self, py: Python<'py>) -> Vec<(Bound<'py, PyBytes>, Vec<BlockId>)> {
        let mut v: Vec<(&[u8], Vec<BlockId>)> = self.core.cache().entries().collect();
        v.sort();
        v.into_iter()
            .map(|(k, ids)| (PyBytes::new(py, k), ids))
            .collect()
    }

    /// Raise RuntimeError if any invariant of the pool is broken.
    fn check_invariants(&self) -> PyResult<()> {
        self.core
            .check_invariants()
            .map_err(|e| PyRuntimeError::new_err(format!("{}: {e}", self.label)))
    }

    /// Bytes of per-block bookkeeping: the core's arrays plus the handle table (which grows
    /// as blocks are first handed to Python, to 8 bytes per block).
    fn bookkeeping_bytes(&self) -> usize {
        self.core.per_block_heap_bytes() + self.handles.heap_bytes()
    }

    /// Make the handles of blocks `0..limit` (of the whole pool if smaller) now, instead
    /// of on first use; returns how many handles the pool has then.
    fn make_handles(slf: &Bound<'_, Self>, limit: &Bound<'_, PyAny>) -> PyResult<usize> {
        let limit = saturating_int(limit)?;
        let mut this = slf.try_borrow_mut()?;
        let limit = usize::try_from(limit).map_err(|_| {
            PyValueError::new_err(format!(
                "{}: make_handles: limit must be >= 0, got {limit}",
                this.label
            ))
        })?;
        let n = this.core.num_blocks();
        for id in 0..n.min(limit) {
            this.handles.get(slf, n, id as BlockId)?;
        }
        Ok(this.handles.count())
    }

    /// Number of block handles created so far.
    fn num_handles(&self) -> usize {
        self.handles.count()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        if let Some(o) = &self.observers {
            visit.call(&o.evicted)?;
            visit.call(&o.allocated)?;
            visit.call(&o.accessed)?;
        }
        if let Some(s) = &self.removed_sink {
            visit.call(s)?;
        }
        for watcher in self.watchers.iter() {
            visit.call(watcher)?;
        }
        if let Some(link) = &self.elastic {
            visit.call(&link.owner)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.handles.clear();
        self.observers = None;
        self.removed_sink = None;
        self.watchers.clear();
        self.elastic = None;
    }
}
