// On each token's row of the QKV projection, in place: the bias (Qwen2), the RMSNorm of every Q
// and K head (Qwen3), then RoPE of Q and K with the token's (cos, sin) table, computed on the host
// as the CPU backend computes it. One workgroup per (head, token); heads are the Q heads, then
// the K heads, then the V heads (which only get their bias).

struct P {
    n: u32,
    q_heads: u32,
    kv_heads: u32,
    head_dim: u32,
    pairs: u32,    // rope_dim / 2
    neox: u32,     // 1: pairs (i, i + pairs); 0: pairs (2i, 2i + 1)
    has_bias: u32,
    has_norm: u32,
    eps: f32,
    stride: u32,   // elements per QKV row
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read_write> qkv: array<f32>;
@group(0) @binding(2) var<storage, read> bias: array<f32>;
@group(0) @binding(3) var<storage, read> qn: array<f32>;
@group(0) @binding(4) var<storage, read> kn: array<f32>;
@group(0) @binding(5) var<storage, read> cs: array<f32>; // [n, pairs, 2] (cos, sin)

var<workgroup> h: array<f32, 256>;
var<workgroup> red: array<f32, 64>;

@compute @workgroup_size(64)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let head = wg.x;
    let t = wg.y;
    let hd = p.head_dim;
    let base = t * p.stride + head * hd;
    let is_q = head < p.q_heads;
    let is_v = head >= p.q_heads + p.kv_heads;
    for (var c = li; c < hd; c += 64u) {
        var v = qkv[base + c];
        if p.has_bias != 0u {
            v += bias[head * hd + c];
        }
        h[c] = v;
    }
    workgroupBarrier();
    if p.has_norm != 0u && !is_v {
        var s = 0.0;
        for (var c = li; c < hd; c += 64u) {
            s += h[c] * h[c];
        }
        red[li] = s;
        workgroupBarrier();
        for (var k = 32u; k > 0u; k >>= 1u) {
            if li < k {
                red[li] += red[li + k];
            }
            workgroupBarrier();
        }
        let scale = 1.0 / sqrt(red[0] / f32(hd) + p.eps);
        for (var c = li; c < hd; c += 64u) {
            h[c] = h[c] * (scale * select(kn[c], qn[c], is_q));
        }
        workgroupBarrier();
    }
    let rope_dim = select(2u * p.pairs, 0u, is_v);
    for (var c = li; c < hd; c += 64u) {
        if c >= rope_dim {
            qkv[base + c] = h[c];
        }
    }
    if is_v {
        return;
    }
    for (var i = li; i < p.pairs; i += 64u) {
        var a = 2u * i;
        var b = a + 1u;
        if p.neox != 0u {
            a = i;
            b = i + p.pairs;
        }
        let co = cs[(t * p.pairs + i) * 2u];
        let si = cs[(t * p.pairs + i) * 2u + 1u];
        let x0 = h[a];
        let x1 = h[b];
        qkv[base + a] = fma(x0, co, -(x1 * si));
        qkv[base + b] = fma(x0, si, x1 * co);
    }
}
