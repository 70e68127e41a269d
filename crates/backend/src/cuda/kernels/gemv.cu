// f16 matrix times a few f16 rows (decode steps of 1..8 tokens), f32 out: y = x · wᵀ + beta · y.
// cuBLAS reads the weights of these skinny products at 55-90% of the copy ceiling; a decode step is
// nothing but this read, so this kernel is shaped for it: every weight byte is read once with
// 16-byte streaming loads (no L1 allocation), 128 bytes in flight per thread, and the tensor cores
// do the arithmetic (one m16n8k16 mma covers 16 weight rows x 8 tokens x 16 k, f32 accumulation).
//
// w: [out, k] f16 (each output row's k weights contiguous, ggml order); x: [n, k] f16, n <= 8;
// y: [n, out] f32. Needs k % 8 == 0 and w, x 16-byte aligned (the host checks, else cuBLAS).
//
// Layout: a CTA owns 16 output rows (the mma's M) and all n tokens (its N, tokens >= n are zero);
// its warps split k into chunks of GEMV_CHUNK (interleaved, so the CTA reads each row front to
// back) and add their partial tiles in shared memory at the end. Within a warp, lane = 4 g + t
// loads 8 consecutive k of rows g and g + 8 and of token g. The mma's k order is permuted: lane
// t's eight physical k are its fragment slots {2t, 2t+1, 2t+8, 2t+9} of two consecutive mmas, the
// same permutation for the weights (A) and the tokens (B), so the dot products are unchanged and
// every register comes straight from one 16-byte load.

#define GEMV_ROWS 16                         // output rows per CTA
#define GEMV_UNROLL 4                        // 16-byte loads per row per lane per chunk
#define GEMV_CHUNK (32 * GEMV_UNROLL)        // k per warp per chunk: 4 lanes x 8 halves x UNROLL
#define GEMV_MAX_WARPS 16

// Weights: read once, so no L1 allocation.
__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// Token rows: small and read by every CTA, so through L1.
__device__ __forceinline__ uint4 ld_cached(const uint4* p) {
    uint4 v;
    asm("ld.global.nc.v4.u32 {%0, %1, %2, %3}, [%4];"
        : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
        : "l"(p));
    return v;
}

// c (16 x 8, f32) += a (16 x 16, f16, row-major) · b (16 x 8, f16, column-major).
// a0: row g, k 2t..2t+1; a1: row g+8, k 2t..; a2: row g, k 2t+8..; a3: row g+8, k 2t+8..
// b0: k 2t..2t+1, column g; b1: k 2t+8..2t+9. c: rows g, g, g+8, g+8 x columns 2t, 2t+1.
__device__ __forceinline__ void mma16816(float* c, unsigned a0, unsigned a1, unsigned a2,
                                         unsigned a3, unsigned b0, unsigned b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a0), "r"(a1), "r"(a2), "r"(a3), "r"(b0), "r"(b1));
}

// w: [out, k] f16; x: [n, k] f16 (n <= 8); y: [n, out] f32.
// grid: (ceil(out / 16)); block: 32 x warps (1..16) threads; warps <= ceil(k / GEMV_CHUNK) is best.
extern "C" __global__ void __launch_bounds__(GEMV_MAX_WARPS * 32)
    gemv_f16(const half_t* __restrict__ w, const half_t* __restrict__ x, float* __restrict__ y,
             int out, int k, int n, float beta) {
    __shared__ float4 red[GEMV_MAX_WARPS][32];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int g = lane >> 2, t = lane & 3;
    const int r0 = blockIdx.x * GEMV_ROWS;
    // Rows past `out` read the last row again; their results are dropped.
    const uint4* wa = reinterpret_cast<const uint4*>(w + (long)min(r0 + g, out - 1) * k);
    const uint4* wb = reinterpret_cast<const uint4*>(w + (long)min(r0 + g + 8, out - 1) * k);
    const bool has_x = g < n;
    const uint4* xg = reinterpret_cast<const uint4*>(x + (long)(has_x ? g : 0) * k);
    const int kv = k >> 3;  // 16-byte vectors per row
    const int chunks = (k + GEMV_CHUNK - 1) / GEMV_CHUNK;
    const uint4 zero = make_uint4(0u, 0u, 0u, 0u);
    float c[4] = {0.0f, 0.0f, 0.0f, 0.0f};
    for (int ch = warp; ch < chunks; ch += warps) {
        // Vector j of this lane: k = 8 * (base + 4 j) .. + 8, i.e. the lane's quad covers 32
        // consecutive k per j and the whole chunk is contiguous in each row.
        const int base = ch * (GEMV_CHUNK / 8) + t;
        uint4 av[GEMV_UNROLL], bv[GEMV_UNROLL], xv[GEMV_UNROLL];
        if ((ch + 1) * (GEMV_CHUNK / 8) <= kv) {
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; j++) {
                av[j] = ld_stream(wa + base + 4 * j);
                bv[j] = ld_stream(wb + base + 4 * j);
            }
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; j++)
                xv[j] = has_x ? ld_cached(xg + base + 4 * j) : zero;
        } else {
            // The last, partial chunk: vectors past the row are zero.
#pragma unroll
            for (int j = 0; j < GEMV_UNROLL; j++) {
                const int p = base + 4 * j;
                av[j] = p < kv ? ld_stream(wa + p) : zero;
                bv[j] = p < kv ? ld_stream(wb + p) : zero;
                xv[j] = p < kv && has_x ? ld_cached(xg + p) : zero;
            }
        }
#pragma unroll
        for (int j = 0; j < GEMV_UNROLL; j++) {
            // Physical k 8t..8t+3 as fragment slots {2t, 2t+1, 2t+8, 2t+9}, then 8t+4..8t+7.
            mma16816(c, av[j].x, bv[j].x, av[j].y, bv[j].y, xv[j].x, xv[j].y);
            mma16816(c, av[j].z, bv[j].z, av[j].w, bv[j].w, xv[j].z, xv[j].w);
        }
    }
    if (warps > 1) {
        red[warp][lane] = make_float4(c[0], c[1], c[2], c[3]);
        __syncthreads();
        if (warp != 0) return;
        for (int i = 1; i < warps; i++) {
            const float4 v = red[i][lane];
            c[0] += v.x;
            c[1] += v.y;
            c[2] += v.z;
            c[3] += v.w;
        }
    }
#pragma unroll
    for (int i = 0; i < 4; i++) {
        const int row = r0 + g + (i >= 2 ? 8 : 0);
        const int tok = 2 * t + (i & 1);
        if (row < out && tok < n) {
            float* o = y + (long)tok * out + row;
            *o = beta != 0.0f ? c[i] + beta * *o : c[i];
        }
    }
}
