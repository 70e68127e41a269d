// y[t, y_off + r] (+)= sum_c x[t, c] * W[r, c] for one part of a weight matrix, and the embedding
// lookup (rows of W by token id). The weight format's `load8`/`col8` are prepended by the host
// (one of types.wgsl's sections): `load8(base, c)` dequantizes the c-th run of eight weights of
// the row starting at word `base`, `col8(c, k)` says which column the k-th of them belongs to.
//
// Matmul: a workgroup of 256 invocations computes RPW = 4 rows for TT = 4 tokens; the 64 lanes
// of a row split its columns in runs of eight, so each weight is read once per TT tokens, then
// a shared-memory tree sums the lanes (no subgroup operations: every adapter runs it).

struct P {
    rows: u32,      // rows of this part
    cols: u32,      // row length (a multiple of 8; of 32 for the block formats)
    n: u32,         // tokens
    x_stride: u32,  // elements per input row
    y_stride: u32,  // elements per output row
    y_off: u32,     // output column of this part's first row
    add: u32,       // 1: add into y (the residual adds)
    row_words: u32, // u32 words per weight row
    row0: u32,      // embedding: the first row (token id) this part holds
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> tokens: array<u32>;

const TT: u32 = 4u;
const LANES: u32 = 64u;
const RPW: u32 = 4u;

var<workgroup> red: array<f32, 1024>; // [TT, RPW * LANES]

@compute @workgroup_size(256)
fn matmul(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let lane = li % LANES;
    let row = wg.x * RPW + li / LANES;
    let t0 = wg.y * TT;
    var acc = array<f32, 4>(0.0, 0.0, 0.0, 0.0);
    if row < p.rows {
        let base = row * p.row_words;
        let chunks = p.cols / 8u;
        for (var c = lane; c < chunks; c += LANES) {
            let wv = load8(base, c);
            for (var t = 0u; t < TT; t++) {
                if t0 + t < p.n {
                    let xb = (t0 + t) * p.x_stride;
                    var s = 0.0;
                    for (var k = 0u; k < 8u; k++) {
                        s += wv[k] * x[xb + col8(c, k)];
                    }
                    acc[t] += s;
                }
            }
        }
    }
    for (var t = 0u; t < TT; t++) {
        red[t * 256u + li] = acc[t];
    }
    workgroupBarrier();
    for (var s = LANES / 2u; s > 0u; s >>= 1u) {
        if lane < s {
            for (var t = 0u; t < TT; t++) {
                red[t * 256u + li] += red[t * 256u + li + s];
            }
        }
        workgroupBarrier();
    }
    if lane == 0u && row < p.rows {
        for (var t = 0u; t < TT; t++) {
            if t0 + t < p.n {
                let o = (t0 + t) * p.y_stride + p.y_off + row;
                let v = red[t * 256u + li];
                if p.add != 0u {
                    y[o] += v;
                } else {
                    y[o] = v;
                }
            }
        }
    }
}

// y[t, :] = row tokens[t] of W, for the tokens whose row lies in this part. Grid: (runs of eight
// columns / 64, tokens).
@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    let tok = tokens[t];
    if c >= p.cols / 8u || tok < p.row0 || tok >= p.row0 + p.rows {
        return;
    }
    let wv = load8((tok - p.row0) * p.row_words, c);
    for (var k = 0u; k < 8u; k++) {
        y[t * p.y_stride + col8(c, k)] = wv[k];
    }
}
