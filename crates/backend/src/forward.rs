//! The Llama-family layer sequence (Llama 2/3, SmolLM2, Mistral, Qwen2's QKV bias, Qwen3's
//! QK-norm, Qwen3-MoE), written once for every backend.
//!
//! Why: a new architecture or a new backend should cost one forward, not one per backend. A
//! backend brings the kernels behind [`LayerOps`] (and whatever fusions it likes: an op may do
//! the next op's work and leave that one a no-op, e.g. a decode step whose attention kernel
//! applies RoPE itself, or a matmul that applies the pending RMSNorm to its input); the order of
//! the ops, and which weights each gets, lives here.
//!
//! Activations are named by role ([`Act`]); each backend keeps them in its own buffers, sized
//! for the step's tokens before [`forward`] runs.

use crate::tp::Shard;
use crate::BackendError;

/// One transformer layer's weights as a backend holds them: `M` a matrix, `V` a vector, `E` a
/// mixture-of-experts block.
pub struct Layer<M, V, E> {
    /// [hidden]
    pub attn_norm: V,
    /// [q + 2·kv, hidden]: Q, K and V stacked.
    pub wqkv: M,
    /// [q + 2·kv] (Qwen2).
    pub bqkv: Option<V>,
    /// [head_dim] each (Qwen3): RMSNorm of every Q and K head before RoPE.
    pub q_norm: Option<V>,
    pub k_norm: Option<V>,
    /// [hidden, q]
    pub wo: M,
    /// [hidden]
    pub ffn_norm: V,
    pub ffn: Ffn<M, E>,
}

/// A layer's feed-forward block.
pub enum Ffn<M, E> {
    /// SwiGLU: `gate_up` [2·inter, hidden] (gate and up in one matrix, in a backend's own row
    /// order), `down` [hidden, inter].
    Dense { gate_up: M, down: M },
    /// A sparse mixture of SwiGLU experts with its router.
    Moe(E),
}

/// The activations of one step, by role. Shapes for `n` tokens of the step:
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum Act {
    /// [n, hidden] f32: the residual stream.
    X,
    /// [n, hidden]: a normed copy of `X`, a matmul input.
    H,
    /// [n, q + 2·kv]: the QKV projection.
    Qkv,
    /// [n, q]: the attention output.
    Attn,
    /// [n, inter]: the SwiGLU output.
    Swiglu,
}

impl Act {
    /// The profiler's name of the matmul from `src` to `dst` (`matmul_qkv`, `matmul_o`,
    /// `matmul_down`), so every backend's profile names the same ops alike.
    pub fn matmul_name(src: Act, dst: Act) -> &'static str {
        match (src, dst) {
            (Act::H, Act::Qkv) => "matmul_qkv",
            (Act::Attn, Act::X) => "matmul_o",
            (Act::Swiglu, Act::X) => "matmul_down",
            _ => "matmul",
        }
    }
}

/// What consumes the output of an RMSNorm, so the backend can put it in that consumer's input
/// form (8-bit blocks for a quantized matmul, say) or fuse the norm into it.
pub enum Next<'a, M, E> {
    Matmul(&'a M),
    Moe(&'a E),
}

/// The kernels of one forward step, bound to that step's batch and buffers.
pub trait LayerOps {
    type M;
    type V;
    type E;

    /// `X` ← the embedding rows of the step's tokens.
    fn embed(&mut self) -> Result<(), BackendError>;
    /// `H` ← RMSNorm(`X`) · `w`, in the input form `next` wants.
    fn rms_norm(
        &mut self,
        layer: usize,
        w: &Self::V,
        next: Next<'_, Self::M, Self::E>,
    ) -> Result<(), BackendError>;
    /// `dst` ← `src` · `w`ᵀ, or `dst` += that when `add` (the residual adds).
    fn matmul(
        &mut self,
        layer: usize,
        w: &Self::M,
        src: Act,
        dst: Act,
        add: bool,
    ) -> Result<(), BackendError>;
    /// On `Qkv`, in place: the bias, the per-head RMSNorm of Q and K, then RoPE at each token's
    /// position.
    fn qkv_post(
        &mut self,
        layer: usize,
        bias: Option<&Self::V>,
        q_norm: Option<&Self::V>,
        k_norm: Option<&Self::V>,
    ) -> Result<(), BackendError>;
    /// Writes the step's K and V (from `Qkv`) into layer `layer`'s cache slots, then `Attn` ←
    /// causal paged attention of the step's queries over each sequence's cached keys.
    fn attention(&mut self, layer: usize) -> Result<(), BackendError>;
    /// `Swiglu` ← silu(gate) ⊙ up of `H` · `gate_up`ᵀ, in the input form `down` wants (a backend
    /// may run the matmul into a gate/up buffer of its own, then the activation, or fuse them).
    fn gate_up(
        &mut self,
        layer: usize,
        gate_up: &Self::M,
        down: &Self::M,
    ) -> Result<(), BackendError>;
    /// `X` += the mixture of experts of `H`.
    fn moe(&mut self, layer: usize, moe: &Self::E) -> Result<(), BackendError>;
    /// The logits of the rows the step wants: RMSNorm(`X`) · `norm`, times `w`ᵀ.
    fn output(&mut self, norm: &Self::V, w: &Self::M) -> Result<(), BackendError>;

    /// Tensor parallelism (`crate::tp`): this step's rank in its group, `None` when the model is
    /// not sharded (then the two ops below are never called).
    fn shard(&self) -> Option<Shard> {
        None
    }
    /// `X` ← the sum over the group's ranks of their `X` (an all-reduce).
    fn all_reduce(&mut self, _layer: usize) -> Result<(), BackendError> {
        Err(no_tp())
    }
    /// `X` ← 0: a rank other than the lead contributes only its partial mixture of experts.
    fn zero_residual(&mut self) -> Result<(), BackendError> {
        Err(no_tp())
    }
}

fn no_tp() -> BackendError {
    BackendError::Config("this backend does not run tensor-parallel groups".into())
}

/// Runs one step: embedding, every layer's attention and feed-forward blocks, the output.
///
/// Sharded (`o.shard()` is `Some`), each rank holds some heads and FFN columns: its o and down
/// products are partial sums of the full ones, so the lead rank adds its part to the residual,
/// the others write theirs alone, and an all-reduce of `X` after each block makes every rank's
/// residual stream the full model's.
pub fn forward<O: LayerOps>(
    o: &mut O,
    layers: &[Layer<O::M, O::V, O::E>],
    output_norm: &O::V,
    output: &O::M,
) -> Result<(), BackendError> {
    let sharded = o.shard().is_some();
    let lead = o.shard().is_none_or(|s| s.is_lead());
    o.embed()?;
    for (li, l) in layers.iter().enumerate() {
        o.rms_norm(li, &l.attn_norm, Next::Matmul(&l.wqkv))?;
        o.matmul(li, &l.wqkv, Act::H, Act::Qkv, false)?;
        o.qkv_post(li, l.bqkv.as_ref(), l.q_norm.as_ref(), l.k_norm.as_ref())?;
        o.attention(li)?;
        o.matmul(li, &l.wo, Act::Attn, Act::X, lead)?;
        if sharded {
            o.all_reduce(li)?;
        }
        match &l.ffn {
            Ffn::Dense { gate_up, down } => {
                o.rms_norm(li, &l.ffn_norm, Next::Matmul(gate_up))?;
                o.gate_up(li, gate_up, down)?;
                o.matmul(li, down, Act::Swiglu, Act::X, lead)?;
            }
            Ffn::Moe(e) => {
                o.rms_norm(li, &l.ffn_norm, Next::Moe(e))?;
                if !lead {
                    o.zero_residual()?;
                }
                o.moe(li, e)?;
            }
        }
        if sharded {
            o.all_reduce(li)?;
        }
    }
    o.output(output_norm, output)
}
