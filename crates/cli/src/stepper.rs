//! The benchmark's own view of the KV cache and its forward passes: sequences with block tables
//! laid out by hand (no scheduler, as llama-bench drives `llama_decode` directly) and the flat
//! batches of a prefill chunk, a decode step or a chain of decode steps. Shared by `bench` and
//! `profile`.

use anyhow::Result;
use quire_backend::{Executor, ForwardBatch, SeqBatch};
use quire_core::BlockId;
use rand::Rng;

use crate::bench::CHUNK;

/// A sequence in the benchmark's cache: its block table and how many tokens it holds.
pub struct BenchSeq {
    pub table: Vec<BlockId>,
    pub len: usize,
}

/// Reusable flat-batch buffers.
#[derive(Default)]
pub struct Stepper {
    token_ids: Vec<u32>,
    positions: Vec<u32>,
    slots: Vec<u32>,
    logits: Vec<u32>,
}

impl Stepper {
    /// One forward: `tokens[i]` appended to `seqs[i]` (every list non-empty), logits of each
    /// sequence's last token.
    pub fn step(
        &mut self,
        exec: &mut dyn Executor,
        seqs: &mut [BenchSeq],
        tokens: &[&[u32]],
    ) -> Result<()> {
        let bs = exec.kv_spec().block_size;
        self.token_ids.clear();
        self.positions.clear();
        self.slots.clear();
        self.logits.clear();
        let mut ranges = Vec::with_capacity(seqs.len());
        for (s, toks) in seqs.iter().zip(tokens) {
            let start = self.token_ids.len();
            for (i, &t) in toks.iter().enumerate() {
                let pos = s.len + i;
                self.token_ids.push(t);
                self.positions.push(pos as u32);
                self.slots.push(quire_core::slot(&s.table, pos, bs) as u32);
            }
            ranges.push((start, toks.len(), s.len + toks.len()));
            self.logits.push((start + toks.len() - 1) as u32);
        }
        let sb: Vec<SeqBatch> = ranges
            .iter()
            .zip(seqs.iter())
            .map(|(&(query_start, query_len, seq_len), s)| SeqBatch {
                query_start,
                query_len,
                seq_len,
                block_table: &s.table,
            })
            .collect();
        exec.forward(&ForwardBatch {
            token_ids: &self.token_ids,
            positions: &self.positions,
            slot_mapping: &self.slots,
            seqs: &sb,
            logits_indices: &self.logits,
        })?;
        for (s, toks) in seqs.iter_mut().zip(tokens) {
            s.len += toks.len();
        }
        Ok(())
    }

    /// Chain decode: `steps` greedy tokens per sequence in one submission, starting from
    /// `tokens` (one per sequence); returns the last step's tokens.
    pub fn chain(
        &mut self,
        exec: &mut dyn Executor,
        seqs: &mut [BenchSeq],
        tokens: &[u32],
        steps: usize,
    ) -> Result<Vec<u32>> {
        let bs = exec.kv_spec().block_size;
        let n = seqs.len();
        self.positions.clear();
        self.slots.clear();
        for s in seqs.iter() {
            self.positions.push(s.len as u32);
            self.slots
                .push(quire_core::slot(&s.table, s.len, bs) as u32);
        }
        let logits: Vec<u32> = (0..n as u32).collect();
        let sb: Vec<SeqBatch> = seqs
            .iter()
            .enumerate()
            .map(|(i, s)| SeqBatch {
                query_start: i,
                query_len: 1,
                seq_len: s.len + 1,
                block_table: &s.table,
            })
            .collect();
        let out = exec.forward_greedy_chain(
            &ForwardBatch {
                token_ids: tokens,
                positions: &self.positions,
                slot_mapping: &self.slots,
                seqs: &sb,
                logits_indices: &logits,
            },
            steps,
        )?;
        for s in seqs.iter_mut() {
            s.len += steps;
        }
        Ok(out[(steps - 1) * n..].to_vec())
    }

    /// Appends `n` random tokens to one sequence in forwards of at most `CHUNK` tokens.
    pub fn prefill(
        &mut self,
        exec: &mut dyn Executor,
        seq: &mut BenchSeq,
        n: usize,
        rng: &mut impl Rng,
    ) -> Result<()> {
        let vocab = exec.vocab_size() as u32;
        let mut left = n;
        while left > 0 {
            let k = left.min(CHUNK);
            let toks: Vec<u32> = (0..k).map(|_| rng.random_range(0..vocab)).collect();
            self.step(exec, std::slice::from_mut(seq), &[&toks])?;
            left -= k;
        }
        Ok(())
    }
}

/// Fresh sequences (empty, each with its own run of blocks) for a test.
pub fn fresh_seqs(n_seqs: usize, tokens_each: usize, block_size: usize) -> Vec<BenchSeq> {
    let per = tokens_each.div_ceil(block_size).max(1);
    (0..n_seqs)
        .map(|i| BenchSeq {
            table: (i * per..(i + 1) * per)
                .map(|b| BlockId(b as u32))
                .collect(),
            len: 0,
        })
        .collect()
}
