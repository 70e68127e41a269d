// The decode GEMV y[t, y_off + r] (+)= sum_c x[t, c] * W[r, c] for one part of a weight matrix
// and a few tokens, and the embedding lookup (rows of W by token id). The weight format's
// `dq`/`unit`/`ucol` come before this file (types.wgsl); the host appends one of the two
// reductions at the end (`//! SUBGROUP` when the device has subgroups, `//! SHARED` otherwise).
//
// Why this shape: decoding reads every weight once per step, so the kernel is a stream of the
// weights at memory speed. A group of invocations (a subgroup, or 32 invocations without
// subgroups) walks a pair of rows; invocation `lane` takes units lane, lane + S, …, each one
// 16-byte load per row, so a group's loads are consecutive addresses. Two rows per group keep
// two loads in flight per invocation and read each activation once for both rows: for the 4-bit
// types 32 activations (128 bytes of f32) go with every 16 bytes of weights, so cache reads of
// the activations, not memory, would bound a row-at-a-time kernel. A unit is dequantized into
// named registers (`Dq`) and dotted in straight-line code; sums are f32. Up to NT tokens share
// each dequantized unit (small decode batches read the weights once); more tokens take more
// workgroups along y. Rows per workgroup are fixed (RW), so the host's grid does not depend on
// the subgroup size, which differs by adapter (8 on lavapipe, 32 on NVIDIA and Apple, 64 on some
// AMD): subgroups loop over the workgroup's row pairs.
//
// Activations are read through `xv`: the host appends `//! X_PLAIN` (x as stored) or
// `//! X_SWIGLU` (x is a [gate | up] row of twice the columns, read as silu(gate) * up), so the
// down projection of a decode step takes the SwiGLU into its input and saves a dispatch; the
// one-token kernel also takes `//! X_NORM` (x is the residual stream, read as RMSNorm(x) * g: the
// norm before the QKV and gate/up projections) and its output through `//! OUT_PLAIN` or
// `//! OUT_ROPE` (RoPE of the Q and K rows as they are stored).

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
    eps: f32,       // X_NORM: the RMSNorm's epsilon
    head_dim: u32,  // OUT_ROPE: columns of a head,
    rope_pairs: u32, // the pairs of each Q and K head that rotate,
    rope_rows: u32, // and the output columns of Q and K (V's are not rotated)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> w: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read> x: array<vec4<f32>>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> tokens: array<u32>;

const RW: u32 = 16u;
const NT: u32 = 8u;

// The one-token kernel's fused RMSNorm (X_NORM): the sum of squares of the activations this
// invocation has read, and the vec4 where the token's row starts (the slot kernels set it).
var<private> xss: f32;
var<private> x_row: u32;

// x's vec4 offsets of the rows of tokens t..t+3 (clamped to the last token: a missing token
// repeats the last one and its sum is dropped).
fn xrows4(t: u32) -> vec4<u32> {
    let last = p.n - 1u;
    return min(vec4<u32>(t, t + 1u, t + 2u, t + 3u), vec4<u32>(last)) * (p.x_stride / 4u);
}

// The dot products of dequantized unit `u` (of columns ucol(u, 0..UV)) of two rows with the
// activations of one token, whose row starts at vec4 `xb`: each activation is loaded once for
// both rows. Straight-line code over constant groups (UV is a constant, so the unused branches
// vanish).
fn xdot2(qa: Dq, qb: Dq, xb: u32, u: u32) -> vec2<f32> {
    let x0 = xv(xb + ucol(u, 0u) / 4u);
    let x1 = xv(xb + ucol(u, 1u) / 4u);
    var s = vec2<f32>(dot(qa.v0, x0) + dot(qa.v1, x1), dot(qb.v0, x0) + dot(qb.v1, x1));
    if UV > 2u {
        let x2 = xv(xb + ucol(u, 2u) / 4u);
        let x3 = xv(xb + ucol(u, 3u) / 4u);
        s += vec2<f32>(dot(qa.v2, x2) + dot(qa.v3, x3), dot(qb.v2, x2) + dot(qb.v3, x3));
    }
    if UV > 4u {
        let x4 = xv(xb + ucol(u, 4u) / 4u);
        let x5 = xv(xb + ucol(u, 5u) / 4u);
        let x6 = xv(xb + ucol(u, 6u) / 4u);
        let x7 = xv(xb + ucol(u, 7u) / 4u);
        s += vec2<f32>(
            dot(qa.v4, x4) + dot(qa.v5, x5) + dot(qa.v6, x6) + dot(qa.v7, x7),
            dot(qb.v4, x4) + dot(qb.v5, x5) + dot(qb.v6, x6) + dot(qb.v7, x7),
        );
    }
    return s;
}

// The partial sums of invocation `lane` of a group of `s` walking rows `ra` and `rb` together,
// for tokens t0..t0+nt: token t of row ra in element t % 4 of [0] (tokens 0..3) or [1] (4..7),
// of row rb in [2] or [3].
fn row_dots(ra: u32, rb: u32, lane: u32, s: u32, t0: u32, nt: u32) -> array<vec4<f32>, 4> {
    let units = p.cols / (4u * UV);
    if nt == 1u {
        let xb = t0 * (p.x_stride / 4u);
        var a = vec2<f32>(0.0);
        for (var u = lane; u < units; u += s) {
            a += xdot2(dq(ra, u), dq(rb, u), xb, u);
        }
        return array<vec4<f32>, 4>(vec4<f32>(a.x, 0.0, 0.0, 0.0), Z4, vec4<f32>(a.y, 0.0, 0.0, 0.0), Z4);
    }
    let r0 = xrows4(t0);
    let r1 = xrows4(t0 + 4u);
    var a0 = Z4;
    var a1 = Z4;
    var b0 = Z4;
    var b1 = Z4;
    for (var u = lane; u < units; u += s) {
        // One load and dequantization of each row's unit serves every token.
        let qa = dq(ra, u);
        let qb = dq(rb, u);
        let s0 = xdot2(qa, qb, r0.x, u);
        let s1 = xdot2(qa, qb, r0.y, u);
        let s2 = xdot2(qa, qb, r0.z, u);
        let s3 = xdot2(qa, qb, r0.w, u);
        a0 += vec4<f32>(s0.x, s1.x, s2.x, s3.x);
        b0 += vec4<f32>(s0.y, s1.y, s2.y, s3.y);
        if nt > 4u {
            let s4 = xdot2(qa, qb, r1.x, u);
            let s5 = xdot2(qa, qb, r1.y, u);
            let s6 = xdot2(qa, qb, r1.z, u);
            let s7 = xdot2(qa, qb, r1.w, u);
            a1 += vec4<f32>(s4.x, s5.x, s6.x, s7.x);
            b1 += vec4<f32>(s4.y, s5.y, s6.y, s7.y);
        }
    }
    return array<vec4<f32>, 4>(a0, a1, b0, b1);
}

// Writes (or adds) the finished sums of `row` for tokens t0..t0+nt.
fn store(row: u32, t0: u32, nt: u32, lo: vec4<f32>, hi: vec4<f32>) {
    for (var t = 0u; t < nt; t++) {
        var v = lo[t % 4u];
        if t >= 4u {
            v = hi[t % 4u];
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
// One subgroup per pair of rows; subgroupAdd sums its invocations. A pair's test is the same
// for the whole subgroup, so every subgroup operation runs with all its invocations.
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
    for (var i = sg; i < RW / 2u; i += nsg) {
        let ra = wg.x * RW + 2u * i;
        if ra < p.rows {
            // An odd last row is paired with itself; the copy's sums are dropped.
            let rb = min(ra + 1u, p.rows - 1u);
            let a = row_dots(ra, rb, lane, s, t0, nt);
            var r = array<vec4<f32>, 4>(Z4, Z4, Z4, Z4);
            if nt == 1u {
                let v = subgroupAdd(vec2<f32>(a[0].x, a[2].x));
                r[0].x = v.x;
                r[2].x = v.y;
            } else {
                r[0] = subgroupAdd(a[0]);
                r[2] = subgroupAdd(a[2]);
                if nt > 4u {
                    r[1] = subgroupAdd(a[1]);
                    r[3] = subgroupAdd(a[3]);
                }
            }
            if lane == 0u {
                store(ra, t0, nt, r[0], r[1]);
                if ra + 1u < p.rows {
                    store(ra + 1u, t0, nt, r[2], r[3]);
                }
            }
        }
    }
}
//! SHARED
// 32 invocations per pair of rows; a tree in workgroup memory sums them.
var<workgroup> red: array<vec4<f32>, 1024>;

@compute @workgroup_size(256)
fn gemv(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let t0 = wg.y * NT;
    let nt = min(NT, max(p.n, t0 + 1u) - t0);
    let lane = li % 32u;
    let ra = wg.x * RW + 2u * (li / 32u);
    let live = ra < p.rows && t0 < p.n;
    var a = array<vec4<f32>, 4>(Z4, Z4, Z4, Z4);
    if live {
        a = row_dots(ra, min(ra + 1u, p.rows - 1u), lane, 32u, t0, nt);
    }
    for (var j = 0u; j < 4u; j++) {
        red[4u * li + j] = a[j];
    }
    workgroupBarrier();
    for (var off = 16u; off > 0u; off >>= 1u) {
        if lane < off {
            for (var j = 0u; j < 4u; j++) {
                red[4u * li + j] += red[4u * (li + off) + j];
            }
        }
        workgroupBarrier();
    }
    if lane == 0u && live {
        store(ra, t0, nt, red[4u * li], red[4u * li + 1u]);
        if ra + 1u < p.rows {
            store(ra + 1u, t0, nt, red[4u * li + 2u], red[4u * li + 3u]);
        }
    }
}

//! X_PLAIN
const XN: bool = false;

fn xv(i: u32) -> vec4<f32> {
    return x[i];
}

fn xscale(ss: f32) -> f32 {
    return 1.0;
}

//! X_SWIGLU
const XN: bool = false;

// silu(gate) * up of the [gate | up] row: the up half starts cols / 4 vec4s after the gate.
fn xv(i: u32) -> vec4<f32> {
    let g = x[i];
    return g / (1.0 + exp(-g)) * x[i + p.cols / 4u];
}

fn xscale(ss: f32) -> f32 {
    return 1.0;
}

//! X_NORM
// The RMSNorm before a projection, fused into the one-token kernel: x is the residual stream,
// read as x * g (the norm's weight), and each row's sum is scaled by 1 / sqrt(mean(x^2) + eps)
// at the end. The invocations of a workgroup read every column of the row exactly once between
// them, so the sums of squares they keep (xss) add up to the row's. Saves the norm's dispatch
// and its pipeline barrier; every workgroup re-reads the row, as the plain kernel does anyway.
const XN: bool = true;

@group(0) @binding(5) var<storage, read> g: array<vec4<f32>>;

fn xv(i: u32) -> vec4<f32> {
    let v = x[i];
    xss += dot(v, v);
    return v * g[i - x_row];
}

fn xscale(ss: f32) -> f32 {
    return 1.0 / sqrt(ss / f32(p.cols) + p.eps);
}

//! OUT_PLAIN
// A row's finished sum `v` (its RoPE partner's `vp` unused), scaled by the fused norm.
fn slot_out(r0: u32, i: u32, t: u32, v: f32, vp: f32, ss: f32) {
    slot_store(r0, i, t, v * xscale(ss));
}

//! OUT_ROPE
// RoPE of the QKV projection's Q and K rows as they are stored (adjacent pairs: columns 2k and
// 2k + 1 of a head rotate together, qkv_post.wgsl's non-NeoX form, same arithmetic): the pair of
// a row is row ^ 1, in the same workgroup (the host runs this only where rows per workgroup are
// even and the part starts at an even column). Saves the RoPE dispatch of a decode step.
@group(0) @binding(6) var<storage, read> cs: array<f32>; // [n, rope_pairs, 2] (cos, sin)

fn slot_out(r0: u32, i: u32, t: u32, v: f32, vp: f32, ss: f32) {
    let s = xscale(ss);
    var o = v * s;
    let col = p.y_off + r0 + i;
    let c = col % p.head_dim;
    if col < p.rope_rows && c < 2u * p.rope_pairs {
        let k = (t * p.rope_pairs + c / 2u) * 2u;
        let co = cs[k];
        let si = cs[k + 1u];
        let b = vp * s;
        if (c & 1u) == 0u {
            o = fma(o, co, -(b * si));
        } else {
            o = fma(b, si, o * co);
        }
    }
    slot_store(r0, i, t, o);
}

//! SLOT
// The one-token GEMV. The host prepends `const SR` (rows of a workgroup: 1, 2, 4 or 8) and
// `const SWG` (its invocations, a power of two from 32 to 256), and appends one of the two
// reductions below (`//! SLOT_SUBGROUP` or `//! SLOT_SHARED`).
//
// Why this shape: with one token every weight is read once and used once, so what bounds the
// kernel is how many loads are in flight and how much work goes with each, not arithmetic. Each
// workgroup takes SR rows and all its invocations stride over those rows' slots together
// (types.wgsl: eight values whose activations lie at consecutive 16-byte pieces across
// invocations, so a subgroup's activation loads touch few cache lines). An invocation loads a
// slot's activations once and uses them for its SR rows, whose SR weight loads are independent,
// so they are in flight together. Small SR makes more workgroups (4,096 rows at SR 4: 1,024, of
// 128 invocations each, fill 132 SMs several times over); large SR shares each activation load
// over more rows. Tokens go along z (the engine takes this kernel for one token; more tokens
// read the weights once in the kernel above). Past 32,768 row blocks the grid folds into y.

const FOLD: u32 = 32768u;

// Rows r0..r0+SR clamped to the part (rows past the end repeat the last; their sums are dropped).
fn slot_row(r0: u32, i: u32) -> u32 {
    return min(r0 + i, p.rows - 1u);
}

// This invocation's partial sums of rows r0 + i (component i % 4 of [i / 4]) over slots li,
// li + SWG, … for the token whose activations start at vec4 `xb`.
fn slot_dots(r0: u32, li: u32, xb: u32) -> array<vec4<f32>, 2> {
    x_row = xb;
    let slots = p.cols / 8u;
    var a = Z4;
    var b = Z4;
    for (var q = li; q < slots; q += SWG) {
        let c = scol(q);
        let xa = xv(xb + c.x / 4u);
        let xc = xv(xb + c.y / 4u);
        a.x += sdot(slot_row(r0, 0u), q, xa, xc);
        if SR > 1u {
            a.y += sdot(slot_row(r0, 1u), q, xa, xc);
        }
        if SR > 2u {
            a.z += sdot(slot_row(r0, 2u), q, xa, xc);
            a.w += sdot(slot_row(r0, 3u), q, xa, xc);
        }
        if SR > 4u {
            b.x += sdot(slot_row(r0, 4u), q, xa, xc);
            b.y += sdot(slot_row(r0, 5u), q, xa, xc);
            b.z += sdot(slot_row(r0, 6u), q, xa, xc);
            b.w += sdot(slot_row(r0, 7u), q, xa, xc);
        }
    }
    return array<vec4<f32>, 2>(a, b);
}

// Writes (or adds) row r0 + i's finished sum for token t.
fn slot_store(r0: u32, i: u32, t: u32, v: f32) {
    let row = r0 + i;
    if i < SR && row < p.rows {
        let o = t * p.y_stride + p.y_off + row;
        if p.add != 0u {
            y[o] += v;
        } else {
            y[o] = v;
        }
    }
}

//! SLOT_SUBGROUP
// subgroupAdd sums each subgroup; its first invocation leaves the sums in workgroup memory and
// the first SR invocations add the subgroups' (at most 32: subgroups of at least 8), with the
// sums of squares of the fused norm (XN) and each row's RoPE partner (row ^ 1) beside them.
var<workgroup> sg_sums: array<array<vec4<f32>, 2>, 32>;
var<workgroup> sg_ss: array<f32, 32>;

@compute @workgroup_size(SWG)
fn gemv_slot(
    @builtin(local_invocation_index) li: u32,
    @builtin(subgroup_invocation_id) lane: u32,
    @builtin(subgroup_id) sg: u32,
    @builtin(num_subgroups) nsg: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
) {
    let r0 = (wg.x + wg.y * FOLD) * SR;
    if r0 >= p.rows {
        return;
    }
    let a = slot_dots(r0, li, wg.z * (p.x_stride / 4u));
    let s0 = subgroupAdd(a[0]);
    var s1 = Z4;
    if SR > 4u {
        s1 = subgroupAdd(a[1]);
    }
    var ss = 0.0;
    if XN {
        ss = subgroupAdd(xss);
    }
    if lane == 0u {
        sg_sums[sg] = array<vec4<f32>, 2>(s0, s1);
        sg_ss[sg] = ss;
    }
    workgroupBarrier();
    if li < SR {
        let lp = li ^ 1u;
        var v = 0.0;
        var vp = 0.0;
        var sq = 0.0;
        for (var j = 0u; j < nsg; j++) {
            v += sg_sums[j][li / 4u][li % 4u];
            vp += sg_sums[j][lp / 4u][lp % 4u];
            sq += sg_ss[j];
        }
        slot_out(r0, li, wg.z, v, vp, sq);
    }
}
//! SLOT_SHARED
// A tree in workgroup memory sums the invocations (and the fused norm's sums of squares).
var<workgroup> red: array<array<vec4<f32>, 2>, SWG>;
var<workgroup> red_ss: array<f32, SWG>;

@compute @workgroup_size(SWG)
fn gemv_slot(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let r0 = (wg.x + wg.y * FOLD) * SR;
    if r0 >= p.rows {
        return;
    }
    red[li] = slot_dots(r0, li, wg.z * (p.x_stride / 4u));
    red_ss[li] = xss;
    workgroupBarrier();
    for (var off = SWG / 2u; off > 0u; off >>= 1u) {
        if li < off {
            red[li][0] += red[li + off][0];
            red[li][1] += red[li + off][1];
            if XN {
                red_ss[li] += red_ss[li + off];
            }
        }
        workgroupBarrier();
    }
    if li < SR {
        let lp = li ^ 1u;
        slot_out(r0, li, wg.z, red[0][li / 4u][li % 4u], red[0][lp / 4u][lp % 4u], red_ss[0]);
    }
}
