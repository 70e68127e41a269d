//! The prompt GEMM: matmuls over a chunk of many tokens, where the GEMV (which reads every
//! weight once per `MM_TOKENS` tokens) would spend its time re-reading weights. Two kernels read
//! the same parameter block and weight layout as the GEMV and differ only in how they multiply:
//! - `gemm.wgsl`, the tiled fallback: workgroup-memory tiles and f32 math, no optional feature,
//!   so every adapter (lavapipe included) runs it;
//! - `gemm_coop.wgsl`, on matrix units through wgpu's experimental cooperative matrices, chosen
//!   where the adapter offers f16 × f16 → f32 fragments (16×16 on NVIDIA Vulkan, 8×8 on Apple)
//!   and one fixed subgroup size. Without them the fallback runs: nothing depends on the feature.

use super::gpu::Gpu;
use super::kernels::{type_source, MmShape, WType, MM_TOKENS};
use crate::BackendError;

pub const GEMM: &str = include_str!("shaders/gemm.wgsl");
pub const GEMM_COOP: &str = include_str!("shaders/gemm_coop.wgsl");

/// Prompt chunks of at least this many tokens take the GEMM: from here the GEMV, which reads
/// the weights once per `MM_TOKENS` tokens, would read them twice or more.
pub const GEMM_MIN_TOKENS: usize = MM_TOKENS as usize + 1;

/// Tile of one workgroup, rows by tokens, for each kernel.
const TILED_TILE: (u32, u32) = (64, 64);
const COOP_TILE: (u32, u32) = (128, 64);

/// The cooperative-matrix configuration the coop kernel is built for.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct CoopTile {
    /// Fragment size F: F×F f16 A and B, F×F f32 accumulator.
    pub frag: u32,
    /// The adapter's one subgroup size (the workgroup is four subgroups).
    pub subgroup: u32,
}

/// Which kernel a GEMM dispatch runs.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub enum GemmPath {
    Tiled,
    Coop(CoopTile),
}

impl GemmPath {
    pub fn name(self) -> String {
        match self {
            GemmPath::Tiled => "tiled (f32, workgroup memory)".into(),
            GemmPath::Coop(t) => format!(
                "cooperative matrix {f}x{f}x{f} f16->f32, subgroup {}",
                t.subgroup,
                f = t.frag
            ),
        }
    }

    fn tile(self) -> (u32, u32) {
        match self {
            GemmPath::Tiled => TILED_TILE,
            GemmPath::Coop(_) => COOP_TILE,
        }
    }

    /// The workgroups of one dispatch over `s`.
    pub fn groups(self, s: &MmShape) -> [u32; 3] {
        let (r, t) = self.tile();
        [(s.rows as u32).div_ceil(r), (s.n as u32).div_ceil(t), 1]
    }
}

/// The coop kernel's configuration on an adapter offering `props`, or `None` (then the tiled
/// fallback runs). It needs f16 in shaders, subgroups of one fixed size (`subgroup`: the
/// adapter's (min, max), `None` without the SUBGROUP feature) that divides the staging loops,
/// and square f16 × f16 → f32 fragments of 16 (preferred: NVIDIA) or 8 (Apple).
pub fn pick_coop(
    props: &[wgpu::CooperativeMatrixProperties],
    f16: bool,
    subgroup: Option<(u32, u32)>,
) -> Option<CoopTile> {
    use wgpu::CooperativeScalarType as S;
    let (lo, hi) = subgroup?;
    // Four subgroups stage 512 runs of weights and 512 vec4s of x in whole rounds.
    if !f16 || lo != hi || !(4..=128).contains(&lo) || !lo.is_power_of_two() {
        return None;
    }
    [16, 8].into_iter().find_map(|f| {
        let ok = props.iter().any(|p| {
            p.m_size == f
                && p.n_size == f
                && p.k_size == f
                && p.ab_type == S::F16
                && p.cr_type == S::F32
        });
        // A fragment must have at least one element per lane for the store loop to cover it.
        (ok && f * f >= lo).then_some(CoopTile {
            frag: f,
            subgroup: lo,
        })
    })
}

/// The tiled GEMM for weights of type `t` (types.wgsl's reader of `t`, then the kernel).
pub fn gemm_source(t: WType) -> String {
    format!("{}\n{GEMM}", type_source(t))
}

/// The coop GEMM for weights of type `t` on `tile`: the template with its sizes and unrolled
/// fragment code filled in. Each subgroup holds (32 / F) × (64 / F) accumulators.
pub fn coop_source(t: WType, tile: CoopTile) -> String {
    let f = tile.frag;
    let mat = format!("coop_mat{f}x{f}");
    let (ft, fr) = (32 / f, 64 / f);
    let mut acc = String::new();
    let mut mma = String::new();
    let mut store = String::new();
    for a in 0..ft {
        mma += &format!(
            "            let ia{a} = (st * 32u + {o}u) * ld + kk;\n            \
             let fa{a} = coopLoadT<{mat}<f16, A>>(&xs[ia{a}], ld);\n",
            o = a * f
        );
    }
    for b in 0..fr {
        mma += &format!(
            "            let ib{b} = (sr * 64u + {o}u) * ld + kk;\n            \
             let fb{b} = coopLoad<{mat}<f16, B>>(&ws[ib{b}], ld);\n",
            o = b * f
        );
    }
    for a in 0..ft {
        for b in 0..fr {
            acc += &format!("    var c{a}_{b} = {mat}<f32, C>();\n");
            mma += &format!("            c{a}_{b} = coopMultiplyAdd(fa{a}, fb{b}, c{a}_{b});\n");
            store += &format!(
                "    coopStoreT(c{a}_{b}, &cs[scratch], f);\n    workgroupBarrier();\n    \
                 put(scratch, t0 + st * 32u + {ot}u, r0 + sr * 64u + {or}u, lane);\n    \
                 workgroupBarrier();\n",
                ot = a * f,
                or = b * f
            );
        }
    }
    let body = GEMM_COOP
        .replace("SG_SIZE", &tile.subgroup.to_string())
        .replace("WG_SIZE", &(4 * tile.subgroup).to_string())
        .replace("FRAG", &f.to_string())
        .replace("//@acc\n", &acc)
        .replace("//@mma\n", &mma)
        .replace("//@store\n", &store);
    // The `enable` directives open the module: the type's reader comes after the kernel.
    format!("{body}\n{}", type_source(t))
}

/// The coop configurations the naga test and the source list cover even where no adapter here
/// has matrix units: NVIDIA's (16×16, subgroup 32) and Apple's (8×8, subgroup 32).
pub const COOP_CHECKED: [CoopTile; 2] = [
    CoopTile {
        frag: 16,
        subgroup: 32,
    },
    CoopTile {
        frag: 8,
        subgroup: 32,
    },
];

/// The coop kernel's sources for the configurations of [`COOP_CHECKED`], each with its name and
/// entry point, for the naga checks (which must grant f16, subgroups and cooperative matrices).
pub fn coop_sources() -> Vec<(String, String, Vec<&'static str>)> {
    let mut v = Vec::new();
    for tile in COOP_CHECKED {
        for t in WType::ALL {
            v.push((
                format!("gemm_coop{}_{}", tile.frag, t.name()),
                coop_source(t, tile),
                vec!["gemm"],
            ));
        }
    }
    v
}

/// The GEMM pipelines of a device: the tiled fallback always, the coop kernel where the device
/// was opened with it (`Gpu::coop`).
pub struct GemmKernels {
    tiled: Vec<wgpu::ComputePipeline>,
    coop: Option<(CoopTile, Vec<wgpu::ComputePipeline>)>,
}

impl GemmKernels {
    pub fn new(gpu: &Gpu) -> Result<GemmKernels, BackendError> {
        let mut tiled = Vec::new();
        for t in WType::ALL {
            let name = format!("gemm_{}", t.name());
            tiled.push(gpu.pipeline(&name, &gemm_source(t), "gemm")?);
        }
        let coop_pipes = |tile: CoopTile| -> Result<Vec<_>, BackendError> {
            WType::ALL
                .iter()
                .map(|&t| {
                    let name = format!("gemm_coop_{}", t.name());
                    gpu.pipeline(&name, &coop_source(t, tile), "gemm")
                })
                .collect()
        };
        // The feature is experimental in wgpu: a driver that refuses the kernel costs speed,
        // not the run (and says so).
        let coop = gpu.coop.and_then(|tile| match coop_pipes(tile) {
            Ok(v) => Some((tile, v)),
            Err(e) => {
                eprintln!(
                    "quire: the cooperative-matrix GEMM does not compile on {}; prompts use \
                     the tiled GEMM ({e})",
                    gpu.info.name
                );
                None
            }
        });
        Ok(GemmKernels { tiled, coop })
    }

    /// The fastest path this device has.
    pub fn best(&self) -> GemmPath {
        self.coop
            .as_ref()
            .map_or(GemmPath::Tiled, |(t, _)| GemmPath::Coop(*t))
    }

    /// Every path this device has (the tiled one first).
    pub fn paths(&self) -> Vec<GemmPath> {
        let mut v = vec![GemmPath::Tiled];
        v.extend(self.coop.as_ref().map(|(t, _)| GemmPath::Coop(*t)));
        v
    }

    /// The pipeline of `path` for weights of type `t`; `None` if the device lacks the path.
    pub fn pipe(&self, path: GemmPath, t: WType) -> Option<&wgpu::ComputePipeline> {
        let i = WType::ALL.iter().position(|&x| x == t)?;
        match path {
            GemmPath::Tiled => self.tiled.get(i),
            GemmPath::Coop(tile) => match &self.coop {
                Some((have, v)) if *have == tile => v.get(i),
                _ => None,
            },
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use wgpu::CooperativeMatrixProperties as Props;
    use wgpu::CooperativeScalarType as S;

    fn prop(m: u32, n: u32, k: u32, ab: S, cr: S) -> Props {
        Props {
            m_size: m,
            n_size: n,
            k_size: k,
            ab_type: ab,
            cr_type: cr,
            saturating_accumulation: false,
        }
    }

    #[test]
    fn coop_is_picked_only_where_the_adapter_has_what_the_kernel_needs() {
        // The H100's list through NVIDIA's Vulkan driver (measured, ../shared/notes/wgpu.md).
        let h100 = [
            prop(16, 16, 16, S::F16, S::F16),
            prop(16, 16, 16, S::F16, S::F32),
            prop(16, 8, 16, S::F16, S::F32),
            prop(16, 8, 8, S::F16, S::F32),
        ];
        let sg32 = Some((32, 32));
        assert_eq!(
            pick_coop(&h100, true, sg32),
            Some(CoopTile {
                frag: 16,
                subgroup: 32
            })
        );
        // Apple: 8x8 only.
        let apple = [prop(8, 8, 8, S::F32, S::F32), prop(8, 8, 8, S::F16, S::F32)];
        assert_eq!(
            pick_coop(&apple, true, sg32),
            Some(CoopTile {
                frag: 8,
                subgroup: 32
            })
        );
        // No f16 -> f32 square fragment, no f16, no subgroups, a varying subgroup size, or a
        // subgroup wider than an 8x8 fragment: the fallback.
        assert_eq!(
            pick_coop(&[prop(8, 8, 8, S::F32, S::F32)], true, sg32),
            None
        );
        assert_eq!(
            pick_coop(&[prop(16, 16, 16, S::F16, S::F16)], true, sg32),
            None
        );
        assert_eq!(
            pick_coop(&[prop(16, 8, 16, S::F16, S::F32)], true, sg32),
            None
        );
        assert_eq!(pick_coop(&h100, false, sg32), None);
        assert_eq!(pick_coop(&h100, true, None), None);
        assert_eq!(pick_coop(&h100, true, Some((32, 64))), None);
        assert_eq!(pick_coop(&[], true, sg32), None);
        assert_eq!(pick_coop(&apple, true, Some((128, 128))), None);
        assert_eq!(
            pick_coop(&h100, true, Some((64, 64))),
            Some(CoopTile {
                frag: 16,
                subgroup: 64
            })
        );
    }

    #[test]
    fn coop_source_unrolls_one_accumulator_per_fragment() {
        for (tile, accs) in [(COOP_CHECKED[0], 8), (COOP_CHECKED[1], 32)] {
            let src = coop_source(WType::Q4_0, tile);
            let f = tile.frag;
            assert_eq!(
                src.matches(&format!("= coop_mat{f}x{f}<f32, C>()")).count(),
                accs
            );
            assert_eq!(src.matches("coopMultiplyAdd(").count(), accs);
            assert_eq!(src.matches("coopStoreT(").count(), accs);
            for left in ["//@acc", "//@mma", "//@store", "SG_SIZE", "WG_SIZE", "FRAG"] {
                assert!(!src.contains(left), "placeholder {left} left");
            }
            assert!(src.contains(&format!("@workgroup_size({})", 4 * tile.subgroup)));
        }
    }

    #[test]
    fn groups_cover_every_row_and_token() {
        let s = MmShape {
            rows: 4097,
            cols: 4096,
            n: 65,
            x_stride: 4096,
            y_stride: 4097,
            y_off: 0,
            add: false,
            row_words: 0,
            row0: 0,
        };
        assert_eq!(GemmPath::Tiled.groups(&s), [65, 2, 1]);
        assert_eq!(GemmPath::Coop(COOP_CHECKED[0]).groups(&s), [33, 2, 1]);
    }
}
