// The prompt attention kernels' shared part (attention.wgsl, attention_coop.wgsl): the parameter
// block, the bindings, reading a key of the tile's sequence, the fused KV write and the tile's
// key span. The host puts it after a kernel's `enable` lines and before its body.
//
// A key of this step is read from the QKV rows (rounded to f16 as the cache stores it), not from
// the cache, since the workgroup writing it may not have run yet; older keys come from the cache
// through the block table. Keys past the tile's last position load as zero, so NaN in unused
// cache slots never reaches a sum. The cache holds f16 pairs in u32 words (no f16 feature
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
    qt: u32,         // tokens per query tile
    kt: u32,         // keys per K/V tile (a multiple of 8, kt * (head_dim / 2 + 1) <= KVW)
}

// Per token, 8 words: position, cache slot, first position of its sequence's new tokens, batch
// row of that first new token, offset of its block table in `tables`. Words 5 and 6 of entry i
// describe query tile i: its first token and its token count.
@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> qkv: array<f32>;
@group(0) @binding(2) var<storage, read_write> kc: array<u32>;
@group(0) @binding(3) var<storage, read_write> vc: array<u32>;
@group(0) @binding(4) var<storage, read> tok: array<u32>;
@group(0) @binding(5) var<storage, read> tables: array<u32>;
@group(0) @binding(6) var<storage, read_write> out: array<f32>;

// Word (pair) i of KV head kvh of the key at position `j` of the tile's sequence, K or V; zero
// past `end`.
fn kv_word(is_k: bool, j: u32, end: u32, kvh: u32, i: u32, first_new: u32, new_row: u32, toff: u32) -> u32 {
    if j >= end {
        return 0u;
    }
    if j >= first_new {
        let r = (new_row + j - first_new) * p.stride + select(p.v_off, p.k_off, is_k) + kvh * p.head_dim + 2u * i;
        return pack2x16float(vec2<f32>(qkv[r], qkv[r + 1u]));
    }
    let slot = tables[toff + j / p.block_size] * p.block_size + j % p.block_size;
    let o = (slot * p.kv_heads * p.head_dim + kvh * p.head_dim) / 2u + i;
    if is_k {
        return kc[o];
    }
    return vc[o];
}

// Writes the K and V of the tile's `cnt` tokens from t0, KV head kvh, into their cache slots
// (the fused KV write); `li` of `wg` invocations.
fn write_new_kv(li: u32, wg: u32, t0: u32, cnt: u32, kvh: u32) {
    let hd = p.head_dim;
    let half = hd / 2u;
    for (var w = li; w < cnt * half; w += wg) {
        let t = t0 + w / half;
        let i = w % half;
        let slot = tok[t * 8u + 1u];
        let r = t * p.stride + kvh * hd + 2u * i;
        let o = (slot * p.kv_heads * hd + kvh * hd) / 2u + i;
        kc[o] = pack2x16float(vec2<f32>(qkv[r + p.k_off], qkv[r + p.k_off + 1u]));
        vc[o] = pack2x16float(vec2<f32>(qkv[r + p.v_off], qkv[r + p.v_off + 1u]));
    }
}

// The keys the tile's `cnt` tokens from t0 attend: the first its windows admit, and the last
// position + 1.
fn tile_span(t0: u32, cnt: u32) -> vec2<u32> {
    var lo = 0xffffffffu;
    var hi = 0u;
    for (var tt = 0u; tt < cnt; tt++) {
        let pos = tok[(t0 + tt) * 8u];
        var f = 0u;
        if p.window != 0u && pos + 1u > p.window {
            f = pos + 1u - p.window;
        }
        lo = min(lo, f);
        hi = max(hi, pos + 1u);
    }
    return vec2<u32>(lo, hi);
}
