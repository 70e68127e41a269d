// Single-token matrix-vector products for decode: y[out] = W[out, in] · x[in] + beta · y[out],
// W f16 rows, x f16, y f32, f32 accumulation.
//
// Why not cuBLAS: at one token cuBLAS's GEMV reads the 8B model's q/k/v and o matrices at 1.7–2.1
// TB/s of the 3.0 TB/s copy rate. Here each warp streams GV_RPW whole rows with 16-byte
// non-allocating loads, GV_UNROLL chunks per row in flight per lane (32 KB per CTA), and x comes
// through L1 (every warp of the CTA reads the same x). Reduced with shuffles; lane 0 writes.
//
// Two shapes of one kernel: 2 rows per warp (16 per CTA) with 4 chunks per row in flight, and,
// for matrices with few rows (a 2048-row down projection is only 128 CTAs of 16 rows: less than
// one per SM), 1 row per warp (8 per CTA) with 8 in flight. The host picks by row count.
//
// Requires in % 8 == 0 (16-byte chunks); rows past `out` are skipped.
#define GV_WARPS 8

__device__ __forceinline__ uint4 ld_stream(const uint4* p) {
    uint4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
                 : "l"(p));
    return v;
}

__device__ __forceinline__ float dot8(uint4 a, uint4 b) {
    const unsigned wa[4] = {a.x, a.y, a.z, a.w}, wb[4] = {b.x, b.y, b.z, b.w};
    float s = 0.0f;
#pragma unroll
    for (int i = 0; i < 4; i++) {
        s = fmaf(h2f((half_t)(wa[i] & 0xffff)), h2f((half_t)(wb[i] & 0xffff)), s);
        s = fmaf(h2f((half_t)(wa[i] >> 16)), h2f((half_t)(wb[i] >> 16)), s);
    }
    return s;
}

// The input vector comes in one of three forms (MODE), so the GEMV absorbs the op before it:
// 0: x, f16 [in], read through L1;
// 1: RMSNorm of the f32 residual row x[rows_idx ? rows_idx[0] : 0] with weight nw, rounded to f16
//    (rms_norm_f16's arithmetic), computed by every CTA into shared memory;
// 2: SwiGLU of the f32 gate/up row gu [2 * in] (swiglu_f16's arithmetic), likewise.
// Every CTA recomputes the vector (in ≤ 24K elements: a few µs of L2 reads spread over the CTAs)
// instead of a separate launch and an f16 round trip through memory.
// w: [out, in] f16; y: [out] f32. grid: ceil(out / (GV_WARPS * RPW)); block: 32 * GV_WARPS;
// dynamic shared memory: in * 2 bytes for MODE 1 and 2.
template <int RPW, int UNROLL, int MODE>
__device__ __forceinline__ void gemv_rows(const half_t* __restrict__ w, const void* __restrict__ xin,
                                          const int* __restrict__ rows_idx,
                                          const float* __restrict__ nw, float eps,
                                          float* __restrict__ y, int in, int out, float beta) {
    extern __shared__ __align__(16) unsigned char gv_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const uint4* xv = reinterpret_cast<const uint4*>(xin);
    if (MODE != 0) {
        half_t* xs = reinterpret_cast<half_t*>(gv_smem);
        if (MODE == 1) {
            __shared__ float red[32];
            const float* xr = reinterpret_cast<const float*>(xin) + (long)(rows_idx ? rows_idx[0] : 0) * in;
            float ss = 0.0f;
            for (int i = threadIdx.x; i < in; i += blockDim.x) ss += xr[i] * xr[i];
            ss = block_sum(ss, red);
            const float scale = rsqrtf(ss / in + eps);
            for (int i = threadIdx.x; i < in; i += blockDim.x) xs[i] = f2h(xr[i] * scale * nw[i]);
        } else {
            const float* gu = reinterpret_cast<const float*>(xin);
            for (int i = threadIdx.x; i < in; i += blockDim.x) {
                const float g = gu[i], u = gu[in + i];
                xs[i] = f2h(g / (1.0f + expf(-g)) * u);
            }
        }
        __syncthreads();
        xv = reinterpret_cast<const uint4*>(xs);
    }
    const int row0 = (blockIdx.x * GV_WARPS + warp) * RPW;
    if (row0 >= out) return;
    const int chunks = in >> 3;
    const uint4* wr[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++)
        wr[r] = reinterpret_cast<const uint4*>(w + (long)min(row0 + r, out - 1) * in);
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) acc[r] = 0.0f;
    int c = lane;
    for (; c + 32 * (UNROLL - 1) < chunks; c += 32 * UNROLL) {
        uint4 wv[RPW][UNROLL], xx[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
#pragma unroll
            for (int r = 0; r < RPW; r++) wv[r][u] = ld_stream(wr[r] + c + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) xx[u] = MODE == 0 ? __ldg(xv + c + 32 * u) : xv[c + 32 * u];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
#pragma unroll
            for (int r = 0; r < RPW; r++) acc[r] += dot8(wv[r][u], xx[u]);
        }
    }
    for (; c < chunks; c += 32) {
        const uint4 xx = MODE == 0 ? __ldg(xv + c) : xv[c];
#pragma unroll
        for (int r = 0; r < RPW; r++) acc[r] += dot8(ld_stream(wr[r] + c), xx);
    }
#pragma unroll
    for (int r = 0; r < RPW; r++) {
        const float s = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < out) {
            const long i = row0 + r;
            y[i] = beta != 0.0f ? s + beta * y[i] : s;
        }
    }
}

// Entry points: gemv_f16{,_norm,_swiglu}{,_r1}, all with one argument list. _r1: one row per
// warp, for matrices of few rows.
#define GEMV_ENTRY(name, RPW, UNROLL, MODE)                                                      \
    extern "C" __global__ void __launch_bounds__(32 * GV_WARPS)                                  \
    name(const half_t* __restrict__ w, const void* __restrict__ xin,                           \
         const int* __restrict__ rows_idx, const float* __restrict__ nw, float eps,            \
         float* __restrict__ y, int in, int out, float beta) { \
        pdl_enter();                             \
        gemv_rows<RPW, UNROLL, MODE>(w, xin, rows_idx, nw, eps, y, in, out, beta);             \
    }
GEMV_ENTRY(gemv_f16, 2, 4, 0)
GEMV_ENTRY(gemv_f16_r1, 1, 8, 0)
GEMV_ENTRY(gemv_f16_norm, 2, 4, 1)
GEMV_ENTRY(gemv_f16_norm_r1, 1, 8, 1)
GEMV_ENTRY(gemv_f16_swiglu, 2, 4, 2)
GEMV_ENTRY(gemv_f16_swiglu_r1, 1, 8, 2)
