enable f16;
enable wgpu_cooperative_matrix;

// Paged attention of prompt chunks on matrix units (tensor cores through
// VK_KHR_cooperative_matrix, Apple's simdgroup matrices through Metal), with the step's K/V
// written into their cache slots by the same kernel, as attention.wgsl does with scalar f32 math.
//
// Why: the scalar kernel spends a 512-token prompt's attention at ~1.5 TFLOP/s; here the two
// products, scores = Q K^T and out = P V, run as F x F fragments (f16 operands, f32 sums).
//
// A workgroup of four subgroups takes one KV head and one tile of queries: consecutive tokens of
// one sequence with every query head of the group, up to 64 rows (16 per subgroup; the host cuts
// tiles of 64 / group tokens). It streams the keys the tile needs in tiles of KT keys through
// workgroup memory, looking each key up in the sequence's block table.
//
// Two passes over the keys: the first takes each row's maximum score, the second its
// probabilities exp(score - max), their sum and P V. The accumulators of P V are opaque
// fragments that cannot be rescaled row by row, so the maximum is known before they start (the
// scores are computed twice; on matrix units that costs less than a pass through memory would).
//
// Numerics: Q, K, V and P are f16 (the cache's K/V already are; Q and P round once, 2^-11
// relative), scores and P V sum in f32, the softmax is f32. Keys past the tile's last position
// load as zero and masked scores (after a row's position, before its window) count zero, so NaN
// in unused cache slots never reaches a sum.
//
// The parameter block, bindings, key reads, fused KV write and key span: attention_common.wgsl.

const SG: u32 = SG_SIZEu;
const WG: u32 = 4u * SG;
const F: u32 = FRAGu;
const HD: u32 = HD_SIZEu;
const HALF: u32 = HD / 2u;
const KT: u32 = 32u;     // keys per tile
const RS: u32 = 16u;     // query rows per subgroup
const ROWS: u32 = 4u * RS;
// Row strides (in elements) of the staged tiles: 8 halves (4 floats) of padding keep every
// fragment's start 16-byte aligned and spread a fragment's rows over the memory banks.
const LDQ: u32 = HD + 8u;
const LDP: u32 = KT + 8u;
const FK: u32 = KT / F;  // key fragments of a tile
const LDV: u32 = KT + 8u; // the V tile, transposed: [HD][LDV]
const NEG: f32 = -3.0e38;

var<workgroup> qs: array<f16, QS_LEN>;   // [ROWS][LDQ]: the tile's Q rows
var<workgroup> kv: array<f16, KV_LEN>;   // the K tile [KT][LDQ], then the V tile [HD][LDV]
// Per subgroup, RS x KT scores as (RS / F) x FK fragments of F x F, each row-major and
// contiguous (stride F, as the GEMM stores them); at the end, one output fragment at a time.
var<workgroup> ss: array<f32, SS_LEN>;
var<workgroup> ps: array<f16, PS_LEN>;   // [ROWS][LDP]: probabilities
var<workgroup> lsum: array<f32, ROWS>;   // each row's sum of probabilities
// The tile's first key and last key + 1 (x, y). A vec4: every workgroup variable here is a
// multiple of 16 bytes, since NVIDIA's Vulkan driver may place them in any order and a fragment
// load needs a 16-byte aligned start (with an 8-byte variable first, the scores came out wrong).
var<workgroup> span: vec4<u32>;

// Stages KT keys from position k0 into `kv`: K row-major [key][dim], V transposed [dim][key]
// (so that both products load their B operand column-major, the form the GEMM uses).
fn stage(is_k: bool, k0: u32, end: u32, kvh: u32, first_new: u32, new_row: u32, toff: u32, li: u32) {
    for (var w = li; w < KT * HALF; w += WG) {
        let j = w / HALF;
        let i = w % HALF;
        let v = unpack2x16float(kv_word(is_k, k0 + j, end, kvh, i, first_new, new_row, toff));
        if is_k {
            kv[j * LDQ + 2u * i] = f16(v.x);
            kv[j * LDQ + 2u * i + 1u] = f16(v.y);
        } else {
            kv[2u * i * LDV + j] = f16(v.x);
            kv[(2u * i + 1u) * LDV + j] = f16(v.y);
        }
    }
}

@compute @workgroup_size(WG_SIZE)
fn main(
    @builtin(local_invocation_index) li: u32,
    @builtin(workgroup_id) wg: vec3<u32>,
    @builtin(subgroup_id) sg: u32,
    @builtin(subgroup_invocation_id) lane: u32,
) {
    let kvh = wg.x;
    let t0 = tok[wg.y * 8u + 5u];
    let cnt = tok[wg.y * 8u + 6u];
    let g = p.group;
    let nrows = cnt * g;
    let first_new = tok[t0 * 8u + 2u];
    let new_row = tok[t0 * 8u + 3u];
    let toff = tok[t0 * 8u + 4u];

    write_new_kv(li, WG, t0, cnt, kvh);
    // Q rows, zero past the tile's rows: row r is head (r % g) of the group for token t0 + r / g.
    for (var w = li; w < ROWS * HD; w += WG) {
        let r = w / HD;
        let d = w % HD;
        var v = 0.0;
        if r < nrows {
            v = qkv[(t0 + r / g) * p.stride + (kvh * g + r % g) * HD + d];
        }
        qs[r * LDQ + d] = f16(v);
    }
    if li == 0u {
        span = vec4<u32>(tile_span(t0, cnt), 0u, 0u);
    }
    let sp = workgroupUniformLoad(&span);

    // Lanes 0..RS of a subgroup each own one of its rows for the softmax.
    let own = lane < RS;
    let row = sg * RS + min(lane, RS - 1u);
    let live = own && row < nrows;
    var pos = 0u;
    var first = 1u; // first > pos: a dead row admits no key
    if live {
        pos = tok[(t0 + row / g) * 8u];
        first = 0u;
        if p.window != 0u && pos + 1u > p.window {
            first = pos + 1u - p.window;
        }
    }
    let q0 = sg * RS * LDQ;
    let s0 = sg * RS * KT;
    let p0 = sg * RS * LDP;
//@decl

    // Pass 1: each row's maximum score.
    var m = NEG;
    for (var k0 = sp.x; k0 < sp.y; k0 += KT) {
        workgroupBarrier();
        stage(true, k0, sp.y, kvh, first_new, new_row, toff, li);
        workgroupBarrier();
//@scores
        workgroupBarrier();
        if live {
            for (var c = 0u; c < KT; c++) {
                let j = k0 + c;
                if j >= first && j <= pos {
                    m = max(m, ss[score(sg, lane, c)] * p.scale);
                }
            }
        }
    }

    // Pass 2: probabilities, their sums, and P V.
    var l = 0.0;
    for (var k0 = sp.x; k0 < sp.y; k0 += KT) {
        workgroupBarrier();
        stage(true, k0, sp.y, kvh, first_new, new_row, toff, li);
        workgroupBarrier();
//@scores
        workgroupBarrier();
        if own {
            for (var c = 0u; c < KT; c++) {
                let j = k0 + c;
                var pr = 0.0;
                if j >= first && j <= pos {
                    pr = exp(ss[score(sg, lane, c)] * p.scale - m);
                }
                l += pr;
                ps[row * LDP + c] = f16(pr);
            }
        }
        workgroupBarrier();
        stage(false, k0, sp.y, kvh, first_new, new_row, toff, li);
        workgroupBarrier();
//@pv
    }
    if own {
        lsum[row] = l;
    }
    workgroupBarrier();
//@store
}

// Where subgroup sg's score of its row `lr` (0..RS) and the tile's key c lies in `ss`.
fn score(sg: u32, lr: u32, c: u32) -> u32 {
    return sg * RS * KT + ((lr / F) * FK + c / F) * F * F + (lr % F) * F + c % F;
}

// Writes the F x F output fragment just stored at the start of this subgroup's `ss` (rows a0..
// of the subgroup) to dims d0.. of those rows' outputs, divided by the rows' sums; rows past the
// tile are skipped.
fn put(sg: u32, a0: u32, d0: u32, lane: u32, t0: u32, nrows: u32, kvh: u32) {
    for (var e = lane; e < F * F; e += SG) {
        let r = sg * RS + a0 + e / F;
        if r < nrows {
            let t = t0 + r / p.group;
            let o = t * p.out_stride + (kvh * p.group + r % p.group) * HD + d0 + e % F;
            out[o] = ss[sg * RS * KT + e] / lsum[r];
        }
    }
}
