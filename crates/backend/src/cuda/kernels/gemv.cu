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

// w: [out, in] f16; x: [in] f16; y: [out] f32. grid: ceil(out / (GV_WARPS * GV_RPW)); block: 32 * GV_WARPS
template <int GV_RPW, int GV_UNROLL>
__device__ __forceinline__ void gemv_rows(const half_t* __restrict__ w, const half_t* __restrict__ x,
                                          float* __restrict__ y, int in, int out, float beta) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int row0 = (blockIdx.x * GV_WARPS + warp) * GV_RPW;
    if (row0 >= out) return;
    const int chunks = in >> 3;
    const uint4* xv = reinterpret_cast<const uint4*>(x);
    const uint4* wr[GV_RPW];
#pragma unroll
    for (int r = 0; r < GV_RPW; r++)
        wr[r] = reinterpret_cast<const uint4*>(w + (long)min(row0 + r, out - 1) * in);
    float acc[GV_RPW];
#pragma unroll
    for (int r = 0; r < GV_RPW; r++) acc[r] = 0.0f;
    int c = lane;
    for (; c + 32 * (GV_UNROLL - 1) < chunks; c += 32 * GV_UNROLL) {
        uint4 wv[GV_RPW][GV_UNROLL], xx[GV_UNROLL];
#pragma unroll
        for (int u = 0; u < GV_UNROLL; u++) {
#pragma unroll
            for (int r = 0; r < GV_RPW; r++) wv[r][u] = ld_stream(wr[r] + c + 32 * u);
        }
#pragma unroll
        for (int u = 0; u < GV_UNROLL; u++) xx[u] = __ldg(xv + c + 32 * u);
#pragma unroll
        for (int u = 0; u < GV_UNROLL; u++) {
#pragma unroll
            for (int r = 0; r < GV_RPW; r++) acc[r] += dot8(wv[r][u], xx[u]);
        }
    }
    for (; c < chunks; c += 32) {
        const uint4 xx = __ldg(xv + c);
#pragma unroll
        for (int r = 0; r < GV_RPW; r++) acc[r] += dot8(ld_stream(wr[r] + c), xx);
    }
#pragma unroll
    for (int r = 0; r < GV_RPW; r++) {
        const float s = warp_sum(acc[r]);
        if (lane == 0 && row0 + r < out) {
            const long i = row0 + r;
            y[i] = beta != 0.0f ? s + beta * y[i] : s;
        }
    }
}

extern "C" __global__ void __launch_bounds__(32 * GV_WARPS)
gemv_f16(const half_t* __restrict__ w, const half_t* __restrict__ x, float* __restrict__ y, int in,
         int out, float beta) {
    gemv_rows<2, 4>(w, x, y, in, out, beta);
}

extern "C" __global__ void __launch_bounds__(32 * GV_WARPS)
gemv_f16_r1(const half_t* __restrict__ w, const half_t* __restrict__ x, float* __restrict__ y,
            int in, int out, float beta) {
    gemv_rows<1, 8>(w, x, y, in, out, beta);
}
