//! The narrow compute interface of quire. The engine hands a backend one flat, mixed batch (prompt
//! chunks and decodes together, described by positions, slot mapping and block tables) and gets
//! logits back; how the backend runs the architecture (kernels, fusion, graphs) is its own business.
//! `cpu` is always built and is the test oracle.

pub mod chain;
pub mod cpu;
pub mod cuda;
pub mod forward;
pub mod sample;
pub mod tp;
pub mod weights;
pub mod wgpu;

use quire_core::BlockId;
pub use sample::{
    mask_allows, mask_words, sample_row, sample_row_masked, sample_row_with, SampleParams,
};
pub use weights::{
    ByteOwner, FfnWeights, HostTensor, LayerWeights, ModelWeights, MoeWeights, TensorBytes,
};

#[derive(Debug, thiserror::Error)]
pub enum BackendError {
    #[error("unsupported tensor type {dtype} for {what}")]
    UnsupportedType { dtype: &'static str, what: String },
    #[error("tensor {name} has shape {got:?}, expected {expected:?}")]
    Shape {
        name: String,
        got: Vec<usize>,
        expected: Vec<usize>,
    },
    #[error("invalid batch: {0}")]
    InvalidBatch(String),
    #[error("invalid configuration: {0}")]
    Config(String),
    #[error("backend {0} was not built into this binary")]
    NotBuilt(&'static str),
    #[error("out of memory: {0}")]
    OutOfMemory(String),
    #[error("CUDA: {0}")]
    Cuda(String),
    #[error("wgpu: {0}")]
    Wgpu(String),
    #[error("kernel {name} did not compile:\n{log}")]
    Kernel { name: String, log: String },
}

/// One sequence's share of a flat batch.
#[derive(Debug, Clone, Copy)]
pub struct SeqBatch<'a> {
    /// Index of this sequence's first new token in the flat batch.
    pub query_start: usize,
    /// Number of new tokens of this sequence in the batch.
    pub query_len: usize,
    /// Tokens in the KV cache after this step (computed before + new).
    pub seq_len: usize,
    /// Physical blocks holding this sequence's KV, in logical order.
    pub block_table: &'a [BlockId],
}

/// A mixed batch: any number of sequences, each with one or more new tokens.
#[derive(Debug, Clone, Copy)]
pub struct ForwardBatch<'a> {
    // token_ids, positions, slot_mapping: [num_tokens]
    pub token_ids: &'a [u32],
    pub positions: &'a [u32],
    /// Cache slot of each new token: [`quire_core::slot`] of its position in its sequence's table.
    pub slot_mapping: &'a [u32],
    pub seqs: &'a [SeqBatch<'a>],
    /// Rows of the batch whose logits are wanted, in output order.
    pub logits_indices: &'a [u32],
}

impl ForwardBatch<'_> {
    pub fn num_tokens(&self) -> usize {
        self.token_ids.len()
    }

    /// `validate` for `kv`, plus every token id inside a vocabulary of `vocab_size`: what an
    /// executor checks before running a model.
    pub fn check(&self, kv: KvCacheSpec, vocab_size: usize) -> Result<(), BackendError> {
        self.validate(kv.block_size, kv.num_blocks)?;
        match self.token_ids.iter().find(|&&t| t as usize >= vocab_size) {
            Some(bad) => Err(BackendError::InvalidBatch(format!(
                "token id {bad} is outside the vocabulary"
            ))),
            None => Ok(()),
        }
    }

    /// Checks that every index is in range, so kernels may index without further checks.
    pub fn validate(&self, block_size: usize, num_blocks: usize) -> Result<(), BackendError> {
        let n = self.token_ids.len();
        let bad = |m: String| Err(BackendError::InvalidBatch(m));
        if self.positions.len() != n || self.slot_mapping.len() != n {
            return bad("positions and slot_mapping must match token_ids".into());
        }
        let mut covered = 0usize;
        for (i, s) in self.seqs.iter().enumerate() {
            if s.query_start != covered || s.query_len == 0 {
                return bad(format!("seq {i}: query ranges must tile the batch"));
            }
            covered += s.query_len;
            if s.seq_len < s.query_len {
                return bad(format!("seq {i}: seq_len < query_len"));
            }
            if s.block_table.len() * block_size < s.seq_len {
                return bad(format!(
                    "seq {i}: block table too short for {} tokens",
                    s.seq_len
                ));
            }
            if s.block_table.iter().any(|b| b.as_usize() >= num_blocks) {
                return bad(format!("seq {i}: block id out of range"));
            }
            for t in 0..s.query_len {
                let pos = s.seq_len - s.query_len + t;
                let row = s.query_start + t;
                if self.positions[row] as usize != pos {
                    return bad(format!("seq {i}: position of row {row} must be {pos}"));
                }
                let slot = quire_core::slot(s.block_table, pos, block_size);
                if self.slot_mapping[row] as usize != slot {
                    return bad(format!("seq {i}: slot of row {row} must be {slot}"));
                }
            }
        }
        if covered != n {
            return bad("sequences do not cover the batch".into());
        }
        if self.logits_indices.iter().any(|&i| i as usize >= n) {
            return bad("logits index out of range".into());
        }
        Ok(())
    }
}

/// Geometry of the paged KV cache a backend allocates.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct KvCacheSpec {
    pub num_blocks: usize,
    pub block_size: usize,
}

/// Timing of one op family during a profiled step.
#[derive(Debug, Clone, Default)]
pub struct OpStat {
    pub name: String,
    /// Transformer layer, or `None` for ops outside the layers (embedding, output).
    pub layer: Option<usize>,
    pub calls: u64,
    pub total_ns: u64,
    pub bytes: u64,
    pub flops: u64,
}

/// A model loaded on a backend with its KV cache: runs forward passes.
pub trait Executor: Send {
    fn backend_name(&self) -> &'static str;
    fn kv_spec(&self) -> KvCacheSpec;
    fn vocab_size(&self) -> usize;
    /// Runs the batch, writing its new K/V into the cache; returns logits
    /// `[batch.logits_indices.len(), vocab_size]`.
    fn forward(&mut self, batch: &ForwardBatch) -> Result<&[f32], BackendError>;
    /// Runs the batch like `forward` but drops its logits: a tensor-parallel rank other than the
    /// lead, whose logits nobody reads. Backends that keep logits on a device override this so
    /// they are not copied to the host.
    fn forward_discard(&mut self, batch: &ForwardBatch) -> Result<(), BackendError> {
        self.forward(batch).map(|_| ())
    }
    /// Runs the batch and returns the argmax token of each logits row (greedy decoding: the
    /// first of equal maxima). Backends that can pick on the device override this, so only
    /// token ids cross to the host.
    fn forward_greedy(&mut self, batch: &ForwardBatch) -> Result<Vec<u32>, BackendError> {
        let vocab = self.vocab_size();
        let logits = self.forward(batch)?;
        Ok(logits.chunks_exact(vocab.max(1)).map(argmax).collect())
    }
    /// Greedy decoding of `steps` tokens per sequence in one submission (chain decode): `batch` is
    /// a decode step (every query_len 1, logits for every row in order) and step k feeds each row
    /// the argmax of step k - 1 at the next position. Every block table must cover
    /// `seq_len + steps - 1` tokens. Returns the tokens step-major, `[steps][rows]`. The default
    /// runs `forward_greedy` step by step (`chain::by_steps`).
    fn forward_greedy_chain(
        &mut self,
        batch: &ForwardBatch,
        steps: usize,
    ) -> Result<Vec<u32>, BackendError> {
        chain::by_steps(self, batch, steps)
    }
    /// Runs the batch and picks one token per logits row with that row's `rows[i]` (temperature
    /// ≤ 0: the argmax), as [`sample_row`] does. Backends that can sample on the device override
    /// this, so only token ids cross to the host.
    ///
    /// `masks` (structured outputs) limits rows to allowed tokens: it is called once, with
    /// `[rows, mask_words(vocab)]` words all set, and clears the bits of the tokens each row may
    /// not pick (bit `t % 32` of word `t / 32`; [`sample::mask_words`]); each row's pick is then
    /// [`sample_row_masked`]'s. It is called after the forward pass has started (on a device:
    /// once its work is enqueued), so it may wait for masks computed meanwhile. A backend that
    /// cannot apply masks on its device must apply them on the host, as this default does; it
    /// may never ignore them.
    fn forward_sample(
        &mut self,
        batch: &ForwardBatch,
        rows: &[SampleParams],
        masks: Option<&mut MaskFill>,
    ) -> Result<Vec<u32>, BackendError> {
        check_sample_rows(batch, rows)?;
        let vocab = self.vocab_size();
        let logits = self.forward(batch)?;
        Ok(sample_on_host(logits, vocab, rows, masks))
    }
    /// The most device memory this executor has had allocated, in bytes (weights, KV cache and
    /// work buffers), or `None` for a backend without device memory of its own (the CPU).
    fn device_memory_peak(&self) -> Option<u64> {
        None
    }
    /// Turns per-op timing on or off (off by default: no overhead).
    fn set_profiling(&mut self, on: bool);
    /// Per-op statistics gathered since the last call; resets them.
    fn take_profile(&mut self) -> Vec<OpStat>;
    /// The wall time of the last profiled step without the profile's own work, for an executor
    /// that times ops by extra runs of the step (wgpu); `None`: the call's wall time is the
    /// step's.
    fn profiled_step_ns(&self) -> Option<u64> {
        None
    }
    /// A line on how the last profile was measured, for profiles to print beside it.
    fn profile_note(&self) -> Option<String> {
        None
    }
}

/// Writes a step's allowed-token masks: see [`Executor::forward_sample`].
pub type MaskFill<'a> = dyn FnMut(&mut [u32]) + 'a;

/// `forward_sample` on the host: each row of `logits` (`[rows.len(), vocab]`) picked with its
/// `rows` entry and, when `masks` is given, its mask (which it fills here).
pub fn sample_on_host(
    logits: &[f32],
    vocab: usize,
    rows: &[SampleParams],
    masks: Option<&mut MaskFill>,
) -> Vec<u32> {
    let words = mask_words(vocab);
    let masked = masks.is_some();
    let mut bits = Vec::new();
    if let Some(fill) = masks {
        bits = vec![u32::MAX; rows.len() * words];
        fill(&mut bits);
    }
    let mut cand = Vec::new();
    logits
        .chunks_exact(vocab.max(1))
        .zip(rows)
        .enumerate()
        .map(|(r, (l, p))| {
            let mask = masked.then(|| &bits[r * words..(r + 1) * words]);
            sample_row_masked(l, mask, p, &mut cand)
        })
        .collect()
}

/// One valid [`SampleParams`] per logits row of `batch`: what `forward_sample` checks before
/// running anything.
pub fn check_sample_rows(batch: &ForwardBatch, rows: &[SampleParams]) -> Result<(), BackendError> {
    if rows.len() != batch.logits_indices.len() {
        return Err(BackendError::InvalidBatch(format!(
            "{} sampling rows for {} logits rows",
            rows.len(),
            batch.logits_indices.len()
        )));
    }
    rows.iter().try_for_each(SampleParams::check)
}

/// Index of the largest value (the first of equal maxima; NaN never wins).
pub fn argmax(row: &[f32]) -> u32 {
    let mut best = 0usize;
    for (i, &l) in row.iter().enumerate() {
        if l > row[best] || row[best].is_nan() && !l.is_nan() {
            best = i;
        }
    }
    best as u32
}

/// Bytes per KV-cache token for a config with f32 storage (K and V, all layers).
pub fn kv_bytes_per_token(cfg: &quire_core::ModelConfig) -> usize {
    2 * cfg.num_layers * cfg.kv_size() * std::mem::size_of::<f32>()
}
