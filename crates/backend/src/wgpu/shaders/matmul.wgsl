// The decode GEMV y[t, y_off + r] (+)= sum_c x[t, c] * W[r, c] for one part of a weight matrix
// and a few tokens, and the embedding lookup (rows of W by token id). The weight format's
// `unit`/`ucol` come before this file (types.wgsl); the host appends one of the two reductions
// at the end (`//! SUBGROUP` when the device has subgroups, `//! SHARED` otherwise).
//
// Why this shape: decoding reads every weight once per step, so the kernel is a stream of the
// weights at memory speed. A group of invocations (a subgroup, or 32 invocations without
// subgroups) walks one row; invocation `lane` takes units lane, lane + S, …, each one 16-byte
// load, so a group's loads are consecutive addresses. Sums are f32. Up to NT tokens share each
// dequantized unit (small decode batches read the weights once); more tokens take more
// workgroups along y. Rows per workgroup are fixed (RW), so the host's grid does not depend on
// the subgroup size, which differs by adapter (8 on lavapipe, 32 on NVIDIA and Apple, 64 on some
// AMD): subgroups loop over the workgroup's rows.

struct P {
    rows: u32,      // rows of this part
    cols: u32,      // row length (a multiple of the type's unit)
    n: u32,         // tokens
    x_stride: u32,  // elements per input row (a multiple of 4)
    y_stride: u32,  // elements per output row
    y_off: u32,     // output column of this part's first row
    add: u32,       // 1: add into y (the residual adds)
    row_words: u32, // unused here (device bytes per row / 4)
    row0: u32,      // embedding: the first row (token id) this part holds
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> tokens: array<u32>;

const RW: u32 = 8u;
const NT: u32 = 8u;

// x's vec4 offsets of the rows of tokens t..t+3 (clamped to the last token: a missing token
// repeats the last one and its sum is dropped).
fn xrows4(t: u32) -> vec4<u32> {
    let last = p.n - 1u;
    return min(vec4<u32>(t, t + 1u, t + 2u, t + 3u), vec4<u32>(last)) * (p.x_stride / 4u);
}

// The dot product of dequantized unit `u` (of columns ucol(u, 0..UV)) with the activations of
// one token, whose row starts at vec4 `xb`. Straight-line code over constant groups (UV is a
// constant, so the unused branches vanish).
fn xdot(q: Dq, xb: u32, u: u32) -> f32 {
    var s = dot(q.v0, x[xb + ucol(u, 0u) / 4u]) + dot(q.v1, x[xb + ucol(u, 1u) / 4u]);
    if UV > 2u {
        s += dot(q.v2, x[xb + ucol(u, 2u) / 4u]) + dot(q.v3, x[xb + ucol(u, 3u) / 4u]);
    }
    if UV > 4u {
        s += dot(q.v4, x[xb + ucol(u, 4u) / 4u]) + dot(q.v5, x[xb + ucol(u, 5u) / 4u]);
        s += dot(q.v6, x[xb + ucol(u, 6u) / 4u]) + dot(q.v7, x[xb + ucol(u, 7u) / 4u]);
    }
    return s;
}

// The partial sums of invocation `lane` of a group of `s` walking `row`, for tokens t0..t0+nt:
// element t of the result (tokens 0..3 in [0], 4..7 in [1]).
fn row_dots(row: u32, lane: u32, s: u32, t0: u32, nt: u32) -> array<vec4<f32>, 2> {
    let units = p.cols / (4u * UV);
    if nt == 1u {
        // One token: two units (two 16-byte loads) in flight per step.
        let xb = t0 * (p.x_stride / 4u);
        var a = 0.0;
        var b = 0.0;
        var u = lane;
        for (; u + s < units; u += 2u * s) {
            let qa = dq(row, u);
            let qb = dq(row, u + s);
            a += xdot(qa, xb, u);
            b += xdot(qb, xb, u + s);
        }
        if u < units {
            a += xdot(dq(row, u), xb, u);
        }
        return array<vec4<f32>, 2>(vec4<f32>(a + b, 0.0, 0.0, 0.0), vec4<f32>(0.0));
    }
    let r0 = xrows4(t0);
    let r1 = xrows4(t0 + 4u);
    var a0 = vec4<f32>(0.0);
    var a1 = vec4<f32>(0.0);
    for (var u = lane; u < units; u += s) {
        // One load and dequantization of the unit serves every token.
        let q = dq(row, u);
        a0 += vec4<f32>(xdot(q, r0.x, u), xdot(q, r0.y, u), xdot(q, r0.z, u), xdot(q, r0.w, u));
        if nt > 4u {
            a1 += vec4<f32>(xdot(q, r1.x, u), xdot(q, r1.y, u), xdot(q, r1.z, u), xdot(q, r1.w, u));
        }
    }
    return array<vec4<f32>, 2>(a0, a1);
}

// Writes (or adds) the finished sums of `row` for tokens t0..t0+nt.
fn store(row: u32, t0: u32, nt: u32, r: array<vec4<f32>, 2>) {
    for (var t = 0u; t < nt; t++) {
        var v = r[0][t % 4u];
        if t >= 4u {
            v = r[1][t % 4u];
        }
        let o = (t0 + t) * p.y_stride + p.y_off + row;
        if p.add != 0u {
            y[o] += v;
        } else {
            y[o] = v;
        }
    }
}

// y[t, :] = row tokens[t] of W, for the tokens whose row lies in this part. Grid: (units of a
// row / 64, tokens).
@compute @workgroup_size(64)
fn embed(@builtin(global_invocation_id) gid: vec3<u32>) {
    let u = gid.x;
    let t = gid.y;
    let tok = tokens[t];
    if u >= p.cols / (4u * UV) || tok < p.row0 || tok >= p.row0 + p.rows {
        return;
    }
    var wv = unit(tok - p.row0, u);
    for (var k = 0u; k < UV; k++) {
        let c = t * p.y_stride + ucol(u, k);
        for (var i = 0u; i < 4u; i++) {
            y[c + i] = wv[k][i];
        }
    }
}

//! SUBGROUP
// One subgroup per row; subgroupAdd sums its invocations. A row's test is the same for the whole
// subgroup, so every subgroup operation runs with all its invocations.
@compute @workgroup_size(256)
fn gemv(
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_size) s: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let t0 = wg.y * NT;
    if t0 >= p.n {
        return;
    }
    let nt = min(NT, p.n - t0);
    for (var i = sg; i < RW; i += nsg) {
        let row = wg.x * RW + i;
        if row < p.rows {
            let a = row_dots(row, lane, s, t0, nt);
            var r = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
            if nt == 1u {
                r[0].x = subgroupAdd(a[0].x);
            } else {
                r[0] = subgroupAdd(a[0]);
                if nt > 4u {
                    r[1] = subgroupAdd(a[1]);
                }
            }
            if lane == 0u {
                store(row, t0, nt, r);
            }
        }
    }
}
//! SHARED
// 32 invocations per row; a tree in workgroup memory sums them.
var<workgroup> red: array<vec4<f32>, 512>;

@compute @workgroup_size(256)
fn gemv(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let t0 = wg.y * NT;
    let nt = min(NT, max(p.n, t0 + 1u) - t0);
    let lane = li % 32u;
    let row = wg.x * RW + li / 32u;
    var a = array<vec4<f32>, 2>(vec4<f32>(0.0), vec4<f32>(0.0));
    if row < p.rows && t0 < p.n {
        a = row_dots(row, lane, 32u, t0, nt);
    }
    red[2u * li] = a[0];
    red[2u * li + 1u] = a[1];
    workgroupBarrier();
    for (var off = 16u; off > 0u; off >>= 1u) {
        if lane < off {
            red[2u * li] += red[2u * (li + off)];
            red[2u * li + 1u] += red[2u * (li + off) + 1u];
        }
        workgroupBarrier();
    }
    if lane == 0u && row < p.rows && t0 < p.n {
        store(row, t0, nt, array<vec4<f32>, 2>(red[2u * li], red[2u * li + 1u]));
    }
}
