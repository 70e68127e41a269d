// ids[r] = the index of the largest logit of row r: the first of equal maxima, NaN never wins
// (an all-NaN row gives 0), as the host's `argmax`. One workgroup per row.

struct P {
    rows: u32,
    vocab: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> logits: array<f32>;
@group(0) @binding(2) var<storage, read_write> ids: array<u32>;

var<workgroup> bv: array<f32, 256>;
var<workgroup> bi: array<u32, 256>;

fn is_nan(v: f32) -> bool {
    return (bitcast<u32>(v) & 0x7fffffffu) > 0x7f800000u;
}

// Whether (v, i) comes before (w, j): a number before NaN, larger first, then the lower index.
fn better(v: f32, i: u32, w: f32, j: u32) -> bool {
    if is_nan(v) != is_nan(w) {
        return is_nan(w);
    }
    if !is_nan(v) && v != w {
        return v > w;
    }
    return i < j;
}

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let base = wg.x * p.vocab;
    var best_v = bitcast<f32>(0x7fc00000u);
    var best_i = 0xffffffffu;
    for (var c = li; c < p.vocab; c += 256u) {
        let v = logits[base + c];
        if best_i == 0xffffffffu || better(v, c, best_v, best_i) {
            best_v = v;
            best_i = c;
        }
    }
    bv[li] = best_v;
    bi[li] = best_i;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k >>= 1u) {
        if li < k {
            let j = bi[li + k];
            if j != 0xffffffffu && (bi[li] == 0xffffffffu || better(bv[li + k], j, bv[li], bi[li])) {
                bv[li] = bv[li + k];
                bi[li] = j;
            }
        }
        workgroupBarrier();
    }
    if li == 0u {
        ids[wg.x] = bi[0];
    }
}
