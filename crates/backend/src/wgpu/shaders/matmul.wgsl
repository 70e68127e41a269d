// y[t, y_off + r] (+)= sum_c x[t, c] * W[r, c] for one part of a weight matrix, and the embedding
// lookup (rows of W by token id). The weight format's `load8`/`col8` are prepended by the host
// (one of types.wgsl's sections): `load8(row, c)` dequantizes the c-th run of eight weights of
// a row as two groups of four consecutive columns, `col8(c)` gives the
// first column of each group (a multiple of 4, so `x` is read as vec4s).
//
// Matmul: one invocation per weight row and TT = 16 tokens; it walks its row in runs of eight
// and keeps sixteen sums. No shared memory, no barrier: the plainest correct form, which every
// adapter runs (CPU Vulkan drivers included) — the decode GEMV with a subgroup reduction and the
// tiled prompt GEMM are the speed work that comes next.

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
// A part's words stored transposed: word j of row r at j * rows + r, so the invocations of a
// workgroup, one per row, read consecutive words (coalesced on GPUs, vector loads on CPUs).
@group(0) @binding(1) var<storage, read> w: array<u32>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>; // x_stride % 4 == 0
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> tokens: array<u32>;

const TT: u32 = 16u;

fn wd(row: u32, j: u32) -> u32 {
    return w[j * p.rows + row];
}

@compute @workgroup_size(64)
fn matmul(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let row = wg.x * 64u + li;
    // Token rows come from the workgroup id alone, so their loads are uniform (a broadcast, not a
    // gather, on SIMD CPUs).
    let t0 = wg.y * TT;
    if row >= p.rows || t0 >= p.n {
        return;
    }
    let chunks = p.cols / 8u;
    let nt = min(TT, p.n - t0);
    if nt == 1u {
        let x0 = t0 * p.x_stride;
        var acc = 0.0;
        for (var c = 0u; c < chunks; c++) {
            let wv = load8(row, c);
            let cc = (x0 + col8(c)) / 4u;
            acc += dot(wv[0], x[cc.x]) + dot(wv[1], x[cc.y]);
        }
        let o = t0 * p.y_stride + p.y_off + row;
        if p.add != 0u {
            y[o] += acc;
        } else {
            y[o] = acc;
        }
        return;
    }
    // Up to 16 tokens in four groups of four (a missing token repeats the last one; its sum is
    // dropped); each run of weights is dequantized once for all of them.
    let r0 = rows4(t0);
    let r1 = rows4(t0 + 4u);
    let r2 = rows4(t0 + 8u);
    let r3 = rows4(t0 + 12u);
    var acc0 = vec4<f32>(0.0);
    var acc1 = vec4<f32>(0.0);
    var acc2 = vec4<f32>(0.0);
    var acc3 = vec4<f32>(0.0);
    for (var c = 0u; c < chunks; c++) {
        let wv = load8(row, c);
        let cc = col8(c);
        acc0 += dots(wv, r0, cc);
        if nt > 4u {
            acc1 += dots(wv, r1, cc);
        }
        if nt > 8u {
            acc2 += dots(wv, r2, cc);
        }
        if nt > 12u {
            acc3 += dots(wv, r3, cc);
        }
    }
    for (var t = 0u; t < nt; t++) {
        var v = acc0[t % 4u];
        if t >= 12u {
            v = acc3[t % 4u];
        } else if t >= 8u {
            v = acc2[t % 4u];
        } else if t >= 4u {
            v = acc1[t % 4u];
        }
        let o = (t0 + t) * p.y_stride + p.y_off + row;
        if p.add != 0u {
            y[o] += v;
        } else {
            y[o] = v;
        }
    }
}

// Element offsets of the rows of tokens t..t+3 of x (clamped to the last token).
fn rows4(t: u32) -> vec4<u32> {
    let last = p.n - 1u;
    return min(vec4<u32>(t, t + 1u, t + 2u, t + 3u), vec4<u32>(last)) * p.x_stride;
}

// The run's eight weights times the same eight columns of four token rows.
fn dots(wv: array<vec4<f32>, 2>, rows: vec4<u32>, cc: vec2<u32>) -> vec4<f32> {
    let a = (rows + cc.x) / 4u;
    let b = (rows + cc.y) / 4u;
    return vec4<f32>(
        dot(wv[0], x[a.x]) + dot(wv[1], x[b.x]),
        dot(wv[0], x[a.y]) + dot(wv[1], x[b.y]),
        dot(wv[0], x[a.z]) + dot(wv[1], x[b.z]),
        dot(wv[0], x[a.w]) + dot(wv[1], x[b.w]),
    );
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
    let wv = load8(tok - p.row0, c);
    let cc = t * p.y_stride + col8(c);
    for (var k = 0u; k < 4u; k++) {
        y[cc.x + k] = wv[0][k];
        y[cc.y + k] = wv[1][k];
    }
}
