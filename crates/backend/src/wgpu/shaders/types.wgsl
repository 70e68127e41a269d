// How each weight format is read on the device. The host prepends this prelude and one type's
// section (`//! NAME`) to a shader that reads weights (kernels::type_source).
//
// Contract with the including shader: it declares
//   `w: array<vec4<u32>>` — one part of a weight matrix, in the device layout of weights.rs
//   `p` with fields `rows` (rows of the part) and `cols` (row length, a multiple of UV * 4)
// and gets from the section:
//   `const UV: u32` — groups of four columns in one *unit*. A unit is what one 16-byte load of
//       quantized data (one vec4<u32>) holds: 8 values for F16, 16 for Q8_0, 32 for the 4/5/6-bit
//       types. Units per row: `p.cols / (4u * UV)`.
//   `fn unit(row, u) -> array<vec4<f32>, 8>` — unit `u` of `row`, dequantized; entries 0..UV
//       are four consecutive columns each (the rest are zero).
//   `fn ucol(u, k) -> u32` — the first column of group `k` of unit `u` (a multiple of 4, so the
//       activations can be read as vec4s).
// Consecutive units of a row are consecutive vec4s of its quantized data, so the invocations of a
// subgroup reading units lane, lane + 1, … make one coalesced load. The older run-of-eight
// interface stays for kernels written against it: `load8(row, c)` is groups 2j, 2j + 1 of unit
// c / (UV / 2) (j = c % (UV / 2)) and `col8(c)` their first columns; it dequantizes a whole unit
// per call, so new kernels should use `unit`.
//
// Layouts (weights.rs writes them): F16 row-major; Q4_K and Q5_K blocks as GGUF stores them (144
// and 176 bytes: whole vec4s); for Q8_0, Q4_0, Q4_1 and Q6_K the blocks without their scale
// (32, 16, 16, 208 bytes) for every row of the part, then the scales (f16 d, or d and m for
// Q4_1) in the same order, from word `scale_base()`.

fn wd(i: u32) -> u32 {
    return w[i >> 2u][i & 3u];
}

// The f16 at index `i` of an array of halves starting at word `base`.
fn half_at(base: u32, i: u32) -> f32 {
    return unpack2x16float(wd(base + i / 2u))[i % 2u];
}

// The four bytes of `v`, low first.
fn bytes4(v: u32) -> vec4<u32> {
    return (vec4<u32>(v) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u);
}

// The four bytes of `v` as signed values.
fn i8x4(v: u32) -> vec4<f32> {
    return vec4<f32>((vec4<i32>(bitcast<i32>(v)) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}

// Byte `i` (0..16) of a vec4<u32>.
fn byte_of(v: vec4<u32>, i: u32) -> u32 {
    return (v[i / 4u] >> (8u * (i % 4u))) & 255u;
}

// Q4_K/Q5_K: the 6-bit scale and min of sub-block j (0..8) from the 12 bytes in words y, z, w
// of a block's first vec4 (ggml's get_scale_min_k4).
fn scale_min_k4(h: vec4<u32>, j: u32) -> vec2<f32> {
    let q = vec4<u32>(h.y, h.z, h.w, 0u);
    if j < 4u {
        return vec2<f32>(f32(byte_of(q, j) & 63u), f32(byte_of(q, j + 4u) & 63u));
    }
    let sc = (byte_of(q, j + 4u) & 15u) | ((byte_of(q, j - 4u) >> 6u) << 4u);
    let m = (byte_of(q, j + 4u) >> 4u) | ((byte_of(q, j) >> 6u) << 4u);
    return vec2<f32>(f32(sc), f32(m));
}

fn load8(row: u32, c: u32) -> array<vec4<f32>, 2> {
    let h = UV / 2u;
    var v = unit(row, c / h);
    let k = 2u * (c % h);
    return array<vec4<f32>, 2>(v[k], v[k + 1u]);
}

fn col8(c: u32) -> vec2<u32> {
    let h = UV / 2u;
    let k = 2u * (c % h);
    return vec2<u32>(ucol(c / h, k), ucol(c / h, k + 1u));
}

const Z4: vec4<f32> = vec4<f32>(0.0);

//! F16
// Row-major f16 pairs (low half first): unit u is columns 8u..8u+7.
const UV: u32 = 2u;
fn unit(row: u32, u: u32) -> array<vec4<f32>, 8> {
    let q = w[row * (p.cols / 8u) + u];
    return array<vec4<f32>, 8>(
        vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
        vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)),
        Z4, Z4, Z4, Z4, Z4, Z4,
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    return 8u * u + 4u * k;
}
//! Q8_0
// Blocks of 32 signed bytes (two units), scales after them. Unit u: half u % 2 of block u / 2,
// columns 16u..16u+15.
const UV: u32 = 4u;
fn scale_base() -> u32 {
    return p.rows * p.cols / 4u;
}
fn unit(row: u32, u: u32) -> array<vec4<f32>, 8> {
    let g = row * (p.cols / 16u) + u;
    let q = w[g];
    let d = half_at(scale_base(), g / 2u);
    return array<vec4<f32>, 8>(
        i8x4(q.x) * d, i8x4(q.y) * d, i8x4(q.z) * d, i8x4(q.w) * d,
        Z4, Z4, Z4, Z4,
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    return 16u * u + 4u * k;
}
//! Q4_0
// Blocks of 32 as sixteen bytes (one unit), scales after them: byte i holds element i in its low
// nibble and element 16 + i in its high one; value (q - 8) * d. Groups 0..3 are the low nibbles
// of words 0..3, groups 4..7 the high ones: group k is columns 32u + 4k..32u + 4k + 3.
const UV: u32 = 8u;
fn scale_base() -> u32 {
    return p.rows * p.cols / 8u;
}
fn unit(row: u32, u: u32) -> array<vec4<f32>, 8> {
    let g = row * (p.cols / 32u) + u;
    let q = w[g];
    let d = half_at(scale_base(), g);
    var o: array<vec4<f32>, 8>;
    for (var j = 0u; j < 4u; j++) {
        let b = vec4<u32>(q[j]) >> vec4<u32>(0u, 8u, 16u, 24u);
        o[j] = (vec4<f32>(b & vec4<u32>(15u)) - 8.0) * d;
        o[j + 4u] = (vec4<f32>((b >> vec4<u32>(4u)) & vec4<u32>(15u)) - 8.0) * d;
    }
    return o;
}
fn ucol(u: u32, k: u32) -> u32 {
    return 32u * u + 4u * k;
}
//! Q4_1
// As Q4_0, with a word (d, m) per block after the blocks; value q * d + m.
const UV: u32 = 8u;
fn scale_base() -> u32 {
    return p.rows * p.cols / 8u;
}
fn unit(row: u32, u: u32) -> array<vec4<f32>, 8> {
    let g = row * (p.cols / 32u) + u;
    let q = w[g];
    let dm = unpack2x16float(wd(scale_base() + g));
    var o: array<vec4<f32>, 8>;
    for (var j = 0u; j < 4u; j++) {
        let b = vec4<u32>(q[j]) >> vec4<u32>(0u, 8u, 16u, 24u);
        o[j] = vec4<f32>(b & vec4<u32>(15u)) * dm.x + dm.y;
        o[j + 4u] = vec4<f32>((b >> vec4<u32>(4u)) & vec4<u32>(15u)) * dm.x + dm.y;
    }
    return o;
}
fn ucol(u: u32, k: u32) -> u32 {
    return 32u * u + 4u * k;
}
//! Q4_K
// 256-column blocks of nine vec4s as stored: (d, dmin, 12 bytes of 6-bit scales and mins), then
// 128 bytes of nibbles. Unit u: vec4 v = u % 8 of the nibbles of block u / 8: bytes
// 32c + 16s + i (c = v / 2, s = v % 2, i < 16) hold element 64c + 16s + i in their low nibble
// (sub-block 2c) and 64c + 32 + 16s + i in their high one (sub-block 2c + 1); value
// d * sc * q - dmin * m.
const UV: u32 = 8u;
fn unit(row: u32, u: u32) -> array<vec4<f32>, 8> {
    let blk = (row * (p.cols / 256u) + u / 8u) * 9u;
    let v = u % 8u;
    let h = w[blk];
    let q = w[blk + 1u + v];
    let dd = unpack2x16float(h.x);
    let lo = scale_min_k4(h, 2u * (v / 2u));
    let hi = scale_min_k4(h, 2u * (v / 2u) + 1u);
    let dl = dd.x * lo.x;
    let ml = dd.y * lo.y;
    let dh = dd.x * hi.x;
    let mh = dd.y * hi.y;
    var o: array<vec4<f32>, 8>;
    for (var j = 0u; j < 4u; j++) {
        let b = vec4<u32>(q[j]) >> vec4<u32>(0u, 8u, 16u, 24u);
        o[j] = dl * vec4<f32>(b & vec4<u32>(15u)) - ml;
        o[j + 4u] = dh * vec4<f32>((b >> vec4<u32>(4u)) & vec4<u32>(15u)) - mh;
    }
    return o;
}
fn ucol(u: u32, k: u32) -> u32 {
    let v = u % 8u;
    return 256u * (u / 8u) + 64u * (v / 2u) + 16u * (v % 2u) + 4u * (k % 4u) + 32u * (k / 4u);
}
//! Q5_K
// 256-column blocks of eleven vec4s as stored: the Q4_K header, 32 bytes of fifth bits, then the
// nibbles as in Q4_K. Byte 16s + i of the fifth bits holds, in bit 2c, the high bit of element
// 64c + 16s + i and, in bit 2c + 1, that of element 64c + 32 + 16s + i.
const UV: u32 = 8u;
fn unit(row: u32, u: u32) -> array<vec4<f32>, 8> {
    let blk = (row * (p.cols / 256u) + u / 8u) * 11u;
    let v = u % 8u;
    let c = v / 2u;
    let h = w[blk];
    let qh = w[blk + 1u + v % 2u];
    let q = w[blk + 3u + v];
    let dd = unpack2x16float(h.x);
    let lo = scale_min_k4(h, 2u * c);
    let hi = scale_min_k4(h, 2u * c + 1u);
    let dl = dd.x * lo.x;
    let ml = dd.y * lo.y;
    let dh = dd.x * hi.x;
    let mh = dd.y * hi.y;
    var o: array<vec4<f32>, 8>;
    for (var j = 0u; j < 4u; j++) {
        let b = vec4<u32>(q[j]) >> vec4<u32>(0u, 8u, 16u, 24u);
        let e = (vec4<u32>(qh[j]) >> vec4<u32>(0u, 8u, 16u, 24u)) >> vec4<u32>(2u * c);
        let ql = (b & vec4<u32>(15u)) | ((e & vec4<u32>(1u)) << vec4<u32>(4u));
        let qhi = ((b >> vec4<u32>(4u)) & vec4<u32>(15u)) | ((e & vec4<u32>(2u)) << vec4<u32>(3u));
        o[j] = dl * vec4<f32>(ql) - ml;
        o[j + 4u] = dh * vec4<f32>(qhi) - mh;
    }
    return o;
}
fn ucol(u: u32, k: u32) -> u32 {
    let v = u % 8u;
    return 256u * (u / 8u) + 64u * (v / 2u) + 16u * (v % 2u) + 4u * (k % 4u) + 32u * (k / 4u);
}
//! Q6_K
// 256-column blocks of thirteen vec4s (GGUF's block without its f16 d: 128 bytes of low
// nibbles, 64 of high bit pairs, 16 signed scales), the d's after every block. In half hf
// (128 elements) element 128hf + 32k + l has its low bits in byte 64hf + l + 32(k & 1) of the
// nibbles (low nibble for k < 2, high for k >= 2) and its high bits in bits 2k..2k+1 of byte
// 32hf + l of the pairs; value d * scale[(128hf + 32k + l) / 16] * (q - 32). Unit u: nibble
// vec4 v = u % 8 of block u / 8, so hf = v / 4, k & 1 = (v % 4) / 2, l = 16(v % 2) + i.
const UV: u32 = 8u;
fn scale_base() -> u32 {
    return p.rows * (p.cols / 256u) * 52u;
}
fn unit(row: u32, u: u32) -> array<vec4<f32>, 8> {
    let g = row * (p.cols / 256u) + u / 8u;
    let blk = g * 13u;
    let v = u % 8u;
    let hf = v / 4u;
    let k1 = (v % 4u) / 2u;
    let q = w[blk + v];
    let qh = w[blk + 8u + 2u * hf + v % 2u];
    let sc = w[blk + 12u];
    let d = half_at(scale_base(), g);
    // Scales of k = k1 and k = k1 + 2: indexes 8hf + 2k + v % 2, as signed bytes.
    let si = 8u * hf + 2u * k1 + v % 2u;
    let dl = d * f32((i32(byte_of(sc, si)) << 24u) >> 24u);
    let dh = d * f32((i32(byte_of(sc, si + 4u)) << 24u) >> 24u);
    var o: array<vec4<f32>, 8>;
    for (var j = 0u; j < 4u; j++) {
        let b = vec4<u32>(q[j]) >> vec4<u32>(0u, 8u, 16u, 24u);
        let e = vec4<u32>(qh[j]) >> vec4<u32>(0u, 8u, 16u, 24u);
        let ql = (b & vec4<u32>(15u)) | (((e >> vec4<u32>(2u * k1)) & vec4<u32>(3u)) << vec4<u32>(4u));
        let qhi = ((b >> vec4<u32>(4u)) & vec4<u32>(15u))
            | (((e >> vec4<u32>(2u * k1 + 4u)) & vec4<u32>(3u)) << vec4<u32>(4u));
        o[j] = dl * (vec4<f32>(ql) - 32.0);
        o[j + 4u] = dh * (vec4<f32>(qhi) - 32.0);
    }
    return o;
}
fn ucol(u: u32, k: u32) -> u32 {
    let v = u % 8u;
    return 256u * (u / 8u) + 128u * (v / 4u) + 32u * ((v % 4u) / 2u) + 16u * (v % 2u)
        + 4u * (k % 4u) + 64u * (k / 4u);
}
