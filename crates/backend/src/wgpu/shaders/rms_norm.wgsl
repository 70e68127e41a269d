// y[i] = x[src] / sqrt(mean(x[src]^2) + eps) * weight, src = i or idx[i] (gather: the output
// norm of the rows whose logits are wanted). One workgroup per output row.

struct P {
    dim: u32,
    n: u32,
    eps: f32,
    gather: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> x: array<f32>;
@group(0) @binding(2) var<storage, read> wt: array<f32>;
@group(0) @binding(3) var<storage, read_write> y: array<f32>;
@group(0) @binding(4) var<storage, read> idx: array<u32>;

var<workgroup> red: array<f32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let i = wg.x;
    var src = i;
    if p.gather != 0u {
        src = idx[i];
    }
    let xb = src * p.dim;
    var s = 0.0;
    for (var c = li; c < p.dim; c += 256u) {
        let v = x[xb + c];
        s += v * v;
    }
    red[li] = s;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k >>= 1u) {
        if li < k {
            red[li] += red[li + k];
        }
        workgroupBarrier();
    }
    let scale = 1.0 / sqrt(red[0] / f32(p.dim) + p.eps);
    for (var c = li; c < p.dim; c += 256u) {
        y[i * p.dim + c] = x[xb + c] * scale * wt[c];
    }
}
