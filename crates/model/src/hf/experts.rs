//! Qwen3-MoE experts of an HF checkpoint → [`MoeWeights`], whose expert matrices are stacked slabs
//! (`[row_len, rows, experts]` in ggml order, as llama.cpp's `ffn_{gate,up,down}_exps`).
//!
//! Checkpoints on the Hub and transformers' `save_pretrained` write one tensor per expert,
//! `mlp.experts.E.{gate,up,down}_proj.weight` (`[inter, hidden]`, `[inter, hidden]`,
//! `[hidden, inter]`): each becomes slab `E` of its stack, by one byte copy into an aligned buffer
//! (an expert's HF `[out, in]` bytes already are its ggml `[in, out]` slab). transformers 5 holds the
//! experts fused in the module (`mlp.experts.gate_up_proj` `[E, 2I, H]`, gate rows then up rows per
//! expert; `mlp.experts.down_proj` `[E, H, I]`); a checkpoint in that layout is read too: the down
//! stack is that tensor as it lies, gate and up are split out by one copy.

use quire_backend::{HostTensor, MoeWeights};
use quire_core::ModelConfig;
use quire_gguf::GgmlType;

use super::shards::{AlignedBuf, Shards};
use crate::ModelError;

/// The experts of layer prefix `p` (`model.layers.L.`).
pub fn load(sh: &Shards, p: &str, cfg: &ModelConfig) -> Result<MoeWeights, ModelError> {
    let m = cfg
        .moe
        .ok_or_else(|| ModelError::Invalid("experts without a MoE config".into()))?;
    let (hd, ne, inter) = (cfg.hidden_size, m.num_experts, m.expert_intermediate_size);
    let gate_inp = sh.tensor(&format!("{p}mlp.gate.weight"), &[hd, ne])?;
    let fused = format!("{p}mlp.experts.gate_up_proj");
    if sh.has(&fused) {
        let (gate_exps, up_exps) = split_gate_up(sh, &fused, hd, inter, ne)?;
        return Ok(MoeWeights {
            gate_inp,
            gate_exps,
            up_exps,
            down_exps: sh.tensor(&format!("{p}mlp.experts.down_proj"), &[inter, hd, ne])?,
        });
    }
    let extra = format!("{p}mlp.experts.{ne}.gate_proj.weight");
    if sh.has(&extra) {
        return Err(ModelError::Invalid(format!(
            "{extra} exists: the weights have more experts than num_experts = {ne}"
        )));
    }
    let stack = |part: &str, dims: &[usize]| {
        stack_experts(
            sh,
            &format!("{p}mlp.experts.*.{part}.weight"),
            |e| format!("{p}mlp.experts.{e}.{part}.weight"),
            dims,
            ne,
        )
    };
    Ok(MoeWeights {
        gate_inp,
        gate_exps: stack("gate_proj", &[hd, inter])?,
        up_exps: stack("up_proj", &[hd, inter])?,
        down_exps: stack("down_proj", &[inter, hd])?,
    })
}

/// The per-expert tensors `name_of(0..experts)`, each of ggml dims `dims`, as one
/// `[dims.., experts]` tensor called `stacked_name`. All experts must share one stored type.
fn stack_experts(
    sh: &Shards,
    stacked_name: &str,
    name_of: impl Fn(usize) -> String,
    dims: &[usize],
    experts: usize,
) -> Result<HostTensor, ModelError> {
    let mut out: Option<(GgmlType, AlignedBuf)> = None;
    for e in 0..experts {
        let name = name_of(e);
        let (dtype, bytes) = sh.raw(&name, dims)?;
        let slab = bytes.len();
        let (first, buf) = out.get_or_insert_with(|| (dtype, AlignedBuf::zeroed(slab * experts)));
        if dtype != *first {
            return Err(ModelError::Invalid(format!(
                "{name} is stored as {} but expert 0 as {}: the experts of a layer must share \
                 one type",
                dtype.name(),
                first.name()
            )));
        }
        buf.bytes_mut()[e * slab..(e + 1) * slab].copy_from_slice(bytes);
    }
    let (dtype, buf) = out.ok_or_else(|| {
        ModelError::Invalid(format!(
            "{stacked_name}: a MoE layer needs at least one expert"
        ))
    })?;
    let mut stacked_dims = dims.to_vec();
    stacked_dims.push(experts);
    Ok(HostTensor {
        name: stacked_name.to_string(),
        dtype,
        dims: stacked_dims,
        bytes: buf.into_tensor_bytes(),
    })
}

/// transformers 5's fused `gate_up_proj` (`[E, 2I, H]`, per expert `I` gate rows then `I` up rows)
/// → the gate and up stacks (`[H, I, E]` each, ggml order).
fn split_gate_up(
    sh: &Shards,
    name: &str,
    hd: usize,
    inter: usize,
    experts: usize,
) -> Result<(HostTensor, HostTensor), ModelError> {
    let (dtype, bytes) = sh.raw(name, &[hd, 2 * inter, experts])?;
    let half = bytes.len() / (2 * experts);
    let (mut gate, mut up) = (
        AlignedBuf::zeroed(half * experts),
        AlignedBuf::zeroed(half * experts),
    );
    let (g, u) = (gate.bytes_mut(), up.bytes_mut());
    for (e, pair) in bytes.chunks_exact(2 * half).enumerate() {
        g[e * half..(e + 1) * half].copy_from_slice(&pair[..half]);
        u[e * half..(e + 1) * half].copy_from_slice(&pair[half..]);
    }
    let tensor = |part: &str, buf: AlignedBuf| HostTensor {
        name: format!("{name}[{part}]"),
        dtype,
        dims: vec![hd, inter, experts],
        bytes: buf.into_tensor_bytes(),
    };
    Ok((tensor("gate", gate), tensor("up", up)))
}
