//! A tensor-parallel group of GPUs in this process: one rank per device, `opts.device` to
//! `opts.device + size - 1`, each a CUDA executor on its share of the model, summing through
//! NCCL. The communicators are made together on the calling thread before any rank starts, so
//! no rank can wait for one that failed to start. Also the vocab-parallel output's gather of the
//! ranks' logits (`gather_logits`).

use std::sync::Arc;

use cudarc::driver::sys::{cuMemcpy2DAsync_v2, cuMemcpyAsync, CUmemorytype, CUDA_MEMCPY2D};
use cudarc::driver::CudaContext;

use super::gpu::{cuda_err, Gpu};
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

/// Device addresses `gather_logits` works on.
pub(super) struct GatherBufs {
    /// `[nl, span]` f32, this rank's logits packed, in room for `nl × stride`.
    pub part: u64,
    /// `[size][nl × stride]` f32.
    pub gathered: u64,
    /// `[nl, vocab]` f32, the full logits rows.
    pub logits: u64,
    /// 0, or the device address of a page-locked host row of `vocab` f32 (`nl == 1`).
    pub host_row: u64,
}

/// A vocab-parallel rank's last op, on the GPU's stream (so a captured decode graph holds it
/// too): every rank's `[nl, span]` logits gathered by NCCL into `[rank][nl × stride]`, then each
/// rank's block copied to its columns of `logits` (one 2-D copy per rank). One row of a
/// vocabulary the ranks split evenly is gathered straight into `logits`, where the layouts
/// coincide. With `host_row`, the row is then copied there.
///
/// # Safety
///
/// The addresses are device allocations of this rank's GPU of the sizes `GatherBufs` gives (with
/// `stride = s.vocab_stride(vocab)`), live until the stream has run the copies.
pub(super) unsafe fn gather_logits(
    g: &Gpu,
    comm: &Comm,
    s: Shard,
    nl: usize,
    vocab: usize,
    b: GatherBufs,
) -> Result<(), BackendError> {
    let stride = s.vocab_stride(vocab);
    let stream = g.stream.cu_stream();
    let direct = nl == 1 && vocab.is_multiple_of(s.size);
    let recv = if direct { b.logits } else { b.gathered };
    // SAFETY: `part` holds `nl × stride` f32 and `recv` room for `size` times that (`logits`
    // holds `vocab` = `size × stride` when `direct`), as the caller guarantees.
    unsafe { comm.all_gather_f32(b.part, recv, nl * stride, stream as *mut _) }?;
    if !direct {
        for r in 0..s.size {
            let (first, count) = Shard { rank: r, ..s }.vocab_span(vocab);
            if count == 0 {
                continue;
            }
            let copy = CUDA_MEMCPY2D {
                srcXInBytes: 0,
                srcY: 0,
                srcMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                srcHost: std::ptr::null(),
                srcDevice: b.gathered + (r * nl * stride * 4) as u64,
                srcArray: std::ptr::null_mut(),
                srcPitch: count * 4,
                dstXInBytes: first * 4,
                dstY: 0,
                dstMemoryType: CUmemorytype::CU_MEMORYTYPE_DEVICE,
                dstHost: std::ptr::null_mut(),
                dstDevice: b.logits,
                dstArray: std::ptr::null_mut(),
                dstPitch: vocab * 4,
                WidthInBytes: count * 4,
                Height: nl,
            };
            // SAFETY: rank r's block, `nl` rows of `count` f32, lies in `gathered`; its
            // destination, columns `first..first + count` of `nl` rows of `vocab`, in `logits`.
            unsafe { cuMemcpy2DAsync_v2(&copy, stream) }
                .result()
                .map_err(cuda_err("arranging the gathered logits"))?;
        }
    }
    if b.host_row != 0 {
        // One row wanted on the host: copied into the page-locked row inside the step, where one
        // GPU's output GEMV writes it itself.
        // SAFETY: `host_row` is a mapped row of `vocab` f32 and `logits` holds that row.
        unsafe { cuMemcpyAsync(b.host_row, b.logits, vocab * 4, stream) }
            .result()
            .map_err(cuda_err("copying the gathered logits row"))?;
    }
    Ok(())
}
