// Per-head work between the QKV GEMM and attention: QKV bias (Qwen2), QK-norm (Qwen3) and RoPE,
// in place on the f32 QKV rows. Angles come from a (cos, sin) table built on the host at load time
// with the CPU backend's own routine, so both backends rotate by identical values.

// qkv: [n, qkv_stride] = [q heads | k heads | v heads]; bias: [qkv_stride] or null;
// q_norm, k_norm: [head_dim] or null; cs: [max_pos, pairs] (cos, sin); positions: [n]
// grid: (n, num_heads + 2 * num_kv_heads); block: 128
extern "C" __global__ void rope_qkv(float* __restrict__ qkv, const float* __restrict__ bias,
                                    const float* __restrict__ q_norm, const float* __restrict__ k_norm,
                                    const float2* __restrict__ cs, const int* __restrict__ positions,
                                    int qkv_stride, int num_heads, int num_kv_heads, int head_dim,
                                    int pairs, int neox, float eps) {
    pdl_enter();
    __shared__ float red[32];
    __shared__ float buf[512];
    const int t = blockIdx.x, h = blockIdx.y;
    const int off = h * head_dim;
    float* x = qkv + (long)t * qkv_stride + off;
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) {
        float v = x[i];
        if (bias) v += bias[off + i];
        buf[i] = v;
    }
    __syncthreads();
    const bool is_q = h < num_heads, is_k = !is_q && h < num_heads + num_kv_heads;
    const float* nw = is_q ? q_norm : (is_k ? k_norm : nullptr);
    if (nw) {
        float ss = 0.0f;
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) ss += buf[i] * buf[i];
        ss = block_sum(ss, red);
        const float scale = rsqrtf(ss / head_dim + eps);
        for (int i = threadIdx.x; i < head_dim; i += blockDim.x) buf[i] = buf[i] * (scale * nw[i]);
        __syncthreads();
    }
    if (is_q || is_k) {
        const float2* c = cs + (long)positions[t] * pairs;
        for (int i = threadIdx.x; i < pairs; i += blockDim.x) {
            const int a = neox ? i : 2 * i, b = neox ? i + pairs : 2 * i + 1;
            const float x0 = buf[a], x1 = buf[b], co = c[i].x, si = c[i].y;
            buf[a] = fmaf(x0, co, -(x1 * si));
            buf[b] = fmaf(x0, si, x1 * co);
        }
        __syncthreads();
    }
    for (int i = threadIdx.x; i < head_dim; i += blockDim.x) x[i] = buf[i];
}
