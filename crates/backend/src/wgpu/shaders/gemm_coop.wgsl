enable f16;
enable wgpu_cooperative_matrix;

// The prompt GEMM on matrix units (tensor cores through VK_KHR_cooperative_matrix, Apple's
// simdgroup matrices through Metal): y[t, y_off + r] (+)= sum_c x[t, c] * W[r, c] for one part of
// a weight matrix. A workgroup of four subgroups computes BT tokens x BR rows: each step it
// stages BR rows x BK columns of W, dequantized to f16 once (the weight format's `unit`/`ucol`,
// prepended by the host from types.wgsl), and the same columns of BT tokens of x rounded to f16,
// in workgroup memory; each subgroup then multiplies its (BT / 2)-token x (BR / 2)-row quarter as
// F x F fragments with f32 accumulators. The results go through a small per-subgroup scratch so
// that rows and tokens past the edges are never written and the residual add is one `+=`. The BK
// columns of a step are BK / 4 groups of four, taken unit by unit as gemm.wgsl explains.
//
// Split over columns (`ksplit` > 0): workgroup z takes units [z ksplit, (z + 1) ksplit) of every
// row and stores its sums in `part` ([z][t][r]); gemm_reduce.wgsl then adds the slices into y in
// a fixed order. A dispatch with few row and token tiles (a short batch, a narrow matrix) so
// keeps the whole GPU busy.
//
// The host fills in the subgroup size, the fragment size F (16 on NVIDIA Vulkan, 8 on Apple), the
// blocking (BR, BT, BK and the workgroup arrays' lengths) and the unrolled fragment code (the `//@`
// lines: gemm.rs writes them), and picks this kernel only where the adapter offers
// f16 x f16 -> f32 fragments of that size and one fixed subgroup size, so that the workgroup is
// exactly four subgroups.

struct P {
    rows: u32,      // rows of this part
    cols: u32,      // row length (a multiple of 8; of 32 for the block formats)
    n: u32,         // tokens
    x_stride: u32,  // elements per input row (a multiple of 4)
    y_stride: u32,  // elements per output row
    y_off: u32,     // output column of this part's first row
    add: u32,       // 1: add into y (the residual adds)
    row_words: u32, // u32 words per weight row
    row0: u32,      // unused here (the embedding's)
    ksplit: u32,    // units per slice of a split over columns; 0: no split
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>; // types.wgsl's layout
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read_write> part: array<f32>; // [slices][n][rows]

const SG: u32 = SG_SIZEu;
const WG: u32 = 4u * SG;
const F: u32 = FRAGu;
const BR: u32 = BR_SIZEu; // weight rows per workgroup
const BT: u32 = BT_SIZEu; // tokens per workgroup
const BK: u32 = BK_SIZEu; // columns per step: BK / 4 groups of four
const G: u32 = BK / 4u;
const TS: u32 = BT / 2u;  // tokens of a subgroup's quarter
const RS: u32 = BR / 2u;  // rows of a subgroup's quarter
// Row stride of the staged slices in halves: BK + 8 keeps every fragment's start 16-byte aligned
// and spreads a fragment's rows over the memory banks.
const LD: u32 = BK + 8u;

var<workgroup> ws: array<f16, WS_LEN>; // [BR][LD]: the weight slice, row-major
var<workgroup> xs: array<f16, XS_LEN>; // [BT][LD]: the activation slice, row-major
var<workgroup> cs: array<f32, CS_LEN>; // one F x F fragment per subgroup

@compute @workgroup_size(WG_SIZE)
fn gemm(
    @builtin(local_invocation_index) li: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let r0 = wg.x * BR;
    let t0 = wg.y * BT;
    // This subgroup's quarter: tokens TS st.., rows RS sr...
    let st = sg / 2u;
    let sr = sg % 2u;
    let ld = LD;
//@acc
    let units = p.cols / (4u * UV);
    // This workgroup's units: all, or its slice of a split.
    var ua = 0u;
    var ub = units;
    if p.ksplit != 0u {
        ua = min(units, wg.z * p.ksplit);
        ub = min(units, ua + p.ksplit);
    }
    let per = BK / (4u * UV); // units per step
    let steps = (ub - ua + per - 1u) / per;
    for (var s = 0u; s < steps; s++) {
        let u0 = ua + s * per;
        workgroupBarrier();
        // Weights: BR rows x `per` units, row e % BR and unit e / BR of round h.
        for (var h = 0u; h < (BR * per + WG - 1u) / WG; h++) {
            let e = li + h * WG;
            if e < BR * per {
                let row = e % BR;
                let j = e / BR;
                var v: array<vec4<f32>, 8>;
                if r0 + row < p.rows && u0 + j < ub {
                    v = unit(r0 + row, u0 + j);
                }
                let base = row * LD + 4u * j * UV;
                for (var k = 0u; k < UV; k++) {
                    for (var i = 0u; i < 4u; i++) {
                        ws[base + 4u * k + i] = f16(v[k][i]);
                    }
                }
            }
        }
        // Activations: BT tokens x G groups of four.
        for (var h = 0u; h < (BT * G + WG - 1u) / WG; h++) {
            let e = li + h * WG;
            if e < BT * G {
                let t = e / G;
                let g = e % G;
                let j = g / UV;
                var v = vec4<f32>(0.0);
                if t0 + t < p.n && u0 + j < ub {
                    v = x[((t0 + t) * p.x_stride + ucol(u0 + j, g % UV)) / 4u];
                }
                let base = t * LD + 4u * g;
                for (var i = 0u; i < 4u; i++) {
                    xs[base + i] = f16(v[i]);
                }
            }
        }
        workgroupBarrier();
        for (var kk = 0u; kk < BK; kk += F) {
//@mma
        }
    }
    let scratch = sg * F * F;
    let f = F;
//@store
}

// Writes the fragment in this subgroup's scratch (row-major, F x F) to tokens t.., rows r..,
// each lane a share of it, skipping what lies past the edges: into y, or into slice z of `part`
// when the columns are split.
fn put(scratch: u32, t: u32, r: u32, lane: u32, z: u32) {
    for (var e = lane; e < F * F; e += SG) {
        let tt = t + e / F;
        let rr = r + e % F;
        if tt < p.n && rr < p.rows {
            let v = cs[scratch + e];
            if p.ksplit != 0u {
                part[(z * p.n + tt) * p.rows + rr] = v;
            } else {
                let o = tt * p.y_stride + p.y_off + rr;
                if p.add != 0u {
                    y[o] += v;
                } else {
                    y[o] = v;
                }
            }
        }
    }
}
