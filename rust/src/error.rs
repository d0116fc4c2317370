//! Errors of the core. Every failing operation returns one of these *before* it changes
//! anything, so a caller that gets an error still holds the pool exactly as it was.

use std::fmt;

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum PoolError {
    /// A pool size past the ID range.
    InvalidSize { requested: i64, max: usize },
    /// An argument outside what the operation accepts (the message says which and why).
    InvalidArgument(String),
    /// A block ID outside `0..num_blocks`.
    OutOfRange { block_id: i64, num_blocks: usize },
    /// More blocks asked for than are free.
    NotEnoughFree { requested: usize, free: usize },
    /// A block released more often than it was referenced.
    DoubleFree { block_id: u32 },
    /// An operation that would change the null block.
    NullBlock { block_id: u32, op: &'static str },
    /// A referenced block where only a free one is allowed, or the reverse.
    BadState { block_id: u32, reason: String },
    /// A reference count that would overflow.
    RefOverflow { block_id: u32 },
    /// A block of another pool passed to an operation that takes only this pool's blocks.
    ForeignBlock { block_id: u32, op: &'static str },
}

impl fmt::Display for PoolError {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            PoolError::InvalidSize { requested, max } => write!(
                f,
                "a pool holds at most {max} blocks, got num_gpu_blocks={requested}"
            ),
            PoolError::InvalidArgument(message) => f.write_str(message),
            PoolError::OutOfRange {
                block_id,
                num_blocks,
            } => write!(
                f,
                "block {block_id} is out of range: this pool has blocks 0..{num_blocks}"
            ),
            PoolError::NotEnoughFree { requested, free } => write!(
                f,
                "Cannot get {requested} free blocks from the pool: only {free} are free"
            ),
            PoolError::DoubleFree { block_id } => write!(
                f,
                "block {block_id} is freed more times than it is referenced (double free)"
            ),
            PoolError::NullBlock { block_id, op } => {
                write!(f, "cannot {op} the null block (block {block_id})")
            }
            PoolError::BadState { block_id, reason } => write!(f, "block {block_id}: {reason}"),
            PoolError::RefOverflow { block_id } => {
                write!(f, "the reference count of block {block_id} would overflow")
            }
            PoolError::ForeignBlock { block_id, op } => {
                write!(f, "{op}: block {block_id} belongs to another pool")
            }
        }
    }
}

impl std::error::Error for PoolError {}

/// The failure of an operation that reads part of its input through the caller (a block
/// or a hash at some position): either the pool refused, or reading the input failed
/// with the caller's own error (say, an object of the wrong type). Either way nothing has
/// changed.
#[derive(Debug, Clone, PartialEq, Eq)]
pub enum OpError<E> {
    Pool(PoolError),
    Input(E),
}

impl<E> From<PoolError> for OpError<E> {
    fn from(e: PoolError) -> Self {
        OpError::Pool(e)
    }
}
