//! Mixture-of-experts layers (Qwen3-MoE) on the wgpu backend: the router's top-k and each
//! token's experts on the device, so a MoE model runs on every adapter the dense ones do.
//!
//! Why this shape: correctness first. Routing keeps the router in f32 (as the CPU does, so both
//! pick the same experts up to f32 rounding of the logits), and every chosen (token, expert) pair
//! runs its gate, up and down rows through one plain kernel (`moe.wgsl`) that reads the expert's
//! rows of the stacked `[experts × rows, cols]` matrix as stored (quantized weights dequantized in
//! the kernel, types.wgsl). A step is six dispatches per layer: route, gate, up, SwiGLU, down, and
//! the weighted sum into the residual (`moe_route.wgsl`). Grouping tokens by expert (one read of
//! an expert's weights per step) is the speed work still to do.

use quire_core::ModelConfig;

use super::gpu::Gpu;
use super::kernels::{type_source, Params, WType};
use super::weights::{DMatrix, DVec};
use crate::{BackendError, MoeWeights};

pub const MOE: &str = include_str!("shaders/moe.wgsl");
pub const MOE_ROUTE: &str = include_str!("shaders/moe_route.wgsl");

/// The most experts `moe_route.wgsl` holds a token's logits for.
pub const MAX_EXPERTS: usize = 512;

/// One layer's experts on the device.
pub struct DMoe {
    pub num_experts: usize,
    pub top_k: usize,
    /// Rows of each expert's gate and up matrices.
    pub inter: usize,
    pub hidden: usize,
    pub norm_topk_prob: bool,
    /// [num_experts, hidden] f32.
    pub router: DVec,
    /// [num_experts × inter, hidden], [num_experts × inter, hidden], [num_experts × hidden, inter]:
    /// one part each (the kernel indexes an expert's rows within its part).
    pub gate: DMatrix,
    pub up: DMatrix,
    pub down: DMatrix,
}

impl DMoe {
    pub fn new(gpu: &mut Gpu, m: &MoeWeights, c: &ModelConfig) -> Result<DMoe, BackendError> {
        let cfg = c
            .moe
            .ok_or_else(|| BackendError::Config("experts without a MoE config".into()))?;
        let (hd, ne, inter) = (c.hidden_size, cfg.num_experts, cfg.expert_intermediate_size);
        if ne > MAX_EXPERTS || cfg.num_experts_per_tok == 0 || cfg.num_experts_per_tok > ne {
            return Err(BackendError::Config(format!(
                "the wgpu backend routes up to {MAX_EXPERTS} experts, k of them (1 <= k <= \
                 experts): got {ne} experts, k = {}",
                cfg.num_experts_per_tok
            )));
        }
        let router = m.gate_inp.to_f32()?;
        if router.len() != ne * hd {
            return Err(BackendError::Shape {
                name: m.gate_inp.name.clone(),
                got: m.gate_inp.dims.clone(),
                expected: vec![hd, ne],
            });
        }
        let one_part = |gpu: &mut Gpu, what: &str, t, cols| -> Result<DMatrix, BackendError> {
            let d = DMatrix::stack(gpu, what, &[t], cols)?;
            if d.parts.len() != 1 {
                return Err(BackendError::Config(format!(
                    "{what}: the expert stack ({} MiB) is larger than one storage binding of \
                     this adapter ({} MiB); the wgpu backend keeps a layer's experts in one",
                    d.bytes() >> 20,
                    gpu.max_binding() >> 20
                )));
            }
            Ok(d)
        };
        Ok(DMoe {
            num_experts: ne,
            top_k: cfg.num_experts_per_tok,
            inter,
            hidden: hd,
            norm_topk_prob: cfg.norm_topk_prob,
            router: DVec::new(gpu, "router", &router)?,
            gate: one_part(gpu, "gate_exps", &m.gate_exps, hd)?,
            up: one_part(gpu, "up_exps", &m.up_exps, hd)?,
            down: one_part(gpu, "down_exps", &m.down_exps, inter)?,
        })
    }

    /// Weight bytes of one expert (its gate, up and down rows).
    pub fn expert_bytes(&self) -> usize {
        let all = self.gate.bytes() + self.up.bytes() + self.down.bytes();
        all as usize / self.num_experts
    }
}

/// The expert matmul for weights of type `t` (types.wgsl's reader of `t`, then the kernel).
pub fn moe_source(t: WType) -> String {
    format!("{}\n{MOE}", type_source(t))
}

/// The pipelines: routing and the weighted sum, and the expert matmul per weight type.
pub struct MoeKernels {
    pub route: wgpu::ComputePipeline,
    pub combine: wgpu::ComputePipeline,
    experts: Vec<wgpu::ComputePipeline>,
}

impl MoeKernels {
    pub fn new(gpu: &Gpu) -> Result<MoeKernels, BackendError> {
        let experts = WType::ALL
            .iter()
            .map(|&t| gpu.pipeline(&format!("moe_{}", t.name()), &moe_source(t), "main"))
            .collect::<Result<_, _>>()?;
        Ok(MoeKernels {
            route: gpu.pipeline("moe_route", MOE_ROUTE, "route")?,
            combine: gpu.pipeline("moe_combine", MOE_ROUTE, "combine")?,
            experts,
        })
    }

    pub fn experts(&self, t: WType) -> &wgpu::ComputePipeline {
        let i = WType::ALL.iter().position(|&x| x == t).expect("every type");
        &self.experts[i]
    }
}

/// The route kernel's parameters and grid for `n` tokens.
pub fn route_params(m: &DMoe, n: usize) -> (Params, [u32; 3]) {
    let mut p = [0u32; 16];
    p[..5].copy_from_slice(&[
        n as u32,
        m.hidden as u32,
        m.num_experts as u32,
        m.top_k as u32,
        m.norm_topk_prob as u32,
    ]);
    (p, [n as u32, 1, 1])
}

/// The combine kernel's parameters and grid for `n` tokens.
pub fn combine_params(m: &DMoe, n: usize) -> (Params, [u32; 3]) {
    let (p, _) = route_params(m, n);
    (p, [(m.hidden as u32).div_ceil(256), n as u32, 1])
}

/// The expert matmul's parameters and grid: `w` (`per` rows per expert) over the `pairs`
/// token-expert pairs, reading input rows of `in_stride` (row pair / k when `by_token`) and
/// writing rows of `out_stride` from column `y_off`.
#[allow(clippy::too_many_arguments)]
pub fn experts_params(
    w: &DMatrix,
    per: usize,
    pairs: usize,
    k: usize,
    in_stride: usize,
    out_stride: usize,
    y_off: usize,
    by_token: bool,
) -> (Params, [u32; 3]) {
    let mut p = [0u32; 16];
    p[..9].copy_from_slice(&[
        w.parts[0].rows as u32,
        w.cols as u32,
        per as u32,
        pairs as u32,
        k as u32,
        in_stride as u32,
        out_stride as u32,
        y_off as u32,
        by_token as u32,
    ]);
    (p, [(per as u32).div_ceil(4), pairs as u32, 1])
}

/// Every MoE module, for the naga translation checks.
pub fn sources() -> Vec<(String, String, Vec<&'static str>)> {
    let mut v: Vec<(String, String, Vec<&'static str>)> = vec![(
        "moe_route".into(),
        MOE_ROUTE.into(),
        vec!["route", "combine"],
    )];
    for t in WType::ALL {
        v.push((format!("moe_{}", t.name()), moe_source(t), vec!["main"]));
    }
    v
}
