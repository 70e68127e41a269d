// Quantized weights times 8-bit activations on the int8 tensor cores, for many tokens (batched
// decode, prompt chunks): a CTA owns a 64-row × 64-token tile (mmq_tc.cuh has the tile, its
// arithmetic and why) over contiguous tokens.

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
