// Quantized weights kept as stored (ggml Q4_0, Q4_1, Q8_0 blocks of 32) times activations
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
    const long b = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    quant_block_warp(h2f(x[b * 32 + (threadIdx.x & 31)]), out + b);
}

// x: [n, k] f32; out: [n, k / 32] q8 blocks. One warp per block.
extern "C" __global__ void quantize_q8_f32(const float* __restrict__ x, q8a_t* __restrict__ out,
                                           long blocks) {
    const long b = blockIdx.x * (long)(blockDim.x >> 5) + (threadIdx.x >> 5);
    if (b >= blocks) return;
    quant_block_warp(x[b * 32 + (threadIdx.x & 31)], out + b);
}

// RMSNorm straight into q8 blocks (the f32 normed row never leaves registers).
// x: [rows, dim] f32 (row r read from x[rows_idx ? rows_idx[r] : r]); w: [dim]; out: [rows, dim/32]
extern "C" __global__ void rms_norm_q8(const float* __restrict__ x, const int* __restrict__ rows_idx,
                                       const float* __restrict__ w, q8a_t* __restrict__ out, int dim,
                                       float eps) {
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

template <int TYPE> struct wblock;
template <> struct wblock<T_Q4_0> { static const int bytes = 18; };
template <> struct wblock<T_Q4_1> { static const int bytes = 20; };
template <> struct wblock<T_Q8_0> { static const int bytes = 34; };

// Two bytes apart: Q4_0 and Q8_0 blocks are only 2-byte aligned.
__device__ __forceinline__ int load_int_b2(const unsigned short* p) {
    return (int)((unsigned)p[0] | ((unsigned)p[1] << 16));
}

// The f32 contribution of one weight block against one activation block, as the CPU's scalar
// reference computes it (integer sum exact, then the same float expression).
template <int TYPE>
__device__ __forceinline__ float block_dot(const unsigned char* wb, const q8a_t* a);

template <>
__device__ __forceinline__ float block_dot<T_Q4_0>(const unsigned char* wb, const q8a_t* a) {
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
__device__ __forceinline__ float block_dot<T_Q4_1>(const unsigned char* wb, const q8a_t* a) {
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
__device__ __forceinline__ float block_dot<T_Q8_0>(const unsigned char* wb, const q8a_t* a) {
    const unsigned short* p = (const unsigned short*)wb;
    int isum = 0;
#pragma unroll
    for (int j = 0; j < 8; j++) isum = dp4a(load_int_b2(p + 1 + 2 * j), a->qs[j], isum);
    return h2f(p[0]) * a->d * (float)isum;
}

#define MMQ_WARPS 4
#define MMQ_ROWS 2

// y[t, r] = Σ_b dot(w[r, b], a[t, b]) + beta * y[t, r]: each warp owns MMQ_ROWS weight rows and the
// CTA's TOK tokens; lanes stride over the row's blocks, then a warp reduction.
// w: [rows, nb] blocks; a: [n, nb] q8 blocks; y: [n, rows] f32. grid (rows / (WARPS*ROWS), n / TOK)
template <int TYPE, int TOK>
__device__ __forceinline__ void mmq(const unsigned char* __restrict__ w, const q8a_t* __restrict__ a,
                                    float* __restrict__ y, int rows, int nb, int n, float beta) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int r0 = (blockIdx.x * MMQ_WARPS + warp) * MMQ_ROWS;
    const int t0 = blockIdx.y * TOK;
    if (r0 >= rows) return;
    const int ntok = min(TOK, n - t0);
    const int bytes = wblock<TYPE>::bytes;
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
                    if (r0 + i < rows)
                        acc[i][t] += block_dot<TYPE>(w + ((long)(r0 + i) * nb + b) * bytes, ab);
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
                                    int nb, int n, float beta) {                                 \
        mmq<TYPE, TOK>(w, a, y, rows, nb, n, beta);                                              \
    }

MMQ_ENTRY(mmq_q4_0_t1, T_Q4_0, 1)
MMQ_ENTRY(mmq_q4_0_t8, T_Q4_0, 8)
MMQ_ENTRY(mmq_q4_1_t1, T_Q4_1, 1)
MMQ_ENTRY(mmq_q4_1_t8, T_Q4_1, 8)
MMQ_ENTRY(mmq_q8_0_t1, T_Q8_0, 1)
MMQ_ENTRY(mmq_q8_0_t8, T_Q8_0, 8)

// Token embedding lookup from a quantized table (values as the CPU dequantizes them: d * q (- m)).
// ids: [n]; table: [vocab, hidden / 32] blocks; x: [n, hidden] f32
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

#define EMBED_ENTRY(NAME, TYPE)                                                                 \
    extern "C" __global__ void NAME(const int* __restrict__ ids, const unsigned char* __restrict__ table, \
                                    float* __restrict__ x, int hidden) {                        \
        const long t = blockIdx.x;                                                              \
        const int nb = hidden / 32;                                                             \
        const unsigned char* row = table + (long)ids[t] * nb * wblock<TYPE>::bytes;             \
        for (int i = threadIdx.x; i < hidden; i += blockDim.x)                                  \
            x[t * hidden + i] = dequant<TYPE>(row + (i / 32) * wblock<TYPE>::bytes, i % 32);    \
    }

EMBED_ENTRY(embed_q4_0, T_Q4_0)
EMBED_ENTRY(embed_q4_1, T_Q4_1)
EMBED_ENTRY(embed_q8_0, T_Q8_0)

// Whole-matrix dequantization to f16, for many-token matmuls through cuBLAS: one thread per value
// (the CPU's value, then rounded to f16); a warp covers one block.
// w: [elems / 32] stored blocks; out: [elems] f16
#define DEQUANT_ENTRY(NAME, TYPE)                                                               \
    extern "C" __global__ void NAME(const unsigned char* __restrict__ w, half_t* __restrict__ out, \
                                    long elems) {                                               \
        const long e = blockIdx.x * (long)blockDim.x + threadIdx.x;                             \
        if (e >= elems) return;                                                                 \
        out[e] = f2h(dequant<TYPE>(w + (e >> 5) * wblock<TYPE>::bytes, (int)(e & 31)));         \
    }

DEQUANT_ENTRY(dequant_q4_0, T_Q4_0)
DEQUANT_ENTRY(dequant_q4_1, T_Q4_1)
DEQUANT_ENTRY(dequant_q8_0, T_Q8_0)
