//! Paged KV cache bookkeeping for quire (pure CPU, no tensors).
//!
//! PagedAttention stores each sequence's KV in fixed-size blocks that need not be contiguous, so
//! memory is handed out a block at a time and identical prefixes can share blocks. This crate
//! decides *which* block holds *which* tokens; the backend owns the actual tensors and indexes
//! them with the block tables produced here.
//!
//! - [`BlockPool`]: reference-counted blocks, an LRU free list, and the prefix-cache map
//!   (chained block hash → block).
//! - [`KvCacheManager`]: per-sequence block tables, prefix-cache lookup and all-or-nothing slot
//!   allocation, after vLLM v1's `KVCacheManager`.

mod block_pool;
mod hash;
mod manager;

pub use block_pool::BlockPool;
pub use hash::{hash_block_tokens, BlockHash, ROOT_BLOCK_HASH};
pub use manager::{cdiv, KvCacheConfig, KvCacheManager, KvCacheStats};

use quire_core::{BlockId, SeqId};

/// Errors of the KV bookkeeping. None of them leaves the state half-changed.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
pub enum KvError {
    #[error("invalid KV cache config: {0}")]
    InvalidConfig(String),
    #[error("{0} holds no blocks (never allocated, or already freed)")]
    UnknownSeq(SeqId),
    #[error("block {0:?} freed with no reference left")]
    DoubleFree(BlockId),
    #[error("block {0:?} does not exist")]
    InvalidBlock(BlockId),
}
