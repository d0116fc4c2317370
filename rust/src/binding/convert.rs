//! Conversions between Python values and the core's, in one place: errors, iterables,
//! block hashes, removed keys.

use crate::caching::HashSource;
use crate::error::{OpError, PoolError};
use crate::group_pool::BlockId;
use pyo3::exceptions::{PyOverflowError, PyTypeError, PyValueError};
use pyo3::prelude::*;
use pyo3::types::iter::BoundListIterator;
use pyo3::types::{PyBytes, PyIterator, PyList};

/// The Python exception for a refusal of the core: a `ValueError` that names the pool (the
/// core's message names the block and the operation).
pub(crate) fn pool_error(label: &str, e: PoolError) -> PyErr {
    PyValueError::new_err(format!("{label}: {e}"))
}

/// The Python exception for an operation that reads its input through Python: the core's
/// refusal as [`pool_error`], or the error reading the input raised, unchanged.
pub(crate) fn op_error(label: &str, e: OpError<PyErr>) -> PyErr {
    match e {
        OpError::Pool(e) => pool_error(label, e),
        OpError::Input(e) => e,
    }
}

/// The name of an object's type, for messages.
pub(crate) fn type_name(obj: &Bound<'_, PyAny>) -> String {
    obj.get_type()
        .name()
        .map(|n| n.to_string())
        .unwrap_or_else(|_| "?".into())
}

/// A `TypeError` for an argument of the wrong type: `"{label}: {op}: expected {expected},
/// got {type}"`.
pub(crate) fn wrong_type(label: &str, op: &str, expected: &str, obj: &Bound<'_, PyAny>) -> PyErr {
    PyTypeError::new_err(format!(
        "{label}: {op}: expected {expected}, got {}",
        type_name(obj)
    ))
}

/// A Python int as an `i64`, saturated: an int past either end of `i64` becomes
/// `i64::MIN` / `i64::MAX`, so that the core refuses it as it refuses any other count or
/// ID out of range (a `ValueError` naming pool and block) instead of the binding raising
/// `OverflowError`. Anything that is not an int is a `TypeError`, as before.
pub(crate) fn saturating_int(obj: &Bound<'_, PyAny>) -> PyResult<i64> {
    match obj.extract::<i64>() {
        Ok(v) => Ok(v),
        Err(e) if e.is_instance_of::<PyOverflowError>(obj.py()) => {
            Ok(if obj.lt(0i64)? { i64::MIN } else { i64::MAX })
        }
        Err(e) => Err(e),
    }
}

/// A KV-cache group ID: an int in `0..=u32::MAX`, else a `ValueError` naming the pool and
/// operation (a `TypeError` if it is not an int).
pub(crate) fn group_id(label: &str, op: &str, obj: &Bound<'_, PyAny>) -> PyResult<u32> {
    let v = saturating_int(obj).map_err(|_| wrong_type(label, op, "group IDs as ints", obj))?;
    u32::try_from(v).map_err(|_| {
        PyValueError::new_err(format!(
            "{label}: {op}: KV-cache group ID {} out of range",
            obj.repr()
                .map(|r| r.to_string())
                .unwrap_or_else(|_| v.to_string())
        ))
    })
}

/// The items of a list or of any other iterable (vLLM passes lists, `reversed(...)`,
/// generators, sets). Lists are read directly, without Python's iterator protocol.
pub(crate) enum Items<'py> {
    List(BoundListIterator<'py>),
    Iter(Bound<'py, PyIterator>),
}

/// Iterate `obj`, a list or any iterable (`TypeError` if it is neither).
#[inline]
pub(crate) fn items<'py>(obj: &Bound<'py, PyAny>) -> PyResult<Items<'py>> {
    match obj.cast::<PyList>() {
        Ok(list) => Ok(Items::List(list.iter())),
        Err(_) => Ok(Items::Iter(obj.try_iter()?)),
    }
}

impl<'py> Iterator for Items<'py> {
    type Item = PyResult<Bound<'py, PyAny>>;

    #[inline]
    fn next(&mut self) -> Option<Self::Item> {
        match self {
            Items::List(it) => it.next().map(Ok),
            Items::Iter(it) => it.next(),
        }
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        match self {
            Items::List(it) => it.size_hint(),
            Items::Iter(_) => (0, None),
        }
    }
}

/// A Python sequence read by position: a list directly, anything else through `obj[i]`.
pub(crate) enum Indexed<'a, 'py> {
    List(&'a Bound<'py, PyList>),
    Any(&'a Bound<'py, PyAny>),
}

impl<'a, 'py> Indexed<'a, 'py> {
    pub fn new(obj: &'a Bound<'py, PyAny>) -> Self {
        // Exact lists only: a subclass may override `__getitem__`.
        match obj.cast_exact::<PyList>() {
            Ok(list) => Indexed::List(list),
            Err(_) => Indexed::Any(obj),
        }
    }

    #[inline]
    pub fn get(&self, index: usize) -> PyResult<Bound<'py, PyAny>> {
        match self {
            Indexed::List(list) => list.get_item(index),
            Indexed::Any(obj) => obj.get_item(index),
        }
    }

    pub fn len(&self) -> PyResult<usize> {
        match self {
            Indexed::List(list) => Ok(list.len()),
            Indexed::Any(obj) => obj.len(),
        }
    }
}

/// A block hash held as the Python `bytes` object it came in (no copy).
pub(crate) struct HashBytes<'py>(Bound<'py, PyBytes>);

impl AsRef<[u8]> for HashBytes<'_> {
    #[inline]
    fn as_ref(&self) -> &[u8] {
        self.0.as_bytes()
    }
}

/// `obj` as a block hash (`bytes`), or a `TypeError` naming the pool and operation.
#[inline]
pub(crate) fn hash_bytes<'py>(
    label: &str,
    op: &str,
    obj: Bound<'py, PyAny>,
) -> PyResult<HashBytes<'py>> {
    match obj.cast_into::<PyBytes>() {
        Ok(b) => Ok(HashBytes(b)),
        Err(e) => Err(wrong_type(
            label,
            op,
            "block hashes as bytes",
            &e.into_inner(),
        )),
    }
}

/// A request's block hashes as vLLM holds them (a list, or a block-size view of one),
/// read by position.
pub(crate) struct PyHashes<'a, 'py> {
    pub seq: Indexed<'a, 'py>,
    pub label: &'a str,
    pub op: &'static str,
}

impl<'py> HashSource for PyHashes<'_, 'py> {
    type Hash = HashBytes<'py>;
    type Error = PyErr;

    fn num_hashes(&self) -> PyResult<usize> {
        self.seq.len()
    }

    #[inline]
    fn hash_at(&self, index: usize) -> PyResult<HashBytes<'py>> {
        hash_bytes(self.label, self.op, self.seq.get(index)?)
    }
}

/// Keys the core removes from the prefix cache during one operation, kept only when KV
/// events are on (each becomes a `BlockRemoved` event); otherwise they are not copied.
pub(crate) struct RemovedKeys {
    keys: Option<Vec<Vec<u8>>>,
}

impl RemovedKeys {
    pub fn new(events_on: bool) -> Self {
        RemovedKeys {
            keys: events_on.then(Vec::new),
        }
    }

    #[inline]
    pub fn push(&mut self, key: &[u8]) {
        if let Some(keys) = &mut self.keys {
            keys.push(key.to_vec());
        }
    }

    /// Whether keys are kept (KV events are on).
    pub fn collecting(&self) -> bool {
        self.keys.is_some()
    }

    /// The callback to hand to the core (see [`with_removed_sink`]).
    pub fn sink(&mut self) -> impl FnMut(BlockId, &[u8]) + '_ {
        |_, key| self.push(key)
    }

    /// The keys collected, as a Python list of `bytes` (`None` if there are none).
    pub fn into_list(self, py: Python<'_>) -> PyResult<Option<Bound<'_, PyList>>> {
        match self.keys {
            Some(keys) if !keys.is_empty() => Ok(Some(PyList::new(
                py,
                keys.iter().map(|k| PyBytes::new(py, k)),
            )?)),
            _ => Ok(None),
        }
    }
}

/// Evaluate `$call` with `$sink` bound to the callback the core reports removed keys to:
/// the collector of `$keys` (a [`RemovedKeys`]) when KV events are on, otherwise a closure
/// that does nothing, which the compiler then removes from the core's per-block loops.
macro_rules! with_removed_sink {
    ($keys:expr, |$sink:ident| $call:expr) => {
        if $keys.collecting() {
            let $sink = $keys.sink();
            $call
        } else {
            let $sink = |_: $crate::group_pool::BlockId, _: &[u8]| {};
            $call
        }
    };
}
pub(crate) use with_removed_sink;
