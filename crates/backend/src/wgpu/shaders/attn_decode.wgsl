// Paged attention of decode rows, split over keys and then merged. A decode row has one query
// per head and a long context, so it is a stream of K/V bytes that must run at memory bandwidth,
// and one workgroup per (KV head, row) would leave most of a GPU idle: each workgroup of `split`
// takes one range of the row's keys, keeps a partial softmax per query head (max, sum,
// unnormalised V sum), and `merge` combines the ranges of each (row, head) with their maxima.
// The split workgroups of range 0 also write the row's K/V into its cache slot (the fused KV
// write); the row's own key is read from the QKV rows, rounded to f16 as the cache stores it,
// since the workgroup writing it may not have run yet.
//
// Layout (the design of the CUDA decode kernel, without its asynchronous copies): a key is
// taken by a group of L lanes, each reading 16-byte chunks (8 halves) of the K and V rows, so a
// group reads a whole f16 row in one coalesced sweep; the workgroup's KG = 128 / L groups take
// keys KG apart. Each lane scores its dims against every query head of the KV group (grouped-
// query attention reads each key once; Q pre-scaled in registers), the group's partial scores
// are summed across its lanes (`lane_sums`: subgroup shuffles, or workgroup memory where the
// adapter has no subgroups), and each group keeps its own online softmax per head in f32 and its
// lanes' dims of the V sums, so the key loop has no workgroup barrier on the subgroup path. At
// the end the groups' partials are merged in workgroup memory into the range's partial. A group
// loads its next key while it computes the current one.
//
// The host fills in G (query heads per KV head), L (lanes per key: 16, or the subgroup size if
// smaller, so a key's lanes lie in one subgroup) and CPL (chunks per lane: head_dim / 8 / L
// rounded up), and appends one `lane_sums`. The subgroup form assumes invocations fill
// subgroups in order of local index (every driver does for one-dimensional workgroups; the
// parity tests run it). Needs head_dim a multiple of 8 (the host checks).

struct P {
    n: u32,
    q_heads: u32,
    kv_heads: u32,
    head_dim: u32,
    block_size: u32,
    scale: f32,
    window: u32,     // sliding window, 0: none
    stride: u32,     // elements per QKV row
    k_off: u32,      // column of K in a QKV row
    v_off: u32,
    out_stride: u32, // elements per output row
    group: u32,      // query heads per KV head (= G)
    splits: u32,     // key ranges per row
    split_keys: u32, // keys per range
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> vc: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> tok: array<u32>;
@group(0) @binding(5) var<storage, read> tables: array<u32>;
// [row, q_head, split, head_dim]: unnormalised V sums; [row, q_head, split, 2]: (max, sum).
@group(0) @binding(6) var<storage, read_write> part: array<f32>;
@group(0) @binding(7) var<storage, read_write> ml: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

const WG: u32 = 128u;
const G: u32 = GROUPu;
const L: u32 = LANESu;
const CPL: u32 = CPLu;
const KG: u32 = WG / L;
const NEG: f32 = -3.0e38;
const NEW: u32 = 0x80000000u;

// The merged V sums [G, head_dim]; each key group's (max, sum) per head [KG, G].
var<workgroup> vsum: array<f32, 2048>;
var<workgroup> gmax: array<f32, 256>;
var<workgroup> gsum: array<f32, 256>;
var<workgroup> krange: vec2<u32>;

// Chunk `c` (8 dims) of KV head `kvh` of the key at `l` (a cache slot, or NEW | its batch row),
// K or V, as f32.
fn chunk(is_k: bool, l: u32, kvh: u32, c: u32) -> array<vec4<f32>, 2> {
    if (l & NEW) != 0u {
        let r = (l & ~NEW) * p.stride + select(p.v_off, p.k_off, is_k) + kvh * p.head_dim + 8u * c;
        var v: array<vec4<f32>, 2>;
        for (var i = 0u; i < 2u; i++) {
            let a = vec4<f32>(qkv[r + 4u * i], qkv[r + 4u * i + 1u], qkv[r + 4u * i + 2u], qkv[r + 4u * i + 3u]);
            // Rounded to f16 as the cache holds it.
            v[i] = vec4<f32>(
                unpack2x16float(pack2x16float(a.xy)),
                unpack2x16float(pack2x16float(a.zw)),
            );
        }
        return v;
    }
    let o = (l * p.kv_heads + kvh) * (p.head_dim / 8u) + c;
    var u: vec4<u32>;
    if is_k {
        u = kc[o];
    } else {
        u = vc[o];
    }
    return array<vec4<f32>, 2>(
        vec4<f32>(unpack2x16float(u.x), unpack2x16float(u.y)),
        vec4<f32>(unpack2x16float(u.z), unpack2x16float(u.w)),
    );
}

// What locates a key of this workgroup's row, and this lane's place in its key group.
struct Row {
    first_new: u32, // the row's first new position (keys from here are in the QKV rows)
    new_row: u32,   // the batch row of that position
    toff: u32,      // the row's block table in `tables`
    kvh: u32,
    lane: u32,
}

// This lane's chunks of key `j`'s K and V rows, or zeros past `end`.
struct Key {
    k: array<vec4<f32>, 2 * CPL>,
    v: array<vec4<f32>, 2 * CPL>,
}

fn load_key(j: u32, end: u32, r: Row) -> Key {
    var key: Key;
    if j < end {
        var at: u32;
        if j >= r.first_new {
            at = NEW | (r.new_row + j - r.first_new);
        } else {
            at = tables[r.toff + j / p.block_size] * p.block_size + j % p.block_size;
        }
        for (var c = 0u; c < CPL; c++) {
            let ci = r.lane + L * c;
            if ci < p.head_dim / 8u {
                let k = chunk(true, at, r.kvh, ci);
                let v = chunk(false, at, r.kvh, ci);
                key.k[2u * c] = k[0];
                key.k[2u * c + 1u] = k[1];
                key.v[2u * c] = v[0];
                key.v[2u * c + 1u] = v[1];
            }
        }
    }
    return key;
}

// The fused KV write: chunk `c` of this row's K and V head into its slot.
fn write_chunk(t: u32, slot: u32, kvh: u32, c: u32) {
    let r = t * p.stride + kvh * p.head_dim + 8u * c;
    let o = (slot * p.kv_heads + kvh) * (p.head_dim / 8u) + c;
    var w: array<vec4<u32>, 2>;
    for (var i = 0u; i < 2u; i++) {
        let b = r + select(p.v_off, p.k_off, i == 0u);
        w[i] = vec4<u32>(
            pack2x16float(vec2<f32>(qkv[b], qkv[b + 1u])),
            pack2x16float(vec2<f32>(qkv[b + 2u], qkv[b + 3u])),
            pack2x16float(vec2<f32>(qkv[b + 4u], qkv[b + 5u])),
            pack2x16float(vec2<f32>(qkv[b + 6u], qkv[b + 7u])),
        );
    }
    kc[o] = w[0];
    vc[o] = w[1];
}

@compute @workgroup_size(128)
fn split(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let kvh = wg.x;
    let t = wg.y;
    let sp = wg.z;
    let hd = p.head_dim;
    let nd = hd / 8u; // chunks per row
    let pos = tok[t * 8u];
    let slot = tok[t * 8u + 1u];
    let first_new = tok[t * 8u + 2u];
    let new_row = tok[t * 8u + 3u];
    let toff = tok[t * 8u + 4u];
    let kg = li / L;
    let lane = li % L;

    if sp == 0u {
        for (var c = li; c < nd; c += WG) {
            write_chunk(t, slot, kvh, c);
        }
    }
    if li == 0u {
        var first = 0u;
        if p.window != 0u && pos + 1u > p.window {
            first = pos + 1u - p.window;
        }
        let k0 = min(first + sp * p.split_keys, pos + 1u);
        krange = vec2<u32>(k0, min(k0 + p.split_keys, pos + 1u));
    }
    // This lane's dims of each head's query, scaled.
    var q: array<array<vec4<f32>, 2 * CPL>, G>;
    for (var h = 0u; h < G; h++) {
        for (var c = 0u; c < CPL; c++) {
            let ci = lane + L * c;
            if ci < nd {
                let r = t * p.stride + (kvh * G + h) * hd + 8u * ci;
                for (var i = 0u; i < 2u; i++) {
                    let b = r + 4u * i;
                    q[h][2u * c + i] = vec4<f32>(qkv[b], qkv[b + 1u], qkv[b + 2u], qkv[b + 3u]) * p.scale;
                }
            }
        }
    }
    let kr = workgroupUniformLoad(&krange);
    var m: array<f32, G>;
    var l: array<f32, G>;
    var acc: array<array<vec4<f32>, 2 * CPL>, G>;
    for (var h = 0u; h < G; h++) {
        m[h] = NEG;
    }
    let row = Row(first_new, new_row, toff, kvh, lane);
    // The trip count is the same for every invocation (keys past the range are masked), so
    // the lane sums may synchronise. Each iteration loads the group's next key while it
    // computes this one (two keys' chunks in flight per lane).
    var cur = load_key(kr.x + kg, kr.y, row);
    for (var j0 = kr.x; j0 < kr.y; j0 += KG) {
        let live = j0 + kg < kr.y;
        let next = load_key(j0 + KG + kg, kr.y, row);
        var s: array<f32, G>;
        for (var h = 0u; h < G; h++) {
            var d = 0.0;
            for (var c = 0u; c < 2u * CPL; c++) {
                d += dot(q[h][c], cur.k[c]);
            }
            s[h] = d;
        }
        lane_sums(&s, li);
        if live {
            for (var h = 0u; h < G; h++) {
                let mn = max(m[h], s[h]);
                let corr = exp(m[h] - mn);
                let pr = exp(s[h] - mn);
                l[h] = l[h] * corr + pr;
                m[h] = mn;
                for (var c = 0u; c < 2u * CPL; c++) {
                    acc[h][c] = acc[h][c] * corr + pr * cur.v[c];
                }
            }
        }
        cur = next;
    }
    // Merge the key groups: the range's maximum per head, each group's V sums rescaled to it
    // and added group by group (a group's lanes own distinct dims).
    if lane == 0u {
        for (var h = 0u; h < G; h++) {
            gmax[kg * G + h] = m[h];
            gsum[kg * G + h] = l[h];
        }
    }
    for (var e = li; e < G * hd; e += WG) {
        vsum[e] = 0.0;
    }
    workgroupBarrier();
    var f: array<f32, G>;
    for (var h = 0u; h < G; h++) {
        var mm = NEG;
        for (var k = 0u; k < KG; k++) {
            mm = max(mm, gmax[k * G + h]);
        }
        f[h] = exp(m[h] - mm);
    }
    for (var k = 0u; k < KG; k++) {
        if k == kg {
            for (var h = 0u; h < G; h++) {
                for (var c = 0u; c < CPL; c++) {
                    let ci = lane + L * c;
                    if ci < nd {
                        for (var i = 0u; i < 2u; i++) {
                            let a = acc[h][2u * c + i] * f[h];
                            let o = h * hd + 8u * ci + 4u * i;
                            vsum[o] += a.x;
                            vsum[o + 1u] += a.y;
                            vsum[o + 2u] += a.z;
                            vsum[o + 3u] += a.w;
                        }
                    }
                }
            }
        }
        workgroupBarrier();
    }
    let base = (t * p.q_heads + kvh * G) * p.splits + sp;
    for (var e = li; e < G * hd; e += WG) {
        let h = e / hd;
        part[(base + h * p.splits) * hd + e % hd] = vsum[e];
    }
    if li < G {
        var mm = NEG;
        for (var k = 0u; k < KG; k++) {
            mm = max(mm, gmax[k * G + li]);
        }
        var ls = 0.0;
        for (var k = 0u; k < KG; k++) {
            ls += gsum[k * G + li] * exp(gmax[k * G + li] - mm);
        }
        ml[(base + li * p.splits) * 2u] = mm;
        ml[(base + li * p.splits) * 2u + 1u] = ls;
    }
}

// out[row, head] = the key ranges' V sums weighted by exp(their max - the overall max), over the
// same weighting of their sums. One workgroup per (query head, row).
@compute @workgroup_size(64)
fn merge(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let qh = wg.x;
    let t = wg.y;
    let hd = p.head_dim;
    let base = (t * p.q_heads + qh) * p.splits;
    var mm = NEG;
    for (var s = 0u; s < p.splits; s++) {
        mm = max(mm, ml[(base + s) * 2u]);
    }
    var l = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        l += ml[(base + s) * 2u + 1u] * exp(ml[(base + s) * 2u] - mm);
    }
    let inv = 1.0 / l;
    for (var d = li; d < hd; d += 64u) {
        var a = 0.0;
        for (var s = 0u; s < p.splits; s++) {
            a += part[(base + s) * hd + d] * exp(ml[(base + s) * 2u] - mm);
        }
        out[t * p.out_stride + qh * hd + d] = a * inv;
    }
}

//! SUBGROUP
// Each head's partial score summed over the L lanes of a key: a butterfly of shuffles within
// the key's lanes (all in one subgroup).
fn lane_sums(s: ptr<function, array<f32, G>>, li: u32) {
    for (var h = 0u; h < G; h++) {
        var x = (*s)[h];
        for (var o = L / 2u; o > 0u; o >>= 1u) {
            x += subgroupShuffleXor(x, o);
        }
        (*s)[h] = x;
    }
}

//! SHARED
// The same sums through workgroup memory, for adapters without subgroups: a tree over each
// key's L lanes.
var<workgroup> red: array<f32, 2048>; // [G][WG]

fn lane_sums(s: ptr<function, array<f32, G>>, li: u32) {
    let lane = li % L;
    for (var h = 0u; h < G; h++) {
        red[h * WG + li] = (*s)[h];
    }
    workgroupBarrier();
    for (var o = L / 2u; o > 0u; o >>= 1u) {
        if lane < o {
            for (var h = 0u; h < G; h++) {
                red[h * WG + li] += red[h * WG + li + o];
            }
        }
        workgroupBarrier();
    }
    for (var h = 0u; h < G; h++) {
        (*s)[h] = red[h * WG + li - lane];
    }
    workgroupBarrier();
}
