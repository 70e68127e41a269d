//! F16
// Row-major f16, two per word (low half first).
fn load8(base: u32, c: u32) -> array<f32, 8> {
    let o = base + 4u * c;
    let a = unpack2x16float(w[o]);
    let b = unpack2x16float(w[o + 1u]);
    let e = unpack2x16float(w[o + 2u]);
    let f = unpack2x16float(w[o + 3u]);
    return array<f32, 8>(a.x, a.y, b.x, b.y, e.x, e.y, f.x, f.y);
}
fn col8(c: u32, k: u32) -> u32 {
    return 8u * c + k;
}
//! Q8_0
// Blocks of 32: word 0 the f16 scale (high half zero), words 1..8 the 32 signed bytes.
fn load8(base: u32, c: u32) -> array<f32, 8> {
    let blk = base + 9u * (c / 4u);
    let d = unpack2x16float(w[blk]).x;
    let o = blk + 1u + 2u * (c % 4u);
    let a = bitcast<i32>(w[o]);
    let b = bitcast<i32>(w[o + 1u]);
    var r: array<f32, 8>;
    for (var k = 0u; k < 4u; k++) {
        r[k] = f32(extractBits(a, 8u * k, 8u)) * d;
        r[k + 4u] = f32(extractBits(b, 8u * k, 8u)) * d;
    }
    return r;
}
fn col8(c: u32, k: u32) -> u32 {
    return 8u * c + k;
}
//! Q4_0
// Blocks of 32: word 0 the f16 scale, words 1..4 sixteen bytes whose low nibbles are elements
// 0..15 and high nibbles 16..31; value (q - 8) * d.
fn load8(base: u32, c: u32) -> array<f32, 8> {
    let blk = base + 5u * (c / 4u);
    let d = unpack2x16float(w[blk]).x;
    let q = w[blk + 1u + c % 4u];
    var r: array<f32, 8>;
    for (var k = 0u; k < 4u; k++) {
        r[k] = (f32((q >> (8u * k)) & 15u) - 8.0) * d;
        r[k + 4u] = (f32((q >> (8u * k + 4u)) & 15u) - 8.0) * d;
    }
    return r;
}
fn col8(c: u32, k: u32) -> u32 {
    return 32u * (c / 4u) + 4u * (c % 4u) + k % 4u + 16u * (k / 4u);
}
//! Q4_1
// Blocks of 32: word 0 the f16 scale d and minimum m, words 1..4 the nibbles as in Q4_0; value
// q * d + m.
fn load8(base: u32, c: u32) -> array<f32, 8> {
    let blk = base + 5u * (c / 4u);
    let dm = unpack2x16float(w[blk]);
    let q = w[blk + 1u + c % 4u];
    var r: array<f32, 8>;
    for (var k = 0u; k < 4u; k++) {
        r[k] = f32((q >> (8u * k)) & 15u) * dm.x + dm.y;
        r[k + 4u] = f32((q >> (8u * k + 4u)) & 15u) * dm.x + dm.y;
    }
    return r;
}
fn col8(c: u32, k: u32) -> u32 {
    return 32u * (c / 4u) + 4u * (c % 4u) + k % 4u + 16u * (k / 4u);
}
