// Paged attention over the f16 KV cache, with the step's own K/V written into their cache slots by
// the same launch (the fused KV write). Two kernels share one launch contract (arguments, grid
// (n, num_kv_heads, splits), block 32 * WARPS, split partials merged by `attention_reduce`):
//
// - `paged_attention`, for any mixed batch (prompt chunks and decodes). One CTA per (query row, KV
//   head, split of the keys): the GQA group's query heads share every K/V row load. A warp takes 32
//   keys at a time: in the K phase each lane scores one key against all the group's heads (16-byte
//   loads of the key row), then the warp's online softmax, then in the V phase each lane owns
//   HEAD_DIM/32 output dims and walks the 32 keys.
// - `paged_decode`, for batches whose rows are all decodes (query_len 1), where attention is one
//   pass over the whole context per row and must run at memory bandwidth: keys stream through
//   shared memory in tiles with coalesced 16-byte cp.async loads, several tiles in flight per CTA
//   (see its own comment). The host picks it per launch (attention.rs, `Plan::decode`); it is also
//   correct for any row, prompt rows included, only not built for them.
//
// - `paged_prefill` (prefill.cu, compiled into the same module), for sequences with long enough
//   prompt chunks: flash attention on tensor cores over a tile of query rows per CTA. In a mixed
//   batch it takes those sequences and one of the two kernels above the other rows (`skip_qlen`).
//
// In the first two, warps merge in shared memory; splits (flash-decoding) merge in `attention_reduce`.
// Keys of this step (positions >= seq_len - query_len) are read from the QKV rows, rounded to f16,
// not from the cache: another CTA of this launch may not have written them yet.
//
// `window` > 0 limits each query to its last `window` keys (Mistral's sliding window).
//
// Compile-time: HEAD_DIM (64, 128 or 256), GQA (query heads per KV head, 1 to 8).

#define WARPS 4
#define DPL (HEAD_DIM / 32)

struct __align__(16) SeqInfo {
    int query_start, query_len, seq_len, bt_offset;
};

__device__ __forceinline__ void load8(const float* __restrict__ p, float* v) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    v[0] = h2f(f2h(a.x)); v[1] = h2f(f2h(a.y)); v[2] = h2f(f2h(a.z)); v[3] = h2f(f2h(a.w));
    v[4] = h2f(f2h(b.x)); v[5] = h2f(f2h(b.y)); v[6] = h2f(f2h(b.z)); v[7] = h2f(f2h(b.w));
}

__device__ __forceinline__ void load8(const half_t* __restrict__ p, float* v) {
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    const unsigned int w[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
    for (int i = 0; i < 4; i++) {
        v[2 * i] = h2f((half_t)(w[i] & 0xffff));
        v[2 * i + 1] = h2f((half_t)(w[i] >> 16));
    }
}

// The fused KV write: row's K and V (after RoPE, in its QKV row) into its cache slot, rounded to
// f16. Done by split 0 of each (row, KV head).
__device__ __forceinline__ void write_step_kv(const float* __restrict__ qrow, int q_size, int kv_size,
                                              int kvh, half_t* __restrict__ k_cache,
                                              half_t* __restrict__ v_cache, int slot,
                                              int num_kv_heads) {
    const long dst = ((long)slot * num_kv_heads + kvh) * HEAD_DIM;
    for (int d = threadIdx.x; d < HEAD_DIM; d += blockDim.x) {
        k_cache[dst + d] = f2h(qrow[q_size + kvh * HEAD_DIM + d]);
        v_cache[dst + d] = f2h(qrow[q_size + kv_size + kvh * HEAD_DIM + d]);
    }
}

// The output row: f16 for cuBLAS, or f32 when the next matmul quantizes it to 8-bit blocks (the
// CPU quantizes its f32 attention output; rounding to f16 first would move a few % of them by a step).
__device__ __forceinline__ void store_out(void* out, int out_f32, long i, float v) {
    if (out_f32) reinterpret_cast<float*>(out)[i] = v;
    else reinterpret_cast<half_t*>(out)[i] = f2h(v);
}

// The end of both kernels: merges the warps' partial results (acc_s [WARPS][GQA][HEAD_DIM], m_s and
// l_s [WARPS][GQA], written before a __syncthreads; a warp that saw no key has m = -inf) and stores
// the output row (one split) or this split's partial for attention_reduce.
__device__ __forceinline__ void merge_warps(const float* acc_s, const float* m_s, const float* l_s,
                                            int row, int kvh, int q_size, int splits, long part,
                                            void* out, int out_f32, float* part_acc,
                                            float2* part_ml) {
    for (int i = threadIdx.x; i < GQA * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        float mx = -INFINITY;
#pragma unroll
        for (int w = 0; w < WARPS; w++) mx = fmaxf(mx, m_s[w * GQA + g]);
        float sum = 0.0f, a = 0.0f;
#pragma unroll
        for (int w = 0; w < WARPS; w++) {
            if (m_s[w * GQA + g] == -INFINITY) continue;  // a warp that saw no key
            const float f = __expf(m_s[w * GQA + g] - mx);
            sum += l_s[w * GQA + g] * f;
            a += acc_s[(w * GQA + g) * HEAD_DIM + d] * f;
        }
        if (splits == 1) {
            store_out(out, out_f32, (long)row * q_size + (kvh * GQA + g) * HEAD_DIM + d, a / sum);
        } else {
            part_acc[(part + (long)g * splits) * HEAD_DIM + d] = a;
            if (d == 0) part_ml[part + (long)g * splits] = make_float2(mx, sum);
        }
    }
}

// sc[g] += q_s[g] · key, the key row read (and rounded to f16) 8 elements at a time: from the
// cache (half_t) or from this step's QKV rows (float).
template <typename T>
__device__ __forceinline__ void score_key(const T* __restrict__ kp, const float (*q_s)[HEAD_DIM],
                                          float* sc) {
    float k[8];
#pragma unroll
    for (int d = 0; d < HEAD_DIM; d += 8) {
        load8(kp + d, k);
#pragma unroll
        for (int g = 0; g < GQA; g++) {
            const float4 qa = *reinterpret_cast<const float4*>(&q_s[g][d]);
            const float4 qb = *reinterpret_cast<const float4*>(&q_s[g][d + 4]);
            sc[g] += qa.x * k[0] + qa.y * k[1] + qa.z * k[2] + qa.w * k[3] +
                     qb.x * k[4] + qb.y * k[5] + qb.z * k[6] + qb.w * k[7];
        }
    }
}

// qkv: [n, qkv_stride] (q | k | v, after RoPE); k_cache, v_cache: [num_slots, num_kv_heads, HEAD_DIM]
// row_seq: [n]; seqs: [num_seqs]; block_tables: flat, seq i's at seqs[i].bt_offset; slot_mapping: [n]
// out: [n, num_heads * HEAD_DIM] f16, or f32 when out_f32 (one split); part_acc: [n, num_heads, splits, HEAD_DIM];
// part_ml: [n, num_heads, splits] (max, sum); skip_qlen > 0: rows of sequences with query_len >=
// skip_qlen are paged_prefill's (this launch returns at once for them, fused write included)
// grid: (n, num_kv_heads, splits); block: 32 * WARPS
extern "C" __global__ void __launch_bounds__(32 * WARPS)
paged_attention(const float* __restrict__ qkv, int qkv_stride, half_t* __restrict__ k_cache,
                half_t* __restrict__ v_cache, const int* __restrict__ row_seq,
                const SeqInfo* __restrict__ seqs, const int* __restrict__ block_tables,
                const int* __restrict__ slot_mapping, int num_kv_heads, int block_size_log2,
                float scale, int window, void* __restrict__ out, int out_f32,
                float* __restrict__ part_acc, float2* __restrict__ part_ml, int skip_qlen) {
    pdl_enter();
    __shared__ __align__(16) float q_s[GQA][HEAD_DIM];
    __shared__ float p_s[WARPS][GQA][32];
    __shared__ __align__(16) float acc_s[WARPS][GQA][HEAD_DIM];
    __shared__ float m_s[WARPS][GQA], l_s[WARPS][GQA];

    const int row = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    const int num_heads = num_kv_heads * GQA;
    const int q_size = num_heads * HEAD_DIM, kv_size = num_kv_heads * HEAD_DIM;
    const SeqInfo s = seqs[row_seq[row]];
    if (skip_qlen > 0 && s.query_len >= skip_qlen) return;  // a paged_prefill row
    const int first_new = s.seq_len - s.query_len;
    const int ctx = first_new + (row - s.query_start) + 1;  // causal: keys 0..=pos
    const float* qrow = qkv + (long)row * qkv_stride;

    if (split == 0)  // the fused KV write
        write_step_kv(qrow, q_size, kv_size, kvh, k_cache, v_cache, slot_mapping[row], num_kv_heads);
    // Each row divides its own keys into `splits` parts of whole warp chunks, so a launch's shape
    // depends only on the batch size (graph-friendly) and short rows leave their last splits empty.
    // Sliding window (window > 0): keys p - window < j <= p, i.e. j >= ctx - window.
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int keys_per_split = ((ctx - lo + splits - 1) / splits + 31) & ~31;
    const int start = lo + split * keys_per_split;
    const int end = min(ctx, start + keys_per_split);
    const long part = ((long)row * num_heads + kvh * GQA) * splits + split;
    if (start >= end) {  // an empty split: nothing to merge
        if (tid < GQA) part_ml[part + (long)tid * splits] = make_float2(-INFINITY, 0.0f);
        return;
    }
    for (int i = tid; i < GQA * HEAD_DIM; i += blockDim.x)
        q_s[i / HEAD_DIM][i % HEAD_DIM] = qrow[kvh * GQA * HEAD_DIM + i] * scale;
    __syncthreads();

    const int block_mask = (1 << block_size_log2) - 1;
    const int* bt = block_tables + s.bt_offset;
    float m[GQA], l[GQA], acc[GQA][DPL];
#pragma unroll
    for (int g = 0; g < GQA; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[g][i] = 0.0f;
    }

    for (int c = start + warp * 32; c < end; c += WARPS * 32) {
        // K phase: lane scores key j.
        const int j = c + lane;
        long src = 0;  // >= 0: cache row offset; < 0: -(1 + QKV row) of a key of this step
        float sc[GQA];
#pragma unroll
        for (int g = 0; g < GQA; g++) sc[g] = 0.0f;
        if (j < end) {
            if (j >= first_new) {
                const int r = s.query_start + (j - first_new);
                src = -1 - (long)r;
                const float* kp = qkv + (long)r * qkv_stride + q_size + kvh * HEAD_DIM;
                score_key(kp, q_s, sc);
            } else {
                const long slot = (long)bt[j >> block_size_log2] * (block_mask + 1) + (j & block_mask);
                src = (slot * num_kv_heads + kvh) * HEAD_DIM;
                const half_t* kp = k_cache + src;
                score_key(kp, q_s, sc);
            }
        }
        // Online softmax over the warp's 32 keys.
#pragma unroll
        for (int g = 0; g < GQA; g++) {
            const float cmax = warp_max(j < end ? sc[g] : -INFINITY);
            const float m_new = fmaxf(m[g], cmax);
            const float corr = __expf(m[g] - m_new);
            const float p = j < end ? __expf(sc[g] - m_new) : 0.0f;
            l[g] = l[g] * corr + warp_sum(p);
            m[g] = m_new;
            p_s[warp][g][lane] = p;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[g][i] *= corr;
        }
        __syncwarp();
        // V phase: lane owns dims lane * DPL .. + DPL.
        const int nvalid = min(32, end - c);
#pragma unroll 8
        for (int k = 0; k < nvalid; k++) {
            const long ks = __shfl_sync(0xffffffffu, src, k);
            float v[DPL];
            if (ks >= 0) {
                const half_t* vp = v_cache + ks + lane * DPL;
#pragma unroll
                for (int i = 0; i < DPL; i++) v[i] = h2f(vp[i]);
            } else {
                const float* vp = qkv + (-1 - ks) * qkv_stride + q_size + kv_size + kvh * HEAD_DIM + lane * DPL;
#pragma unroll
                for (int i = 0; i < DPL; i++) v[i] = h2f(f2h(vp[i]));
            }
#pragma unroll
            for (int g = 0; g < GQA; g++) {
                const float p = p_s[warp][g][k];
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[g][i] = fmaf(p, v[i], acc[g][i]);
            }
        }
        __syncwarp();
    }

    // Merge the warps.
#pragma unroll
    for (int g = 0; g < GQA; g++) {
#pragma unroll
        for (int i = 0; i < DPL; i++) acc_s[warp][g][lane * DPL + i] = acc[g][i];
        if (lane == 0) {
            m_s[warp][g] = m[g];
            l_s[warp][g] = l[g];
        }
    }
    __syncthreads();
    merge_warps(&acc_s[0][0][0], &m_s[0][0], &l_s[0][0], row, kvh, q_size, splits, part, out,
                out_f32, part_acc, part_ml);
}

// ---------------------------------------------------------------------------------------------
// paged_decode: the decode kernel. Same arguments, grid and block as paged_attention.
//
// Why a second kernel: a decode row reads its whole context once, so the step is a stream of
// K/V bytes and must run at memory bandwidth. paged_attention's K phase gives each lane its own
// key (a warp load touches 32 rows), its V phase re-reads V rows per key, and few bytes are in
// flight per SM. Here each CTA streams its key range through shared memory in tiles of DEC_TILE
// keys (16 KB of K + V for every HEAD_DIM) with 16-byte cp.async copies (a warp copies whole
// HEAD_DIM * 2-byte key rows), DEC_STAGES tiles deep: while one tile is computed the next two
// are in flight, 32 KB per CTA, and the host plans splits so every SM holds several CTAs.
//
// Per tile, warp w owns keys [w * DEC_KW, (w + 1) * DEC_KW):
// - QK: DEC_QD lanes share a key (lane = qd * DEC_KW + kk), each scoring 32 of its dims against
//   every GQA head (q from shared memory, the 8 lanes of a 16-byte access phase read one address),
//   partial sums joined by shuffles;
// - the warp's online softmax over its keys (its own m, l: warps merge at the end);
// - PV: lane owns output dims lane * DPL .. + DPL and walks the warp's keys, p by shuffle.
// Every K and V element is read from global memory once and converted once per CTA.
//
// Shared memory (dynamic, DEC_SMEM bytes, the host sets the attribute): DEC_STAGES stages of
// [K tile: DEC_TILE][HEAD_DIM] then [V tile: DEC_TILE][HEAD_DIM] f16, then q [GQA][DEC_QS] f32
// (pre-scaled; 8 floats of padding after each 32 dims, so lanes of different qd in one access
// phase hit different banks). K rows hold their 16-byte chunks XOR-swizzled by key (chunk c of
// key r at c ^ (r & 7)): in QK the 8 lanes of a phase read one chunk index of 8 different keys,
// which land in 8 different bank groups. V rows are plain (PV reads one row across the warp).
// After the key loop the stages hold the warps' partial outputs for the merge.
//
// Tail and edge keys: keys past the split's end are zero-filled (no stale NaN reaches PV) and
// masked to -inf before the softmax; keys of this step are converted from the QKV rows into the
// tile with ordinary shared stores (the wait_group + __syncthreads before the tile is computed
// orders both kinds of writes).
#define DEC_TILE (4096 / HEAD_DIM)   // keys per tile: 64, 32, 16
#define DEC_KW (DEC_TILE / WARPS)    // keys per warp per tile: 16, 8, 4
#define DEC_QD (32 / DEC_KW)         // lanes per key in QK (HEAD_DIM / 32)
#define DEC_CPR (HEAD_DIM / 8)       // 16-byte chunks per key row
#define DEC_STAGES 3
#define DEC_STAGE_HALVES (2 * DEC_TILE * HEAD_DIM)
#define DEC_LOADS (DEC_TILE * DEC_CPR / (32 * WARPS))  // 16-byte chunks per thread per tile (4)
#define DEC_KSTEP (32 * WARPS / DEC_CPR)                // keys between a thread's chunks
#define DEC_QS (HEAD_DIM / 32 * 40)  // floats per q head in shared memory
#define DEC_SMEM (DEC_STAGES * DEC_STAGE_HALVES * 2 + GQA * DEC_QS * 4)
// Registers: 4 CTAs per SM cap a thread at 128, enough up to GQA 4 at HEAD_DIM 128 (acc holds
// GQA * DPL floats); larger groups take 3 (170) rather than spill.
#define DEC_MIN_CTAS (GQA > 4 || GQA * DPL > 16 ? 3 : 4)
static_assert(DEC_TILE * DEC_CPR % (32 * WARPS) == 0 && 32 * WARPS % DEC_CPR == 0,
              "whole chunks per thread, one chunk column per thread");
static_assert(WARPS * GQA * HEAD_DIM * 4 <= DEC_STAGES * DEC_STAGE_HALVES * 2, "merge fits the stages");

__device__ __forceinline__ unsigned smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}
// dst: a shared-memory address (smem_u32), 16-byte aligned; src: global, 16-byte aligned.
__device__ __forceinline__ void cp_async16(unsigned dst, const void* src) {
    asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst), "l"(src) : "memory");
}
__device__ __forceinline__ void cp_async_commit() {
    asm volatile("cp.async.commit_group;" ::: "memory");
}
template <int N>
__device__ __forceinline__ void cp_async_wait() {
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
}

// Eight f32 rounded to f16, packed as one 16-byte chunk (a key or value row of this step).
__device__ __forceinline__ uint4 pack8(const float* __restrict__ p) {
    const float4 a = *reinterpret_cast<const float4*>(p);
    const float4 b = *reinterpret_cast<const float4*>(p + 4);
    uint4 u;
    u.x = (unsigned)f2h(a.x) | ((unsigned)f2h(a.y) << 16);
    u.y = (unsigned)f2h(a.z) | ((unsigned)f2h(a.w) << 16);
    u.z = (unsigned)f2h(b.x) | ((unsigned)f2h(b.y) << 16);
    u.w = (unsigned)f2h(b.z) | ((unsigned)f2h(b.w) << 16);
    return u;
}

__device__ __forceinline__ void unpack2(unsigned w, float* v) {
    v[0] = h2f((half_t)(w & 0xffff));
    v[1] = h2f((half_t)(w >> 16));
}

// DPL f16 values (DPL = 2, 4 or 8) from shared memory, one vector load.
__device__ __forceinline__ void load_dpl(const half_t* p, float* v) {
#if DPL == 2
    unpack2(*reinterpret_cast<const unsigned*>(p), v);
#elif DPL == 4
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    unpack2(u.x, v);
    unpack2(u.y, v + 2);
#else
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    unpack2(u.x, v);
    unpack2(u.y, v + 2);
    unpack2(u.z, v + 4);
    unpack2(u.w, v + 6);
#endif
}

// Arguments and shapes: as paged_attention. grid: (n, num_kv_heads, splits); block: 32 * WARPS;
// dynamic shared memory: DEC_SMEM bytes.
extern "C" __global__ void __launch_bounds__(32 * WARPS, DEC_MIN_CTAS)
paged_decode(const float* __restrict__ qkv, int qkv_stride, half_t* __restrict__ k_cache,
             half_t* __restrict__ v_cache, const int* __restrict__ row_seq,
             const SeqInfo* __restrict__ seqs, const int* __restrict__ block_tables,
             const int* __restrict__ slot_mapping, int num_kv_heads, int block_size_log2,
             float scale, int window, void* __restrict__ out, int out_f32,
             float* __restrict__ part_acc, float2* __restrict__ part_ml, int skip_qlen) {
    pdl_enter();
    extern __shared__ __align__(16) unsigned char dec_smem[];
    half_t* stages = reinterpret_cast<half_t*>(dec_smem);
    float* q_s = reinterpret_cast<float*>(dec_smem + DEC_STAGES * DEC_STAGE_HALVES * 2);
    __shared__ float m_s[WARPS * GQA], l_s[WARPS * GQA];

    const int row = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    {  // A launch with less shared memory than this layout needs would corrupt it: fail loudly.
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < DEC_SMEM) __trap();
    }
    const int num_heads = num_kv_heads * GQA;
    const int q_size = num_heads * HEAD_DIM, kv_size = num_kv_heads * HEAD_DIM;
    const SeqInfo s = seqs[row_seq[row]];
    if (skip_qlen > 0 && s.query_len >= skip_qlen) return;  // a paged_prefill row
    const int first_new = s.seq_len - s.query_len;
    const int ctx = first_new + (row - s.query_start) + 1;  // causal: keys 0..=pos
    const float* qrow = qkv + (long)row * qkv_stride;

    if (split == 0)  // the fused KV write
        write_step_kv(qrow, q_size, kv_size, kvh, k_cache, v_cache, slot_mapping[row], num_kv_heads);
    // Splits of whole tiles, each row dividing its own keys (see paged_attention).
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int keys_per_split =
        ((ctx - lo + splits - 1) / splits + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
    const int start = lo + split * keys_per_split;
    const int end = min(ctx, start + keys_per_split);
    const long part = ((long)row * num_heads + kvh * GQA) * splits + split;
    if (start >= end) {  // an empty split: nothing to merge
        if (tid < GQA) part_ml[part + (long)tid * splits] = make_float2(-INFINITY, 0.0f);
        return;
    }
    const int ntiles = (end - start + DEC_TILE - 1) / DEC_TILE;
    const int* bt = block_tables + s.bt_offset;
    const int block_mask = (1 << block_size_log2) - 1;

    // The loader: thread tid copies chunk column c = tid % DEC_CPR of keys key0 + i * DEC_KSTEP
    // (a warp copies whole rows, 16 bytes per lane); offsets within a stage are fixed per thread.
    const int c_ld = tid % DEC_CPR, key0 = tid / DEC_CPR;
    unsigned k_off[DEC_LOADS], v_off[DEC_LOADS];  // bytes from the stage's start
#pragma unroll
    for (int i = 0; i < DEC_LOADS; i++) {
        const int key = key0 + i * DEC_KSTEP;
        k_off[i] = (key * HEAD_DIM + ((c_ld ^ (key & 7)) << 3)) * 2;
        v_off[i] = ((DEC_TILE + key) * HEAD_DIM + (c_ld << 3)) * 2;
    }
    const unsigned stages_u32 = smem_u32(stages);
    // 32-bit slot math, one wide multiply-add per address: slots < 2^31, slot rows of < 2^31 bytes.
    const unsigned row_bytes = num_kv_heads * HEAD_DIM * 2;  // from one slot to the next
    const char* k_col = reinterpret_cast<const char*>(k_cache + kvh * HEAD_DIM + (c_ld << 3));
    const char* v_col = reinterpret_cast<const char*>(v_cache + kvh * HEAD_DIM + (c_ld << 3));
    const int cached_end = min(end, first_new);  // keys below come from the cache
    // Issues tile t's copies into stage t % DEC_STAGES.
    auto load_tile = [&](int t) {
        const int stage = t % DEC_STAGES;
        const unsigned sbase = stages_u32 + stage * DEC_STAGE_HALVES * 2;
        const int kbase = start + t * DEC_TILE + key0;
        if (start + (t + 1) * DEC_TILE <= cached_end) {
            // The common case, every key in the cache: block-table reads first (all in flight
            // together), then the copies.
            int blk[DEC_LOADS];
#pragma unroll
            for (int i = 0; i < DEC_LOADS; i++)
                blk[i] = bt[(kbase + i * DEC_KSTEP) >> block_size_log2];
#pragma unroll
            for (int i = 0; i < DEC_LOADS; i++) {
                const int j = kbase + i * DEC_KSTEP;
                const unsigned slot = ((unsigned)blk[i] << block_size_log2) + (j & block_mask);
                cp_async16(sbase + k_off[i], k_col + (size_t)slot * row_bytes);
                cp_async16(sbase + v_off[i], v_col + (size_t)slot * row_bytes);
            }
            return;
        }
        // A tile with keys of this step (converted from their QKV rows) or past the split's end
        // (zeros).
        unsigned char* sgen = dec_smem + stage * DEC_STAGE_HALVES * 2;
#pragma unroll
        for (int i = 0; i < DEC_LOADS; i++) {
            const int j = kbase + i * DEC_KSTEP;
            uint4* kd = reinterpret_cast<uint4*>(sgen + k_off[i]);
            uint4* vd = reinterpret_cast<uint4*>(sgen + v_off[i]);
            if (j < cached_end) {
                const unsigned slot =
                    ((unsigned)bt[j >> block_size_log2] << block_size_log2) + (j & block_mask);
                cp_async16(sbase + k_off[i], k_col + (size_t)slot * row_bytes);
                cp_async16(sbase + v_off[i], v_col + (size_t)slot * row_bytes);
            } else if (j < end) {
                const float* r = qkv + (long)(s.query_start + (j - first_new)) * qkv_stride +
                                 q_size + kvh * HEAD_DIM + (c_ld << 3);
                *kd = pack8(r);
                *vd = pack8(r + kv_size);
            } else {
                *kd = make_uint4(0, 0, 0, 0);
                *vd = make_uint4(0, 0, 0, 0);
            }
        }
    };
    // One commit group per tile slot, empty past the last tile, so wait_group counts stay fixed.
#pragma unroll
    for (int t = 0; t < DEC_STAGES - 1; t++) {
        if (t < ntiles) load_tile(t);
        cp_async_commit();
    }
    for (int i = tid; i < GQA * HEAD_DIM; i += blockDim.x) {
        const int g = i / HEAD_DIM, d = i % HEAD_DIM;
        q_s[g * DEC_QS + (d >> 5) * 40 + (d & 31)] = qrow[kvh * GQA * HEAD_DIM + i] * scale;
    }

    const int kk = lane % DEC_KW, qd = lane / DEC_KW;
    const int my_key = warp * DEC_KW + kk;  // this lane's key in the tile during QK
    const float* q_mine = q_s + qd * 40;
    float m[GQA], l[GQA], acc[GQA][DPL];
#pragma unroll
    for (int g = 0; g < GQA; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[g][i] = 0.0f;
    }

    for (int t = 0; t < ntiles; t++) {
        // Tile t has landed (this thread's copies), and after the barrier everyone's; every warp
        // is also done with tile t - 1, whose stage the next copies overwrite.
        cp_async_wait<DEC_STAGES - 2>();
        __syncthreads();
        if (t + DEC_STAGES - 1 < ntiles) load_tile(t + DEC_STAGES - 1);
        cp_async_commit();
        const half_t* kt = stages + (t % DEC_STAGES) * DEC_STAGE_HALVES;
        const half_t* vt = kt + DEC_TILE * HEAD_DIM;

        // QK: this lane's 32 dims (chunks qd * 4 .. + 4) of key my_key.
        float sc[GQA];
#pragma unroll
        for (int g = 0; g < GQA; g++) sc[g] = 0.0f;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int lc = qd * 4 + c;
            const uint4 u =
                *reinterpret_cast<const uint4*>(kt + my_key * HEAD_DIM + ((lc ^ (my_key & 7)) << 3));
            float k[8];
            unpack2(u.x, k);
            unpack2(u.y, k + 2);
            unpack2(u.z, k + 4);
            unpack2(u.w, k + 6);
#pragma unroll
            for (int g = 0; g < GQA; g++) {
                const float4 qa = *reinterpret_cast<const float4*>(q_mine + g * DEC_QS + c * 8);
                const float4 qb = *reinterpret_cast<const float4*>(q_mine + g * DEC_QS + c * 8 + 4);
                sc[g] += qa.x * k[0] + qa.y * k[1] + qa.z * k[2] + qa.w * k[3] +
                         qb.x * k[4] + qb.y * k[5] + qb.z * k[6] + qb.w * k[7];
            }
        }
        // Join the DEC_QD partial sums of a key (lanes kk, kk + DEC_KW, ...), then the warp's
        // online softmax over its DEC_KW keys (lanes 0 .. DEC_KW - 1 hold them all).
        const bool valid = start + t * DEC_TILE + my_key < end;
        float p[GQA];
#pragma unroll
        for (int g = 0; g < GQA; g++) {
#pragma unroll
            for (int o = DEC_KW; o < 32; o <<= 1) sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], o);
            const float x = valid ? sc[g] : -INFINITY;
            float mx = x;
#pragma unroll
            for (int o = 1; o < DEC_KW; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m[g], mx);
            const float m_ref = m_new == -INFINITY ? 0.0f : m_new;  // no valid key yet
            const float corr = __expf(m[g] - m_ref);
            p[g] = __expf(x - m_ref);
            float ps = p[g];
#pragma unroll
            for (int o = 1; o < DEC_KW; o <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l[g] = l[g] * corr + ps;
            m[g] = m_new;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[g][i] *= corr;
        }
        // PV over the warp's keys; key k2's p sits in lane k2.
#pragma unroll
        for (int k2 = 0; k2 < DEC_KW; k2++) {
            float v[DPL];
            load_dpl(vt + (warp * DEC_KW + k2) * HEAD_DIM + lane * DPL, v);
#pragma unroll
            for (int g = 0; g < GQA; g++) {
                const float pk = __shfl_sync(0xffffffffu, p[g], k2);
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[g][i] = fmaf(pk, v[i], acc[g][i]);
            }
        }
    }

    // Merge the warps, their partial outputs parked in the (now idle) stages.
    cp_async_wait<0>();
    __syncthreads();
    float* acc_s = reinterpret_cast<float*>(dec_smem);  // [WARPS][GQA][HEAD_DIM]
#pragma unroll
    for (int g = 0; g < GQA; g++) {
#pragma unroll
        for (int i = 0; i < DPL; i++) acc_s[(warp * GQA + g) * HEAD_DIM + lane * DPL + i] = acc[g][i];
        if (lane == 0) {
            m_s[warp * GQA + g] = m[g];
            l_s[warp * GQA + g] = l[g];
        }
    }
    __syncthreads();
    merge_warps(acc_s, m_s, l_s, row, kvh, q_size, splits, part, out, out_f32, part_acc, part_ml);
}

// Merges the splits of each (row, head) in one pass (running max, rescaled as it grows), so the
// loads of all splits are independent and in flight together. grid: (n, num_heads); block: HEAD_DIM
// Rows of sequences with query_len >= skip_qlen (> 0) belong to paged_prefill and are left alone.
extern "C" __global__ void attention_reduce(const float* __restrict__ part_acc,
                                            const float2* __restrict__ part_ml, int splits,
                                            void* __restrict__ out, int out_f32,
                                            const int* __restrict__ row_seq,
                                            const SeqInfo* __restrict__ seqs, int skip_qlen) {
    pdl_enter();
    const int row = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (skip_qlen > 0 && seqs[row_seq[row]].query_len >= skip_qlen) return;
    const long base = ((long)row * gridDim.y + head) * splits;
    float mx = -INFINITY, sum = 0.0f, a = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; s++) {
        const float2 ml = part_ml[base + s];
        const float x = part_acc[(base + s) * HEAD_DIM + d];
        if (ml.x == -INFINITY) continue;  // an empty split (its part_acc was never written)
        const float m_new = fmaxf(mx, ml.x);
        const float f_old = __expf(mx - m_new), f = __expf(ml.x - m_new);
        sum = sum * f_old + ml.y * f;
        a = a * f_old + x * f;
        mx = m_new;
    }
    store_out(out, out_f32, ((long)row * gridDim.y + head) * HEAD_DIM + d, a / sum);
}
