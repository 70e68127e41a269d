//! The decode GEMV's designs. Decoding one token reads every weight once, so its matmuls are a
//! stream of the weights and should run at the adapter's read bandwidth; on the H100 through
//! Vulkan the multi-token kernel read 4-bit weights at 0.15-0.2 TB/s of the 3 TB/s measured, bound
//! by what goes with each load (activation cache lines, dequantization) rather than by memory.
//! The one-token slot kernel (matmul.wgsl's `//! SLOT`) is the alternative; its rows per
//! workgroup and workgroup size are parameters, so wgpu_gemv_bench can time several shapes of it
//! beside the multi-token kernel on one adapter; [`Gemv::engine`] is the engine's choice by type.

use super::gpu::Gpu;
use super::kernels::{matmul_source, section, type_source, MmShape, WType, MATMUL};
use crate::BackendError;

/// A decode GEMV design: the multi-token kernel (matmul.wgsl's `gemv`: 16 rows per workgroup of
/// 256 invocations, a subgroup per pair of rows, each invocation a 16-byte unit of both, up to 8
/// tokens per read of the weights), or the one-token slot kernel (`gemv_slot`: `rows` rows per
/// workgroup of `wg` invocations that all stride over those rows' 8-value slots). The engine runs
/// the multi-token kernel for 2..8 tokens and [`Gemv::engine`] of the weight type for one;
/// wgpu_gemv_bench times any of them. `Unit` is the one-token kernel of gemv_q.wgsl for the
/// 4-, 5- and 6-bit types ([`super::gemv_q`]: a whole 16-byte unit per invocation, little arithmetic per
/// value), with the slot kernel's grid and reductions; the engine runs it for the K-quants.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum Gemv {
    Multi,
    Slot { rows: u32, wg: u32 },
    Unit { rows: u32, wg: u32 },
}

impl Gemv {
    /// The slot design the engine runs where it runs one (see [`Gemv::engine`]).
    pub const SLOT: Gemv = Gemv::Slot { rows: 4, wg: 256 };
    /// The unit design the engine runs for the K-quants (see [`Gemv::engine`]).
    pub const UNIT: Gemv = Gemv::Unit { rows: 4, wg: 64 };

    /// The one-token design the engine runs for weights of type `t`. Measured with
    /// wgpu_gemv_bench through Vulkan over Llama-3-8B's decode shapes (PERF.md, "wgpu one-token
    /// GEMV by type" and "wgpu unit GEMV for the K-quants"): the unit kernel (4 rows per 64
    /// invocations) is ahead for Q4_K, Q5_K and Q6_K (1.6-2x the slot kernel on 128256 x 4096);
    /// the slot kernel (4 rows per 256 invocations) for F16 on every shape and for Q4_0 on all but
    /// 4096 x 4096 (Q4_1 follows Q4_0, not measured); the multi-token kernel for Q8_0.
    pub fn engine(t: WType) -> Gemv {
        match t {
            WType::F16 | WType::Q4_0 | WType::Q4_1 => Gemv::SLOT,
            WType::Q4_K | WType::Q5_K | WType::Q6_K => Gemv::UNIT,
            WType::Q8_0 => Gemv::Multi,
        }
    }
    /// The designs wgpu_gemv_bench offers by default (and the tests check).
    pub const CANDIDATES: [Gemv; 4] = [
        Gemv::Multi,
        Gemv::Slot { rows: 2, wg: 128 },
        Gemv::Slot { rows: 4, wg: 128 },
        Gemv::Slot { rows: 8, wg: 256 },
    ];

    /// Whether the design has a form for weights of type `t` (the unit kernel only for the
    /// types [`super::gemv_q::supports`] names).
    pub fn supports(self, t: WType) -> bool {
        match self {
            Gemv::Unit { .. } => super::gemv_q::supports(t),
            _ => true,
        }
    }

    /// Unit-kernel designs the tests check and the translation test compiles (the bench takes
    /// any `uRwW`).
    pub const UNITS: [Gemv; 4] = [
        Gemv::Unit { rows: 2, wg: 64 },
        Gemv::Unit { rows: 4, wg: 64 },
        Gemv::Unit { rows: 4, wg: 128 },
        Gemv::Unit { rows: 8, wg: 128 },
    ];

    /// `multi`, or `rRwW` (the slot kernel) or `uRwW` (the unit kernel) with R rows of 1, 2, 4, 8
    /// per workgroup of W = 32, 64, 128, 256 invocations, e.g. `r4w128`, `u4w64`.
    pub fn parse(s: &str) -> Result<Gemv, String> {
        let bad = || {
            format!(
                "GEMV variant {s:?}: expected `multi`, rRwW or uRwW with R in 1, 2, 4, 8 and W \
                 in 32, 64, 128, 256 (e.g. r4w128)"
            )
        };
        if s == "multi" {
            return Ok(Gemv::Multi);
        }
        let (unit, rest) = match (s.strip_prefix('r'), s.strip_prefix('u')) {
            (Some(t), _) => (false, t),
            (_, Some(t)) => (true, t),
            _ => return Err(bad()),
        };
        let (r, w) = rest.split_once('w').ok_or_else(bad)?;
        let rows: u32 = r.parse().map_err(|_| bad())?;
        let wg: u32 = w.parse().map_err(|_| bad())?;
        if ![1, 2, 4, 8].contains(&rows) || ![32, 64, 128, 256].contains(&wg) {
            return Err(bad());
        }
        Ok(if unit {
            Gemv::Unit { rows, wg }
        } else {
            Gemv::Slot { rows, wg }
        })
    }

    pub fn name(self) -> String {
        match self {
            Gemv::Multi => "multi".into(),
            Gemv::Slot { rows, wg } => format!("r{rows}w{wg}"),
            Gemv::Unit { rows, wg } => format!("u{rows}w{wg}"),
        }
    }

    /// The kernel's entry point.
    pub fn entry(self) -> &'static str {
        match self {
            Gemv::Multi => "gemv",
            Gemv::Slot { .. } | Gemv::Unit { .. } => "gemv_slot",
        }
    }

    /// The module for weights of type `t`, summing through subgroups or workgroup memory,
    /// reading its activations and writing its rows as `input` says. Panics for a type the
    /// design does not support ([`Gemv::supports`]), and for the multi-token kernel with a
    /// fused norm (only the one-token designs have one).
    pub fn source(self, t: WType, subgroup: bool, input: GemvIn) -> String {
        match self {
            Gemv::Multi => match input {
                GemvIn::Plain | GemvIn::Swiglu => {
                    matmul_source(t, subgroup, input == GemvIn::Swiglu)
                }
                _ => panic!("the multi-token GEMV has no fused norm"),
            },
            Gemv::Unit { rows, wg } => super::gemv_q::source(t, rows, wg, subgroup, input),
            Gemv::Slot { rows, wg } => {
                let (_, slot) = section(MATMUL, "SLOT");
                slot_module(t, rows, wg, subgroup, input, slot)
            }
        }
    }

    /// The grid for shape `s`: the multi-token kernel's, or a workgroup per `rows` rows (folded
    /// into y past [`SLOT_FOLD`] workgroups) and a token per z.
    pub fn groups(self, s: &MmShape) -> [u32; 3] {
        match self {
            Gemv::Multi => s.matmul_groups(),
            Gemv::Slot { rows, .. } | Gemv::Unit { rows, .. } => {
                let blocks = (s.rows as u32).div_ceil(rows).max(1);
                [
                    blocks.min(SLOT_FOLD),
                    blocks.div_ceil(SLOT_FOLD),
                    s.n as u32,
                ]
            }
        }
    }
}

/// How a one-token GEMV reads its activations and writes its rows (matmul.wgsl's `//! X_*` and
/// `//! OUT_*` sections). The fused forms save a decode step's small dispatches, each of which
/// costs a pipeline barrier and a launch on top of its work (microseconds on NVIDIA's Vulkan
/// driver, with the work itself well under that).
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
pub enum GemvIn {
    /// The activations as stored.
    Plain,
    /// [gate | up] rows of twice the columns, read as silu(gate) · up (the down projection).
    Swiglu,
    /// The residual stream, read as RMSNorm(x) · g, g (the norm's weight) at binding 5, the
    /// epsilon in the parameters (the norm before the QKV and gate/up projections, and the
    /// output's of a one-row step).
    Norm,
    /// `Norm`, and RoPE (adjacent pairs) of the output's Q and K rows with the (cos, sin) table at
    /// binding 6: the whole QKV projection of a Llama decode step in one dispatch.
    NormRope,
}

impl GemvIn {
    pub const ALL: [GemvIn; 4] = [
        GemvIn::Plain,
        GemvIn::Swiglu,
        GemvIn::Norm,
        GemvIn::NormRope,
    ];

    /// The name's part for this form ("" for plain).
    pub fn infix(self) -> &'static str {
        match self {
            GemvIn::Plain => "",
            GemvIn::Swiglu => "swiglu_",
            GemvIn::Norm => "norm_",
            GemvIn::NormRope => "norm_rope_",
        }
    }

    /// Columns of x each output row reads, as a multiple of the weights' columns.
    pub fn x_cols(self) -> usize {
        1 + (self == GemvIn::Swiglu) as usize
    }
}

/// A module on the slot kernel's grid: `rows` rows per workgroup of `wg` invocations, the weight
/// type's helpers, matmul.wgsl's slot core, `kernel` (the loop over a row block), the row sums
/// through subgroups or workgroup memory, the activation reader and the row writer of `input`.
pub(super) fn slot_module(
    t: WType,
    rows: u32,
    wg: u32,
    subgroup: bool,
    input: GemvIn,
    kernel: &str,
) -> String {
    let (core, _) = section(MATMUL, "SLOT");
    let reduce_name = if subgroup {
        "SLOT_SUBGROUP"
    } else {
        "SLOT_SHARED"
    };
    let (_, reduce) = section(MATMUL, reduce_name);
    let (xs, outs) = match input {
        GemvIn::Plain => ("X_PLAIN", "OUT_PLAIN"),
        GemvIn::Swiglu => ("X_SWIGLU", "OUT_PLAIN"),
        GemvIn::Norm => ("X_NORM", "OUT_PLAIN"),
        GemvIn::NormRope => ("X_NORM", "OUT_ROPE"),
    };
    let (_, xv) = section(MATMUL, xs);
    let (_, out) = section(MATMUL, outs);
    format!(
        "const SR: u32 = {rows}u;\nconst SWG: u32 = {wg}u;\n{}\n{core}\n{kernel}\n{reduce}\n{xv}\n{out}",
        type_source(t)
    )
}

/// Row blocks of the slot GEMV along x before its grid folds into y (matmul.wgsl's FOLD).
pub const SLOT_FOLD: u32 = 32768;

/// A pipeline of GEMV design `g` for weights of type `t` (see [`Gemv::source`]); the bench and
/// the tests make the designs the engine does not use this way.
pub fn gemv_pipeline(
    gpu: &Gpu,
    t: WType,
    g: Gemv,
    subgroup: bool,
    input: GemvIn,
) -> Result<wgpu::ComputePipeline, BackendError> {
    let name = format!("gemv_{}{}_{}", input.infix(), g.name(), t.name());
    gpu.pipeline(&name, &g.source(t, subgroup, input), g.entry())
}

/// The one-token GEMV's modules (the engine's design and the bench's candidates) for the
/// translation test: name, source, entry points.
pub fn sources() -> Vec<(String, String, Vec<&'static str>)> {
    let mut v = Vec::new();
    let mut designs = Gemv::CANDIDATES.to_vec();
    if !designs.contains(&Gemv::SLOT) {
        designs.push(Gemv::SLOT);
    }
    designs.extend(Gemv::UNITS);
    for g in designs {
        if g == Gemv::Multi {
            continue;
        }
        for t in WType::ALL.into_iter().filter(|&t| g.supports(t)) {
            for (sub, suffix) in [(false, ""), (true, "_subgroup")] {
                for input in GemvIn::ALL {
                    v.push((
                        format!("gemv_{}{}_{}{suffix}", input.infix(), g.name(), t.name()),
                        g.source(t, sub, input),
                        vec!["gemv_slot"],
                    ));
                }
            }
        }
    }
    v
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn gemv_designs_parse_from_their_names_and_bad_ones_are_refused() {
        for g in Gemv::CANDIDATES
            .into_iter()
            .chain([Gemv::SLOT])
            .chain(Gemv::UNITS)
        {
            assert_eq!(Gemv::parse(&g.name()), Ok(g));
        }
        assert_eq!(Gemv::parse("r1w32"), Ok(Gemv::Slot { rows: 1, wg: 32 }));
        assert_eq!(Gemv::parse("u8w256"), Ok(Gemv::Unit { rows: 8, wg: 256 }));
        for bad in [
            "", "r3w128", "r4w48", "r4", "w128", "r4w128x", "R4W128", "slot", "u3w64", "uw64",
            "x4w64",
        ] {
            let e = Gemv::parse(bad).unwrap_err();
            assert!(e.contains("uRwW"), "{bad:?}: {e}");
        }
    }

    #[test]
    fn slot_grid_folds_past_its_limit_and_takes_a_token_per_z() {
        let s = |rows: usize, n: usize| MmShape {
            rows,
            cols: 256,
            n,
            x_stride: 256,
            y_stride: rows,
            y_off: 0,
            add: false,
            row_words: 0,
            row0: 0,
        };
        let g = Gemv::Slot { rows: 4, wg: 128 };
        assert_eq!(g.groups(&s(4097, 1)), [1025, 1, 1]);
        assert_eq!(
            g.groups(&s(4 * SLOT_FOLD as usize + 1, 3)),
            [SLOT_FOLD, 2, 3]
        );
    }
}
