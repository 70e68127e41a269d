// The one-token GEMV for the 4-, 5- and 6-bit types (Q4_K, Q5_K, Q6_K, Q4_0, Q4_1), built for little arithmetic per byte.
// The host prepends types.wgsl (for `ucol`, `kscales`, `half_at`, `scale_base`), matmul.wgsl's
// core (bindings, `p`, `xv`) and `const SR` / `const SWG` (rows per workgroup, invocations), then
// this prelude and one type's section, then matmul.wgsl's slot reduction (`//! SLOT_SUBGROUP` or
// `//! SLOT_SHARED`, which call `slot_dots` below), `xv` (an `//! X_*` section) and `slot_out`
// (an `//! OUT_*` section, which calls `slot_store` below).
//
// Why this shape: with one token every weight byte is used once, so the kernel runs at memory
// speed only if the work per byte is small; on the H100 the 4-bit slot kernel spent ~8
// operations per value (a scale decode per 8 values, dequantize-then-dot) and reached a third of
// the read ceiling. Here an invocation owns a whole *unit* (types.wgsl: one 16-byte load of
// quantized data, 32 values in two scale groups of 16 or 32), so
//   - each weight load is a vec4<u32> and a row's scales are decoded once per 32 values;
//   - a value becomes a float in three integer operations: its bits are placed in the top of
//     the mantissa of 1.0 (f32 bits 0x3F800000 | q << (23 - bits)), giving 1 + q / 2^bits, and
//     dotted as is; sum(q x) = 2^bits (sum((1 + q / 2^bits) x) - sum(x));
//   - sum(x) of each scale group and the unit's eight activation vec4s are loaded and summed
//     once and serve all SR rows, and the minimum / offset term becomes one multiply by sum(x)
//     per group instead of one per value.
// No workgroup barrier in the loop; the reduction is the slot kernel's (subgroupAdd when there
// are subgroups). Invocations of a workgroup take units li, li + SWG, …, so a subgroup's weight
// loads cover consecutive 16-byte pieces of its rows.

const FOLD: u32 = 32768u;

// The activations of unit `u` of the token whose row starts at vec4 `xb`: groups k = 0..3 (a)
// and 4..7 (b) of `ucol`, and the sum of each half (one scale group, or two of 16 for Q6_K).
struct Xu {
    a0: vec4<f32>,
    a1: vec4<f32>,
    a2: vec4<f32>,
    a3: vec4<f32>,
    b0: vec4<f32>,
    b1: vec4<f32>,
    b2: vec4<f32>,
    b3: vec4<f32>,
    sa: f32,
    sb: f32,
}

fn xload(xb: u32, u: u32) -> Xu {
    let a0 = xv(xb + ucol(u, 0u) / 4u);
    let a1 = xv(xb + ucol(u, 1u) / 4u);
    let a2 = xv(xb + ucol(u, 2u) / 4u);
    let a3 = xv(xb + ucol(u, 3u) / 4u);
    let b0 = xv(xb + ucol(u, 4u) / 4u);
    let b1 = xv(xb + ucol(u, 5u) / 4u);
    let b2 = xv(xb + ucol(u, 6u) / 4u);
    let b3 = xv(xb + ucol(u, 7u) / 4u);
    let one = vec4<f32>(1.0);
    return Xu(a0, a1, a2, a3, b0, b1, b2, b3, dot(a0 + a1 + a2 + a3, one), dot(b0 + b1 + b2 + b3, one));
}

// Rows r0..r0+SR clamped to the part (rows past the end repeat the last; their sums are dropped).
fn slot_row(r0: u32, i: u32) -> u32 {
    return min(r0 + i, p.rows - 1u);
}

// This invocation's partial sums of rows r0 + i (component i % 4 of [i / 4]) over units li,
// li + SWG, … for the token whose activations start at vec4 `xb`.
fn slot_dots(r0: u32, li: u32, xb: u32) -> array<vec4<f32>, 2> {
    x_row = xb;
    let units = p.cols / 32u;
    var a = Z4;
    var b = Z4;
    for (var u = li; u < units; u += SWG) {
        let x = xload(xb, u);
        a.x += qdot(slot_row(r0, 0u), u, x);
        if SR > 1u {
            a.y += qdot(slot_row(r0, 1u), u, x);
        }
        if SR > 2u {
            a.z += qdot(slot_row(r0, 2u), u, x);
            a.w += qdot(slot_row(r0, 3u), u, x);
        }
        if SR > 4u {
            b.x += qdot(slot_row(r0, 4u), u, x);
            b.y += qdot(slot_row(r0, 5u), u, x);
            b.z += qdot(slot_row(r0, 6u), u, x);
            b.w += qdot(slot_row(r0, 7u), u, x);
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

const ONE_BITS: vec4<u32> = vec4<u32>(0x3F800000u);

// The low nibbles of the four bytes of `v` as 1 + q / 16.
fn lo16(v: u32) -> vec4<f32> {
    let m = vec4<u32>(0xFu << 19u);
    return bitcast<vec4<f32>>((vec4<u32>(v << 19u, v << 11u, v << 3u, v >> 5u) & m) | ONE_BITS);
}

// The high nibbles of the four bytes of `v` as 1 + q / 16.
fn hi16(v: u32) -> vec4<f32> {
    let m = vec4<u32>(0xFu << 19u);
    return bitcast<vec4<f32>>((vec4<u32>(v << 15u, v << 7u, v >> 1u, v >> 9u) & m) | ONE_BITS);
}

//! Q4_K
// Unit u: nibble vec4 v = u % 8 of block u / 8; word j's low nibbles are columns ucol(u, j)..+3
// (sub-block 2c, c = v / 2), its high ones ucol(u, 4 + j)..+3 (sub-block 2c + 1).

// Unit u of `row` dotted with its activations: d * sc * sum(q x) - dmin * m * sum(x) per
// sub-block.
fn qdot(row: u32, u: u32, x: Xu) -> f32 {
    let blk = (row * (p.cols / 256u) + u / 8u) * 9u;
    let v = u % 8u;
    let h = w[blk];
    let q = w[blk + 1u + v];
    let dd = unpack2x16float(h.x);
    let sm = kscales(h.y, h.z, h.w, v / 2u);
    let dl = dot(lo16(q.x), x.a0) + dot(lo16(q.y), x.a1) + dot(lo16(q.z), x.a2) + dot(lo16(q.w), x.a3);
    let dh = dot(hi16(q.x), x.b0) + dot(hi16(q.y), x.b1) + dot(hi16(q.z), x.b2) + dot(hi16(q.w), x.b3);
    let ql = 16.0 * (dl - x.sa);
    let qh = 16.0 * (dh - x.sb);
    return dd.x * (sm.x * ql + sm.y * qh) - dd.y * (sm.z * x.sa + sm.w * x.sb);
}
//! Q6_K
// Unit u: nibble vec4 v = u % 8 of block g = u / 8 (half hf = v / 4, k1 = (v % 4) / 2); word j's
// low nibbles with bit pair 2k1 of high-bit word j are columns ucol(u, j)..+3 (scale 8hf + 2k1 +
// v % 2), its high nibbles with pair 2k1 + 4 are ucol(u, 4 + j)..+3 (that scale + 4).

// The six-bit values in the low six bits of the four bytes of `v` as 1 + q / 64.
fn six(v: u32) -> vec4<f32> {
    let m = vec4<u32>(0x3Fu << 17u);
    return bitcast<vec4<f32>>((vec4<u32>(v << 17u, v << 9u, v << 1u, v >> 7u) & m) | ONE_BITS);
}

// Unit u of `row` dotted with its activations: d * sc * sum((q - 32) x) per scale group, with
// sum((q - 32) x) = 64 sum((1 + q / 64) x) - 96 sum(x).
fn qdot(row: u32, u: u32, x: Xu) -> f32 {
    let g = row * (p.cols / 256u) + u / 8u;
    let blk = g * 13u;
    let v = u % 8u;
    let hf = v / 4u;
    let k1 = (v % 4u) / 2u;
    let q = w[blk + v];
    let qh = w[blk + 8u + 2u * hf + v % 2u];
    let sc = w[blk + 12u];
    let d = half_at(scale_base(), g);
    let si = 8u * hf + 2u * k1 + v % 2u;
    let sh = 24u - 8u * (si % 4u);
    let scl = f32(bitcast<i32>(sc[si / 4u] << sh) >> 24u);
    let sch = f32(bitcast<i32>(sc[si / 4u + 1u] << sh) >> 24u);
    let nib = vec4<u32>(0x0F0F0F0Fu);
    let twos = vec4<u32>(0x03030303u);
    let l = (q & nib) | (((qh >> vec4<u32>(2u * k1)) & twos) << vec4<u32>(4u));
    let hv = ((q >> vec4<u32>(4u)) & nib) | (((qh >> vec4<u32>(2u * k1 + 4u)) & twos) << vec4<u32>(4u));
    let dl = dot(six(l.x), x.a0) + dot(six(l.y), x.a1) + dot(six(l.z), x.a2) + dot(six(l.w), x.a3);
    let dh = dot(six(hv.x), x.b0) + dot(six(hv.y), x.b1) + dot(six(hv.z), x.b2) + dot(six(hv.w), x.b3);
    return d * (scl * (64.0 * dl - 96.0 * x.sa) + sch * (64.0 * dh - 96.0 * x.sb));
}
//! Q5_K
// Unit u: as Q4_K's, with fifth bits 2c (low nibbles) and 2c + 1 (high ones) of fifth-bit word j
// of vec4 v % 2.

// The five-bit values in the low five bits of the four bytes of `v` as 1 + q / 32.
fn five(v: u32) -> vec4<f32> {
    let m = vec4<u32>(0x1Fu << 18u);
    return bitcast<vec4<f32>>((vec4<u32>(v << 18u, v << 10u, v << 2u, v >> 6u) & m) | ONE_BITS);
}

fn qdot(row: u32, u: u32, x: Xu) -> f32 {
    let blk = (row * (p.cols / 256u) + u / 8u) * 11u;
    let v = u % 8u;
    let c = v / 2u;
    let h = w[blk];
    let qh = w[blk + 1u + v % 2u];
    let q = w[blk + 3u + v];
    let dd = unpack2x16float(h.x);
    let sm = kscales(h.y, h.z, h.w, c);
    let nib = vec4<u32>(0x0F0F0F0Fu);
    let ones = vec4<u32>(0x01010101u);
    let l = (q & nib) | (((qh >> vec4<u32>(2u * c)) & ones) << vec4<u32>(4u));
    let hv = ((q >> vec4<u32>(4u)) & nib) | (((qh >> vec4<u32>(2u * c + 1u)) & ones) << vec4<u32>(4u));
    let dl = dot(five(l.x), x.a0) + dot(five(l.y), x.a1) + dot(five(l.z), x.a2) + dot(five(l.w), x.a3);
    let dh = dot(five(hv.x), x.b0) + dot(five(hv.y), x.b1) + dot(five(hv.z), x.b2) + dot(five(hv.w), x.b3);
    let ql = 32.0 * (dl - x.sa);
    let qhs = 32.0 * (dh - x.sb);
    return dd.x * (sm.x * ql + sm.y * qhs) - dd.y * (sm.z * x.sa + sm.w * x.sb);
}
//! Q4_0
// Unit u: block u of the row (sixteen bytes, one scale); word j's low nibbles are columns
// ucol(u, j)..+3, its high ones ucol(u, 4 + j)..+3; value (q - 8) d, and sum((q - 8) x) =
// 16 sum((1 + q / 16) x) - 24 sum(x).
fn qdot(row: u32, u: u32, x: Xu) -> f32 {
    let g = row * (p.cols / 32u) + u;
    let q = w[g];
    let d = half_at(scale_base(), g);
    let dl = dot(lo16(q.x), x.a0) + dot(lo16(q.y), x.a1) + dot(lo16(q.z), x.a2) + dot(lo16(q.w), x.a3);
    let dh = dot(hi16(q.x), x.b0) + dot(hi16(q.y), x.b1) + dot(hi16(q.z), x.b2) + dot(hi16(q.w), x.b3);
    return d * (16.0 * (dl + dh) - 24.0 * (x.sa + x.sb));
}
//! Q4_1
// Unit u: as Q4_0's, with (d, m) per block; value q d + m.
fn qdot(row: u32, u: u32, x: Xu) -> f32 {
    let g = row * (p.cols / 32u) + u;
    let q = w[g];
    let dm = unpack2x16float(w1(scale_base() + g));
    let dl = dot(lo16(q.x), x.a0) + dot(lo16(q.y), x.a1) + dot(lo16(q.z), x.a2) + dot(lo16(q.w), x.a3);
    let dh = dot(hi16(q.x), x.b0) + dot(hi16(q.y), x.b1) + dot(hi16(q.z), x.b2) + dot(hi16(q.w), x.b3);
    return dm.x * 16.0 * (dl + dh - x.sa - x.sb) + dm.y * (x.sa + x.sb);
}
