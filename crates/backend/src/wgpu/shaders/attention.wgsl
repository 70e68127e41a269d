// Paged attention of prompt chunks (and of any step the split decode kernel does not take), in
// the flash-attention manner, with the step's K/V written into their cache slots by the same
// kernel (the fused KV write).
//
// Why tiles: a prompt chunk's queries of one sequence attend over nearly the same keys, so a
// workgroup that takes several of them reads each key once for all of them instead of once per
// token. A workgroup takes one tile of queries, consecutive tokens of one sequence (the host
// cuts every sequence's chunk into tiles of at most QT tokens, QT * group <= 16 rows), and one KV
// head with every query head of its group: up to 16 query rows. It streams the keys that tile
// needs (from the first key the window admits to its last query's position) in tiles of KT keys
// through workgroup memory, looking each key up in the sequence's block table; each row keeps an
// online softmax in f32 and its masked scores (a key after the row's position, or before its
// window, counts zero); the output is written once at the end.
//
// Layout: 128 invocations, 8 lanes per row. A lane scores the keys lane, lane + 8, … of the K
// tile against its row's Q (from workgroup memory, f32), the row's maximum and sum are combined
// across its 8 lanes (`row_max` / `row_sum`: subgroup shuffles, or workgroup memory where the
// adapter has none), the probabilities go to workgroup memory, the V tile replaces the K tile,
// and each lane accumulates its pairs of dims (lane, lane + 8, …) of the row's output.
//
// The parameter block, bindings, key reads, fused KV write and key span: attention_common.wgsl.

const WG: u32 = 128u;
const ROWS: u32 = 16u;
const LANES: u32 = 8u;
const KVW: u32 = 2112u; // words of the K/V tile
const MAX_KT: u32 = 64u;
const MAX_PAIRS: u32 = 16u; // pairs of dims per lane: head_dim 256 / 2 / LANES
const NEG: f32 = -3.0e38;

var<workgroup> qs: array<f32, 4096>;  // [ROWS, head_dim]
var<workgroup> kvs: array<u32, KVW>;  // [kt, head_dim / 2 + 1]: the K tile, then the V tile
var<workgroup> sc: array<f32, 1024>;  // [ROWS, kt]: probabilities
var<workgroup> span: vec2<u32>;       // the tile's first key and last key + 1

@compute @workgroup_size(128)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let kvh = wg.x;
    let t0 = tok[wg.y * 8u + 5u];
    let cnt = tok[wg.y * 8u + 6u];
    let hd = p.head_dim;
    let half = hd / 2u;
    let g = p.group;
    let kt = p.kt;
    let nrows = cnt * g;
    // Words per key row of the tile: one of padding, so the 8 lanes of a row, which score
    // different keys at the same dims, read different banks.
    let ks = half + 1u;
    let first_new = tok[t0 * 8u + 2u];
    let new_row = tok[t0 * 8u + 3u];
    let toff = tok[t0 * 8u + 4u];

    write_new_kv(li, WG, t0, cnt, kvh);
    // Q rows: row r is head (r % g) of the group for token t0 + r / g.
    for (var w = li; w < nrows * hd; w += WG) {
        let r = w / hd;
        let t = t0 + r / g;
        qs[w] = qkv[t * p.stride + (kvh * g + r % g) * hd + w % hd];
    }
    if li == 0u {
        span = tile_span(t0, cnt);
    }
    let sp = workgroupUniformLoad(&span);

    // This lane's row (rows past nrows compute on stale values and write nothing).
    let row = li / LANES;
    let lane = li % LANES;
    let live = row < nrows;
    let rt = t0 + min(row, max(nrows, 1u) - 1u) / g;
    let pos = tok[rt * 8u];
    var first = 0u;
    if p.window != 0u && pos + 1u > p.window {
        first = pos + 1u - p.window;
    }
    var m = NEG;
    var l = 0.0;
    var acc: array<f32, 32>; // [MAX_PAIRS][2]: pairs lane, lane + 8, …
    let per = kt / LANES;
    for (var k0 = sp.x; k0 < sp.y; k0 += kt) {
        for (var w = li; w < kt * half; w += WG) {
            kvs[w / half * ks + w % half] = kv_word(true, k0 + w / half, sp.y, kvh, w % half, first_new, new_row, toff);
        }
        workgroupBarrier();
        var s: array<f32, 8>; // MAX_KT / LANES
        var tmax = NEG;
        for (var c = 0u; c < per; c++) {
            let jj = lane + LANES * c;
            let j = k0 + jj;
            var x = NEG;
            if live && j >= first && j <= pos {
                var d = 0.0;
                for (var i = 0u; i < half; i++) {
                    let k = unpack2x16float(kvs[jj * ks + i]);
                    d += qs[row * hd + 2u * i] * k.x + qs[row * hd + 2u * i + 1u] * k.y;
                }
                x = d * p.scale;
            }
            s[c] = x;
            tmax = max(tmax, x);
        }
        let mn = max(m, row_max(tmax, li));
        let corr = exp(m - mn);
        m = mn;
        var part = 0.0;
        for (var c = 0u; c < per; c++) {
            var pr = 0.0;
            if s[c] > NEG {
                pr = exp(s[c] - mn);
            }
            part += pr;
            sc[row * kt + lane + LANES * c] = pr;
        }
        l = l * corr + part;
        for (var e = 0u; e < 2u * MAX_PAIRS; e++) {
            acc[e] *= corr;
        }
        workgroupBarrier();
        for (var w = li; w < kt * half; w += WG) {
            kvs[w / half * ks + w % half] = kv_word(false, k0 + w / half, sp.y, kvh, w % half, first_new, new_row, toff);
        }
        workgroupBarrier();
        let cnt_k = min(kt, sp.y - k0);
        for (var jj = 0u; jj < cnt_k; jj++) {
            let pr = sc[row * kt + jj];
            for (var e = 0u; e < MAX_PAIRS; e++) {
                let i = lane + LANES * e;
                if i < half {
                    let v = unpack2x16float(kvs[jj * ks + i]);
                    acc[2u * e] += pr * v.x;
                    acc[2u * e + 1u] += pr * v.y;
                }
            }
        }
        workgroupBarrier();
    }
    let total = row_sum(l, li);
    if live {
        let t = t0 + row / g;
        let inv = 1.0 / total;
        for (var e = 0u; e < MAX_PAIRS; e++) {
            let i = lane + LANES * e;
            if i < half {
                let o = t * p.out_stride + (kvh * g + row % g) * hd + 2u * i;
                out[o] = acc[2u * e] * inv;
                out[o + 1u] = acc[2u * e + 1u] * inv;
            }
        }
    }
}

//! SUBGROUP
// A row's maximum and sum over its 8 lanes: a butterfly of shuffles (the lanes of a row lie in
// one subgroup when subgroups hold a multiple of 8 invocations in order of local index).
fn row_max(x: f32, li: u32) -> f32 {
    var v = x;
    for (var o = LANES / 2u; o > 0u; o >>= 1u) {
        v = max(v, subgroupShuffleXor(v, o));
    }
    return v;
}

fn row_sum(x: f32, li: u32) -> f32 {
    var v = x;
    for (var o = LANES / 2u; o > 0u; o >>= 1u) {
        v += subgroupShuffleXor(v, o);
    }
    return v;
}

//! SHARED
// The same through workgroup memory, for adapters without subgroups (or with subgroups of
// fewer than 8 invocations).
var<workgroup> red: array<f32, WG>;

fn row_max(x: f32, li: u32) -> f32 {
    red[li] = x;
    workgroupBarrier();
    var v = NEG;
    let base = li - li % LANES;
    for (var k = 0u; k < LANES; k++) {
        v = max(v, red[base + k]);
    }
    workgroupBarrier();
    return v;
}

fn row_sum(x: f32, li: u32) -> f32 {
    red[li] = x;
    workgroupBarrier();
    var v = 0.0;
    let base = li - li % LANES;
    for (var k = 0u; k < LANES; k++) {
        v += red[base + k];
    }
    workgroupBarrier();
    return v;
}
