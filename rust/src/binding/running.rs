//! `NativeRunningRequests`: the core's [`RunningRequests`] as a Python class. Counts come
//! in as Python ints: a negative one is a `ValueError` naming the table and the request,
//! one past 64 bits counts as the largest (never an `OverflowError`); block counts as
//! `int | None` per group. The table is built by `hybrid_alloc.integration.scheduler.quiet_step`.

use super::convert::{pool_error, saturating_int};
use crate::error::PoolError;
use crate::running::{
    CacheFacts, Cacheable, Caching, DecodeStep, GroupRule, RunningRequests, StepPlan,
};
use pyo3::exceptions::PyValueError;
use pyo3::prelude::*;
use pyo3::types::PyTuple;

/// `decode_step`'s bit for a step in which vLLM's `remove_skipped_blocks` has work
/// (`_native.STEP_REMOVE_SKIPPED`).
pub(super) const PHASE_REMOVE_SKIPPED: u8 = 1;
/// `decode_step`'s bit for a step in which vLLM's `cache_blocks` has work
/// (`_native.STEP_CACHE_BLOCKS`).
pub(super) const PHASE_CACHE: u8 = 2;

#[pyclass(module = "hybrid_alloc._native", name = "NativeRunningRequests")]
pub struct NativeRunningRequests {
    table: RunningRequests,
    label: String,
}

/// `CacheFacts` as Python passes them (see `NativeRunningRequests::sync`).
type FactsTuple<'py> = (
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
    bool,
    Bound<'py, PyAny>,
    Bound<'py, PyAny>,
);

/// A count the caller passes (tokens, blocks): a non-negative int.
fn count(label: &str, request_id: &str, what: &str, obj: &Bound<'_, PyAny>) -> PyResult<u64> {
    let v = saturating_int(obj)?;
    u64::try_from(v).map_err(|_| {
        PyValueError::new_err(format!(
            "{label}: request {request_id}: {what} {v} is negative"
        ))
    })
}

impl NativeRunningRequests {
    fn held(&self, request_id: &str, held: &Bound<'_, PyAny>) -> PyResult<Vec<Option<u64>>> {
        let mut out = Vec::with_capacity(self.table.num_groups());
        for item in held.try_iter()? {
            let item = item?;
            out.push(if item.is_none() {
                None
            } else {
                Some(count(&self.label, request_id, "block count", &item)?)
            });
        }
        Ok(out)
    }

    fn counts(&self, request_id: &str, what: &str, items: &Bound<'_, PyAny>) -> PyResult<Vec<u64>> {
        items
            .try_iter()?
            .map(|item| count(&self.label, request_id, what, &item?))
            .collect()
    }

    /// `(cached, retired, stale_state, state_boundary, settled, cached_tokens,
    /// prompt_tokens)` as [`CacheFacts`].
    fn facts(&self, request_id: &str, facts: &Bound<'_, PyAny>) -> PyResult<CacheFacts> {
        let (cached, retired, stale, boundary, settled, cached_tokens, prompt_tokens): FactsTuple<
            '_,
        > = facts.extract()?;
        let label = &self.label;
        Ok(CacheFacts {
            cached: self.counts(request_id, "cached block count", &cached)?,
            retired: self.counts(request_id, "retired block count", &retired)?,
            stale_state: self.held(request_id, &stale)?,
            state_boundary: self.counts(request_id, "state boundary", &boundary)?,
            settled,
            cached_tokens: count(label, request_id, "cached tokens", &cached_tokens)?,
            prompt_tokens: count(label, request_id, "prompt tokens", &prompt_tokens)?,
        })
    }

    fn error(&self, e: PoolError) -> PyErr {
        pool_error(&self.label, e)
    }
}

#[pymethods]
impl NativeRunningRequests {
    /// `rules`: per KV-cache group, `(block_size, extra_slots, skip_offset, room_pool)`
    /// (the last two `None` where the group never skips tokens / keeps no room).
    /// `caching` (prefix caching on): per group `(kind, speculative_blocks, use_eagle)`,
    /// kind `""` (caches nothing), `"full"` (full attention) or `"align"` (Mamba 'align'
    /// mode); `cacheable`: the coordinator's `(hash_block_size, hybrid_align,
    /// reprefillable)` (`hybrid_align` `None`: vLLM's base rule; 1: no rounding).
    #[new]
    #[pyo3(signature = (
        rules, quiet_steps, room_tokens, label = "running requests".to_owned(),
        caching = None, cacheable = None,
    ))]
    fn new(
        rules: Vec<(u64, u64, Option<u64>, Option<usize>)>,
        quiet_steps: bool,
        room_tokens: u64,
        label: String,
        caching: Option<Vec<(String, u64, bool)>>,
        cacheable: Option<(u64, Option<u64>, u64)>,
    ) -> PyResult<Self> {
        let caching = caching.unwrap_or_default();
        if !caching.is_empty() && caching.len() != rules.len() {
            return Err(PyValueError::new_err(format!(
                "{label}: {} caching rules for {} groups",
                caching.len(),
                rules.len()
            )));
        }
        let mut group_rules = Vec::with_capacity(rules.len());
        for (g, (block_size, extra_slots, skip_offset, room_pool)) in rules.into_iter().enumerate()
        {
            let (kind, speculative_blocks, use_eagle) = caching
                .get(g)
                .map_or(("", 0, false), |(k, s, e)| (k.as_str(), *s, *e));
            let caching = match kind {
                "" => Caching::Off,
                "full" => Caching::Full,
                "align" => Caching::MambaAlign { speculative_blocks },
                other => {
                    return Err(PyValueError::new_err(format!(
                        "{label}: group {g}: unknown caching kind {other:?}"
                    )))
                }
            };
            group_rules.push(GroupRule {
                block_size,
                extra_slots,
                skip_offset,
                room_pool,
                caching,
                use_eagle,
            });
        }
        let cacheable = cacheable.map(|(hash_block_size, hybrid_align, reprefillable)| Cacheable {
            hash_block_size,
            hybrid_align,
            reprefillable,
        });
        let table = RunningRequests::new(group_rules, quiet_steps, room_tokens, cacheable)
            .map_err(|e| pool_error(&label, e))?;
        Ok(Self { table, label })
    }

    /// Whether `quiet_step` may answer True at all.
    #[getter]
    fn quiet_steps(&self) -> bool {
        self.table.quiet_steps()
    }

    /// Requests the table holds (a property, not `__len__`: an empty table must not read
    /// as a missing one in `if table:`).
    #[getter]
    fn num_requests(&self) -> usize {
        self.table.len()
    }

    fn __contains__(&self, request_id: &str) -> bool {
        self.table.contains(request_id)
    }

    /// `facts`: what caching managers hold of the request, `(cached, retired,
    /// stale_state, state_boundary, settled, cached_tokens, prompt_tokens)` (see `CacheFacts` in
    /// rust/src/running.rs); `None`: its steps take vLLM's path until a sync brings them.
    #[pyo3(signature = (request_id, held, partial_hit, room_length, facts = None))]
    fn sync(
        &mut self,
        request_id: &str,
        held: &Bound<'_, PyAny>,
        partial_hit: bool,
        room_length: &Bound<'_, PyAny>,
        facts: Option<&Bound<'_, PyAny>>,
    ) -> PyResult<()> {
        let held = self.held(request_id, held)?;
        let length = count(&self.label, request_id, "room length", room_length)?;
        let facts = facts.map(|f| self.facts(request_id, f)).transpose()?;
        self.table
            .sync(request_id, &held, partial_hit, length, facts.as_ref())
            .map_err(|e| self.error(e))
    }

    /// After a decode step `decode_step` answered with growth took exactly `needs[g]`
    /// blocks in each group: what `sync` with the managers' new counts records, without
    /// walking them (tables that cache nothing); the room recounted at `room_length`.
    fn grown(
        &mut self,
        request_id: &str,
        needs: &Bound<'_, PyAny>,
        room_length: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let needs = self.counts(request_id, "new block count", needs)?;
        let length = count(&self.label, request_id, "room length", room_length)?;
        self.table
            .grown(request_id, &needs, length)
            .map_err(|e| self.error(e))
    }

    /// The tokens the coordinator's `cache_blocks` hands group `group`'s manager when it
    /// caches `tokens` (checked against vLLM's own rule when the table is built).
    fn cacheable_tokens(&self, group: usize, tokens: u64) -> PyResult<Option<u64>> {
        self.table
            .cacheable_tokens(group, tokens)
            .map_err(|e| self.error(e))
    }

    fn note_removed(
        &mut self,
        request_id: &str,
        processed: &Bound<'_, PyAny>,
        held: &Bound<'_, PyAny>,
    ) -> PyResult<()> {
        let processed = count(&self.label, request_id, "processed tokens", processed)?;
        let held = self.held(request_id, held)?;
        self.table
            .note_removed(request_id, processed, &held)
            .map_err(|e| self.error(e))
    }

    fn quiet_step(
        &mut self,
        request_id: &str,
        slots: &Bound<'_, PyAny>,
        processed: &Bound<'_, PyAny>,
        room_length: &Bound<'_, PyAny>,
    ) -> PyResult<bool> {
        let slots = count(&self.label, request_id, "slots", slots)?;
        let processed = count(&self.label, request_id, "processed tokens", processed)?;
        let length = count(&self.label, request_id, "room length", room_length)?;
        Ok(self.table.quiet_step(request_id, slots, processed, length))
    }

    /// A running request's decode step, from the request's own counts (the scheduler's
    /// hot path: one call, the arithmetic here): `None` where vLLM's rules must run,
    /// `()` for a quiet step (its room recounted), an `int` of phase bits where no group
    /// takes a block and only those phases of vLLM's call have work
    /// ([`PHASE_REMOVE_SKIPPED`]: vLLM's `remove_skipped_blocks`, [`PHASE_CACHE`]: its
    /// `cache_blocks`; run them in that order, then `sync`), else the blocks each group
    /// takes (only groups without a window, and Mamba 'align' groups, take any; tell
    /// `sync` once they are allocated).
    #[allow(clippy::too_many_arguments)]
    fn decode_step<'py>(
        &mut self,
        py: Python<'py>,
        request_id: &str,
        num_computed_tokens: i64,
        num_new_tokens: i64,
        num_lookahead_tokens: i64,
        num_in_flight_tokens: i64,
        num_prompt_tokens: i64,
        num_tokens: i64,
        max_model_len: i64,
    ) -> PyResult<Option<Bound<'py, PyAny>>> {
        let counts = [
            ("num_computed_tokens", num_computed_tokens),
            ("num_new_tokens", num_new_tokens),
            ("num_lookahead_tokens", num_lookahead_tokens),
            ("num_in_flight_tokens", num_in_flight_tokens),
            ("num_prompt_tokens", num_prompt_tokens),
            ("num_tokens", num_tokens),
            ("max_model_len", max_model_len),
        ];
        let mut values = [0u64; 7];
        for (value, (what, given)) in values.iter_mut().zip(counts) {
            *value = u64::try_from(given).map_err(|_| {
                PyValueError::new_err(format!(
                    "{}: request {request_id}: {what} {given} is negative",
                    self.label
                ))
            })?;
        }
        let [computed, new_tokens, lookahead, in_flight, prompt_tokens, num_tokens, max_model_len] =
            values;
        let step = DecodeStep {
            computed,
            new_tokens,
            lookahead,
            in_flight,
            prompt_tokens,
            num_tokens,
            max_model_len,
        };
        Ok(match self.table.decode_step(request_id, &step) {
            StepPlan::VllmPath => None,
            StepPlan::Quiet => Some(PyTuple::empty(py).into_any()),
            StepPlan::Grow(needs) => Some(PyTuple::new(py, needs)?.into_any()),
            StepPlan::Only(phases) => {
                let mut bits = 0;
                if phases.remove_skipped {
                    bits |= PHASE_REMOVE_SKIPPED;
                }
                if phases.cache {
                    bits |= PHASE_CACHE;
                }
                Some(bits.into_pyobject(py)?.into_any())
            }
        })
    }

    fn forget(&mut self, request_id: &str) {
        self.table.forget(request_id);
    }

    fn cache_evicted(&mut self) {
        self.table.cache_evicted();
    }

    /// `[(pool, pages), ...]` the running requests other than `except_request` lack for
    /// their decode room.
    fn room_asks(&self, except_request: &str) -> Vec<(usize, u64)> {
        self.table.room_asks(except_request)
    }
}
