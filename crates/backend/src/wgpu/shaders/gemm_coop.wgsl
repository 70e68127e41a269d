enable f16;
enable wgpu_cooperative_matrix;

// The prompt GEMM on matrix units (tensor cores through VK_KHR_cooperative_matrix, Apple's
// simdgroup matrices through Metal): y[t, y_off + r] (+)= sum_c x[t, c] * W[r, c] for one part of
// a weight matrix. A workgroup of four subgroups computes 64 tokens x 128 rows: each step it
// stages 128 rows x 32 columns of W, dequantized to f16 once (the weight format's `unit`/`ucol`,
// prepended by the host from types.wgsl), and the same columns of 64 tokens of x rounded to f16, in
// workgroup memory; each subgroup then multiplies its 32-token x 64-row quarter as F x F
// fragments with f32 accumulators. The results go through a small per-subgroup scratch so that
// rows and tokens past the edges are never written and the residual add is one `+=`. The 32
// columns of a step are 8 groups of four, taken unit by unit as gemm.wgsl explains.
//
// The host fills in the subgroup size, the fragment size F (16 on NVIDIA Vulkan, 8 on Apple) and
// the unrolled fragment code (the `//@` lines: gemm.rs writes them), and picks this
// kernel only where the adapter offers f16 x f16 -> f32 fragments of that size and one fixed
// subgroup size, so that the workgroup is exactly four subgroups.

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
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>; // types.wgsl's layout
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

const SG: u32 = SG_SIZEu;
const WG: u32 = 4u * SG;
const F: u32 = FRAGu;
const BR: u32 = 128u; // weight rows per workgroup
const BT: u32 = 64u;  // tokens per workgroup
const BK: u32 = 32u;  // columns per step: 8 groups of four
// Row stride of the staged slices in halves: 80 bytes keeps every fragment's start 16-byte
// aligned and spreads a fragment's rows over the memory banks.
const LD: u32 = 40u;

var<workgroup> ws: array<f16, 5120>; // [BR][LD]: the weight slice, row-major
var<workgroup> xs: array<f16, 2560>; // [BT][LD]: the activation slice, row-major
var<workgroup> cs: array<f32, 1024>; // one F x F fragment per subgroup

@compute @workgroup_size(WG_SIZE)
fn gemm(
    @builtin(local_invocation_index) li: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let r0 = wg.x * BR;
    let t0 = wg.y * BT;
    // This subgroup's quarter: tokens 32 st.., rows 64 sr...
    let st = sg / 2u;
    let sr = sg % 2u;
    let ld = LD;
//@acc
    let units = p.cols / (4u * UV);
    let per = 8u / UV; // units per step
    let steps = (units + per - 1u) / per;
    for (var s = 0u; s < steps; s++) {
        let u0 = s * per;
        workgroupBarrier();
        // Weights: 128 rows x `per` units, row e % 128 and unit e / 128 of round h.
        for (var h = 0u; h < (BR * per + WG - 1u) / WG; h++) {
            let e = li + h * WG;
            if e < BR * per {
                let row = e % BR;
                let j = e / BR;
                var v: array<vec4<f32>, 8>;
                if r0 + row < p.rows && u0 + j < units {
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
        // Activations: 64 tokens x 8 groups of four.
        for (var h = 0u; h < BT * 8u / WG; h++) {
            let e = li + h * WG;
            let t = e / 8u;
            let g = e % 8u;
            let j = g / UV;
            var v = vec4<f32>(0.0);
            if t0 + t < p.n && u0 + j < units {
                v = x[((t0 + t) * p.x_stride + ucol(u0 + j, g % UV)) / 4u];
            }
            let base = t * LD + 4u * g;
            for (var i = 0u; i < 4u; i++) {
                xs[base + i] = f16(v[i]);
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
// each lane a share of it, skipping what lies past the edges.
fn put(scratch: u32, t: u32, r: u32, lane: u32) {
    for (var e = lane; e < F * F; e += SG) {
        let tt = t + e / F;
        let rr = r + e % F;
        if tt < p.n && rr < p.rows {
            let o = tt * p.y_stride + p.y_off + rr;
            let v = cs[scratch + e];
            if p.add != 0u {
                y[o] += v;
            } else {
                y[o] = v;
            }
        }
    }
}
