//! Host-side view of a model's weights, as a loader produces them: each tensor is a typed byte range
//! of some owner (a memory-mapped GGUF file, or an owned buffer). Backends read from here once, at
//! load time, and keep quantized data quantized.

use std::sync::Arc;

use quire_core::ModelConfig;
use quire_gguf::GgmlType;

/// Anything that owns a byte buffer for the lifetime of the weights.
pub trait ByteOwner: Send + Sync {
    fn bytes(&self) -> &[u8];
}

impl ByteOwner for Vec<u8> {
    fn bytes(&self) -> &[u8] {
        self
    }
}

impl ByteOwner for quire_gguf::GgufFile {
    fn bytes(&self) -> &[u8] {
        quire_gguf::GgufFile::bytes(self)
    }
}

/// A byte range of a shared owner.
#[derive(Clone)]
pub struct TensorBytes {
    owner: Arc<dyn ByteOwner>,
    start: usize,
    len: usize,
}

impl TensorBytes {
    /// `None` when the range does not lie inside the owner.
    pub fn new(owner: Arc<dyn ByteOwner>, start: usize, len: usize) -> Option<Self> {
        let end = start.checked_add(len)?;
        (end <= owner.bytes().len()).then_some(Self { owner, start, len })
    }

    pub fn owned(bytes: Vec<u8>) -> Self {
        let len = bytes.len();
        Self {
            owner: Arc::new(bytes),
            start: 0,
            len,
        }
    }

    /// The sub-range `[start, start + len)` of this range, sharing the owner (no copy); `None`
    /// when it does not lie inside.
    pub fn slice(&self, start: usize, len: usize) -> Option<Self> {
        let end = start.checked_add(len)?;
        (end <= self.len).then(|| Self {
            owner: self.owner.clone(),
            start: self.start + start,
            len,
        })
    }

    pub fn as_slice(&self) -> &[u8] {
        &self.owner.bytes()[self.start..self.start + self.len]
    }
}

impl std::fmt::Debug for TensorBytes {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(f, "TensorBytes({} bytes)", self.len)
    }
}

/// One tensor: ggml dimension order (`dims[0]` is the contiguous row length).
#[derive(Debug, Clone)]
pub struct HostTensor {
    pub name: String,
    pub dtype: GgmlType,
    pub dims: Vec<usize>,
    pub bytes: TensorBytes,
}

impl HostTensor {
    pub fn n_elements(&self) -> usize {
        self.dims.iter().product()
    }

    /// Row length and number of rows of a 2-D (or 1-D) tensor.
    pub fn row_len(&self) -> usize {
        self.dims.first().copied().unwrap_or(0)
    }

    pub fn rows(&self) -> usize {
        self.dims.iter().skip(1).product()
    }

    /// Dequantizes the whole tensor to f32 (norms, biases, tests).
    pub fn to_f32(&self) -> Result<Vec<f32>, crate::BackendError> {
        let mut out = vec![0f32; self.n_elements()];
        quire_gguf::dequantize_row(self.dtype, self.bytes.as_slice(), &mut out).map_err(|e| {
            crate::BackendError::UnsupportedType {
                dtype: self.dtype.name(),
                what: format!("{}: {e}", self.name),
            }
        })?;
        Ok(out)
    }
}

#[derive(Debug, Clone)]
pub struct LayerWeights {
    pub attn_norm: HostTensor,
    // wq: [hidden, q_size], wk/wv: [hidden, kv_size], wo: [q_size, hidden] (ggml order)
    pub wq: HostTensor,
    pub wk: HostTensor,
    pub wv: HostTensor,
    pub wo: HostTensor,
    pub bq: Option<HostTensor>,
    pub bk: Option<HostTensor>,
    pub bv: Option<HostTensor>,
    pub q_norm: Option<HostTensor>,
    pub k_norm: Option<HostTensor>,
    pub ffn_norm: HostTensor,
    pub ffn: FfnWeights,
}

/// A layer's feed-forward block.
#[derive(Debug, Clone)]
pub enum FfnWeights {
    /// SwiGLU: `down(silu(gate(x)) * up(x))`.
    // w_gate, w_up: [hidden, intermediate]; w_down: [intermediate, hidden] (ggml order)
    Dense {
        w_gate: HostTensor,
        w_up: HostTensor,
        w_down: HostTensor,
    },
    /// A mixture of SwiGLU experts chosen per token by a router (see `quire_core::MoeConfig`).
    Moe(MoeWeights),
}

/// The experts of one layer, each expert's matrix a contiguous slab: expert `e` of `gate_exps` is
/// the `[expert_inter, hidden]` row-major block `e` (ggml order: dims[0] contiguous), as llama.cpp
/// stores `ffn_{gate,up,down}_exps`.
#[derive(Debug, Clone)]
pub struct MoeWeights {
    /// Router: [hidden, num_experts] (one row of `hidden` per expert).
    pub gate_inp: HostTensor,
    /// [hidden, expert_inter, num_experts]
    pub gate_exps: HostTensor,
    /// [hidden, expert_inter, num_experts]
    pub up_exps: HostTensor,
    /// [expert_inter, hidden, num_experts]
    pub down_exps: HostTensor,
}

impl FfnWeights {
    /// Every matrix of the block (for byte counts and type conversions).
    pub fn tensors_mut(&mut self) -> Vec<&mut HostTensor> {
        match self {
            FfnWeights::Dense {
                w_gate,
                w_up,
                w_down,
            } => vec![w_gate, w_up, w_down],
            FfnWeights::Moe(m) => vec![
                &mut m.gate_inp,
                &mut m.gate_exps,
                &mut m.up_exps,
                &mut m.down_exps,
            ],
        }
    }

    pub fn tensors(&self) -> Vec<&HostTensor> {
        match self {
            FfnWeights::Dense {
                w_gate,
                w_up,
                w_down,
            } => vec![w_gate, w_up, w_down],
            FfnWeights::Moe(m) => vec![&m.gate_inp, &m.gate_exps, &m.up_exps, &m.down_exps],
        }
    }
}

#[derive(Debug, Clone)]
pub struct ModelWeights {
    pub config: ModelConfig,
    // tok_embd: [hidden, vocab]
    pub tok_embd: HostTensor,
    pub layers: Vec<LayerWeights>,
    pub output_norm: HostTensor,
    /// `None` when the output projection is tied to the embeddings.
    pub output: Option<HostTensor>,
    /// Per-frequency divisors of Llama 3's RoPE scaling (`rope_freqs.weight`), `[rope_dim / 2]`.
    pub rope_freqs: Option<Vec<f32>>,
}

impl HostTensor {
    /// The same values stored as f16 (quantized blocks dequantized).
    pub fn to_f16_tensor(&self) -> Result<HostTensor, crate::BackendError> {
        let bytes: Vec<u8> = self
            .to_f32()?
            .into_iter()
            .flat_map(|v| half::f16::from_f32(v).to_le_bytes())
            .collect();
        Ok(HostTensor {
            name: self.name.clone(),
            dtype: GgmlType::F16,
            dims: self.dims.clone(),
            bytes: TensorBytes::owned(bytes),
        })
    }
}

impl ModelWeights {
    /// The model with every matrix dequantized to f16: on the CPU backend this runs with f32
    /// activations (no 8-bit activation quantization), the yardstick for backends that compute
    /// with f16 weights and unquantized activations.
    pub fn dequantized_f16(&self) -> Result<ModelWeights, crate::BackendError> {
        let mut w = self.clone();
        w.tok_embd = w.tok_embd.to_f16_tensor()?;
        if let Some(o) = &w.output {
            w.output = Some(o.to_f16_tensor()?);
        }
        for l in &mut w.layers {
            for t in [&mut l.wq, &mut l.wk, &mut l.wv, &mut l.wo] {
                *t = t.to_f16_tensor()?;
            }
            for t in l.ffn.tensors_mut() {
                *t = t.to_f16_tensor()?;
            }
        }
        Ok(w)
    }

    /// The model with every RMSNorm weight scaled by `1 ± rel` (a fixed pattern of magnitudes in
    /// [0.5, 1.5] × `rel`, alternating signs): a perturbation the size of float summation-order
    /// differences, for measuring how sensitive a numeric path is to them (tests, examples).
    pub fn with_norms_nudged(&self, rel: f32) -> Result<ModelWeights, crate::BackendError> {
        let nudge = |t: &HostTensor| -> Result<HostTensor, crate::BackendError> {
            let bytes = t
                .to_f32()?
                .iter()
                .enumerate()
                .flat_map(|(i, v)| {
                    let e = (0.5 + (i * 7919 % 1000) as f32 / 1000.0) * rel;
                    let sign = if i % 2 == 0 { 1.0 } else { -1.0 };
                    (v * (1.0 + sign * e)).to_le_bytes()
                })
                .collect();
            Ok(HostTensor {
                name: t.name.clone(),
                dtype: GgmlType::F32,
                dims: t.dims.clone(),
                bytes: TensorBytes::owned(bytes),
            })
        };
        let mut w = self.clone();
        w.output_norm = nudge(&w.output_norm)?;
        for l in &mut w.layers {
            l.attn_norm = nudge(&l.attn_norm)?;
            l.ffn_norm = nudge(&l.ffn_norm)?;
        }
        Ok(w)
    }
}

impl ModelWeights {
    /// The checks every backend makes before it uploads or packs anything: the config is sane,
    /// there is one set of weights per layer, Q/K/V biases come together, and every tensor holds
    /// the number of elements its role needs (so a kernel never reads past a tensor's bytes).
    pub fn check(&self) -> Result<(), crate::BackendError> {
        let c = &self.config;
        c.validate().map_err(crate::BackendError::Config)?;
        if self.layers.len() != c.num_layers {
            return Err(crate::BackendError::Config(format!(
                "config says {} layers, weights have {}",
                c.num_layers,
                self.layers.len()
            )));
        }
        let (hd, qs, kvs) = (c.hidden_size, c.q_size(), c.kv_size());
        let count = |t: &HostTensor, want: Option<usize>| -> Result<(), crate::BackendError> {
            match want {
                Some(n) if t.n_elements() == n => Ok(()),
                _ => Err(crate::BackendError::Config(format!(
                    "tensor {} has {} elements {:?}, its role needs {}",
                    t.name,
                    t.n_elements(),
                    t.dims,
                    want.map_or("more than fit in memory".into(), |n| n.to_string())
                ))),
            }
        };
        count(&self.tok_embd, hd.checked_mul(c.vocab_size))?;
        count(&self.output_norm, Some(hd))?;
        if let Some(o) = &self.output {
            count(o, hd.checked_mul(c.vocab_size))?;
        }
        for l in &self.layers {
            count(&l.attn_norm, Some(hd))?;
            count(&l.ffn_norm, Some(hd))?;
            count(&l.wq, hd.checked_mul(qs))?;
            count(&l.wk, hd.checked_mul(kvs))?;
            count(&l.wv, hd.checked_mul(kvs))?;
            count(&l.wo, qs.checked_mul(hd))?;
            match (&l.bq, &l.bk, &l.bv) {
                (Some(bq), Some(bk), Some(bv)) => {
                    count(bq, Some(qs))?;
                    count(bk, Some(kvs))?;
                    count(bv, Some(kvs))?;
                }
                (None, None, None) => {}
                _ => {
                    return Err(crate::BackendError::Config(
                        "Q, K and V biases must come together".into(),
                    ))
                }
            }
            for n in [&l.q_norm, &l.k_norm].into_iter().flatten() {
                count(n, Some(c.head_dim))?;
            }
            match (&l.ffn, &c.moe) {
                (
                    FfnWeights::Dense {
                        w_gate,
                        w_up,
                        w_down,
                    },
                    _,
                ) => {
                    let n = hd.checked_mul(c.intermediate_size);
                    count(w_gate, n)?;
                    count(w_up, n)?;
                    count(w_down, n)?;
                }
                (FfnWeights::Moe(m), Some(mc)) => {
                    count(&m.gate_inp, hd.checked_mul(mc.num_experts))?;
                    let n = hd
                        .checked_mul(mc.expert_intermediate_size)
                        .and_then(|n| n.checked_mul(mc.num_experts));
                    count(&m.gate_exps, n)?;
                    count(&m.up_exps, n)?;
                    count(&m.down_exps, n)?;
                }
                (FfnWeights::Moe(_), None) => {
                    return Err(crate::BackendError::Config(
                        "expert weights in a model whose config has no experts".into(),
                    ))
                }
            }
        }
        Ok(())
    }
}
