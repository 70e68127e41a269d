// Mixture-of-experts FFN (Qwen3-MoE): the router's top-k, a counting sort of the (token, slot)
// pairs by expert into tiles of one expert, expert matmuls that read each expert's weights once per
// tile, and the weighted combine into the residual stream. Everything stays on the device (no host
// round trip), so a decode step can still be one CUDA graph.
//
// Two tile sizes, chosen by the host from the token count: up to MOE_TILE (8) pairs for decode,
// multiplied by the dp4a kernels below (a warp per weight row pair, the tile's activations in
// registers), and up to TC_TOK (64) pairs for prompt chunks, multiplied on the int8 tensor cores
// by mmq_tc.cuh's tile with the pairs' activation rows gathered by index. Either way one launch
// covers every expert's tiles (grid: row blocks × tiles), and every stored type (Q4_0, Q4_1,
// Q8_0, Q4_K, Q5_K, Q6_K) stays as stored: the arithmetic is quant.cu's `block_dot`. Few tokens
// route in one launch (moe_route: logits, top-k and sort); more take cuBLAS's router GEMM, then
// moe_topk and moe_sort. Decode's fast kernels (moe_mmv, moe_down_mmv) have the dense one-token
// GEMV's shape: 16-byte staged loads of the weight rows, the tile's pairs gathered by index, and
// for few tokens the down matrix summed over each token's k experts in order straight into the
// residual stream (the combine in the same launch, deterministic).
//
// A "pair" p = t * top_k + s is token t's s-th chosen expert.

#define MOE_TILE 8
#define MOE_WARPS 4
#define MOE_ROWS 2

// Router: softmax over the experts, top-k (ties to the lower index, as torch.topk on CPU), weights
// renormalized over the chosen k when `norm_topk`. One warp per token (experts <= 512, k <= 32,
// which the host checks; a lane holds MOE_TOPK_REGS = 512 / 32 logits).
#define MOE_TOPK_REGS 16
// logits: [n, num_experts] f32; ids, weights: [n, top_k]
// (`logits` without __restrict__: the fused route kernel reads logits other CTAs of the same
// launch wrote, which must not go through the read-only cache.)
__device__ __forceinline__ void moe_topk_warp(const float* logits, int num_experts,
                                              int top_k, int norm_topk, int t,
                                              int* __restrict__ ids,
                                              float* __restrict__ weights) {
    const int lane = threadIdx.x & 31;
    const float* l = logits + (long)t * num_experts;
    // The token's logits in registers, read once (all loads in flight together): expert
    // lane + 32 i in v[i]; -inf past the end. The k rounds below then only shuffle.
    float v[MOE_TOPK_REGS];
#pragma unroll
    for (int i = 0; i < MOE_TOPK_REGS; i++) {
        const int e = lane + 32 * i;
        v[i] = e < num_experts ? l[e] : -INFINITY;
    }
    float mx = -INFINITY;
#pragma unroll
    for (int i = 0; i < MOE_TOPK_REGS; i++) mx = fmaxf(mx, v[i]);
    mx = warp_max(mx);
    float sum = 0.0f;
#pragma unroll
    for (int i = 0; i < MOE_TOPK_REGS; i++)
        if (lane + 32 * i < num_experts) sum += expf(v[i] - mx);
    sum = warp_sum(sum);
    // k rounds of a warp argmax over the logits not yet taken (softmax is monotonic).
    unsigned taken = 0;  // bit i: expert lane + 32 i was picked
    float chosen_sum = 0.0f;
    float w_mine = 0.0f;
    int id_mine = 0;
    for (int s = 0; s < top_k; s++) {
        float best = -INFINITY;
        int best_e = 0x7fffffff;
#pragma unroll
        for (int i = 0; i < MOE_TOPK_REGS; i++) {
            const int e = lane + 32 * i;
            if (e >= num_experts || ((taken >> i) & 1u)) continue;
            if (v[i] > best || (v[i] == best && e < best_e)) {
                best = v[i];
                best_e = e;
            }
        }
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oe = __shfl_xor_sync(0xffffffffu, best_e, o);
            if (ov > best || (ov == best && oe < best_e)) {
                best = ov;
                best_e = oe;
            }
        }
        if ((best_e & 31) == lane) taken |= 1u << (best_e >> 5);
        const float p = expf(best - mx) / sum;
        chosen_sum += p;
        if (lane == s) {
            w_mine = p;
            id_mine = best_e;
        }
    }
    if (lane < top_k) {
        ids[(long)t * top_k + lane] = id_mine;
        weights[(long)t * top_k + lane] = norm_topk ? w_mine / chosen_sum : w_mine;
    }
}

// Many tokens: four per CTA.
extern "C" __global__ void moe_topk(const float* __restrict__ logits, int num_experts, int top_k,
                                    int norm_topk, int n, int* __restrict__ ids,
                                    float* __restrict__ weights) {
    pdl_enter();
    const int t = blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);
    if (t >= n) return;
    moe_topk_warp(logits, num_experts, top_k, norm_topk, t, ids, weights);
}

// Counting sort of the pairs by expert, and the tile list: tile i covers `count` (<= tile)
// consecutive sorted pairs of one expert, experts in ascending order. One CTA (experts <= 1024,
// a whole number of warps, at most 1024 threads). Each thread takes a run of consecutive experts;
// the offsets of their pairs and tiles come from a block-wide exclusive scan (warp shuffles, then
// the warps' totals), so no thread walks all the experts alone.
// ids: [pairs]; sorted: [pairs] pair indices; tiles: [max_tiles] (expert, start, count, 0);
// num_tiles: [1]
__device__ __forceinline__ void moe_sort_cta(const int* ids, int pairs, int num_experts, int tile,
                                             int* __restrict__ sorted, int4* __restrict__ tiles,
                                             int* __restrict__ num_tiles) {
    __shared__ int count[1024], offset[1024], cursor[1024];
    __shared__ int warp_pairs[32], warp_tiles[32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    for (int e = threadIdx.x; e < num_experts; e += blockDim.x) {
        count[e] = 0;
        cursor[e] = 0;
    }
    __syncthreads();
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) atomicAdd(&count[ids[p]], 1);
    __syncthreads();
    const int per = (num_experts + blockDim.x - 1) / blockDim.x;
    const int e0 = min(num_experts, (int)threadIdx.x * per), e1 = min(num_experts, e0 + per);
    int my_pairs = 0, my_tiles = 0;
    for (int e = e0; e < e1; e++) {
        my_pairs += count[e];
        my_tiles += (count[e] + tile - 1) / tile;
    }
    // Inclusive scan within the warp.
    int inc_pairs = my_pairs, inc_tiles = my_tiles;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const int a = __shfl_up_sync(0xffffffffu, inc_pairs, o);
        const int b = __shfl_up_sync(0xffffffffu, inc_tiles, o);
        if (lane >= o) {
            inc_pairs += a;
            inc_tiles += b;
        }
    }
    if (lane == 31) {
        warp_pairs[warp] = inc_pairs;
        warp_tiles[warp] = inc_tiles;
    }
    __syncthreads();
    if (warp == 0) {
        // Exclusive scan of the warps' totals.
        const int wp = lane < warps ? warp_pairs[lane] : 0, wt = lane < warps ? warp_tiles[lane] : 0;
        int ip = wp, it = wt;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const int a = __shfl_up_sync(0xffffffffu, ip, o);
            const int b = __shfl_up_sync(0xffffffffu, it, o);
            if (lane >= o) {
                ip += a;
                it += b;
            }
        }
        __syncwarp();
        if (lane < warps) {
            warp_pairs[lane] = ip - wp;
            warp_tiles[lane] = it - wt;
        }
    }
    __syncthreads();
    int off = warp_pairs[warp] + inc_pairs - my_pairs;
    int nt = warp_tiles[warp] + inc_tiles - my_tiles;
    for (int e = e0; e < e1; e++) {
        offset[e] = off;
        for (int c = 0; c < count[e]; c += tile)
            tiles[nt++] = make_int4(e, off + c, min(tile, count[e] - c), 0);
        off += count[e];
    }
    // The last thread's runs end at the totals (its run may be empty).
    if (threadIdx.x == blockDim.x - 1) *num_tiles = nt;
    __syncthreads();
    // Within an expert the order follows the atomics; each pair's result is computed on its own,
    // so the outputs do not depend on it.
    for (int p = threadIdx.x; p < pairs; p += blockDim.x) {
        const int e = ids[p];
        sorted[offset[e] + atomicAdd(&cursor[e], 1)] = p;
    }
}

extern "C" __global__ void moe_sort(const int* __restrict__ ids, int pairs, int num_experts,
                                    int tile, int* __restrict__ sorted, int4* __restrict__ tiles,
                                    int* __restrict__ num_tiles) {
    pdl_enter();
    moe_sort_cta(ids, pairs, num_experts, tile, sorted, tiles, num_tiles);
}

// Few tokens (decode), the whole routing in one launch: router logits (f32, one warp per expert,
// 16-byte loads), then the last CTA to finish (an atomic count, reset for the next launch so CUDA
// graph replays stay valid) takes the top-k of every token and the sort. The
// ids pass through global memory, visible to the whole CTA after its barrier.
// hf: [n, hidden] f32 (hidden % 4 == 0); router: [num_experts, hidden] f32; logits: [n, experts];
// done: [1], zero between launches. grid (⌈experts / warps⌉), block 32 · warps.
extern "C" __global__ void moe_route(const float* __restrict__ hf, const float* __restrict__ router,
                                     int hidden, float* logits, int num_experts, int top_k,
                                     int norm_topk, int n, int* ids, float* __restrict__ weights,
                                     int tile, int* __restrict__ sorted, int4* __restrict__ tiles,
                                     int* __restrict__ num_tiles, unsigned int* done) {
    pdl_enter();
    const int warps = blockDim.x >> 5, warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
    const int e = blockIdx.x * warps + warp;
    if (e < num_experts) {
        const float4* r4 = (const float4*)(router + (long)e * hidden);
        for (int t = 0; t < n; t++) {
            const float4* x4 = (const float4*)(hf + (long)t * hidden);
            float acc = 0.0f;
            // Unrolled so several 16-byte loads are in flight per lane (a lane's 16 loads of a
            // 2048-wide row would otherwise wait on memory one after another).
#pragma unroll 8
            for (int i = lane; i < hidden / 4; i += 32) {
                const float4 a = r4[i], b = x4[i];
                acc += a.x * b.x + a.y * b.y + a.z * b.z + a.w * b.w;
            }
            acc = warp_sum(acc);
            if (lane == 0) logits[(long)t * num_experts + e] = acc;
        }
    }
    __shared__ int last;
    __threadfence();  // this CTA's logits visible device-wide before it counts itself done
    __syncthreads();
    if (threadIdx.x == 0) last = atomicAdd(done, 1u) == gridDim.x - 1;
    __syncthreads();
    if (!last) return;
    __threadfence();  // every other CTA's logits seen by this one
    for (int t = warp; t < n; t += warps)
        moe_topk_warp(logits, num_experts, top_k, norm_topk, t, ids, weights);
    __syncthreads();
    moe_sort_cta(ids, n * top_k, num_experts, tile, sorted, tiles, num_tiles);
    if (threadIdx.x == 0) *done = 0;
}

// y[p, r] = Σ_b dot(w[e][r, b], a[p / act_div, b]) for the pairs p of each tile (expert e): the
// quantized weights (stored blocks, expert slabs of `rows` rows, `expert_bytes` each) against
// 8-bit activation blocks. act_div = top_k reads the token's activations (gate/up), 1 the pair's
// own (down). Tiles of up to MOE_TILE pairs.
// grid (rows / (MOE_WARPS * MOE_ROWS), max_tiles); block 32 * MOE_WARPS
template <int TYPE>
__device__ __forceinline__ void moe_mmq(const unsigned char* __restrict__ w, long expert_bytes,
                                        const q8a_t* __restrict__ a, int act_div,
                                        const int* __restrict__ sorted, const int4* __restrict__ tiles,
                                        const int* __restrict__ num_tiles, float* __restrict__ y,
                                        int rows, int nb) {
    if (blockIdx.y >= *num_tiles) return;
    const int4 tile = tiles[blockIdx.y];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * MOE_WARPS + warp) * MOE_ROWS;
    if (r0 >= rows) return;
    const unsigned char* we = w + tile.x * expert_bytes;
    const long row_bytes = (long)(nb / (wblock<TYPE>::elems / 32)) * wblock<TYPE>::bytes;
    int pair[MOE_TILE];
#pragma unroll
    for (int t = 0; t < MOE_TILE; t++) pair[t] = t < tile.z ? sorted[tile.y + t] : 0;
    float acc[MOE_ROWS][MOE_TILE];
#pragma unroll
    for (int i = 0; i < MOE_ROWS; i++)
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++) acc[i][t] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
        // Each row's block b (sub-block `sub` of a K-quant super-block), read once for the tile.
        const unsigned char* wb[MOE_ROWS];
        int sub = 0;
#pragma unroll
        for (int i = 0; i < MOE_ROWS; i++) wb[i] = block_of<TYPE>(we + (r0 + i) * row_bytes, b, &sub);
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++) {
            if (t < tile.z) {
                const q8a_t* ab = a + (long)(pair[t] / act_div) * nb + b;
#pragma unroll
                for (int i = 0; i < MOE_ROWS; i++)
                    if (r0 + i < rows) acc[i][t] += block_dot<TYPE>(wb[i], sub, ab);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MOE_ROWS; i++)
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++) {
            const float v = warp_sum(acc[i][t]);
            if (lane == 0 && t < tile.z && r0 + i < rows) y[(long)pair[t] * rows + r0 + i] = v;
        }
}

// The same product for decode (MoePath::Gemv), shaped like the dense staged GEMV (quant.cu's
// `mmv`): each warp owns MMV_ROWS rows of the tile's expert and copies a stage of them into
// shared memory with coalesced 16-byte loads, issuing the next stage's loads before it computes
// on the current one; the dot products are `block_dot` (Q4_K, Q6_K: the sub-block pair dots), so
// each pair's result equals the dp4a kernel's up to the f32 summation order. With one token the
// tiles are single pairs of 8 experts, so the 16-byte loads and the loads in flight, not the
// arithmetic, set the time. The expert's rows must start 16-byte aligned (the slab base and the
// row length in bytes multiples of 16; the host checks), else the dp4a kernel above runs. TOK:
// the most pairs a tile holds, MOE_TILE, or 1 for one token (its k experts are distinct, so every
// tile is one pair: an eighth of the accumulators, fewer registers, more warps resident).
// grid (⌈rows / (MMV_WARPS · MMV_ROWS)⌉, max_tiles); block 32 · MMV_WARPS
template <int TYPE, int TOK>
__device__ __forceinline__ void moe_mmv(const unsigned char* __restrict__ w, long expert_bytes,
                                        const q8a_t* __restrict__ a, int act_div,
                                        const int* __restrict__ sorted, const int4* __restrict__ tiles,
                                        const int* __restrict__ num_tiles, float* __restrict__ y,
                                        int rows, int nb) {
    __shared__ uint4 stage[MMV_WARPS][MMV_ROWS][MMV_LOADS * 32];
    const int B = wblock<TYPE>::bytes, PER = wblock<TYPE>::elems / 32;
    const int SB = mmv_stage<TYPE>::blocks;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * MMV_WARPS + warp) * MMV_ROWS;
    // The tile list is the route's output: nothing is read before it is complete.
    if (blockIdx.y >= *num_tiles || r0 >= rows) return;  // whole warps: no warp step left waiting
    const int4 tile = tiles[blockIdx.y];
    const int nsb = nb / PER;
    const long row_bytes = (long)nsb * B;
    const unsigned char* we = w + tile.x * expert_bytes;
    // Rows past the end read the last row again (in bounds) and are not written.
    const uint4* wr[MMV_ROWS];
#pragma unroll
    for (int i = 0; i < MMV_ROWS; i++)
        wr[i] = (const uint4*)(we + (long)min(r0 + i, rows - 1) * row_bytes);
    uint4 next[MMV_ROWS][MMV_LOADS];
    mmv_fetch<TYPE>(wr, 0, nsb, lane, next);
    int pair[TOK];
    const q8a_t* ap[TOK];
#pragma unroll
    for (int t = 0; t < TOK; t++) {
        pair[t] = t < tile.z ? sorted[tile.y + t] : 0;
        ap[t] = a + (long)(pair[t] / act_div) * nb;
    }
    float acc[MMV_ROWS][TOK];
#pragma unroll
    for (int i = 0; i < MMV_ROWS; i++)
#pragma unroll
        for (int t = 0; t < TOK; t++) acc[i][t] = 0.0f;
    for (int s0 = 0; s0 < nsb; s0 += SB) {
        const int n16 = (min(SB, nsb - s0) * B) >> 4;
        __syncwarp();  // every lane is done reading the previous stage
#pragma unroll
        for (int i = 0; i < MMV_ROWS; i++)
#pragma unroll
            for (int u = 0; u < MMV_LOADS; u++)
                if (lane + 32 * u < n16) stage[warp][i][lane + 32 * u] = next[i][u];
        __syncwarp();
        if (s0 + SB < nsb) mmv_fetch<TYPE>(wr, s0 + SB, nsb, lane, next);  // in flight meanwhile
        const int nsub = min(SB, nsb - s0) * PER;
        const long b0 = (long)s0 * PER;
        if constexpr (TYPE == T_Q4_K || TYPE == T_Q6_K) {
            // One pair of sub-blocks per lane: four per super-block, at most 8 super-blocks.
            const int sb = lane >> 2, p = lane & 3;
            if (sb < nsub / PER) {
#pragma unroll
                for (int t = 0; t < TOK; t++) {
                    if (t < tile.z) {
                        const q8a_t* ab = ap[t] + b0 + sb * PER;
#pragma unroll
                        for (int i = 0; i < MMV_ROWS; i++) {
                            const unsigned char* wb = (const unsigned char*)stage[warp][i] + sb * B;
                            if constexpr (TYPE == T_Q4_K) {
                                acc[i][t] += q4k_pair_dot(wb, p, ab + 2 * p);
                            } else {
                                const int h = p >> 1, k = p & 1, j0 = 4 * h + k;
                                acc[i][t] += q6k_pair_dot(wb, h, k, ab + j0, ab + j0 + 2);
                            }
                        }
                    }
                }
            }
        } else {
            // Sub-blocks j and j + 32 per lane: consecutive lanes read consecutive activation
            // blocks.
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int j = lane + 32 * c;
                if (j < nsub) {
#pragma unroll
                    for (int t = 0; t < TOK; t++) {
                        if (t < tile.z) {
                            const q8a_t* ab = ap[t] + b0 + j;
#pragma unroll
                            for (int i = 0; i < MMV_ROWS; i++) {
                                const unsigned char* wb =
                                    (const unsigned char*)stage[warp][i] + (j / PER) * B;
                                acc[i][t] += block_dot<TYPE>(wb, j % PER, ab);
                            }
                        }
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MMV_ROWS; i++)
#pragma unroll
        for (int t = 0; t < TOK; t++) {
            const float v = warp_sum(acc[i][t]);
            if (lane == 0 && t < tile.z && r0 + i < rows) y[(long)pair[t] * rows + r0 + i] = v;
        }
}

// The down matrix and the combine in one kernel for decode (MoePath::Gemv, few tokens):
// x[t, r] += Σ_s weights[t, s] · dot(w[ids[t, s]][r], a[t · top_k + s]). A CTA owns MMV_ROWS rows
// of one token; its warps split the token's k slots (warp w takes slots w, w + MMV_WARPS, …), so
// one token's block still keeps ~1,000 CTAs in flight (hidden 2048), and each warp walks its
// slots stage by stage, issuing the next stage's loads (the next slot's expert rows once a slot is
// done) before it computes on the current. Each slot's dot is `moe_mmv`'s (the same stages and
// lane partials, then the warp sum); the slots' results meet in shared memory and one thread per
// row sums them in order s = 0, 1, … as moe_combine does, so the step stays deterministic (no
// float atomics). The CTAs of one row block for every token are neighbours in the launch order
// (grid x is the token), so an expert two tokens share is read from memory once, then from L2.
// w: experts' slabs of `rows` rows (`expert_bytes` each, rows 16-byte aligned); a: [n · top_k, nb]
// q8 blocks; ids, weights: [n, top_k] (top_k <= MOE_MAX_TOP_K); x: [n, rows] f32.
// grid (n, ⌈rows / MMV_ROWS⌉); block 32 · MMV_WARPS
#define MOE_MAX_TOP_K 32
template <int TYPE>
__device__ __forceinline__ void moe_down_mmv(const unsigned char* __restrict__ w, long expert_bytes,
                                             const q8a_t* __restrict__ a,
                                             const int* __restrict__ ids,
                                             const float* __restrict__ weights, int top_k,
                                             float* __restrict__ x, int rows, int nb) {
    __shared__ uint4 stage[MMV_WARPS][MMV_ROWS][MMV_LOADS * 32];
    __shared__ float ys[MOE_MAX_TOP_K][MMV_ROWS];
    const int B = wblock<TYPE>::bytes, PER = wblock<TYPE>::elems / 32;
    const int SB = mmv_stage<TYPE>::blocks;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int t = blockIdx.x;
    const int r0 = blockIdx.y * MMV_ROWS;
    const int nsb = nb / PER;
    const int stages = (nsb + SB - 1) / SB;
    const long row_bytes = (long)nsb * B;
    const int* id = ids + (long)t * top_k;
    // This warp's slots, and the (slot, stage) steps it walks.
    const int my_slots = warp < top_k ? (top_k - warp + MMV_WARPS - 1) / MMV_WARPS : 0;
    const int steps = my_slots * stages;
    // Rows past the end read the last row again (in bounds) and are not written.
    const uint4* wr[MMV_ROWS];
    auto rows_of = [&](int slot) {
        const unsigned char* we = w + id[slot] * expert_bytes;
#pragma unroll
        for (int i = 0; i < MMV_ROWS; i++)
            wr[i] = (const uint4*)(we + (long)min(r0 + i, rows - 1) * row_bytes);
    };
    uint4 next[MMV_ROWS][MMV_LOADS];
    if (steps > 0) {
        rows_of(warp);
        mmv_fetch<TYPE>(wr, 0, nsb, lane, next);
    }
    float acc[MMV_ROWS];
#pragma unroll
    for (int i = 0; i < MMV_ROWS; i++) acc[i] = 0.0f;
    for (int step = 0; step < steps; step++) {
        const int j = step / stages, slot = warp + j * MMV_WARPS;
        const int s0 = (step - j * stages) * SB;
        const int n16 = (min(SB, nsb - s0) * B) >> 4;
        __syncwarp();  // every lane is done reading the previous stage
#pragma unroll
        for (int i = 0; i < MMV_ROWS; i++)
#pragma unroll
            for (int u = 0; u < MMV_LOADS; u++)
                if (lane + 32 * u < n16) stage[warp][i][lane + 32 * u] = next[i][u];
        __syncwarp();
        if (step + 1 < steps) {  // in flight meanwhile
            const int nj = (step + 1) / stages;
            if (nj != j) rows_of(warp + nj * MMV_WARPS);
            mmv_fetch<TYPE>(wr, (step + 1 - nj * stages) * SB, nsb, lane, next);
        }
        const int nsub = min(SB, nsb - s0) * PER;
        const q8a_t* ab0 = a + ((long)t * top_k + slot) * nb + (long)s0 * PER;
        if constexpr (TYPE == T_Q4_K || TYPE == T_Q6_K) {
            const int sb = lane >> 2, p = lane & 3;
            if (sb < nsub / PER) {
                const q8a_t* ab = ab0 + sb * PER;
#pragma unroll
                for (int i = 0; i < MMV_ROWS; i++) {
                    const unsigned char* wb = (const unsigned char*)stage[warp][i] + sb * B;
                    if constexpr (TYPE == T_Q4_K) {
                        acc[i] += q4k_pair_dot(wb, p, ab + 2 * p);
                    } else {
                        const int h = p >> 1, k = p & 1, j0 = 4 * h + k;
                        acc[i] += q6k_pair_dot(wb, h, k, ab + j0, ab + j0 + 2);
                    }
                }
            }
        } else {
#pragma unroll
            for (int c = 0; c < 2; c++) {
                const int jb = lane + 32 * c;
                if (jb < nsub) {
#pragma unroll
                    for (int i = 0; i < MMV_ROWS; i++) {
                        const unsigned char* wb =
                            (const unsigned char*)stage[warp][i] + (jb / PER) * B;
                        acc[i] += block_dot<TYPE>(wb, jb % PER, ab0 + jb);
                    }
                }
            }
        }
        if (s0 + SB >= nsb) {  // the slot's last stage: its dot is complete
#pragma unroll
            for (int i = 0; i < MMV_ROWS; i++) {
                const float v = warp_sum(acc[i]);
                if (lane == 0) ys[slot][i] = v;
                acc[i] = 0.0f;
            }
        }
    }
    __syncthreads();
    const int i = threadIdx.x;
    if (i < MMV_ROWS && r0 + i < rows) {
        float out = 0.0f;
        for (int s = 0; s < top_k; s++) out += weights[(long)t * top_k + s] * ys[s][i];
        x[(long)t * rows + r0 + i] += out;
    }
}

// The columns of a tensor-core tile: the tile's pairs (activation row pair / act_div, output
// row pair), gathered by index from the sorted list.
struct tc_moe_map {
    const int* sorted;
    int start, count, act_div;
    __device__ __forceinline__ int out(int t) const { return t < count ? sorted[start + t] : -1; }
    __device__ __forceinline__ int act(int t) const {
        return t < count ? sorted[start + t] / act_div : -1;
    }
};

// The same on the int8 tensor cores for tiles of up to TC_TOK pairs: one CTA per 64 weight rows
// of the tile's expert. grid (⌈rows / TC_ROWS⌉, max_tiles); block TC_THREADS; sm_80 and newer.
template <int TYPE>
__device__ __forceinline__ void moe_mmq_tc(const unsigned char* __restrict__ w, long expert_bytes,
                                           const q8a_t* __restrict__ a, int act_div,
                                           const int* __restrict__ sorted,
                                           const int4* __restrict__ tiles,
                                           const int* __restrict__ num_tiles,
                                           float* __restrict__ y, int rows, int nb) {
    // The whole CTA leaves together (the tile loop has barriers).
    if (blockIdx.y >= *num_tiles) return;
    const int4 tile = tiles[blockIdx.y];
    const tc_moe_map map = {sorted, tile.y, tile.z, act_div};
    tc_tile<TYPE>(w + tile.x * expert_bytes, a, y, rows, nb, (int)blockIdx.x * TC_ROWS, 0.0f, map);
}

#define MOE_MMQ_ENTRY(NAME, TYPE)                                                                 \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ w, long expert_bytes,      \
                                    const q8a_t* __restrict__ a, int act_div,                    \
                                    const int* __restrict__ sorted, const int4* __restrict__ tiles, \
                                    const int* __restrict__ num_tiles, float* __restrict__ y,    \
                                    int rows, int nb) {                                          \
        pdl_enter();                                                                             \
        moe_mmq<TYPE>(w, expert_bytes, a, act_div, sorted, tiles, num_tiles, y, rows, nb);       \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMV_WARPS * 32)                                 \
        NAME##_mmv(const unsigned char* __restrict__ w, long expert_bytes,                       \
                   const q8a_t* __restrict__ a, int act_div, const int* __restrict__ sorted,     \
                   const int4* __restrict__ tiles, const int* __restrict__ num_tiles,            \
                   float* __restrict__ y, int rows, int nb) {                                    \
        pdl_enter();                                                                             \
        moe_mmv<TYPE, MOE_TILE>(w, expert_bytes, a, act_div, sorted, tiles, num_tiles, y, rows,  \
                                nb);                                                             \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMV_WARPS * 32)                                 \
        NAME##_mmv1(const unsigned char* __restrict__ w, long expert_bytes,                      \
                    const q8a_t* __restrict__ a, int act_div, const int* __restrict__ sorted,    \
                    const int4* __restrict__ tiles, const int* __restrict__ num_tiles,           \
                    float* __restrict__ y, int rows, int nb) {                                   \
        pdl_enter();                                                                             \
        moe_mmv<TYPE, 1>(w, expert_bytes, a, act_div, sorted, tiles, num_tiles, y, rows, nb);    \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(MMV_WARPS * 32)                                 \
        NAME##_down(const unsigned char* __restrict__ w, long expert_bytes,                      \
                    const q8a_t* __restrict__ a, const int* __restrict__ ids,                    \
                    const float* __restrict__ weights, int top_k, float* __restrict__ x,         \
                    int rows, int nb) {                                                          \
        pdl_enter();                                                                             \
        moe_down_mmv<TYPE>(w, expert_bytes, a, ids, weights, top_k, x, rows, nb);                \
    }                                                                                            \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                     \
        NAME##_tc(const unsigned char* __restrict__ w, long expert_bytes,                        \
                  const q8a_t* __restrict__ a, int act_div, const int* __restrict__ sorted,      \
                  const int4* __restrict__ tiles, const int* __restrict__ num_tiles,             \
                  float* __restrict__ y, int rows, int nb) {                                     \
        pdl_enter();                                                                             \
        moe_mmq_tc<TYPE>(w, expert_bytes, a, act_div, sorted, tiles, num_tiles, y, rows, nb);    \
    }

MOE_MMQ_ENTRY(moe_mmq_q4_0, T_Q4_0)
MOE_MMQ_ENTRY(moe_mmq_q4_1, T_Q4_1)
MOE_MMQ_ENTRY(moe_mmq_q8_0, T_Q8_0)
MOE_MMQ_ENTRY(moe_mmq_q4_k, T_Q4_K)
MOE_MMQ_ENTRY(moe_mmq_q5_k, T_Q5_K)
MOE_MMQ_ENTRY(moe_mmq_q6_k, T_Q6_K)

// The same for f16 expert weights and f16 activations. w: [experts, rows, cols] f16;
// a: [*, cols] f16 (row p / act_div); y: [pairs, rows] f32
extern "C" __global__ void moe_gemv_f16(const half_t* __restrict__ w, const half_t* __restrict__ a,
                                        int act_div, const int* __restrict__ sorted,
                                        const int4* __restrict__ tiles,
                                        const int* __restrict__ num_tiles, float* __restrict__ y,
                                        int rows, int cols) {
    pdl_enter();
    if (blockIdx.y >= *num_tiles) return;
    const int4 tile = tiles[blockIdx.y];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * MOE_WARPS + warp) * MOE_ROWS;
    if (r0 >= rows) return;
    const half_t* we = w + (long)tile.x * rows * cols;
    int pair[MOE_TILE];
#pragma unroll
    for (int t = 0; t < MOE_TILE; t++) pair[t] = t < tile.z ? sorted[tile.y + t] : 0;
    float acc[MOE_ROWS][MOE_TILE];
#pragma unroll
    for (int i = 0; i < MOE_ROWS; i++)
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++) acc[i][t] = 0.0f;
    // Eight columns per lane per step (16-byte loads; cols is a multiple of 8).
    for (int c = lane * 8; c < cols; c += 256) {
        float wv[MOE_ROWS][8];
#pragma unroll
        for (int i = 0; i < MOE_ROWS; i++) {
            if (r0 + i < rows) {
                const uint4 u = *reinterpret_cast<const uint4*>(we + (long)(r0 + i) * cols + c);
                const unsigned int ws[4] = {u.x, u.y, u.z, u.w};
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    wv[i][2 * j] = h2f((half_t)(ws[j] & 0xffff));
                    wv[i][2 * j + 1] = h2f((half_t)(ws[j] >> 16));
                }
            } else {
#pragma unroll
                for (int j = 0; j < 8; j++) wv[i][j] = 0.0f;
            }
        }
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++) {
            if (t < tile.z) {
                const uint4 u =
                    *reinterpret_cast<const uint4*>(a + (long)(pair[t] / act_div) * cols + c);
                const unsigned int xs[4] = {u.x, u.y, u.z, u.w};
                float xv[8];
#pragma unroll
                for (int j = 0; j < 4; j++) {
                    xv[2 * j] = h2f((half_t)(xs[j] & 0xffff));
                    xv[2 * j + 1] = h2f((half_t)(xs[j] >> 16));
                }
#pragma unroll
                for (int i = 0; i < MOE_ROWS; i++)
#pragma unroll
                    for (int j = 0; j < 8; j++) acc[i][t] = fmaf(wv[i][j], xv[j], acc[i][t]);
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MOE_ROWS; i++)
#pragma unroll
        for (int t = 0; t < MOE_TILE; t++) {
            const float v = warp_sum(acc[i][t]);
            if (lane == 0 && t < tile.z && r0 + i < rows) y[(long)pair[t] * rows + r0 + i] = v;
        }
}

// x[t] += Σ_s weights[t, s] · y[t * top_k + s]. x: [n, hidden] f32; y: [n * top_k, hidden] f32
extern "C" __global__ void moe_combine(float* __restrict__ x, const float* __restrict__ y,
                                       const float* __restrict__ weights, int top_k, int hidden) {
    pdl_enter();
    const long t = blockIdx.x;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) {
        float acc = 0.0f;
        for (int s = 0; s < top_k; s++)
            acc += weights[t * top_k + s] * y[(t * top_k + s) * hidden + i];
        x[t * hidden + i] += acc;
    }
}
