//! F16
// Row-major f16, two per word (low half first). Run c: columns 8c..8c+7.
fn load8(row: u32, c: u32) -> array<vec4<f32>, 2> {
    let o = 4u * c;
    let a = unpack2x16float(wd(row, o));
    let b = unpack2x16float(wd(row, o + 1u));
    let e = unpack2x16float(wd(row, o + 2u));
    let f = unpack2x16float(wd(row, o + 3u));
    return array<vec4<f32>, 2>(vec4<f32>(a, b), vec4<f32>(e, f));
}
fn col8(c: u32) -> vec2<u32> {
    return vec2<u32>(8u * c, 8u * c + 4u);
}
//! Q8_0
// Blocks of 32: word 0 the f16 scale (high half zero), words 1..8 the 32 signed bytes. Run c:
// columns 8c..8c+7.
fn i8x4(v: u32) -> vec4<f32> {
    return vec4<f32>((vec4<i32>(bitcast<i32>(v)) << vec4<u32>(24u, 16u, 8u, 0u)) >> vec4<u32>(24u));
}
fn load8(row: u32, c: u32) -> array<vec4<f32>, 2> {
    let blk = 9u * (c / 4u);
    let d = unpack2x16float(wd(row, blk)).x;
    let o = blk + 1u + 2u * (c % 4u);
    return array<vec4<f32>, 2>(i8x4(wd(row, o)) * d, i8x4(wd(row, o + 1u)) * d);
}
fn col8(c: u32) -> vec2<u32> {
    return vec2<u32>(8u * c, 8u * c + 4u);
}
//! Q4_0
// Blocks of 32: word 0 the f16 scale, words 1..4 sixteen bytes whose low nibbles are elements
// 0..15 and high nibbles 16..31; value (q - 8) * d. Run c: word c % 4 of block c / 4, columns
// 4j..4j+3 (low nibbles) and 16+4j..16+4j+3 (high), j = c % 4.
fn load8(row: u32, c: u32) -> array<vec4<f32>, 2> {
    let blk = 5u * (c / 4u);
    let d = unpack2x16float(wd(row, blk)).x;
    let q = vec4<u32>(wd(row, blk + 1u + c % 4u)) >> vec4<u32>(0u, 8u, 16u, 24u);
    let lo = vec4<f32>(q & vec4<u32>(15u)) - 8.0;
    let hi = vec4<f32>((q >> vec4<u32>(4u)) & vec4<u32>(15u)) - 8.0;
    return array<vec4<f32>, 2>(lo * d, hi * d);
}
fn col8(c: u32) -> vec2<u32> {
    let b = 32u * (c / 4u) + 4u * (c % 4u);
    return vec2<u32>(b, b + 16u);
}
//! Q4_1
// Blocks of 32: word 0 the f16 scale d and minimum m, words 1..4 the nibbles as in Q4_0; value
// q * d + m.
fn load8(row: u32, c: u32) -> array<vec4<f32>, 2> {
    let blk = 5u * (c / 4u);
    let dm = unpack2x16float(wd(row, blk));
    let q = vec4<u32>(wd(row, blk + 1u + c % 4u)) >> vec4<u32>(0u, 8u, 16u, 24u);
    let lo = vec4<f32>(q & vec4<u32>(15u));
    let hi = vec4<f32>((q >> vec4<u32>(4u)) & vec4<u32>(15u));
    return array<vec4<f32>, 2>(lo * dm.x + dm.y, hi * dm.x + dm.y);
}
fn col8(c: u32) -> vec2<u32> {
    let b = 32u * (c / 4u) + 4u * (c % 4u);
    return vec2<u32>(b, b + 16u);
}
