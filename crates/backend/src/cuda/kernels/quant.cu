// Quantized weights kept as stored (ggml Q4_0, Q4_1, Q8_0 blocks of 32; Q4_K, Q5_K, Q6_K
// super-blocks of 256) times activations
// quantized to 8 bits per block of 32: the CPU backend's numerics (and llama.cpp's), with dp4a.
// The activation block is the CPU's `BlockQ8A`: d = amax / 127 and s = d * sum(q), both rounded to
// f16 precision, q = round-to-nearest-even(x * 127 / amax).

struct q8a_t {
    float d;
    float s;
    int qs[8];  // 32 int8, four per int
};

__device__ __forceinline__ int dp4a(int a, int b, int c) {
    int r;
    asm("dp4a.s32.s32 %0, %1, %2, %3;" : "=r"(r) : "r"(a), "r"(b), "r"(c));
    return r;
}

__device__ __forceinline__ int warp_isum(int v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}

// One warp quantizes one block: lane i holds element i.
__device__ __forceinline__ void quant_block_warp(float v, q8a_t* dst) {
    const int lane = threadIdx.x & 31;
    const float amax = warp_max(fabsf(v));
    // IEEE division and product (kernels build with --use_fast_math): the CPU's exact bits.
    const float d = __fdiv_rn(amax, 127.0f);
    const float id = amax != 0.0f ? __fdiv_rn(127.0f, amax) : 0.0f;
    int q = (int)rintf(__fmul_rn(v, id));
    q = max(-127, min(127, q));
    const int sum = warp_isum(q);
    ((signed char*)dst->qs)[lane] = (signed char)q;
    if (lane == 0) {
        dst->d = h2f(f2h(d));
        dst->s = h2f(f2h(__fmul_rn(d, (float)sum)));
    }
}

// x: [n, k] f16; out: [n, k / 32] q8 blocks. One warp per block.
extern "C" __global__ void quantize_q8_f16(const half_t* __restrict__ x, q8a_t* __restrict__ out,
                                           long blocks) {
    pdl_enter();
    const long b = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    quant_block_warp(h2f(x[b * 32 + (threadIdx.x & 31)]), out + b);
}

// x: [n, k] f32; out: [n, k / 32] q8 blocks. One warp per block.
extern "C" __global__ void quantize_q8_f32(const float* __restrict__ x, q8a_t* __restrict__ out,
                                           long blocks) {
    pdl_enter();
    const long b = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    quant_block_warp(x[b * 32 + (threadIdx.x & 31)], out + b);
}

// RMSNorm straight into q8 blocks (the f32 normed row never leaves registers).
// x: [rows, dim] f32 (row r read from x[rows_idx ? rows_idx[r] : r]); w: [dim]; out: [rows, dim/32]
extern "C" __global__ void rms_norm_q8(const float* __restrict__ x, const int* __restrict__ rows_idx,
                                       const float* __restrict__ w, q8a_t* __restrict__ out, int dim,
                                       float eps) {
    pdl_enter();
    __shared__ float red[32];
    const int r = blockIdx.x;
    const long src = rows_idx ? rows_idx[r] : r;
    const float* xr = x + src * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(ss / dim + eps);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, warps = blockDim.x >> 5;
    const int nb = dim / 32;
    for (int b = warp; b < nb; b += warps) {
        const int i = b * 32 + lane;
        quant_block_warp(xr[i] * scale * w[i], out + (long)r * nb + b);
    }
}

// silu(gate) * up into q8 blocks. gu: [n, 2 * inter] f32; out: [n, inter / 32]
extern "C" __global__ void swiglu_q8(const float* __restrict__ gu, q8a_t* __restrict__ out, int inter,
                                     long blocks) {
    pdl_enter();
    const long b = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    const int nb = inter / 32;
    const long t = b / nb;
    const int j = (int)(b - t * nb) * 32 + (threadIdx.x & 31);
    const float g = gu[t * 2 * inter + j], u = gu[t * 2 * inter + inter + j];
    quant_block_warp(g / (1.0f + expf(-g)) * u, out + b);
}

// ---- weight blocks -------------------------------------------------------------------------

#define T_Q4_0 0
#define T_Q4_1 1
#define T_Q8_0 2
#define T_Q4_K 3
#define T_Q5_K 4
#define T_Q6_K 5

// Bytes and elements of one stored block: 32 elements for the legacy types, 256-element
// super-blocks (eight sub-blocks of 32, each lining up with one activation block) for K-quants.
template <int TYPE> struct wblock;
template <> struct wblock<T_Q4_0> { static const int bytes = 18, elems = 32; };
template <> struct wblock<T_Q4_1> { static const int bytes = 20, elems = 32; };
template <> struct wblock<T_Q8_0> { static const int bytes = 34, elems = 32; };
template <> struct wblock<T_Q4_K> { static const int bytes = 144, elems = 256; };
template <> struct wblock<T_Q5_K> { static const int bytes = 176, elems = 256; };
template <> struct wblock<T_Q6_K> { static const int bytes = 210, elems = 256; };

// The stored block holding 32-element block `b` of a row, and `b`'s index inside it.
template <int TYPE>
__device__ __forceinline__ const unsigned char* block_of(const unsigned char* row, int b, int* sub) {
    const int per = wblock<TYPE>::elems / 32;
    *sub = b % per;
    return row + (long)(b / per) * wblock<TYPE>::bytes;
}

// Two bytes apart: Q4_0, Q8_0 and Q6_K blocks are only 2-byte aligned.
__device__ __forceinline__ int load_int_b2(const unsigned short* p) {
    return (int)((unsigned)p[0] | ((unsigned)p[1] << 16));
}

// Q4_K/Q5_K: the 6-bit scale and min of sub-block j (ggml's packing of 12 bytes).
__device__ __forceinline__ void scale_min_k4(int j, const unsigned char* q, int* sc, int* m) {
    if (j < 4) {
        *sc = q[j] & 63;
        *m = q[j + 4] & 63;
    } else {
        *sc = (q[j + 4] & 0x0F) | ((q[j - 4] >> 6) << 4);
        *m = (q[j + 4] >> 4) | ((q[j] >> 6) << 4);
    }
}

// The f32 contribution of one weight block (sub-block `j` of a K-quant super-block) against one
// activation block, as the CPU's scalar reference computes it (integer sum exact, then the same
// float expression, unfused).
template <int TYPE>
__device__ __forceinline__ float block_dot(const unsigned char* wb, int j, const q8a_t* a);

template <>
__device__ __forceinline__ float block_dot<T_Q4_0>(const unsigned char* wb, int, const q8a_t* a) {
    const unsigned short* p = (const unsigned short*)wb;
    int isum = 0, asum = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int v = load_int_b2(p + 1 + 2 * j);
        const int lo = v & 0x0F0F0F0F, hi = (v >> 4) & 0x0F0F0F0F;
        isum = dp4a(lo, a->qs[j], isum);
        isum = dp4a(hi, a->qs[j + 4], isum);
        asum = dp4a(0x01010101, a->qs[j], asum);
        asum = dp4a(0x01010101, a->qs[j + 4], asum);
    }
    return h2f(p[0]) * a->d * (float)(isum - 8 * asum);
}

template <>
__device__ __forceinline__ float block_dot<T_Q4_1>(const unsigned char* wb, int, const q8a_t* a) {
    const int* p = (const int*)wb;
    const unsigned dm = (unsigned)p[0];
    int isum = 0;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int v = p[1 + j];
        isum = dp4a(v & 0x0F0F0F0F, a->qs[j], isum);
        isum = dp4a((v >> 4) & 0x0F0F0F0F, a->qs[j + 4], isum);
    }
    return h2f((half_t)(dm & 0xFFFF)) * a->d * (float)isum + h2f((half_t)(dm >> 16)) * a->s;
}

template <>
__device__ __forceinline__ float block_dot<T_Q8_0>(const unsigned char* wb, int, const q8a_t* a) {
    const unsigned short* p = (const unsigned short*)wb;
    int isum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) isum = dp4a(load_int_b2(p + 1 + 2 * j), a->qs[j], isum);
    return h2f(p[0]) * a->d * (float)isum;
}

// Q4_K/Q5_K: ((d·sc)·a.d)·isum − (dmin·m)·a.s, the CPU's `add_affine`.
__device__ __forceinline__ float affine_k(const unsigned char* wb, int j, const q8a_t* a, int isum) {
    const half_t* dm = (const half_t*)wb;
    int sc, m;
    scale_min_k4(j, wb + 4, &sc, &m);
    const float x = __fmul_rn(__fmul_rn(__fmul_rn(h2f(dm[0]), (float)sc), a->d), (float)isum);
    return __fsub_rn(x, __fmul_rn(__fmul_rn(h2f(dm[1]), (float)m), a->s));
}

// Q4_K: d, dmin, scales[12], qs[128] (elements 64c + l: low nibbles of qs[32c + l], 64c + 32 + l:
// high nibbles). Sub-block j = 2c + hi.
template <>
__device__ __forceinline__ float block_dot<T_Q4_K>(const unsigned char* wb, int j, const q8a_t* a) {
    const int* qs = (const int*)(wb + 16 + 32 * (j >> 1));
    const int shift = 4 * (j & 1);
    int isum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) isum = dp4a((qs[i] >> shift) & 0x0F0F0F0F, a->qs[i], isum);
    return affine_k(wb, j, a, isum);
}

// Q5_K: d, dmin, scales[12], qh[32], qs[128]: Q4_K's nibbles plus bit j of qh[l] as the fifth bit.
template <>
__device__ __forceinline__ float block_dot<T_Q5_K>(const unsigned char* wb, int j, const q8a_t* a) {
    const int* qh = (const int*)(wb + 16);
    const int* qs = (const int*)(wb + 48 + 32 * (j >> 1));
    const int shift = 4 * (j & 1);
    int isum = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int code = ((qs[i] >> shift) & 0x0F0F0F0F) | (((qh[i] >> j) & 0x01010101) << 4);
        isum = dp4a(code, a->qs[i], isum);
    }
    return affine_k(wb, j, a, isum);
}

// Q6_K: ql[128], qh[64], scales[16] (i8, one per 16 elements), d. Element 128h + 32k + l: low
// nibble (k < 2) or high nibble (k >= 2) of ql[64h + 32(k & 1) + l], bits 2k..2k+1 of qh[32h + l]
// on top, minus 32. Sub-block j = 4h + k; its two halves of 16 take scales 2j and 2j + 1.
template <>
__device__ __forceinline__ float block_dot<T_Q6_K>(const unsigned char* wb, int j, const q8a_t* a) {
    const int h = j >> 2, k = j & 3;
    const unsigned short* ql = (const unsigned short*)(wb + 64 * h + 32 * (k & 1));
    const unsigned short* qh = (const unsigned short*)(wb + 128 + 32 * h);
    const signed char* sc = (const signed char*)(wb + 192);
    const int lshift = k < 2 ? 0 : 4;
    int half_sum[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int lo = (load_int_b2(ql + 2 * i) >> lshift) & 0x0F0F0F0F;
        const int hi = ((load_int_b2(qh + 2 * i) >> (2 * k)) & 0x03030303) << 4;
        // (code - 32) · a, as code · a − 32 · Σa (codes are 0..63).
        half_sum[i >> 2] += dp4a(lo | hi, a->qs[i], 0) - 32 * dp4a(0x01010101, a->qs[i], 0);
    }
    const int isum = (int)sc[2 * j] * half_sum[0] + (int)sc[2 * j + 1] * half_sum[1];
    const float d = h2f(*(const half_t*)(wb + 208));
    return __fmul_rn(__fmul_rn(d, a->d), (float)isum);
}

#define MMQ_WARPS 4
#define MMQ_ROWS 2

// y[t, r] = Σ_b dot(w[r, b], a[t, b]) + beta * y[t, r]: each warp owns MMQ_ROWS weight rows and the
// CTA's TOK tokens; lanes stride over the row's blocks, then a warp reduction.
// w: [rows, nb * 32 / elems] stored blocks; a: [n, nb] q8 blocks; y: [n, rows] f32. grid (rows / (WARPS*ROWS), n / TOK)
template <int TYPE, int TOK>
__device__ __forceinline__ void mmq(const unsigned char* __restrict__ w, const q8a_t* __restrict__ a,
                                    float* __restrict__ y, int rows, int nb, int n, float beta) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * MMQ_WARPS + warp) * MMQ_ROWS;
    const int t0 = blockIdx.y * TOK;
    if (r0 >= rows) return;
    const int ntok = min(TOK, n - t0);
    const long row_bytes = (long)(nb / (wblock<TYPE>::elems / 32)) * wblock<TYPE>::bytes;
    float acc[MMQ_ROWS][TOK];
#pragma unroll
    for (int i = 0; i < MMQ_ROWS; i++)
#pragma unroll
        for (int t = 0; t < TOK; t++) acc[i][t] = 0.0f;
    for (int b = lane; b < nb; b += 32) {
#pragma unroll
        for (int t = 0; t < TOK; t++) {
            if (t < ntok) {
                const q8a_t* ab = a + (long)(t0 + t) * nb + b;
#pragma unroll
                for (int i = 0; i < MMQ_ROWS; i++) {
                    if (r0 + i < rows) {
                        int sub;
                        const unsigned char* wb = block_of<TYPE>(w + (r0 + i) * row_bytes, b, &sub);
                        acc[i][t] += block_dot<TYPE>(wb, sub, ab);
                    }
                }
            }
        }
    }
#pragma unroll
    for (int i = 0; i < MMQ_ROWS; i++)
#pragma unroll
        for (int t = 0; t < TOK; t++) {
            const float v = warp_sum(acc[i][t]);
            if (lane == 0 && t < ntok && r0 + i < rows) {
                float* o = y + (long)(t0 + t) * rows + r0 + i;
                *o = beta != 0.0f ? v + beta * *o : v;
            }
        }
}

#define MMQ_ENTRY(NAME, TYPE, TOK)                                                               \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ w,                         \
                                    const q8a_t* __restrict__ a, float* __restrict__ y, int rows, \
                                    int nb, int n, float beta) { \
        pdl_enter();                             \
        mmq<TYPE, TOK>(w, a, y, rows, nb, n, beta);                                              \
    }

MMQ_ENTRY(mmq_q4_0_t1, T_Q4_0, 1)
MMQ_ENTRY(mmq_q4_0_t8, T_Q4_0, 8)
MMQ_ENTRY(mmq_q4_1_t1, T_Q4_1, 1)
MMQ_ENTRY(mmq_q4_1_t8, T_Q4_1, 8)
MMQ_ENTRY(mmq_q8_0_t1, T_Q8_0, 1)
MMQ_ENTRY(mmq_q8_0_t8, T_Q8_0, 8)
MMQ_ENTRY(mmq_q4_k_t1, T_Q4_K, 1)
MMQ_ENTRY(mmq_q4_k_t8, T_Q4_K, 8)
MMQ_ENTRY(mmq_q5_k_t1, T_Q5_K, 1)
MMQ_ENTRY(mmq_q5_k_t8, T_Q5_K, 8)
MMQ_ENTRY(mmq_q6_k_t1, T_Q6_K, 1)
MMQ_ENTRY(mmq_q6_k_t8, T_Q6_K, 8)

// ---- the few-token GEMV (mmv_*): 16-byte loads staged through shared memory -----------------
//
// Why the dp4a kernel above (`mmq_*_t1`) stays far from the memory roof at one token, read off its
// code (a reasoning, to be checked against cuda_matmul_bench's decode table):
// - Narrow loads. Q4_0, Q8_0 and Q6_K blocks are only 2-byte aligned, so every quant is fetched
//   two bytes at a time (`load_int_b2`): 16 load instructions per Q8_0 block, 32 per Q6_K
//   sub-block. Q4_K is read four bytes at a time, and the 32 bytes that hold a sub-block pair
//   (low and high nibbles) are fetched by both lanes of the pair. Each 4-byte load of a warp
//   touches 32 different 32-byte stretches of the row, so the load/store unit and L1 replay far
//   more often than the bytes need.
// - Scales by single bytes: each sub-block's 6-bit scale and min are picked out of the
//   super-block's 12 packed bytes with 3-4 byte loads from global memory, and d/dmin with two
//   more, per lane and sub-block.
// - Little in flight: the loop over a row's blocks has a run-time trip count (4 at k = 4096 for
//   Q4_K) and is not unrolled, so a lane has one block per row (2 rows: ~64 bytes) outstanding
//   before it needs the data. 4096 rows at 2 rows per warp are ~15 warps per SM, ~30 KB in flight
//   per SM at best, about twice what 3.1 TB/s × ~0.7 µs of latency asks for: any stall (the
//   byte-wise scale decode, the replays above) drops it below.
// - The activation row (40 bytes per 32 values: 2.2× a Q4 row's bytes) is read again by every
//   warp; it hits L1/L2, but those reads compete with the weight loads for the same unit. This
//   kernel keeps that cost (2 rows per warp share each activation block).
//
// So here each warp copies a stage of its rows (whole stored blocks, a multiple of 16 bytes:
// 8 K-quant super-blocks, 64 Q4_0/Q4_1 or 32 Q8_0 blocks) into shared memory with coalesced
// 16-byte loads, up to 4 per lane and row, all independent, and issues the next stage's loads
// before it computes on the current one (registers hold them meanwhile). The dot products then
// read shared memory with `block_dot`, the arithmetic of the dp4a kernel unchanged (exact integer
// dot per 32-block, the same f32 scale expressions): the results equal `mmq_*` up to the f32
// summation order. For Q4_K and Q6_K a lane takes a sub-block pair instead (`q4k_pair_dot`,
// `q6k_pair_dot`): the two sub-blocks whose quants share bytes (low and high nibbles; Q6_K's
// 2-bit high parts too), so each quant byte is read once (Q4_K: 16 bytes at a time), and the
// super-block's d (and dmin) read once for both. Rows must start 16-byte aligned (the matrix base and the row length in bytes
// multiples of 16; `QuantKernels::mmv_ok`), otherwise the dp4a kernel runs. The first stage's
// loads go out before `pdl_enter` (the one kernel here that does not start with it): weights are
// read-only, so only the activations and `y` must wait for the grid before.

#define MMV_WARPS 4
#define MMV_ROWS 2
#define MMV_LOADS 4  // 16-byte loads per lane, row and stage (a stage is at most 2 KB)

// Stored blocks per stage: the fewest whole blocks that fill a multiple of 16 bytes, times what
// keeps the stage at 1-2 KB (and at most 64 sub-blocks of 32: two per lane).
template <int TYPE> struct mmv_stage;
template <> struct mmv_stage<T_Q4_0> { static const int blocks = 64; };  // 1152 bytes
template <> struct mmv_stage<T_Q4_1> { static const int blocks = 64; };  // 1280
template <> struct mmv_stage<T_Q8_0> { static const int blocks = 32; };  // 1088
template <> struct mmv_stage<T_Q4_K> { static const int blocks = 8; };   // 1152
template <> struct mmv_stage<T_Q5_K> { static const int blocks = 8; };   // 1408
template <> struct mmv_stage<T_Q6_K> { static const int blocks = 8; };   // 1680

// Q4_K sub-blocks 2c and 2c + 1 (the low and high nibbles of the same 32 bytes) against the
// activation blocks a[0] and a[1], for the staged kernel: the 32 bytes read once (two 16-byte
// reads of shared memory), the two scale/min pairs decoded once; each half is
// block_dot<T_Q4_K>'s arithmetic (exact integer dot, then `affine_k`).
__device__ __forceinline__ float q4k_pair_dot(const unsigned char* wb, int c, const q8a_t* a) {
    const uint4* q = (const uint4*)(wb + 16 + 32 * c);
    const uint4 q0 = q[0], q1 = q[1];
    const int v[8] = {(int)q0.x, (int)q0.y, (int)q0.z, (int)q0.w,
                      (int)q1.x, (int)q1.y, (int)q1.z, (int)q1.w};
    int lo = 0, hi = 0;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        lo = dp4a(v[i] & 0x0F0F0F0F, a[0].qs[i], lo);
        hi = dp4a((v[i] >> 4) & 0x0F0F0F0F, a[1].qs[i], hi);
    }
    return affine_k(wb, 2 * c, a, lo) + affine_k(wb, 2 * c + 1, a + 1, hi);
}

// Q6_K sub-blocks j0 = 4h + k and j0 + 2 (k < 2: the low and high nibbles of the same 32 ql
// bytes, the same 32 qh bytes) against the activation blocks a0 and a1, for the staged kernel:
// each quant byte read once for both; each half is block_dot<T_Q6_K>'s arithmetic.
__device__ __forceinline__ float q6k_pair_dot(const unsigned char* wb, int h, int k,
                                              const q8a_t* a0, const q8a_t* a1) {
    const unsigned short* ql = (const unsigned short*)(wb + 64 * h + 32 * k);
    const unsigned short* qh = (const unsigned short*)(wb + 128 + 32 * h);
    const signed char* sc = (const signed char*)(wb + 192);
    int s0[2] = {0, 0}, s1[2] = {0, 0};
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int l = load_int_b2(ql + 2 * i), q = load_int_b2(qh + 2 * i);
        const int c0 = (l & 0x0F0F0F0F) | (((q >> (2 * k)) & 0x03030303) << 4);
        const int c1 = ((l >> 4) & 0x0F0F0F0F) | (((q >> (2 * k + 4)) & 0x03030303) << 4);
        // (code - 32) · a, as code · a − 32 · Σa (codes are 0..63).
        s0[i >> 2] += dp4a(c0, a0->qs[i], 0) - 32 * dp4a(0x01010101, a0->qs[i], 0);
        s1[i >> 2] += dp4a(c1, a1->qs[i], 0) - 32 * dp4a(0x01010101, a1->qs[i], 0);
    }
    const int j0 = 4 * h + k, j1 = j0 + 2;
    const int i0 = (int)sc[2 * j0] * s0[0] + (int)sc[2 * j0 + 1] * s0[1];
    const int i1 = (int)sc[2 * j1] * s1[0] + (int)sc[2 * j1 + 1] * s1[1];
    const float d = h2f(*(const half_t*)(wb + 208));
    return __fmul_rn(__fmul_rn(d, a0->d), (float)i0) + __fmul_rn(__fmul_rn(d, a1->d), (float)i1);
}

// Issues this lane's 16-byte loads of the stage starting at stored block `s0` of each row.
template <int TYPE>
__device__ __forceinline__ void mmv_fetch(const uint4* const* rows, int s0, int nsb, int lane,
                                          uint4 (*regs)[MMV_LOADS]) {
    const int B = wblock<TYPE>::bytes, SB = mmv_stage<TYPE>::blocks;
    const int n16 = (min(SB, nsb - s0) * B) >> 4;
    const long base = ((long)s0 * B) >> 4;
#pragma unroll
    for (int i = 0; i < MMV_ROWS; i++)
#pragma unroll
        for (int u = 0; u < MMV_LOADS; u++) {
            const int idx = lane + 32 * u;
            if (idx < n16) regs[i][u] = rows[i][base + idx];
        }
}

// y[t, r] = Σ_b dot(w[r, b], a[t, b]) + beta · y[t, r]: each warp owns MMV_ROWS rows and the
// CTA's TOK tokens. w: [rows, nb · 32 / elems] stored blocks, each row 16-byte aligned; a: [n, nb]
// q8 blocks; y: [n, rows] f32. grid (rows / (MMV_WARPS · MMV_ROWS), n / TOK), MMV_WARPS warps.
template <int TYPE, int TOK>
__device__ __forceinline__ void mmv(const unsigned char* __restrict__ w, const q8a_t* __restrict__ a,
                                    float* __restrict__ y, int rows, int nb, int n, float beta) {
    __shared__ uint4 stage[MMV_WARPS][MMV_ROWS][MMV_LOADS * 32];
    const int B = wblock<TYPE>::bytes, PER = wblock<TYPE>::elems / 32;
    const int SB = mmv_stage<TYPE>::blocks;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * MMV_WARPS + warp) * MMV_ROWS;
    const int t0 = blockIdx.y * TOK;
    if (r0 >= rows) {
        pdl_enter();
        return;  // the whole warp: no warp-wide step below is left waiting
    }
    const int ntok = min(TOK, n - t0);
    const int nsb = nb / PER;
    const long row_bytes = (long)nsb * B;
    // Rows past the end read the last row again (in bounds) and are not written.
    const uint4* wr[MMV_ROWS];
#pragma unroll
    for (int i = 0; i < MMV_ROWS; i++)
        wr[i] = (const uint4*)(w + (long)min(r0 + i, rows - 1) * row_bytes);
    float acc[MMV_ROWS][TOK];
#pragma unroll
    for (int i = 0; i < MMV_ROWS; i++)
#pragma unroll
        for (int t = 0; t < TOK; t++) acc[i][t] = 0.0f;
    uint4 next[MMV_ROWS][MMV_LOADS];
    // The weights are never written by a kernel, so their first stage is requested before
    // waiting on the grid before this one (whose output, the activations, is read only after):
    // the loads overlap that grid's tail and this one's launch.
    mmv_fetch<TYPE>(wr, 0, nsb, lane, next);
    pdl_enter();
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
                    if (t < ntok) {
                        const q8a_t* ab = a + (long)(t0 + t) * nb + b0 + sb * PER;
#pragma unroll
                        for (int i = 0; i < MMV_ROWS; i++) {
                            const unsigned char* wb = (const unsigned char*)stage[warp][i] + sb * B;
                            if constexpr (TYPE == T_Q4_K) {
                                // Sub-blocks 2p and 2p + 1.
                                acc[i][t] += q4k_pair_dot(wb, p, ab + 2 * p);
                            } else {
                                // Sub-blocks 4h + k and 4h + k + 2.
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
                        if (t < ntok) {
                            const q8a_t* ab = a + (long)(t0 + t) * nb + b0 + j;
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
            if (lane == 0 && t < ntok && r0 + i < rows) {
                float* o = y + (long)(t0 + t) * rows + r0 + i;
                *o = beta != 0.0f ? v + beta * *o : v;
            }
        }
}

#define MMV_ENTRY(NAME, TYPE, TOK)                                                                \
    extern "C" __global__ void __launch_bounds__(MMV_WARPS * 32)                                  \
        NAME(const unsigned char* __restrict__ w, const q8a_t* __restrict__ a,                    \
             float* __restrict__ y, int rows, int nb, int n, float beta) {                        \
        mmv<TYPE, TOK>(w, a, y, rows, nb, n, beta);                                               \
    }

MMV_ENTRY(mmv_q4_0_t1, T_Q4_0, 1)
MMV_ENTRY(mmv_q4_0_t8, T_Q4_0, 8)
MMV_ENTRY(mmv_q4_1_t1, T_Q4_1, 1)
MMV_ENTRY(mmv_q4_1_t8, T_Q4_1, 8)
MMV_ENTRY(mmv_q8_0_t1, T_Q8_0, 1)
MMV_ENTRY(mmv_q8_0_t8, T_Q8_0, 8)
MMV_ENTRY(mmv_q4_k_t1, T_Q4_K, 1)
MMV_ENTRY(mmv_q4_k_t8, T_Q4_K, 8)
MMV_ENTRY(mmv_q5_k_t1, T_Q5_K, 1)
MMV_ENTRY(mmv_q5_k_t8, T_Q5_K, 8)
MMV_ENTRY(mmv_q6_k_t1, T_Q6_K, 1)
MMV_ENTRY(mmv_q6_k_t8, T_Q6_K, 8)

// The read roof for the benchmark: every 16 bytes of `p` read once, four loads in flight per
// thread, nothing written (the xor is stored only when it equals a constant, so the compiler must
// keep every load). n16: 16-byte words; grid-stride, any grid.
extern "C" __global__ void read_roof(const uint4* __restrict__ p, long n16, unsigned* out) {
    pdl_enter();
    const long stride = (long)gridDim.x * blockDim.x;
    unsigned x = 0;
    long i = blockIdx.x * (long)blockDim.x + threadIdx.x;
    for (; i + 3 * stride < n16; i += 4 * stride) {
        uint4 v[4];
#pragma unroll
        for (int u = 0; u < 4; u++) v[u] = p[i + u * stride];
#pragma unroll
        for (int u = 0; u < 4; u++) x ^= v[u].x ^ v[u].y ^ v[u].z ^ v[u].w;
    }
    for (; i < n16; i += stride) x ^= p[i].x ^ p[i].y ^ p[i].z ^ p[i].w;
    if (x == 0x9e3779b9u) out[0] = x;
}

// Token embedding lookup from a quantized table (values as the CPU dequantizes them: d * q (- m)).
// ids: [n]; table: [vocab, hidden / elems] stored blocks; x: [n, hidden] f32
// Element i (0..elems) of one stored block.
template <int TYPE>
__device__ __forceinline__ float dequant(const unsigned char* wb, int i);
template <>
__device__ __forceinline__ float dequant<T_Q8_0>(const unsigned char* wb, int i) {
    return h2f(*(const half_t*)wb) * (float)((const signed char*)(wb + 2))[i];
}
template <>
__device__ __forceinline__ float dequant<T_Q4_0>(const unsigned char* wb, int i) {
    const unsigned char q = wb[2 + (i & 15)];
    return h2f(*(const half_t*)wb) * (float)((int)(i < 16 ? (q & 15) : (q >> 4)) - 8);
}
template <>
__device__ __forceinline__ float dequant<T_Q4_1>(const unsigned char* wb, int i) {
    const unsigned char q = wb[4 + (i & 15)];
    const half_t* dm = (const half_t*)wb;
    // Unfused, as the CPU computes it.
    return __fadd_rn(__fmul_rn((float)(i < 16 ? (q & 15) : (q >> 4)), h2f(dm[0])), h2f(dm[1]));
}

// K-quants: dj * code - mj with dj = d * sc, mj = dmin * m (the CPU's order, unfused).
__device__ __forceinline__ float dequant_affine_k(const unsigned char* wb, int i, int code) {
    const half_t* dm = (const half_t*)wb;
    int sc, m;
    scale_min_k4(i / 32, wb + 4, &sc, &m);
    return __fsub_rn(__fmul_rn(__fmul_rn(h2f(dm[0]), (float)sc), (float)code),
                     __fmul_rn(h2f(dm[1]), (float)m));
}
template <>
__device__ __forceinline__ float dequant<T_Q4_K>(const unsigned char* wb, int i) {
    const unsigned char q = wb[16 + 32 * (i / 64) + i % 32];
    return dequant_affine_k(wb, i, i % 64 < 32 ? (q & 15) : (q >> 4));
}
template <>
__device__ __forceinline__ float dequant<T_Q5_K>(const unsigned char* wb, int i) {
    const unsigned char q = wb[48 + 32 * (i / 64) + i % 32];
    const int lo = i % 64 < 32 ? (q & 15) : (q >> 4);
    return dequant_affine_k(wb, i, lo | (((wb[16 + i % 32] >> (i / 32)) & 1) << 4));
}
template <>
__device__ __forceinline__ float dequant<T_Q6_K>(const unsigned char* wb, int i) {
    const int h = i / 128, k = (i % 128) / 32, l = i % 32;
    const unsigned char b = wb[64 * h + l + 32 * (k & 1)];
    const int lo = k < 2 ? (b & 15) : (b >> 4);
    const int hi = (wb[128 + 32 * h + l] >> (2 * k)) & 3;
    const float d = h2f(*(const half_t*)(wb + 208));
    const float sc = (float)((const signed char*)(wb + 192))[i / 16];
    return __fmul_rn(__fmul_rn(d, sc), (float)((lo | (hi << 4)) - 32));
}

#define EMBED_ENTRY(NAME, TYPE)                                                                 \
    extern "C" __global__ void NAME(const int* __restrict__ ids, const unsigned char* __restrict__ table, \
                                    float* __restrict__ x, int hidden) { \
        pdl_enter();                    \
        const long t = blockIdx.x;                                                              \
        const int E = wblock<TYPE>::elems;                                                      \
        const unsigned char* row = table + (long)ids[t] * (hidden / E) * wblock<TYPE>::bytes;   \
        for (int i = threadIdx.x; i < hidden; i += blockDim.x)                                  \
            x[t * hidden + i] = dequant<TYPE>(row + (i / E) * wblock<TYPE>::bytes, i % E);      \
    }

EMBED_ENTRY(embed_q4_0, T_Q4_0)
EMBED_ENTRY(embed_q4_1, T_Q4_1)
EMBED_ENTRY(embed_q8_0, T_Q8_0)
EMBED_ENTRY(embed_q4_k, T_Q4_K)
EMBED_ENTRY(embed_q5_k, T_Q5_K)
EMBED_ENTRY(embed_q6_k, T_Q6_K)

// Whole-matrix dequantization to f16, for many-token matmuls through cuBLAS: one thread per value
// (the CPU's value, then rounded to f16); a warp covers one block.
// w: [elems / block elems] stored blocks; out: [elems] f16
#define DEQUANT_ENTRY(NAME, TYPE)                                                               \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ w, half_t* __restrict__ out, \
                                    long elems) { \
        pdl_enter();                                           \
        const long e = blockIdx.x * (long)blockDim.x + threadIdx.x;                             \
        if (e >= elems) return;                                                                 \
        const int E = wblock<TYPE>::elems;                                                      \
        out[e] = f2h(dequant<TYPE>(w + (e / E) * wblock<TYPE>::bytes, (int)(e % E)));           \
    }

DEQUANT_ENTRY(dequant_q4_0, T_Q4_0)
DEQUANT_ENTRY(dequant_q4_1, T_Q4_1)
DEQUANT_ENTRY(dequant_q8_0, T_Q8_0)
DEQUANT_ENTRY(dequant_q4_k, T_Q4_K)
DEQUANT_ENTRY(dequant_q5_k, T_Q5_K)
DEQUANT_ENTRY(dequant_q6_k, T_Q6_K)
