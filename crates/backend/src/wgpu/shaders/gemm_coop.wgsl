enable f16;
enable wgpu_cooperative_matrix;

// The prompt GEMM on matrix units (tensor cores through VK_KHR_cooperative_matrix, Apple's
// simdgroup matrices through Metal): y[t, y_off + r] (+)= sum_c x[t, c] * W[r, c] for one part of
// a weight matrix. A workgroup of four subgroups computes 64 tokens x 128 rows: each step it
// stages a 128-row x 32-column slice of W, dequantized to f16 once (the weight format's
// `load8`/`col8`, appended by the host), and the 64 tokens' 32 columns of x rounded to f16, in
// workgroup memory; each subgroup then multiplies its 32-token x 64-row quarter as F x F
// fragments with f32 accumulators. The results go through a small per-subgroup scratch so that
// rows and tokens past the edges are never written and the residual add is one `+=`.
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
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;

// Word j of weight row r in weights.rs's layout: the only place that knows it.
fn wd(row: u32, j: u32) -> u32 {
    return w[j * p.rows + row];
}

const SG: u32 = SG_SIZEu;
const WG: u32 = 4u * SG;
const F: u32 = FRAGu;
const BR: u32 = 128u; // weight rows per workgroup
const BT: u32 = 64u;  // tokens per workgroup
const BK: u32 = 32u;  // columns per step (one block of the quantized formats)
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
    let runs = p.cols / 8u;
    let steps = (p.cols + BK - 1u) / BK;
    for (var s = 0u; s < steps; s++) {
        let k0 = s * BK;
        workgroupBarrier();
        // Weights: 128 rows x 4 runs of eight.
        for (var h = 0u; h < BR * 4u / WG; h++) {
            let e = li + h * WG;
            let row = e % BR;
            let q = e / BR;
            let c = k0 / 8u + q;
            var v = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
            var kc = vec2<u32>(8u * q, 8u * q + 4u);
            if r0 + row < p.rows && c < runs {
                v = load8(r0 + row, c);
                kc = col8(c) - vec2<u32>(k0);
            }
            let base = row * LD;
            for (var i = 0u; i < 4u; i++) {
                ws[base + kc.x + i] = f16(v[0][i]);
                ws[base + kc.y + i] = f16(v[1][i]);
            }
        }
        // Activations: 64 tokens x 8 vec4s.
        for (var h = 0u; h < BT * 8u / WG; h++) {
            let e = li + h * WG;
            let t = e / 8u;
            let kq = 4u * (e % 8u);
            var v = vec4<f32>(0.0);
            if t0 + t < p.n && k0 + kq < p.cols {
                v = x[((t0 + t) * p.x_stride + k0 + kq) / 4u];
            }
            let base = t * LD + kq;
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
