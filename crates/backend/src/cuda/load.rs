//! Loading a model onto the GPU: checks of what the kernels support, the weights (stacked as the
//! CPU backend stacks them), the kernels, the KV-cache pool sized from free memory, the RoPE
//! table and the step buffers.

use std::collections::HashMap;

use half::f16;
use quire_core::ModelConfig;
use quire_gguf::GgmlType;

use super::attention::PagedAttention;
use super::gpu::{DBuf, Gpu, HostBuf};
use super::llama::{CudaExecutor, Kernels, Layer};
use super::meta::MappedMeta;
use super::moe::{MoeKernels, MoeLayer};
use super::nvrtc;
use super::qmat::{is_native_quant, upload_stacked, QuantKernels, WMat};
use super::sample::SampleKernel;
use super::scratch::Scratch;
use super::CudaOptions;
use crate::forward::Ffn;
use crate::tp::{output_rows, Shard};
use crate::{BackendError, HostTensor, KvCacheSpec, ModelWeights};

use super::profile::EventProfiler;

/// Device memory kept free for activations when the KV pool is sized from free memory.
const ACTIVATION_RESERVE: usize = 512 << 20;

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

/// Fails on a model or block size the kernels do not support.
fn check_shapes(c: &ModelConfig, w: &ModelWeights, bs: usize) -> Result<(), BackendError> {
    w.check()?;
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
    Ok(())
}

/// Bytes the weights take on the device: stored bytes where the kernels read the type (dense and
/// MoE expert kernels read the same six), else f16.
fn weight_bytes(w: &ModelWeights, keep_quant: bool) -> usize {
    let dev_bytes = |(t, stays): (&HostTensor, fn(GgmlType) -> bool)| {
        if keep_quant && stays(t.dtype) {
            t.bytes.as_slice().len()
        } else {
            2 * t.n_elements()
        }
    };
    let dense: fn(GgmlType) -> bool = is_native_quant;
    let experts: fn(GgmlType) -> bool = is_native_quant;
    w.layers
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
        .sum()
}

/// Compiles (or loads from the disk cache) every kernel the model needs.
fn kernels(gpu: &Gpu, c: &ModelConfig, opts: &CudaOptions) -> Result<Kernels, BackendError> {
    let norm = gpu.module(&nvrtc::NORM, &[])?;
    let embed_m = gpu.module(&nvrtc::EMBED, &[])?;
    let act = gpu.module(&nvrtc::ACTIVATION, &[])?;
    let rope = gpu.module(&nvrtc::ROPE, &[])?;
    let sample = gpu.module(&nvrtc::SAMPLE, &[])?;
    Ok(Kernels {
        rms_norm: Gpu::function(&norm, "rms_norm_f16")?,
        rms_norm_f32: Gpu::function(&norm, "rms_norm_f32")?,
        embed: Gpu::function(&embed_m, "embed_f16")?,
        embed_meta: Gpu::function(&embed_m, "embed_f16_meta")?,
        swiglu: Gpu::function(&act, "swiglu_f16")?,
        rope: Gpu::function(&rope, "rope_qkv")?,
        argmax: Gpu::function(&sample, "argmax_split")?,
        sample: SampleKernel::new(gpu, &sample)?,
        attention: PagedAttention::new(gpu, c.num_heads, c.num_kv_heads, c.head_dim)?
            .with_window(c.sliding_window),
        q: QuantKernels::new(gpu)?,
        gemv: if opts.gemv {
            Some(super::gemv::Gemv::new(gpu)?)
        } else {
            None
        },
        moe: c.moe.map(|_| MoeKernels::new(gpu)).transpose()?,
    })
}

/// One layer's weights on the device (its KV cache comes later, once the pool is sized:
/// `CudaExecutor::kv_caches`).
fn upload_layer(
    gpu: &Gpu,
    c: &ModelConfig,
    l: &crate::LayerWeights,
    keep_quant: bool,
) -> Result<Layer, BackendError> {
    let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
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
            .map(|t| upload_vec(gpu, t, c.head_dim))
            .transpose()
    };
    let ffn = match &l.ffn {
        crate::FfnWeights::Dense {
            w_gate,
            w_up,
            w_down,
        } => Ffn::Dense {
            gate_up: upload_stacked(gpu, &[w_gate, w_up], hd, &[inter, inter], keep_quant)?,
            down: upload_stacked(gpu, &[w_down], inter, &[hd], keep_quant)?,
        },
        crate::FfnWeights::Moe(m) => {
            let cfg = c
                .moe
                .ok_or_else(|| BackendError::Config("MoE weights without a MoE config".into()))?;
            Ffn::Moe(MoeLayer::upload(gpu, m, cfg, hd, keep_quant)?)
        }
    };
    Ok(Layer {
        attn_norm: upload_vec(gpu, &l.attn_norm, hd)?,
        wqkv: upload_stacked(gpu, &[&l.wq, &l.wk, &l.wv], hd, &[qs, kvs, kvs], keep_quant)?,
        bqkv,
        q_norm: opt_vec(&l.q_norm)?,
        k_norm: opt_vec(&l.k_norm)?,
        wo: upload_stacked(gpu, &[&l.wo], qs, &[hd], keep_quant)?,
        ffn_norm: upload_vec(gpu, &l.ffn_norm, hd)?,
        ffn,
    })
}

/// Elements of the largest quantized matrix (room to dequantize it for many-token matmuls), if
/// any matrix is quantized.
fn largest_quant(c: &ModelConfig, layers: &[Layer], out_w: &WMat) -> Option<usize> {
    let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
    layers
        .iter()
        .flat_map(|l| {
            let mut m = vec![(&l.wqkv, hd * (qs + 2 * kvs)), (&l.wo, qs * hd)];
            if let Ffn::Dense { gate_up, down } = &l.ffn {
                m.extend([(gate_up, hd * 2 * inter), (down, inter * hd)]);
            }
            m
        })
        .chain([(out_w, hd * c.vocab_size)])
        .filter(|(m, _)| m.quant_type().is_some())
        .map(|(_, e)| e)
        .max()
}

/// KV-cache blocks: `opts.num_blocks`, else what the utilization leaves of the memory free
/// before loading (`free_before`) after the weights and a reserve for activations.
fn pool_blocks(
    gpu: &Gpu,
    c: &ModelConfig,
    opts: &CudaOptions,
    free_before: usize,
) -> Result<usize, BackendError> {
    let per_block = 2 * c.num_layers * opts.block_size * c.kv_size() * 2;
    let num_blocks = match opts.num_blocks {
        Some(n) => {
            // A pool the caller sized must fit what is free now (plus one padding block), or
            // the error says what would.
            let (free_now, _) = gpu.mem_info()?;
            let room = free_now.saturating_sub(ACTIVATION_RESERVE) / per_block;
            if n.checked_add(1).is_none_or(|b| b > room) {
                return Err(BackendError::OutOfMemory(format!(
                    "a KV cache of {n} blocks of {} tokens needs {} MiB on {}, but {} MiB are free \
                     after the weights; at most {} blocks fit",
                    opts.block_size,
                    (n as u128 * per_block as u128) >> 20,
                    gpu.name,
                    free_now >> 20,
                    room.saturating_sub(1)
                )));
            }
            n
        }
        None => {
            let (free_now, _) = gpu.mem_info()?;
            let used = free_before.saturating_sub(free_now);
            let budget = (free_before as f64 * opts.gpu_memory_utilization as f64) as usize;
            budget.saturating_sub(used + ACTIVATION_RESERVE) / per_block
        }
    };
    if num_blocks == 0 {
        return Err(BackendError::OutOfMemory(format!(
            "no room for a KV-cache block on {} after the weights; raise --gpu-memory-utilization",
            gpu.name
        )));
    }
    Ok(num_blocks)
}

/// The RoPE (cos, sin) table `[max_pos, pairs, 2]` on the device.
fn rope_table(
    gpu: &Gpu,
    c: &ModelConfig,
    w: &ModelWeights,
    max_pos: usize,
) -> Result<DBuf<f32>, BackendError> {
    let table = crate::cpu::ops::RopeTable::new(c.rope_dim, c.rope_theta, w.rope_freqs.as_deref());
    let mut cs = Vec::with_capacity(max_pos * c.rope_dim);
    let mut tmp = Vec::new();
    for p in 0..max_pos {
        table.angles(p as u32, &mut tmp);
        cs.extend(tmp.iter().flat_map(|&(co, si)| [co, si]));
    }
    gpu.upload(&cs)
}

impl CudaExecutor {
    pub fn create(w: &ModelWeights, opts: CudaOptions) -> Result<Self, BackendError> {
        Self::create_part(w, opts, None)
    }

    /// `create`, with only `split`'s vocabulary rows of the output projection on the device when
    /// `split` is given (a rank of a vocab-parallel group).
    pub(super) fn create_part(
        w: &ModelWeights,
        opts: CudaOptions,
        split: Option<Shard>,
    ) -> Result<Self, BackendError> {
        let c = &w.config;
        let bs = opts.block_size;
        check_shapes(c, w, bs)?;
        let gpu = Gpu::new(opts.device)?;
        let (free_before, total) = gpu.mem_info()?;
        let (hd, kvs) = (c.hidden_size, c.kv_size());
        let keep_quant = opts.quantized_weights;
        let weight_bytes = weight_bytes(w, keep_quant);
        if weight_bytes as f64 > free_before as f64 * opts.gpu_memory_utilization as f64 {
            let gib = |b: usize| b as f64 / (1u64 << 30) as f64;
            return Err(BackendError::OutOfMemory(format!(
                "the model needs {:.1} GiB of weights but {:.1} GiB of {:.1} GiB is free on {} (x {} utilization)",
                gib(weight_bytes),
                gib(free_before),
                gib(total),
                gpu.name,
                opts.gpu_memory_utilization
            )));
        }
        let k = kernels(&gpu, c, &opts)?;
        let embed = upload_stacked(&gpu, &[&w.tok_embd], hd, &[c.vocab_size], keep_quant)?;
        let output = match split {
            Some(s) => {
                let t = output_rows(w, s)?;
                Some(upload_stacked(&gpu, &[&t], hd, &[t.rows()], keep_quant)?)
            }
            None => w
                .output
                .as_ref()
                .map(|t| upload_stacked(&gpu, &[t], hd, &[c.vocab_size], keep_quant))
                .transpose()?,
        };
        let layers = w
            .layers
            .iter()
            .map(|l| upload_layer(&gpu, c, l, keep_quant))
            .collect::<Result<Vec<_>, _>>()?;
        let output_norm = upload_vec(&gpu, &w.output_norm, hd)?;
        let wdq = match largest_quant(c, &layers, output.as_ref().unwrap_or(&embed)) {
            Some(e) if opts.dequant_gemm_tokens != usize::MAX => gpu.alloc::<f16>(e)?,
            _ => gpu.alloc::<f16>(0)?,
        };
        let s = Scratch::new(&gpu, c, wdq, opts.max_num_batched_tokens)?;
        let num_blocks = pool_blocks(&gpu, c, &opts, free_before)?;
        // One block more than the engine sees: padding rows of decode graphs write there.
        let slots = (num_blocks + 1) * bs * kvs;
        let kv_caches = (0..layers.len())
            .map(|_| Ok((gpu.alloc::<f16>(slots)?, gpu.alloc::<f16>(slots)?)))
            .collect::<Result<Vec<_>, BackendError>>()?;
        // Positions the RoPE table covers: the trained context, unless the caller sized the pool
        // itself (`bench -d` past the trained context, as llama.cpp allows, with a warning there).
        let max_pos = match opts.num_blocks {
            Some(_) => num_blocks * bs,
            None => c.max_position_embeddings.min(num_blocks * bs),
        }
        .max(1);
        let rope_cs = rope_table(&gpu, c, w, max_pos)?;
        gpu.sync()?;
        let meta_mapped = match &embed {
            WMat::F16(_) => Some(MappedMeta::new()?),
            WMat::Quant { .. } => None,
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
            kv_caches,
            kv: KvCacheSpec {
                num_blocks,
                block_size: bs,
            },
            s,
            host_logits: Default::default(),
            host_logits_len: 0,
            host_row: HostBuf::mapped(c.vocab_size)?,
            logits_in_row: false,
            host_ids: vec![],
            meta_host: vec![],
            prof: EventProfiler::default(),
            use_graphs: opts.graphs,
            dequant_gemm_tokens: opts.dequant_gemm_tokens,
            graphs: HashMap::new(),
            meta_mapped,
            tp: None,
            vocab_split: split,
            gpu,
        })
    }
}
