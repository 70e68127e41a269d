// ---------------------------------------------------------------------------------------------
// paged_prefill: flash attention for prompt chunks over the paged cache, on tensor cores.
// Compiled after attention.cu (same module, same HEAD_DIM and GQA; shares SeqInfo, pack8,
// cp.async and store_out).
//
// Why a third kernel: a prompt chunk of q rows attends to its whole context, so paged_attention
// (one CTA per query row, CUDA cores) reads every K/V row q times and spends ~40% of an 8B
// 512-token prefill there. Here one CTA takes a tile of PF_QROWS query rows of one sequence with
// all GQA query heads of one KV head: PF_BM = 64 rows of the score matrix, score row
// m = r * GQA + g (query row r, head g), 16 per warp. It walks the keys in tiles of PF_BN through
// shared memory, two stages deep, on mma.sync m16n8k16 (f16 inputs, f32 accumulators):
// S = Q·Kᵀ, masking and the online softmax in registers (exp2 with the scale folded in),
// O += P·V with P taken straight from the S accumulators (the C fragment of two n8 tiles is the A
// fragment of one k16 step). Keys are read once per CTA, not once per query row.
//
// Keys of this step (positions >= first_new) come from the QKV rows rounded to f16, as in the
// other kernels (another CTA may not have written them to the cache yet); earlier keys are copied
// from their cache slots with cp.async. Keys past the tile's last position are zero-filled and
// masked, so no stale NaN of an unused slot reaches the MMA.
//
// The fused KV write: each CTA writes the K and V of its own query rows for its KV head, so every
// (row, KV head) of the prefill sequences is written exactly once.
//
// Shared memory (dynamic, PF_SMEM bytes): Q [PF_BM][HEAD_DIM], then 2 stages of
// K [PF_BN][HEAD_DIM] and V [PF_BN][HEAD_DIM], all f16, rows of 16-byte chunks stored XOR-swizzled
// (chunk c of row r at c ^ (r & 7)) so the 8 row addresses of an ldmatrix phase hit 8 bank groups.
#define PF_WARPS 4
#define PF_BM 64
#define PF_QROWS (PF_BM / GQA)  // query rows per CTA (GQA 3: 21 rows, score row 63 idle)
#define PF_BN (HEAD_DIM == 256 ? 32 : 64)
#define PF_CH (HEAD_DIM / 8)  // 16-byte chunks per row
#define PF_STAGE (2 * PF_BN * HEAD_DIM)  // halves per stage (K then V)
#define PF_SMEM ((PF_BM * HEAD_DIM + 2 * PF_STAGE) * 2)
static_assert((PF_BN * PF_CH) % (32 * PF_WARPS) == 0, "whole chunks per thread");

// Byte offset of chunk c of row r in a swizzled [rows][HEAD_DIM] f16 array.
__device__ __forceinline__ unsigned pf_off(int r, int c) {
    return (unsigned)(r * PF_CH + (c ^ (r & 7))) * 16u;
}

__device__ __forceinline__ void ldsm_x4(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
__device__ __forceinline__ void ldsm_x4_t(unsigned addr, unsigned* r) {
    asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];"
                 : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
                 : "r"(addr));
}
// c += a · b: a: 16x16 f16 (row), b: 16x8 f16 (col), c: 16x8 f32.
__device__ __forceinline__ void mma16816(float* c, const unsigned* a, unsigned b0, unsigned b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, "
        "{%8,%9}, {%0,%1,%2,%3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}
// Two f32 as an f16 pair, the first in the low half.
__device__ __forceinline__ unsigned pack_h2(float lo, float hi) {
    return (unsigned)f2h(lo) | ((unsigned)f2h(hi) << 16);
}

struct __align__(8) PrefillTile {
    int seq, first;  // sequence index, first query row of the tile within its chunk
};

// qkv, k_cache, v_cache, seqs, block_tables, slot_mapping, scale, window, out, out_f32: as
// paged_attention. tiles: [gridDim.x].
// grid: (tiles, num_kv_heads); block: 32 * PF_WARPS; dynamic shared memory: PF_SMEM bytes.
extern "C" __global__ void __launch_bounds__(32 * PF_WARPS)
paged_prefill(const float* __restrict__ qkv, int qkv_stride, half_t* __restrict__ k_cache,
              half_t* __restrict__ v_cache, const SeqInfo* __restrict__ seqs,
              const int* __restrict__ block_tables, const int* __restrict__ slot_mapping,
              const PrefillTile* __restrict__ tiles, int num_kv_heads, int block_size_log2,
              float scale, int window, void* __restrict__ out, int out_f32) {
    pdl_enter();
    extern __shared__ __align__(16) unsigned char pf_smem[];
    {  // A launch with less shared memory than this layout needs would corrupt it: fail loudly.
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < PF_SMEM) __trap();
    }
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const PrefillTile tile = tiles[blockIdx.x];
    const int kvh = blockIdx.y;
    const SeqInfo s = seqs[tile.seq];
    const int num_heads = num_kv_heads * GQA;
    const int q_size = num_heads * HEAD_DIM, kv_size = num_kv_heads * HEAD_DIM;
    const int nq = min(PF_QROWS, s.query_len - tile.first);  // query rows of this tile
    const int first_new = s.seq_len - s.query_len;
    const int p0 = first_new + tile.first;  // position of the tile's first row
    const int hi = p0 + nq;                  // keys [lo, hi) can be seen by some row
    const int lo = window > 0 ? max(0, p0 - window + 1) : 0;
    const int row0 = s.query_start + tile.first;

    // The fused KV write of this tile's rows.
    for (int i = tid; i < nq * PF_CH; i += blockDim.x) {
        const int r = i / PF_CH, c = i % PF_CH;
        const float* src = qkv + (long)(row0 + r) * qkv_stride + q_size + kvh * HEAD_DIM + c * 8;
        const long dst = ((long)slot_mapping[row0 + r] * num_kv_heads + kvh) * HEAD_DIM + c * 8;
        *reinterpret_cast<uint4*>(k_cache + dst) = pack8(src);
        *reinterpret_cast<uint4*>(v_cache + dst) = pack8(src + kv_size);
    }

    const unsigned q_u32 = smem_u32(pf_smem);
    const unsigned kv_u32 = q_u32 + PF_BM * HEAD_DIM * 2;
    const int* bt = block_tables + s.bt_offset;
    const int block_mask = (1 << block_size_log2) - 1;
    const int cached_end = min(hi, first_new);  // keys below come from the cache
    const unsigned row_bytes = num_kv_heads * HEAD_DIM * 2;
    const char* k_base = reinterpret_cast<const char*>(k_cache + kvh * HEAD_DIM);
    const char* v_base = reinterpret_cast<const char*>(v_cache + kvh * HEAD_DIM);
    const int ntiles = (hi - lo + PF_BN - 1) / PF_BN;
    // Tile t (keys lo + t * PF_BN ..) into stage t & 1.
    auto load_tile = [&](int t) {
        const unsigned kb = kv_u32 + (t & 1) * PF_STAGE * 2, vb = kb + PF_BN * HEAD_DIM * 2;
        unsigned char* kg = pf_smem + PF_BM * HEAD_DIM * 2 + (t & 1) * PF_STAGE * 2;
        unsigned char* vg = kg + PF_BN * HEAD_DIM * 2;
#pragma unroll
        for (int i = 0; i < PF_BN * PF_CH / (32 * PF_WARPS); i++) {
            const int idx = tid + i * 32 * PF_WARPS;
            const int kk = idx / PF_CH, c = idx % PF_CH;
            const int j = lo + t * PF_BN + kk;
            const unsigned o = pf_off(kk, c);
            if (j < cached_end) {
                const unsigned slot =
                    ((unsigned)bt[j >> block_size_log2] << block_size_log2) + (j & block_mask);
                cp_async16(kb + o, k_base + (size_t)slot * row_bytes + c * 16);
                cp_async16(vb + o, v_base + (size_t)slot * row_bytes + c * 16);
            } else if (j < hi) {
                const float* r = qkv + (long)(s.query_start + (j - first_new)) * qkv_stride +
                                 q_size + kvh * HEAD_DIM + c * 8;
                *reinterpret_cast<uint4*>(kg + o) = pack8(r);
                *reinterpret_cast<uint4*>(vg + o) = pack8(r + kv_size);
            } else {
                *reinterpret_cast<uint4*>(kg + o) = make_uint4(0, 0, 0, 0);
                *reinterpret_cast<uint4*>(vg + o) = make_uint4(0, 0, 0, 0);
            }
        }
    };
    load_tile(0);
    cp_async_commit();
    // Q rows (score row m = r * GQA + g), rounded to f16; rows past the tile are zeros.
    for (int i = tid; i < PF_BM * PF_CH; i += blockDim.x) {
        const int m = i / PF_CH, c = i % PF_CH;
        const int r = m / GQA, g = m % GQA;
        uint4 v = make_uint4(0, 0, 0, 0);
        if (r < nq && m < PF_QROWS * GQA)
            v = pack8(qkv + (long)(row0 + r) * qkv_stride + (kvh * GQA + g) * HEAD_DIM + c * 8);
        *reinterpret_cast<uint4*>(pf_smem + pf_off(m, c)) = v;
    }

    // This thread's two score rows (fragment rows lane / 4 and + 8 of its warp's 16).
    const float sl2 = scale * 1.4426950408889634f;  // exp(x) = exp2(x * log2 e)
    int pos[2];
    bool live[2];
#pragma unroll
    for (int h = 0; h < 2; h++) {
        const int m = warp * 16 + (lane >> 2) + h * 8;
        live[h] = m < PF_QROWS * GQA && m / GQA < nq;
        pos[h] = p0 + m / GQA;
    }
    float mrow[2] = {-INFINITY, -INFINITY}, lrow[2] = {0.0f, 0.0f};
    float o[HEAD_DIM / 8][4];
#pragma unroll
    for (int i = 0; i < HEAD_DIM / 8; i++) o[i][0] = o[i][1] = o[i][2] = o[i][3] = 0.0f;

    for (int t = 0; t < ntiles; t++) {
        if (t + 1 < ntiles) load_tile(t + 1);
        cp_async_commit();
        cp_async_wait<1>();
        __syncthreads();
        const unsigned kb = kv_u32 + (t & 1) * PF_STAGE * 2, vb = kb + PF_BN * HEAD_DIM * 2;

        // S = Q · Kᵀ for the warp's 16 rows and PF_BN keys.
        float sc[PF_BN / 8][4];
#pragma unroll
        for (int i = 0; i < PF_BN / 8; i++) sc[i][0] = sc[i][1] = sc[i][2] = sc[i][3] = 0.0f;
#pragma unroll
        for (int ks = 0; ks < HEAD_DIM / 16; ks++) {
            unsigned a[4];
            ldsm_x4(q_u32 + pf_off(warp * 16 + (lane & 15), 2 * ks + (lane >> 4)), a);
#pragma unroll
            for (int np = 0; np < PF_BN / 16; np++) {
                unsigned b[4];
                const int mat = lane >> 3;
                ldsm_x4(kb + pf_off(np * 16 + (mat >> 1) * 8 + (lane & 7), 2 * ks + (mat & 1)), b);
                mma16816(sc[2 * np], a, b[0], b[1]);
                mma16816(sc[2 * np + 1], a, b[2], b[3]);
            }
        }
        // Mask, then the online softmax per row; the 4 lanes of a quad share a row.
        const int key0 = lo + t * PF_BN + 2 * (lane & 3);
        float mx[2] = {-INFINITY, -INFINITY};
#pragma unroll
        for (int i = 0; i < PF_BN / 8; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                const int h = e >> 1, j = key0 + i * 8 + (e & 1);
                const bool ok = live[h] && j <= pos[h] && (window <= 0 || j > pos[h] - window);
                sc[i][e] = ok ? sc[i][e] * sl2 : -INFINITY;
                mx[h] = fmaxf(mx[h], sc[i][e]);
            }
        }
        float corr[2], mref[2];
#pragma unroll
        for (int h = 0; h < 2; h++) {
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 1));
            mx[h] = fmaxf(mx[h], __shfl_xor_sync(0xffffffffu, mx[h], 2));
            const float m_new = fmaxf(mrow[h], mx[h]);
            mref[h] = m_new == -INFINITY ? 0.0f : m_new;  // no visible key yet
            corr[h] = exp2f(mrow[h] - mref[h]);
            mrow[h] = m_new;
        }
        float ls[2] = {0.0f, 0.0f};
#pragma unroll
        for (int i = 0; i < PF_BN / 8; i++) {
#pragma unroll
            for (int e = 0; e < 4; e++) {
                sc[i][e] = exp2f(sc[i][e] - mref[e >> 1]);
                ls[e >> 1] += sc[i][e];
            }
        }
#pragma unroll
        for (int h = 0; h < 2; h++) lrow[h] = lrow[h] * corr[h] + ls[h];  // quad-partial sums
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 8; i++) {
            o[i][0] *= corr[0];
            o[i][1] *= corr[0];
            o[i][2] *= corr[1];
            o[i][3] *= corr[1];
        }
        // O += P · V, 16 keys per step.
#pragma unroll
        for (int kk = 0; kk < PF_BN / 16; kk++) {
            unsigned a[4];
            a[0] = pack_h2(sc[2 * kk][0], sc[2 * kk][1]);
            a[1] = pack_h2(sc[2 * kk][2], sc[2 * kk][3]);
            a[2] = pack_h2(sc[2 * kk + 1][0], sc[2 * kk + 1][1]);
            a[3] = pack_h2(sc[2 * kk + 1][2], sc[2 * kk + 1][3]);
#pragma unroll
            for (int dp = 0; dp < HEAD_DIM / 16; dp++) {
                unsigned b[4];
                const int mat = lane >> 3;
                ldsm_x4_t(vb + pf_off(kk * 16 + (mat & 1) * 8 + (lane & 7), 2 * dp + (mat >> 1)), b);
                mma16816(o[2 * dp], a, b[0], b[1]);
                mma16816(o[2 * dp + 1], a, b[2], b[3]);
            }
        }
        __syncthreads();  // the next iteration's copies overwrite this stage
    }
    cp_async_wait<0>();

    // Normalize and store: dims 2 * (lane & 3) + {0, 1} of each n8 tile.
#pragma unroll
    for (int h = 0; h < 2; h++) {
        float l = lrow[h];
        l += __shfl_xor_sync(0xffffffffu, l, 1);
        l += __shfl_xor_sync(0xffffffffu, l, 2);
        if (!live[h]) continue;
        const int m = warp * 16 + (lane >> 2) + h * 8;
        const long base = (long)(row0 + m / GQA) * q_size + (kvh * GQA + m % GQA) * HEAD_DIM;
        const float inv = 1.0f / l;
#pragma unroll
        for (int i = 0; i < HEAD_DIM / 8; i++) {
            const int d = i * 8 + 2 * (lane & 3);
            store_out(out, out_f32, base + d, o[i][2 * h] * inv);
            store_out(out, out_f32, base + d + 1, o[i][2 * h + 1] * inv);
        }
    }
}
