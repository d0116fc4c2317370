//! `NativeElasticPools`: one [`ByteBudget`] shared by the `NativeBlockPool`s of several
//! groups (the core's [`crate::elastic`] functions over those pools). Each pool keeps its
//! own core pool and handles; attached pools point back here ([`ElasticLink`]) so that
//! their operations pass live changes on and their allocations get memory lent first.

use super::convert::pool_error;
use super::pool::NativeBlockPool;

use crate::byte_budget::{ByteBudget, GroupIndex};
use crate::elastic::{self, SlabSet, TakenBack};
use crate::error::PoolError;
use crate::group_pool::{BlockId, GroupPool};
use crate::reuse::ReuseWatchers;
use pyo3::exceptions::{PyRuntimeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::PyList;
use pyo3::{PyTraverseError, PyVisit};

use super::convert::RemovedKeys;

/// A pool's way back to the budget it is a group of.
pub(crate) struct ElasticLink {
    pub owner: Py<NativeElasticPools>,
    pub group: GroupIndex,
}

#[pyclass(module = "hybrid_alloc._native", name = "NativeElasticPools")]
pub struct NativeElasticPools {
    budget: ByteBudget,
    pools: Vec<Option<Py<NativeBlockPool>>>,
    label: String,
    /// Slabs the step being served holds (`reserve` .. `end_step`).
    reserved: SlabSet,
}

impl NativeElasticPools {
    fn error(&self, e: PoolError) -> PyErr {
        pool_error(&self.label, e)
    }

    fn group(&self, g: i64) -> PyResult<GroupIndex> {
        let index = usize::try_from(g).map_err(|_| {
            PyValueError::new_err(format!("{}: group {g} is not a group", self.label))
        })?;
        self.budget.check_group(index).map_err(|e| self.error(e))?;
        Ok(index)
    }

    fn attached(&self, py: Python<'_>) -> PyResult<Vec<Py<NativeBlockPool>>> {
        self.pools
            .iter()
            .enumerate()
            .map(|(g, p)| {
                p.as_ref().map(|p| p.clone_ref(py)).ok_or_else(|| {
                    PyRuntimeError::new_err(format!(
                        "{}: group {g} has no pool attached",
                        self.label
                    ))
                })
            })
            .collect()
    }

    /// [`elastic::operate`] on group `g`'s core pool (borrowed by the caller).
    pub(crate) fn operate<T>(
        &mut self,
        g: GroupIndex,
        pool: &mut GroupPool,
        named: &[BlockId],
        what: &'static str,
        op: impl FnOnce(&mut GroupPool) -> Result<T, PoolError>,
    ) -> Result<T, PoolError> {
        elastic::operate(&mut self.budget, g, pool, named, what, op)
    }

    /// [`elastic::sync`]: pass a pool's live changes on to the budget.
    pub(crate) fn sync(&mut self, g: GroupIndex, pool: &mut GroupPool) -> Result<(), PoolError> {
        elastic::sync(&mut self.budget, g, pool)
    }

    pub(crate) fn held_pages(&self, g: GroupIndex) -> usize {
        elastic::held_pages(&self.budget, g)
    }

    /// [`elastic::check_named`]: `Ok` if group `g` may name every ID.
    pub(crate) fn check_named(
        &self,
        g: GroupIndex,
        pool: &GroupPool,
        ids: &[BlockId],
        op: &'static str,
    ) -> Result<(), PoolError> {
        elastic::check_named(&self.budget, g, pool, ids, op)
    }

    /// Run `op` over the budget and every group's pool (all borrowed for the call); keys
    /// it evicts become `BlockRemoved` events of their own pool, and the pages of slabs it
    /// takes back are reported to their pool's reuse watchers and observers.
    fn with_pools<T>(
        slf: &Bound<'_, Self>,
        op: impl FnOnce(
            &mut ByteBudget,
            &mut [&mut NativeBlockPool],
            &mut SlabSet,
            &mut dyn FnMut(GroupIndex, BlockId, &[u8]),
        ) -> Result<(T, Vec<TakenBack>), PoolError>,
    ) -> PyResult<T> {
        let (value, told) = Self::with_pools_told_after(slf, op)?;
        told.map(|()| value)
    }

    /// [`Self::with_pools`], answering `op`'s value even when telling the Python layer of
    /// its removed keys or taken-back slabs fails (that outcome comes second): what `op`
    /// did is done either way.
    #[allow(clippy::type_complexity)]
    fn with_pools_told_after<T>(
        slf: &Bound<'_, Self>,
        op: impl FnOnce(
            &mut ByteBudget,
            &mut [&mut NativeBlockPool],
            &mut SlabSet,
            &mut dyn FnMut(GroupIndex, BlockId, &[u8]),
        ) -> Result<(T, Vec<TakenBack>), PoolError>,
    ) -> PyResult<(T, PyResult<()>)> {
        let py = slf.py();
        let pools = slf.try_borrow()?.attached(py)?;
        let mut keys: Vec<RemovedKeys> = Vec::with_capacity(pools.len());
        let outcome = {
            let mut guards = Vec::with_capacity(pools.len());
            for p in &pools {
                guards.push(p.bind(py).try_borrow_mut()?);
            }
            for guard in &guards {
                keys.push(guard.removed_keys());
            }
            let mut this = slf.try_borrow_mut()?;
            let this = &mut *this;
            let mut refs: Vec<&mut NativeBlockPool> = guards.iter_mut().map(|g| &mut **g).collect();
            let mut sink = |h: GroupIndex, _: BlockId, key: &[u8]| keys[h].push(key);
            op(&mut this.budget, &mut refs, &mut this.reserved, &mut sink)
                .map_err(|e| pool_error(&this.label, e))
        };
        let mut told = Ok(());
        for (p, k) in pools.iter().zip(keys) {
            told = told.and(NativeBlockPool::emit_removed(p.bind(py), k));
        }
        let (value, taken) = match outcome {
            Ok(done) => done,
            Err(e) => return told.and(Err(e)),
        };
        for t in taken {
            if told.is_ok() {
                told = NativeBlockPool::taken_back(pools[t.group].bind(py), &t.pages, &t.evicted);
            }
        }
        Ok((value, told))
    }

    /// `n` new pages for group `g` ([`elastic::allocate`]: the memory lent, then `pop` on
    /// the group's core pool with its reuse watchers, the budget synced at once). The pop's
    /// answer comes even if a watcher of a slab taken back raised (second): the pages are
    /// off the queue and the caller must still claim them.
    pub(crate) fn allocate<T>(
        slf: &Bound<'_, Self>,
        g: GroupIndex,
        n: usize,
        pop: impl FnOnce(&mut GroupPool, &mut ReuseWatchers<Py<PyAny>>) -> Result<T, PoolError>,
    ) -> PyResult<(T, PyResult<()>)> {
        Self::with_pools_told_after(slf, |budget, pools, reserved, removed| {
            let mut cores = Vec::with_capacity(pools.len());
            let mut watchers = None;
            for (h, pool) in pools.iter_mut().enumerate() {
                let pool = &mut **pool;
                if h == g {
                    watchers = Some(&mut pool.watchers);
                }
                cores.push(&mut pool.core);
            }
            let watchers = watchers.ok_or_else(|| {
                PoolError::InvalidArgument(format!("group {g} has no pool attached"))
            })?;
            elastic::allocate(budget, &mut cores, g, n, reserved, removed, |core, _| {
                pop(core, watchers)
            })
        })
    }

    /// [`elastic::check_lent`]: `Ok` if group `g` may name `id`.
    pub(crate) fn check_lent(
        &self,
        g: GroupIndex,
        id: BlockId,
        op: &'static str,
    ) -> Result<(), PoolError> {
        elastic::check_lent(&self.budget, g, id, op)
    }

    /// [`elastic::reserve_steps`] over the attached pools, arguments converted and
    /// checked: None if reserved, else (group, blocks missing) and nothing changed.
    fn reserve_checked(
        slf: &Bound<'_, Self>,
        hits: &[&[BlockId]],
        news: &[(GroupIndex, usize)],
    ) -> PyResult<Option<(usize, usize)>> {
        Self::with_pools(slf, |budget, pools, reserved, removed| {
            let mut cores: Vec<&mut GroupPool> = pools.iter_mut().map(|p| &mut p.core).collect();
            Ok(
                match elastic::reserve_steps(budget, &mut cores, hits, news, reserved, removed)? {
                    Ok(taken) => (None, taken),
                    Err(short) => (Some((short.group, short.missing)), Vec::new()),
                },
            )
        })
    }

    /// Hit IDs per group and (group, count) allocations, converted and checked.
    #[allow(clippy::type_complexity)]
    fn step_args(
        slf: &Bound<'_, Self>,
        hits: &[Bound<'_, PyAny>],
        news: Vec<(i64, usize)>,
    ) -> PyResult<(Vec<Vec<BlockId>>, Vec<(GroupIndex, usize)>)> {
        let py = slf.py();
        let pools = slf.try_borrow()?.attached(py)?;
        let mut hit_ids = Vec::with_capacity(hits.len());
        for (g, blocks) in hits.iter().enumerate() {
            hit_ids.push(match pools.get(g) {
                Some(p) => NativeBlockPool::own_ids(p.bind(py), blocks, "plan")?,
                None => Vec::new(),
            });
        }
        let this = slf.try_borrow()?;
        let news = news
            .into_iter()
            .map(|(g, n)| Ok((this.group(g)?, n)))
            .collect::<PyResult<Vec<_>>>()?;
        Ok((hit_ids, news))
    }
}

#[pymethods]
impl NativeElasticPools {
    #[new]
    #[pyo3(signature = (slab_bytes, num_slabs, page_bytes, label=None, kept_per_live=None))]
    fn new(
        slab_bytes: i64,
        num_slabs: i64,
        page_bytes: Vec<i64>,
        label: Option<String>,
        kept_per_live: Option<Vec<i64>>,
    ) -> PyResult<Self> {
        let label = label.unwrap_or_else(|| "elastic pools".to_string());
        let mut budget = ByteBudget::new(slab_bytes, num_slabs, &page_bytes)
            .map_err(|e| pool_error(&label, e))?;
        if let Some(kept) = kept_per_live {
            if kept.len() != budget.num_groups() {
                return Err(PyValueError::new_err(format!(
                    "{label}: kept_per_live names {} groups, page_bytes {}",
                    kept.len(),
                    budget.num_groups()
                )));
            }
            for (g, &n) in kept.iter().enumerate() {
                let n = u32::try_from(n).map_err(|_| {
                    PyValueError::new_err(format!(
                        "{label}: group {g}: kept_per_live must be in 0..={}, got {n}",
                        u32::MAX
                    ))
                })?;
                budget
                    .set_kept_per_live(g, n)
                    .map_err(|e| pool_error(&label, e))?;
            }
        }
        let pools = (0..budget.num_groups()).map(|_| None).collect();
        Ok(NativeElasticPools {
            budget,
            pools,
            label,
            reserved: SlabSet::default(),
        })
    }

    /// Make `pool` (new, with `num_pages(group)` blocks) group `group`'s pool: the budget
    /// holds its pages until it lends them.
    fn attach(
        slf: &Bound<'_, Self>,
        group: i64,
        pool: &Bound<'_, NativeBlockPool>,
    ) -> PyResult<()> {
        let mut this = slf.try_borrow_mut()?;
        let g = this.group(group)?;
        if this.pools[g].is_some() {
            return Err(PyValueError::new_err(format!(
                "{}: group {g} already has a pool",
                this.label
            )));
        }
        let mut p = pool.try_borrow_mut()?;
        if p.elastic.is_some() {
            return Err(PyValueError::new_err(format!(
                "{}: {} is already a group of elastic pools",
                this.label, p.label
            )));
        }
        elastic::adopt(&this.budget, g, &mut p.core).map_err(|e| this.error(e))?;
        p.elastic = Some(ElasticLink {
            owner: slf.clone().unbind(),
            group: g,
        });
        this.pools[g] = Some(pool.clone().unbind());
        Ok(())
    }

    /// Whether a step fits: `hits[g]` are group g's prefix-hit blocks (taken first), then
    /// `news` lists (group, new blocks) in the order the groups allocate. None if it
    /// fits, else (the first group short, blocks missing). Changes nothing.
    fn plan(
        slf: &Bound<'_, Self>,
        hits: Vec<Bound<'_, PyAny>>,
        news: Vec<(i64, usize)>,
    ) -> PyResult<Option<(usize, usize)>> {
        let py = slf.py();
        let (hit_ids, news) = Self::step_args(slf, &hits, news)?;
        let pools = slf.try_borrow()?.attached(py)?;
        let this = slf.try_borrow()?;
        let guards = pools
            .iter()
            .map(|p| p.bind(py).try_borrow())
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&GroupPool> = guards.iter().map(|g| &g.core).collect();
        let hit_refs: Vec<&[BlockId]> = hit_ids.iter().map(Vec::as_slice).collect();
        match elastic::plan_steps(&this.budget, &refs, &hit_refs, &news, &this.reserved)
            .map_err(|e| this.error(e))?
        {
            Ok(()) => Ok(None),
            Err(short) => Ok(Some((short.group, short.missing))),
        }
    }

    /// Admit a step as a reservation (see `elastic::reserve_steps`): the plan of `plan`,
    /// and if it fits, every slab it lends is lent now and the step's slabs are kept from
    /// other groups until `end_step`. None if reserved, else (group, blocks missing) and
    /// nothing changed.
    fn reserve(
        slf: &Bound<'_, Self>,
        hits: Vec<Bound<'_, PyAny>>,
        news: Vec<(i64, usize)>,
    ) -> PyResult<Option<(usize, usize)>> {
        let (hit_ids, news) = Self::step_args(slf, &hits, news)?;
        let hit_refs: Vec<&[BlockId]> = hit_ids.iter().map(Vec::as_slice).collect();
        Self::reserve_checked(slf, &hit_refs, &news)
    }

    /// What group `group`'s pool could have now: its free blocks, and the pages of every
    /// slab no page pins that it does not own yet (its own idle slabs' pages are among
    /// its free blocks already). Shared by every group: a plan decides, this bounds it;
    /// it is the one free count vLLM's `allocate_slots` compares a step's blocks with.
    fn num_free_for(slf: &Bound<'_, Self>, group: i64) -> PyResult<u64> {
        let py = slf.py();
        let this = slf.try_borrow()?;
        let g = this.group(group)?;
        let pool = this.attached(py)?.swap_remove(g);
        let free = pool.bind(py).try_borrow()?.core.num_free() as u64;
        let budget = &this.budget;
        let others = budget.num_fully_free() - budget.num_idle(g);
        Ok(free + u64::from(others) * u64::from(budget.pages_per_slab(g)))
    }

    /// A running request's decode step that takes pages only (`news`: (group, new pages)
    /// in the order the groups allocate), in one call: refused (None, nothing changed)
    /// when more than `num_free_for(primary)` pages are asked of the primary group's
    /// groups (`primary_need`: vLLM's own comparison; by default the pages `news` asks
    /// of group `primary`) or when the step does not fit (`reserve`'s plan); else the
    /// step is reserved and each entry's pages are taken from its group's pool (as
    /// `get_new_blocks`), one list of handles per entry. The reservation lasts until
    /// `end_step`.
    #[pyo3(signature = (news, primary, primary_need=None))]
    fn grow<'py>(
        slf: &Bound<'py, Self>,
        news: Vec<(i64, usize)>,
        primary: i64,
        primary_need: Option<u64>,
    ) -> PyResult<Option<Vec<Bound<'py, PyList>>>> {
        let py = slf.py();
        let primary_need = primary_need.unwrap_or_else(|| {
            news.iter()
                .filter(|&&(g, _)| g == primary)
                .fold(0u64, |sum, &(_, n)| sum.saturating_add(n as u64))
        });
        if primary_need > Self::num_free_for(slf, primary)? {
            return Ok(None);
        }
        let (_, groups) = Self::step_args(slf, &[], news)?;
        let no_hits: Vec<&[BlockId]> = vec![&[]; slf.try_borrow()?.pools.len()];
        if Self::reserve_checked(slf, &no_hits, &groups)?.is_some() {
            return Ok(None);
        }
        let pools = slf.try_borrow()?.attached(py)?;
        let mut lists = Vec::with_capacity(groups.len());
        for (g, n) in groups {
            if n == 0 {
                lists.push(PyList::empty(py));
                continue;
            }
            let count = n.into_pyobject(py)?.into_any();
            lists.push(NativeBlockPool::get_new_blocks(pools[g].bind(py), &count)?);
        }
        Ok(Some(lists))
    }

    /// The reserved step is over: its slabs may be taken back again.
    fn end_step(&mut self) {
        self.reserved.clear();
    }

    /// Slabs the step being served holds (0 between steps).
    #[getter]
    fn num_reserved(&self) -> usize {
        self.reserved.len()
    }

    #[getter]
    fn num_groups(&self) -> usize {
        self.budget.num_groups()
    }

    #[getter]
    fn num_slabs(&self) -> u32 {
        self.budget.num_slabs()
    }

    #[getter]
    fn slab_bytes(&self) -> u64 {
        self.budget.slab_bytes()
    }

    #[getter]
    fn num_unowned(&self) -> u32 {
        self.budget.num_unowned()
    }

    #[getter]
    fn num_fully_free(&self) -> u32 {
        self.budget.num_fully_free()
    }

    /// Per group: idle pages kept per page in use, out of other groups' reach.
    #[getter]
    fn kept_per_live(&self) -> Vec<u32> {
        (0..self.budget.num_groups())
            .map(|g| self.budget.kept_per_live(g))
            .collect()
    }

    /// Each group's free pages, the unowned slabs and the reserved slabs, in one call. An
    /// admission's second ask compares it with the first's (`_pools_state` in the
    /// coordinator): only frees run between the two, and a free adds a page to its
    /// group's queue or a slab to the unowned ones, so the answers differ whenever the
    /// pools did. One call instead of a pool-by-pool walk from Python, twice an admission.
    fn state(slf: &Bound<'_, Self>) -> PyResult<(Vec<usize>, u32, usize)> {
        let py = slf.py();
        let this = slf.try_borrow()?;
        let mut free = Vec::with_capacity(this.pools.len());
        for pool in this.attached(py)? {
            free.push(pool.bind(py).try_borrow()?.core.num_free());
        }
        Ok((free, this.budget.num_unowned(), this.reserved.len()))
    }

    /// The share of the lendable bytes live pages take (vLLM's `usage`, read every step).
    #[getter]
    fn usage(&self) -> f64 {
        self.budget.usage()
    }

    #[getter]
    fn stranded_bytes(&self) -> u64 {
        self.budget.stranded_bytes()
    }

    #[getter]
    fn edge_waste_bytes(&self) -> u64 {
        self.budget.edge_waste_bytes()
    }

    #[getter]
    fn label(&self) -> String {
        self.label.clone()
    }

    fn num_pages(&self, group: i64) -> PyResult<u32> {
        Ok(self.budget.num_pages(self.group(group)?))
    }

    fn pages_per_slab(&self, group: i64) -> PyResult<u32> {
        Ok(self.budget.pages_per_slab(self.group(group)?))
    }

    fn page_bytes(&self, group: i64) -> PyResult<u64> {
        Ok(self.budget.page_bytes(self.group(group)?))
    }

    fn num_owned(&self, group: i64) -> PyResult<u32> {
        Ok(self.budget.num_owned(self.group(group)?))
    }

    fn num_idle(&self, group: i64) -> PyResult<u32> {
        Ok(self.budget.num_idle(self.group(group)?))
    }

    /// Pages the group has in use.
    fn num_live_pages(&self, group: i64) -> PyResult<u64> {
        // The budget's running count (`check_invariants` compares it with its slabs'):
        // vLLM reads the usage every step, and summing the slabs cost ~40 us there.
        Ok(self.budget.live_pages(self.group(group)?))
    }

    /// (granted, released): slabs the group took from the budget and gave back.
    fn owner_changes(&self, group: i64) -> PyResult<(u64, u64)> {
        let c = self.budget.owner_changes(self.group(group)?);
        Ok((c.granted, c.released))
    }

    /// Raise RuntimeError naming the first disagreement of the budget and the pools.
    fn check_invariants(slf: &Bound<'_, Self>) -> PyResult<()> {
        let py = slf.py();
        let this = slf.try_borrow()?;
        let pools = this.attached(py)?;
        let guards = pools
            .iter()
            .map(|p| p.bind(py).try_borrow())
            .collect::<Result<Vec<_>, _>>()?;
        let refs: Vec<&GroupPool> = guards.iter().map(|g| &g.core).collect();
        elastic::check_invariants(&this.budget, &refs)
            .map_err(|e| PyRuntimeError::new_err(format!("{}: {e}", this.label)))
    }

    fn __traverse__(&self, visit: PyVisit<'_>) -> Result<(), PyTraverseError> {
        for p in self.pools.iter().flatten() {
            visit.call(p)?;
        }
        Ok(())
    }

    fn __clear__(&mut self) {
        self.pools.iter_mut().for_each(|p| *p = None);
    }
}
