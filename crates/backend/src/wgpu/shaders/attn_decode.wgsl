// Paged attention of decode rows, split over keys and then merged. A decode row has one query
// per head and a long context, so it is a stream of K/V bytes that must run at memory bandwidth,
// and one workgroup per (KV head, row) would leave most of a GPU idle: each workgroup of `split`
// takes one range of the row's keys, keeps a partial softmax per query head (max, sum,
// unnormalised V sum), and `merge` combines the ranges of each (row, head) with their maxima.
// The split workgroups of range 0 also write the row's K/V into its cache slot (the fused KV
// write); the row's own key is read from the QKV rows, rounded to f16 as the cache stores it,
// since the workgroup writing it may not have run yet.
//
// Layout: the range is walked in tiles of T keys. The whole workgroup copies a tile's K and V
// rows (f16, 16-byte chunks, consecutive invocations on consecutive chunks of a row) into
// workgroup memory, and while it computes on that tile its next tile's loads are already in
// flight in registers: each invocation keeps LPT chunks of K and of V outstanding, so a
// workgroup has a whole tile (T × head_dim × 4 bytes) in flight, not one key. On the tile:
// invocations take (key, head) pairs and score them from workgroup memory (rows padded by 16
// bytes so neighbouring keys fall in different banks; the head's Q, pre-scaled, is read by
// every invocation of the pair's head at once); then each invocation owns 8 output dims of one
// head (and every S-th key of the tile when the heads' dims leave invocations over), takes the
// tile's maximum of its head, rescales its sums and adds its keys' exp(score - max) · V. Three
// barriers per tile; no subgroup operations, so one kernel serves every adapter. At the end
// the S key subsets of each dim are summed in workgroup memory.
//
// The host fills in the sizes (G query heads per KV head, HD head dim, T keys per tile, the
// workgroup size and the derived counts) and repeats each `//{{ … //}}` block LPT times with
// `_I_` the copy's number (the prefetched chunks stay in named registers, never in an indexed
// array). Needs head_dim a multiple of 8 (the host checks).

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

const G: u32 = GROUPu;
const HD: u32 = HEADDIMu;
const T: u32 = TILEu;
const WG: u32 = WGSIZEu;
const NC: u32 = HD / 8u;  // 16-byte chunks per K or V row
const RS: u32 = NC + 1u;  // a tile row's stride in workgroup memory, padded
const U: u32 = G * NC;    // (head, chunk) units of the output
const S: u32 = SUBSETSu;  // key subsets per unit: max(1, WG / U)
const NEG: f32 = -3.0e38;
const NEW: u32 = 0x80000000u;

// The tile's K rows [T][RS], then its V rows; after the last tile, the subsets' sums.
var<workgroup> kv: array<vec4<u32>, KVWORDSu>;
// The scaled queries [G][HD / 4]; the tile's scores [G][T]; each subset's sums [S][G].
var<workgroup> qs: array<vec4<f32>, QWORDSu>;
var<workgroup> sc: array<f32, SCWORDSu>;
var<workgroup> lsum: array<f32, LSWORDSu>;
var<workgroup> krange: vec2<u32>;

// What locates a key of this workgroup's row.
struct Row {
    first_new: u32, // the row's first new position (keys from here are in the QKV rows)
    new_row: u32,   // the batch row of that position
    toff: u32,      // the row's block table in `tables`
    kvh: u32,
}

// Key `j`'s cache slot, or NEW | its batch row.
fn key_at(j: u32, r: Row) -> u32 {
    if j >= r.first_new {
        return NEW | (r.new_row + j - r.first_new);
    }
    let bs = p.block_size;
    if (bs & (bs - 1u)) == 0u {
        return tables[r.toff + (j >> firstTrailingBit(bs))] * bs + (j & (bs - 1u));
    }
    return tables[r.toff + j / bs] * bs + j % bs;
}

// Chunk `c` (8 dims, packed f16) of KV head `kvh` of the key at `at` (from `key_at`), K or V.
fn chunk(is_k: bool, at: u32, kvh: u32, c: u32) -> vec4<u32> {
    if (at & NEW) != 0u {
        let r = (at & ~NEW) * p.stride + select(p.v_off, p.k_off, is_k) + kvh * HD + 8u * c;
        // Rounded to f16 as the cache holds it.
        return vec4<u32>(
            pack2x16float(vec2<f32>(qkv[r], qkv[r + 1u])),
            pack2x16float(vec2<f32>(qkv[r + 2u], qkv[r + 3u])),
            pack2x16float(vec2<f32>(qkv[r + 4u], qkv[r + 5u])),
            pack2x16float(vec2<f32>(qkv[r + 6u], qkv[r + 7u])),
        );
    }
    let o = (at * p.kv_heads + kvh) * NC + c;
    if is_k {
        return kc[o];
    }
    return vc[o];
}

fn lo(w: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.x), unpack2x16float(w.y));
}

fn hi(w: vec4<u32>) -> vec4<f32> {
    return vec4<f32>(unpack2x16float(w.z), unpack2x16float(w.w));
}

// The fused KV write: chunk `c` of this row's K and V head into its slot.
fn write_chunk(t: u32, slot: u32, kvh: u32, c: u32) {
    let o = (slot * p.kv_heads + kvh) * NC + c;
    kc[o] = chunk(true, NEW | t, kvh, c);
    vc[o] = chunk(false, NEW | t, kvh, c);
}

@compute @workgroup_size(WGSIZE)
fn split(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let kvh = wg.x;
    let t = wg.y;
    let sp = wg.z;
    let pos = tok[t * 8u];
    let slot = tok[t * 8u + 1u];
    let row = Row(tok[t * 8u + 2u], tok[t * 8u + 3u], tok[t * 8u + 4u], kvh);

    if sp == 0u {
        for (var c = li; c < NC; c += WG) {
            write_chunk(t, slot, kvh, c);
        }
    }
    if li == 0u {
        var first = 0u;
        if p.window != 0u && pos + 1u > p.window {
            first = pos + 1u - p.window;
        }
        let first_key = min(first + sp * p.split_keys, pos + 1u);
        krange = vec2<u32>(first_key, min(first_key + p.split_keys, pos + 1u));
    }
    for (var e = li; e < G * HD / 4u; e += WG) {
        let b = t * p.stride + kvh * G * HD + 4u * e;
        qs[e] = vec4<f32>(qkv[b], qkv[b + 1u], qkv[b + 2u], qkv[b + 3u]) * p.scale;
    }
    // (Also the barrier that publishes `qs`.)
    let kr = workgroupUniformLoad(&krange);

    // This invocation's output unit: head h, chunk c, every S-th key from s.
    let owns = li < U * S;
    let u = li % U;
    let s = li / U;
    let h = u / NC;
    let c = u % NC;
    var m = NEG;
    var l = 0.0;
    var acc0 = vec4<f32>();
    var acc1 = vec4<f32>();

    // The chunks this invocation copies: chunk e of the tile (key e / NC, chunk e % NC).
    //{{
    let e_I_ = li + _I_u * WG;
    let o_I_ = (e_I_ / NC) * RS + e_I_ % NC;
    var k_I_ = vec4<u32>();
    var v_I_ = vec4<u32>();
    if e_I_ < T * NC && kr.x + e_I_ / NC < kr.y {
        let at = key_at(kr.x + e_I_ / NC, row);
        k_I_ = chunk(true, at, kvh, e_I_ % NC);
        v_I_ = chunk(false, at, kvh, e_I_ % NC);
    }
    //}}
    // The trip count is the same for every invocation, so the barriers are in uniform flow.
    for (var j0 = kr.x; j0 < kr.y; j0 += T) {
        //{{
        if e_I_ < T * NC {
            kv[o_I_] = k_I_;
            kv[T * RS + o_I_] = v_I_;
        }
        //}}
        workgroupBarrier();
        // The next tile's loads, in flight while this one is computed.
        //{{
        k_I_ = vec4<u32>();
        v_I_ = vec4<u32>();
        if e_I_ < T * NC && j0 + T + e_I_ / NC < kr.y {
            let at = key_at(j0 + T + e_I_ / NC, row);
            k_I_ = chunk(true, at, kvh, e_I_ % NC);
            v_I_ = chunk(false, at, kvh, e_I_ % NC);
        }
        //}}
        // Scores of (key, head) pairs; keys past the range score NEG.
        for (var pi = li; pi < T * G; pi += WG) {
            let kk = pi % T;
            let hq = pi / T;
            var d0 = 0.0;
            var d1 = 0.0;
            for (var cc = 0u; cc < NC; cc++) {
                let kw = kv[kk * RS + cc];
                let qo = (hq * NC + cc) * 2u;
                d0 += dot(qs[qo], lo(kw));
                d1 += dot(qs[qo + 1u], hi(kw));
            }
            sc[hq * T + kk] = select(NEG, d0 + d1, j0 + kk < kr.y);
        }
        workgroupBarrier();
        if owns {
            var mt = NEG;
            for (var kk = 0u; kk < T; kk++) {
                mt = max(mt, sc[h * T + kk]);
            }
            let mn = max(m, mt);
            let corr = exp(m - mn);
            m = mn;
            var a0 = acc0 * corr;
            var a1 = acc1 * corr;
            var ls = 0.0;
            for (var kk = s; kk < T; kk += S) {
                let pr = exp(sc[h * T + kk] - mn);
                let vw = kv[T * RS + kk * RS + c];
                a0 += pr * lo(vw);
                a1 += pr * hi(vw);
                ls += pr;
            }
            acc0 = a0;
            acc1 = a1;
            l = l * corr + ls;
        }
        workgroupBarrier();
    }
    // The key subsets of each unit share the maximum (every invocation of a head took the same
    // tiles' maxima): their sums add as they are.
    if S > 1u {
        if owns {
            kv[2u * li] = bitcast<vec4<u32>>(acc0);
            kv[2u * li + 1u] = bitcast<vec4<u32>>(acc1);
            if c == 0u {
                lsum[s * G + h] = l;
            }
        }
        workgroupBarrier();
        if li < U {
            for (var o = 1u; o < S; o++) {
                acc0 += bitcast<vec4<f32>>(kv[2u * (o * U + li)]);
                acc1 += bitcast<vec4<f32>>(kv[2u * (o * U + li) + 1u]);
                l += lsum[o * G + h];
            }
        }
    }
    if li < U {
        let base = (t * p.q_heads + kvh * G + h) * p.splits + sp;
        let o = base * HD + 8u * c;
        part[o] = acc0.x;
        part[o + 1u] = acc0.y;
        part[o + 2u] = acc0.z;
        part[o + 3u] = acc0.w;
        part[o + 4u] = acc1.x;
        part[o + 5u] = acc1.y;
        part[o + 6u] = acc1.z;
        part[o + 7u] = acc1.w;
        if c == 0u {
            ml[base * 2u] = m;
            ml[base * 2u + 1u] = l;
        }
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
