//! `NativeByteBudget`: the core's [`ByteBudget`] as a Python class. Group indices and slab
//! IDs are checked here before the core's accessors index with them; refusals of the core
//! become `ValueError`s naming the budget, the group, the slab or the block.

use crate::byte_budget::{ByteBudget, GroupIndex, SlabId};
use crate::error::PoolError;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;

use super::convert::pool_error;

const LABEL: &str = "byte budget";

fn err(e: PoolError) -> PyErr {
    pool_error(LABEL, e)
}

#[pyclass(module = "hybrid_alloc._native", name = "NativeByteBudget")]
pub struct NativeByteBudget {
    inner: ByteBudget,
}

impl NativeByteBudget {
    fn group(&self, g: i64) -> PyResult<GroupIndex> {
        let index = usize::try_from(g).map_err(|_| {
            PyValueError::new_err(format!("{LABEL}: group {g} is not a group index"))
        })?;
        self.inner.check_group(index).map_err(err)?;
        Ok(index)
    }

    fn slab(&self, s: i64) -> PyResult<SlabId> {
        let id = u32::try_from(s)
            .map_err(|_| PyValueError::new_err(format!("{LABEL}: slab {s} is not a slab ID")))?;
        self.inner.check_slab(id).map_err(err)?;
        Ok(id)
    }

    fn page(&self, page: i64) -> PyResult<u32> {
        u32::try_from(page)
            .map_err(|_| PyValueError::new_err(format!("{LABEL}: block {page} is not a block ID")))
    }
}

#[pymethods]
impl NativeByteBudget {
    #[new]
    fn new(slab_bytes: i64, num_slabs: i64, page_bytes: Vec<i64>) -> PyResult<Self> {
        let inner = ByteBudget::new(slab_bytes, num_slabs, &page_bytes).map_err(err)?;
        Ok(NativeByteBudget { inner })
    }

    #[getter]
    fn num_groups(&self) -> usize {
        self.inner.num_groups()
    }

    #[getter]
    fn num_slabs(&self) -> u32 {
        self.inner.num_slabs()
    }

    #[getter]
    fn slab_bytes(&self) -> u64 {
        self.inner.slab_bytes()
    }

    fn page_bytes(&self, group: i64) -> PyResult<u64> {
        Ok(self.inner.page_bytes(self.group(group)?))
    }

    fn pages_per_slab(&self, group: i64) -> PyResult<u32> {
        Ok(self.inner.pages_per_slab(self.group(group)?))
    }

    fn slab_waste_bytes(&self, group: i64) -> PyResult<u64> {
        Ok(self.inner.slab_waste_bytes(self.group(group)?))
    }

    fn num_pages(&self, group: i64) -> PyResult<u32> {
        Ok(self.inner.num_pages(self.group(group)?))
    }

    /// ``(first, end)``: the group's block IDs in the slab.
    fn pages_in(&self, group: i64, slab: i64) -> PyResult<(u32, u32)> {
        let r = self.inner.pages_in(self.group(group)?, self.slab(slab)?);
        Ok((r.start, r.end))
    }

    fn slab_of(&self, group: i64, page: i64) -> PyResult<Option<SlabId>> {
        let g = self.group(group)?;
        Ok(u32::try_from(page)
            .ok()
            .and_then(|p| self.inner.slab_of(g, p)))
    }

    fn owner(&self, slab: i64) -> PyResult<Option<GroupIndex>> {
        Ok(self.inner.owner(self.slab(slab)?))
    }

    fn live(&self, slab: i64) -> PyResult<u32> {
        Ok(self.inner.live(self.slab(slab)?))
    }

    #[getter]
    fn num_unowned(&self) -> u32 {
        self.inner.num_unowned()
    }

    #[getter]
    fn num_fully_free(&self) -> u32 {
        self.inner.num_fully_free()
    }

    fn num_owned(&self, group: i64) -> PyResult<u32> {
        Ok(self.inner.num_owned(self.group(group)?))
    }

    fn num_idle(&self, group: i64) -> PyResult<u32> {
        Ok(self.inner.num_idle(self.group(group)?))
    }

    fn owned_slabs(&self, group: i64) -> PyResult<Vec<SlabId>> {
        Ok(self.inner.owned_slabs(self.group(group)?).collect())
    }

    fn partly_used_free_pages(&self, group: i64) -> PyResult<u64> {
        Ok(self.inner.partly_used_free_pages(self.group(group)?))
    }

    /// ``(granted, released)``: slabs the group took from and gave back to the budget.
    fn owner_changes(&self, group: i64) -> PyResult<(u64, u64)> {
        let c = self.inner.owner_changes(self.group(group)?);
        Ok((c.granted, c.released))
    }

    fn grant(&mut self, group: i64) -> PyResult<Option<SlabId>> {
        let g = self.group(group)?;
        self.inner.grant(g).map_err(err)
    }

    fn release(&mut self, group: i64, slab: i64) -> PyResult<()> {
        let (g, s) = (self.group(group)?, self.slab(slab)?);
        self.inner.release(g, s).map_err(err)
    }

    fn pin(&mut self, group: i64, page: i64) -> PyResult<()> {
        let (g, p) = (self.group(group)?, self.page(page)?);
        self.inner.pin(g, p).map_err(err)
    }

    fn unpin(&mut self, group: i64, page: i64) -> PyResult<()> {
        let (g, p) = (self.group(group)?, self.page(page)?);
        self.inner.unpin(g, p).map_err(err)
    }

    #[getter]
    fn stranded_bytes(&self) -> u64 {
        self.inner.stranded_bytes()
    }

    #[getter]
    fn edge_waste_bytes(&self) -> u64 {
        self.inner.edge_waste_bytes()
    }

    /// Raise ``RuntimeError`` naming the first count that disagrees with the slabs.
    fn check_invariants(&self) -> PyResult<()> {
        self.inner
            .check_invariants()
            .map_err(|e| PyRuntimeError::new_err(format!("{LABEL}: {e}")))
    }
}
