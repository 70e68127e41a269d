// The second half of a GEMM split over columns (gemm.wgsl, gemm_coop.wgsl): y[t, y_off + r]
// (+)= the sum of the slices' partial sums part[z][t][r], z = 0, 1, ... in that order, so the
// result does not depend on which slice finished first. One invocation per output.

struct P {
    rows: u32,     // rows of the part
    n: u32,        // tokens
    y_stride: u32, // elements per output row
    y_off: u32,    // output column of the part's first row
    add: u32,      // 1: add into y (the residual adds)
    slices: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> part: array<f32>; // [slices][n][rows]

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let r = gid.x;
    let t = gid.y;
    if r >= p.rows || t >= p.n {
        return;
    }
    var s = 0.0;
    for (var z = 0u; z < p.slices; z++) {
        s += part[(z * p.n + t) * p.rows + r];
    }
    let o = t * p.y_stride + p.y_off + r;
    if p.add != 0u {
        y[o] += s;
    } else {
        y[o] = s;
    }
}
