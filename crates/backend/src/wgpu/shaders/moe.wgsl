// A mixture-of-experts layer (Qwen3-MoE) on the device, as the CPU computes it (cpu/moe.rs): per
// token, router logits x · routerᵀ in f32, softmax over all experts, the k largest probabilities
// (ties: the lower expert index first), divided by their sum when `norm`; then each chosen
// expert's SwiGLU, and x += Σ_j w_j · down_j(...). Routing and the final sum are moe_route.wgsl;
// this is the experts' matmul: one workgroup per 4 rows of one (token, expert) pair,
// y[pair, y_off + r] = W_e[r] · in[row], W the stacked [experts x per, cols] matrix (types.wgsl's
// layout: the host prepends the weight type's reader), `in` the layer's input (row pair / k) for
// gate and up, the pair's own SwiGLU row for down. The SwiGLU between the two matmuls is
// swiglu.wgsl over the pairs' rows. Correctness first: plain loops and workgroup-memory sums, no
// optional feature.

struct P {
    rows: u32,       // rows of the stacked matrix (experts x per)
    cols: u32,       // row length
    per: u32,        // rows per expert
    pairs: u32,      // token-expert pairs (n k)
    k: u32,          // experts per token
    in_stride: u32,  // elements per input row (a multiple of 4)
    out_stride: u32, // elements per output row
    y_off: u32,      // output column of row 0
    by_token: u32,   // 1: pair p reads input row p / k; 0: row p
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>; // the stacked weights
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>; // the input rows
@group(0) @binding(3) var<storage, read_write> y: array<f32>; // the output rows
@group(0) @binding(4) var<storage, read> ids: array<u32>;     // [pairs]: the chosen experts

const WG: u32 = 64u;
const R: u32 = 4u;

var<workgroup> red: array<f32, 256>; // [R][WG]

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let pair = wg.y;
    let r0 = wg.x * R;
    let e = ids[pair];
    var row_in = pair;
    if p.by_token != 0u {
        row_in = pair / p.k;
    }
    let units = p.cols / (4u * UV);
    var acc: array<f32, 4>;
    for (var u = li; u < units; u += WG) {
        var xs: array<vec4<f32>, 8>;
        for (var g = 0u; g < UV; g++) {
            xs[g] = x[(row_in * p.in_stride + ucol(u, g)) / 4u];
        }
        for (var i = 0u; i < R; i++) {
            if r0 + i < p.per {
                let v = unit(e * p.per + r0 + i, u);
                var s = 0.0;
                for (var g = 0u; g < UV; g++) {
                    s += dot(v[g], xs[g]);
                }
                acc[i] += s;
            }
        }
    }
    for (var i = 0u; i < R; i++) {
        red[i * WG + li] = acc[i];
    }
    workgroupBarrier();
    for (var s = WG / 2u; s > 0u; s >>= 1u) {
        if li < s {
            for (var i = 0u; i < R; i++) {
                red[i * WG + li] += red[i * WG + li + s];
            }
        }
        workgroupBarrier();
    }
    if li < R && r0 + li < p.per {
        y[pair * p.out_stride + p.y_off + r0 + li] = red[li * WG];
    }
}
