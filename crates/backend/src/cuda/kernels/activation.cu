// SwiGLU: silu(gate) * up, reading the stacked [gate | up] GEMM output, writing f16 for the down GEMM.

// gu: [n, 2 * inter] f32; out: [n, inter] f16
extern "C" __global__ void swiglu_f16(const float* __restrict__ gu, half_t* __restrict__ out,
                                      int inter, long total) {
    pdl_enter();
    for (long i = blockIdx.x * (long)blockDim.x + threadIdx.x; i < total;
         i += (long)gridDim.x * blockDim.x) {
        const long t = i / inter, j = i - t * inter;
        const float g = gu[t * 2 * inter + j], u = gu[t * 2 * inter + inter + j];
        out[i] = f2h(g / (1.0f + expf(-g)) * u);
    }
}
