// Quantized weights times 8-bit activations on the int8 tensor cores, for many tokens (batched
// decode, prompt chunks), in two forms: `mmq_*_tc`, a CTA owning a 64-row × 64-token tile
// (mmq_tc.cuh has the tile, its arithmetic and why) over contiguous tokens, and below it
// `mmq_*_tcp*`, the pipelined split-K form the host prefers where weights and activations are
// 16-byte aligned (why and how: its own header further down).

// y[t, r] = Σ_b dot(w[r, b], a[t, b]) + beta · y[t, r].
// w: [rows, nb · 32 / elems] stored blocks; a: [n, nb] q8 blocks; y: [n, rows] f32.
// grid (⌈rows / 64⌉, ⌈n / 64⌉), 256 threads.
#define MMQ_TC_ENTRY(NAME, TYPE)                                                                \
    extern "C" __global__ void __launch_bounds__(TC_THREADS)                                    \
        NAME(const unsigned char* __restrict__ w, const q8a_t* __restrict__ a,                  \
             float* __restrict__ y, int rows, int nb, int n, float beta) {                      \
        pdl_enter();                                                                            \
        const tc_dense_map map = {(int)blockIdx.y * TC_TOK, n};                                 \
        tc_tile<TYPE>(w, a, y, rows, nb, (int)blockIdx.x * TC_ROWS, beta, map);                 \
    }

MMQ_TC_ENTRY(mmq_q4_0_tc, T_Q4_0)
MMQ_TC_ENTRY(mmq_q4_1_tc, T_Q4_1)
MMQ_TC_ENTRY(mmq_q8_0_tc, T_Q8_0)
MMQ_TC_ENTRY(mmq_q4_k_tc, T_Q4_K)
MMQ_TC_ENTRY(mmq_q5_k_tc, T_Q5_K)
MMQ_TC_ENTRY(mmq_q6_k_tc, T_Q6_K)

// ---------------------------------------------------------------------------------------------
// The pipelined form (`mmq_*_tcp<NT>`), for 16–255 tokens: batched decode's shapes.
//
// Why: the 64 × 64 tile above leaves a 4096-row matrix at 64 CTAs on 132 SMs and waits for each
// K step's global loads before its mma, so it runs at ~150 GB/s whatever the token count. Here:
// - the K range is split over gridDim.z CTAs (split-K) until the grid fills the machine; each
//   split's partial tile goes to a scratch buffer and the CTA that finishes a tile last (an
//   integer counter: no float atomics) sums the partials in split order 0, 1, 2, …, so the
//   result does not depend on which CTA came last: bit-for-bit the same every run;
// - the stored bytes of each row's K step are copied raw into shared memory with 16-byte
//   `cp.async` from the 16-byte window around them (any block alignment: Q4_0/Q8_0/Q6_K blocks
//   are 2-byte aligned), STAGES steps in flight while the current one is multiplied;
// - the int8 A fragments are unpacked straight from the raw bytes in shared memory (lane c of a
//   row takes code words c and c + 4, the bytes `m16n8k32` wants), so no unpacked copy and one
//   barrier per K step; the activation blocks are read in place for the B fragments;
// - the token tile NT (8, 16, 32, 64) is picked by the host to fit the batch.
// Per block the arithmetic is the 64 × 64 kernel's (mmq_tc.cuh): exact integer dot, then the same
// f32 expressions; only the order of the sums over blocks differs (per split, then split order).
//
// CTA: 4 warps, 64 rows (a warp owns 16 rows × all NT tokens), 128 threads. Shared memory
// (dynamic): STAGES × (64 rows × TCP_WSTR<TYPE> + NT tokens × TCP_ASTR) bytes.
// Row strides are 16 mod 32 bytes (4 mod 8 words): the 8 rows × 4 words a warp reads per
// fragment fall on 32 distinct banks.

#define TCP_ROWS 64
#define TCP_THREADS 128
// Activation stage row: 8 q8a blocks (320 bytes) plus the 8-byte misalignment of odd rows,
// rounded to 16-byte units (21) — 84 words, 20 mod 32: conflict-free B fragment loads.
#define TCP_AUNITS 21
#define TCP_ASTR (TCP_AUNITS * 16)

// Stored bytes of one K step (8 blocks of 32) of a row.
template <int TYPE> struct tcp_geom {
    static const int per = wblock<TYPE>::elems / 32;  // 32-blocks per stored block
    static const int step_bytes = TC_KB / per * wblock<TYPE>::bytes;
    // 16-byte units covering the step from any 2-byte aligned start.
    static const int units = (step_bytes + 15 + 15) / 16;
    static const int wstr = (units & 1) ? units * 16 : units * 16 + 16;
};

template <int NT> struct tcp_stages { static const int n = NT <= 32 ? 4 : 3; };

__device__ __forceinline__ void tcp_cp16(unsigned char* dst, const unsigned char* src,
                                         const unsigned char* end) {
    if (src + 16 <= end) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
        const unsigned s = (unsigned)__cvta_generic_to_shared(dst);
        asm volatile("cp.async.cg.shared.global [%0], [%1], 16;" ::"r"(s), "l"(src) : "memory");
#else
        *(int4*)dst = *(const int4*)src;
#endif
    } else {
        // The unit that crosses the end of the buffer: byte loads of what is inside it.
        for (int b = 0; b < 16; b++) dst[b] = src + b < end ? src[b] : 0;
    }
}

__device__ __forceinline__ void tcp_commit() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.commit_group;" ::: "memory");
#endif
}

template <int N> __device__ __forceinline__ void tcp_wait() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile("cp.async.wait_group %0;" ::"n"(N) : "memory");
#endif
}

// Byte offset of K step c's first stored block in a row, and the step's stored length.
template <int TYPE>
__device__ __forceinline__ void tcp_span(int c, int nb, long* start, int* len) {
    const int per = tcp_geom<TYPE>::per;
    const int kbs = min(TC_KB, nb - c * TC_KB);
    const int first = c * TC_KB / per;
    *start = (long)first * wblock<TYPE>::bytes;
    *len = ((c * TC_KB + kbs + per - 1) / per - first) * wblock<TYPE>::bytes;
}

// Issues the copies of K step c into stage buffers sw (weights) and sa (activations).
template <int TYPE, int NT>
__device__ __forceinline__ void tcp_load(unsigned char* sw, unsigned char* sa,
                                         const unsigned char* __restrict__ w,
                                         const unsigned char* __restrict__ a, int rows, int nb,
                                         int n, long row_bytes, int r0, int t0, int c) {
    const int UW = tcp_geom<TYPE>::units, WSTR = tcp_geom<TYPE>::wstr;
    long start;
    int len;
    tcp_span<TYPE>(c, nb, &start, &len);
    const unsigned char* w_end = w + (long)rows * row_bytes;
    for (int idx = threadIdx.x; idx < TCP_ROWS * UW; idx += TCP_THREADS) {
        const int r = idx / UW, u = idx - r * UW;
        if (r0 + r >= rows) continue;
        const unsigned char* src = w + (long)(r0 + r) * row_bytes + start;
        const int off = (int)((unsigned long)src & 15);
        if (u * 16 >= off + len) continue;
        tcp_cp16(sw + r * WSTR + u * 16, src - off + u * 16, w_end);
    }
    const int kbs = min(TC_KB, nb - c * TC_KB);
    const int alen = kbs * (int)sizeof(q8a_t);
    const unsigned char* a_end = a + (long)n * nb * sizeof(q8a_t);
    for (int idx = threadIdx.x; idx < NT * TCP_AUNITS; idx += TCP_THREADS) {
        const int t = idx / TCP_AUNITS, u = idx - t * TCP_AUNITS;
        if (t0 + t >= n) continue;
        const unsigned char* src = a + ((long)(t0 + t) * nb + c * TC_KB) * sizeof(q8a_t);
        const int off = (int)((unsigned long)src & 15);
        if (u * 16 >= off + alen) continue;
        tcp_cp16(sa + t * TCP_ASTR + u * 16, src - off + u * 16, a_end);
    }
}

// Lane c's two A-fragment words of block `sub` of stored block `wb` (code bytes 4c..4c+3 into
// *x0, 16+4c..16+4c+3 into *x1, the words c and c + 4 of tc_unpack's q[8]) and the block's
// factors, as tc_unpack gives them.
template <int TYPE>
__device__ __forceinline__ void tcp_frag(const unsigned char* wb, int sub, int c, int* x0, int* x1,
                                         float* wd, float* wm, signed char sc[2]);

template <>
__device__ __forceinline__ void tcp_frag<T_Q4_0>(const unsigned char* wb, int, int c, int* x0,
                                                 int* x1, float* wd, float* wm, signed char*) {
    const unsigned short* p = (const unsigned short*)wb;
    const int v = load_int_b2(p + 1 + 2 * c);
    *x0 = sub8_x4(v & 0x0F0F0F0F);
    *x1 = sub8_x4((v >> 4) & 0x0F0F0F0F);
    *wd = h2f(p[0]);
    *wm = 0.0f;
}

template <>
__device__ __forceinline__ void tcp_frag<T_Q4_1>(const unsigned char* wb, int, int c, int* x0,
                                                 int* x1, float* wd, float* wm, signed char*) {
    const int* p = (const int*)wb;
    const int v = p[1 + c];
    *x0 = v & 0x0F0F0F0F;
    *x1 = (v >> 4) & 0x0F0F0F0F;
    const unsigned dm = (unsigned)p[0];
    *wd = h2f((half_t)(dm & 0xFFFF));
    *wm = h2f((half_t)(dm >> 16));
}

template <>
__device__ __forceinline__ void tcp_frag<T_Q8_0>(const unsigned char* wb, int, int c, int* x0,
                                                 int* x1, float* wd, float* wm, signed char*) {
    const unsigned short* p = (const unsigned short*)wb;
    *x0 = load_int_b2(p + 1 + 2 * c);
    *x1 = load_int_b2(p + 1 + 2 * (c + 4));
    *wd = h2f(p[0]);
    *wm = 0.0f;
}

template <>
__device__ __forceinline__ void tcp_frag<T_Q4_K>(const unsigned char* wb, int j, int c, int* x0,
                                                 int* x1, float* wd, float* wm, signed char*) {
    const int* qs = (const int*)(wb + 16 + 32 * (j >> 1));
    const int shift = 4 * (j & 1);
    *x0 = (qs[c] >> shift) & 0x0F0F0F0F;
    *x1 = (qs[c + 4] >> shift) & 0x0F0F0F0F;
    tc_affine_k(wb, j, wd, wm);
}

template <>
__device__ __forceinline__ void tcp_frag<T_Q5_K>(const unsigned char* wb, int j, int c, int* x0,
                                                 int* x1, float* wd, float* wm, signed char*) {
    const int* qh = (const int*)(wb + 16);
    const int* qs = (const int*)(wb + 48 + 32 * (j >> 1));
    const int shift = 4 * (j & 1);
    *x0 = ((qs[c] >> shift) & 0x0F0F0F0F) | (((qh[c] >> j) & 0x01010101) << 4);
    *x1 = ((qs[c + 4] >> shift) & 0x0F0F0F0F) | (((qh[c + 4] >> j) & 0x01010101) << 4);
    tc_affine_k(wb, j, wd, wm);
}

template <>
__device__ __forceinline__ void tcp_frag<T_Q6_K>(const unsigned char* wb, int j, int c, int* x0,
                                                 int* x1, float* wd, float* wm, signed char* sc) {
    const int h = j >> 2, k = j & 3;
    const unsigned short* ql = (const unsigned short*)(wb + 64 * h + 32 * (k & 1));
    const unsigned short* qh = (const unsigned short*)(wb + 128 + 32 * h);
    const int lshift = k < 2 ? 0 : 4;
    int q[2];
#pragma unroll
    for (int e = 0; e < 2; e++) {
        const int i = c + 4 * e;
        const int lo = (load_int_b2(ql + 2 * i) >> lshift) & 0x0F0F0F0F;
        const int hi = ((load_int_b2(qh + 2 * i) >> (2 * k)) & 0x03030303) << 4;
        q[e] = sub32_x4(lo | hi);
    }
    *x0 = q[0];
    *x1 = q[1];
    const signed char* s = (const signed char*)(wb + 192);
    sc[0] = s[2 * j];
    sc[1] = s[2 * j + 1];
    *wd = h2f(*(const half_t*)(wb + 208));
    *wm = 0.0f;
}

// Multiplies K step c, staged in sw / sa, into acc[NT / 8][4] (the warp's 16 rows × NT tokens).
template <int TYPE, int NT>
__device__ __forceinline__ void tcp_step(const unsigned char* sw, const unsigned char* sa,
                                         float acc[NT / 8][4], int nb, long row_bytes, int r0,
                                         int t0, int c) {
    const int WSTR = tcp_geom<TYPE>::wstr;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, cq = lane & 3;
    const int wr = warp * 16;
    long start;
    int len;
    tcp_span<TYPE>(c, nb, &start, &len);
    // The window offsets of the lane's two rows (w is 16-byte aligned: the host checks).
    const int off0 = (int)(((long)(r0 + wr + g) * row_bytes + start) & 15);
    const int off1 = (int)(((long)(r0 + wr + g + 8) * row_bytes + start) & 15);
    const unsigned char* row0 = sw + (wr + g) * WSTR + off0;
    const unsigned char* row1 = sw + (wr + g + 8) * WSTR + off1;
    // Activation rows start 8 bytes into their window when (token · nb) is odd (40-byte blocks
    // on a 16-byte aligned buffer; the step's own offset, 320 · c bytes, is a multiple of 16).
    // t0 is even (a multiple of NT), so the parity is the lane's: g for the B fragment's token
    // 8j + g, 0 and 1 for the scale tokens 8j + 2cq and 8j + 2cq + 1.
    const int nbo = nb & 1;
    const unsigned char* bbase = sa + g * TCP_ASTR + (g & nbo) * 8 + 8 + 4 * cq;
    const unsigned char* dbase0 = sa + 2 * cq * TCP_ASTR;
    const unsigned char* dbase1 = sa + (2 * cq + 1) * TCP_ASTR + nbo * 8;
    const int kbs = min(TC_KB, nb - c * TC_KB);
#pragma unroll 2
    for (int kb = 0; kb < kbs; kb++) {
        int sub;
        const unsigned char* b0 = block_of<TYPE>(row0, kb, &sub);
        const unsigned char* b1 = block_of<TYPE>(row1, kb, &sub);
        int af[4];
        float wd0, wm0, wd1, wm1;
        signed char sc0[2] = {0, 0}, sc1[2] = {0, 0};
        tcp_frag<TYPE>(b0, sub, cq, &af[0], &af[2], &wd0, &wm0, sc0);
        tcp_frag<TYPE>(b1, sub, cq, &af[1], &af[3], &wd1, &wm1, sc1);
        const int ko = kb * (int)sizeof(q8a_t);
#pragma unroll
        for (int j = 0; j < NT / 8; j++) {
            const unsigned char* ap = bbase + 8 * j * TCP_ASTR + ko;
            const int bf[2] = {*(const int*)ap, *(const int*)(ap + 16)};
            int ci[4];
            if (TYPE == T_Q6_K) {
                int lo[4], hi[4];
                mma_k16(lo, af[0], af[1], bf[0]);
                mma_k16(hi, af[2], af[3], bf[1]);
                ci[0] = sc0[0] * lo[0] + sc0[1] * hi[0];
                ci[1] = sc0[0] * lo[1] + sc0[1] * hi[1];
                ci[2] = sc1[0] * lo[2] + sc1[1] * hi[2];
                ci[3] = sc1[0] * lo[3] + sc1[1] * hi[3];
            } else {
                mma_k32(ci, af, bf);
            }
            const float* q0 = (const float*)(dbase0 + 8 * j * TCP_ASTR + ko);
            const float* q1 = (const float*)(dbase1 + 8 * j * TCP_ASTR + ko);
            const float da[2] = {q0[0], q1[0]};
            const float sa2[2] = {q0[1], q1[1]};
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const float wd = i < 2 ? wd0 : wd1, wm = i < 2 ? wm0 : wm1;
                float v = __fmul_rn(__fmul_rn(wd, da[i & 1]), (float)ci[i]);
                if (TYPE == T_Q4_1 || TYPE == T_Q4_K || TYPE == T_Q5_K)
                    v = __fadd_rn(v, __fmul_rn(wm, sa2[i & 1]));
                acc[j][i] += v;
            }
        }
    }
}

// y[t, r] = Σ_b dot(w[r, b], a[t, b]) + beta · y[t, r] for rows blockIdx.x · 64.., tokens
// blockIdx.y · NT.., K steps [z · steps_per, (z + 1) · steps_per) with z = blockIdx.z.
// When gridDim.z > 1: part holds gridDim.x · gridDim.y · gridDim.z slots of 64 · NT floats and
// cnt one zeroed counter per (x, y) tile (the last CTA of a tile sets it back to 0).
template <int TYPE, int NT>
__device__ __forceinline__ void tcp_tile(const unsigned char* __restrict__ w,
                                         const unsigned char* __restrict__ a, float* __restrict__ y,
                                         int rows, int nb, int n, float beta, int steps_per,
                                         float* __restrict__ part, unsigned* __restrict__ cnt) {
    const int S = tcp_stages<NT>::n;
    const int STAGE = TCP_ROWS * tcp_geom<TYPE>::wstr + NT * TCP_ASTR;
    extern __shared__ __align__(16) unsigned char tcp_smem[];
    const int r0 = (int)blockIdx.x * TCP_ROWS, t0 = (int)blockIdx.y * NT;
    const long row_bytes = (long)(nb / tcp_geom<TYPE>::per) * wblock<TYPE>::bytes;
    const int steps = (nb + TC_KB - 1) / TC_KB;
    const int c0 = (int)blockIdx.z * steps_per;
    const int nc = max(0, min(steps, c0 + steps_per) - c0);
    float acc[NT / 8][4];
#pragma unroll
    for (int j = 0; j < NT / 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.0f;

#pragma unroll
    for (int s = 0; s < S - 1; s++) {
        if (s < nc) {
            unsigned char* sw = tcp_smem + s * STAGE;
            tcp_load<TYPE, NT>(sw, sw + TCP_ROWS * tcp_geom<TYPE>::wstr, w, a, rows, nb, n,
                               row_bytes, r0, t0, c0 + s);
        }
        tcp_commit();
    }
    for (int i = 0; i < nc; i++) {
        tcp_wait<S - 2>();  // step i's group is complete (S − 2 newer ones may be in flight)
        __syncthreads();    // … for every thread, and step i − 1's buffer is free again
        if (i + S - 1 < nc) {
            unsigned char* sw = tcp_smem + ((i + S - 1) % S) * STAGE;
            tcp_load<TYPE, NT>(sw, sw + TCP_ROWS * tcp_geom<TYPE>::wstr, w, a, rows, nb, n,
                               row_bytes, r0, t0, c0 + i + S - 1);
        }
        tcp_commit();
        const unsigned char* sw = tcp_smem + (i % S) * STAGE;
        tcp_step<TYPE, NT>(sw, sw + TCP_ROWS * tcp_geom<TYPE>::wstr, acc, nb, row_bytes, r0, t0,
                           c0 + i);
    }
    tcp_wait<0>();

    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, cq = lane & 3;
    if (gridDim.z > 1) {
        const long tile = (long)blockIdx.x + (long)gridDim.x * blockIdx.y;
        float* mine = part + (tile * gridDim.z + blockIdx.z) * (TCP_ROWS * NT);
#pragma unroll
        for (int j = 0; j < NT / 8; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) __stcg(mine + (j * 4 + i) * TCP_THREADS + threadIdx.x, acc[j][i]);
        __threadfence();
        __syncthreads();
        __shared__ int last;
        if (threadIdx.x == 0) last = atomicAdd(cnt + tile, 1u) == gridDim.z - 1;
        __syncthreads();
        if (!last) return;
        __threadfence();
        const float* first = part + tile * gridDim.z * (TCP_ROWS * NT);
#pragma unroll
        for (int j = 0; j < NT / 8; j++)
#pragma unroll
            for (int i = 0; i < 4; i++) {
                const int e = (j * 4 + i) * TCP_THREADS + threadIdx.x;
                float v = __ldcg(first + e);
                for (int z = 1; z < (int)gridDim.z; z++) v += __ldcg(first + z * (TCP_ROWS * NT) + e);
                acc[j][i] = v;
            }
        if (threadIdx.x == 0) cnt[tile] = 0;
    }
#pragma unroll
    for (int j = 0; j < NT / 8; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + warp * 16 + g + (i < 2 ? 0 : 8);
            const int t = t0 + 8 * j + 2 * cq + (i & 1);
            if (r < rows && t < n) {
                float* p = y + (long)t * rows + r;
                *p = beta != 0.0f ? acc[j][i] + beta * *p : acc[j][i];
            }
        }
}

#define MMQ_TCP_ENTRY(NAME, TYPE, NT)                                                           \
    extern "C" __global__ void __launch_bounds__(TCP_THREADS)                                   \
        NAME(const unsigned char* __restrict__ w, const unsigned char* __restrict__ a,          \
             float* __restrict__ y, int rows, int nb, int n, float beta, int steps_per,         \
             float* __restrict__ part, unsigned* __restrict__ cnt) {                            \
        pdl_enter();                                                                            \
        tcp_tile<TYPE, NT>(w, a, y, rows, nb, n, beta, steps_per, part, cnt);                   \
    }

#define MMQ_TCP_TYPE(T, TYPE)                                                                   \
    MMQ_TCP_ENTRY(mmq_##T##_tcp8, TYPE, 8)                                                      \
    MMQ_TCP_ENTRY(mmq_##T##_tcp16, TYPE, 16)                                                    \
    MMQ_TCP_ENTRY(mmq_##T##_tcp32, TYPE, 32)                                                    \
    MMQ_TCP_ENTRY(mmq_##T##_tcp64, TYPE, 64)

MMQ_TCP_TYPE(q4_0, T_Q4_0)
MMQ_TCP_TYPE(q4_1, T_Q4_1)
MMQ_TCP_TYPE(q8_0, T_Q8_0)
MMQ_TCP_TYPE(q4_k, T_Q4_K)
MMQ_TCP_TYPE(q5_k, T_Q5_K)
MMQ_TCP_TYPE(q6_k, T_Q6_K)
