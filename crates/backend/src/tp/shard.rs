//! Which part of every weight each rank of a tensor-parallel group holds, and the model config it
//! runs with. Output-row splits (Q/K/V by heads, gate/up by FFN columns, each expert's gate/up)
//! are byte ranges of the stored tensor (no copy); input-column splits (o, down, each expert's
//! down) copy each row's slice, which must start and end on a quantization block.

use quire_core::ModelConfig;

use crate::TensorBytes;
use crate::{BackendError, FfnWeights, HostTensor, LayerWeights, ModelWeights, MoeWeights};

/// A rank's place in a tensor-parallel group of `size` ranks; rank 0 is the lead.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Shard {
    pub rank: usize,
    pub size: usize,
}

impl Shard {
    /// Whether this rank adds the residual stream (rank 0), so the all-reduce counts it once.
    pub fn is_lead(&self) -> bool {
        self.rank == 0
    }

    /// The KV heads this rank holds: `(first, count)`. With more ranks than KV heads, every
    /// `size / num_kv_heads` consecutive ranks share (replicate) one.
    fn kv_heads(&self, num_kv_heads: usize) -> (usize, usize) {
        if self.size <= num_kv_heads {
            let per = num_kv_heads / self.size;
            (self.rank * per, per)
        } else {
            (self.rank / (self.size / num_kv_heads), 1)
        }
    }

    /// The rows of the output projection (vocabulary entries) this rank holds in a
    /// vocab-parallel output: `[rank·V/N, (rank+1)·V/N)` as `(first, count)`. The counts differ
    /// by at most one when `N` does not divide `V`; none is larger than [`Shard::vocab_stride`].
    pub fn vocab_span(&self, vocab: usize) -> (usize, usize) {
        let first = self.rank * vocab / self.size;
        (first, (self.rank + 1) * vocab / self.size - first)
    }

    /// The longest rank's vocabulary span, `ceil(V / N)`: the per-rank stride of gathered logits
    /// where every rank must send the same count (NCCL's all-gather).
    pub fn vocab_stride(&self, vocab: usize) -> usize {
        vocab.div_ceil(self.size)
    }
}

fn bad(m: String) -> BackendError {
    BackendError::Config(m)
}

/// Checks that `size` ranks can split a model of `cfg`; the message says which count does not
/// divide.
pub fn check_split(cfg: &ModelConfig, size: usize) -> Result<(), BackendError> {
    if size == 0 {
        return Err(bad("the tensor-parallel size must be at least 1".into()));
    }
    let (h, kv) = (cfg.num_heads, cfg.num_kv_heads);
    if !h.is_multiple_of(size) {
        return Err(bad(format!(
            "tensor-parallel size {size} does not divide the model's {h} attention heads"
        )));
    }
    if size <= kv && !kv.is_multiple_of(size) || size > kv && !size.is_multiple_of(kv) {
        return Err(bad(format!(
            "tensor-parallel size {size} and the model's {kv} KV heads: one must divide the other \
             (KV heads are split, or replicated when there are more ranks than KV heads)"
        )));
    }
    match &cfg.moe {
        Some(m) if !m.expert_intermediate_size.is_multiple_of(size) => Err(bad(format!(
            "tensor-parallel size {size} does not divide the experts' FFN size {}",
            m.expert_intermediate_size
        ))),
        None if !cfg.intermediate_size.is_multiple_of(size) => Err(bad(format!(
            "tensor-parallel size {size} does not divide the FFN size {}",
            cfg.intermediate_size
        ))),
        _ => Ok(()),
    }
}

/// The config rank `s.rank` runs with: its heads, KV heads and FFN columns.
pub fn shard_config(cfg: &ModelConfig, s: Shard) -> Result<ModelConfig, BackendError> {
    check_split(cfg, s.size)?;
    let mut c = cfg.clone();
    c.num_heads /= s.size;
    c.num_kv_heads = s.kv_heads(cfg.num_kv_heads).1;
    c.intermediate_size /= s.size;
    if let Some(m) = &mut c.moe {
        m.expert_intermediate_size /= s.size;
    }
    Ok(c)
}

/// Rank `s.rank`'s part of every weight (`s.size == 1`: the weights unchanged).
pub fn shard_weights(w: &ModelWeights, s: Shard) -> Result<ModelWeights, BackendError> {
    w.check()?;
    if s.rank >= s.size {
        return Err(bad(format!("rank {} of a group of {}", s.rank, s.size)));
    }
    let c = &w.config;
    let config = shard_config(c, s)?;
    let hd = c.head_dim;
    let q_rows = config.q_size();
    let (kv_first, kv_count) = s.kv_heads(c.num_kv_heads);
    let kv_span = (kv_first * hd, kv_count * hd);
    let mut layers = Vec::with_capacity(w.layers.len());
    for l in &w.layers {
        let q_span = (s.rank * q_rows, q_rows);
        layers.push(LayerWeights {
            attn_norm: l.attn_norm.clone(),
            wq: rows(&l.wq, q_span)?,
            wk: rows(&l.wk, kv_span)?,
            wv: rows(&l.wv, kv_span)?,
            wo: columns(&l.wo, q_span)?,
            bq: l.bq.as_ref().map(|b| elements(b, q_span)).transpose()?,
            bk: l.bk.as_ref().map(|b| elements(b, kv_span)).transpose()?,
            bv: l.bv.as_ref().map(|b| elements(b, kv_span)).transpose()?,
            q_norm: l.q_norm.clone(),
            k_norm: l.k_norm.clone(),
            ffn_norm: l.ffn_norm.clone(),
            ffn: ffn(&l.ffn, &config, s)?,
        });
    }
    Ok(ModelWeights {
        config,
        tok_embd: w.tok_embd.clone(),
        layers,
        output_norm: w.output_norm.clone(),
        output: w.output.clone(),
        rope_freqs: w.rope_freqs.clone(),
    })
}

/// Rank `s.rank`'s rows of the output projection (`Shard::vocab_span`): the `output` tensor's,
/// or the embedding's when the two are tied (the embedding itself stays whole on every rank).
pub fn output_rows(w: &ModelWeights, s: Shard) -> Result<HostTensor, BackendError> {
    let t = w.output.as_ref().unwrap_or(&w.tok_embd);
    rows(t, s.vocab_span(w.config.vocab_size))
}

fn ffn(f: &FfnWeights, local: &ModelConfig, s: Shard) -> Result<FfnWeights, BackendError> {
    Ok(match f {
        FfnWeights::Dense {
            w_gate,
            w_up,
            w_down,
        } => {
            let inter = local.intermediate_size;
            let span = (s.rank * inter, inter);
            FfnWeights::Dense {
                w_gate: rows(w_gate, span)?,
                w_up: rows(w_up, span)?,
                w_down: columns(w_down, span)?,
            }
        }
        FfnWeights::Moe(m) => {
            let ei = local.moe.as_ref().map_or(0, |m| m.expert_intermediate_size);
            let span = (s.rank * ei, ei);
            FfnWeights::Moe(MoeWeights {
                gate_inp: m.gate_inp.clone(),
                gate_exps: expert_rows(&m.gate_exps, span)?,
                up_exps: expert_rows(&m.up_exps, span)?,
                down_exps: columns(&m.down_exps, span)?,
            })
        }
    })
}

/// Bytes of one row of `t`.
fn row_bytes(t: &HostTensor) -> Result<usize, BackendError> {
    t.dtype
        .row_size(t.row_len() as u64)
        .map(|b| b as usize)
        .ok_or_else(|| bad(format!("{}: rows are not whole {} blocks", t.name, t.dtype)))
}

/// Rows `[start, start + count)` of a 2-D tensor (a byte range of the same owner).
fn rows(t: &HostTensor, (start, count): (usize, usize)) -> Result<HostTensor, BackendError> {
    let rb = row_bytes(t)?;
    let bytes = t
        .bytes
        .slice(start * rb, count * rb)
        .filter(|_| start + count <= t.rows())
        .ok_or_else(|| bad(format!("{}: rows {start}..+{count} out of range", t.name)))?;
    Ok(HostTensor {
        name: t.name.clone(),
        dtype: t.dtype,
        dims: vec![t.row_len(), count],
        bytes,
    })
}

/// Rows `[start, start + count)` of every expert of a `[cols, rows, experts]` stack, gathered.
fn expert_rows(t: &HostTensor, (start, count): (usize, usize)) -> Result<HostTensor, BackendError> {
    let (per_expert, experts) = match t.dims[..] {
        [_, r, e] => (r, e),
        _ => return Err(bad(format!("{}: expected an expert stack", t.name))),
    };
    let rb = row_bytes(t)?;
    let src = t.bytes.as_slice();
    let mut out = Vec::with_capacity(experts * count * rb);
    for e in 0..experts {
        let first = (e * per_expert + start) * rb;
        out.extend_from_slice(&src[first..first + count * rb]);
    }
    Ok(HostTensor {
        name: t.name.clone(),
        dtype: t.dtype,
        dims: vec![t.row_len(), count, experts],
        bytes: TensorBytes::owned(out),
    })
}

/// Columns `[start, start + count)` of every row (copied), the split of a row-parallel product's
/// weight; both ends must fall on a quantization block.
fn columns(t: &HostTensor, (start, count): (usize, usize)) -> Result<HostTensor, BackendError> {
    let bs = t.dtype.block_size();
    if !start.is_multiple_of(bs) || !count.is_multiple_of(bs) {
        return Err(bad(format!(
            "{} ({}) cannot be split at column {start}: its {bs}-value blocks would be cut; \
             choose a tensor-parallel size that splits it on block boundaries",
            t.name, t.dtype
        )));
    }
    let rb = row_bytes(t)?;
    let (b0, nb) = (
        start / bs * t.dtype.type_size(),
        count / bs * t.dtype.type_size(),
    );
    let src = t.bytes.as_slice();
    let nrows = t.rows();
    let mut out = Vec::with_capacity(nrows * nb);
    for r in 0..nrows {
        out.extend_from_slice(&src[r * rb + b0..r * rb + b0 + nb]);
    }
    let mut dims = t.dims.clone();
    dims[0] = count;
    Ok(HostTensor {
        name: t.name.clone(),
        dtype: t.dtype,
        dims,
        bytes: TensorBytes::owned(out),
    })
}

/// Elements `[start, start + count)` of a 1-D tensor of an unquantized type (a bias).
fn elements(t: &HostTensor, span: (usize, usize)) -> Result<HostTensor, BackendError> {
    let as_row = HostTensor {
        dims: vec![t.n_elements()],
        ..t.clone()
    };
    columns(&as_row, span)
}
