//! The Llama-family forward pass on CUDA (Llama 2/3, SmolLM2, Mistral, Qwen2's QKV bias, Qwen3's
//! QK-norm). Weights live on the GPU as f16, stacked like the CPU backend's (QKV, gate+up), so a
//! layer is four cuBLAS GEMMs and five kernels (four in a decode step, whose attention kernel
//! applies RoPE itself); the residual adds ride on the GEMMs (beta = 1).
//! The residual stream is f32; GEMM inputs are f16. The KV cache is f16, one buffer per layer.

use std::collections::HashMap;

use cudarc::driver::sys::{CUgraphInstantiate_flags, CUstreamCaptureMode};
use cudarc::driver::{CudaFunction, CudaGraph};
use half::f16;
use quire_core::ModelConfig;
use quire_gguf::GgmlType;

use super::attention::{pack_meta, PagedAttention};
use super::forward::Step;
use super::gpu::{DBuf, Gpu};
use super::meta::{pack_meta_padded, MappedMeta};
use super::moe::{MoeKernels, MoeLayer};
use super::nvrtc;
use super::qmat::{is_block32_quant, is_native_quant, upload_stacked, QuantKernels, WMat};
use super::sample::SampleKernel;
use super::scratch::Scratch;
use super::CudaOptions;
use crate::{
    BackendError, Executor, ForwardBatch, HostTensor, KvCacheSpec, ModelWeights, OpStat,
    SampleParams,
};

use super::profile::EventProfiler;

pub(super) struct Layer {
    pub(super) attn_norm: DBuf<f32>,
    pub(super) wqkv: WMat,
    pub(super) bqkv: Option<DBuf<f32>>,
    pub(super) q_norm: Option<DBuf<f32>>,
    pub(super) k_norm: Option<DBuf<f32>>,
    pub(super) wo: WMat,
    pub(super) ffn_norm: DBuf<f32>,
    pub(super) ffn: CudaFfn,
    pub(super) k_cache: DBuf<f16>,
    pub(super) v_cache: DBuf<f16>,
}

/// A layer's feed-forward block on the device.
pub(super) enum CudaFfn {
    /// Stacked gate+up `[2 · inter, hidden]` and down `[hidden, inter]`.
    Dense {
        w_gate_up: WMat,
        w_down: WMat,
    },
    Moe(MoeLayer),
}

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
    pub(super) kv: KvCacheSpec,
    pub(super) s: Scratch,
    /// Pinned: the logits copy of every step runs at the bus rate.
    pub(super) host_logits: super::gpu::HostBuf<f32>,
    pub(super) host_logits_len: usize,
    /// One logits row in page-locked memory the device writes (and its device address): a
    /// one-row step that returns logits has the output GEMV write them there, so no copy
    /// follows the step (`QUIRE_CUDA_LOGITS_MAPPED=0`: copy as before). `None` when off.
    pub(super) host_row: Option<(super::gpu::HostBuf<f32>, u64)>,
    /// Whether the last `forward` left its logits in `host_row`.
    pub(super) logits_in_row: bool,
    pub(super) host_ids: Vec<i32>,
    pub(super) meta_host: Vec<i32>,
    pub(super) prof: EventProfiler,
    pub(super) use_graphs: bool,
    /// Capture decode graphs for the longest context (`graph_ctx`).
    pub(super) graph_ctx_max: bool,
    /// The smallest context bound of a decode graph (`GRAPH_CTX_MIN` unless measuring).
    pub(super) graph_ctx_min: usize,
    /// See `CudaOptions::dequant_gemm_tokens`.
    pub(super) dequant_gemm_tokens: usize,
    /// Decode graphs by (padded batch size, chained steps, context bound: `graph_ctx`, logits
    /// to `host_row`, words of metadata read from `meta_mapped`, 0 when copied).
    pub(super) graphs: HashMap<(usize, usize, usize, bool, usize), Graph>,
    /// Small decode steps' metadata, read by the graph's first kernel from page-locked memory
    /// instead of copied (f16 embeddings only, the kernel that copies it being
    /// `embed_f16_meta`). `None` when off (`QUIRE_CUDA_META_MAPPED=0`). Measured on the H100
    /// (PERF.md, stop 20): within ±0.6% of the copy, ahead in most alternating pairs.
    pub(super) meta_mapped: Option<MappedMeta>,
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

fn upload_vec(gpu: &Gpu, t: &HostTensor, len: usize) -> Result<DBuf<f32>, BackendError> {
    if t.n_elements() != len {
        return Err(BackendError::Shape {
            name: t.name.clone(),
            got: t.dims.clone(),
            expected: vec![len],
        });
    }
    gpu.upload(&t.to_f32()?)
}

impl CudaExecutor {
    // Boxed: callers hold executors as `Box<dyn Executor>`, and the stand-in has nothing else to return.
    #[allow(clippy::new_ret_no_self)]
    pub fn new(w: &ModelWeights, opts: CudaOptions) -> Result<Box<dyn Executor>, BackendError> {
        Ok(Box::new(Self::create(w, opts)?))
    }

    pub fn create(w: &ModelWeights, opts: CudaOptions) -> Result<Self, BackendError> {
        let c = &w.config;
        c.validate().map_err(BackendError::Config)?;
        let bs = opts.block_size;
        if !matches!(bs, 16 | 32 | 64 | 128) {
            return Err(BackendError::Config(format!(
                "block size must be 16, 32, 64 or 128 (got {bs})"
            )));
        }
        if !matches!(c.head_dim, 64 | 128 | 256) || !c.num_heads.is_multiple_of(c.num_kv_heads) {
            return Err(BackendError::Config(format!(
                "the CUDA backend supports head_dim 64, 128 or 256 (got {})",
                c.head_dim
            )));
        }
        let gqa = c.num_heads / c.num_kv_heads;
        if gqa > 8 {
            return Err(BackendError::Config(format!(
                "the CUDA backend supports up to 8 query heads per KV head (got {gqa})"
            )));
        }
        let gpu = Gpu::new(opts.device)?;
        let (free_before, total) = gpu.mem_info()?;
        let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
        let keep_quant = opts.quantized_weights;
        // Bytes on the device: stored bytes where the kernels read the type (the MoE expert
        // kernels only the 32-element types), else f16.
        let dev_bytes = |(t, stays): (&HostTensor, fn(GgmlType) -> bool)| {
            if keep_quant && stays(t.dtype) {
                t.bytes.as_slice().len()
            } else {
                2 * t.n_elements()
            }
        };
        let dense: fn(GgmlType) -> bool = is_native_quant;
        let experts: fn(GgmlType) -> bool = is_block32_quant;
        let weight_bytes: usize = w
            .layers
            .iter()
            .flat_map(|l| {
                let ffn = match &l.ffn {
                    crate::FfnWeights::Dense {
                        w_gate,
                        w_up,
                        w_down,
                    } => vec![(w_gate, dense), (w_up, dense), (w_down, dense)],
                    crate::FfnWeights::Moe(m) => vec![
                        (&m.gate_inp, dense),
                        (&m.gate_exps, experts),
                        (&m.up_exps, experts),
                        (&m.down_exps, experts),
                    ],
                };
                [&l.wq, &l.wk, &l.wv, &l.wo]
                    .into_iter()
                    .map(|t| (t, dense))
                    .chain(ffn)
            })
            .chain([(&w.tok_embd, dense)])
            .chain(w.output.as_ref().map(|t| (t, dense)))
            .map(dev_bytes)
            .sum();
        if weight_bytes as f64 > free_before as f64 * opts.gpu_memory_utilization as f64 {
            return Err(BackendError::OutOfMemory(format!(
                "the model needs {:.1} GiB of weights but {:.1} GiB of {:.1} GiB is free on {} (x {} utilization)",
                weight_bytes as f64 / (1u64 << 30) as f64,
                free_before as f64 / (1u64 << 30) as f64,
                total as f64 / (1u64 << 30) as f64,
                gpu.name,
                opts.gpu_memory_utilization
            )));
        }

        let norm = gpu.module(&nvrtc::NORM, &[])?;
        let embed_m = gpu.module(&nvrtc::EMBED, &[])?;
        let act = gpu.module(&nvrtc::ACTIVATION, &[])?;
        let rope = gpu.module(&nvrtc::ROPE, &[])?;
        let sample = gpu.module(&nvrtc::SAMPLE, &[])?;
        let k = Kernels {
            rms_norm: Gpu::function(&norm, "rms_norm_f16")?,
            rms_norm_f32: Gpu::function(&norm, "rms_norm_f32")?,
            embed: Gpu::function(&embed_m, "embed_f16")?,
            embed_meta: Gpu::function(&embed_m, "embed_f16_meta")?,
            swiglu: Gpu::function(&act, "swiglu_f16")?,
            rope: Gpu::function(&rope, "rope_qkv")?,
            argmax: Gpu::function(&sample, "argmax_split")?,
            sample: SampleKernel::new(&gpu, &sample)?,
            attention: PagedAttention::new(&gpu, c.num_heads, c.num_kv_heads, c.head_dim)?
                .with_window(c.sliding_window),
            q: QuantKernels::new(&gpu)?,
            gemv: if opts.gemv {
                Some(super::gemv::Gemv::new(&gpu)?)
            } else {
                None
            },
            moe: c.moe.map(|_| MoeKernels::new(&gpu)).transpose()?,
        };

        let embed = upload_stacked(&gpu, &[&w.tok_embd], hd, &[c.vocab_size], keep_quant)?;
        let output = w
            .output
            .as_ref()
            .map(|t| upload_stacked(&gpu, &[t], hd, &[c.vocab_size], keep_quant))
            .transpose()?;
        if w.layers.len() != c.num_layers {
            return Err(BackendError::Config(format!(
                "config says {} layers, weights have {}",
                c.num_layers,
                w.layers.len()
            )));
        }
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in &w.layers {
            let bqkv = match (&l.bq, &l.bk, &l.bv) {
                (Some(bq), Some(bk), Some(bv)) => {
                    let mut b = bq.to_f32()?;
                    b.extend(bk.to_f32()?);
                    b.extend(bv.to_f32()?);
                    if b.len() != qs + 2 * kvs {
                        return Err(BackendError::Config("QKV bias has the wrong length".into()));
                    }
                    Some(gpu.upload(&b)?)
                }
                (None, None, None) => None,
                _ => {
                    return Err(BackendError::Config(
                        "Q, K and V biases must come together".into(),
                    ))
                }
            };
            let opt_vec = |t: &Option<HostTensor>| {
                t.as_ref()
                    .map(|t| upload_vec(&gpu, t, c.head_dim))
                    .transpose()
            };
            let ffn = match &l.ffn {
                crate::FfnWeights::Dense {
                    w_gate,
                    w_up,
                    w_down,
                } => CudaFfn::Dense {
                    w_gate_up: upload_stacked(
                        &gpu,
                        &[w_gate, w_up],
                        hd,
                        &[inter, inter],
                        keep_quant,
                    )?,
                    w_down: upload_stacked(&gpu, &[w_down], inter, &[hd], keep_quant)?,
                },
                crate::FfnWeights::Moe(m) => {
                    let cfg = c.moe.ok_or_else(|| {
                        BackendError::Config("MoE weights without a MoE config".into())
                    })?;
                    CudaFfn::Moe(MoeLayer::upload(&gpu, m, cfg, hd, keep_quant)?)
                }
            };
            layers.push(Layer {
                attn_norm: upload_vec(&gpu, &l.attn_norm, hd)?,
                wqkv: upload_stacked(
                    &gpu,
                    &[&l.wq, &l.wk, &l.wv],
                    hd,
                    &[qs, kvs, kvs],
                    keep_quant,
                )?,
                bqkv,
                q_norm: opt_vec(&l.q_norm)?,
                k_norm: opt_vec(&l.k_norm)?,
                wo: upload_stacked(&gpu, &[&l.wo], qs, &[hd], keep_quant)?,
                ffn_norm: upload_vec(&gpu, &l.ffn_norm, hd)?,
                ffn,
                // The caches come below, once their size is known.
                k_cache: gpu.alloc::<f16>(0)?,
                v_cache: gpu.alloc::<f16>(0)?,
            });
        }
        let output_norm = upload_vec(&gpu, &w.output_norm, hd)?;
        // Room to dequantize the largest quantized matrix for many-token matmuls.
        let mut scratch = Scratch::default();
        let quant_elems = layers
            .iter()
            .flat_map(|l| {
                let mut m = vec![(&l.wqkv, hd * (qs + 2 * kvs)), (&l.wo, qs * hd)];
                if let CudaFfn::Dense { w_gate_up, w_down } = &l.ffn {
                    m.extend([(w_gate_up, hd * 2 * inter), (w_down, inter * hd)]);
                }
                m
            })
            .chain([(output.as_ref().unwrap_or(&embed), hd * c.vocab_size)])
            .filter(|(m, _)| m.quant_type().is_some())
            .map(|(_, e)| e)
            .max();
        if let (Some(e), true) = (quant_elems, opts.dequant_gemm_tokens != usize::MAX) {
            scratch.wdq = Some(gpu.alloc::<f16>(e)?);
        }

        // The KV pool: what the utilization leaves after weights and a reserve for activations.
        let per_block = 2 * c.num_layers * bs * kvs * 2;
        let num_blocks = match opts.num_blocks {
            Some(n) => n,
            None => {
                let (free_now, _) = gpu.mem_info()?;
                let used = free_before.saturating_sub(free_now);
                let budget = (free_before as f64 * opts.gpu_memory_utilization as f64) as usize;
                let reserve = 512usize << 20;
                budget.saturating_sub(used + reserve) / per_block
            }
        };
        if num_blocks == 0 {
            return Err(BackendError::OutOfMemory(format!(
                "no room for a KV-cache block on {} after the weights; raise --gpu-memory-utilization",
                gpu.name
            )));
        }
        // One block more than the engine sees: padding rows of decode graphs write there.
        let slots = (num_blocks + 1) * bs * kvs;
        for l in &mut layers {
            l.k_cache = gpu.alloc::<f16>(slots)?;
            l.v_cache = gpu.alloc::<f16>(slots)?;
        }
        let max_pos = c.max_position_embeddings.min(num_blocks * bs).max(1);
        let table =
            crate::cpu::ops::RopeTable::new(c.rope_dim, c.rope_theta, w.rope_freqs.as_deref());
        let mut cs = Vec::with_capacity(max_pos * c.rope_dim);
        let mut tmp = Vec::new();
        for p in 0..max_pos {
            table.angles(p as u32, &mut tmp);
            cs.extend(tmp.iter().flat_map(|&(co, si)| [co, si]));
        }
        let rope_cs = gpu.upload(&cs)?;
        gpu.sync()?;
        let host_row = if std::env::var("QUIRE_CUDA_LOGITS_MAPPED").map_or(true, |v| v != "0") {
            Some(super::gpu::HostBuf::mapped(c.vocab_size)?)
        } else {
            None
        };
        let meta_mapped = match (&embed, std::env::var("QUIRE_CUDA_META_MAPPED").as_deref()) {
            (_, Ok("0")) => None,
            (WMat::F16(_), _) => Some(MappedMeta::new()?),
            _ => None,
        };
        Ok(Self {
            cfg: c.clone(),
            k,
            embed,
            output,
            output_norm,
            rope_cs,
            max_pos,
            layers,
            kv: KvCacheSpec {
                num_blocks,
                block_size: bs,
            },
            s: scratch,
            host_logits: Default::default(),
            host_logits_len: 0,
            host_row,
            logits_in_row: false,
            host_ids: vec![],
            meta_host: vec![],
            prof: EventProfiler::default(),
            use_graphs: opts.graphs,
            graph_ctx_max: std::env::var("QUIRE_CUDA_GRAPH_CTX").is_ok_and(|v| v == "max"),
            // `QUIRE_CUDA_GRAPH_CTX=N`: the smallest bound (a measurement switch; 256 was the
            // bound of stop 17).
            graph_ctx_min: std::env::var("QUIRE_CUDA_GRAPH_CTX")
                .ok()
                .and_then(|v| v.parse().ok())
                .unwrap_or(GRAPH_CTX_MIN),
            dequant_gemm_tokens: opts.dequant_gemm_tokens,
            graphs: HashMap::new(),
            meta_mapped,
            gpu,
        })
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

    fn forward(&mut self, batch: &ForwardBatch) -> Result<&[f32], BackendError> {
        self.forward_inner(batch)?;
        Ok(self.logits_on_host())
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
    ) -> Result<Vec<u32>, BackendError> {
        self.forward_sample_inner(batch, rows)?;
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
        match &self.host_row {
            Some((row, _)) if self.logits_in_row => row.slice(self.cfg.vocab_size),
            _ => self.host_logits.slice(self.host_logits_len),
        }
    }

    /// Where a step with `nl` logits rows that go to the host writes them: `host_row`'s device
    /// address when it is one row by the output GEMV, else 0 (`s.logits`, copied afterwards).
    fn logits_dst(&self, nl: usize, to_host: bool) -> u64 {
        match &self.host_row {
            Some((_, dev)) if to_host && self.output_by_gemv(nl) => *dev,
            _ => 0,
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
        let max_ctx = batch.seqs.iter().map(|s| s.seq_len).max().unwrap_or(1);
        let plan = self.k.attention.plan(self.gpu.sms, n, max_ctx, decode_only);
        let layout = pack_meta(batch, &mut self.meta_host, self.k.attention.prefill_rows());
        let nl = batch.logits_indices.len();
        if self.grow(n, nl, n * c.num_heads * plan.splits, self.meta_host.len())? {
            self.graphs.clear();
        }
        self.upload_meta()?;
        let meta_buf = self.s.meta.as_ref().unwrap();
        let logits_host = self.logits_dst(nl, to_host);
        let step = Step {
            n,
            nl,
            plan,
            meta_base: meta_buf.ptr,
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
        let meta_buf = self.s.meta.as_ref().unwrap();
        let logits_host = self.logits_dst(b, to_host);
        let step = Step {
            n: b,
            nl: b,
            plan,
            meta_base: meta_buf.ptr,
            layout,
            pairs: 0,
            ctx_tokens: 0,
            logits_host,
            meta_src,
            meta_words,
        };
        let key = (b, 1, ctx, logits_host != 0, meta_words);
        if !self.graphs.contains_key(&key) {
            let stream = self.gpu.stream.clone();
            let mark0 = self.gpu.trace_len();
            stream
                .begin_capture(CUstreamCaptureMode::CU_STREAM_CAPTURE_MODE_THREAD_LOCAL)
                .map_err(super::gpu::cuda_err("beginning graph capture"))?;
            let r = self.enqueue(step);
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
            .map_err(super::gpu::cuda_err("launching the decode graph"))?;
        Ok(logits_host != 0)
    }

    /// Copies `meta_host` to the device's metadata buffer. From pageable memory on purpose: the
    /// driver carries a copy this small in its command stream, which measured faster than a DMA
    /// from page-locked memory (PERF.md, stop 17: 135M tg128 2,358 against 2,388).
    fn upload_meta(&mut self) -> Result<(), BackendError> {
        let meta_buf = self.s.meta.as_mut().expect("grown before the upload");
        self.gpu.htod(&self.meta_host, meta_buf, 0)
    }

    /// The context bound a decode graph is captured for: `max_ctx` (the longest context of the
    /// batch's last step) rounded up to a power of two, at least `GRAPH_CTX_MIN`, or every
    /// position with `QUIRE_CUDA_GRAPH_CTX=max`. The attention launch's split count follows it,
    /// so short contexts do not pay for the splits (and their merge launch) the longest would
    /// need; the kernel divides each row's own keys among the splits, so any context up to the
    /// bound is right. The bound once started at 256, which gave a one-sequence decode at 128
    /// keys two splits and a merge launch per layer when the cache could hold 256 positions, but
    /// not when it held only 128: that was the "slower decode after a prompt" (PERF.md, stop 18).
    pub(super) fn graph_ctx(&self, max_ctx: usize) -> usize {
        if self.graph_ctx_max {
            return self.max_pos;
        }
        max_ctx
            .max(self.graph_ctx_min)
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
            self.gpu.dtoh(self.s.logits.as_ref().unwrap(), out)?;
        }
        self.prof.finish(&self.gpu)
    }

    fn forward_greedy_inner(&mut self, batch: &ForwardBatch) -> Result<(), BackendError> {
        self.run(batch, false)?;
        let nl = batch.logits_indices.len();
        if nl > 0 {
            let ids = self.s.ids.as_ref().unwrap().ptr;
            self.launch_argmax(nl, ids)?;
        }
        let ids = self.s.ids.as_ref().unwrap();
        self.host_ids.resize(nl, 0);
        self.gpu.dtoh(ids, &mut self.host_ids)?;
        self.prof.finish(&self.gpu)
    }
}

/// The smallest context bound of a decode graph: at 64 keys every model's decode attention takes
/// one split (no merge launch).
pub(super) const GRAPH_CTX_MIN: usize = 64;

/// Largest decode batch run through a CUDA graph (buckets are powers of two up to it).
pub(super) const MAX_GRAPH_BATCH: usize = 256;
