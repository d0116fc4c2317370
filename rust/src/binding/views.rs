//! Read views for the vLLM code that reaches into the stock pool's internals: the block
//! table (`pool.blocks`), the free queue (`pool.free_block_queue`) and its iterator.

use super::block::Block;
use super::convert::saturating_int;
use super::pool::NativeBlockPool;
use crate::free_queue::QueueCursor;
use crate::group_pool::BlockId;
use pyo3::exceptions::{PyIndexError, PyRuntimeError};
use pyo3::prelude::*;
use pyo3::types::{PyList, PySlice};
use pyo3::{PyTraverseError, PyVisit};
use std::sync::Mutex;

/// `pool.blocks`: every block of a pool, indexable by ID.
#[pyclass(frozen, module = "hybrid_alloc._native", sequence)]
pub struct BlockTable {
    pool: Py<NativeBlockPool>,
}

impl BlockTable {
    pub(super) fn new(pool: &Bound<'_, NativeBlockPool>) -> Self {
        BlockTable {
            pool: pool.as_unbound().clone_ref(pool.py()),
        }
    }
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
            let list = NativeBlockPool::handle_list(pool, &ids)?;
            return Ok(list.into_any().unbind());
        }
        // Saturated: an index past isize is out of range like any other (IndexError).
        let index = saturating_int(index)?.clamp(isize::MIN as i64, isize::MAX as i64) as isize;
        let i = if index < 0 {
            index.saturating_add(n)
        } else {
            index
        };
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
        let list = NativeBlockPool::handle_list(pool, &ids)?;
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

impl FreeQueueView {
    pub(super) fn new(pool: &Bound<'_, NativeBlockPool>) -> Self {
        FreeQueueView {
            pool: pool.as_unbound().clone_ref(pool.py()),
        }
    }
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
        NativeBlockPool::handle_list(pool, &ids)
    }

    /// Iterate the free blocks after `cursor` (from the front if None), following the
    /// queue as it is at each step.
    #[pyo3(signature = (cursor=None))]
    fn iter_blocks_after(
        &self,
        py: Python<'_>,
        cursor: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<FreeBlockIterator> {
        let pool = self.pool.bind(py);
        let start = match cursor {
            None => QueueCursor::Front,
            Some(block) => {
                QueueCursor::After(NativeBlockPool::own_id(pool, block, "iter_blocks_after")?)
            }
        };
        Ok(FreeBlockIterator {
            pool: self.pool.clone_ref(py),
            cursor: Mutex::new(start),
        })
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.pool)
    }
}

/// The Python iterator of `free_block_queue.iter_blocks_after(cursor)`: block handles, one
/// queue step at a time (the core's `QueueCursor` decides each step).
#[pyclass(frozen, module = "hybrid_alloc._native")]
pub struct FreeBlockIterator {
    pool: Py<NativeBlockPool>,
    /// A frozen class is shared between threads, hence the lock around the position.
    cursor: Mutex<QueueCursor>,
}

#[pymethods]
impl FreeBlockIterator {
    fn __iter__(slf: PyRef<'_, Self>) -> PyRef<'_, Self> {
        slf
    }

    fn __next__(&self, py: Python<'_>) -> PyResult<Option<Py<Block>>> {
        let pool = self.pool.bind(py);
        let next = {
            let mut cursor = self
                .cursor
                .lock()
                .map_err(|_| PyRuntimeError::new_err("free queue iterator lock poisoned"))?;
            cursor.advance(pool.try_borrow()?.core.queue())
        };
        next.map(|id| NativeBlockPool::handle(pool, id)).transpose()
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        visit.call(&self.pool)
    }
}
