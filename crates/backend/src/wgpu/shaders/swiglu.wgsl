// out[t, i] = silu(gate) * up, each row of gu being [gate | up]. Grid: (inter / 256, tokens).

struct P {
    n: u32,
    inter: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> gu: array<f32>;
@group(0) @binding(2) var<storage, read_write> out: array<f32>;

@compute @workgroup_size(256)
fn main(@builtin(global_invocation_id) gid: vec3<u32>) {
    let i = gid.x;
    let t = gid.y;
    if i >= p.inter {
        return;
    }
    let g = gu[t * 2u * p.inter + i];
    let u = gu[t * 2u * p.inter + p.inter + i];
    out[t * p.inter + i] = g / (1.0 + exp(-g)) * u;
}
