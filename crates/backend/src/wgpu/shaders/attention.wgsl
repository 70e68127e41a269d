// Paged attention of one step, with the step's K/V written into their cache slots by the same
// kernel (the fused KV write). One workgroup per (KV head, token) handles the query heads of that
// KV head's group: keys in tiles of 64 (one per invocation: its scores for every head of the
// group), an online softmax per head, then each invocation accumulates V for its pairs of dims.
//
// A key of this step is read from the QKV rows (rounded to f16 as the cache stores it), not from
// the cache, since the workgroup writing it may not have run yet; older keys come from the cache
// through the sequence's block table. The cache holds f16 pairs in u32 words (no f16 feature
// needed): [slots, kv_heads, head_dim / 2].

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
}

// Per token, 8 words: position, cache slot, first position of its sequence's new tokens, batch
// row of that token, offset of its block table in `tables`.
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<u32>;
@group(0) @binding(3) var<storage, read_write> vc: array<u32>;
@group(0) @binding(4) var<storage, read> tok: array<u32>;
@group(0) @binding(5) var<storage, read> tables: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

const TILE: u32 = 64u;
const NEG: f32 = -3.0e38;
const NEW: u32 = 0x80000000u;

var<workgroup> qs: array<f32, 2048>;  // [group, head_dim]
var<workgroup> sc: array<f32, 1024>;  // [group, TILE]: scores, then probabilities
var<workgroup> loc: array<u32, 64>;   // each key's cache slot, or NEW | its batch row
var<workgroup> corr: array<f32, 16>;
var<workgroup> lsum: array<f32, 16>;
var<workgroup> mx: array<f32, 16>;
var<workgroup> ntiles: u32;

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

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let kvh = wg.x;
    let t = wg.y;
    let hd = p.head_dim;
    let half = hd / 2u;
    let g = p.group;
    let pos = tok[t * 8u];
    let slot = tok[t * 8u + 1u];
    let first_new = tok[t * 8u + 2u];
    let new_row = tok[t * 8u + 3u];
    let toff = tok[t * 8u + 4u];

    // The fused write of this token's K and V of head kvh.
    for (var i = li; i < half; i += TILE) {
        let r = t * p.stride + kvh * hd + 2u * i;
        let o = (slot * p.kv_heads * hd + kvh * hd) / 2u + i;
        kc[o] = pack2x16float(vec2<f32>(qkv[r + p.k_off], qkv[r + p.k_off + 1u]));
        vc[o] = pack2x16float(vec2<f32>(qkv[r + p.v_off], qkv[r + p.v_off + 1u]));
    }
    for (var i = li; i < g * hd; i += TILE) {
        qs[i] = qkv[t * p.stride + kvh * g * hd + i];
    }
    var first = 0u;
    if p.window != 0u && pos + 1u > p.window {
        first = pos + 1u - p.window;
    }
    let nkeys = pos + 1u - first;
    if li < g {
        mx[li] = NEG;
        lsum[li] = 0.0;
    }
    if li == 0u {
        ntiles = (nkeys + TILE - 1u) / TILE;
    }
    var acc: array<f32, 64>; // [group][2 pairs][2]: this invocation's pairs li and li + 64
    let tiles = workgroupUniformLoad(&ntiles);
    for (var tile = 0u; tile < tiles; tile++) {
        let j = first + tile * TILE + li;
        if j <= pos {
            var l: u32;
            if j >= first_new {
                l = NEW | (new_row + j - first_new);
            } else {
                l = tables[toff + j / p.block_size] * p.block_size + j % p.block_size;
            }
            loc[li] = l;
            for (var h = 0u; h < g; h++) {
                var s = 0.0;
                for (var i = 0u; i < half; i++) {
                    let k = kv_pair(true, l, kvh, i);
                    s += qs[h * hd + 2u * i] * k.x + qs[h * hd + 2u * i + 1u] * k.y;
                }
                sc[h * TILE + li] = s * p.scale;
            }
        } else {
            for (var h = 0u; h < g; h++) {
                sc[h * TILE + li] = NEG;
            }
        }
        workgroupBarrier();
        let cnt = min(TILE, nkeys - tile * TILE);
        if li < g {
            var m = mx[li];
            for (var jj = 0u; jj < cnt; jj++) {
                m = max(m, sc[li * TILE + jj]);
            }
            let c = exp(mx[li] - m);
            var s = lsum[li] * c;
            for (var jj = 0u; jj < cnt; jj++) {
                let pr = exp(sc[li * TILE + jj] - m);
                sc[li * TILE + jj] = pr;
                s += pr;
            }
            mx[li] = m;
            lsum[li] = s;
            corr[li] = c;
        }
        workgroupBarrier();
        for (var h = 0u; h < g; h++) {
            let c = corr[h];
            for (var e = 0u; e < 4u; e++) {
                acc[h * 4u + e] *= c;
            }
        }
        for (var jj = 0u; jj < cnt; jj++) {
            let l = loc[jj];
            for (var e = 0u; e < 2u; e++) {
                let i = li + TILE * e;
                if i < half {
                    let v = kv_pair(false, l, kvh, i);
                    for (var h = 0u; h < g; h++) {
                        let pr = sc[h * TILE + jj];
                        acc[h * 4u + 2u * e] += pr * v.x;
                        acc[h * 4u + 2u * e + 1u] += pr * v.y;
                    }
                }
            }
        }
        workgroupBarrier();
    }
    for (var h = 0u; h < g; h++) {
        let inv = 1.0 / lsum[h];
        for (var e = 0u; e < 2u; e++) {
            let i = li + TILE * e;
            if i < half {
                let o = t * p.out_stride + (kvh * g + h) * hd + 2u * i;
                out[o] = acc[h * 4u + 2u * e] * inv;
                out[o + 1u] = acc[h * 4u + 2u * e + 1u] * inv;
            }
        }
    }
}
