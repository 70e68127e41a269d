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
//   `fn dq(row, u) -> Dq` — unit `u` of `row`, dequantized: fields v0..v7, of which v0..v(UV-1)
//       are four consecutive columns each (the rest are zero). Named fields, not an array: a
//       kernel reads them with constant names, so they stay in registers on every compiler (an
//       array indexed in a loop may be placed in memory when the loop is not unrolled).
//   `fn unit(row, u) -> array<vec4<f32>, 8>` — the same as an array, for loops over groups.
//   `fn ucol(u, k) -> u32` — the first column of group `k` of unit `u` (a multiple of 4, so the
//       activations can be read as vec4s).
// Consecutive units of a row are consecutive vec4s of its quantized data, so the invocations of a
// subgroup reading units lane, lane + 1, … make one coalesced load.
//
// The one-token GEMV (matmul.wgsl's SLOT kernel) reads rows a *slot* at a time instead: eight
// values, whose columns are two groups of four, `scol(q)` (x and y: first columns), chosen so that
// invocations taking slots q, q + 1, … read consecutive 16-byte pieces of the activations (one
// cache line serves eight invocations; a 32-value unit per invocation reads lines 128 bytes
// apart, 32 lines per load instruction of a subgroup). `fn sdot(row, q, xa, xb) -> f32` is slot
// q of `row` dotted with the activations xa (columns scol(q).x..+3) and xb (scol(q).y..+3). The
// slot's quantized bits are one word (4-bit types; two for Q8_0, four for F16); its block's
// scales come from loads that every invocation of a subgroup makes at the same address. Values
// are dequantized (minimum included) before the dot, as `dq` does: taking the minimum out as
// min * sum(x) saves a few operations but cancels, and costs f32 accuracy the tests measure.
//
// Dequantization works on whole words: nibbles and high bits are masked and joined four bytes at
// a time, and each byte b becomes a float without an integer-to-float conversion (a slow
// instruction on GPUs): the bits 0x4B000000 | b are the f32 2^23 + b, so one subtraction gives
// b minus the type's offset, exactly. Scales are read once per unit.
//
// Layouts (weights.rs writes them): F16 row-major; Q4_K and Q5_K blocks as GGUF stores them (144
// and 176 bytes: whole vec4s); for Q8_0, Q4_0, Q4_1 and Q6_K the blocks without their scale
// (32, 16, 16, 208 bytes) for every row of the part, then the scales (f16 d, or d and m for
// Q4_1) in the same order, from word `scale_base()`.

struct Dq {
    v0: vec4<f32>,
    v1: vec4<f32>,
    v2: vec4<f32>,
    v3: vec4<f32>,
    v4: vec4<f32>,
    v5: vec4<f32>,
    v6: vec4<f32>,
    v7: vec4<f32>,
}

fn unit(row: u32, u: u32) -> array<vec4<f32>, 8> {
    let q = dq(row, u);
    return array<vec4<f32>, 8>(q.v0, q.v1, q.v2, q.v3, q.v4, q.v5, q.v6, q.v7);
}

fn wd(i: u32) -> u32 {
    return w[i >> 2u][i & 3u];
}

// The f16 at index `i` of an array of halves starting at word `base`.
fn half_at(base: u32, i: u32) -> f32 {
    return unpack2x16float(wd(base + i / 2u))[i % 2u];
}

// 2^23: the f32 whose low mantissa bits hold a small integer exactly.
const MAGIC: f32 = 8388608.0;

// The four bytes of `v` (low first) as floats, each less the type's offset (`off` is MAGIC plus
// that offset).
fn bytesf(v: u32, off: f32) -> vec4<f32> {
    let b = (vec4<u32>(v) >> vec4<u32>(0u, 8u, 16u, 24u)) & vec4<u32>(255u);
    return bitcast<vec4<f32>>(b | vec4<u32>(0x4B000000u)) - vec4<f32>(off);
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

const Z4: vec4<f32> = vec4<f32>(0.0);

// Word `i` of `w` as one 4-byte load.
fn w1(i: u32) -> u32 {
    return w[i >> 2u][i & 3u];
}

// Q4_K/Q5_K: the 6-bit scales of sub-blocks 2c and 2c + 1 (x, y) and their mins (z, w), from
// the scale words a, b, e (bytes 0..3, 4..7, 8..11) of a block's header, as floats. Both
// sub-blocks' bytes sit in the same half of each word, so they are decoded together.
fn kscales(a: u32, b: u32, e: u32, c: u32) -> vec4<f32> {
    let s = 16u * (c & 1u);
    let sa = (a >> s) & 0xFFFFu;
    let sb = (b >> s) & 0xFFFFu;
    var v = (sa & 0x3F3Fu) | ((sb & 0x3F3Fu) << 16u);
    if c >= 2u {
        let se = (e >> s) & 0xFFFFu;
        let sc = (se & 0x0F0Fu) | ((sa >> 2u) & 0x3030u);
        let m = ((se >> 4u) & 0x0F0Fu) | ((sb >> 2u) & 0x3030u);
        v = sc | (m << 16u);
    }
    return bytesf(v, MAGIC);
}

//! F16
// Row-major f16 pairs (low half first): unit u is columns 8u..8u+7.
const UV: u32 = 2u;
fn dq(row: u32, u: u32) -> Dq {
    let q = w[row * (p.cols / 8u) + u];
    return Dq(
        vec4<f32>(unpack2x16float(q.x), unpack2x16float(q.y)),
        vec4<f32>(unpack2x16float(q.z), unpack2x16float(q.w)),
        Z4, Z4, Z4, Z4, Z4, Z4,
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    return 8u * u + 4u * k;
}
fn scol(q: u32) -> vec2<u32> {
    return vec2<u32>(8u * q, 8u * q + 4u);
}
fn sdot(row: u32, q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let v = w[row * (p.cols / 8u) + q];
    return dot(vec4<f32>(unpack2x16float(v.x), unpack2x16float(v.y)), xa)
        + dot(vec4<f32>(unpack2x16float(v.z), unpack2x16float(v.w)), xb);
}
//! Q8_0
// Blocks of 32 signed bytes (two units), scales after them. Unit u: half u % 2 of block u / 2,
// columns 16u..16u+15. Flipping each byte's sign bit makes it q + 128 unsigned.
const UV: u32 = 4u;
fn scale_base() -> u32 {
    return p.rows * p.cols / 4u;
}
fn dq(row: u32, u: u32) -> Dq {
    let g = row * (p.cols / 16u) + u;
    let q = w[g] ^ vec4<u32>(0x80808080u);
    let d = half_at(scale_base(), g / 2u);
    let o = MAGIC + 128.0;
    return Dq(
        bytesf(q.x, o) * d, bytesf(q.y, o) * d, bytesf(q.z, o) * d, bytesf(q.w, o) * d,
        Z4, Z4, Z4, Z4,
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    return 16u * u + 4u * k;
}
// Slot q: words 2q and 2q + 1 of the row's bytes, columns 8q..8q+7.
fn scol(q: u32) -> vec2<u32> {
    return vec2<u32>(8u * q, 8u * q + 4u);
}
fn sdot(row: u32, q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let i = row * (p.cols / 4u) + 2u * q;
    let d = half_at(scale_base(), i / 8u);
    let o = MAGIC + 128.0;
    return d * (dot(bytesf(w1(i) ^ 0x80808080u, o), xa) + dot(bytesf(w1(i + 1u) ^ 0x80808080u, o), xb));
}
//! Q4_0
// Blocks of 32 as sixteen bytes (one unit), scales after them: byte i holds element i in its low
// nibble and element 16 + i in its high one; value (q - 8) * d. Groups 0..3 are the low nibbles
// of words 0..3, groups 4..7 the high ones: group k is columns 32u + 4k..32u + 4k + 3.
const UV: u32 = 8u;
fn scale_base() -> u32 {
    return p.rows * p.cols / 8u;
}
fn dq(row: u32, u: u32) -> Dq {
    let g = row * (p.cols / 32u) + u;
    let q = w[g];
    let d = half_at(scale_base(), g);
    let lo = q & vec4<u32>(0x0F0F0F0Fu);
    let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
    let o = MAGIC + 8.0;
    return Dq(
        bytesf(lo.x, o) * d, bytesf(lo.y, o) * d, bytesf(lo.z, o) * d, bytesf(lo.w, o) * d,
        bytesf(hi.x, o) * d, bytesf(hi.y, o) * d, bytesf(hi.z, o) * d, bytesf(hi.w, o) * d,
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    return 32u * u + 4u * k;
}
// Slot q: word q % 4 of block q / 4, its low nibbles (columns 32b + 4j..) and high ones (+ 16).
fn scol(q: u32) -> vec2<u32> {
    let c = 32u * (q / 4u) + 4u * (q % 4u);
    return vec2<u32>(c, c + 16u);
}
fn sdot(row: u32, q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let i = row * (p.cols / 8u) + q;
    let v = w1(i);
    let d = half_at(scale_base(), i / 4u);
    let o = MAGIC + 8.0;
    return d * (dot(bytesf(v & 0x0F0F0F0Fu, o), xa) + dot(bytesf((v >> 4u) & 0x0F0F0F0Fu, o), xb));
}
//! Q4_1
// As Q4_0, with a word (d, m) per block after the blocks; value q * d + m.
const UV: u32 = 8u;
fn scale_base() -> u32 {
    return p.rows * p.cols / 8u;
}
fn dq(row: u32, u: u32) -> Dq {
    let g = row * (p.cols / 32u) + u;
    let q = w[g];
    let dm = unpack2x16float(wd(scale_base() + g));
    let lo = q & vec4<u32>(0x0F0F0F0Fu);
    let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
    let d = dm.x;
    let m = vec4<f32>(dm.y);
    return Dq(
        fma(bytesf(lo.x, MAGIC), vec4<f32>(d), m), fma(bytesf(lo.y, MAGIC), vec4<f32>(d), m),
        fma(bytesf(lo.z, MAGIC), vec4<f32>(d), m), fma(bytesf(lo.w, MAGIC), vec4<f32>(d), m),
        fma(bytesf(hi.x, MAGIC), vec4<f32>(d), m), fma(bytesf(hi.y, MAGIC), vec4<f32>(d), m),
        fma(bytesf(hi.z, MAGIC), vec4<f32>(d), m), fma(bytesf(hi.w, MAGIC), vec4<f32>(d), m),
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    return 32u * u + 4u * k;
}
// Slot q: as Q4_0's; value q * d + m.
fn scol(q: u32) -> vec2<u32> {
    let c = 32u * (q / 4u) + 4u * (q % 4u);
    return vec2<u32>(c, c + 16u);
}
fn sdot(row: u32, q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let i = row * (p.cols / 8u) + q;
    let v = w1(i);
    let dm = unpack2x16float(w1(scale_base() + i / 4u));
    let d = vec4<f32>(dm.x);
    let m = vec4<f32>(dm.y);
    return dot(fma(bytesf(v & 0x0F0F0F0Fu, MAGIC), d, m), xa)
        + dot(fma(bytesf((v >> 4u) & 0x0F0F0F0Fu, MAGIC), d, m), xb);
}
//! Q4_K
// 256-column blocks of nine vec4s as stored: (d, dmin, 12 bytes of 6-bit scales and mins), then
// 128 bytes of nibbles. Unit u: vec4 v = u % 8 of the nibbles of block u / 8: bytes
// 32c + 16s + i (c = v / 2, s = v % 2, i < 16) hold element 64c + 16s + i in their low nibble
// (sub-block 2c) and 64c + 32 + 16s + i in their high one (sub-block 2c + 1); value
// d * sc * q - dmin * m. A unit's two scales and mins are decoded once for its 32 values.
const UV: u32 = 8u;
fn dq(row: u32, u: u32) -> Dq {
    let blk = (row * (p.cols / 256u) + u / 8u) * 9u;
    let v = u % 8u;
    let h = w[blk];
    let q = w[blk + 1u + v];
    let dd = unpack2x16float(h.x);
    let sl = scale_min_k4(h, 2u * (v / 2u));
    let sh = scale_min_k4(h, 2u * (v / 2u) + 1u);
    let dl = vec4<f32>(dd.x * sl.x);
    let ml = vec4<f32>(-dd.y * sl.y);
    let dh = vec4<f32>(dd.x * sh.x);
    let mh = vec4<f32>(-dd.y * sh.y);
    let lo = q & vec4<u32>(0x0F0F0F0Fu);
    let hi = (q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu);
    return Dq(
        fma(bytesf(lo.x, MAGIC), dl, ml), fma(bytesf(lo.y, MAGIC), dl, ml),
        fma(bytesf(lo.z, MAGIC), dl, ml), fma(bytesf(lo.w, MAGIC), dl, ml),
        fma(bytesf(hi.x, MAGIC), dh, mh), fma(bytesf(hi.y, MAGIC), dh, mh),
        fma(bytesf(hi.z, MAGIC), dh, mh), fma(bytesf(hi.w, MAGIC), dh, mh),
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    let v = u % 8u;
    return 256u * (u / 8u) + 64u * (v / 2u) + 16u * (v % 2u) + 4u * (k % 4u) + 32u * (k / 4u);
}
// Slot q: nibble word i = q % 32 of block q / 32 (byte 32c + o, c = i / 8, o = 4 (i % 8)): low
// nibbles are columns 64c + o.. of sub-block 2c, high ones 64c + 32 + o.. of sub-block 2c + 1.
fn scol(q: u32) -> vec2<u32> {
    let i = q % 32u;
    let c = 256u * (q / 32u) + 64u * (i / 8u) + 4u * (i % 8u);
    return vec2<u32>(c, c + 32u);
}
fn sdot(row: u32, q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let blk = (row * (p.cols / 256u) + q / 32u) * 9u;
    let i = q % 32u;
    let h = w[blk];
    let v = w1(4u * blk + 4u + i);
    let dd = unpack2x16float(h.x);
    let sm = kscales(h.y, h.z, h.w, i / 8u);
    let lo = fma(bytesf(v & 0x0F0F0F0Fu, MAGIC), vec4<f32>(dd.x * sm.x), vec4<f32>(-dd.y * sm.z));
    let hi = fma(bytesf((v >> 4u) & 0x0F0F0F0Fu, MAGIC), vec4<f32>(dd.x * sm.y), vec4<f32>(-dd.y * sm.w));
    return dot(lo, xa) + dot(hi, xb);
}
//! Q5_K
// 256-column blocks of eleven vec4s as stored: the Q4_K header, 32 bytes of fifth bits, then the
// nibbles as in Q4_K. Byte 16s + i of the fifth bits holds, in bit 2c, the high bit of element
// 64c + 16s + i and, in bit 2c + 1, that of element 64c + 32 + 16s + i. The fifth bits join the
// nibbles four bytes at a time (word-wide masks and shifts).
const UV: u32 = 8u;
fn dq(row: u32, u: u32) -> Dq {
    let blk = (row * (p.cols / 256u) + u / 8u) * 11u;
    let v = u % 8u;
    let c = v / 2u;
    let h = w[blk];
    let qh = w[blk + 1u + v % 2u];
    let q = w[blk + 3u + v];
    let dd = unpack2x16float(h.x);
    let sl = scale_min_k4(h, 2u * c);
    let sh = scale_min_k4(h, 2u * c + 1u);
    let dl = vec4<f32>(dd.x * sl.x);
    let ml = vec4<f32>(-dd.y * sl.y);
    let dh = vec4<f32>(dd.x * sh.x);
    let mh = vec4<f32>(-dd.y * sh.y);
    let ones = vec4<u32>(0x01010101u);
    let lo = (q & vec4<u32>(0x0F0F0F0Fu)) | (((qh >> vec4<u32>(2u * c)) & ones) << vec4<u32>(4u));
    let hi = ((q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu))
        | (((qh >> vec4<u32>(2u * c + 1u)) & ones) << vec4<u32>(4u));
    return Dq(
        fma(bytesf(lo.x, MAGIC), dl, ml), fma(bytesf(lo.y, MAGIC), dl, ml),
        fma(bytesf(lo.z, MAGIC), dl, ml), fma(bytesf(lo.w, MAGIC), dl, ml),
        fma(bytesf(hi.x, MAGIC), dh, mh), fma(bytesf(hi.y, MAGIC), dh, mh),
        fma(bytesf(hi.z, MAGIC), dh, mh), fma(bytesf(hi.w, MAGIC), dh, mh),
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    let v = u % 8u;
    return 256u * (u / 8u) + 64u * (v / 2u) + 16u * (v % 2u) + 4u * (k % 4u) + 32u * (k / 4u);
}
// Slot q: as Q4_K's (nibble word i = q % 32, c = i / 8); the fifth bits of its bytes are bits 2c
// and 2c + 1 of fifth-bit word i % 8.
fn scol(q: u32) -> vec2<u32> {
    let i = q % 32u;
    let c = 256u * (q / 32u) + 64u * (i / 8u) + 4u * (i % 8u);
    return vec2<u32>(c, c + 32u);
}
fn sdot(row: u32, q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let blk = (row * (p.cols / 256u) + q / 32u) * 11u;
    let i = q % 32u;
    let c = i / 8u;
    let h = w[blk];
    let v = w1(4u * blk + 12u + i);
    let qh = w1(4u * blk + 4u + i % 8u);
    let dd = unpack2x16float(h.x);
    let sm = kscales(h.y, h.z, h.w, c);
    let ones = 0x01010101u;
    let l = (v & 0x0F0F0F0Fu) | (((qh >> (2u * c)) & ones) << 4u);
    let u = ((v >> 4u) & 0x0F0F0F0Fu) | (((qh >> (2u * c + 1u)) & ones) << 4u);
    let lo = fma(bytesf(l, MAGIC), vec4<f32>(dd.x * sm.x), vec4<f32>(-dd.y * sm.z));
    let hi = fma(bytesf(u, MAGIC), vec4<f32>(dd.x * sm.y), vec4<f32>(-dd.y * sm.w));
    return dot(lo, xa) + dot(hi, xb);
}
//! Q6_K
// 256-column blocks of thirteen vec4s (GGUF's block without its f16 d: 128 bytes of low
// nibbles, 64 of high bit pairs, 16 signed scales), the d's after every block. In half hf
// (128 elements) element 128hf + 32k + l has its low bits in byte 64hf + l + 32(k & 1) of the
// nibbles (low nibble for k < 2, high for k >= 2) and its high bits in bits 2k..2k+1 of byte
// 32hf + l of the pairs; value d * scale[(128hf + 32k + l) / 16] * (q - 32). Unit u: nibble
// vec4 v = u % 8 of block u / 8, so hf = v / 4, k & 1 = (v % 4) / 2, l = 16(v % 2) + i. The
// high bit pairs join the nibbles four bytes at a time.
const UV: u32 = 8u;
fn scale_base() -> u32 {
    return p.rows * (p.cols / 256u) * 52u;
}
fn dq(row: u32, u: u32) -> Dq {
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
    let dl = vec4<f32>(d * f32((i32(byte_of(sc, si)) << 24u) >> 24u));
    let dh = vec4<f32>(d * f32((i32(byte_of(sc, si + 4u)) << 24u) >> 24u));
    let twos = vec4<u32>(0x03030303u);
    let lo = (q & vec4<u32>(0x0F0F0F0Fu)) | (((qh >> vec4<u32>(2u * k1)) & twos) << vec4<u32>(4u));
    let hi = ((q >> vec4<u32>(4u)) & vec4<u32>(0x0F0F0F0Fu))
        | (((qh >> vec4<u32>(2u * k1 + 4u)) & twos) << vec4<u32>(4u));
    let o = MAGIC + 32.0;
    return Dq(
        bytesf(lo.x, o) * dl, bytesf(lo.y, o) * dl, bytesf(lo.z, o) * dl, bytesf(lo.w, o) * dl,
        bytesf(hi.x, o) * dh, bytesf(hi.y, o) * dh, bytesf(hi.z, o) * dh, bytesf(hi.w, o) * dh,
    );
}
fn ucol(u: u32, k: u32) -> u32 {
    let v = u % 8u;
    return 256u * (u / 8u) + 128u * (v / 4u) + 32u * ((v % 4u) / 2u) + 16u * (v % 2u)
        + 4u * (k % 4u) + 64u * (k / 4u);
}
// Slot q: nibble word i = q % 32 of block q / 32: half hf = i / 16, k1 = (i % 16) / 8, l = 4 (i % 8);
// low nibbles are columns 128hf + 32k1 + l.. (k = k1), high ones 64 further (k = k1 + 2); their
// high bit pairs are bits 2k.. of high-bit word 8hf + i % 8; scales 8hf + 2k + l / 16.
fn scol(q: u32) -> vec2<u32> {
    let i = q % 32u;
    let c = 256u * (q / 32u) + 128u * (i / 16u) + 32u * ((i % 16u) / 8u) + 4u * (i % 8u);
    return vec2<u32>(c, c + 64u);
}
fn sdot(row: u32, q: u32, xa: vec4<f32>, xb: vec4<f32>) -> f32 {
    let g = row * (p.cols / 256u) + q / 32u;
    let base = g * 52u;
    let i = q % 32u;
    let hf = i / 16u;
    let k1 = (i % 16u) / 8u;
    let v = w1(base + i);
    let qh = w1(base + 32u + 8u * hf + i % 8u);
    let si = 8u * hf + 2u * k1 + (i % 8u) / 4u;
    let sh = 24u - 8u * (si % 4u);
    let scl = f32(bitcast<i32>(w1(base + 48u + si / 4u) << sh) >> 24u);
    let sch = f32(bitcast<i32>(w1(base + 49u + si / 4u) << sh) >> 24u);
    let d = half_at(scale_base(), g);
    let twos = 0x03030303u;
    let l = (v & 0x0F0F0F0Fu) | (((qh >> (2u * k1)) & twos) << 4u);
    let u = ((v >> 4u) & 0x0F0F0F0Fu) | (((qh >> (2u * k1 + 4u)) & twos) << 4u);
    let o = MAGIC + 32.0;
    return d * (scl * dot(bytesf(l, o), xa) + sch * dot(bytesf(u, o), xb));
}
