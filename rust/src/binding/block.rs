//! `KVCacheBlock`, the block handle vLLM's managers hold, and the table of handles a pool
//! has handed out.

use super::convert::wrong_type;
use super::pool::NativeBlockPool;
use crate::group_pool::{BlockId, NULL_BLOCK_ID};
use crate::routing::BlockRef;
use pyo3::exceptions::PyIndexError;
use pyo3::prelude::*;
use pyo3::types::{PyBool, PyBytes, PyInt, PyList};
use pyo3::{PyTraverseError, PyVisit};

/// A KV-cache block handle, call-compatible with vLLM's `KVCacheBlock`.
///
/// `block_id`, `is_null` and `pool` never change, so they are stored as Python objects in
/// the frozen struct: PyO3 exposes such fields as struct members, which CPython reads as
/// fast as a `__slots__` attribute (vLLM's managers read `block_id` per block on hot paths).
/// Everything else is read from (and `ref_cnt` written to) the pool, the one source of
/// truth.
#[pyclass(frozen, module = "hybrid_alloc._native", name = "KVCacheBlock")]
pub struct Block {
    pub(super) id: BlockId,
    /// The block's ID, scoped to its pool.
    #[pyo3(get)]
    block_id: Py<PyInt>,
    /// Whether this is the pool's null block (block 0).
    #[pyo3(get)]
    is_null: Py<PyBool>,
    /// The pool that owns this block.
    #[pyo3(get)]
    pub(super) pool: Py<NativeBlockPool>,
}

#[pymethods]
impl Block {
    #[getter]
    fn ref_cnt(&self, py: Python<'_>) -> PyResult<u32> {
        Ok(self.pool.bind(py).try_borrow()?.core.ref_cnt(self.id))
    }

    /// vLLM's managers write `block.ref_cnt += 1` on blocks they hold; the write goes to
    /// the pool's count (the core decides which writes are allowed).
    #[setter]
    fn set_ref_cnt(&self, py: Python<'_>, value: i64) -> PyResult<()> {
        let mut pool = self.pool.bind(py).try_borrow_mut()?;
        let id = self.id;
        pool.operate(py, &[id], "set the reference count of", |core| {
            core.set_ref_cnt(id, value)
        })
    }

    /// The primary prefix-cache key (`BlockHashWithGroupId` bytes), or None.
    #[getter]
    fn block_hash<'py>(&self, py: Python<'py>) -> PyResult<Option<Bound<'py, PyBytes>>> {
        let pool = self.pool.bind(py).try_borrow()?;
        Ok(pool.core.block_hash(self.id).map(|k| PyBytes::new(py, k)))
    }

    #[getter]
    fn block_hash_num_tokens(&self, py: Python<'_>) -> PyResult<Option<u32>> {
        let pool = self.pool.bind(py).try_borrow()?;
        Ok(pool.core.block_hash_num_tokens(self.id))
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
    let pool = block.pool.as_ptr();
    BlockRef {
        pool: if pool == this.as_ptr() {
            PoolToken::This
        } else {
            PoolToken::Native(pool as usize)
        },
        id: block.id,
    }
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
                pool: owner.as_unbound().clone_ref(py),
            },
        )?;
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
        let mut objs = Vec::with_capacity(ids.len());
        for &id in ids {
            objs.push(self.get(owner, num_blocks, id)?);
        }
        PyList::new(owner.py(), objs)
    }

    /// Number of handles created so far.
    pub fn count(&self) -> usize {
        self.handles.iter().filter(|h| h.is_some()).count()
    }

    /// Heap bytes of the table (8 per block once every block was handed out).
    pub fn heap_bytes(&self) -> usize {
        self.handles.capacity() * std::mem::size_of::<Option<Py<Block>>>()
    }

    pub fn traverse(&self, visit: &PyVisit<'_>) -> Result<(), PyTraverseError> {
        for h in self.handles.iter().flatten() {
            visit.call(h)?;
        }
        Ok(())
    }

    pub fn clear(&mut self) {
        self.handles.iter_mut().for_each(|h| *h = None);
    }
}
