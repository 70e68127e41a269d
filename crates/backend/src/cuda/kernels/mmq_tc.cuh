// Shared pieces of the int8 tensor-core matmuls (mmq_tc.cu's dense one, moe.cu's grouped expert
// one): the tile, the fragments, the unpacking of each stored type, and the tile loop itself,
// which takes the tile's token columns as a map so the same code serves contiguous tokens and
// (token, expert) pairs gathered by index.
//
// Why: the dp4a kernels (quant.cu) give each CTA 8 tokens, so at 64 tokens every weight is read
// from memory 8 times; a tensor-core CTA owns a 64-row × 64-token tile and reads its weights
// once per 64 tokens.
//
// Arithmetic: a 32-element weight block is unpacked to int8 codes (Q4_0: nibble − 8; Q6_K:
// code − 32; the others as stored) so one `mma.sync m16n8k32 s8` gives the exact integer dot of
// a (row, token) pair over one block — the dp4a kernels' `isum`. Each block's scale terms are
// then applied in f32 with the same expressions `block_dot` uses: d_w·d_a·isum, plus m_w·s_a for
// Q4_1 and the K-quants' −(dmin·m)·s_a. Q6_K's scales cover 16 elements, so its block takes two
// `m16n8k16` halves (the same fragments split) combined in integers as the dp4a path does. The
// results equal the dp4a kernels' up to the order of the f32 sums over blocks.
//
// Tile: 64 weight rows × 64 tokens, 8 warps (4 over rows × 2 over tokens; a warp owns 16 rows ×
// 32 tokens = four m16n8 results per block). 64 tokens covers the 64-sequence decode batch in
// one pass over the weights; 64 rows keeps the grid at ≥ 64 CTAs for 4096-row matrices. The
// K step is 8 blocks (256 elements, one K-quant super-block). Shared rows are 256 + 16 bytes
// (68 words): the fragment loads of a warp (8 rows × 4 words) then fall on 32 distinct banks,
// and every 16-byte row segment stays aligned.
//
// Fragment layouts (PTX ISA, "Matrix fragments for mma.m16n8k32", 8-bit types), with
// g = lane / 4, c = lane % 4: A (16 × 32, row-major): a0 = row g, bytes 4c..4c+3; a1 = row g + 8,
// same bytes; a2 = row g, bytes 16 + 4c..; a3 = row g + 8, bytes 16 + 4c... B (32 × 8, column
// = token): b0 = token g, bytes 4c..4c+3; b1 = token g, bytes 16 + 4c... C (16 × 8, s32):
// c0, c1 = row g, tokens 2c, 2c + 1; c2, c3 = row g + 8, same tokens. m16n8k16 takes {a0, a1}
// with b0 (bytes 0..15) and {a2, a3} with b1 (bytes 16..31).

#define TC_ROWS 64
#define TC_TOK 64
#define TC_KB 8
#define TC_STRIDE (TC_KB * 32 + 16)
#define TC_THREADS 256

struct tc_smem {
    signed char w[TC_ROWS][TC_STRIDE];  // unpacked weight codes of the stage
    signed char a[TC_TOK][TC_STRIDE];   // activation codes
    float wd[TC_KB][TC_ROWS];           // per (block, row): the factor of isum
    float wm[TC_KB][TC_ROWS];           // per (block, row): the factor of the activation sum s
    float ad[TC_KB][TC_TOK];            // activation d
    float as[TC_KB][TC_TOK];            // activation s
    signed char wsc[TC_ROWS][TC_KB][2]; // Q6_K: the two 16-element scales of each block
};

__device__ __forceinline__ void mma_k32(int c[4], const int a[4], const int b[2]) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, "
        "{%10,%11,%12,%13};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]), "r"(0), "r"(0),
          "r"(0), "r"(0));
#else
    __trap();  // the host launches these kernels on sm_80 and newer only
#endif
}

__device__ __forceinline__ void mma_k16(int c[4], int a0, int a1, int b) {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 800
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, "
        "{%7,%8,%9,%10};"
        : "=r"(c[0]), "=r"(c[1]), "=r"(c[2]), "=r"(c[3])
        : "r"(a0), "r"(a1), "r"(b), "r"(0), "r"(0), "r"(0), "r"(0));
#else
    __trap();
#endif
}

// Bytes of 0..15 minus 8, and of 0..63 minus 32, as int8 (no carry crosses a byte: the sums stay
// below 0x100).
__device__ __forceinline__ int sub8_x4(int v) { return (v + 0x78787878) ^ 0x80808080; }
__device__ __forceinline__ int sub32_x4(int v) { return (v + 0x60606060) ^ 0x80808080; }

// Unpacks block `sub` of stored block `wb` into 32 int8 codes `q` (as 8 ints) and its factors:
// the block's contribution is wd·d_a·isum + wm·s_a (Q6_K: isum = sc[0]·Σ₀..₁₅ + sc[1]·Σ₁₆..₃₁).
template <int TYPE>
__device__ __forceinline__ void tc_unpack(const unsigned char* wb, int sub, int q[8], float* wd,
                                          float* wm, signed char sc[2]);

template <>
__device__ __forceinline__ void tc_unpack<T_Q4_0>(const unsigned char* wb, int, int q[8],
                                                  float* wd, float* wm, signed char*) {
    const unsigned short* p = (const unsigned short*)wb;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int v = load_int_b2(p + 1 + 2 * j);
        q[j] = sub8_x4(v & 0x0F0F0F0F);
        q[j + 4] = sub8_x4((v >> 4) & 0x0F0F0F0F);
    }
    *wd = h2f(p[0]);
    *wm = 0.0f;
}

template <>
__device__ __forceinline__ void tc_unpack<T_Q4_1>(const unsigned char* wb, int, int q[8],
                                                  float* wd, float* wm, signed char*) {
    const int* p = (const int*)wb;
#pragma unroll
    for (int j = 0; j < 4; j++) {
        const int v = p[1 + j];
        q[j] = v & 0x0F0F0F0F;
        q[j + 4] = (v >> 4) & 0x0F0F0F0F;
    }
    const unsigned dm = (unsigned)p[0];
    *wd = h2f((half_t)(dm & 0xFFFF));
    *wm = h2f((half_t)(dm >> 16));
}

template <>
__device__ __forceinline__ void tc_unpack<T_Q8_0>(const unsigned char* wb, int, int q[8],
                                                  float* wd, float* wm, signed char*) {
    const unsigned short* p = (const unsigned short*)wb;
#pragma unroll
    for (int j = 0; j < 8; j++) q[j] = load_int_b2(p + 1 + 2 * j);
    *wd = h2f(p[0]);
    *wm = 0.0f;
}

// Q4_K/Q5_K factors: d·sc and −dmin·m (the dp4a path's `affine_k`, its subtraction as the
// addition of the negated product: the same f32 result).
__device__ __forceinline__ void tc_affine_k(const unsigned char* wb, int j, float* wd, float* wm) {
    const half_t* dm = (const half_t*)wb;
    int sc, m;
    scale_min_k4(j, wb + 4, &sc, &m);
    *wd = __fmul_rn(h2f(dm[0]), (float)sc);
    *wm = -__fmul_rn(h2f(dm[1]), (float)m);
}

// Super-blocks of 144 and 176 bytes keep 16-byte alignment (rows start at multiples of them on
// a 16-byte aligned matrix, which the host checks), so the codes come in 16-byte loads.
template <>
__device__ __forceinline__ void tc_unpack<T_Q4_K>(const unsigned char* wb, int j, int q[8],
                                                  float* wd, float* wm, signed char*) {
    const int4* qs = (const int4*)(wb + 16 + 32 * (j >> 1));
    const int shift = 4 * (j & 1);
    const int4 x0 = qs[0], x1 = qs[1];
    const int v[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int i = 0; i < 8; i++) q[i] = (v[i] >> shift) & 0x0F0F0F0F;
    tc_affine_k(wb, j, wd, wm);
}

template <>
__device__ __forceinline__ void tc_unpack<T_Q5_K>(const unsigned char* wb, int j, int q[8],
                                                  float* wd, float* wm, signed char*) {
    const int4* qh4 = (const int4*)(wb + 16);
    const int4* qs4 = (const int4*)(wb + 48 + 32 * (j >> 1));
    const int shift = 4 * (j & 1);
    const int4 h0 = qh4[0], h1 = qh4[1], x0 = qs4[0], x1 = qs4[1];
    const int h[8] = {h0.x, h0.y, h0.z, h0.w, h1.x, h1.y, h1.z, h1.w};
    const int v[8] = {x0.x, x0.y, x0.z, x0.w, x1.x, x1.y, x1.z, x1.w};
#pragma unroll
    for (int i = 0; i < 8; i++)
        q[i] = ((v[i] >> shift) & 0x0F0F0F0F) | (((h[i] >> j) & 0x01010101) << 4);
    tc_affine_k(wb, j, wd, wm);
}

template <>
__device__ __forceinline__ void tc_unpack<T_Q6_K>(const unsigned char* wb, int j, int q[8],
                                                  float* wd, float* wm, signed char* sc) {
    const int h = j >> 2, k = j & 3;
    const unsigned short* ql = (const unsigned short*)(wb + 64 * h + 32 * (k & 1));
    const unsigned short* qh = (const unsigned short*)(wb + 128 + 32 * h);
    const int lshift = k < 2 ? 0 : 4;
#pragma unroll
    for (int i = 0; i < 8; i++) {
        const int lo = (load_int_b2(ql + 2 * i) >> lshift) & 0x0F0F0F0F;
        const int hi = ((load_int_b2(qh + 2 * i) >> (2 * k)) & 0x03030303) << 4;
        q[i] = sub32_x4(lo | hi);
    }
    const signed char* s = (const signed char*)(wb + 192);
    sc[0] = s[2 * j];
    sc[1] = s[2 * j + 1];
    *wd = h2f(*(const half_t*)(wb + 208));
    *wm = 0.0f;
}


// The token columns of a tile: `act(t)` is the activation row of column t (0..TC_TOK) and `out(t)`
// the output row, both −1 past the tile's tokens.
// Contiguous tokens t0..n (the dense matmul).
struct tc_dense_map {
    int t0, n;
    __device__ __forceinline__ int act(int t) const { return t0 + t < n ? t0 + t : -1; }
    __device__ __forceinline__ int out(int t) const { return act(t); }
};

// Stages blocks [c·8, c·8 + kbs) of the CTA's weight rows and tokens into shared memory. Each
// thread takes (row, block) pairs with the block fastest, so neighbouring threads read
// neighbouring blocks of a row. Rows and tokens past the matrix get zero codes and factors.
template <int TYPE, class MAP>
__device__ __forceinline__ void tc_stage(tc_smem& s, const unsigned char* __restrict__ w,
                                         const q8a_t* __restrict__ a, int rows, int nb,
                                         long row_bytes, int r0, const MAP& map, int c, int kbs) {
#pragma unroll
    for (int p = 0; p < TC_ROWS * TC_KB / TC_THREADS; p++) {
        const int idx = threadIdx.x + p * TC_THREADS;
        const int r = idx / TC_KB, kb = idx % TC_KB;
        if (kb >= kbs) continue;
        int q[8] = {0, 0, 0, 0, 0, 0, 0, 0};
        float wd = 0.0f, wm = 0.0f;
        signed char sc[2] = {0, 0};
        if (r0 + r < rows) {
            int sub;
            const unsigned char* wb =
                block_of<TYPE>(w + (long)(r0 + r) * row_bytes, c * TC_KB + kb, &sub);
            tc_unpack<TYPE>(wb, sub, q, &wd, &wm, sc);
        }
        int4* dst = (int4*)&s.w[r][kb * 32];
        dst[0] = make_int4(q[0], q[1], q[2], q[3]);
        dst[1] = make_int4(q[4], q[5], q[6], q[7]);
        s.wd[kb][r] = wd;
        s.wm[kb][r] = wm;
        s.wsc[r][kb][0] = sc[0];
        s.wsc[r][kb][1] = sc[1];
    }
#pragma unroll
    for (int p = 0; p < TC_TOK * TC_KB / TC_THREADS; p++) {
        const int idx = threadIdx.x + p * TC_THREADS;
        const int t = idx / TC_KB, kb = idx % TC_KB;
        if (kb >= kbs) continue;
        int4* dst = (int4*)&s.a[t][kb * 32];
        const int ar = map.act(t);
        if (ar >= 0) {
            // q8a_t is 4-byte aligned (40-byte blocks): word loads.
            const q8a_t* ab = a + (long)ar * nb + c * TC_KB + kb;
            dst[0] = make_int4(ab->qs[0], ab->qs[1], ab->qs[2], ab->qs[3]);
            dst[1] = make_int4(ab->qs[4], ab->qs[5], ab->qs[6], ab->qs[7]);
            s.ad[kb][t] = ab->d;
            s.as[kb][t] = ab->s;
        } else {
            dst[0] = make_int4(0, 0, 0, 0);
            dst[1] = make_int4(0, 0, 0, 0);
            s.ad[kb][t] = 0.0f;
            s.as[kb][t] = 0.0f;
        }
    }
}

// One CTA's tile: y[out(t), r] = Σ_b dot(w[r, b], a[act(t), b]) + beta · y[out(t), r] for the
// rows r0..r0 + 64 and the map's 64 token columns.
// w: [rows, nb · 32 / elems] stored blocks; a: [*, nb] q8 blocks; y: [*, rows] f32. 256 threads.
template <int TYPE, class MAP>
__device__ __forceinline__ void tc_tile(const unsigned char* __restrict__ w,
                                        const q8a_t* __restrict__ a, float* __restrict__ y,
                                        int rows, int nb, int r0, float beta, const MAP& map) {
    __shared__ __align__(16) tc_smem s;
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int g = lane >> 2, tc = lane & 3;
    const int wr = (warp & 3) * 16;   // the warp's first row in the tile
    const int wt = (warp >> 2) * 32;  // and first token
    const long row_bytes = (long)(nb / (wblock<TYPE>::elems / 32)) * wblock<TYPE>::bytes;
    // acc[j][i]: token tile j (8 tokens), C fragment element i.
    float acc[4][4];
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) acc[j][i] = 0.0f;

    const int chunks = (nb + TC_KB - 1) / TC_KB;
    for (int c = 0; c < chunks; c++) {
        const int kbs = min(TC_KB, nb - c * TC_KB);
        tc_stage<TYPE>(s, w, a, rows, nb, row_bytes, r0, map, c, kbs);
        __syncthreads();
        for (int kb = 0; kb < kbs; kb++) {
            const signed char* wa = &s.w[wr + g][kb * 32 + 4 * tc];
            const signed char* wb8 = &s.w[wr + g + 8][kb * 32 + 4 * tc];
            const int af[4] = {*(const int*)wa, *(const int*)wb8, *(const int*)(wa + 16),
                               *(const int*)(wb8 + 16)};
            const float wd0 = s.wd[kb][wr + g], wd1 = s.wd[kb][wr + g + 8];
            const float wm0 = s.wm[kb][wr + g], wm1 = s.wm[kb][wr + g + 8];
#pragma unroll
            for (int j = 0; j < 4; j++) {
                const signed char* ap = &s.a[wt + 8 * j + g][kb * 32 + 4 * tc];
                const int bf[2] = {*(const int*)ap, *(const int*)(ap + 16)};
                int ci[4];
                if (TYPE == T_Q6_K) {
                    int lo[4], hi[4];
                    mma_k16(lo, af[0], af[1], bf[0]);
                    mma_k16(hi, af[2], af[3], bf[1]);
                    const int sa0 = s.wsc[wr + g][kb][0], sb0 = s.wsc[wr + g][kb][1];
                    const int sa1 = s.wsc[wr + g + 8][kb][0], sb1 = s.wsc[wr + g + 8][kb][1];
                    ci[0] = sa0 * lo[0] + sb0 * hi[0];
                    ci[1] = sa0 * lo[1] + sb0 * hi[1];
                    ci[2] = sa1 * lo[2] + sb1 * hi[2];
                    ci[3] = sa1 * lo[3] + sb1 * hi[3];
                } else {
                    mma_k32(ci, af, bf);
                }
                const int ta = wt + 8 * j + 2 * tc;
                const float da[2] = {s.ad[kb][ta], s.ad[kb][ta + 1]};
                const float sa[2] = {s.as[kb][ta], s.as[kb][ta + 1]};
#pragma unroll
                for (int i = 0; i < 4; i++) {
                    const float wd = i < 2 ? wd0 : wd1, wm = i < 2 ? wm0 : wm1;
                    float v = __fmul_rn(__fmul_rn(wd, da[i & 1]), (float)ci[i]);
                    if (TYPE == T_Q4_1 || TYPE == T_Q4_K || TYPE == T_Q5_K)
                        v = __fadd_rn(v, __fmul_rn(wm, sa[i & 1]));
                    acc[j][i] += v;
                }
            }
        }
        __syncthreads();
    }
#pragma unroll
    for (int j = 0; j < 4; j++)
#pragma unroll
        for (int i = 0; i < 4; i++) {
            const int r = r0 + wr + g + (i < 2 ? 0 : 8);
            const int o = map.out(wt + 8 * j + 2 * tc + (i & 1));
            if (r < rows && o >= 0) {
                float* p = y + (long)o * rows + r;
                *p = beta != 0.0f ? acc[j][i] + beta * *p : acc[j][i];
            }
        }
}
