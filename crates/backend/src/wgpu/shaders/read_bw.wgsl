// The adapter's read bandwidth: every workgroup reads its share of a buffer in 16-byte loads
// (consecutive invocations, consecutive words) and writes one sum, so the bytes moved are the
// buffer's. `quire roofline --backend wgpu` times it.

struct P {
    words: u32, // vec4<u32> elements
    per_group: u32,
}

@group(0) @binding(0) var<uniform> p: P;
@group(0) @binding(1) var<storage, read> src: array<vec4<u32>>;
@group(0) @binding(2) var<storage, read_write> sums: array<u32>;

var<workgroup> part: array<u32, 256>;

@compute @workgroup_size(256)
fn main(@builtin(local_invocation_index) li: u32, @builtin(workgroup_id) wg: vec3<u32>) {
    let start = wg.x * p.per_group;
    let end = min(start + p.per_group, p.words);
    var s = vec4<u32>(0u);
    for (var i = start + li; i < end; i += 256u) {
        s ^= src[i];
    }
    part[li] = s.x ^ s.y ^ s.z ^ s.w;
    workgroupBarrier();
    for (var k = 128u; k > 0u; k >>= 1u) {
        if li < k {
            part[li] ^= part[li + k];
        }
        workgroupBarrier();
    }
    if li == 0u {
        sums[wg.x] = part[0];
    }
}
