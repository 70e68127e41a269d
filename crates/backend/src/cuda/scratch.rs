//! The CUDA executor's device activations and how they grow with the batches it sees.

use half::f16;

use super::gpu::DBuf;
use super::llama::CudaExecutor;
use super::moe::MoeScratch;
use super::qmat::Q8A_BYTES;
use crate::BackendError;

/// Steps of at most this many tokens (single-sequence decode, small decode batches) use their own
/// activations, allocated once and never regrown.
pub(super) const SMALL_ROWS: usize = 16;

/// One set of per-token activations for up to `tokens` rows.
#[derive(Default)]
pub(super) struct Acts {
    tokens: usize,
    pub(super) x: Option<DBuf<f32>>,    // [n, hidden]
    pub(super) h: Option<DBuf<f16>>,    // [n, hidden]
    pub(super) qkv: Option<DBuf<f32>>,  // [n, q + 2kv]
    pub(super) attn: Option<DBuf<f32>>, // [n, q] f16 or f32 (see AttnBuffers::out_f32)
    pub(super) gu: Option<DBuf<f32>>,   // [n, 2 inter]
    pub(super) act: Option<DBuf<f16>>,  // [n, inter]
    /// [n, num_kv_heads] split arrivals of the decode attention kernel; zeroed when allocated,
    /// left zero by every launch.
    pub(super) attn_counters: Option<DBuf<i32>>,
    /// Quantized activations for the quantized matmuls: [n, max(hidden, q, inter) / 32] blocks.
    pub(super) q8: Option<DBuf<u8>>,
}

/// Device activations, in two sets: small steps (decode of one or a few sequences) keep theirs
/// together and never moved by a prompt's growth. Written to test whether scattered rows of
/// grown buffers explained the slower tg128 after a 512-token prompt; they did not (PERF.md,
/// stop 17: it was the decode graph's context bound, stop 18), the split stays because it costs
/// nothing.
#[derive(Default)]
pub(super) struct Scratch {
    /// Steps of up to `SMALL_ROWS` tokens.
    pub(super) small: Acts,
    /// Larger steps, grown to the largest seen.
    pub(super) large: Acts,
    pub(super) logits: Option<DBuf<f32>>, // [n, vocab]
    pub(super) part_acc: Option<DBuf<f32>>,
    pub(super) part_ml: Option<DBuf<f32>>,
    pub(super) meta: Option<DBuf<i32>>,
    /// The MoE FFN's routing and expert activations.
    pub(super) moe: MoeScratch,
    /// The largest quantized matrix dequantized to f16, for many-token matmuls (allocated at load).
    pub(super) wdq: Option<DBuf<f16>>,
    pub(super) ids: Option<DBuf<i32>>,
    /// `argmax_split`'s slices `[rows, ARGMAX_MAX_CTAS]` (value, index) and its per-row arrival
    /// counters (zeroed when allocated, left zero by every launch); grown with the logits.
    pub(super) argmax_part: Option<DBuf<f32>>,
    pub(super) argmax_counters: Option<DBuf<i32>>,
    /// Chain decode's token ids, `[MAX_CHAIN][MAX_GRAPH_BATCH]` (allocated at first use, never moved).
    pub(super) chain_ids: Option<DBuf<i32>>,
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
        let s = &mut self.s;
        let mut moved = false;
        let a = if n <= SMALL_ROWS {
            &mut s.small
        } else {
            &mut s.large
        };
        if n > a.tokens {
            moved = true;
            let cap = n.next_power_of_two().max(SMALL_ROWS);
            let (hd, qs, kvs, inter) =
                (c.hidden_size, c.q_size(), c.kv_size(), c.intermediate_size);
            a.x = Some(g.alloc(cap * hd)?);
            a.h = Some(g.alloc(cap * hd)?);
            a.qkv = Some(g.alloc(cap * (qs + 2 * kvs))?);
            a.attn = Some(g.alloc(cap * qs)?);
            a.gu = Some(g.alloc(cap * 2 * inter)?);
            a.act = Some(g.alloc(cap * inter)?);
            a.q8 = Some(g.alloc(cap * hd.max(qs).max(inter) / 32 * Q8A_BYTES)?);
            a.attn_counters = Some(g.alloc(cap * c.num_kv_heads)?);
            a.tokens = cap;
        }
        if let Some(m) = c.moe {
            moved |= s.moe.grow(g, n, &m, c.hidden_size)?;
        }
        if s.logits.as_ref().is_none_or(|b| b.len < nl * c.vocab_size) {
            let rows = nl.next_power_of_two();
            s.logits = Some(g.alloc(rows * c.vocab_size)?);
            s.ids = Some(g.alloc(rows)?);
            s.argmax_part = Some(g.alloc(rows * super::sample::ARGMAX_MAX_CTAS * 2)?);
            s.argmax_counters = Some(g.alloc(rows)?);
            moved = true;
        }
        if s.part_acc
            .as_ref()
            .is_none_or(|b| b.len < part * c.head_dim)
        {
            s.part_acc = Some(g.alloc(part.next_power_of_two() * c.head_dim)?);
            s.part_ml = Some(g.alloc(part.next_power_of_two() * 2)?);
            moved = true;
        }
        if s.meta.as_ref().is_none_or(|b| b.len < meta) {
            s.meta = Some(g.alloc(meta.next_power_of_two())?);
            moved = true;
        }
        Ok(moved)
    }
}

impl Scratch {
    /// The activations a step of `n` tokens uses.
    pub(super) fn acts(&self, n: usize) -> &Acts {
        if n <= SMALL_ROWS {
            &self.small
        } else {
            &self.large
        }
    }
}
