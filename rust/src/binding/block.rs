//! `KVCacheBlock`, the block handle vLLM's managers hold, and the table of handles a pool
//! has handed out.

use super::convert::{items, wrong_type};
use super::pool::NativeBlockPool;
use crate::group_pool::{BlockId, NULL_BLOCK_ID};
use crate::routing::BlockRef;
use pyo3::exceptions::{PyIndexError, PyRuntimeError};
use pyo3::ffi;
use pyo3::intern;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList};
use std::sync::atomic::{AtomicPtr, Ordering};

/// A KV-cache block handle, call-compatible with vLLM's `KVCacheBlock`.
///
/// `block_id` and `is_null` never change, so they are stored as Python objects in the
/// frozen struct: PyO3 exposes such fields as struct members, which CPython reads as fast
/// as a `__slots__` attribute (vLLM's managers read `block_id` per block on hot paths).
/// Everything else is read from (and `ref_cnt` written to) the pool, the one source of
/// truth.
///
/// A handle holds no reference to its pool ([`PoolLink`]), so it cannot be part of a
/// reference cycle, and its pool untracks it from Python's cyclic GC as it makes it.
/// Handles beyond the ones a pool makes as it is built are made on first use, after the
/// engine core froze its heap (`gc.freeze()`); tracked, every one of them would be walked
/// by each collection of the generation it sits in: with a million handles out, a full
/// collection took 66-78 ms on the development machine, a stall in the scheduler that
/// stock vLLM, whose blocks are built before the freeze, never has.
#[pyclass(frozen, module = "hybrid_alloc._native", name = "KVCacheBlock")]
pub struct Block {
    pub(super) id: BlockId,
    /// The block's ID, scoped to its pool.
    #[pyo3(get)]
    block_id: Py<PyInt>,
    /// Whether this is the pool's null block (block 0).
    #[pyo3(get)]
    is_null: Py<PyBool>,
    /// The pool that owns this block, while it lives.
    pub(super) pool: PoolLink,
}

/// The address of the pool a handle belongs to, without a reference to it; null once the
/// pool has let go of its handles.
///
/// Invariant: the address is not null only while the pool object is alive. A pool makes
/// each of its handles in its [`HandleTable`] and keeps a reference to every one of them
/// there until the table lets them go ([`HandleTable::clear`], or the table's drop when
/// the pool is deallocated), which nulls every handle's address first. Both run with the
/// GIL held, as does every read, so no read sees an address whose pool is being freed.
pub(crate) struct PoolLink(AtomicPtr<ffi::PyObject>);

impl PoolLink {
    fn new(pool: &Bound<'_, NativeBlockPool>) -> Self {
        Self(AtomicPtr::new(pool.as_ptr()))
    }

    /// The pool's address (null once the pool let go of the handle).
    #[inline(always)]
    pub(crate) fn addr(&self) -> *mut ffi::PyObject {
        self.0.load(Ordering::Acquire)
    }

    /// The pool of block `id`, or a `RuntimeError` once the pool is gone.
    pub(crate) fn get<'py>(
        &self,
        py: Python<'py>,
        id: BlockId,
    ) -> PyResult<Bound<'py, NativeBlockPool>> {
        let gone = || {
            PyRuntimeError::new_err(format!(
                "block {id}: its pool is gone (the handle outlived the pool that made it)"
            ))
        };
        let ptr = self.addr();
        if ptr.is_null() {
            return Err(gone());
        }
        // SAFETY: `ptr` is not null, so by the invariant above the pool object it points
        // to has not been freed, and the GIL (`py`) keeps it from being freed while this
        // runs. A count of zero means its deallocation has begun (code run while its
        // `__dict__` is cleared, before its table lets go of the handles): taking a new
        // reference then would bring it back to life mid-teardown, so it counts as gone.
        // Otherwise `from_borrowed_ptr` takes a new reference, which keeps it alive after.
        let pool = unsafe {
            if ffi::Py_REFCNT(ptr) <= 0 {
                return Err(gone());
            }
            Bound::from_borrowed_ptr(py, ptr)
        };
        Ok(pool.cast_into::<NativeBlockPool>()?)
    }

    fn orphan(&self) {
        self.0.store(std::ptr::null_mut(), Ordering::Release);
    }
}

#[pymethods]
impl Block {
    #[getter]
    fn ref_cnt(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(self
            .pool
            .get(py, self.id)?
            .try_borrow()?
            .core
            .ref_cnt(self.id))
    }

    /// vLLM's managers write `block.ref_cnt += 1` on blocks they hold; the write goes to
    /// the pool's count (the core decides which writes are allowed).
    #[setter]
    fn set_ref_cnt(&self, py: Python<'_>, value: i64) -> PyResult<()> {
        let mut pool = self.pool.get(py, self.id)?.try_borrow_mut()?;
        let id = self.id;
        pool.operate(py, &[id], "set the reference count of", |core| {
            core.set_ref_cnt(id, value)
        })
    }

    /// The primary prefix-cache key (`BlockHashWithGroupId` bytes), or None.
    #[getter]
    fn block_hash<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let pool = self.pool.get(py, self.id)?.try_borrow()?;
        Ok(pool.core.block_hash(self.id).map(|k| PyBytes::new(py, k)))
    }

    #[getter]
    fn block_hash_num_tokens(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        let pool = self.pool.get(py, self.id)?.try_borrow()?;
        Ok(pool.core.block_hash_num_tokens(self.id))
    }

    #[getter]
    fn prev_free_block(&self, py: Python<'_>) -> PyResult<Option<Py<Block>>> {
        let pool = &self.pool.get(py, self.id)?;
        let prev = pool.try_borrow()?.core.queue().prev_of(self.id);
        prev.map(|id| NativeBlockPool::handle(pool, id)).transpose()
    }

    #[getter]
    fn next_free_block(&self, py: Python<'_>) -> PyResult<Option<Py<Block>>> {
        let pool = &self.pool.get(py, self.id)?;
        let next = pool.try_borrow()?.core.queue().next_of(self.id);
        next.map(|id| NativeBlockPool::handle(pool, id)).transpose()
    }

    fn __repr__(&self, py: Python<'_>) -> PyResult<String> {
        let pool = self.pool.get(py, self.id)?.try_borrow()?;
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
                o.id == self.id && o.pool.addr() == self.pool.addr()
            }
            Err(_) => false,
        }
    }

    /// The pool that owns this block (a `RuntimeError` once the pool is gone).
    #[getter]
    fn pool<'py>(&self, py: Python<'py>) -> PyResult<Bound<'py, NativeBlockPool>> {
        self.pool.get(py, self.id)
    }
}

/// How the binding names a pool to the core's routing rules: the pool a call is made on,
/// another pool of ours, or a pool of another kind, the latter two by the address of the
/// pool object (which the caller keeps alive while tokens are compared).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub(crate) enum PoolToken {
    This,
    Native(usize),
    Foreign(usize),
}

/// The block a handle names, with its pool as seen from the pool `this` (a `TypeError`
/// naming `label` and `op` if `obj` is not a handle).
#[inline(always)]
pub(crate) fn block_ref(
    this: &Bound<'_, NativeBlockPool>,
    label: &str,
    op: &str,
    obj: &Bound<'_, PyAny>,
) -> PyResult<BlockRef<PoolToken>> {
    match obj.cast::<Block>() {
        Ok(block) => Ok(handle_ref(this, block.get())),
        Err(_) => Err(wrong_type(label, op, "a KVCacheBlock of this pool", obj)),
    }
}

/// The block a handle names, with its pool as seen from the pool `this`.
#[inline(always)]
pub(crate) fn handle_ref(this: &Bound<'_, NativeBlockPool>, block: &Block) -> BlockRef<PoolToken> {
    let pool = block.pool.addr();
    BlockRef {
        pool: if pool == this.as_ptr() {
            PoolToken::This
        } else {
            PoolToken::Native(pool as usize)
        },
        id: block.id,
    }
}

/// The `block_id` of every block in `blocks` (a list or any iterable), in order, as a new
/// list: what `[blk.block_id for blk in blocks]` gives, at a reference count per handle
/// of this package (its stored int) instead of an attribute lookup. Any other object is
/// asked for its `block_id` attribute, so a group of vLLM's own blocks, or one that mixes
/// both kinds, reads as vLLM reads it (an object without one raises `AttributeError`).
///
/// vLLM's scheduler turns every scheduled request's new blocks into IDs at every step
/// (`KVCacheBlocks.get_block_ids`), a prompt's whole table when it is admitted: about
/// 10 ns a block as a list comprehension, which per-group pools' 16-token pages make
/// many.
#[pyfunction]
pub fn block_ids<'py>(blocks: &Bound<'py, PyAny>) -> PyResult<Bound<'py, PyList>> {
    let py = blocks.py();
    let items = items(blocks)?;
    let mut ids: Vec<Bound<'py, PyAny>> = Vec::with_capacity(items.size_hint().0);
    for item in items {
        let item = item?;
        match item.cast_exact::<Block>() {
            Ok(block) => ids.push(block.get().block_id.bind(py).clone().into_any()),
            Err(_) => ids.push(item.getattr(intern!(py, "block_id"))?),
        }
    }
    PyList::new(py, ids)
}

/// The handles a pool has handed to Python, by block ID: created on first use, then the
/// same object every time (vLLM compares blocks with `is`).
#[derive(Default)]
pub(crate) struct HandleTable {
    handles: Vec<Option<Py<Block>>>,
}

impl HandleTable {
    /// The handle of block `id` of `owner` (a pool of `num_blocks` blocks).
    #[inline]
    pub fn get(
        &mut self,
        owner: &Bound<'_, NativeBlockPool>,
        num_blocks: usize,
        id: BlockId,
    ) -> PyResult<Py<Block>> {
        let py = owner.py();
        let i = id as usize;
        if i >= num_blocks {
            return Err(PyIndexError::new_err(format!("block {id} is out of range")));
        }
        if i >= self.handles.len() {
            // Grow geometrically: handles are made as blocks are first handed out.
            let want = (i + 1).max(self.handles.len() * 2).min(num_blocks);
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
                pool: PoolLink::new(owner),
            },
        )?;
        // SAFETY: `h` is a live object that was just made (PyO3 makes every pyclass a GC
        // type, tracked from allocation), and untracking is idempotent (the dealloc
        // untracks again). Leaving it to reference counting alone is sound because a
        // handle cannot be part of a cycle: it refers only to an int and a bool, holds
        // its pool by address (`PoolLink`), and has no `__dict__` to which Python code
        // could add a reference.
        unsafe { ffi::PyObject_GC_UnTrack(h.as_ptr().cast()) };
        *slot = Some(h.clone_ref(py));
        Ok(h)
    }

    /// The handles of `ids`, as a list.
    pub fn list<'py>(
        &mut self,
        owner: &Bound<'py, NativeBlockPool>,
        num_blocks: usize,
        ids: &[BlockId],
    ) -> PyResult<Bound<'py, PyList>> {
        self.list_recording_ids(owner, num_blocks, ids, None)
    }

    /// The handles of `ids`, as a list; with `ints`, each handle's own `block_id` int is
    /// pushed there too, in the same pass.
    pub fn list_recording_ids<'py>(
        &mut self,
        owner: &Bound<'py, NativeBlockPool>,
        num_blocks: usize,
        ids: &[BlockId],
        mut ints: Option<&mut Vec<Py<PyInt>>>,
    ) -> PyResult<Bound<'py, PyList>> {
        let py = owner.py();
        let mut objs = Vec::with_capacity(ids.len());
        if let Some(ints) = ints.as_deref_mut() {
            ints.reserve(ids.len());
        }
        for &id in ids {
            let handle = self.get(owner, num_blocks, id)?;
            if let Some(ints) = ints.as_deref_mut() {
                ints.push(handle.get().block_id.clone_ref(py));
            }
            objs.push(handle);
        }
        PyList::new(py, objs)
    }

    /// Number of handles created so far.
    pub fn count(&self) -> usize {
        self.handles.iter().filter(|h| h.is_some()).count()
    }

    /// Heap bytes of the table (8 per block once every block was handed out).
    pub fn heap_bytes(&self) -> usize {
        self.handles.capacity() * std::mem::size_of::<Option<Py<Block>>>()
    }

    /// Let go of every handle, nulling its pool address first (the [`PoolLink`]
    /// invariant): a handle someone still holds then raises instead of reading a pool
    /// that may be gone.
    pub fn clear(&mut self) {
        for h in self.handles.iter_mut() {
            if let Some(handle) = h.take() {
                handle.get().pool.orphan();
            }
        }
    }
}

impl Drop for HandleTable {
    fn drop(&mut self) {
        self.clear();
    }
}
