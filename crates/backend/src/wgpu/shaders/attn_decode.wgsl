// Paged attention of decode rows in one dispatch: split over keys, the ranges merged by the last
// workgroup of each (row, KV head) to finish. A decode row has one query per head and a long
// context, so it is a stream of K/V bytes that must run at memory bandwidth, and one workgroup
// per (KV head, row) would leave most of a GPU idle: each workgroup takes one range of the row's
// keys and keeps a partial softmax per query head (max, sum, unnormalised V sum). With one range
// per row it writes the output itself; with more it leaves its partial, counts itself done on
// the (row, KV head)'s counter, and the workgroup that arrives last merges every range's partial
// in range order (so the result does not depend on which one that is) and resets the counter for
// the next dispatch. The workgroups of range 0 also write the row's K/V into its cache slot (the
// fused KV write); the row's own key is read from the QKV rows, rounded to f16 as the cache
// stores it, since the workgroup writing it may not have run yet.
//
// Layout (after the CUDA decode kernel's design, without its asynchronous copies): a key is taken
// by a group of L lanes, each reading 16-byte chunks (8 halves) of the K and V rows, so a group
// reads a whole f16 row in one coalesced sweep; the workgroup's KG = 128 / L groups each take U
// keys per step (keys KG apart), and load the next step's keys while they compute this one's, so
// every lane has 2 U K/V chunk pairs in flight. The slots of the range's blocks are read from the
// block table once, into workgroup memory, so a key's address costs no dependent global load.
// Each lane scores its dims against every query head of the KV group (grouped-query attention
// reads each key once; Q pre-scaled in registers), the group's partial scores are summed across
// its lanes (`lane_sums`: subgroup shuffles, or workgroup memory where the adapter has no
// subgroups), and each group keeps its own online softmax per head in f32 (one rescale per step
// of U keys) and its lanes' dims of the V sums, so the key loop has no workgroup barrier on the
// subgroup path. At the end the groups' partials are merged in workgroup memory.
//
// Why one dispatch: a second (merge) dispatch costs a pipeline barrier and a launch, which on a
// short context is as long as the attention itself.
//
// The host fills in G (query heads per KV head), L (lanes per key: 16, or the subgroup size if
// smaller, so a key's lanes lie in one subgroup), CPL (chunks per lane: head_dim / 8 / L rounded
// up) and U, and appends one `lane_sums`. The subgroup form assumes invocations fill subgroups in
// order of local index (every driver does for one-dimensional workgroups; the parity tests run
// it). Needs head_dim a multiple of 8, G * head_dim <= 2048 and splits <= 64 (the host checks).

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
    ml_off: u32,     // where the (max, sum) pairs start in `part`
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<vec4<u32>>;
@group(0) @binding(3) var<storage, read_write> vc: array<vec4<u32>>;
@group(0) @binding(4) var<storage, read> tok: array<u32>;
@group(0) @binding(5) var<storage, read> tables: array<u32>;
// [row, q_head, split, head_dim]: unnormalised V sums; from ml_off, [row, q_head, split, 2]:
// (max, sum).
@group(0) @binding(6) var<storage, read_write> part: array<f32>;
// [row, kv_head]: the ranges of that row and head finished so far (0 between dispatches).
@group(0) @binding(7) var<storage, read_write> done: array<atomic<u32>>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

const WG: u32 = 128u;
const G: u32 = GROUPu;
const L: u32 = LANESu;
const CPL: u32 = CPLu;
const U: u32 = KEYSu;
const KG: u32 = WG / L;
const NEG: f32 = -3.0e38;
const NEW: u32 = 0x80000000u;
// Block-table entries of a range kept in workgroup memory (a longer range reads the rest from
// the table).
const TB: u32 = 256u;
const MAX_SPLITS: u32 = 64u;

// The merged V sums [G, head_dim]; each key group's (max, sum) per head [KG, G]; the range's
// (max, sum) per head.
var<workgroup> vsum: array<f32, 2048>;
var<workgroup> gmax: array<f32, 256>;
var<workgroup> gsum: array<f32, 256>;
var<workgroup> hmax: array<f32, 16>;
var<workgroup> hsum: array<f32, 16>;
// The first slot of each block of the range.
var<workgroup> blk: array<u32, TB>;
// The last arriver's merge weights [G, splits].
var<workgroup> wsplit: array<f32, 1024>;
var<workgroup> krange: vec2<u32>;
var<workgroup> last: u32;

// Chunk `c` (8 dims) of KV head `kvh` of the key at `l` (a cache slot, or NEW | its batch row),
// K or V, as 8 f16 in 4 words.
fn chunk(is_k: bool, l: u32, kvh: u32, c: u32) -> vec4<u32> {
    if (l & NEW) != 0u {
        // Rounded to f16 as the cache holds it.
        let r = (l & ~NEW) * p.stride + select(p.v_off, p.k_off, is_k) + kvh * p.head_dim + 8u * c;
        return vec4<u32>(
            pack2x16float(vec2<f32>(qkv[r], qkv[r + 1u])),
            pack2x16float(vec2<f32>(qkv[r + 2u], qkv[r + 3u])),
            pack2x16float(vec2<f32>(qkv[r + 4u], qkv[r + 5u])),
            pack2x16float(vec2<f32>(qkv[r + 6u], qkv[r + 7u])),
        );
    }
    let o = (l * p.kv_heads + kvh) * (p.head_dim / 8u) + c;
    if is_k {
        return kc[o];
    }
    return vc[o];
}

// What locates a key of this workgroup's row, and this lane's place in its key group.
struct Row {
    first_new: u32, // the row's first new position (keys from here are in the QKV rows)
    new_row: u32,   // the batch row of that position
    toff: u32,      // the row's block table in `tables`
    b0: u32,        // the range's first block (blk[0])
    kvh: u32,
    kg: u32,
    lane: u32,
}

// Where key `j` lies: a cache slot, or NEW | the batch row holding it.
fn locate(j: u32, r: Row) -> u32 {
    if j >= r.first_new {
        return NEW | (r.new_row + j - r.first_new);
    }
    let b = j / p.block_size;
    var base: u32;
    if b - r.b0 < TB {
        base = blk[b - r.b0];
    } else {
        base = tables[r.toff + b] * p.block_size;
    }
    return base + j % p.block_size;
}

// This lane's chunks of the K and V rows of its group's U keys of the step at `j0` (key
// j0 + u * KG + kg), zeros past `end`.
struct Batch {
    k: array<vec4<u32>, U * CPL>,
    v: array<vec4<u32>, U * CPL>,
}

fn load_batch(j0: u32, end: u32, r: Row) -> Batch {
    var b: Batch;
    for (var u = 0u; u < U; u++) {
        let j = j0 + u * KG + r.kg;
        if j < end {
            let at = locate(j, r);
            for (var c = 0u; c < CPL; c++) {
                let ci = r.lane + L * c;
                if ci < p.head_dim / 8u {
                    b.k[u * CPL + c] = chunk(true, at, r.kvh, ci);
                    b.v[u * CPL + c] = chunk(false, at, r.kvh, ci);
                }
            }
        }
    }
    return b;
}

fn unpack8(w: vec4<u32>) -> array<vec4<f32>, 2> {
    return array<vec4<f32>, 2>(
        vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y)),
        vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w)),
    );
}

// The fused KV write: chunk `c` of this row's K and V head into its slot.
fn write_chunk(t: u32, slot: u32, kvh: u32, c: u32) {
    let o = (slot * p.kv_heads + kvh) * (p.head_dim / 8u) + c;
    kc[o] = chunk(true, NEW | t, kvh, c);
    vc[o] = chunk(false, NEW | t, kvh, c);
}

@compute @workgroup_size(128)
fn decode(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
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
    let b0 = kr.x / p.block_size;
    var nb = 0u;
    if kr.y > kr.x {
        nb = min((kr.y - 1u) / p.block_size - b0 + 1u, TB);
    }
    for (var i = li; i < nb; i += WG) {
        blk[i] = tables[toff + b0 + i] * p.block_size;
    }
    workgroupBarrier();
    var m: array<f32, G>;
    var l: array<f32, G>;
    var acc: array<array<vec4<f32>, 2 * CPL>, G>;
    for (var h = 0u; h < G; h++) {
        m[h] = NEG;
    }
    let row = Row(first_new, new_row, toff, b0, kvh, kg, lane);
    // The trip count is the same for every invocation (keys past the range are masked), so the
    // lane sums may synchronise.
    const STEP: u32 = KG * U;
    var cur = load_batch(kr.x, kr.y, row);
    for (var j0 = kr.x; j0 < kr.y; j0 += STEP) {
        let next = load_batch(j0 + STEP, kr.y, row);
        var s: array<f32, U * G>;
        for (var u = 0u; u < U; u++) {
            for (var h = 0u; h < G; h++) {
                var d = 0.0;
                for (var c = 0u; c < CPL; c++) {
                    let k = unpack8(cur.k[u * CPL + c]);
                    d += dot(q[h][2u * c], k[0]) + dot(q[h][2u * c + 1u], k[1]);
                }
                s[u * G + h] = d;
            }
        }
        lane_sums(&s, li);
        // One rescale per step: the new maximum over this group's live keys of the step.
        for (var h = 0u; h < G; h++) {
            var mx = m[h];
            for (var u = 0u; u < U; u++) {
                if j0 + u * KG + kg < kr.y {
                    mx = max(mx, s[u * G + h]);
                }
            }
            let corr = exp(m[h] - mx);
            l[h] *= corr;
            for (var c = 0u; c < 2u * CPL; c++) {
                acc[h][c] *= corr;
            }
            m[h] = mx;
        }
        for (var u = 0u; u < U; u++) {
            let live = j0 + u * KG + kg < kr.y;
            for (var c = 0u; c < CPL; c++) {
                let v = unpack8(cur.v[u * CPL + c]);
                for (var h = 0u; h < G; h++) {
                    let pr = select(0.0, exp(s[u * G + h] - m[h]), live);
                    if c == 0u {
                        l[h] += pr;
                    }
                    acc[h][2u * c] += pr * v[0];
                    acc[h][2u * c + 1u] += pr * v[1];
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
    if li < G {
        var mm = NEG;
        for (var k = 0u; k < KG; k++) {
            mm = max(mm, gmax[k * G + li]);
        }
        var ls = 0.0;
        for (var k = 0u; k < KG; k++) {
            ls += gsum[k * G + li] * exp(gmax[k * G + li] - mm);
        }
        hmax[li] = mm;
        hsum[li] = ls;
    }
    workgroupBarrier();
    let orow = t * p.out_stride + kvh * G * hd;
    if p.splits == 1u {
        for (var e = li; e < G * hd; e += WG) {
            out[orow + e] = vsum[e] / hsum[e / hd];
        }
        return;
    }
    // This range's partial, then the count; the last range of the (row, KV head) merges.
    let base = (t * p.q_heads + kvh * G) * p.splits;
    for (var e = li; e < G * hd; e += WG) {
        let h = e / hd;
        part[(base + h * p.splits + sp) * hd + e % hd] = vsum[e];
    }
    if li < G {
        let i = p.ml_off + (base + li * p.splits + sp) * 2u;
        part[i] = hmax[li];
        part[i + 1u] = hsum[li];
    }
    // Every write above is visible device-wide before the count moves (and, for the last
    // arriver, every other range's writes before its reads below).
    storageBarrier();
    let counter = t * p.kv_heads + kvh;
    if li == 0u {
        last = u32(atomicAdd(&done[counter], 1u) == p.splits - 1u);
    }
    if workgroupUniformLoad(&last) == 0u {
        return;
    }
    storageBarrier();
    // The merge, with as many loads in flight as the workgroup can take (a loop of dependent
    // loads over the ranges would cost a memory latency per range). Every range's (max, sum)
    // per head into workgroup memory (vsum is free again: its partial is written), one pair
    // per invocation; each head's weights by one invocation; then each invocation sums 4 dims
    // of a head over every range, 8 ranges' loads at a time, in range order.
    let ns = p.splits;
    for (var e = li; e < G * ns; e += WG) {
        let h = e / ns;
        let i = p.ml_off + (base + e) * 2u;
        wsplit[h * MAX_SPLITS + e % ns] = part[i];
        vsum[h * MAX_SPLITS + e % ns] = part[i + 1u];
    }
    workgroupBarrier();
    if li < G {
        var mm = NEG;
        for (var s = 0u; s < ns; s++) {
            mm = max(mm, wsplit[li * MAX_SPLITS + s]);
        }
        var ls = 0.0;
        for (var s = 0u; s < ns; s++) {
            let w = exp(wsplit[li * MAX_SPLITS + s] - mm);
            wsplit[li * MAX_SPLITS + s] = w;
            ls += vsum[li * MAX_SPLITS + s] * w;
        }
        hsum[li] = ls;
    }
    workgroupBarrier();
    for (var e = li; e < G * hd / 4u; e += WG) {
        let h = 4u * e / hd;
        let d = 4u * e % hd;
        var a = vec4<f32>(0.0);
        for (var s0 = 0u; s0 < ns; s0 += 8u) {
            var v: array<vec4<f32>, 8>;
            for (var k = 0u; k < 8u; k++) {
                if s0 + k < ns {
                    let o = (base + h * ns + s0 + k) * hd + d;
                    v[k] = vec4<f32>(part[o], part[o + 1u], part[o + 2u], part[o + 3u]);
                }
            }
            for (var k = 0u; k < 8u; k++) {
                if s0 + k < ns {
                    a += v[k] * wsplit[h * MAX_SPLITS + s0 + k];
                }
            }
        }
        let o = orow + h * hd + d;
        let r = a / hsum[h];
        out[o] = r.x;
        out[o + 1u] = r.y;
        out[o + 2u] = r.z;
        out[o + 3u] = r.w;
    }
    if li == 0u {
        atomicStore(&done[counter], 0u);
    }
}

//! SUBGROUP
// Each partial score summed over the L lanes of its key: a butterfly of shuffles within the
// key's lanes (all in one subgroup).
fn lane_sums(s: ptr<function, array<f32, U * G>>, li: u32) {
    for (var i = 0u; i < U * G; i++) {
        var x = (*s)[i];
        for (var o = L / 2u; o > 0u; o >>= 1u) {
            x += subgroupShuffleXor(x, o);
        }
        (*s)[i] = x;
    }
}

//! SHARED
// The same sums through workgroup memory, for adapters without subgroups: a tree over each
// key's L lanes (the host keeps U * G <= 16).
var<workgroup> red: array<f32, 2048>; // [U * G][WG]

fn lane_sums(s: ptr<function, array<f32, U * G>>, li: u32) {
    let lane = li % L;
    for (var h = 0u; h < U * G; h++) {
        red[h * WG + li] = (*s)[h];
    }
    workgroupBarrier();
    for (var o = L / 2u; o > 0u; o >>= 1u) {
        if lane < o {
            for (var h = 0u; h < U * G; h++) {
                red[h * WG + li] += red[h * WG + li + o];
            }
        }
        workgroupBarrier();
    }
    for (var h = 0u; h < U * G; h++) {
        (*s)[h] = red[h * WG + li - lane];
    }
    workgroupBarrier();
}
