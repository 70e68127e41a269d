//! The decode attention kernel's instances and plans (attn_decode.wgsl): which variant runs
//! for a head geometry, how a step's keys are split into ranges, and its parameter block. Kept
//! apart from kernels.rs, which re-exports it, so each file stays readable.

use super::gpu::Gpu;
use super::kernels::{attn_params, section, HeadShape, Params, ATTN_DECODE};
use crate::BackendError;

/// The most key ranges one decode row is split into (attn_decode.wgsl's MAX_SPLITS).
pub const MAX_SPLITS: usize = 64;
/// Workgroups the decode kernel aims for: enough for every SM of a large GPU to hold several
/// while each still takes a few steps of keys.
const SPLIT_TARGET_GROUPS: usize = 1024;
/// Ranges per row the engine's plan takes at most where the target would ask for more (few
/// rows): the last range of a (row, KV head) merges every range's partial, so 64 ranges cost
/// more in that merge than they gain. wgpu_decode_bench on an H200 through Vulkan (one row,
/// Hq32 Hkv8 D128, block 16; one call, noisy absolute times): 1,024 keys 64 × 16 127.7 µs, 32 ×
/// 32 71.9, 16 × 64 68.8; 4,096 keys 64 × 64 107.8, 32 × 128 69.2, 16 × 256 82.6.
const PLAN_MAX_SPLITS: usize = 32;
/// Block-table entries a range keeps in workgroup memory (attn_decode.wgsl's TB).
const SPLIT_TABLE: usize = 256;

/// One instance of the decode attention kernel (attn_decode.wgsl): the query heads per KV head,
/// the lanes that share a key, the 16-byte chunks each lane reads of a K or V row, the keys each
/// key group takes per step, and whether the lanes sum through subgroups.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub struct DecodeKernel {
    pub group: usize,
    pub lanes: usize,
    pub chunks_per_lane: usize,
    pub keys: usize,
    pub subgroup: bool,
}

impl DecodeKernel {
    /// The instance for `group` query heads per KV head of `head_dim` (a multiple of 8) on a
    /// device whose smallest subgroup is `subgroup` (`None`: no subgroup operations, or a
    /// subgroup size the layout cannot use). Lanes per key: 16 (a 256-byte f16 row of head dim
    /// 128 in one sweep of 16-byte loads), fewer where subgroups are smaller, so that a key's
    /// lanes lie in one subgroup. Subgroups of fewer than 8 (at most 16 key groups, whose
    /// partials the kernel merges in workgroup memory) take the workgroup-memory sums. Keys per
    /// step: as many as keep a lane's registers for K/V in flight, Q and the V sums bounded
    /// (4 for GQA 2 at head dim 128, 2 for GQA 4); one for the workgroup-memory sums.
    pub fn new(subgroup: Option<u32>, group: usize, head_dim: usize) -> DecodeKernel {
        let sg = subgroup.filter(|&s| s.is_power_of_two() && (8..=128).contains(&s));
        let lanes = sg.map_or(16, |s| s.min(16) as usize);
        let chunks_per_lane = (head_dim / 8).div_ceil(lanes).max(1);
        let keys = match (sg, group * chunks_per_lane) {
            (None, _) => 1,
            (Some(_), w) if w <= 2 => 4,
            (Some(_), w) if w <= 4 => 2,
            _ => 1,
        };
        DecodeKernel {
            group,
            lanes,
            chunks_per_lane,
            keys,
            subgroup: sg.is_some(),
        }
    }

    /// This instance taking `keys` keys per key group and step (benchmarks compare them; the
    /// workgroup-memory sums take at most 16 / group).
    pub fn with_keys(self, keys: usize) -> DecodeKernel {
        let most = if self.subgroup {
            16
        } else {
            (16 / self.group).max(1)
        };
        DecodeKernel {
            keys: keys.clamp(1, most),
            ..self
        }
    }

    /// Keys one workgroup takes per step.
    pub fn step_keys(&self) -> usize {
        128 / self.lanes * self.keys
    }

    /// How it runs, in words (for benchmark output).
    pub fn describe(&self) -> String {
        format!(
            "{} lanes x {} 16-byte chunks per key row, {} keys per group and step; GQA {}; lane \
             sums through {}; ranges merged by the last workgroup",
            self.lanes,
            self.chunks_per_lane,
            self.keys,
            self.group,
            if self.subgroup {
                "subgroup shuffles"
            } else {
                "workgroup memory"
            }
        )
    }

    /// The WGSL module: the kernel with its sizes filled in and its lane sums.
    pub fn source(&self) -> String {
        let (prelude, sums) = section(
            ATTN_DECODE,
            if self.subgroup { "SUBGROUP" } else { "SHARED" },
        );
        let body = prelude
            .replace("GROUPu", &format!("{}u", self.group))
            .replace("LANESu", &format!("{}u", self.lanes))
            .replace("CPLu", &format!("{}u", self.chunks_per_lane))
            .replace("KEYSu", &format!("{}u", self.keys));
        format!("{body}\n{sums}")
    }
}

/// Whether the split decode kernel takes heads of `s` (16-byte chunks of K and V rows); other
/// shapes' decode rows take the general attention kernel.
pub fn split_fits(s: &HeadShape) -> bool {
    s.head_dim.is_multiple_of(8)
}

/// The decode kernel's pipelines, one per instance, made on first use (a model has one: its
/// first decode step makes it) and kept.
pub struct DecodeSplit {
    /// The smallest subgroup size where the kernel sums through subgroups.
    pub subgroup: Option<u32>,
    pipes: std::sync::Mutex<std::collections::HashMap<DecodeKernel, wgpu::ComputePipeline>>,
}

impl DecodeSplit {
    /// No pipelines yet; lane sums through subgroups where `subgroup` (the smallest subgroup
    /// size) is given.
    pub fn new(subgroup: Option<u32>) -> DecodeSplit {
        DecodeSplit {
            subgroup,
            pipes: Default::default(),
        }
    }

    /// The instance for heads of `s`.
    pub fn kernel(&self, s: &HeadShape) -> DecodeKernel {
        DecodeKernel::new(self.subgroup, s.q_heads / s.kv_heads, s.head_dim)
    }

    /// The pipeline for heads of `s`.
    pub fn pipe(&self, gpu: &Gpu, s: &HeadShape) -> Result<wgpu::ComputePipeline, BackendError> {
        self.pipe_of(gpu, self.kernel(s))
    }

    /// The pipeline of instance `d`.
    pub fn pipe_of(
        &self,
        gpu: &Gpu,
        d: DecodeKernel,
    ) -> Result<wgpu::ComputePipeline, BackendError> {
        let mut pipes = self.pipes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pipes.get(&d) {
            return Ok(p.clone());
        }
        let name = format!(
            "attn_decode_g{}_l{}_c{}_u{}",
            d.group, d.lanes, d.chunks_per_lane, d.keys
        );
        let pipe = gpu.pipeline(&name, &d.source(), "decode")?;
        pipes.insert(d, pipe.clone());
        Ok(pipe)
    }
}

/// How the decode kernel divides the keys of `rows` decode rows of at most `max_keys` keys.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct SplitPlan {
    pub splits: usize,
    pub split_keys: usize,
}

impl SplitPlan {
    /// Ranges of whole steps of kernel `d`, as many as fill about [`SPLIT_TARGET_GROUPS`]
    /// workgroups over the rows and KV heads but at most [`PLAN_MAX_SPLITS`] per row (more only
    /// where a range's block-table entries would not fit workgroup memory, up to
    /// [`MAX_SPLITS`]), no more than the longest row has steps.
    pub fn new(
        d: &DecodeKernel,
        s: &HeadShape,
        rows: usize,
        max_keys: usize,
        block_size: usize,
    ) -> SplitPlan {
        let target = SPLIT_TARGET_GROUPS.min(PLAN_MAX_SPLITS * (rows * s.kv_heads).max(1));
        SplitPlan::with_target(d, s, rows, max_keys, block_size, target)
    }

    /// [`SplitPlan::new`] aiming at `target` workgroups (benchmarks compare targets).
    pub fn with_target(
        d: &DecodeKernel,
        s: &HeadShape,
        rows: usize,
        max_keys: usize,
        block_size: usize,
        target: usize,
    ) -> SplitPlan {
        let unit = d.step_keys();
        let steps = max_keys.div_ceil(unit).max(1);
        let want = target.div_ceil((rows * s.kv_heads).max(1));
        // Ranges whose blocks fit the kernel's table (two entries spare for ranges that start
        // mid-block).
        let fit = ((SPLIT_TABLE - 2) * block_size.max(1) / unit).max(1);
        let least = steps.div_ceil(fit);
        let splits = want.max(least).clamp(1, MAX_SPLITS).min(steps);
        let split_keys = steps.div_ceil(splits) * unit;
        SplitPlan {
            splits: max_keys.div_ceil(split_keys).max(1),
            split_keys,
        }
    }

    /// f32 words of the partial V sums, and of the (max, sum) pairs, for `rows` rows.
    pub fn scratch_words(&self, s: &HeadShape, rows: usize) -> (usize, usize) {
        let parts = rows * s.q_heads * self.splits;
        (parts * s.head_dim, parts * 2)
    }
}

/// The decode kernel's parameters; `ml_off`: where the (max, sum) pairs start in its scratch.
pub fn split_params(
    s: &HeadShape,
    n: usize,
    block_size: usize,
    window: usize,
    plan: SplitPlan,
    ml_off: usize,
) -> Params {
    let mut p = attn_params(s, n, block_size, window);
    p[12] = plan.splits as u32;
    p[13] = plan.split_keys as u32;
    p[14] = ml_off as u32;
    p
}

pub fn split_groups(s: &HeadShape, n: usize, plan: SplitPlan) -> [u32; 3] {
    [s.kv_heads as u32, n as u32, plan.splits as u32]
}
