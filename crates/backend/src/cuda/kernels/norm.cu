// RMSNorm: the residual stream stays f32; the normed rows go out as f16 for the next GEMM.

// x: [rows, dim] f32 (row r read from x[rows_idx ? rows_idx[r] : r]); w: [dim]; out: [rows, dim] f16
extern "C" __global__ void rms_norm_f16(const float* __restrict__ x, const int* __restrict__ rows_idx,
                                        const float* __restrict__ w, half_t* __restrict__ out,
                                        int dim, float eps) {
    pdl_enter();
    __shared__ float red[32];
    const int r = blockIdx.x;
    const long src = rows_idx ? rows_idx[r] : r;
    const float* xr = x + src * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float scale = rsqrtf(ss / dim + eps);
    half_t* o = out + (long)r * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = f2h(xr[i] * scale * w[i]);
}

// The same into f32 rows (the MoE router's input, kept at full precision so that expert choices
// match the CPU's). out: [rows, dim] f32
extern "C" __global__ void rms_norm_f32(const float* __restrict__ x, const int* __restrict__ rows_idx,
                                        const float* __restrict__ w, float* __restrict__ out,
                                        int dim, float eps) {
    pdl_enter();
    __shared__ float red[32];
    const int r = blockIdx.x;
    const long src = rows_idx ? rows_idx[r] : r;
    const float* xr = x + src * dim;
    float ss = 0.0f;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) ss += xr[i] * xr[i];
    ss = block_sum(ss, red);
    const float scale = 1.0f / sqrtf(ss / dim + eps);
    float* o = out + (long)r * dim;
    for (int i = threadIdx.x; i < dim; i += blockDim.x) o[i] = xr[i] * scale * w[i];
}
