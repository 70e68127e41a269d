//! Model runner: a scheduler step becomes one flat batch for the backend — token ids, positions,
//! slot mapping, per-sequence query ranges and block tables, and which rows need logits.

use quire_backend::{BackendError, Executor, ForwardBatch, MaskFill, SampleParams, SeqBatch};
use quire_core::BlockId;
use quire_sched::SchedulerOutput;

/// Reusable buffers of the flat batch (no allocation per step once warm).
#[derive(Default)]
pub struct BatchBuffers {
    pub token_ids: Vec<u32>,
    pub positions: Vec<u32>,
    pub slot_mapping: Vec<u32>,
    pub logits_indices: Vec<u32>,
    /// (query_start, query_len, seq_len) per scheduled sequence.
    pub ranges: Vec<(usize, usize, usize)>,
}

impl BatchBuffers {
    /// Fills the buffers from a scheduler step. Returns, per scheduled sequence, the first row of
    /// its logits in the output (if it samples this step); a sequence verifying `k` proposals has
    /// `1 + k` consecutive rows, one per position from its last known token on.
    pub fn fill(&mut self, out: &SchedulerOutput, block_size: usize) -> Vec<Option<usize>> {
        self.token_ids.clear();
        self.positions.clear();
        self.slot_mapping.clear();
        self.logits_indices.clear();
        self.ranges.clear();
        let mut rows = Vec::with_capacity(out.scheduled.len());
        for s in &out.scheduled {
            let start = self.token_ids.len();
            for (i, t) in s.token_ids.iter().enumerate() {
                let pos = s.num_computed_tokens + i;
                self.token_ids.push(t.0);
                self.positions.push(pos as u32);
                self.slot_mapping
                    .push(quire_core::slot(&s.block_table, pos, block_size) as u32);
            }
            let len = s.token_ids.len();
            self.ranges.push((start, len, s.num_computed_tokens + len));
            if s.samples {
                rows.push(Some(self.logits_indices.len()));
                let first = start + len - 1 - s.num_spec_tokens;
                self.logits_indices
                    .extend((first..start + len).map(|i| i as u32));
            } else {
                rows.push(None);
            }
        }
        rows
    }
}

/// Runs a filled batch through the executor.
pub fn execute<'a>(
    exec: &'a mut dyn Executor,
    buf: &BatchBuffers,
    tables: &[&[BlockId]],
) -> Result<&'a [f32], BackendError> {
    let seqs = seq_batches(buf, tables);
    exec.forward(&batch_of(buf, &seqs))
}

/// Runs a filled batch and returns the argmax token of each logits row (greedy rows only: the
/// backend may pick on the device and send back token ids alone).
pub fn execute_greedy(
    exec: &mut dyn Executor,
    buf: &BatchBuffers,
    tables: &[&[BlockId]],
) -> Result<Vec<u32>, BackendError> {
    let seqs = seq_batches(buf, tables);
    exec.forward_greedy(&batch_of(buf, &seqs))
}

/// Runs a filled batch and picks each logits row's token with its `rows` entry (rows without
/// penalties or log-probabilities: the backend may sample on the device), under the allowed-token
/// masks `masks` writes when it is given (see `Executor::forward_sample`).
pub fn execute_sample(
    exec: &mut dyn Executor,
    buf: &BatchBuffers,
    tables: &[&[BlockId]],
    rows: &[SampleParams],
    masks: Option<&mut MaskFill>,
) -> Result<Vec<u32>, BackendError> {
    let seqs = seq_batches(buf, tables);
    exec.forward_sample(&batch_of(buf, &seqs), rows, masks)
}

fn seq_batches<'a>(buf: &BatchBuffers, tables: &[&'a [BlockId]]) -> Vec<SeqBatch<'a>> {
    buf.ranges
        .iter()
        .zip(tables)
        .map(
            |(&(query_start, query_len, seq_len), &block_table)| SeqBatch {
                query_start,
                query_len,
                seq_len,
                block_table,
            },
        )
        .collect()
}

fn batch_of<'a>(buf: &'a BatchBuffers, seqs: &'a [SeqBatch<'a>]) -> ForwardBatch<'a> {
    ForwardBatch {
        token_ids: &buf.token_ids,
        positions: &buf.positions,
        slot_mapping: &buf.slot_mapping,
        seqs,
        logits_indices: &buf.logits_indices,
    }
}

/// One sequence from an empty cache through blocks `0..`, outside the scheduler: logits of the
/// requested rows. Used by perplexity and by tests that want raw logits.
pub fn forward_single(
    exec: &mut dyn Executor,
    tokens: &[u32],
    logits_rows: &[u32],
) -> Result<Vec<f32>, BackendError> {
    let spec = exec.kv_spec();
    let nblocks = tokens.len().div_ceil(spec.block_size);
    if nblocks > spec.num_blocks {
        return Err(BackendError::InvalidBatch(format!(
            "{} tokens need {nblocks} KV blocks, the cache has {}",
            tokens.len(),
            spec.num_blocks
        )));
    }
    let table: Vec<BlockId> = (0..nblocks as u32).map(BlockId).collect();
    let positions: Vec<u32> = (0..tokens.len() as u32).collect();
    let seqs = [SeqBatch {
        query_start: 0,
        query_len: tokens.len(),
        seq_len: tokens.len(),
        block_table: &table,
    }];
    let out = exec.forward(&ForwardBatch {
        token_ids: tokens,
        positions: &positions,
        slot_mapping: &positions,
        seqs: &seqs,
        logits_indices: logits_rows,
    })?;
    Ok(out.to_vec())
}
