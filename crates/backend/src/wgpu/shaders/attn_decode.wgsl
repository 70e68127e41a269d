// Paged attention of decode rows, split over keys and then merged. A decode row has one query
// per head and a long context, so one workgroup per (KV head, row) leaves most of a GPU idle;
// here each workgroup takes one range of the row's keys (`split`), keeps a partial softmax per
// query head (max, sum, unnormalised V sum), and `merge` combines the ranges of each (row, head)
// with their maxima. The split workgroups of range 0 also write the row's K/V into its cache
// slot (the fused KV write); the row's own key is read from the QKV rows, rounded to f16 as the
// cache stores it, since the workgroup writing it may not have run yet.
//
// One workgroup serves every query head of its KV head (grouped-query attention reads each key
// once). Per tile of 128 keys: one invocation per key computes its scores for the group's heads
// (Q in shared memory); lanes of each head reduce the tile's maximum and sum in shared memory;
// then each invocation owns one pair of dims of V and a subset of the tile's keys, reading V rows
// as consecutive words (coalesced), and the key subsets are summed at the end. Plain f32 math
// on f16 pairs in u32 words: no optional feature needed.

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
    group: u32,      // query heads per KV head
    splits: u32,     // key ranges per row
    split_keys: u32, // keys per range (a multiple of TILE)
    red_lanes: u32,  // invocations per head in the tile reductions (a power of two)
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<u32>;
@group(0) @binding(3) var<storage, read_write> vc: array<u32>;
@group(0) @binding(4) var<storage, read> tok: array<u32>;
@group(0) @binding(5) var<storage, read> tables: array<u32>;
// [row, q_head, split, head_dim]: unnormalised V sums; [row, q_head, split, 2]: (max, sum).
@group(0) @binding(6) var<storage, read_write> part: array<f32>;
@group(0) @binding(7) var<storage, read_write> ml: array<f32>;
@group(0) @binding(8) var<storage, read_write> out: array<f32>;

const WG: u32 = 128u;
const TILE: u32 = 128u;
const NEG: f32 = -3.0e38;
const NEW: u32 = 0x80000000u;

// [0, 2048): Q of the group's heads [group, head_dim]; [2048, 4096): scores, then
// probabilities [group, TILE]. At the end the whole array gathers the V sums of the key lanes.
var<workgroup> shm: array<f32, 4096>;
var<workgroup> loc: array<u32, 128>; // each key's cache slot, or NEW | its batch row
var<workgroup> red: array<f32, 128>;
var<workgroup> mx: array<f32, 16>;
var<workgroup> lsum: array<f32, 16>;
var<workgroup> corr: array<f32, 16>;
var<workgroup> krange: vec2<u32>;

const SC: u32 = 2048u;

// Pair i of KV head kvh of the key at `l`, K or V.
fn kv_pair(is_k: bool, l: u32, kvh: u32, i: u32) -> vec2<f32> {
    if (l & NEW) != 0u {
        let r = (l & ~NEW) * p.stride + select(p.v_off, p.k_off, is_k) + kvh * p.head_dim + 2u * i;
        return unpack2x16float(pack2x16float(vec2<f32>(qkv[r], qkv[r + 1u])));
    }
    let o = (l * p.kv_heads * p.head_dim + kvh * p.head_dim) / 2u + i;
    if is_k {
        return unpack2x16float(kc[o]);
    }
    return unpack2x16float(vc[o]);
}

// The tile reduction of `red` over each head's `red_lanes` invocations (max or sum).
fn reduce(li: u32, is_max: bool) {
    for (var step = p.red_lanes / 2u; step > 0u; step >>= 1u) {
        if li % p.red_lanes < step {
            if is_max {
                red[li] = max(red[li], red[li + step]);
            } else {
                red[li] = red[li] + red[li + step];
            }
        }
        workgroupBarrier();
    }
}

@compute @workgroup_size(128)
fn split(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let kvh = wg.x;
    let t = wg.y;
    let sp = wg.z;
    let hd = p.head_dim;
    let half = hd / 2u;
    let g = p.group;
    let pos = tok[t * 8u];
    let slot = tok[t * 8u + 1u];
    let first_new = tok[t * 8u + 2u];
    let new_row = tok[t * 8u + 3u];
    let toff = tok[t * 8u + 4u];

    if sp == 0u {
        for (var i = li; i < half; i += WG) {
            let r = t * p.stride + kvh * hd + 2u * i;
            let o = (slot * p.kv_heads * hd + kvh * hd) / 2u + i;
            kc[o] = pack2x16float(vec2<f32>(qkv[r + p.k_off], qkv[r + p.k_off + 1u]));
            vc[o] = pack2x16float(vec2<f32>(qkv[r + p.v_off], qkv[r + p.v_off + 1u]));
        }
    }
    for (var i = li; i < g * hd; i += WG) {
        shm[i] = qkv[t * p.stride + kvh * g * hd + i];
    }
    if li == 0u {
        var first = 0u;
        if p.window != 0u && pos + 1u > p.window {
            first = pos + 1u - p.window;
        }
        let k0 = min(first + sp * p.split_keys, pos + 1u);
        krange = vec2<u32>(k0, min(k0 + p.split_keys, pos + 1u));
    }
    if li < g {
        mx[li] = NEG;
        lsum[li] = 0.0;
    }
    let kr = workgroupUniformLoad(&krange);
    let rl = p.red_lanes;
    let h_red = li / rl;
    let r_red = li % rl;
    let vlanes = WG / half; // key lanes of the V sums
    let vi = li % half;
    let vk = li / half;
    var acc: array<f32, 32>; // [group][2]: this invocation's pair vi of each head
    for (var t0 = kr.x; t0 < kr.y; t0 += TILE) {
        let cnt = min(TILE, kr.y - t0);
        if li < cnt {
            let j = t0 + li;
            var l: u32;
            if j >= first_new {
                l = NEW | (new_row + j - first_new);
            } else {
                l = tables[toff + j / p.block_size] * p.block_size + j % p.block_size;
            }
            loc[li] = l;
            var s: array<f32, 16>;
            for (var i = 0u; i < half; i++) {
                let k = kv_pair(true, l, kvh, i);
                for (var h = 0u; h < g; h++) {
                    s[h] += shm[h * hd + 2u * i] * k.x + shm[h * hd + 2u * i + 1u] * k.y;
                }
            }
            for (var h = 0u; h < g; h++) {
                shm[SC + h * TILE + li] = s[h] * p.scale;
            }
        }
        workgroupBarrier();
        // The tile's maximum per head.
        var m = NEG;
        if h_red < g {
            for (var jj = r_red; jj < cnt; jj += rl) {
                m = max(m, shm[SC + h_red * TILE + jj]);
            }
        }
        red[li] = m;
        workgroupBarrier();
        reduce(li, true);
        var m_new = NEG;
        if h_red < g {
            m_new = max(mx[h_red], red[h_red * rl]);
        }
        workgroupBarrier();
        // Probabilities and their sum per head.
        var sum = 0.0;
        if h_red < g {
            for (var jj = r_red; jj < cnt; jj += rl) {
                let pr = exp(shm[SC + h_red * TILE + jj] - m_new);
                shm[SC + h_red * TILE + jj] = pr;
                sum += pr;
            }
        }
        red[li] = sum;
        workgroupBarrier();
        reduce(li, false);
        if h_red < g && r_red == 0u {
            let c = exp(mx[h_red] - m_new);
            lsum[h_red] = lsum[h_red] * c + red[li];
            mx[h_red] = m_new;
            corr[h_red] = c;
        }
        workgroupBarrier();
        if vk < vlanes {
            for (var h = 0u; h < g; h++) {
                acc[2u * h] *= corr[h];
                acc[2u * h + 1u] *= corr[h];
            }
            for (var jj = vk; jj < cnt; jj += vlanes) {
                let v = kv_pair(false, loc[jj], kvh, vi);
                for (var h = 0u; h < g; h++) {
                    let pr = shm[SC + h * TILE + jj];
                    acc[2u * h] += pr * v.x;
                    acc[2u * h + 1u] += pr * v.y;
                }
            }
        }
        workgroupBarrier();
    }
    // Sum the key lanes' V sums: lane k's head h at [(k * group + h) * head_dim].
    if vk < vlanes {
        for (var h = 0u; h < g; h++) {
            let o = (vk * g + h) * hd + 2u * vi;
            shm[o] = acc[2u * h];
            shm[o + 1u] = acc[2u * h + 1u];
        }
    }
    workgroupBarrier();
    let base = (t * p.q_heads + kvh * g) * p.splits + sp;
    for (var e = li; e < g * hd; e += WG) {
        let h = e / hd;
        let d = e % hd;
        var a = 0.0;
        for (var k = 0u; k < vlanes; k++) {
            a += shm[(k * g + h) * hd + d];
        }
        part[(base + h * p.splits) * hd + d] = a;
    }
    if li < g {
        ml[(base + li * p.splits) * 2u] = mx[li];
        ml[(base + li * p.splits) * 2u + 1u] = lsum[li];
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
    var m = NEG;
    for (var s = 0u; s < p.splits; s++) {
        m = max(m, ml[(base + s) * 2u]);
    }
    var l = 0.0;
    for (var s = 0u; s < p.splits; s++) {
        l += ml[(base + s) * 2u + 1u] * exp(ml[(base + s) * 2u] - m);
    }
    let inv = 1.0 / l;
    for (var d = li; d < hd; d += 64u) {
        var a = 0.0;
        for (var s = 0u; s < p.splits; s++) {
            a += part[(base + s) * hd + d] * exp(ml[(base + s) * 2u] - m);
        }
        out[t * p.out_stride + qh * hd + d] = a * inv;
    }
}
