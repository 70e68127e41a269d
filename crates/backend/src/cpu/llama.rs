//! The CPU executor: the model's weights in the CPU's form, its KV cache, and each step run
//! through the shared layer sequence (`crate::forward`) with the CPU's kernels (`step.rs`). Q/K/V
//! and gate/up are stacked at load time so each layer makes four threaded matrix products.
//! Buffers live in `step::Scratch` and only grow.

use half::f16;
use quire_core::ModelConfig;

use super::attention::AttnParams;
use super::matmul::QMatrix;
use super::moe::{ffn, ffn_bytes, MoeLayer};
use super::ops;
use super::profile::Profiler;
use super::step::{CpuStep, KvStore, Scratch};
use super::team::{Parallel, Team};
use super::CpuMath;
use crate::forward::{self, forward};
use crate::tp::{output_rows, HostReduce, Shard};
use crate::{BackendError, Executor, ForwardBatch, KvCacheSpec, ModelWeights, OpStat};
use std::sync::Arc;

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum KvDtype {
    F32,
    F16,
}

#[derive(Debug, Clone, Copy)]
pub struct CpuOptions {
    pub threads: usize,
    pub kv_dtype: KvDtype,
    /// With an f16 cache: round Q and the attention's V accumulator to f16 as llama.cpp's CPU
    /// flash attention does (the default: its logits). `false` accumulates in f32, the CUDA
    /// kernels' numerics (what the CUDA parity test compares against).
    pub attn_f16_accum: bool,
    /// Arithmetic mode (`CpuMath`): the library's default is `Exact`, the oracle other backends
    /// are tested against; the CLI chooses its own default (`--cpu-math`).
    pub math: CpuMath,
}

impl Default for CpuOptions {
    fn default() -> Self {
        Self {
            threads: std::thread::available_parallelism()
                .map(|n| n.get())
                .unwrap_or(1),
            kv_dtype: KvDtype::F16,
            attn_f16_accum: true,
            math: CpuMath::Exact,
        }
    }
}

/// A layer's weights as the CPU holds them.
type Layer = forward::Layer<QMatrix, Vec<f32>, MoeLayer>;

pub struct CpuExecutor {
    cfg: ModelConfig,
    team: Team,
    embed: QMatrix,
    output: QMatrix,
    output_norm: Vec<f32>,
    layers: Vec<Layer>,
    rope: ops::RopeTable,
    kv: KvCacheSpec,
    store: KvStore,
    attn_f16_accum: bool,
    math: CpuMath,
    scratch: Scratch,
    prof: Profiler,
    /// The group and rank of a sharded model (`crate::tp`).
    tp: Option<(Arc<HostReduce>, Shard)>,
}

/// Element types whose all-zero bit pattern is the value zero.
trait ZeroBits: Copy {}
impl ZeroBits for f32 {}
impl ZeroBits for f16 {}

/// `n` zeros, or an out-of-memory error naming `what` when the allocator refuses (a plain `vec!`
/// would abort the process). Zeroed pages come from the OS lazily, as with `vec![0; n]`, so a
/// large cache costs memory only as it fills.
fn zeroed_vec<T: ZeroBits>(n: usize, what: &str) -> Result<Vec<T>, BackendError> {
    let oom = || BackendError::OutOfMemory(format!("cannot allocate the {what}"));
    let layout = std::alloc::Layout::array::<T>(n).map_err(|_| oom())?;
    if layout.size() == 0 {
        return Ok(Vec::new());
    }
    // SAFETY: the layout has a nonzero size, as `alloc_zeroed` requires.
    let ptr = unsafe { std::alloc::alloc_zeroed(layout) }.cast::<T>();
    if ptr.is_null() {
        return Err(oom());
    }
    // SAFETY: `ptr` comes from the global allocator with the layout of `[T; n]` (so the Vec frees
    // it with the same layout), and its `n` elements are initialized: all bytes are zero, which
    // `ZeroBits` types accept as the value 0.
    Ok(unsafe { Vec::from_raw_parts(ptr, n, n) })
}

/// The K and V caches of every layer, `slots` zeros each.
type KvLayers<T> = (Vec<Vec<T>>, Vec<Vec<T>>);

fn kv_layers<T: ZeroBits>(
    layers: usize,
    slots: usize,
    what: &str,
) -> Result<KvLayers<T>, BackendError> {
    let one = || {
        (0..layers)
            .map(|_| zeroed_vec(slots, what))
            .collect::<Result<Vec<_>, _>>()
    };
    Ok((one()?, one()?))
}

fn vec_f32(t: &crate::HostTensor, len: usize) -> Result<Vec<f32>, BackendError> {
    if t.n_elements() != len {
        return Err(BackendError::Shape {
            name: t.name.clone(),
            got: t.dims.clone(),
            expected: vec![len],
        });
    }
    t.to_f32()
}

impl CpuExecutor {
    pub fn new(w: &ModelWeights, kv: KvCacheSpec, opts: CpuOptions) -> Result<Self, BackendError> {
        let c = &w.config;
        w.check()?;
        if !kv.block_size.is_power_of_two() || kv.block_size > 128 || kv.num_blocks == 0 {
            return Err(BackendError::Config(format!(
                "block size must be a power of two up to 128 and the cache non-empty (got {} blocks of {})",
                kv.num_blocks, kv.block_size
            )));
        }
        if c.num_heads / c.num_kv_heads > 16 {
            return Err(BackendError::Config(
                "GQA groups above 16 heads are not supported".into(),
            ));
        }
        let (hd, qs, kvs) = (c.hidden_size, c.q_size(), c.kv_size());
        let embed = QMatrix::from_tensor(&w.tok_embd, hd, c.vocab_size)?;
        let output = match &w.output {
            Some(t) => QMatrix::from_tensor(t, hd, c.vocab_size)?,
            None => embed.clone(),
        };
        let mut layers = Vec::with_capacity(c.num_layers);
        for l in &w.layers {
            let wq = QMatrix::from_tensor(&l.wq, hd, qs)?;
            let wk = QMatrix::from_tensor(&l.wk, hd, kvs)?;
            let wv = QMatrix::from_tensor(&l.wv, hd, kvs)?;
            let bqkv = match (&l.bq, &l.bk, &l.bv) {
                (Some(bq), Some(bk), Some(bv)) => {
                    let mut b = vec_f32(bq, qs)?;
                    b.extend(vec_f32(bk, kvs)?);
                    b.extend(vec_f32(bv, kvs)?);
                    Some(b)
                }
                (None, None, None) => None,
                _ => {
                    return Err(BackendError::Config(
                        "Q, K and V biases must come together".into(),
                    ))
                }
            };
            layers.push(Layer {
                attn_norm: vec_f32(&l.attn_norm, hd)?,
                wqkv: QMatrix::concat_rows(&format!("{}+k+v", l.wq.name), &[wq, wk, wv])?,
                bqkv,
                q_norm: l
                    .q_norm
                    .as_ref()
                    .map(|t| vec_f32(t, c.head_dim))
                    .transpose()?,
                k_norm: l
                    .k_norm
                    .as_ref()
                    .map(|t| vec_f32(t, c.head_dim))
                    .transpose()?,
                wo: QMatrix::from_tensor(&l.wo, qs, hd)?,
                ffn_norm: vec_f32(&l.ffn_norm, hd)?,
                ffn: ffn(&l.ffn, c)?,
            });
        }
        let slots = kv
            .num_blocks
            .checked_mul(kv.block_size)
            .and_then(|s| s.checked_mul(kvs))
            .ok_or_else(|| BackendError::OutOfMemory("KV cache size overflows".into()))?;
        let what = |elem: usize| {
            format!(
                "KV cache of {} blocks of {} tokens ({} MiB per layer for K and for V)",
                kv.num_blocks,
                kv.block_size,
                slots.saturating_mul(elem) >> 20
            )
        };
        let store = match opts.kv_dtype {
            KvDtype::F32 => {
                let (k, v) = kv_layers(c.num_layers, slots, &what(4))?;
                KvStore::F32(k, v)
            }
            KvDtype::F16 => {
                let (k, v) = kv_layers(c.num_layers, slots, &what(2))?;
                KvStore::F16(k, v)
            }
        };
        let team = Team::new(opts.threads.max(1));
        Ok(Self {
            rope: ops::RopeTable::new(c.rope_dim, c.rope_theta, w.rope_freqs.as_deref()),
            output_norm: vec_f32(&w.output_norm, hd)?,
            cfg: c.clone(),
            team,
            embed,
            output,
            layers,
            kv,
            store,
            attn_f16_accum: opts.attn_f16_accum,
            math: opts.math,
            scratch: Scratch::default(),
            prof: Profiler::default(),
            tp: None,
        })
    }

    /// Rank `shard.rank` of a tensor-parallel group: `w` must be that rank's part of the model
    /// (`tp::shard_weights`), and every rank of the group shares `group`. The rank keeps only its
    /// vocabulary rows of the output projection (`tp::output_rows`) and all-gathers the logits.
    pub fn new_rank(
        w: &ModelWeights,
        kv: KvCacheSpec,
        opts: CpuOptions,
        group: Arc<HostReduce>,
        shard: Shard,
    ) -> Result<Self, BackendError> {
        if group.size() != shard.size || shard.rank >= shard.size {
            return Err(BackendError::Config(format!(
                "rank {} of {} in a group of {}",
                shard.rank,
                shard.size,
                group.size()
            )));
        }
        let mut me = Self::new(w, kv, opts)?;
        let out = output_rows(w, shard)?;
        me.output = QMatrix::from_tensor(&out, w.config.hidden_size, out.rows())?;
        me.tp = Some((group, shard));
        Ok(me)
    }

    pub fn config(&self) -> &ModelConfig {
        &self.cfg
    }

    pub fn threads(&self) -> usize {
        self.team.threads()
    }

    /// Bytes of weights read by one forward pass (all layers plus the output projection).
    pub fn weight_bytes(&self) -> usize {
        self.layers
            .iter()
            .map(|l| l.wqkv.bytes() + l.wo.bytes() + ffn_bytes(&l.ffn))
            .sum::<usize>()
            + self.output.bytes()
    }
}

impl Executor for CpuExecutor {
    fn backend_name(&self) -> &'static str {
        "cpu"
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
        Ok(&self.scratch.logits)
    }
}

impl CpuExecutor {
    fn forward_inner(&mut self, batch: &ForwardBatch) -> Result<(), BackendError> {
        batch.check(self.kv, self.cfg.vocab_size)?;
        let c = &self.cfg;
        let n = batch.num_tokens();
        let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
        let s = &mut self.scratch;
        s.x.resize(n * hd, 0.0);
        s.h.resize(n * hd, 0.0);
        s.qkv.resize(n * (qs + 2 * kvs), 0.0);
        s.attn.resize(n * qs, 0.0);
        s.tmp.resize(n * hd, 0.0);
        s.gu.resize(n * 2 * inter, 0.0);
        s.act.resize(n * inter, 0.0);
        s.rope_cs.clear();
        for &pos in batch.positions {
            self.rope.angles(pos, &mut s.cs_tmp);
            s.rope_cs.extend_from_slice(&s.cs_tmp);
        }
        let attn = AttnParams {
            num_heads: c.num_heads,
            num_kv_heads: c.num_kv_heads,
            head_dim: c.head_dim,
            block_size: self.kv.block_size,
            scale: 1.0 / (c.head_dim as f32).sqrt(),
            f16_accum: self.attn_f16_accum && matches!(self.store, KvStore::F16(..)),
            sliding_window: c.sliding_window,
        };
        let pool: &dyn Parallel = &self.team;
        let mut step = CpuStep {
            c,
            pool,
            prof: &mut self.prof,
            s,
            store: &mut self.store,
            embed: &self.embed,
            batch,
            attn,
            math: self.math,
            tp: self.tp.as_ref().map(|(g, s)| (&**g, *s)),
        };
        forward(&mut step, &self.layers, &self.output_norm, &self.output)
    }
}

#[cfg(test)]
mod alloc_tests {
    use super::*;

    #[test]
    fn an_impossible_kv_cache_is_an_error_not_an_abort() {
        let z: Vec<f32> = zeroed_vec(1000, "test").unwrap();
        assert!(z.iter().all(|&x| x == 0.0));
        // 2^60 f16s (2 EiB): no allocator grants it.
        let e = zeroed_vec::<f16>(1 << 60, "KV cache").unwrap_err();
        assert!(
            e.to_string().contains("cannot allocate the KV cache"),
            "{e}"
        );
        assert!(zeroed_vec::<f32>(usize::MAX, "x").is_err());
    }
}
