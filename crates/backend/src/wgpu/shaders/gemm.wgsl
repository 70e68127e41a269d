// The prompt GEMM without matrix units: y[t, y_off + r] (+)= sum_c x[t, c] * W[r, c] for one part
// of a weight matrix, over a whole prompt chunk. The GEMV reads every weight once per few tokens;
// here a workgroup stages 64 rows x 32 columns of W (dequantized once, through the weight
// format's `unit`/`ucol`, which the host prepends from types.wgsl) and the same 32 columns of 64
// tokens of x in workgroup memory, and each of its 256 invocations accumulates a 4 x 4 block of
// outputs in f32: every weight is read once per 64 tokens and every staged value is used 64
// times. 16 KiB of workgroup memory, plain f32 math and no optional feature, so every adapter
// runs it (lavapipe included); adapters with matrix units take gemm_coop.wgsl instead.
//
// A step takes 32 columns as 8 groups of four: the groups of the next 8 / UV units of every
// row, wherever `ucol` puts them (a unit of the K-quants spans columns far apart). Slot
// 4 (j UV + k) + i of a step holds column ucol(u0 + j, k) + i for W and x alike, so the sum over
// slots is the sum over those columns.
//
// Split over columns (`ksplit` > 0), as gemm_coop.wgsl: workgroup z takes units [z ksplit,
// (z + 1) ksplit) of every row and stores its sums in `part` ([z][t][r]); gemm_reduce.wgsl adds
// the slices into y.

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

const BR: u32 = 64u; // weight rows per workgroup
const BT: u32 = 64u; // tokens per workgroup
const BK: u32 = 32u; // columns per step: 8 groups of four

// [BK][BR] and [BK][BT]: slot k of the step is a contiguous run of rows (tokens), so the
// invocations of one k read consecutive words.
var<workgroup> ws: array<f32, 2048>;
var<workgroup> xs: array<f32, 2048>;

@compute @workgroup_size(256)
fn gemm(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let r0 = wg.x * BR;
    let t0 = wg.y * BT;
    // This invocation's outputs: rows tr + 16i and tokens tt + 16j (i, j < 4), strided so the
    // invocations of a k read distinct consecutive words of ws and xs.
    let tr = li % 16u;
    let tt = li / 16u;
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    let units = p.cols / (4u * UV);
    // This workgroup's units: all, or its slice of a split.
    var ua = 0u;
    var ub = units;
    if p.ksplit != 0u {
        ua = min(units, wg.z * p.ksplit);
        ub = min(units, ua + p.ksplit);
    }
    let per = 8u / UV; // units per step
    let steps = (ub - ua + per - 1u) / per;
    for (var s = 0u; s < steps; s++) {
        let u0 = ua + s * per;
        workgroupBarrier();
        // Weights: one unit of one row per invocation and round (row e % 64, unit e / 64).
        for (var h = 0u; h < (BR * per + 255u) / 256u; h++) {
            let e = li + 256u * h;
            if e < BR * per {
                let row = e % BR;
                let j = e / BR;
                var v: array<vec4<f32>, 8>;
                if r0 + row < p.rows && u0 + j < ub {
                    v = unit(r0 + row, u0 + j);
                }
                for (var k = 0u; k < UV; k++) {
                    let slot = 4u * (j * UV + k);
                    for (var i = 0u; i < 4u; i++) {
                        ws[(slot + i) * BR + row] = v[k][i];
                    }
                }
            }
        }
        // Activations: two groups of four per invocation (token e / 8, group e % 8).
        for (var h = 0u; h < 2u; h++) {
            let e = li + 256u * h;
            let t = e / 8u;
            let g = e % 8u;
            let j = g / UV;
            var v = vec4<f32>(0.0);
            if t0 + t < p.n && u0 + j < ub {
                v = x[((t0 + t) * p.x_stride + ucol(u0 + j, g % UV)) / 4u];
            }
            for (var i = 0u; i < 4u; i++) {
                xs[(4u * g + i) * BT + t] = v[i];
            }
        }
        workgroupBarrier();
        for (var k = 0u; k < BK; k++) {
            let a = vec4<f32>(
                ws[k * BR + tr],
                ws[k * BR + tr + 16u],
                ws[k * BR + tr + 32u],
                ws[k * BR + tr + 48u],
            );
            acc0 += a * xs[k * BT + tt];
            acc1 += a * xs[k * BT + tt + 16u];
            acc2 += a * xs[k * BT + tt + 32u];
            acc3 += a * xs[k * BT + tt + 48u];
        }
    }
    put(t0 + tt, r0 + tr, acc0, wg.z);
    put(t0 + tt + 16u, r0 + tr, acc1, wg.z);
    put(t0 + tt + 32u, r0 + tr, acc2, wg.z);
    put(t0 + tt + 48u, r0 + tr, acc3, wg.z);
}

// Token t's outputs for rows r, r + 16, r + 32, r + 48 (those that exist): into y, or into slice
// z of `part` when the columns are split.
fn put(t: u32, r: u32, v: vec4<f32>, z: u32) {
    if t >= p.n {
        return;
    }
    for (var i = 0u; i < 4u; i++) {
        let row = r + 16u * i;
        if row < p.rows {
            if p.ksplit != 0u {
                part[(z * p.n + t) * p.rows + row] = v[i];
                continue;
            }
            let o = t * p.y_stride + p.y_off + row;
            if p.add != 0u {
                y[o] += v[i];
            } else {
                y[o] = v[i];
            }
        }
    }
}
