//! A tensor-parallel group of GPUs in this process: one rank per device, `opts.device` to
//! `opts.device + size - 1`, each a CUDA executor on its share of the model, summing through
//! NCCL. The communicators are made together on the calling thread before any rank starts, so
//! no rank can wait for one that failed to start.

use std::sync::Arc;

use cudarc::driver::CudaContext;

use super::nccl::Comm;
use super::{CudaExecutor, CudaOptions};
use crate::tp::{check_split, shard_weights, Abort, Shard, TpExecutor};
use crate::{BackendError, Executor, ModelWeights};

/// Aborts every rank's communicator (a rank waiting in a collective then returns).
struct Comms(Vec<Arc<Comm>>);

impl Abort for Comms {
    fn abort(&self, _why: &str) {
        self.0.iter().for_each(|c| c.abort());
    }
}

/// The CUDA devices visible to this process.
pub fn device_count() -> Result<usize, BackendError> {
    super::gpu::Gpu::check_driver()?;
    Ok(CudaContext::device_count()
        .map_err(super::gpu::cuda_err("cuDeviceGetCount"))?
        .max(0) as usize)
}

/// `size` ranks on consecutive devices from `opts.device`; `size == 1` is a plain executor.
pub fn tp_group(
    w: &ModelWeights,
    opts: CudaOptions,
    size: usize,
) -> Result<Box<dyn Executor>, BackendError> {
    check_split(&w.config, size)?;
    if size == 1 {
        return CudaExecutor::new(w, opts);
    }
    let found = device_count()?;
    if opts.device + size > found {
        return Err(BackendError::Config(format!(
            "tensor-parallel size {size} from device {} needs {} GPUs, but {found} are visible",
            opts.device,
            opts.device + size
        )));
    }
    let devices: Vec<usize> = (opts.device..opts.device + size).collect();
    let comms: Vec<Arc<Comm>> = Comm::init_all(&devices)?
        .into_iter()
        .map(Arc::new)
        .collect();
    let weights = Arc::new(w.clone());
    let rank_comms = comms.clone();
    let make = move |s: Shard| -> Result<Box<dyn Executor>, BackendError> {
        let part = shard_weights(&weights, s)?;
        let opts = CudaOptions {
            device: opts.device + s.rank,
            ..opts
        };
        CudaExecutor::new_rank(&part, opts, rank_comms[s.rank].clone(), s)
    };
    // Rank threads spin up to 2 ms for their next job: a decode step's comes within the host's
    // turn between steps (a few hundred microseconds), and a woken thread would add its wake-up.
    Ok(Box::new(
        TpExecutor::new(size, Arc::new(Comms(comms)), Arc::new(make))?.spinning(2000),
    ))
}
