//! The PyO3 binding: the only module of the crate that knows about Python.
//!
//! `NativeBlockPool` wraps one [`GroupPool`] and is subclassed in Python by
//! `hybrid_alloc.block_pool.BlockPool`, which adds what needs vLLM's Python objects
//! (building `BlockStored` events from a request, logging). `KVCacheBlock` is the block
//! handle vLLM's managers hold: created the first time a block is handed to Python and
//! then reused, so the same block is the same object every time. Its `ref_cnt`,
//! `block_hash` and free-list links are read from (and `ref_cnt` written to) the pool, so
//! there is one source of truth.
//!
//! Every bulk operation crosses the boundary once: a list of blocks in, a list out.

use crate::error::PoolError;
use crate::group_pool::{BlockId, FullBlock, GroupPool, NULL_BLOCK_ID};
use crate::prefix_cache::make_key;
use pyo3::exceptions::{PyIndexError, PyRuntimeError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList, PySlice, PyTuple};
use pyo3::{PyTraverseError, PyVisit};
use rustc_hash::FxHashMap;

fn pool_err(label: &str, e: PoolError) -> PyErr {
    PyValueError::new_err(format!("{label}: {e}"))
}

/// A KV-cache block handle, call-compatible with vLLM's `KVCacheBlock`.
///
/// `block_id`, `is_null` and `pool` never change, so they are stored as Python objects in
/// the frozen struct: PyO3 exposes such fields as struct members, which CPython reads as
/// fast as a `__slots__` attribute (vLLM's managers read `block_id` per block on hot paths).
#[pyclass(frozen, module = "hybrid_alloc._native", name = "KVCacheBlock")]
pub struct Block {
    id: BlockId,
    /// The block's ID, scoped to its pool.
    #[pyo3(get)]
    block_id: Py<PyInt>,
    /// Whether this is the pool's null block (block 0).
    #[pyo3(get)]
    is_null: Py<PyBool>,
    /// The pool that owns this block.
    #[pyo3(get)]
    pool: Py<NativeBlockPool>,
}

#[pymethods]
impl Block {
    #[getter]
    fn ref_cnt(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(self.pool.bind(py).try_borrow()?.core.ref_cnt(self.id))
    }

    /// vLLM's managers write `block.ref_cnt += 1` on blocks they hold; the write goes to
    /// the pool's count. Only held, non-null blocks may be set, to one or more.
    #[setter]
    fn set_ref_cnt(&self, py: Python<'_>, value: i64) -> PyResult<()> {
        let mut guard = self.pool.bind(py).try_borrow_mut()?;
        let pool = &mut *guard;
        pool.core
            .set_ref_cnt(self.id, value)
            .map_err(|e| pool_err(&pool.label, e))
    }

    /// The primary prefix-cache key (`BlockHashWithGroupId` bytes), or None.
    #[getter]
    fn block_hash<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let pool = self.pool.bind(py).try_borrow()?;
        Ok(pool.core.block_hash(self.id).map(|k| PyBytes::new(py, k)))
    }

    #[getter]
    fn block_hash_num_tokens(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        Ok(self
            .pool
            .bind(py)
            .try_borrow()?
            .core
            .block_hash_num_tokens(self.id))
    }

    #[getter]
    fn prev_free_block(&self, py: Python<'_>) -> PyResult<Option<Py<Block>>> {
        let pool = self.pool.bind(py);
        let prev = pool.try_borrow()?.core.queue().prev_of(self.id);
        prev.map(|id| NativeBlockPool::handle(pool, id)).transpose()
    }

    #[getter]
    fn next_free_block(&self, py: Python<'_>) -> PyResult<Option<Py<Block>>> {
        let pool = self.pool.bind(py);
        let next = pool.try_borrow()?.core.queue().next_of(self.id);
        next.map(|id| NativeBlockPool::handle(pool, id)).transpose()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let pool = self.pool.bind(py).try_borrow()?;
        let hash = match pool.core.block_hash(self.id) {
            Some(k) => PyBytes::new(py, k).repr()?.to_string(),
            None => "None".into(),
        };
        let tokens = match pool.core.block_hash_num_tokens(self.id) {
            Some(t) => t.to_string(),
            None => "None".into(),
        };
        Ok(format!(
            "KVCacheBlock(block_id={}, ref_cnt={}, block_hash={hash}, block_hash_num_tokens={tokens}, pool={:?})",
            self.id,
            pool.core.ref_cnt(self.id),
            pool.label
        ))
    }

    /// Two handles are equal when they are the same block of the same pool (there is one
    /// handle per block, so this is identity). Like vLLM's blocks, handles are unhashable.
    fn __eq__(&self, other: &Bound<'_, PyAny>) -> bool {
        match other.cast::<Block>() {
            Ok(o) => {
                let o = o.get();
                o.id == self.id && o.pool.as_ptr() == self.pool.as_ptr()
            }
            Err(_) => false,
        }
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.pool)
    }
}

/// Where each block of a mixed list belongs.
struct SortedBlocks<'py> {
    own: Vec<BlockId>,
    /// Blocks of other pools, grouped by pool in first-seen order.
    others: Vec<(Bound<'py, PyAny>, Vec<Bound<'py, PyAny>>)>,
}

/// Insertion-ordered reuse watchers (vLLM keeps them in a dict).
#[derive(Default)]
struct Watchers {
    next_seq: u64,
    by_block: FxHashMap<BlockId, (u64, Py<PyAny>)>,
}

impl Watchers {
    fn is_empty(&self) -> bool {
        self.by_block.is_empty()
    }

    fn set(&mut self, id: BlockId, cb: Py<PyAny>) {
        let seq = match self.by_block.get(&id) {
            Some((seq, _)) => *seq,
            None => {
                self.next_seq += 1;
                self.next_seq
            }
        };
        self.by_block.insert(id, (seq, cb));
    }

    fn take(&mut self, id: BlockId) -> Option<Py<PyAny>> {
        self.by_block.remove(&id).map(|(_, cb)| cb)
    }

    fn take_all(&mut self) -> Vec<(BlockId, Py<PyAny>)> {
        let mut all: Vec<_> = self
            .by_block
            .drain()
            .map(|(id, (seq, cb))| (seq, id, cb))
            .collect();
        all.sort_by_key(|(seq, _, _)| *seq);
        all.into_iter().map(|(_, id, cb)| (id, cb)).collect()
    }
}

/// The native half of `hybrid_alloc.BlockPool`: one pool of blocks.
#[pyclass(subclass, module = "hybrid_alloc._native", name = "NativeBlockPool")]
pub struct NativeBlockPool {
    core: GroupPool,
    handles: Vec<Option<Py<Block>>>,
    hash_block_size: usize,
    enable_kv_cache_events: bool,
    metrics_collector: Option<Py<PyAny>>,
    watchers: Watchers,
    /// Called with a list of removed keys when events are on (builds `BlockRemoved`).
    removed_sink: Option<Py<PyAny>>,
    label: String,
}

impl NativeBlockPool {
    /// The handle of block `id`, created on first use.
    fn handle(slf: &Bound<'_, Self>, id: BlockId) -> PyResult<Py<Block>> {
        let py = slf.py();
        let mut this = slf.try_borrow_mut()?;
        this.handle_in(slf, py, id)
    }

    fn handle_in(
        &mut self,
        owner: &Bound<'_, Self>,
        py: Python<'_>,
        id: BlockId,
    ) -> PyResult<Py<Block>> {
        let i = id as usize;
        if i >= self.core.num_blocks() {
            return Err(PyIndexError::new_err(format!("block {id} is out of range")));
        }
        if i >= self.handles.len() {
            // Grow geometrically: handles are made as blocks are first handed out.
            let want = (i + 1)
                .max(self.handles.len() * 2)
                .min(self.core.num_blocks());
            self.handles.resize_with(want, || None);
        }
        let slot = &mut self.handles[i];
        if let Some(h) = slot {
            return Ok(h.clone_ref(py));
        }
        let h = Py::new(
            py,
            Block {
                id,
                block_id: id.into_pyobject(py)?.unbind(),
                is_null: PyBool::new(py, id == NULL_BLOCK_ID).to_owned().unbind(),
                pool: owner.as_unbound().clone_ref(py),
            },
        )?;
        *slot = Some(h.clone_ref(py));
        Ok(h)
    }

    fn handles_list<'py>(
        &mut self,
        owner: &Bound<'py, Self>,
        ids: &[BlockId],
    ) -> PyResult<Bound<'py, PyList>> {
        let py = owner.py();
        let mut objs = Vec::with_capacity(ids.len());
        for &id in ids {
            objs.push(self.handle_in(owner, py, id)?);
        }
        PyList::new(py, objs)
    }

    fn err(&self, e: PoolError) -> PyErr {
        pool_err(&self.label, e)
    }

    /// The block ID of a handle of this pool.
    fn own_id(
        &self,
        owner: &Bound<'_, Self>,
        obj: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<BlockId> {
        match obj.cast::<Block>() {
            Ok(b) => {
                let b = b.get();
                if b.pool.as_ptr() == owner.as_ptr() {
                    Ok(b.id)
                } else {
                    Err(PyValueError::new_err(format!(
                        "{}: {op}: block {} belongs to another pool",
                        self.label, b.id
                    )))
                }
            }
            Err(_) => Err(PyTypeError::new_err(format!(
                "{}: {op}: expected a KVCacheBlock of this pool, got {}",
                self.label,
                obj.get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))),
        }
    }

    /// Block IDs of an iterable of handles that must all belong to this pool.
    fn own_ids(
        &self,
        owner: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        op: &str,
    ) -> PyResult<Vec<BlockId>> {
        let mut ids = Vec::new();
        if let Ok(list) = blocks.cast::<PyList>() {
            ids.reserve(list.len());
            for item in list.iter() {
                ids.push(self.own_id(owner, &item, op)?);
            }
        } else {
            for item in blocks.try_iter()? {
                ids.push(self.own_id(owner, &item?, op)?);
            }
        }
        Ok(ids)
    }

    /// Sort an iterable of blocks into this pool's IDs and other pools' blocks (vLLM's
    /// deferred frees can mix pools; each block is routed through its `pool`).
    fn sort_blocks<'py>(
        &self,
        owner: &Bound<'py, Self>,
        blocks: &Bound<'py, PyAny>,
    ) -> PyResult<SortedBlocks<'py>> {
        let mut sorted = SortedBlocks {
            own: Vec::new(),
            others: Vec::new(),
        };
        let mut visit = |item: Bound<'py, PyAny>| -> PyResult<()> {
            if let Ok(b) = item.cast::<Block>() {
                let bg = b.get();
                if bg.pool.as_ptr() == owner.as_ptr() {
                    sorted.own.push(bg.id);
                    return Ok(());
                }
            }
            let pool = match item.getattr("pool") {
                Ok(p) if !p.is_none() => p,
                _ => {
                    return Err(PyTypeError::new_err(format!(
                        "{}: free_blocks: expected KVCacheBlock objects, got {}",
                        self.label,
                        item.get_type()
                            .name()
                            .map(|n| n.to_string())
                            .unwrap_or_default()
                    )));
                }
            };
            if pool.as_ptr() == owner.as_ptr() {
                // A foreign block type that claims this pool: refuse rather than guess.
                return Err(PyTypeError::new_err(format!(
                    "{}: free_blocks: a block claims this pool but is not one of its handles",
                    self.label
                )));
            }
            match sorted.others.iter_mut().find(|(p, _)| p.is(&pool)) {
                Some((_, v)) => v.push(item),
                None => sorted.others.push((pool, vec![item])),
            }
            Ok(())
        };
        if let Ok(list) = blocks.cast::<PyList>() {
            for item in list.iter() {
                visit(item)?;
            }
        } else {
            for item in blocks.try_iter()? {
                visit(item?)?;
            }
        }
        Ok(sorted)
    }

    fn emit_removed(slf: &Bound<'_, Self>, keys: Vec<Vec<u8>>) -> PyResult<()> {
        if keys.is_empty() {
            return Ok(());
        }
        let sink = slf
            .try_borrow()?
            .removed_sink
            .as_ref()
            .map(|s| s.clone_ref(slf.py()));
        if let Some(sink) = sink {
            let py = slf.py();
            let list = PyList::new(py, keys.iter().map(|k| PyBytes::new(py, k)))?;
            sink.call1(py, (list,))?;
        }
        Ok(())
    }

    fn collector(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.metrics_collector.as_ref().map(|c| c.clone_ref(py))
    }

    /// Evict one block's keys, with vLLM's metrics call first. Returns whether any key
    /// was removed.
    fn evict_one(slf: &Bound<'_, Self>, id: BlockId) -> PyResult<bool> {
        let py = slf.py();
        let collector = slf.try_borrow()?.collector(py);
        if let Some(c) = collector {
            let h = Self::handle(slf, id)?;
            c.call_method1(py, "on_block_evicted", (h,))?;
        }
        let mut keys = Vec::new();
        let n = {
            let mut this = slf.try_borrow_mut()?;
            let events = this.removed_sink.is_some();
            let r = this.core.evict(id, |_, k| {
                if events {
                    keys.push(k.to_vec())
                }
            });
            r.map_err(|e| this.err(e))?
        };
        Self::emit_removed(slf, keys)?;
        Ok(n > 0)
    }
}

#[pymethods]
impl NativeBlockPool {
    #[new]
    #[pyo3(signature = (num_gpu_blocks, enable_caching, hash_block_size, enable_kv_cache_events=false, metrics_collector=None, medium=None, label=None))]
    fn new(
        num_gpu_blocks: &Bound<'_, PyAny>,
        enable_caching: bool,
        hash_block_size: i64,
        enable_kv_cache_events: bool,
        metrics_collector: Option<Py<PyAny>>,
        medium: Option<&Bound<'_, PyAny>>,
        label: Option<String>,
    ) -> PyResult<Self> {
        // `medium` belongs to the Python layer (events); accepted here so that the class
        // takes vLLM's constructor arguments as they are.
        let _ = medium;
        let label = label.unwrap_or_else(|| "BlockPool".to_string());
        let n: i64 = num_gpu_blocks.extract().map_err(|_| {
            PyTypeError::new_err(format!(
                "{label}: num_gpu_blocks must be an int, got {}",
                num_gpu_blocks
                    .get_type()
                    .name()
                    .map(|n| n.to_string())
                    .unwrap_or_default()
            ))
        })?;
        if n <= 0 {
            return Err(PyValueError::new_err(format!(
                "{label}: num_gpu_blocks must be positive, got {n}"
            )));
        }
        if hash_block_size <= 0 {
            return Err(PyValueError::new_err(format!(
                "{label}: hash_block_size must be positive, got {hash_block_size}"
            )));
        }
        let core = GroupPool::new(n as usize, enable_caching).map_err(|e| pool_err(&label, e))?;
        Ok(NativeBlockPool {
            core,
            handles: Vec::new(),
            hash_block_size: hash_block_size as usize,
            enable_kv_cache_events,
            metrics_collector,
            watchers: Watchers::default(),
            removed_sink: None,
            label,
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
    fn hash_block_size(&self) -> usize {
        self.hash_block_size
    }

    #[getter]
    fn enable_kv_cache_events(&self) -> bool {
        self.enable_kv_cache_events
    }

    #[getter]
    fn metrics_collector(&self, py: Python<'_>) -> Option<Py<PyAny>> {
        self.collector(py)
    }

    #[setter]
    fn set_metrics_collector(&mut self, collector: Option<Py<PyAny>>) {
        self.metrics_collector = collector;
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

    fn get_num_free_blocks(&self) -> usize {
        self.core.num_free()
    }

    fn get_usage(&self) -> f64 {
        self.core.usage()
    }

    /// Take `num_blocks` blocks from the front of the free queue (evicting their cached
    /// hashes) and give each one reference.
    fn get_new_blocks<'py>(
        slf: &Bound<'py, Self>,
        num_blocks: i64,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let mut this = slf.try_borrow_mut()?;
        if num_blocks < 0 {
            return Err(PyValueError::new_err(format!(
                "{}: cannot get a negative number of blocks ({num_blocks})",
                this.label
            )));
        }
        let n = num_blocks as usize;
        let events = this.removed_sink.is_some();
        if this.watchers.is_empty() && this.metrics_collector.is_none() {
            let mut keys = Vec::new();
            let ids = this
                .core
                .allocate(n, |_, k| {
                    if events {
                        keys.push(k.to_vec())
                    }
                })
                .map_err(|e| pool_err(&this.label, e))?;
            let list = this.handles_list(slf, &ids)?;
            drop(this);
            Self::emit_removed(slf, keys)?;
            return Ok(list);
        }
        // Slow path, in vLLM's order: pop, tell reuse watchers, then per block the
        // metrics eviction, the hash eviction and the allocation.
        let ids = this
            .core
            .pop_free(n)
            .map_err(|e| pool_err(&this.label, e))?;
        let list = this.handles_list(slf, &ids)?;
        let watchers: Vec<(BlockId, Py<PyAny>)> = ids
            .iter()
            .filter_map(|&id| this.watchers.take(id).map(|cb| (id, cb)))
            .collect();
        let collector = this.collector(py);
        let caching = this.core.enable_caching();
        drop(this);
        for (id, cb) in watchers {
            cb.call1(py, (Self::handle(slf, id)?,))?;
        }
        let mut keys = Vec::new();
        for (i, &id) in ids.iter().enumerate() {
            let h = list.get_item(i)?;
            if caching {
                if let Some(c) = &collector {
                    c.call_method1(py, "on_block_evicted", (&h,))?;
                }
            }
            slf.try_borrow_mut()?.core.claim_popped(&[id], |_, k| {
                if events {
                    keys.push(k.to_vec())
                }
            });
            if let Some(c) = &collector {
                c.call_method1(py, "on_block_allocated", (&h,))?;
            }
        }
        Self::emit_removed(slf, keys)?;
        Ok(list)
    }

    /// Drop one reference to each block; blocks reaching zero become free (uncached ones
    /// reused first, cached ones last). Blocks of other pools are passed to their own pool.
    fn free_blocks(slf: &Bound<'_, Self>, ordered_blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let sorted = slf.try_borrow()?.sort_blocks(slf, ordered_blocks)?;
        {
            let mut this = slf.try_borrow_mut()?;
            this.core
                .free(&sorted.own)
                .map_err(|e| pool_err(&this.label, e))?;
        }
        for (pool, blocks) in sorted.others {
            pool.call_method1("free_blocks", (PyList::new(slf.py(), blocks)?,))?;
        }
        Ok(())
    }

    /// Add one reference to each block (a prefix-cache hit), taking free ones out of the
    /// free queue. The null block is passed over.
    fn touch(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<()> {
        let py = slf.py();
        let (ids, collector) = {
            let mut this = slf.try_borrow_mut()?;
            let ids = this.own_ids(slf, blocks, "touch")?;
            this.core
                .touch(&ids)
                .map_err(|e| pool_err(&this.label, e))?;
            (ids, this.collector(py))
        };
        if let Some(c) = collector {
            for id in ids {
                c.call_method1(py, "on_block_accessed", (Self::handle(slf, id)?,))?;
            }
        }
        Ok(())
    }

    /// Release references to blocks whose contents stay readable until the pool hands
    /// them out again; `on_reuse(block)` is called then.
    fn unpin_blocks(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        on_reuse: Py<PyAny>,
    ) -> PyResult<()> {
        let py = slf.py();
        let mut this = slf.try_borrow_mut()?;
        let ids = this.own_ids(slf, blocks, "unpin_blocks")?;
        this.core
            .unpin(&ids)
            .map_err(|e| pool_err(&this.label, e))?;
        for id in ids {
            this.watchers.set(id, on_reuse.clone_ref(py));
        }
        Ok(())
    }

    fn is_block_writable(slf: &Bound<'_, Self>, block: &Bound<'_, PyAny>) -> PyResult<bool> {
        let this = slf.try_borrow()?;
        let id = this.own_id(slf, block, "is_block_writable")?;
        Ok(this.core.is_writable(id))
    }

    /// The first cached block for `block_hash` in each listed group, or None if any group
    /// misses.
    fn get_cached_block<'py>(
        slf: &Bound<'py, Self>,
        block_hash: &[u8],
        kv_cache_group_ids: &Bound<'py, PyAny>,
    ) -> PyResult<Option<Bound<'py, PyList>>> {
        let mut this = slf.try_borrow_mut()?;
        let mut key = Vec::with_capacity(block_hash.len() + 4);
        let mut ids: Vec<BlockId> = Vec::with_capacity(4);
        let mut visit = |gid: u32| -> bool {
            make_key(&mut key, block_hash, gid);
            match this.core.lookup(&key) {
                Some(id) => {
                    ids.push(id);
                    true
                }
                None => false,
            }
        };
        if let Ok(list) = kv_cache_group_ids.cast::<PyList>() {
            for g in list.iter() {
                if !visit(g.extract::<u32>()?) {
                    return Ok(None);
                }
            }
        } else {
            for g in kv_cache_group_ids.try_iter()? {
                if !visit(g?.extract::<u32>()?) {
                    return Ok(None);
                }
            }
        }
        Ok(Some(this.handles_list(slf, &ids)?))
    }

    /// Batched prefix lookup: walk `block_hashes` from the start and stop at the first
    /// hash that misses in any group; at most `max_blocks` hashes. Returns one list of
    /// blocks per group (a tuple), all of the same length.
    fn get_cached_prefix<'py>(
        slf: &Bound<'py, Self>,
        block_hashes: &Bound<'py, PyAny>,
        kv_cache_group_ids: Vec<u32>,
        max_blocks: usize,
    ) -> PyResult<Bound<'py, PyTuple>> {
        let py = slf.py();
        let mut this = slf.try_borrow_mut()?;
        let groups = kv_cache_group_ids.len();
        let mut found: Vec<Vec<BlockId>> = vec![Vec::new(); groups];
        let mut key = Vec::new();
        let mut row: Vec<BlockId> = Vec::with_capacity(groups);
        let mut step = |h: &Bound<'py, PyAny>| -> PyResult<bool> {
            let bytes = h.cast::<PyBytes>()?.as_bytes();
            // A hash counts only if every group has it: look all up before keeping any.
            row.clear();
            for &gid in &kv_cache_group_ids {
                make_key(&mut key, bytes, gid);
                match this.core.lookup(&key) {
                    Some(id) => row.push(id),
                    None => return Ok(false),
                }
            }
            for (list, &id) in found.iter_mut().zip(&row) {
                list.push(id);
            }
            Ok(true)
        };
        let mut count = 0usize;
        if let Ok(list) = block_hashes.cast::<PyList>() {
            for h in list.iter() {
                if count >= max_blocks || !step(&h)? {
                    break;
                }
                count += 1;
            }
        } else {
            for h in block_hashes.try_iter()? {
                if count >= max_blocks || !step(&h?)? {
                    break;
                }
                count += 1;
            }
        }
        let mut lists = Vec::with_capacity(groups);
        for ids in &found {
            lists.push(this.handles_list(slf, ids)?);
        }
        PyTuple::new(py, lists)
    }

    /// The core of `cache_full_blocks` (events are built by the Python layer): cache
    /// `blocks[num_cached_blocks:num_full_blocks]` under `block_hashes` at the same
    /// positions, skipping null and masked-out blocks.
    #[pyo3(signature = (blocks, block_hashes, num_cached_blocks, num_full_blocks, block_size, kv_cache_group_id, block_mask=None))]
    #[allow(clippy::too_many_arguments)]
    fn _cache_full_blocks(
        slf: &Bound<'_, Self>,
        blocks: &Bound<'_, PyAny>,
        block_hashes: &Bound<'_, PyAny>,
        num_cached_blocks: i64,
        num_full_blocks: i64,
        block_size: i64,
        kv_cache_group_id: u32,
        block_mask: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        if num_cached_blocks >= num_full_blocks {
            return Ok(());
        }
        let label = slf.try_borrow()?.label.clone();
        if num_cached_blocks < 0 || block_size <= 0 {
            return Err(PyValueError::new_err(format!(
                "{label}: cache_full_blocks: invalid num_cached_blocks={num_cached_blocks} or block_size={block_size}"
            )));
        }
        let span = (num_full_blocks - num_cached_blocks) as usize;
        let mask: Option<Vec<bool>> = block_mask.map(|m| m.extract()).transpose()?;
        if let Some(m) = &mask {
            if m.len() != span {
                return Err(PyValueError::new_err(format!(
                    "{label}: cache_full_blocks: block_mask has {} entries for {span} blocks",
                    m.len()
                )));
            }
        }
        // Gather (block, hash, tokens) first; nothing changes until all are valid.
        let mut picked: Vec<(BlockId, usize, usize, u32)> = Vec::with_capacity(span);
        let mut arena: Vec<u8> = Vec::new();
        {
            let this = slf.try_borrow()?;
            for k in 0..span {
                let i = num_cached_blocks as usize + k;
                let item = blocks.get_item(i)?;
                let id = this.own_id(slf, &item, "cache_full_blocks")?;
                if id == NULL_BLOCK_ID || mask.as_ref().is_some_and(|m| !m[k]) {
                    continue;
                }
                let h = block_hashes.get_item(i)?;
                let bytes = h.cast::<PyBytes>()?.as_bytes();
                let start = arena.len();
                arena.extend_from_slice(bytes);
                let tokens = u32::try_from((i as i64 + 1) * block_size).map_err(|_| {
                    PyValueError::new_err(format!("{label}: token count overflows"))
                })?;
                picked.push((id, start, arena.len(), tokens));
            }
        }
        let full: Vec<FullBlock<'_>> = picked
            .iter()
            .map(|&(block, s, e, num_tokens)| FullBlock {
                block,
                block_hash: &arena[s..e],
                num_tokens,
            })
            .collect();
        let mut keys = Vec::new();
        {
            let mut this = slf.try_borrow_mut()?;
            let events = this.removed_sink.is_some();
            let r = this
                .core
                .cache_full_blocks(&full, kv_cache_group_id, |_, k| {
                    if events {
                        keys.push(k.to_vec())
                    }
                });
            r.map_err(|e| pool_err(&label, e))?;
        }
        Self::emit_removed(slf, keys)
    }

    /// vLLM's `_insert_block_hash`.
    #[pyo3(signature = (block_hash_with_group_id, block, num_tokens=None))]
    fn _insert_block_hash(
        slf: &Bound<'_, Self>,
        block_hash_with_group_id: &[u8],
        block: &Bound<'_, PyAny>,
        num_tokens: Option<u32>,
    ) -> PyResult<()> {
        let mut this = slf.try_borrow_mut()?;
        let id = this.own_id(slf, block, "_insert_block_hash")?;
        this.core
            .insert_hash(block_hash_with_group_id, id, num_tokens)
            .map_err(|e| pool_err(&this.label, e))
    }

    /// vLLM's `_remove_cached_block_hashes`: unlink every key of `block` and return the
    /// keys removed (no events; the caller emits them).
    fn _remove_cached_block_hashes<'py>(
        slf: &Bound<'py, Self>,
        block: &Bound<'py, PyAny>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = slf.py();
        let mut this = slf.try_borrow_mut()?;
        let id = this.own_id(slf, block, "_remove_cached_block_hashes")?;
        let mut keys = Vec::new();
        this.core
            .evict(id, |_, k| keys.push(PyBytes::new(py, k)))
            .map_err(|e| pool_err(&this.label, e))?;
        PyList::new(py, keys)
    }

    /// Emit `BlockRemoved` events for keys (when events are on).
    fn _emit_block_removed_events(slf: &Bound<'_, Self>, keys: Vec<Vec<u8>>) -> PyResult<()> {
        Self::emit_removed(slf, keys)
    }

    /// Whether `key` maps to block `block_id`.
    fn _hash_maps_to(&self, key: &[u8], block_id: i64) -> PyResult<bool> {
        let id = self.core.check_id(block_id).map_err(|e| self.err(e))?;
        Ok(self.core.cache().contains(key, id))
    }

    /// The extra (non-primary) keys of a block: vLLM's `cached_block_hashes_by_block`.
    fn _extra_block_hashes<'py>(
        &self,
        py: Python<'py>,
        block_id: i64,
    ) -> PyResult<Vec<Bound<'py, PyBytes>>> {
        let id = self.core.check_id(block_id).map_err(|e| self.err(e))?;
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

    /// vLLM's private `_maybe_evict_cached_block`, used by its Mamba manager.
    fn _maybe_evict_cached_block(
        slf: &Bound<'_, Self>,
        block: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let id = slf
            .try_borrow()?
            .own_id(slf, block, "_maybe_evict_cached_block")?;
        Self::evict_one(slf, id)
    }

    /// Re-point `src_block`'s prefix-cache entries to `dst_block` (no events).
    fn move_block_hashes(
        slf: &Bound<'_, Self>,
        src_block: &Bound<'_, PyAny>,
        dst_block: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let mut this = slf.try_borrow_mut()?;
        let src = this.own_id(slf, src_block, "move_block_hashes")?;
        let dst = this.own_id(slf, dst_block, "move_block_hashes")?;
        this.core
            .move_hashes(src, dst)
            .map_err(|e| pool_err(&this.label, e))
    }

    /// Evict blocks from the prefix cache by ID (IDs of this pool). Every ID is checked
    /// before any block is evicted. Referenced blocks stay allocated.
    fn evict_blocks(slf: &Bound<'_, Self>, block_ids: &Bound<'_, PyAny>) -> PyResult<()> {
        let mut ids = Vec::new();
        {
            let this = slf.try_borrow()?;
            for item in block_ids.try_iter()? {
                let item = item?;
                let raw: i64 = item.extract().map_err(|_| {
                    PyTypeError::new_err(format!(
                        "{}: evict_blocks: block IDs must be ints, got {}",
                        this.label,
                        item.get_type()
                            .name()
                            .map(|n| n.to_string())
                            .unwrap_or_default()
                    ))
                })?;
                ids.push(this.core.check_id(raw).map_err(|e| this.err(e))?);
            }
        }
        if slf.try_borrow()?.metrics_collector.is_some() {
            // vLLM tells the metrics collector before each eviction: go block by block.
            for id in ids {
                Self::evict_one(slf, id)?;
            }
            return Ok(());
        }
        let mut keys = Vec::new();
        {
            let mut guard = slf.try_borrow_mut()?;
            let this = &mut *guard;
            let events = this.removed_sink.is_some();
            for id in ids {
                this.core
                    .evict(id, |_, k| {
                        if events {
                            keys.push(k.to_vec())
                        }
                    })
                    .map_err(|e| pool_err(&this.label, e))?;
            }
        }
        Self::emit_removed(slf, keys)
    }

    /// How many of `blocks` are free but cached (count 0, not the null block): blocks a
    /// prefix hit would take out of the free queue. vLLM's managers compute this per block
    /// in Python on every admission; this is the same count in one call.
    fn count_evictable(slf: &Bound<'_, Self>, blocks: &Bound<'_, PyAny>) -> PyResult<usize> {
        let this = slf.try_borrow()?;
        let ids = this.own_ids(slf, blocks, "count_evictable")?;
        Ok(ids
            .into_iter()
            .filter(|&id| id != NULL_BLOCK_ID && this.core.ref_cnt(id) == 0)
            .count())
    }

    /// Clear the prefix cache if no block is in use; tell every reuse watcher. Returns
    /// whether it did (the Python layer logs, resets metrics and emits the event).
    fn _reset_prefix_cache(slf: &Bound<'_, Self>) -> PyResult<bool> {
        let py = slf.py();
        let watchers = {
            let mut this = slf.try_borrow_mut()?;
            if !this.core.reset_prefix_cache() {
                return Ok(false);
            }
            this.watchers.take_all()
        };
        for (id, cb) in watchers {
            cb.call1(py, (Self::handle(slf, id)?,))?;
        }
        Ok(true)
    }

    /// The handle of block `block_id`.
    fn _block(slf: &Bound<'_, Self>, block_id: i64) -> PyResult<Py<Block>> {
        let id = {
            let this = slf.try_borrow()?;
            this.core.check_id(block_id).map_err(|e| this.err(e))?
        };
        Self::handle(slf, id)
    }

    /// A sequence view of every block, indexable by ID (vLLM's `pool.blocks`).
    fn _block_table(slf: &Bound<'_, Self>) -> BlockTable {
        BlockTable {
            pool: slf.as_unbound().clone_ref(slf.py()),
        }
    }

    /// A view of the free queue (vLLM's `pool.free_block_queue`).
    fn _free_queue_view(slf: &Bound<'_, Self>) -> FreeQueueView {
        FreeQueueView {
            pool: slf.as_unbound().clone_ref(slf.py()),
        }
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
        self.core.per_block_heap_bytes()
            + self.handles.capacity() * std::mem::size_of::<Option<Py<Block>>>()
    }

    /// Number of block handles created so far.
    fn num_handles(&self) -> usize {
        self.handles.iter().filter(|h| h.is_some()).count()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for h in self.handles.iter().flatten() {
            visit.call(h)?;
        }
        if let Some(c) = &self.metrics_collector {
            visit.call(c)?;
        }
        if let Some(s) = &self.removed_sink {
            visit.call(s)?;
        }
        for (_, cb) in self.watchers.by_block.values() {
            visit.call(cb)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        for h in self.handles.iter_mut() {
            *h = None;
        }
        self.metrics_collector = None;
        self.removed_sink = None;
        self.watchers = Watchers::default();
    }
}

/// `pool.blocks`: every block of a pool, indexable by ID.
#[pyclass(frozen, module = "hybrid_alloc._native", sequence)]
pub struct BlockTable {
    pool: Py<NativeBlockPool>,
}

#[pymethods]
impl BlockTable {
    fn __len__(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.pool.bind(py).try_borrow()?.core.num_blocks())
    }

    /// `blocks[i]` (negative indices count from the end) or `blocks[a:b:c]` (a list).
    fn __getitem__<'py>(&self, py: Python<'py>, index: &Bound<'py, PyAny>) -> PyResult<Py<PyAny>> {
        let pool = self.pool.bind(py);
        let n = pool.try_borrow()?.core.num_blocks() as isize;
        if let Ok(slice) = index.cast::<PySlice>() {
            let ind = slice.indices(n)?;
            let ids: Vec<BlockId> = (0..ind.slicelength)
                .map(|k| (ind.start + k as isize * ind.step) as BlockId)
                .collect();
            let list = pool.try_borrow_mut()?.handles_list(pool, &ids)?;
            return Ok(list.into_any().unbind());
        }
        let index: isize = index.extract()?;
        let i = if index < 0 { index + n } else { index };
        if i < 0 || i >= n {
            return Err(PyIndexError::new_err(format!(
                "block index {index} out of range for a pool of {n} blocks"
            )));
        }
        Ok(NativeBlockPool::handle(pool, i as BlockId)?.into_any())
    }

    fn __iter__<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyAny>> {
        let pool = self.pool.bind(py);
        let n = pool.try_borrow()?.core.num_blocks() as BlockId;
        let ids: Vec<BlockId> = (0..n).collect();
        let list = pool.try_borrow_mut()?.handles_list(pool, &ids)?;
        list.try_iter().map(|it| it.into_any())
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.pool)
    }
}

/// `pool.free_block_queue`: the free blocks in eviction order.
#[pyclass(frozen, module = "hybrid_alloc._native")]
pub struct FreeQueueView {
    pool: Py<NativeBlockPool>,
}

#[pymethods]
impl FreeQueueView {
    #[getter]
    fn num_free_blocks(&self, py: Python<'_>) -> PyResult<usize> {
        Ok(self.pool.bind(py).try_borrow()?.core.num_free())
    }

    fn get_all_free_blocks<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, PyList>> {
        let pool = self.pool.bind(py);
        let ids = pool.try_borrow()?.core.free_blocks_in_order();
        let list = pool.try_borrow_mut()?.handles_list(pool, &ids)?;
        Ok(list)
    }

    /// Iterate the free blocks after `cursor` (from the front if None), following the
    /// queue as it is at each step.
    #[pyo3(signature = (cursor=None))]
    fn iter_blocks_after(
        &self,
        py: Python<'_>,
        cursor: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<FreeQueueIter> {
        let pool = self.pool.bind(py);
        let start = match cursor {
            None => Cursor::Front,
            Some(c) => {
                let id = pool.try_borrow()?.own_id(pool, c, "iter_blocks_after")?;
                Cursor::After(id)
            }
        };
        Ok(FreeQueueIter {
            pool: self.pool.clone_ref(py),
            cursor: std::sync::Mutex::new(start),
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.pool)
    }
}

#[derive(Clone, Copy)]
enum Cursor {
    Front,
    After(BlockId),
    Done,
}

#[pyclass(frozen, module = "hybrid_alloc._native")]
pub struct FreeQueueIter {
    pool: Py<NativeBlockPool>,
    cursor: std::sync::Mutex<Cursor>,
}

#[pymethods]
impl FreeQueueIter {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<Block>>> {
        let pool = self.pool.bind(py);
        let mut cur = self
            .cursor
            .lock()
            .map_err(|_| PyRuntimeError::new_err("free queue iterator lock poisoned"))?;
        let next = {
            let p = pool.try_borrow()?;
            match *cur {
                Cursor::Front => p.core.queue().front(),
                Cursor::After(id) => p.core.queue().next_of(id),
                Cursor::Done => None,
            }
        };
        match next {
            Some(id) => {
                *cur = Cursor::After(id);
                Ok(Some(NativeBlockPool::handle(pool, id)?))
            }
            None => {
                *cur = Cursor::Done;
                Ok(None)
            }
        }
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.pool)
    }
}

#[pymodule]
fn _native(m: &Bound<'_, PyModule>) -> PyResult<()> {
    m.add_class::<Block>()?;
    m.add_class::<NativeBlockPool>()?;
    m.add_class::<BlockTable>()?;
    m.add_class::<FreeQueueView>()?;
    m.add_class::<FreeQueueIter>()?;
    m.add("__version__", env!("CARGO_PKG_VERSION"))?;
    Ok(())
}
