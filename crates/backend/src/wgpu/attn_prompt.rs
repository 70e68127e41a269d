//! Which kernel runs the attention of prompt chunks, and how it cuts them into query tiles.
//! Two kernels share one parameter block, token table and grid ([KV heads, query tiles]):
//! - `attention.wgsl`, scalar f32 math on 16 query rows per workgroup; every adapter runs it;
//! - `attention_coop.wgsl`, both products on matrix units over 64 query rows per workgroup,
//!   where the adapter has the prompt GEMM's cooperative matrices (f16 × f16 → f32 fragments,
//!   one fixed subgroup size of at least 16) and the head dimension is a multiple of the
//!   fragment of at most [`COOP_MAX_HEAD_DIM`]. Nothing depends on it: the scalar kernel runs
//!   everywhere else.
//!
//! The coop kernel is specialized on the head dimension, so its pipelines are made on first
//! use, one per head dimension (a model has one).

use std::collections::HashMap;
use std::sync::Mutex;

use super::gemm::CoopTile;
use super::gpu::Gpu;
use super::kernels::{params, section, HeadShape, Params};
use crate::BackendError;

const ATTENTION: &str = include_str!("shaders/attention.wgsl");
const ATTENTION_COOP: &str = include_str!("shaders/attention_coop.wgsl");
/// What both kernels share (parameters, bindings, key reads, the fused KV write).
const ATTENTION_COMMON: &str = include_str!("shaders/attention_common.wgsl");

/// The scalar kernel's query rows per workgroup, lanes per row and words of its K/V tile
/// (attention.wgsl's ROWS, LANES and KVW).
const ATTN_ROWS: usize = 16;
const ATTN_LANES: u32 = 8;
const ATTN_KVW: usize = 2112;
const ATTN_MAX_KT: usize = 64;

/// The coop kernel's query rows per workgroup (four subgroups of 16), keys per tile, and the
/// largest head dimension its workgroup memory holds.
const COOP_ROWS: usize = 64;
const COOP_KEYS: usize = 32;
const COOP_MAX_HEAD_DIM: usize = 128;
const COOP_SUBGROUP_ROWS: u32 = 16;

/// The kernel a prompt chunk's attention runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum PromptPath {
    /// attention.wgsl; `subgroup`: its row sums through subgroup shuffles.
    Scalar { subgroup: bool },
    /// attention_coop.wgsl on fragments of `tile`.
    Coop(CoopTile),
}

/// The prompt attention of a device: the scalar pipeline, and the coop configuration with its
/// pipelines by head dimension.
pub struct PromptAttn {
    scalar: wgpu::ComputePipeline,
    subgroup: bool,
    /// The coop kernel's configuration; `None` where the adapter lacks it (tests set it to
    /// `None` to run the scalar kernel on an adapter that has it).
    pub coop: Option<CoopTile>,
    /// The device's workgroup memory (bytes): the coop kernel's grows with the head dimension.
    room: u32,
    coop_pipes: Mutex<HashMap<usize, wgpu::ComputePipeline>>,
}

impl PromptAttn {
    /// The scalar kernel (row sums through subgroups if `subgroup` and the device's subgroups
    /// hold a row's 8 lanes), and the coop kernel where the device was opened with it.
    pub fn new(gpu: &Gpu, subgroup: bool) -> Result<PromptAttn, BackendError> {
        let subgroup = subgroup && subgroup_fits(gpu);
        Ok(PromptAttn {
            scalar: gpu.pipeline("attention", &scalar_source(subgroup), "main")?,
            subgroup,
            coop: gpu.coop.filter(|t| {
                t.subgroup >= COOP_SUBGROUP_ROWS && COOP_SUBGROUP_ROWS.is_multiple_of(t.frag)
            }),
            room: gpu.limits.max_compute_workgroup_storage_size,
            coop_pipes: Default::default(),
        })
    }

    /// The kernel for heads of `s`.
    pub fn path(&self, s: &HeadShape) -> PromptPath {
        match self.coop {
            Some(t) if coop_fits(t, s) && coop_bytes(s.head_dim as u32) <= self.room => {
                PromptPath::Coop(t)
            }
            _ => PromptPath::Scalar {
                subgroup: self.subgroup,
            },
        }
    }

    /// Tokens per query tile for heads of `s`: as many as keep every query head of a KV group
    /// within the kernel's rows.
    pub fn tile_tokens(&self, s: &HeadShape) -> usize {
        let rows = match self.path(s) {
            PromptPath::Coop(_) => COOP_ROWS,
            PromptPath::Scalar { .. } => ATTN_ROWS,
        };
        (rows / group(s)).max(1)
    }

    /// The kernel's parameters for `n` tokens of heads `s` (`window` 0: none).
    pub fn params(&self, s: &HeadShape, n: usize, block_size: usize, window: usize) -> Params {
        let mut p = attn_params(s, n, block_size, window);
        if let PromptPath::Coop(_) = self.path(s) {
            p[12] = self.tile_tokens(s) as u32;
            p[13] = COOP_KEYS as u32;
        }
        p
    }

    /// The pipeline for heads of `s`.
    pub fn pipe(&self, gpu: &Gpu, s: &HeadShape) -> Result<wgpu::ComputePipeline, BackendError> {
        let PromptPath::Coop(tile) = self.path(s) else {
            return Ok(self.scalar.clone());
        };
        let mut pipes = self.coop_pipes.lock().unwrap_or_else(|e| e.into_inner());
        if let Some(p) = pipes.get(&s.head_dim) {
            return Ok(p.clone());
        }
        let name = format!("attention_coop_d{}", s.head_dim);
        let pipe = gpu.pipeline(&name, &coop_source(tile, s.head_dim as u32), "main")?;
        pipes.insert(s.head_dim, pipe.clone());
        Ok(pipe)
    }

    /// Makes the pipeline for heads of `s` now (at load, not in the first prompt's step). The
    /// cooperative-matrix feature is experimental in wgpu: a driver that refuses the coop kernel
    /// costs speed, not the run (and says so); the scalar kernel then runs.
    pub fn prepare(&mut self, gpu: &Gpu, s: &HeadShape) -> Result<(), BackendError> {
        if let Err(e) = self.pipe(gpu, s) {
            if self.coop.is_none() {
                return Err(e);
            }
            eprintln!(
                "quire: the cooperative-matrix prompt attention does not compile on {}; prompts \
                 use the scalar kernel ({e})",
                gpu.info.name
            );
            self.coop = None;
        }
        Ok(())
    }

    /// The kernel and its tiling for heads of `s`, for benchmark tables.
    pub fn describe(&self, s: &HeadShape) -> String {
        match self.path(s) {
            PromptPath::Coop(t) => format!(
                "coop {f}x{f} f16->f32, {} tokens x {COOP_KEYS} keys per tile, two passes",
                self.tile_tokens(s),
                f = t.frag
            ),
            PromptPath::Scalar { subgroup } => format!(
                "scalar f32, {} tokens x {} keys per tile, row sums through {}",
                self.tile_tokens(s),
                attn_tile_keys(s),
                if subgroup {
                    "subgroup shuffles"
                } else {
                    "workgroup memory"
                }
            ),
        }
    }
}

fn group(s: &HeadShape) -> usize {
    (s.q_heads / s.kv_heads.max(1)).max(1)
}

/// Whether the coop kernel on `t` takes heads of `s`: the head dimension in whole fragments
/// within the kernel's limit, and at least one token per tile.
fn coop_fits(t: CoopTile, s: &HeadShape) -> bool {
    s.head_dim.is_multiple_of(t.frag as usize)
        && s.head_dim <= COOP_MAX_HEAD_DIM
        && group(s) <= COOP_ROWS
}

/// Whether the scalar kernel's 8 lanes of a row lie in one subgroup on this device (its
/// subgroups are a power of two of at least 8 invocations).
fn subgroup_fits(gpu: &Gpu) -> bool {
    gpu.caps
        .subgroup
        .is_some_and(|(lo, _)| lo.is_power_of_two() && lo >= ATTN_LANES)
}

/// The scalar kernel (attention.wgsl) with its row sums through subgroup shuffles or through
/// workgroup memory.
pub fn scalar_source(subgroup: bool) -> String {
    let (prelude, sums) = section(ATTENTION, if subgroup { "SUBGROUP" } else { "SHARED" });
    format!("{ATTENTION_COMMON}\n{prelude}\n{sums}")
}

/// Keys per K/V tile of the scalar kernel: a multiple of 8 whose rows (head_dim / 2 words and
/// one of padding) fit the tile's words.
fn attn_tile_keys(s: &HeadShape) -> usize {
    let fit = ATTN_KVW / (s.head_dim / 2 + 1);
    (fit.min(ATTN_MAX_KT) / 8 * 8).max(8)
}

/// The scalar kernel's parameters (`window` 0: none); the decode kernel starts from them too.
pub fn attn_params(s: &HeadShape, n: usize, block_size: usize, window: usize) -> Params {
    params(&[
        n as u32,
        s.q_heads as u32,
        s.kv_heads as u32,
        s.head_dim as u32,
        block_size as u32,
        (1.0 / (s.head_dim as f32).sqrt()).to_bits(),
        window as u32,
        s.stride() as u32,
        s.q_size() as u32,
        (s.q_size() + s.kv_size()) as u32,
        s.q_size() as u32,
        group(s) as u32,
        (ATTN_ROWS / group(s)).max(1) as u32,
        attn_tile_keys(s) as u32,
    ])
}

/// The prompt attention's grid for `tiles` query tiles (either kernel).
pub fn attn_groups(s: &HeadShape, tiles: usize) -> [u32; 3] {
    [s.kv_heads as u32, tiles as u32, 1]
}

/// The coop kernel for head dimension `hd` on `tile`: the template with its sizes and unrolled
/// fragment code filled in. Each subgroup holds (16 / F) × (KT / F) score fragments and
/// (16 / F) × (hd / F) output fragments.
pub fn coop_source(tile: CoopTile, hd: u32) -> String {
    let f = tile.frag;
    let mat = format!("coop_mat{f}x{f}");
    let fa = COOP_SUBGROUP_ROWS / f; // row fragments of a subgroup
    let fk = COOP_KEYS as u32 / f; // key fragments of a tile
    let fd = hd / f; // dim fragments
    let mut decl = String::new();
    let mut scores = String::new();
    let mut pv = String::new();
    let mut store = String::new();
    decl += &format!("    let zero = {mat}<f32, C>();\n");
    for a in 0..fa {
        for c in 0..fk {
            decl += &format!("    var s{a}_{c} = {mat}<f32, C>();\n");
        }
        for d in 0..fd {
            decl += &format!("    var o{a}_{d} = {mat}<f32, C>();\n");
        }
    }
    // The products over dims d0.. of Q and K; `first`: into fresh accumulators.
    let step = |d0: &str, first: bool| -> String {
        let mut s = String::new();
        for a in 0..fa {
            s += &format!(
                "            let qa{a} = coopLoadT<{mat}<f16, A>>(&qs[q0 + {}u * LDQ + {d0}], LDQ);\n",
                a * f
            );
        }
        for c in 0..fk {
            s += &format!(
                "            let kb{c} = coopLoad<{mat}<f16, B>>(&kv[{}u * LDQ + {d0}], LDQ);\n",
                c * f
            );
            for a in 0..fa {
                let acc = if first {
                    "zero".to_string()
                } else {
                    format!("s{a}_{c}")
                };
                s += &format!("            s{a}_{c} = coopMultiplyAdd(qa{a}, kb{c}, {acc});\n");
            }
        }
        s
    };
    // Each tile's scores start from a product with a zero accumulator.
    scores += &format!("        {{\n{}        }}\n", step("0u", true));
    scores += &format!("        for (var d = {f}u; d < HD; d += {f}u) {{\n");
    scores += &step("d", false);
    scores += "        }\n";
    for a in 0..fa {
        for c in 0..fk {
            scores += &format!(
                "        coopStoreT(s{a}_{c}, &ss[s0 + {}u], {f}u);\n",
                (a * fk + c) * f * f
            );
        }
    }
    pv += &format!("        for (var kk = 0u; kk < KT; kk += {f}u) {{\n");
    for a in 0..fa {
        pv += &format!(
            "            let pa{a} = coopLoadT<{mat}<f16, A>>(&ps[p0 + {}u * LDP + kk], LDP);\n",
            a * f
        );
    }
    for d in 0..fd {
        pv += &format!(
            "            let vb{d} = coopLoad<{mat}<f16, B>>(&kv[{}u * LDV + kk], LDV);\n",
            d * f
        );
        for a in 0..fa {
            pv += &format!("            o{a}_{d} = coopMultiplyAdd(pa{a}, vb{d}, o{a}_{d});\n");
        }
    }
    pv += "        }\n";
    for a in 0..fa {
        for d in 0..fd {
            store += &format!(
                "    coopStoreT(o{a}_{d}, &ss[s0], {f}u);\n    workgroupBarrier();\n    \
                 put(sg, {ra}u, {dd}u, lane, t0, nrows, kvh);\n    workgroupBarrier();\n",
                ra = a * f,
                dd = d * f
            );
        }
    }
    let lens = CoopLens::new(hd);
    // The `enable` lines open the module; the shared part follows them.
    let enables = "enable f16;\nenable wgpu_cooperative_matrix;\n";
    let body = ATTENTION_COOP
        .strip_prefix(enables)
        .expect("attention_coop.wgsl opens on its enable lines");
    format!("{enables}\n{ATTENTION_COMMON}\n{body}")
        .replace("SG_SIZE", &tile.subgroup.to_string())
        .replace("WG_SIZE", &(4 * tile.subgroup).to_string())
        .replace("FRAG", &f.to_string())
        .replace("HD_SIZE", &hd.to_string())
        .replace("QS_LEN", &lens.qs.to_string())
        .replace("KV_LEN", &lens.kv.to_string())
        .replace("SS_LEN", &lens.ss.to_string())
        .replace("PS_LEN", &lens.ps.to_string())
        .replace("//@decl\n", &decl)
        .replace("//@scores\n", &scores)
        .replace("//@pv\n", &pv)
        .replace("//@store\n", &store)
}

/// Element counts of the coop kernel's workgroup arrays for head dimension `hd`
/// (attention_coop.wgsl's QS_LEN, KV_LEN, SS_LEN and PS_LEN).
struct CoopLens {
    qs: u32, // f16: [ROWS][hd + 8]
    kv: u32, // f16: the K tile [KT][hd + 8] or the V tile [hd][KT + 8], whichever is larger
    ss: u32, // f32: [ROWS][KT]
    ps: u32, // f16: [ROWS][KT + 8]
}

impl CoopLens {
    fn new(hd: u32) -> CoopLens {
        let (rows, kt) = (COOP_ROWS as u32, COOP_KEYS as u32);
        CoopLens {
            qs: rows * (hd + 8),
            kv: (kt * (hd + 8)).max(hd * (kt + 8)),
            ss: rows * kt,
            ps: rows * (kt + 8),
        }
    }
}

/// Workgroup memory of the coop kernel for head dimension `hd` (bytes): its arrays, the row
/// sums (f32 per row) and the 16-byte key span.
pub fn coop_bytes(hd: u32) -> u32 {
    let l = CoopLens::new(hd);
    2 * (l.qs + l.kv + l.ps) + 4 * l.ss + 4 * COOP_ROWS as u32 + 16
}

/// The coop kernel's sources for the configurations the naga test covers (NVIDIA's and Apple's
/// fragments) at head dimensions 64 and 128, each with its name and entry point.
pub fn coop_sources() -> Vec<(String, String, Vec<&'static str>)> {
    let mut v = Vec::new();
    for tile in super::gemm::COOP_CHECKED {
        for hd in [64, 128] {
            v.push((
                format!("attention_coop{}_d{hd}", tile.frag),
                coop_source(tile, hd),
                vec!["main"],
            ));
        }
    }
    v
}
