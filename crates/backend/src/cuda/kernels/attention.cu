// Paged attention over the f16 KV cache, with the step's own K/V written into their cache slots by
// the same launch (the fused KV write). Three kernels, one module (this file, decode.cu and
// prefill.cu compiled together, same HEAD_DIM and GQA):
//
// - `paged_attention`, for any mixed batch (prompt chunks and decodes). One CTA per (query row, KV
//   head, split of the keys): the GQA group's query heads share every K/V row load. A warp takes 32
//   keys at a time: in the K phase each lane scores one key against all the group's heads (16-byte
//   loads of the key row), then the warp's online softmax, then in the V phase each lane owns
//   HEAD_DIM/32 output dims and walks the 32 keys. Grid (n, num_kv_heads, splits), block
//   32 * WARPS; the splits (flash-decoding) are merged by `attention_reduce`, a second launch.
// - `paged_decode` (decode.cu), for batches whose rows are all decodes (query_len 1), where
//   attention is one pass over the whole context per row and must run at memory bandwidth: keys
//   stream through shared memory in tiles with coalesced 16-byte cp.async loads. Same grid and
//   block, and the first arguments of paged_attention's list; it also applies the QKV bias,
//   QK-norm and RoPE itself (so a decode step launches no rope_qkv) and merges its own splits (so
//   no attention_reduce): a decode layer's attention is one launch. The host picks it per launch
//   (attention.rs, `Plan::decode`).
// - `paged_prefill` (prefill.cu), for sequences with long enough prompt chunks: flash attention on
//   tensor cores over a tile of query rows per CTA. In a mixed batch it takes those sequences and
//   paged_attention the other rows (`skip_qlen`).
//
// In the first two, warps merge in shared memory. Keys of this step (positions >= seq_len -
// query_len) are read from the QKV rows, rounded to f16, not from the cache: another CTA of this
// launch may not have written them yet.
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
// the output row (one split) or this split's partial for the split merge.
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

// One output element of a (row, head) merged over its splits in one pass (running max, rescaled
// as it grows), so the loads of all splits are independent and in flight together. Shared by
// attention_reduce and paged_decode's in-kernel merge, so both give the same bits. Loads go
// through L2 only (.cg): in paged_decode the partials were written by other CTAs of the launch.
// base: (row * num_heads + head) * splits; d: the element's dim
__device__ __forceinline__ float merge_splits(const float* part_acc, const float2* part_ml,
                                              long base, int splits, int d) {
    float mx = -INFINITY, sum = 0.0f, a = 0.0f;
#pragma unroll 8
    for (int s = 0; s < splits; s++) {
        const float2 ml = __ldcg(part_ml + base + s);
        const float x = __ldcg(part_acc + (base + s) * HEAD_DIM + d);
        if (ml.x == -INFINITY) continue;  // an empty split (its part_acc was never written)
        const float m_new = fmaxf(mx, ml.x);
        const float f_old = __expf(mx - m_new), f = __expf(ml.x - m_new);
        sum = sum * f_old + ml.y * f;
        a = a * f_old + x * f;
        mx = m_new;
    }
    return a / sum;
}

// Merges the splits of paged_attention's launches (paged_decode merges its own). grid:
// (n, num_heads); block: HEAD_DIM. Rows of sequences with query_len >= skip_qlen (> 0) belong to
// paged_prefill and are left alone.
extern "C" __global__ void attention_reduce(const float* __restrict__ part_acc,
                                            const float2* __restrict__ part_ml, int splits,
                                            void* __restrict__ out, int out_f32,
                                            const int* __restrict__ row_seq,
                                            const SeqInfo* __restrict__ seqs, int skip_qlen) {
    pdl_enter();
    const int row = blockIdx.x, head = blockIdx.y, d = threadIdx.x;
    if (skip_qlen > 0 && seqs[row_seq[row]].query_len >= skip_qlen) return;
    const long base = ((long)row * gridDim.y + head) * splits;
    store_out(out, out_f32, ((long)row * gridDim.y + head) * HEAD_DIM + d,
              merge_splits(part_acc, part_ml, base, splits, d));
}
