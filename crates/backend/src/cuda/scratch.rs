//! The CUDA executor's device activations and how they grow with the batches it sees.
//!
//! Every buffer exists from load on, so the forward pass reads plain fields: the activations for
//! the engine's token budget (`CudaOptions::max_num_batched_tokens`) are allocated at load, before
//! the KV pool is sized; `grow` replaces a buffer that is too small for a step and reports the
//! move, because CUDA graphs captured before it hold the old addresses.

use half::f16;
use quire_core::ModelConfig;

use super::gpu::{DBuf, Gpu};
use super::llama::{CudaExecutor, MAX_GRAPH_BATCH};
use super::moe::MoeScratch;
use super::qmat::Q8A_BYTES;
use crate::chain::MAX_CHAIN;
use crate::BackendError;

/// Steps of at most this many tokens (single-sequence decode, small decode batches) use their own
/// activations, allocated once and never regrown.
pub(super) const SMALL_ROWS: usize = 16;

/// One set of per-token activations for up to `tokens` rows (0: not allocated yet).
pub(super) struct Acts {
    tokens: usize,
    pub(super) x: DBuf<f32>,    // [n, hidden]
    pub(super) h: DBuf<f16>,    // [n, hidden]
    pub(super) qkv: DBuf<f32>,  // [n, q + 2kv]
    pub(super) attn: DBuf<f32>, // [n, q] f16 or f32 (see AttnBuffers::out_f32)
    pub(super) gu: DBuf<f32>,   // [n, 2 inter]
    pub(super) act: DBuf<f16>,  // [n, inter]
    /// Quantized activations for the quantized matmuls: [n, max(hidden, q, inter) / 32] blocks.
    pub(super) q8: DBuf<u8>,
}

impl Acts {
    /// Activations for `n` rows (rounded up to a power of two, at least `SMALL_ROWS`).
    fn alloc(g: &Gpu, c: &ModelConfig, n: usize) -> Result<Self, BackendError> {
        let cap = n.next_power_of_two().max(SMALL_ROWS);
        let (hd, qs, kvs, inter) = (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
        Ok(Self {
            tokens: cap,
            x: g.alloc(cap * hd)?,
            h: g.alloc(cap * hd)?,
            qkv: g.alloc(cap * (qs + 2 * kvs))?,
            attn: g.alloc(cap * qs)?,
            gu: g.alloc(cap * 2 * inter)?,
            act: g.alloc(cap * inter)?,
            q8: g.alloc(cap * hd.max(qs).max(inter) / 32 * Q8A_BYTES)?,
        })
    }
}

/// Device activations, in two sets: small steps (decode of one or a few sequences) keep theirs
/// together, never moved by a prompt's growth (so their graphs stay valid). Measured on the H100,
/// the split neither costs nor gains speed.
pub(super) struct Scratch {
    /// Steps of up to `SMALL_ROWS` tokens.
    pub(super) small: Acts,
    /// Larger steps, grown to the largest seen.
    pub(super) large: Acts,
    pub(super) logits: DBuf<f32>, // [n, vocab]
    /// A vocab-parallel rank's own logits, `[n, its span]` packed in room for `[n, stride]`, and
    /// every rank's gathered, `[ranks][n · stride]` (`Fwd::output`); empty on one GPU.
    pub(super) logits_part: DBuf<f32>,
    pub(super) logits_gathered: DBuf<f32>,
    pub(super) part_acc: DBuf<f32>,
    pub(super) part_ml: DBuf<f32>,
    pub(super) meta: DBuf<i32>,
    /// The MoE FFN's routing and expert activations.
    pub(super) moe: MoeScratch,
    /// The largest quantized matrix dequantized to f16, for many-token matmuls (sized at load;
    /// empty when no matmul dequantizes).
    pub(super) wdq: DBuf<f16>,
    pub(super) ids: DBuf<i32>,
    /// `argmax_split`'s slices `[rows, ARGMAX_MAX_CTAS]` (value, index) and its per-row arrival
    /// counters (zeroed when allocated, left zero by every launch); grown with the logits.
    pub(super) argmax_part: DBuf<f32>,
    pub(super) argmax_counters: DBuf<i32>,
    /// Chain decode's token ids, `[MAX_CHAIN][MAX_GRAPH_BATCH]` (never moved).
    pub(super) chain_ids: DBuf<i32>,
}

impl Scratch {
    /// The activations of steps up to `max_tokens` tokens (the engine's token budget), beside
    /// `wdq`; allocated at load, before the KV pool takes the free memory, so a serving engine
    /// never allocates on its hot path. Logits rows, attention partials and metadata grow with
    /// the steps (they are small); so do the activations for a step beyond `max_tokens` (tools
    /// such as `bench -p 2048`), once.
    pub(super) fn new(
        g: &Gpu,
        c: &ModelConfig,
        wdq: DBuf<f16>,
        max_tokens: usize,
    ) -> Result<Self, BackendError> {
        let mut moe = MoeScratch::empty(g)?;
        if let Some(m) = c.moe {
            moe.grow(g, max_tokens, &m, c.hidden_size)?;
        }
        Ok(Self {
            small: Acts::alloc(g, c, SMALL_ROWS)?,
            large: Acts::alloc(g, c, max_tokens.max(SMALL_ROWS + 1))?,
            logits: g.alloc(0)?,
            logits_part: g.alloc(0)?,
            logits_gathered: g.alloc(0)?,
            part_acc: g.alloc(0)?,
            part_ml: g.alloc(0)?,
            meta: g.alloc(0)?,
            moe,
            wdq,
            ids: g.alloc(0)?,
            argmax_part: g.alloc(0)?,
            argmax_counters: g.alloc(0)?,
            chain_ids: g.alloc(MAX_CHAIN * MAX_GRAPH_BATCH)?,
        })
    }

    /// The activations a step of `n` tokens uses.
    pub(super) fn acts(&self, n: usize) -> &Acts {
        if n <= SMALL_ROWS {
            &self.small
        } else {
            &self.large
        }
    }
}

/// Whether `b` must be (re)allocated to hold `len` elements: never allocated yet (an empty
/// buffer), or too small.
fn too_small<T>(b: &DBuf<T>, len: usize) -> bool {
    b.len == 0 || b.len < len
}

impl CudaExecutor {
    /// Grows the activations to `n` tokens, `nl` logits rows, `part` attention partials and
    /// `meta` metadata words; true when anything moved (captured graphs are then stale).
    pub(super) fn grow(
        &mut self,
        n: usize,
        nl: usize,
        part: usize,
        meta: usize,
    ) -> Result<bool, BackendError> {
        let c = &self.cfg;
        let g = &self.gpu;
        let split = self.vocab_split;
        let s = &mut self.s;
        let mut moved = false;
        let a = if n <= SMALL_ROWS {
            &mut s.small
        } else {
            &mut s.large
        };
        if n > a.tokens {
            moved = true;
            // Free the old set first: the new one may need the room.
            *a = Acts::alloc(g, c, 0)?;
            *a = Acts::alloc(g, c, n)?;
        }
        if let Some(m) = c.moe {
            moved |= s.moe.grow(g, n, &m, c.hidden_size)?;
        }
        if too_small(&s.logits, nl * c.vocab_size) {
            let rows = nl.next_power_of_two();
            s.logits = g.alloc(rows * c.vocab_size)?;
            s.ids = g.alloc(rows)?;
            s.argmax_part = g.alloc(rows * super::sample::ARGMAX_MAX_CTAS * 2)?;
            s.argmax_counters = g.alloc(rows)?;
            moved = true;
        }
        if let Some(sh) = split {
            let stride = sh.vocab_stride(c.vocab_size);
            if too_small(&s.logits_part, nl * stride) {
                let rows = nl.next_power_of_two();
                s.logits_part = g.alloc(rows * stride)?;
                s.logits_gathered = g.alloc(0)?;
                s.logits_gathered = g.alloc(sh.size * rows * stride)?;
                moved = true;
            }
        }
        if too_small(&s.part_acc, part * c.head_dim) {
            s.part_acc = g.alloc(part.next_power_of_two() * c.head_dim)?;
            s.part_ml = g.alloc(part.next_power_of_two() * 2)?;
            moved = true;
        }
        if too_small(&s.meta, meta) {
            s.meta = g.alloc(meta.next_power_of_two())?;
            moved = true;
        }
        Ok(moved)
    }
}
