// Single-token matrix-vector products for decode: y[out] = W[out, in] · x[in] + beta · y[out],
// W f16 rows, x f16, y f32, f32 accumulation.
//
// Why not cuBLAS: at one token cuBLAS's GEMV reads the 8B model's q/k/v and o matrices at 1.7–2.1
// TB/s of the 3.0 TB/s copy rate. Here each warp streams GV_RPW whole rows with 16-byte
// non-allocating loads, GV_UNROLL chunks per row in flight per lane (32 KB per CTA), and x comes
// through L1 (every warp of the CTA reads the same x). Reduced with shuffles; lane 0 writes.
//
// Two shapes of one kernel (rows per warp × chunks per row in flight, below): the host picks
// 1 row × 8 chunks for long rows and small matrices and 2 rows × 4 chunks otherwise (gemv.rs,
// `shape_for`, with the measurements), and one row group per warp.
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
// Every CTA recomputes the vector instead of a separate launch and an f16 round trip through
// memory; the host bounds `in` for the fused forms (gemv.rs).
//
// Each warp's first batch of weight loads is issued before `pdl_enter`: the weights are model
// weights, never written by a kernel, so under programmatic dependent launch they stream in while
// the kernel before finishes (the rest of the step only needs the input vector). After that the
// loads of batch i + 1 are issued before batch i's arithmetic. Every lane still accumulates its
// chunks c, c + 32, c + 64, ... in order, so the sums do not depend on UNROLL. (An L2 bulk
// prefetch of more of the rows before the wait was slower in every form tried on the H100.)
// w: [out, in] f16; y: [out] f32. grid: ceil(out / (GV_WARPS * RPW)); block: 32 * GV_WARPS;
// dynamic shared memory: in * 2 bytes for MODE 1 and 2, in * 6 for MODE 1's EARLY form (below).
__device__ __forceinline__ unsigned gv_smem_u32(const void* p) {
    unsigned a;
    asm("{ .reg .u64 t; cvta.to.shared.u64 t, %1; cvt.u32.u64 %0, t; }" : "=r"(a) : "l"(p));
    return a;
}

template <int RPW, int UNROLL>
__device__ __forceinline__ void gv_load(const uint4* const (&wr)[RPW], int c, int chunks,
                                        uint4 (&wv)[RPW][UNROLL]) {
#pragma unroll
    for (int u = 0; u < UNROLL; u++) {
#pragma unroll
        for (int r = 0; r < RPW; r++)
            wv[r][u] = c + 32 * u < chunks ? ld_stream(wr[r] + c + 32 * u) : make_uint4(0, 0, 0, 0);
    }
}

__device__ __forceinline__ uint2 pack4h(float a, float b, float c, float d) {
    return make_uint2((unsigned)f2h(a) | ((unsigned)f2h(b) << 16),
                      (unsigned)f2h(c) | ((unsigned)f2h(d) << 16));
}

// The input vector of MODE 1 (RMSNorm) or 2 (SwiGLU) rounded to f16 into shared memory xs
// ([in / 4] of 4 f16), by the whole CTA; the caller synchronizes before reading it.
// EARLY: nw was copied into shared memory (at xs + in / 4 uint2, in floats) by cp.async before
// the wait; each thread waits for its copies before the block sum's barriers.
template <int MODE, bool EARLY = false>
__device__ __forceinline__ void gv_input(const void* __restrict__ xin,
                                         const int* __restrict__ rows_idx,
                                         const float* __restrict__ nw, float eps, int in,
                                         uint2* __restrict__ xs) {
    const int in4 = in >> 2;
    if (MODE == 1) {
        if (EARLY) {
            asm volatile("cp.async.wait_all;" ::: "memory");
            nw = reinterpret_cast<const float*>(xs + in4);
        }
        __shared__ float red[32];
        const float4* xr =
            reinterpret_cast<const float4*>(xin) + (long)(rows_idx ? rows_idx[0] : 0) * in4;
        float ss = 0.0f;
#pragma unroll 4
        for (int i = threadIdx.x; i < in4; i += blockDim.x) {
            const float4 v = xr[i];
            ss += v.x * v.x + v.y * v.y + v.z * v.z + v.w * v.w;
        }
        ss = block_sum(ss, red);
        const float scale = rsqrtf(ss / in + eps);
        const float4* nw4 = reinterpret_cast<const float4*>(nw);
#pragma unroll 4
        for (int i = threadIdx.x; i < in4; i += blockDim.x) {
            const float4 v = xr[i], g = nw4[i];
            xs[i] = pack4h(v.x * scale * g.x, v.y * scale * g.y, v.z * scale * g.z,
                           v.w * scale * g.w);
        }
    } else if (MODE == 2) {
        const float4* g4 = reinterpret_cast<const float4*>(xin);
#pragma unroll 4
        for (int i = threadIdx.x; i < in4; i += blockDim.x) {
            const float4 g = g4[i], u = g4[in4 + i];
            xs[i] = pack4h(g.x / (1.0f + expf(-g.x)) * u.x, g.y / (1.0f + expf(-g.y)) * u.y,
                           g.z / (1.0f + expf(-g.z)) * u.z, g.w / (1.0f + expf(-g.w)) * u.w);
        }
    }
}

// HOST's store: the CTA's GV_WARPS * RPW rows, gathered in ys, in one coalesced store.
template <int RPW>
__device__ __forceinline__ void gv_store_host(const float* ys, float* __restrict__ y, int out) {
    __syncthreads();
    const int i = blockIdx.x * GV_WARPS * RPW + threadIdx.x;
    if (threadIdx.x < GV_WARPS * RPW && i < out) y[i] = ys[threadIdx.x];
}

//
// HOST (the logits of a one-row decode step, written straight into page-locked host memory): warp
// w of CTA b takes row group b * GV_WARPS + w (one group per warp, the host's grid), beta is 0,
// and the CTA's rows leave in one store after a barrier. Stored a row at a time from each warp,
// the 4-8 byte bus writes cost the 135M model's 49K-row projection more than the copy they
// replace (measured on the H100).
//
// GLU (the gate/up projection of a decode step): w holds the gate rows [0, out) and then the up
// rows [out, 2 * out); a warp's row group pairs gate row i with up row out + i (RPW is 2) and lane
// 0 writes silu(gate) · up rounded to f16 into yv[i] (swiglu_f16's arithmetic on the same sums), so
// the down projection reads f16 rows and no SwiGLU runs anywhere else. Otherwise y is f32.
//
// EARLY: what does not depend on the kernel before is read before the wait too: the RMSNorm
// weight (MODE 1, copied into shared memory behind the input vector: in * 4 more bytes of dynamic
// shared memory), and with beta != 0 the output rows y of the warp's first group. The latter is
// sound because y is the residual row, which the kernel just before (decode attention before the
// o projection, the gate/up GEMV before the down one) never writes, and which the kernel before
// that had finished writing before this one could start (every kernel waits for the one before
// it before letting the next one start). The host (gemv.rs) only calls the EARLY forms so.
template <int RPW, int UNROLL, int MODE, bool GLU, bool HOST, bool EARLY = false>
__device__ __forceinline__ void gemv_rows(const half_t* __restrict__ w, const void* __restrict__ xin,
                                          const int* __restrict__ rows_idx,
                                          const float* __restrict__ nw, float eps,
                                          void* __restrict__ yv, int in, int out, float beta) {
    static_assert(!GLU || RPW == 2, "a GLU row group is one gate row and one up row");
    static_assert(!(GLU && HOST), "the host form writes f32 rows");
    __shared__ float ys[HOST ? GV_WARPS * RPW : 1];
    float* __restrict__ y = reinterpret_cast<float*>(yv);
    extern __shared__ __align__(16) unsigned char gv_smem[];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = in >> 3;
    const int bpr = (chunks + 32 * UNROLL - 1) / (32 * UNROLL);  // batches per row group
    // This warp's row groups: a contiguous share [g_begin, g_end) of the ceil(out / RPW) groups.
    // With one warp per group (the host's grid) that is at most one group; on a smaller grid
    // each warp would walk many rows, the next group's loads in flight while a group is summed.
    const long groups = GLU ? out : (out + RPW - 1) / RPW, total_warps = (long)gridDim.x * GV_WARPS;
    const long gw = (long)blockIdx.x * GV_WARPS + warp;
    const int g_begin = HOST ? (int)gw : (int)(gw * groups / total_warps);
    const int g_end = HOST ? (int)min(gw + 1, groups) : (int)((gw + 1) * groups / total_warps);
    auto rows_of = [&](int g, const uint4* (&wr)[RPW]) {
#pragma unroll
        for (int r = 0; r < RPW; r++)
            wr[r] = reinterpret_cast<const uint4*>(
                w + (GLU ? (long)min(g, out - 1) + (long)r * out : (long)min(g * RPW + r, out - 1)) *
                        in);
    };
    const uint4* wr[RPW];
    rows_of(g_begin, wr);
    uint4 wv[RPW][UNROLL], nx[RPW][UNROLL];
    if (g_begin < g_end) gv_load<RPW, UNROLL>(wr, lane, chunks, wv);
    // (g, bt): the batch in wv; (gn, bn): the one after it, in nx once issued.
    int g = g_begin, bt = 0, gn = g_begin, bn = 1;
    if (bn == bpr) {
        gn = g + 1;
        bn = 0;
    }
    // Issues batch (gn, bn) into nx: zeros, and no load, past the warp's last group.
    auto load_next = [&]() {
        const uint4* wn[RPW];
        rows_of(min(gn, g_end - 1), wn);
        gv_load<RPW, UNROLL>(wn, gn < g_end ? lane + bn * 32 * UNROLL : chunks, chunks, nx);
    };
    float y_first[RPW];  // EARLY, beta != 0: y of the first group's rows (lane 0)
    if (EARLY) {
        if (MODE == 1) {
            const unsigned dst = gv_smem_u32(gv_smem + in * 2);
            for (int i = threadIdx.x; i < in / 4; i += blockDim.x)
                asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(dst + 16 * i),
                             "l"(nw + 4 * i)
                             : "memory");
            asm volatile("cp.async.commit_group;" ::: "memory");
        }
        if (!GLU && !HOST && beta != 0.0f && lane == 0 && g_begin < g_end) {
#pragma unroll
            for (int r = 0; r < RPW; r++) y_first[r] = y[min(g_begin * RPW + r, out - 1)];
        }
    }
    pdl_enter();

    const uint4* xv = reinterpret_cast<const uint4*>(xin);
    if (MODE != 0) {
        gv_input<MODE, EARLY>(xin, rows_idx, nw, eps, in, reinterpret_cast<uint2*>(gv_smem));
        __syncthreads();
        xv = reinterpret_cast<const uint4*>(gv_smem);
    }
    if (g_begin >= g_end) {
        if (HOST) gv_store_host<RPW>(ys, y, out);
        return;
    }
    float acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; r++) acc[r] = 0.0f;
    while (true) {
        const int c = lane + bt * 32 * UNROLL;
        uint4 xx[UNROLL];
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            const int cu = min(c + 32 * u, chunks - 1);  // in range; unused past the end
            xx[u] = MODE == 0 ? __ldg(xv + cu) : xv[cu];
        }
        load_next();  // the next batch: this group's, or the first of the next group
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (c + 32 * u < chunks) {
#pragma unroll
                for (int r = 0; r < RPW; r++) acc[r] += dot8(wv[r][u], xx[u]);
            }
        }
        if (bn == 0) {  // group g is complete
            if (GLU) {
                const float gs = warp_sum(acc[0]), us = warp_sum(acc[RPW - 1]);
                if (lane == 0 && g < out)
                    reinterpret_cast<half_t*>(yv)[g] = f2h(gs / (1.0f + expf(-gs)) * us);
            } else {
#pragma unroll
                for (int r = 0; r < RPW; r++) {
                    const float s = warp_sum(acc[r]);
                    const int i = g * RPW + r;
                    if (HOST) {
                        if (lane == 0) ys[warp * RPW + r] = s;
                    } else if (lane == 0 && i < out) {
                        const float y0 =
                            EARLY && g == g_begin ? y_first[r] : (beta != 0.0f ? y[i] : 0.0f);
                        y[i] = beta != 0.0f ? s + beta * y0 : s;
                    }
                }
            }
#pragma unroll
            for (int r = 0; r < RPW; r++) acc[r] = 0.0f;
            if (gn >= g_end) break;
        }
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
#pragma unroll
            for (int r = 0; r < RPW; r++) wv[r][u] = nx[r][u];
        }
        g = gn;
        bt = bn;
        if (++bn == bpr) {
            gn++;
            bn = 0;
        }
    }
    if (HOST) gv_store_host<RPW>(ys, y, out);
}

// Entry points gemv_f16{,_norm,_swiglu}_r{RPW}u{UNROLL}, all with one argument list; the host
// (gemv.rs) picks r1u8 or r2u4 (other shapes measured slower on the H100; git history has them).
// EARLY: see gemv_rows.
#define GEMV_ENTRY_X(name, RPW, UNROLL, MODE, GLU, HOST, EARLY)                               \
    extern "C" __global__ void __launch_bounds__(32 * GV_WARPS, 1)                             \
    name(const half_t* __restrict__ w, const void* __restrict__ xin,                           \
         const int* __restrict__ rows_idx, const float* __restrict__ nw, float eps,            \
         void* __restrict__ y, int in, int out, float beta) {                                  \
        gemv_rows<RPW, UNROLL, MODE, GLU, HOST, EARLY>(w, xin, rows_idx, nw, eps, y, in, out,  \
                                                       beta);                                  \
    }
#define GEMV_ENTRY_H(name, RPW, UNROLL, MODE, GLU, HOST) \
    GEMV_ENTRY_X(name, RPW, UNROLL, MODE, GLU, HOST, false)
#define GEMV_ENTRY_E(name, RPW, UNROLL, MODE, GLU, HOST) \
    GEMV_ENTRY_X(name, RPW, UNROLL, MODE, GLU, HOST, true)
#define GEMV_ENTRY(name, RPW, UNROLL, MODE, GLU) GEMV_ENTRY_H(name, RPW, UNROLL, MODE, GLU, false)
#define GEMV_SHAPES(prefix, MODE)                \
    GEMV_ENTRY(prefix##_r1u8, 1, 8, MODE, false) \
    GEMV_ENTRY(prefix##_r2u4, 2, 4, MODE, false)
GEMV_SHAPES(gemv_f16, 0)
GEMV_SHAPES(gemv_f16_norm, 1)
GEMV_SHAPES(gemv_f16_swiglu, 2)
// The GLU forms (gate/up with the SwiGLU applied on the way out), f16 or RMSNorm input.
GEMV_ENTRY(gemv_f16_glu_r2u4, 2, 4, 0, true)
GEMV_ENTRY(gemv_f16_norm_glu_r2u4, 2, 4, 1, true)
// The EARLY forms, for rows of at least gemv.rs's EARLY_MIN_K elements.
GEMV_ENTRY_E(gemv_f16_r1u8_e, 1, 8, 0, false, false)
GEMV_ENTRY_E(gemv_f16_r2u4_e, 2, 4, 0, false, false)
GEMV_ENTRY_E(gemv_f16_norm_r1u8_e, 1, 8, 1, false, false)
GEMV_ENTRY_E(gemv_f16_norm_r2u4_e, 2, 4, 1, false, false)
GEMV_ENTRY_E(gemv_f16_swiglu_r1u8_e, 1, 8, 2, false, false)
GEMV_ENTRY_E(gemv_f16_swiglu_r2u4_e, 2, 4, 2, false, false)
GEMV_ENTRY_E(gemv_f16_glu_r2u4_e, 2, 4, 0, true, false)
GEMV_ENTRY_E(gemv_f16_norm_glu_r2u4_e, 2, 4, 1, true, false)
GEMV_ENTRY_E(gemv_f16_norm_host_r1u8_e, 1, 8, 1, false, true)
GEMV_ENTRY_E(gemv_f16_norm_host_r2u4_e, 2, 4, 1, false, true)
// The output projection of a one-row step into host memory (RMSNorm input, the two shapes the
// host picks for it).
GEMV_ENTRY_H(gemv_f16_norm_host_r1u8, 1, 8, 1, false, true)
GEMV_ENTRY_H(gemv_f16_norm_host_r2u4, 2, 4, 1, false, true)

// The host form for rows that fit one batch (in <= 256 * UNROLL elements: the 135M model's 576-
// long output rows), on a persistent grid: CTA b takes, round after round, the GV_WARPS row
// groups (r * gridDim.x + b) * GV_WARPS + warp, so each round's rows are contiguous and leave in
// one store. The RMSNorm prologue runs once per CTA instead of once per 8 groups, the lane's x
// chunks stay in registers (the same for every row), and the next round's rows load while this
// round's are summed. Every CTA runs every round (rows past `out` are clamped for the loads and
// not stored) so the one barrier a round is reached by all threads; rounds alternate between two
// staging buffers, so a fast warp cannot overwrite rows not yet stored.
template <int RPW, int UNROLL>
__device__ __forceinline__ void gemv_host_rounds(const half_t* __restrict__ w,
                                                 const void* __restrict__ xin,
                                                 const int* __restrict__ rows_idx,
                                                 const float* __restrict__ nw, float eps,
                                                 float* __restrict__ y, int in, int out) {
    extern __shared__ __align__(16) unsigned char gv_smem[];
    __shared__ float ys[2][GV_WARPS * RPW];
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int chunks = in >> 3;
    const int groups = (out + RPW - 1) / RPW, per_round = gridDim.x * GV_WARPS;
    const int rounds = (groups + per_round - 1) / per_round;
    auto rows_of = [&](int g, const uint4* (&wr)[RPW]) {
#pragma unroll
        for (int r = 0; r < RPW; r++)
            wr[r] = reinterpret_cast<const uint4*>(w + (long)min(g * RPW + r, out - 1) * in);
    };
    int g = blockIdx.x * GV_WARPS + warp;
    const uint4* wr[RPW];
    rows_of(g, wr);
    uint4 wv[RPW][UNROLL];
    gv_load<RPW, UNROLL>(wr, lane, chunks, wv);
    pdl_enter();
    gv_input<1>(xin, rows_idx, nw, eps, in, reinterpret_cast<uint2*>(gv_smem));
    __syncthreads();
    const uint4* xv = reinterpret_cast<const uint4*>(gv_smem);
    uint4 xx[UNROLL];
#pragma unroll
    for (int u = 0; u < UNROLL; u++) xx[u] = xv[min(lane + 32 * u, chunks - 1)];
    for (int r = 0; r < rounds; r++) {
        uint4 nx[RPW][UNROLL];
        const uint4* wn[RPW];
        rows_of(g + per_round, wn);
        gv_load<RPW, UNROLL>(wn, r + 1 < rounds ? lane : chunks, chunks, nx);
        float acc[RPW];
#pragma unroll
        for (int i = 0; i < RPW; i++) acc[i] = 0.0f;
#pragma unroll
        for (int u = 0; u < UNROLL; u++) {
            if (lane + 32 * u < chunks) {
#pragma unroll
                for (int i = 0; i < RPW; i++) acc[i] += dot8(wv[i][u], xx[u]);
            }
        }
#pragma unroll
        for (int i = 0; i < RPW; i++) {
            const float s = warp_sum(acc[i]);
            if (lane == 0) ys[r & 1][warp * RPW + i] = s;
        }
        __syncthreads();
        const int row = (r * per_round + blockIdx.x * GV_WARPS) * RPW + threadIdx.x;
        if (threadIdx.x < GV_WARPS * RPW && row < out) y[row] = ys[r & 1][threadIdx.x];
#pragma unroll
        for (int i = 0; i < RPW; i++) {
#pragma unroll
            for (int u = 0; u < UNROLL; u++) wv[i][u] = nx[i][u];
        }
        g += per_round;
    }
}

extern "C" __global__ void __launch_bounds__(32 * GV_WARPS)
gemv_f16_norm_host_rounds_r2u4(const half_t* __restrict__ w, const void* __restrict__ xin,
                               const int* __restrict__ rows_idx, const float* __restrict__ nw,
                               float eps, void* __restrict__ y, int in, int out, float beta) {
    gemv_host_rounds<2, 4>(w, xin, rows_idx, nw, eps, reinterpret_cast<float*>(y), in, out);
}
