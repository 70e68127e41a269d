//! The prompt GEMM: matmuls over a chunk of many tokens, where the GEMV (which reads every
//! weight once per `MM_TOKENS` tokens) would spend its time re-reading weights. Two kernels read
//! the same parameter block and weight layout as the GEMV and differ only in how they multiply:
//! - `gemm.wgsl`, the tiled fallback: workgroup-memory tiles and f32 math, no optional feature,
//!   so every adapter (lavapipe included) runs it;
//! - `gemm_coop.wgsl`, on matrix units through wgpu's experimental cooperative matrices, chosen
//!   where the adapter offers f16 × f16 → f32 fragments (16×16 on NVIDIA Vulkan, 8×8 on Apple)
//!   and one fixed subgroup size. Without them the fallback runs: nothing depends on the feature.

use super::gpu::Gpu;
use super::kernels::{type_source, MmShape, Params, WType, MM_TOKENS};
use crate::BackendError;

pub const GEMM: &str = include_str!("shaders/gemm.wgsl");
pub const GEMM_COOP: &str = include_str!("shaders/gemm_coop.wgsl");
pub const GEMM_REDUCE: &str = include_str!("shaders/gemm_reduce.wgsl");

/// Prompt chunks of at least this many tokens take the GEMM: from here the GEMV, which reads
/// the weights once per `MM_TOKENS` tokens, would read them twice or more.
pub const GEMM_MIN_TOKENS: usize = MM_TOKENS as usize + 1;

/// Workgroups a dispatch should have to keep a large GPU busy (an H100 or H200 has 132 SMs,
/// each holding two or more of these workgroups). A dispatch with fewer row and token tiles
/// (a short batch, a narrow matrix) is split over its columns until it has about this many.
const FILL_GROUPS: u32 = 256;
/// Steps each slice of a split keeps at least: a slice's fixed costs are its stores and its
/// share of the reduce.
const MIN_SLICE_STEPS: u32 = 8;
const MAX_SLICES: u32 = 8;

/// A workgroup's tile, weight rows by tokens, and the columns it stages per step.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Blocking {
    pub rows: u32,
    pub tokens: u32,
    pub k: u32,
}

impl Blocking {
    const fn new(rows: u32, tokens: u32, k: u32) -> Blocking {
        Blocking { rows, tokens, k }
    }

    /// Workgroup memory of the coop kernel with F × F fragments: the two staged slices (f16,
    /// rows of k + 8) and a fragment of f32 per subgroup.
    pub fn coop_bytes(self, frag: u32) -> u32 {
        (self.rows + self.tokens) * (self.k + 8) * 2 + 4 * frag * frag * 4
    }

    pub fn name(self) -> String {
        format!("{}x{}x{}", self.rows, self.tokens, self.k)
    }
}

/// The tiled kernel's one blocking (gemm.wgsl's constants).
const TILED: Blocking = Blocking::new(64, 64, 32);

/// The coop kernel's blockings (rows × tokens per workgroup, columns per step). Each
/// subgroup's quarter, (rows / 2) × (tokens / 2), must be whole fragments (of 16 on NVIDIA).
/// `wgpu_gemm_bench` times them all; on an H200 through Vulkan (PERF.md) 128 × 128 × 32 is the
/// fastest for 512-token prompts on every Llama-3-8B shape (72–106 TFLOP/s against 52–72 for
/// 128 × 64 × 32), and 128 × 64 × 32, split over columns, for 64 tokens; staging 64 columns per
/// step was slower in every tile.
pub const BLOCKINGS: [Blocking; 5] = [
    Blocking::new(128, 64, 32),
    Blocking::new(128, 128, 32),
    Blocking::new(128, 64, 64),
    Blocking::new(64, 64, 64),
    Blocking::new(64, 32, 64),
];

/// The blockings the engine's [`GemmKernels::choose`] picks from: short batches, and prompts.
const ENGINE_BLOCKINGS: [Blocking; 2] = [Blocking::new(128, 64, 32), Blocking::new(128, 128, 32)];

/// From this many tokens the engine takes the 128-token tile (below it, half of it or more
/// would be padding).
const WIDE_TILE_TOKENS: usize = 128;

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
    Coop(CoopTile, Blocking),
}

impl GemmPath {
    pub fn name(self) -> String {
        match self {
            GemmPath::Tiled => "tiled (f32, workgroup memory)".into(),
            GemmPath::Coop(t, b) => format!(
                "coop {f}x{f}x{f} f16->f32 sg{}, {}",
                t.subgroup,
                b.name(),
                f = t.frag
            ),
        }
    }

    pub fn blocking(self) -> Blocking {
        match self {
            GemmPath::Tiled => TILED,
            GemmPath::Coop(_, b) => b,
        }
    }

    /// The row and token tiles of a dispatch over `s` (one slice of the columns each).
    fn tiles(self, s: &MmShape) -> (u32, u32) {
        let b = self.blocking();
        (
            (s.rows as u32).div_ceil(b.rows),
            (s.n as u32).div_ceil(b.tokens),
        )
    }

    /// How the columns of a dispatch over `s` with weights of type `t` are split.
    pub fn split(self, t: WType, s: &MmShape) -> Split {
        let (gx, gy) = self.tiles(s);
        let per = self.blocking().k / t.unit_cols() as u32;
        let units = (s.cols / t.unit_cols()) as u32;
        let steps = units.div_ceil(per);
        let want = FILL_GROUPS.div_ceil((gx * gy).max(1));
        let slices = want.min(steps / MIN_SLICE_STEPS).min(MAX_SLICES);
        if slices <= 1 {
            return Split::NONE;
        }
        let steps_per = steps.div_ceil(slices);
        Split {
            slices: steps.div_ceil(steps_per),
            units: steps_per * per,
        }
    }

    /// The workgroups of one dispatch over `s` split as `split`.
    pub fn groups(self, s: &MmShape, split: Split) -> [u32; 3] {
        let (gx, gy) = self.tiles(s);
        [gx, gy, split.slices]
    }
}

/// A GEMM's split over columns: `slices` workgroups along z, each taking `units` units of every
/// row, whose partial sums the reduce kernel adds. `slices == 1`: no split.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Split {
    pub slices: u32,
    pub units: u32,
}

impl Split {
    pub const NONE: Split = Split {
        slices: 1,
        units: 0,
    };

    pub fn is_split(self) -> bool {
        self.slices > 1
    }

    /// The GEMM kernel's parameters for `s`.
    pub fn params(self, s: &MmShape) -> Params {
        let mut p = s.params();
        p[9] = if self.is_split() { self.units } else { 0 };
        p
    }

    /// The reduce kernel's parameters and grid for `s`.
    pub fn reduce(self, s: &MmShape) -> (Params, [u32; 3]) {
        let mut p = [0u32; 16];
        p[..6].copy_from_slice(&[
            s.rows as u32,
            s.n as u32,
            s.y_stride as u32,
            s.y_off as u32,
            s.add as u32,
            self.slices,
        ]);
        (p, [(s.rows as u32).div_ceil(256), s.n as u32, 1])
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

/// The coop GEMM for weights of type `t` on `tile` with blocking `b`: the template with its
/// sizes and unrolled fragment code filled in. Each subgroup holds (b.tokens / 2F) ×
/// (b.rows / 2F) accumulators.
pub fn coop_source(t: WType, tile: CoopTile, b: Blocking) -> String {
    let f = tile.frag;
    let mat = format!("coop_mat{f}x{f}");
    let (ts, rs) = (b.tokens / 2, b.rows / 2);
    let (ft, fr) = (ts / f, rs / f);
    let mut acc = String::new();
    let mut mma = String::new();
    let mut store = String::new();
    for a in 0..ft {
        mma += &format!(
            "            let ia{a} = (st * {ts}u + {o}u) * ld + kk;\n            \
             let fa{a} = coopLoadT<{mat}<f16, A>>(&xs[ia{a}], ld);\n",
            o = a * f
        );
    }
    for c in 0..fr {
        mma += &format!(
            "            let ib{c} = (sr * {rs}u + {o}u) * ld + kk;\n            \
             let fb{c} = coopLoad<{mat}<f16, B>>(&ws[ib{c}], ld);\n",
            o = c * f
        );
    }
    for a in 0..ft {
        for c in 0..fr {
            acc += &format!("    var c{a}_{c} = {mat}<f32, C>();\n");
            mma += &format!("            c{a}_{c} = coopMultiplyAdd(fa{a}, fb{c}, c{a}_{c});\n");
            store += &format!(
                "    coopStoreT(c{a}_{c}, &cs[scratch], f);\n    workgroupBarrier();\n    \
                 put(scratch, t0 + st * {ts}u + {ot}u, r0 + sr * {rs}u + {or}u, lane, wg.z);\n    \
                 workgroupBarrier();\n",
                ot = a * f,
                or = c * f
            );
        }
    }
    let ld = b.k + 8;
    let body = GEMM_COOP
        .replace("SG_SIZE", &tile.subgroup.to_string())
        .replace("WG_SIZE", &(4 * tile.subgroup).to_string())
        .replace("FRAG", &f.to_string())
        .replace("BR_SIZE", &b.rows.to_string())
        .replace("BT_SIZE", &b.tokens.to_string())
        .replace("BK_SIZE", &b.k.to_string())
        .replace("WS_LEN", &(b.rows * ld).to_string())
        .replace("XS_LEN", &(b.tokens * ld).to_string())
        .replace("CS_LEN", &(4 * f * f).to_string())
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

/// The coop kernel's sources for the configurations of [`COOP_CHECKED`] and every blocking,
/// each with its name and entry point, for the naga checks (which must grant f16, subgroups and
/// cooperative matrices).
pub fn coop_sources() -> Vec<(String, String, Vec<&'static str>)> {
    let mut v = Vec::new();
    for tile in COOP_CHECKED {
        for b in BLOCKINGS {
            for t in WType::ALL {
                v.push((
                    format!("gemm_coop{}_{}_{}", tile.frag, b.name(), t.name()),
                    coop_source(t, tile, b),
                    vec!["gemm"],
                ));
            }
        }
    }
    v
}

/// The coop kernels of one blocking, a pipeline per weight type.
type CoopPipes = Vec<(Blocking, Vec<wgpu::ComputePipeline>)>;

/// The GEMM pipelines of a device: the tiled fallback always, the coop kernel where the device
/// was opened with it (`Gpu::coop`), and the reduce of a split.
pub struct GemmKernels {
    tiled: Vec<wgpu::ComputePipeline>,
    coop: Option<(CoopTile, CoopPipes)>,
    pub reduce: wgpu::ComputePipeline,
}

impl GemmKernels {
    /// The pipelines the engine runs: the blockings [`GemmKernels::choose`] can pick.
    pub fn new(gpu: &Gpu) -> Result<GemmKernels, BackendError> {
        GemmKernels::with_blockings(gpu, &ENGINE_BLOCKINGS)
    }

    /// The pipelines of every blocking that fits the device (benchmarks and tests).
    pub fn all(gpu: &Gpu) -> Result<GemmKernels, BackendError> {
        GemmKernels::with_blockings(gpu, &BLOCKINGS)
    }

    fn with_blockings(gpu: &Gpu, blockings: &[Blocking]) -> Result<GemmKernels, BackendError> {
        let mut tiled = Vec::new();
        for t in WType::ALL {
            let name = format!("gemm_{}", t.name());
            tiled.push(gpu.pipeline(&name, &gemm_source(t), "gemm")?);
        }
        let room = gpu.limits.max_compute_workgroup_storage_size;
        let coop_pipes = |tile: CoopTile| -> Result<CoopPipes, BackendError> {
            let mut v = Vec::new();
            for &b in blockings.iter().filter(|b| b.coop_bytes(tile.frag) <= room) {
                let pipes = WType::ALL
                    .iter()
                    .map(|&t| {
                        let name = format!("gemm_coop_{}_{}", b.name(), t.name());
                        gpu.pipeline(&name, &coop_source(t, tile, b), "gemm")
                    })
                    .collect::<Result<_, _>>()?;
                v.push((b, pipes));
            }
            Ok(v)
        };
        // The feature is experimental in wgpu: a driver that refuses the kernel costs speed,
        // not the run (and says so).
        let coop = gpu.coop.and_then(|tile| match coop_pipes(tile) {
            Ok(v) if !v.is_empty() => Some((tile, v)),
            Ok(_) => None,
            Err(e) => {
                eprintln!(
                    "quire: the cooperative-matrix GEMM does not compile on {}; prompts use \
                     the tiled GEMM ({e})",
                    gpu.info.name
                );
                None
            }
        });
        Ok(GemmKernels {
            tiled,
            coop,
            reduce: gpu.pipeline("gemm_reduce", GEMM_REDUCE, "main")?,
        })
    }

    /// The path the engine takes for weights of type `t` over `s`: the coop kernel where the
    /// device has it, with the blocking that suits the shape (measured on an H200 through
    /// Vulkan, PERF.md), else the tiled kernel.
    pub fn choose(&self, _t: WType, s: &MmShape) -> GemmPath {
        let Some((tile, have)) = &self.coop else {
            return GemmPath::Tiled;
        };
        let want = ENGINE_BLOCKINGS[(s.n >= WIDE_TILE_TOKENS) as usize];
        let b = have
            .iter()
            .map(|(b, _)| *b)
            .find(|&b| b == want)
            .unwrap_or(have[0].0);
        GemmPath::Coop(*tile, b)
    }

    /// Every path this device has (the tiled one first).
    pub fn paths(&self) -> Vec<GemmPath> {
        let mut v = vec![GemmPath::Tiled];
        if let Some((tile, have)) = &self.coop {
            v.extend(have.iter().map(|(b, _)| GemmPath::Coop(*tile, *b)));
        }
        v
    }

    /// The pipeline of `path` for weights of type `t`; `None` if the device lacks the path.
    pub fn pipe(&self, path: GemmPath, t: WType) -> Option<&wgpu::ComputePipeline> {
        let i = WType::ALL.iter().position(|&x| x == t)?;
        match path {
            GemmPath::Tiled => self.tiled.get(i),
            GemmPath::Coop(tile, b) => match &self.coop {
                Some((have, v)) if *have == tile => {
                    v.iter().find(|(x, _)| *x == b).and_then(|(_, p)| p.get(i))
                }
                _ => None,
            },
        }
    }

    /// The index of `path` among [`GemmKernels::paths`] (bind groups are kept per path: each
    /// pipeline's layout is its own).
    /// Asked for every GEMM dispatch a step records, so it builds no list.
    pub fn index(&self, path: GemmPath) -> u8 {
        match (path, &self.coop) {
            (GemmPath::Coop(_, b), Some((_, have))) => {
                1 + have.iter().position(|(x, _)| *x == b).unwrap_or(0) as u8
            }
            _ => 0,
        }
    }

    /// Floats of the partial sums any split dispatch of this device writes, at most: a split
    /// has fewer than [`FILL_GROUPS`] tiles before it and fewer than twice that after, so its
    /// partials are fewer than 2 · FILL_GROUPS tiles of the largest blocking.
    pub fn scratch_floats(&self) -> usize {
        let tile = self
            .paths()
            .iter()
            .map(|p| {
                let b = p.blocking();
                (b.rows * b.tokens) as usize
            })
            .max()
            .unwrap_or(0);
        2 * FILL_GROUPS as usize * tile
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
        let b = BLOCKINGS[0];
        for (tile, accs) in [(COOP_CHECKED[0], 8), (COOP_CHECKED[1], 32)] {
            let src = coop_source(WType::Q4_0, tile, b);
            let f = tile.frag;
            assert_eq!(
                src.matches(&format!("= coop_mat{f}x{f}<f32, C>()")).count(),
                accs
            );
            assert_eq!(src.matches("coopMultiplyAdd(").count(), accs);
            assert_eq!(src.matches("coopStoreT(").count(), accs);
            for left in [
                "//@acc", "//@mma", "//@store", "SG_SIZE", "WG_SIZE", "FRAG", "BR_SIZE", "BT_SIZE",
                "BK_SIZE", "WS_LEN", "XS_LEN", "CS_LEN",
            ] {
                assert!(!src.contains(left), "placeholder {left} left");
            }
            assert!(src.contains(&format!("@workgroup_size({})", 4 * tile.subgroup)));
        }
        // A 128 x 128 tile: 64 x 64 per subgroup, 4 x 4 fragments of 16.
        let src = coop_source(WType::F16, COOP_CHECKED[0], Blocking::new(128, 128, 32));
        assert_eq!(src.matches("coopMultiplyAdd(").count(), 16);
    }

    #[test]
    fn every_blocking_is_whole_fragments_per_subgroup_and_whole_steps_per_unit() {
        for b in BLOCKINGS {
            for tile in COOP_CHECKED {
                assert_eq!((b.rows / 2) % tile.frag, 0, "{}", b.name());
                assert_eq!((b.tokens / 2) % tile.frag, 0, "{}", b.name());
                assert_eq!(b.k % tile.frag, 0, "{}", b.name());
            }
            for t in WType::ALL {
                assert_eq!(b.k as usize % t.unit_cols(), 0, "{} {}", b.name(), t.name());
            }
            // NVIDIA's Vulkan driver offers 48 KiB of workgroup memory.
            assert!(b.coop_bytes(16) <= 48 << 10, "{}", b.name());
        }
    }

    fn shape(rows: usize, cols: usize, n: usize) -> MmShape {
        MmShape::dense(rows, cols, n)
    }

    #[test]
    fn groups_cover_every_row_and_token() {
        let s = shape(4097, 4096, 65);
        assert_eq!(GemmPath::Tiled.groups(&s, Split::NONE), [65, 2, 1]);
        let coop = GemmPath::Coop(COOP_CHECKED[0], BLOCKINGS[0]);
        assert_eq!(coop.groups(&s, Split::NONE), [33, 2, 1]);
    }

    #[test]
    fn a_split_covers_every_unit_once_and_only_where_tiles_are_few() {
        let coop = |b| GemmPath::Coop(COOP_CHECKED[0], b);
        for path in [
            GemmPath::Tiled,
            coop(BLOCKINGS[0]),
            coop(BLOCKINGS[1]),
            coop(BLOCKINGS[4]),
        ] {
            for t in WType::ALL {
                for (rows, cols, n) in [
                    (4096, 14336, 64),
                    (4096, 4096, 512),
                    (28672, 4096, 512),
                    (67, 136, 17),
                    (5, 4096, 9),
                    (200, 256, 129),
                ] {
                    let cols = cols / t.unit_cols() * t.unit_cols();
                    let s = shape(rows, cols, n);
                    let sp = path.split(t, &s);
                    let [gx, gy, gz] = path.groups(&s, sp);
                    assert_eq!(gz, sp.slices);
                    let units = (cols / t.unit_cols()) as u32;
                    if !sp.is_split() {
                        assert_eq!(sp.params(&s)[9], 0);
                        continue;
                    }
                    assert!(gx * gy < FILL_GROUPS, "split with {} tiles", gx * gy);
                    assert!(sp.slices <= MAX_SLICES);
                    let per = path.blocking().k / t.unit_cols() as u32;
                    assert_eq!(sp.units % per, 0, "slices start on whole steps");
                    // Slices [z u, (z + 1) u) cover 0..units, none empty.
                    assert!((sp.slices - 1) * sp.units < units);
                    assert!(sp.slices * sp.units >= units);
                    let floats = sp.slices as usize * n * rows;
                    let b = path.blocking();
                    let bound = 2 * FILL_GROUPS as usize * (b.rows * b.tokens) as usize;
                    assert!(floats <= bound, "{floats} > {bound}");
                }
            }
        }
        // The 8B's down projection over 64 tokens splits; a 512-token prompt's does not.
        let down = shape(4096, 14336, 64);
        assert!(coop(BLOCKINGS[0]).split(WType::F16, &down).slices >= 4);
        let down = shape(4096, 14336, 512);
        assert!(!coop(BLOCKINGS[0]).split(WType::F16, &down).is_split());
    }
}
