//! The all-reduce of small steps through peer memory: the GPUs of a tensor-parallel group read
//! each other's staging buffers over NVLink in one kernel (`kernels/allreduce.cu`) instead of
//! calling NCCL. Why: a decode step's residual rows are KiBs, where an NCCL all-reduce costs about
//! 10 µs of latency (measured on 2 H200s: 64 of them were 12% of an 8B decode step); the peer
//! kernel's cost is one flag round trip. Steps larger than [`MAX_BYTES`] per rank still go through
//! NCCL, and so does everything when some pair of GPUs cannot map each other's memory or
//! `QUIRE_CUDA_PEER_ALLREDUCE=0` is set.
//!
//! The ranks' sum is taken in rank order by every rank, so all ranks hold the same bits, and a
//! step's result does not depend on timing. With two ranks it equals NCCL's (a + b = b + a); with
//! more, a step that goes through NCCL may round differently from one that goes through here.
//!
//! Everything is allocated on the calling thread before any rank starts: per rank two staging
//! buffers, the flags the peers write, and the per-CTA call counts; one page-locked word that
//! [`PeerGroup::stop`] sets so that a rank waiting for a failed peer leaves instead of hanging.

use std::sync::Arc;

use cudarc::driver::{sys as drv_sys, CudaContext};

use super::gpu::{cuda_err, Gpu, KArg};
use crate::BackendError;

/// CTAs per all-reduce; `PEER_GRID` in allreduce.cu.
const GRID: usize = 32;
/// Threads per CTA; `PEER_THREADS` in allreduce.cu.
const THREADS: u32 = 256;
/// Ranks the flag arrays have room for.
const MAX_RANKS: usize = 8;
/// The largest all-reduce (bytes of f32 per rank) that goes through peer memory: a decode step of
/// 64 rows of 8,192 is 2 MiB. Larger steps (prompt chunks) are bandwidth, where NCCL is right.
pub const MAX_BYTES: usize = 2 << 20;

/// One rank's device memory, one allocation: staging buffers 0 and 1 (`cap` f32 each), the flags
/// the peers write (`MAX_RANKS × GRID` u32), the per-CTA call counts (`GRID` u32) and the table of
/// every rank's addresses (`n × 3` u64). Made by `cuMemAlloc`, not from the stream-ordered pool
/// (cudarc's `alloc`): pool memory is not opened to peers by `cuCtxEnablePeerAccess`, and a peer's
/// read of it faults (measured: an illegal address on 2 H200s).
struct RankMem {
    ctx: Arc<CudaContext>,
    base: u64,
}

impl RankMem {
    const FLAGS: usize = 2 * MAX_BYTES;
    const EPOCHS: usize = Self::FLAGS + MAX_RANKS * GRID * 4;
    const TABLE: usize = Self::EPOCHS + GRID * 4;

    fn new(ctx: &Arc<CudaContext>, n: usize) -> Result<Self, BackendError> {
        ctx.bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        let bytes = Self::TABLE + n * 3 * 8;
        // SAFETY: a fresh allocation on the bound context, zeroed before use.
        let base = unsafe { cudarc::driver::result::malloc_sync(bytes) }
            .map_err(cuda_err("allocating the all-reduce buffers"))?;
        let me = RankMem {
            ctx: ctx.clone(),
            base,
        };
        // SAFETY: `bytes` bytes at `base` were just allocated on this context.
        unsafe { cudarc::driver::result::memset_d8_sync(base, 0, bytes) }
            .map_err(cuda_err("clearing the all-reduce buffers"))?;
        Ok(me)
    }

    fn stage(&self, i: usize) -> u64 {
        self.base + (i * MAX_BYTES) as u64
    }
    fn flags(&self) -> u64 {
        self.base + Self::FLAGS as u64
    }
    fn epochs(&self) -> u64 {
        self.base + Self::EPOCHS as u64
    }
    fn table(&self) -> u64 {
        self.base + Self::TABLE as u64
    }
}

impl Drop for RankMem {
    fn drop(&mut self) {
        if self.ctx.bind_to_thread().is_ok() {
            // SAFETY: allocated by `malloc_sync` in `new`, freed once, after every rank executor
            // (each holds the group) is gone, so no kernel uses it any more.
            let _ = unsafe { cudarc::driver::result::free_sync(self.base) };
        }
    }
}

/// A page-locked host word the devices read (`CU_MEMHOSTALLOC_PORTABLE | DEVICEMAP`: one address
/// valid in every context).
struct StopWord {
    host: *mut u32,
    dev: u64,
}

// SAFETY: the word is owned memory; the host writes it with volatile stores only.
unsafe impl Send for StopWord {}
// SAFETY: see above.
unsafe impl Sync for StopWord {}

impl Drop for StopWord {
    fn drop(&mut self) {
        // SAFETY: allocated by malloc_host in `PeerGroup::new`, freed once, after every rank
        // executor (each holds the group) is gone, so no kernel reads it any more.
        let _ = unsafe { cudarc::driver::result::free_host(self.host as *mut std::ffi::c_void) };
    }
}

/// The peer all-reduce state of a whole group.
pub struct PeerGroup {
    ranks: Vec<RankMem>,
    stop: StopWord,
}

impl PeerGroup {
    /// The group over `devices` (CUDA ordinals, rank i on `devices[i]`), or `None` when some pair
    /// cannot reach each other's memory or there are more than [`MAX_RANKS`] ranks (NCCL then
    /// does every all-reduce).
    pub fn new(devices: &[usize]) -> Result<Option<Arc<PeerGroup>>, BackendError> {
        let n = devices.len();
        if !(2..=MAX_RANKS).contains(&n) {
            return Ok(None);
        }
        let ctxs = devices
            .iter()
            .map(|&d| CudaContext::new(d).map_err(cuda_err("creating the CUDA context")))
            .collect::<Result<Vec<_>, _>>()?;
        for (i, a) in ctxs.iter().enumerate() {
            for (j, b) in ctxs.iter().enumerate() {
                if i == j {
                    continue;
                }
                let mut can = 0;
                // SAFETY: plain out-parameter; both devices exist (their contexts were made).
                unsafe { drv_sys::cuDeviceCanAccessPeer(&mut can, a.cu_device(), b.cu_device()) }
                    .result()
                    .map_err(cuda_err("cuDeviceCanAccessPeer"))?;
                if can == 0 {
                    return Ok(None);
                }
                a.bind_to_thread()
                    .map_err(cuda_err("binding the context"))?;
                // SAFETY: both contexts are live primary contexts; enabling twice is reported and
                // allowed below.
                let r = unsafe { drv_sys::cuCtxEnablePeerAccess(b.cu_ctx(), 0) };
                if r != drv_sys::CUresult::CUDA_SUCCESS
                    && r != drv_sys::CUresult::CUDA_ERROR_PEER_ACCESS_ALREADY_ENABLED
                {
                    return Err(BackendError::Cuda(format!(
                        "enabling peer access from GPU {} to GPU {}: {r:?}",
                        devices[i], devices[j]
                    )));
                }
            }
        }
        let stop = {
            ctxs[0]
                .bind_to_thread()
                .map_err(cuda_err("binding the context"))?;
            let flags = drv_sys::CU_MEMHOSTALLOC_PORTABLE | drv_sys::CU_MEMHOSTALLOC_DEVICEMAP;
            // SAFETY: a fresh allocation of one u32, zeroed before any kernel can read it.
            let p = unsafe { cudarc::driver::result::malloc_host(4, flags) }
                .map_err(cuda_err("allocating the all-reduce stop word"))?
                as *mut u32;
            // SAFETY: `p` is the live allocation just made.
            unsafe { p.write_volatile(0) };
            let mut dev: drv_sys::CUdeviceptr = 0;
            // SAFETY: `p` is a live page-locked allocation made with DEVICEMAP.
            unsafe {
                drv_sys::cuMemHostGetDevicePointer_v2(&mut dev, p as *mut std::ffi::c_void, 0)
            }
            .result()
            .map_err(cuda_err("mapping the all-reduce stop word"))?;
            StopWord { host: p, dev }
        };
        let ranks = ctxs
            .iter()
            .map(|c| RankMem::new(c, n))
            .collect::<Result<Vec<_>, _>>()?;
        let addrs: Vec<u64> = ranks
            .iter()
            .flat_map(|m| [m.stage(0), m.stage(1), m.flags()])
            .collect();
        for m in &ranks {
            m.ctx
                .bind_to_thread()
                .map_err(cuda_err("binding the context"))?;
            // SAFETY: the table's `n × 3` u64 lie inside the rank's allocation (`RankMem`).
            unsafe { cudarc::driver::result::memcpy_htod_sync(m.table(), &addrs) }
                .map_err(cuda_err("writing the all-reduce table"))?;
        }
        Ok(Some(Arc::new(PeerGroup { ranks, stop })))
    }

    /// Rank `rank`'s handle.
    pub fn rank(self: &Arc<Self>, rank: usize) -> PeerRank {
        let m = &self.ranks[rank];
        PeerRank {
            table: m.table(),
            epochs: m.epochs(),
            rank,
            size: self.ranks.len(),
            group: self.clone(),
        }
    }

    /// Makes every rank waiting in a peer all-reduce leave it (with no result), now and later.
    pub fn stop(&self) {
        // SAFETY: the word is live while the group is; a volatile store the devices read.
        unsafe { self.stop.host.write_volatile(1) };
    }

    fn stopped(&self) -> bool {
        // SAFETY: as in `stop`.
        unsafe { self.stop.host.read_volatile() != 0 }
    }
}

/// One rank's side of the group's peer all-reduce.
pub struct PeerRank {
    group: Arc<PeerGroup>,
    table: u64,
    epochs: u64,
    rank: usize,
    size: usize,
}

impl PeerRank {
    /// Whether an all-reduce of `count` f32 goes through peer memory.
    pub fn fits(&self, count: usize) -> bool {
        count % 4 == 0 && count * 4 <= MAX_BYTES
    }

    /// `x` ← the group's sum of `x` (`count` f32, in place), on `gpu`'s stream.
    ///
    /// # Safety
    /// `x` is a device allocation of at least `count` f32 on `gpu`, which is this rank's device;
    /// `f` is `peer_all_reduce_f32` loaded on it; `fits(count)`; every rank of the group launches
    /// the same sequence of peer all-reduces (the kernel pairs them by count).
    pub unsafe fn launch(
        &self,
        gpu: &Gpu,
        f: &cudarc::driver::CudaFunction,
        x: u64,
        count: usize,
    ) -> Result<(), BackendError> {
        if self.group.stopped() {
            return Err(BackendError::Cuda(
                "all-reduce on a stopped tensor-parallel group".into(),
            ));
        }
        let args = [
            KArg::P(x),
            KArg::I(count as i32),
            KArg::I(self.rank as i32),
            KArg::I(self.size as i32),
            KArg::P(self.table),
            KArg::P(self.epochs),
            KArg::P(self.group.stop.dev),
        ];
        // SAFETY: the argument list is the kernel's; the table, counts and stop word live as
        // long as the group (held by `self`); `x` and `count` are the caller's contract.
        unsafe { gpu.launch(f, (GRID as u32, 1, 1), (THREADS, 1, 1), &args) }
    }
}
