// The routing and the final sum of a mixture-of-experts layer (moe.wgsl says what the layer
// computes). Two entry points:
//   `route`   one workgroup per token: router logits x[t] · router[e] in f32 (the router is kept
//             in f32, as the CPU keeps it, so both choose the same experts), softmax over all
//             experts, the k largest probabilities (ties: the lower expert index first), divided
//             by their sum when `norm`: ids[t k + j], wts[t k + j];
//   `combine` x[t, c] += Σ_j wts[t k + j] · ey[t k + j, c], j in order.

struct P {
    n: u32,       // tokens
    hidden: u32,
    experts: u32, // at most MAX_EXPERTS
    k: u32,       // experts per token
    norm: u32,    // 1: divide the chosen probabilities by their sum
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;       // route: [n, hidden]; combine: ey [n k, hidden]
@group(0) @binding(2) var<storage, read> router: array<f32>;  // route: [experts, hidden]; combine: wts [n k]
@group(0) @binding(3) var<storage, read_write> ids: array<u32>; // route: [n k]
@group(0) @binding(4) var<storage, read_write> wts: array<f32>; // route: [n k]; combine: x [n, hidden]

const WG: u32 = 64u;
const MAX_EXPERTS: u32 = 512u;
// Below every probability's logit: marks an expert already chosen.
const TAKEN: f32 = -3.4e38;

var<workgroup> lg: array<f32, 512>;

@compute @workgroup_size(64)
fn route(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let t = wg.x;
    for (var e = li; e < p.experts; e += WG) {
        var s = 0.0;
        for (var c = 0u; c < p.hidden; c++) {
            s += x[t * p.hidden + c] * router[e * p.hidden + c];
        }
        lg[e] = s;
    }
    workgroupBarrier();
    if li != 0u {
        return;
    }
    var mx = lg[0];
    for (var e = 1u; e < p.experts; e++) {
        mx = max(mx, lg[e]);
    }
    var sum = 0.0;
    for (var e = 0u; e < p.experts; e++) {
        sum += exp(lg[e] - mx);
    }
    var chosen = 0.0;
    for (var j = 0u; j < p.k; j++) {
        var best = 0u;
        var bv = TAKEN;
        for (var e = 0u; e < p.experts; e++) {
            if lg[e] > bv {
                bv = lg[e];
                best = e;
            }
        }
        let prob = exp(bv - mx) / sum;
        ids[t * p.k + j] = best;
        wts[t * p.k + j] = prob;
        chosen += prob;
        lg[best] = TAKEN;
    }
    if p.norm != 0u {
        for (var j = 0u; j < p.k; j++) {
            wts[t * p.k + j] = wts[t * p.k + j] / chosen;
        }
    }
}

@compute @workgroup_size(256)
fn combine(@builtin(global_invocation_id) gid: vec3<u32>) {
    let c = gid.x;
    let t = gid.y;
    if c >= p.hidden {
        return;
    }
    var s = 0.0;
    for (var j = 0u; j < p.k; j++) {
        let q = t * p.k + j;
        s += router[q] * x[q * p.hidden + c];
    }
    wts[t * p.hidden + c] += s;
}
