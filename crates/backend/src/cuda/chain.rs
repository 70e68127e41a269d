//! Chain decode on the GPU: `steps` greedy decode steps in one CUDA graph. Each step's metadata
//! (positions, slots, context lengths: all known in advance) sits in its own copy of the step
//! layout; the graph holds every step's kernels, then the argmax of its logits, then a
//! device-to-device copy of those token ids into the next step's token array. The host uploads
//! once, launches once and reads `steps × rows` ids once, instead of a round trip per token.
//!
//! Only decode batches that fit a graph bucket take this path (the same buckets and padding as
//! single decode graphs); anything else, or graphs off or the profiler on, runs step by step
//! (`chain::by_steps`), which gives the same tokens.

use super::gpu::cuda_err;
use super::llama::{CudaExecutor, GraphKey, MAX_GRAPH_BATCH};
use super::meta::pack_meta_padded;
use crate::chain;
use crate::{BackendError, ForwardBatch};

use super::forward::Step;

impl CudaExecutor {
    pub(super) fn chain(
        &mut self,
        batch: &ForwardBatch,
        steps: usize,
    ) -> Result<Vec<u32>, BackendError> {
        let n = batch.num_tokens();
        let bs = self.kv.block_size;
        chain::check(batch, steps, bs)?;
        if !self.use_graphs || self.prof.is_on() || n > MAX_GRAPH_BATCH || steps == 1 {
            return chain::by_steps(self, batch, steps);
        }
        self.check_batch(batch)?;
        if let Some(p) = batch
            .positions
            .iter()
            .map(|&p| p as usize + steps - 1)
            .max()
        {
            if p >= self.max_pos {
                return Err(BackendError::InvalidBatch(format!(
                    "a chain of {steps} reaches position {p}, beyond the context this cache was built for ({})",
                    self.max_pos
                )));
            }
        }
        self.gpu
            .ctx
            .bind_to_thread()
            .map_err(cuda_err("binding the context"))?;
        let b = n.next_power_of_two();
        let c = &self.cfg;
        // Every step's metadata, one after another at a fixed stride. The graph bakes the stride
        // into its addresses, so it is part of the graph's key; a power of two (at least 64
        // words, so 16-byte aligned) keeps one graph for block tables that grow a little. The
        // block tables do not change along a chain, so every step's metadata has step 0's length.
        let mut all = Vec::new();
        let mut layout = None;
        let mut stride = 0;
        // Tokens of later steps are written by the graph; zeros stand in for them here.
        let mut cur = chain::Stepped::new(batch);
        let zeros = vec![0u32; n];
        for k in 0..steps {
            if k > 0 {
                cur.advance(bs, &zeros);
            }
            let l = pack_meta_padded(&cur.batch(), b, self.kv.num_blocks, bs, &mut self.meta_host);
            if k == 0 {
                stride = chain_stride(self.meta_host.len());
                layout = Some(l);
                all.resize(steps * stride, 0);
            }
            all[k * stride..k * stride + self.meta_host.len()].copy_from_slice(&self.meta_host);
        }
        let layout = layout.expect("steps >= 1");
        let last_ctx = batch.seqs.iter().map(|s| s.seq_len).max().unwrap_or(1) + steps - 1;
        let ctx = self.graph_ctx(last_ctx);
        let plan = self.k.attention.plan(self.gpu.sms, b, ctx, true);
        if self.grow(b, b, b * c.num_heads * plan.splits, all.len())? {
            self.graphs.clear();
        }
        self.gpu.htod(&all, &mut self.s.meta, 0)?;
        let meta_base = self.s.meta.ptr;
        let key = GraphKey {
            rows: b,
            steps,
            ctx,
            logits_to_host: false,
            meta_words: 0,
            meta_stride: stride,
        };
        self.replay(key, |e| {
            e.enqueue_chain(b, steps, stride, meta_base, layout, plan)
        })?;
        let mut host = vec![0i32; steps * b];
        self.gpu.dtoh(&self.s.chain_ids, &mut host)?;
        Ok(host
            .chunks_exact(b)
            .flat_map(|r| r[..n].iter().map(|&t| t as u32))
            .collect())
    }

    /// The kernels of `steps` decode steps, each step's argmax copied into the next step's tokens.
    fn enqueue_chain(
        &mut self,
        b: usize,
        steps: usize,
        stride: usize,
        meta_base: u64,
        layout: super::attention::Meta,
        plan: super::attention::Plan,
    ) -> Result<(), BackendError> {
        let ids = self.s.chain_ids.ptr;
        for k in 0..steps {
            let base = meta_base + 4 * (k * stride) as u64;
            self.enqueue(Step {
                n: b,
                nl: b,
                plan,
                meta_base: base,
                layout,
                pairs: 0,
                ctx_tokens: 0,
                logits_host: 0,
                meta_src: 0,
                meta_words: 0,
            })?;
            let out = ids + 4 * (k * b) as u64;
            // SAFETY: `out` is step `k`'s row of `b` ids inside `chain_ids`, allocated at load
            // for `MAX_CHAIN` steps of `MAX_GRAPH_BATCH` rows (the caller bounds both).
            unsafe { self.launch_argmax(b, out) }?;
            if k + 1 < steps {
                let next_tokens = meta_base + 4 * ((k + 1) * stride + layout.tokens) as u64;
                // SAFETY: both ranges lie in live device buffers (b ids; the next step's token
                // array of b entries).
                unsafe {
                    cudarc::driver::result::memcpy_dtod_async(
                        next_tokens,
                        out,
                        4 * b,
                        self.gpu.stream.cu_stream(),
                    )
                }
                .map_err(cuda_err("chaining the step's tokens"))?;
            }
        }
        Ok(())
    }
}

/// Words between two steps' metadata in a chain graph for `len` words of one step's metadata: a
/// power of two of at least 64, so the stride (baked into the graph) changes only when the block
/// tables double.
fn chain_stride(len: usize) -> usize {
    len.next_power_of_two().max(64)
}

#[cfg(test)]
mod tests {
    use super::chain_stride;

    #[test]
    fn a_chain_stride_holds_the_step_and_keeps_int4_alignment() {
        for len in 0..5000 {
            let s = chain_stride(len);
            assert!(
                s >= len && s.is_multiple_of(4) && s >= 64,
                "len {len} -> {s}"
            );
            assert_eq!(s, chain_stride(s), "a stride is its own stride");
        }
        assert_eq!(chain_stride(65), 128);
    }
}
