// Token embedding lookup: a gather of f16 rows into the f32 residual stream.
//
// The first kernel of a decode step, so its latency is the step's: each thread issues all of its
// 16-byte row chunks (up to EMB_PER) before storing any, so a row costs one memory round trip
// after the token id's instead of one per strided pass.
#define EMB_PER 4

// ids: [n]; table: [vocab, hidden] f16; x: [n, hidden] f32
__device__ __forceinline__ void embed_row(int id, const half_t* __restrict__ table,
                                          float* __restrict__ x, int hidden) {
    const long t = blockIdx.x;
    const half_t* row = table + (long)id * hidden;
    float* xr = x + t * hidden;
    if ((hidden & 7) != 0) {
        for (int i = threadIdx.x; i < hidden; i += blockDim.x) xr[i] = h2f(row[i]);
        return;
    }
    const uint4* r4 = reinterpret_cast<const uint4*>(row);
    float4* x4 = reinterpret_cast<float4*>(xr);
    const int n8 = hidden >> 3;
    for (int base = threadIdx.x; base < n8; base += blockDim.x * EMB_PER) {
        uint4 v[EMB_PER];
#pragma unroll
        for (int j = 0; j < EMB_PER; j++) {
            const int i = base + j * blockDim.x;
            v[j] = i < n8 ? __ldg(r4 + i) : make_uint4(0, 0, 0, 0);
        }
#pragma unroll
        for (int j = 0; j < EMB_PER; j++) {
            const int i = base + j * blockDim.x;
            if (i >= n8) break;
            const unsigned u[4] = {v[j].x, v[j].y, v[j].z, v[j].w};
            float f[8];
#pragma unroll
            for (int k = 0; k < 4; k++) {
                f[2 * k] = h2f((half_t)(u[k] & 0xffff));
                f[2 * k + 1] = h2f((half_t)(u[k] >> 16));
            }
            x4[2 * i] = make_float4(f[0], f[1], f[2], f[3]);
            x4[2 * i + 1] = make_float4(f[4], f[5], f[6], f[7]);
        }
    }
}

// grid: n; block: 256
extern "C" __global__ void embed_f16(const int* __restrict__ ids, const half_t* __restrict__ table,
                                     float* __restrict__ x, int hidden) {
    pdl_enter();
    embed_row(ids[blockIdx.x], table, x, hidden);
}

// embed_f16 for a decode step whose metadata the host left in mapped page-locked memory instead
// of copying it: the grid first copies `words` words of it (a multiple of 4; both addresses
// 16-byte aligned) to the device's metadata buffer, where the rest of the step reads it, and
// takes its token ids from the host copy. Later kernels read the metadata only after this one
// has finished: the next kernel (a GEMV) reads none before its wait, and the one after it
// (decode attention, which reads the block tables before its wait) is scheduled only once the
// GEMV has passed its wait.
// meta_src: [words] host (device address of the mapping); meta_dst: [words]; ids at meta_src +
// tokens; grid: n; block: 256
extern "C" __global__ void embed_f16_meta(const int* __restrict__ meta_src,
                                          int* __restrict__ meta_dst, int words, int tokens,
                                          const half_t* __restrict__ table, float* __restrict__ x,
                                          int hidden) {
    pdl_enter();
    const int id = meta_src[tokens + blockIdx.x];
    const int4* s4 = reinterpret_cast<const int4*>(meta_src);
    int4* d4 = reinterpret_cast<int4*>(meta_dst);
    for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < (words >> 2); i += gridDim.x * blockDim.x)
        d4[i] = s4[i];
    embed_row(id, table, x, hidden);
}
