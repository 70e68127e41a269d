//! Tensor parallelism: one model split over several ranks (GPUs, or CPU "ranks" in one process
//! for testing), Megatron style. Why: a model larger than one device's memory, or one device's
//! bandwidth, runs on several at once.
//!
//! - `shard`: which part of every weight a rank holds (Q/K/V and gate/up split by output rows —
//!   heads, KV heads, FFN columns — and the o and down projections by input columns), and the
//!   model config each rank runs with. Embedding and norms are replicated. The output projection
//!   is split by vocabulary rows (`output_rows`, taken by each backend's rank constructor): each
//!   rank reads only its share of the largest matrix, then the ranks all-gather their logits, so
//!   every rank holds the full rows and greedy, sampled and chained steps run as on one device.
//! - `forward.rs` (the shared layer sequence) adds the ranks' partial o and down products with an
//!   all-reduce of the residual stream after each; only the lead rank adds its residual, the
//!   others contribute their partial product alone, so the sum counts the residual once.
//! - `group`: an [`Executor`](crate::Executor) over one rank executor per thread. The scheduler and
//!   block tables run once; every rank gets the same batch and holds its share of every KV block;
//!   the lead rank's result is the group's.
//! - `host`: the in-memory all-reduce and all-gather that CPU ranks use (deterministic: ranks
//!   summed in order).

pub mod group;
pub mod host;
pub mod shard;

pub use group::{Abort, TpExecutor};
pub use host::HostReduce;
pub use shard::{check_split, output_rows, shard_config, shard_weights, Shard};

use std::sync::Arc;

use crate::cpu::{CpuExecutor, CpuOptions};
use crate::{BackendError, Executor, KvCacheSpec, ModelWeights};

/// `size` CPU ranks in one process, each on `opts.threads / size` threads (at least one), summing
/// through a [`HostReduce`]: the sharding arithmetic without GPUs (tests, and a check of a split
/// before it goes to GPUs). `size == 1` is a plain CPU executor.
pub fn cpu_group(
    w: &ModelWeights,
    kv: KvCacheSpec,
    opts: CpuOptions,
    size: usize,
) -> Result<Box<dyn Executor>, BackendError> {
    check_split(&w.config, size)?;
    if size == 1 {
        return Ok(Box::new(CpuExecutor::new(w, kv, opts)?));
    }
    let group = Arc::new(HostReduce::new(size));
    let weights = Arc::new(w.clone());
    let opts = CpuOptions {
        threads: (opts.threads / size).max(1),
        ..opts
    };
    let g = group.clone();
    let make = move |s: Shard| -> Result<Box<dyn Executor>, BackendError> {
        let part = shard_weights(&weights, s)?;
        Ok(Box::new(CpuExecutor::new_rank(
            &part,
            kv,
            opts,
            g.clone(),
            s,
        )?))
    };
    Ok(Box::new(TpExecutor::new(size, group, Arc::new(make))?))
}
