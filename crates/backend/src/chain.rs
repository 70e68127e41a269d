//! Chain decode: several greedy decode steps per submission. A backend that can keep the argmax of
//! one step on the device as the next step's input (the CUDA executor replays one graph holding
//! all the steps) saves a host round trip per token; this module holds the contract's checks and
//! the step-by-step form every backend falls back to, which is also its reference.

use crate::{BackendError, Executor, ForwardBatch, SeqBatch};

/// Longest chain one call may ask for.
pub const MAX_CHAIN: usize = 64;

/// Checks that `batch` can start a chain of `steps`: every row a decode (query_len 1) that gets
/// logits, in row order, and every block table long enough for `seq_len + steps - 1` tokens.
pub fn check(batch: &ForwardBatch, steps: usize, block_size: usize) -> Result<(), BackendError> {
    let bad = |m: String| Err(BackendError::InvalidBatch(m));
    if steps == 0 || steps > MAX_CHAIN {
        return bad(format!(
            "a chain takes 1 to {MAX_CHAIN} steps (got {steps})"
        ));
    }
    if batch.seqs.iter().any(|s| s.query_len != 1) {
        return bad("a chain starts from a decode step (every query_len 1)".into());
    }
    let n = batch.num_tokens();
    if batch.logits_indices.len() != n
        || batch
            .logits_indices
            .iter()
            .enumerate()
            .any(|(i, &r)| r as usize != i)
    {
        return bad("a chain samples every row, in order".into());
    }
    for (i, s) in batch.seqs.iter().enumerate() {
        let need = s.seq_len + steps - 1;
        if s.block_table.len() * block_size < need {
            return bad(format!(
                "seq {i}: a chain of {steps} needs blocks for {need} tokens, the table holds {}",
                s.block_table.len() * block_size
            ));
        }
    }
    Ok(())
}

/// A decode step's batch, owned, that moves one position on (`advance`): step k + 1 of a chain.
pub struct Stepped<'a> {
    pub tokens: Vec<u32>,
    pub positions: Vec<u32>,
    pub slots: Vec<u32>,
    pub seqs: Vec<SeqBatch<'a>>,
    logits_indices: &'a [u32],
}

impl<'a> Stepped<'a> {
    pub fn new(batch: &ForwardBatch<'a>) -> Self {
        Stepped {
            tokens: batch.token_ids.to_vec(),
            positions: batch.positions.to_vec(),
            slots: batch.slot_mapping.to_vec(),
            seqs: batch.seqs.to_vec(),
            logits_indices: batch.logits_indices,
        }
    }

    /// The next step: every row one position on (its slot from the block table), with `tokens`.
    pub fn advance(&mut self, block_size: usize, tokens: &[u32]) {
        self.tokens.copy_from_slice(tokens);
        for (i, s) in self.seqs.iter_mut().enumerate() {
            self.positions[i] += 1;
            s.seq_len += 1;
            let p = self.positions[i] as usize;
            self.slots[i] = quire_core::slot(s.block_table, p, block_size) as u32;
        }
    }

    pub fn batch(&self) -> ForwardBatch<'_> {
        ForwardBatch {
            token_ids: &self.tokens,
            positions: &self.positions,
            slot_mapping: &self.slots,
            seqs: &self.seqs,
            logits_indices: self.logits_indices,
        }
    }
}

/// The chain as `steps` calls of `forward_greedy`, each step's tokens fed to the next at the next
/// position. Returns the tokens step-major: `[steps][rows]`.
pub fn by_steps<E: Executor + ?Sized>(
    exec: &mut E,
    batch: &ForwardBatch,
    steps: usize,
) -> Result<Vec<u32>, BackendError> {
    let bs = exec.kv_spec().block_size;
    check(batch, steps, bs)?;
    let n = batch.num_tokens();
    let mut out: Vec<u32> = Vec::with_capacity(steps * n);
    let mut cur = Stepped::new(batch);
    for step in 0..steps {
        if step > 0 {
            let prev = out[(step - 1) * n..].to_vec();
            cur.advance(bs, &prev);
        }
        let ids = exec.forward_greedy(&cur.batch())?;
        out.extend_from_slice(&ids);
    }
    Ok(out)
}

#[cfg(test)]
mod tests {
    use super::*;
    use crate::{KvCacheSpec, OpStat};
    use quire_core::BlockId;

    /// A model whose next token is (token + position) mod 50; records every step's slots.
    struct Toy {
        logits: Vec<f32>,
        slots: Vec<Vec<u32>>,
    }

    impl Executor for Toy {
        fn backend_name(&self) -> &'static str {
            "toy"
        }
        fn kv_spec(&self) -> KvCacheSpec {
            KvCacheSpec {
                num_blocks: 8,
                block_size: 4,
            }
        }
        fn vocab_size(&self) -> usize {
            50
        }
        fn forward(&mut self, b: &ForwardBatch) -> Result<&[f32], BackendError> {
            b.check(self.kv_spec(), 50)?;
            self.slots.push(b.slot_mapping.to_vec());
            self.logits = vec![0.0; b.logits_indices.len() * 50];
            for (i, &r) in b.logits_indices.iter().enumerate() {
                let r = r as usize;
                let next = (b.token_ids[r] + b.positions[r]) % 50;
                self.logits[i * 50 + next as usize] = 1.0;
            }
            Ok(&self.logits)
        }
        fn set_profiling(&mut self, _on: bool) {}
        fn take_profile(&mut self) -> Vec<OpStat> {
            Vec::new()
        }
    }

    #[test]
    fn by_steps_feeds_each_token_to_the_next_position_and_slot() {
        let t0 = [BlockId(5), BlockId(2), BlockId(7)];
        let t1 = [BlockId(0), BlockId(3)];
        let seqs = [
            SeqBatch {
                query_start: 0,
                query_len: 1,
                seq_len: 3,
                block_table: &t0,
            },
            SeqBatch {
                query_start: 1,
                query_len: 1,
                seq_len: 1,
                block_table: &t1,
            },
        ];
        let batch = ForwardBatch {
            token_ids: &[10, 20],
            positions: &[2, 0],
            slot_mapping: &[22, 0],
            seqs: &seqs,
            logits_indices: &[0, 1],
        };
        let mut toy = Toy {
            logits: vec![],
            slots: vec![],
        };
        let out = by_steps(&mut toy, &batch, 5).unwrap();
        // Row 0: 10@2 → 12, 12@3 → 15, 15@4 → 19, 19@5 → 24, 24@6 → 30.
        // Row 1: 20@0 → 20, 20@1 → 21, 21@2 → 23, 23@3 → 26, 26@4 → 30.
        assert_eq!(out, vec![12, 20, 15, 21, 19, 23, 24, 26, 30, 30]);
        // Row 0's positions 2..6 over blocks 5, 2; row 1's 0..4 over blocks 0, 3.
        let want: Vec<Vec<u32>> = vec![
            vec![22, 0],
            vec![23, 1],
            vec![8, 2],
            vec![9, 3],
            vec![10, 12],
        ];
        assert_eq!(toy.slots, want);
    }

    #[test]
    fn check_refuses_what_a_chain_cannot_run() {
        let t = [BlockId(0), BlockId(1)];
        let one = |ql: usize, sl: usize| SeqBatch {
            query_start: 0,
            query_len: ql,
            seq_len: sl,
            block_table: &t,
        };
        let decode = [one(1, 5)];
        let b = ForwardBatch {
            token_ids: &[1],
            positions: &[4],
            slot_mapping: &[4],
            seqs: &decode,
            logits_indices: &[0],
        };
        assert!(check(&b, 4, 4).is_ok()); // positions 4..7 fit two blocks of 4
        let e = check(&b, 5, 4).unwrap_err().to_string();
        assert!(e.contains("needs blocks for 9 tokens"), "{e}");
        assert!(check(&b, 0, 4).is_err());
        assert!(check(&b, MAX_CHAIN + 1, 4).is_err());
        let no_logits = ForwardBatch {
            logits_indices: &[],
            ..b
        };
        assert!(check(&no_logits, 2, 4).is_err());
        let prefill = [one(2, 5)];
        let p = ForwardBatch {
            token_ids: &[1, 2],
            positions: &[3, 4],
            slot_mapping: &[3, 4],
            seqs: &prefill,
            logits_indices: &[1],
        };
        assert!(check(&p, 2, 4).unwrap_err().to_string().contains("decode"));
    }
}
