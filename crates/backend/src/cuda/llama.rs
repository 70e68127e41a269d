//! The Llama-family forward pass on CUDA (Llama 2/3, SmolLM2, Mistral, Qwen2's QKV bias, Qwen3's
//! QK-norm). Weights live on the GPU as f16, stacked like the CPU backend's (QKV, gate+up), so a
//! layer is four cuBLAS GEMMs and five kernels (four in a decode step, whose attention kernel
//! applies RoPE itself); the residual adds ride on the GEMMs (beta = 1).
//! The residual stream is f32; GEMM inputs are f16. The KV cache is f16, one buffer per layer.
//! A step runs the shared layer sequence (`crate::forward`) with the kernels of `forward.rs`.

use std::collections::HashMap;
use std::sync::Arc;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaFunction, CudaGraph};
use half::f16;
use quire_core::ModelConfig;

use super::attention::{pack_meta, PagedAttention};
use super::forward::Step;
use super::gpu::{DBuf, Gpu};
use super::meta::{pack_meta_padded, MappedMeta};
use super::moe::{MoeKernels, MoeLayer};
use super::nccl::Comm;
use super::qmat::{QuantKernels, WMat};
use super::sample::SampleKernel;
use super::scratch::Scratch;
use super::CudaOptions;
use crate::tp::Shard;
use crate::{
    BackendError, Executor, ForwardBatch, KvCacheSpec, MaskFill, ModelWeights, OpStat, SampleParams,
};

use super::profile::EventProfiler;

/// A layer's weights on the device (its KV cache is `CudaExecutor::kv_caches`).
pub(super) type Layer = crate::forward::Layer<WMat, DBuf<f32>, MoeLayer>;

pub(super) struct Kernels {
    pub(super) rms_norm: CudaFunction,
    pub(super) rms_norm_f32: CudaFunction,
    pub(super) embed: CudaFunction,
    /// `embed` that first copies the step's metadata from mapped host memory (`MappedMeta`).
    pub(super) embed_meta: CudaFunction,
    pub(super) swiglu: CudaFunction,
    pub(super) rope: CudaFunction,
    pub(super) argmax: CudaFunction,
    /// `None` where the device lacks the shared memory (rows are then sampled on the host).
    pub(super) sample: Option<SampleKernel>,
    pub(super) attention: PagedAttention,
    pub(super) q: QuantKernels,
    /// One-token f16 matmuls (`None`: cuBLAS for every size, `CudaOptions::gemv` off).
    pub(super) gemv: Option<super::gemv::Gemv>,
    /// Compiled only for MoE models.
    pub(super) moe: Option<MoeKernels>,
}

pub struct CudaExecutor {
    pub(super) gpu: Gpu,
    pub(super) cfg: ModelConfig,
    pub(super) k: Kernels,
    pub(super) embed: WMat,
    pub(super) output: Option<WMat>, // None: tied to `embed`
    pub(super) output_norm: DBuf<f32>,
    pub(super) rope_cs: DBuf<f32>, // [max_pos, pairs, 2]
    pub(super) max_pos: usize,
    pub(super) layers: Vec<Layer>,
    /// Each layer's K and V caches (f16, the pool's slots plus one padding block).
    pub(super) kv_caches: Vec<(DBuf<f16>, DBuf<f16>)>,
    pub(super) kv: KvCacheSpec,
    pub(super) s: Scratch,
    /// Pinned: the logits copy of every step runs at the bus rate.
    pub(super) host_logits: super::gpu::HostBuf<f32>,
    pub(super) host_logits_len: usize,
    /// One logits row in page-locked memory the device writes (and its device address): a
    /// one-row step that returns logits has the output GEMV write them there, so no copy
    /// follows the step.
    pub(super) host_row: (super::gpu::HostBuf<f32>, u64),
    /// Whether the last `forward` left its logits in `host_row`.
    pub(super) logits_in_row: bool,
    pub(super) host_ids: Vec<i32>,
    pub(super) meta_host: Vec<i32>,
    pub(super) prof: EventProfiler,
    pub(super) use_graphs: bool,
    /// See `CudaOptions::dequant_gemm_tokens`.
    pub(super) dequant_gemm_tokens: usize,
    /// Captured decode graphs.
    pub(super) graphs: HashMap<GraphKey, Graph>,
    /// Small decode steps' metadata, read by the graph's first kernel from page-locked memory
    /// instead of copied (f16 embeddings only, the kernel that copies it being
    /// `embed_f16_meta`; `None` for quantized embeddings). Measured on the H100: within ±0.6% of
    /// the copy, ahead in most alternating pairs.
    pub(super) meta_mapped: Option<MappedMeta>,
    /// The communicator and rank of a sharded model (`crate::tp`).
    pub(super) tp: Option<(Arc<Comm>, Shard)>,
    /// `Some(shard)`: `output` holds only this rank's vocabulary rows (`Shard::vocab_span`), and
    /// the ranks all-gather their logits (`Fwd::output`).
    pub(super) vocab_split: Option<Shard>,
}

/// What a captured decode graph was captured for: a replay must match all of it.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub(super) struct GraphKey {
    /// Padded batch size (a power of two up to `MAX_GRAPH_BATCH`).
    pub(super) rows: usize,
    /// Chained decode steps (1 for a plain decode step).
    pub(super) steps: usize,
    /// Context bound the attention splits were planned for (`graph_ctx`).
    pub(super) ctx: usize,
    /// Whether the logits go to `host_row`.
    pub(super) logits_to_host: bool,
    /// Words of metadata the graph reads from `meta_mapped` (0: copied before the replay).
    pub(super) meta_words: usize,
    /// A chain graph's words between two steps' metadata (0 for a single step).
    pub(super) meta_stride: usize,
}

/// The decode timeline, when traced (`QUIRE_CUDA_TRACE=1`), goes to stderr as the executor ends.
impl Drop for CudaExecutor {
    fn drop(&mut self) {
        if let Some(t) = &self.gpu.trace {
            let r = self
                .gpu
                .ctx
                .bind_to_thread()
                .map_err(super::gpu::cuda_err("binding the context"))
                .and_then(|_| t.report(&self.gpu));
            match r {
                Ok(table) => eprintln!("decode timeline (QUIRE_CUDA_TRACE=1):\n{table}"),
                Err(e) => eprintln!("decode timeline: {e}"),
            }
        }
    }
}

/// A captured decode graph. cudarc leaves `CudaGraph` `!Send` (it holds raw driver handles); the
/// executor moves between threads (built on one, stepped on the engine's) but is used by one at a
/// time, and binds its context before every use.
pub(super) struct Graph(pub(super) CudaGraph, pub(super) Vec<super::trace::Mark>);
// SAFETY: see above; CUDA graph handles are not tied to the thread that created them.
unsafe impl Send for Graph {}

impl CudaExecutor {
    // Boxed: callers hold executors as `Box<dyn Executor>`, and the stand-in has nothing else to return.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(w: &ModelWeights, opts: CudaOptions) -> Result<Box<dyn Executor>, BackendError> {
        Ok(Box::new(Self::create(w, opts)?))
    }

    /// Rank `shard.rank` of a tensor-parallel group on device `opts.device`: `w` is that rank's
    /// part of the model (`tp::shard_weights`), `comm` its communicator. The rank uploads only its
    /// vocabulary rows of the output projection (vocab-parallel output).
    pub fn new_rank(
        w: &ModelWeights,
        opts: CudaOptions,
        comm: Arc<Comm>,
        shard: Shard,
    ) -> Result<Box<dyn Executor>, BackendError> {
        if comm.size != shard.size || comm.rank != shard.rank {
            return Err(BackendError::Config(format!(
                "rank {} of {} on the communicator of rank {} of {}",
                shard.rank, shard.size, comm.rank, comm.size
            )));
        }
        let mut me = Self::create_part(w, opts, Some(shard))?;
        me.tp = Some((comm, shard));
        Ok(Box::new(me))
    }
}

impl Executor for CudaExecutor {
    fn backend_name(&self) -> &'static str {
        "cuda"
    }

    fn kv_spec(&self) -> KvCacheSpec {
        self.kv
    }

    fn vocab_size(&self) -> usize {
        self.cfg.vocab_size
    }

    fn set_profiling(&mut self, on: bool) {
        self.prof.set(on);
    }

    fn take_profile(&mut self) -> Vec<OpStat> {
        self.prof.take()
    }

    /// Device memory in use (`cuMemGetInfo`: total − free, so the CUDA context and cuBLAS's
    /// workspace count too). quire allocates weights and the KV pool at load and only grows its
    /// work buffers, never freeing them while the executor lives, so the amount in use when this
    /// is asked (at the end of a run) is the run's peak.
    fn device_memory_peak(&self) -> Option<u64> {
        let (free, total) = self.gpu.mem_info().ok()?;
        Some(total.saturating_sub(free) as u64)
    }

    fn forward(&mut self, batch: &ForwardBatch) -> Result<&[f32], BackendError> {
        self.forward_inner(batch)?;
        Ok(self.logits_on_host())
    }

    /// The step without the copy of its logits to the host (the sync still reports its errors).
    fn forward_discard(&mut self, batch: &ForwardBatch) -> Result<(), BackendError> {
        self.run(batch, false)?;
        self.gpu.sync()?;
        self.prof.finish(&self.gpu)
    }

    fn forward_greedy(&mut self, batch: &ForwardBatch) -> Result<Vec<u32>, BackendError> {
        self.forward_greedy_inner(batch)?;
        Ok(self.host_ids.iter().map(|&t| t as u32).collect())
    }

    fn forward_greedy_chain(
        &mut self,
        batch: &ForwardBatch,
        steps: usize,
    ) -> Result<Vec<u32>, BackendError> {
        self.chain(batch, steps)
    }

    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        rows: &[SampleParams],
        masks: Option<&mut MaskFill>,
    ) -> Result<Vec<u32>, BackendError> {
        self.forward_sample_inner(batch, rows, masks)?;
        Ok(self.host_ids.iter().map(|&t| t as u32).collect())
    }
}

impl CudaExecutor {
    pub(super) fn check_batch(&self, batch: &ForwardBatch) -> Result<(), BackendError> {
        batch.check(self.kv, self.cfg.vocab_size)?;
        if let Some(&p) = batch
            .positions
            .iter()
            .find(|&&p| p as usize >= self.max_pos)
        {
            return Err(BackendError::InvalidBatch(format!(
                "position {p} is beyond the context this cache was built for ({})",
                self.max_pos
            )));
        }
        Ok(())
    }

    /// The logits the last `forward_inner` left on the host.
    pub(super) fn logits_on_host(&self) -> &[f32] {
        if self.logits_in_row {
            self.host_row.0.slice(self.cfg.vocab_size)
        } else {
            self.host_logits.slice(self.host_logits_len)
        }
    }

    /// Where a step with `nl` logits rows that go to the host writes them: `host_row`'s device
    /// address when it is one row by the output GEMV, else 0 (`s.logits`, copied afterwards).
    fn logits_dst(&self, nl: usize, to_host: bool) -> u64 {
        // A vocab-parallel rank copies one gathered row there inside the step (`Fwd::output`).
        let one_row = match self.vocab_split {
            Some(_) => nl == 1,
            None => self.output_by_gemv(nl),
        };
        if to_host && one_row {
            self.host_row.1
        } else {
            0
        }
    }

    /// Runs the batch; the logits of `batch.logits_indices` end on the device in `s.logits`, or
    /// with `to_host` and one row by the GEMV in `host_row` (returns whether they did).
    pub(super) fn run(
        &mut self,
        batch: &ForwardBatch,
        to_host: bool,
    ) -> Result<bool, BackendError> {
        self.check_batch(batch)?;
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(super::gpu::cuda_err("binding the context"))?;
        let n = batch.num_tokens();
        let decode_only = batch.seqs.iter().all(|s| s.query_len == 1);
        let identity = batch
            .logits_indices
            .iter()
            .enumerate()
            .all(|(i, &r)| i == r as usize)
            && batch.logits_indices.len() == n;
        if self.use_graphs && !self.prof.is_on() && decode_only && identity && n <= MAX_GRAPH_BATCH
        {
            return self.run_graph(batch, to_host);
        }
        let c = &self.cfg;
        let plan = self.k.attention.plan_batch(self.gpu.sms, batch);
        let layout = pack_meta(batch, &mut self.meta_host, self.k.attention.prefill_rows());
        let nl = batch.logits_indices.len();
        if self.grow(n, nl, n * c.num_heads * plan.splits, self.meta_host.len())? {
            self.graphs.clear();
        }
        self.upload_meta()?;
        let logits_host = self.logits_dst(nl, to_host);
        let step = Step {
            n,
            nl,
            plan,
            meta_base: self.s.meta.ptr,
            layout,
            pairs: batch.seqs.iter().map(|q| q.query_len * q.seq_len).sum(),
            ctx_tokens: batch.seqs.iter().map(|q| q.seq_len).sum(),
            logits_host,
            meta_src: 0,
            meta_words: 0,
        };
        self.prof.start(&self.gpu)?;
        self.enqueue(step)?;
        Ok(logits_host != 0)
    }

    /// A decode-only batch through the CUDA graph of its batch-size bucket (captured on first
    /// use): rows past `n` are padding that attends to itself in a reserved block.
    fn run_graph(&mut self, batch: &ForwardBatch, to_host: bool) -> Result<bool, BackendError> {
        let n = batch.num_tokens();
        let b = n.next_power_of_two();
        let c = &self.cfg;
        let bs = self.kv.block_size;
        let layout = pack_meta_padded(batch, b, self.kv.num_blocks, bs, &mut self.meta_host);
        let max_ctx = batch.seqs.iter().map(|s| s.seq_len).max().unwrap_or(1);
        let ctx = self.graph_ctx(max_ctx);
        let plan = self.k.attention.plan(self.gpu.sms, b, ctx, true);
        // Small metadata goes through mapped memory when that is on (the graph's embed copies
        // it), else by a copy before the replay.
        let mapped = match &mut self.meta_mapped {
            Some(m) => m.stage(&self.meta_host).map(|words| (m.dev, words)),
            None => None,
        };
        let (meta_src, meta_words) = mapped.unwrap_or((0, 0));
        let meta_len = self.meta_host.len().max(meta_words);
        if self.grow(b, b, b * c.num_heads * plan.splits, meta_len)? {
            self.graphs.clear();
        }
        if mapped.is_none() {
            self.upload_meta()?;
        }
        let logits_host = self.logits_dst(b, to_host);
        let step = Step {
            n: b,
            nl: b,
            plan,
            meta_base: self.s.meta.ptr,
            layout,
            pairs: 0,
            ctx_tokens: 0,
            logits_host,
            meta_src,
            meta_words,
        };
        let key = GraphKey {
            rows: b,
            steps: 1,
            ctx,
            logits_to_host: logits_host != 0,
            meta_words,
            meta_stride: 0,
        };
        self.replay(key, |e| e.enqueue(step))?;
        Ok(logits_host != 0)
    }

    /// Launches the graph of `key`, capturing what `enqueue` puts on the stream first when there
    /// is none yet.
    pub(super) fn replay(
        &mut self,
        key: GraphKey,
        enqueue: impl FnOnce(&mut Self) -> Result<(), BackendError>,
    ) -> Result<(), BackendError> {
        if !self.graphs.contains_key(&key) {
            let stream = self.gpu.stream.clone();
            let mark0 = self.gpu.trace_len();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(super::gpu::cuda_err("beginning graph capture"))?;
            let r = enqueue(self);
            let marks = self.gpu.trace_take(mark0);
            let graph = stream
                .end_capture(CUgraphInstantiate_flags(0))
                .map_err(super::gpu::cuda_err("instantiating the decode graph"));
            r?;
            let graph = graph?
                .ok_or_else(|| BackendError::Cuda("graph capture recorded nothing".into()))?;
            self.graphs.insert(key, Graph(graph, marks));
        }
        let graph = &self.graphs[&key];
        self.gpu.trace_replay(&graph.1);
        graph
            .0
            .launch()
            .map_err(super::gpu::cuda_err("launching the decode graph"))
    }

    /// Copies `meta_host` to the device's metadata buffer. From pageable memory on purpose: the
    /// driver carries a copy this small in its command stream, which measured faster than a DMA
    /// from page-locked memory (135M tg128 on the H100: 2,388 against 2,358).
    fn upload_meta(&mut self) -> Result<(), BackendError> {
        self.gpu.htod(&self.meta_host, &mut self.s.meta, 0)
    }

    /// The context bound a decode graph is captured for: `max_ctx` (the longest context of the
    /// batch's last step) rounded up to a power of two, at least `GRAPH_CTX_MIN`. The attention
    /// launch's split count follows it, so short contexts do not pay for the splits (and their
    /// merge launch) the longest would need; the kernel divides each row's own keys among the
    /// splits, so any context up to the bound is right. A bound starting at 256 gave a
    /// one-sequence decode at 128 keys two splits and a merge launch per layer when the cache
    /// could hold 256 positions, but not when it held only 128: decode was slower after a prompt.
    pub(super) fn graph_ctx(&self, max_ctx: usize) -> usize {
        max_ctx
            .max(GRAPH_CTX_MIN)
            .next_power_of_two()
            .min(self.max_pos)
    }

    pub(super) fn forward_inner(&mut self, batch: &ForwardBatch) -> Result<(), BackendError> {
        self.logits_in_row = self.run(batch, true)?;
        if self.logits_in_row {
            // The output GEMV wrote the row into `host_row`; the sync makes it visible.
            self.gpu.sync()?;
        } else {
            let nl = batch.logits_indices.len();
            self.host_logits_len = nl * self.cfg.vocab_size;
            let out = self.host_logits.slice_mut(self.host_logits_len)?;
            self.gpu.dtoh(&self.s.logits, out)?;
        }
        self.prof.finish(&self.gpu)
    }

    fn forward_greedy_inner(&mut self, batch: &ForwardBatch) -> Result<(), BackendError> {
        self.run(batch, false)?;
        let nl = batch.logits_indices.len();
        if nl > 0 {
            // SAFETY: `run` grew `ids` to the step's `nl` logits rows; scratch lives as long as
            // the executor.
            unsafe { self.launch_argmax(nl, self.s.ids.ptr) }?;
        }
        self.host_ids.resize(nl, 0);
        self.gpu.dtoh(&self.s.ids, &mut self.host_ids)?;
        self.prof.finish(&self.gpu)
    }
}

/// The smallest context bound of a decode graph: at 64 keys every model's decode attention takes
/// one split (no merge launch).
pub(super) const GRAPH_CTX_MIN: usize = 64;

/// Largest decode batch run through a CUDA graph (buckets are powers of two up to it).
pub(super) const MAX_GRAPH_BATCH: usize = 256;
