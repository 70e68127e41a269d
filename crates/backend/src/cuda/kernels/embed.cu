// Token embedding lookup: a gather of f16 rows into the f32 residual stream.

// ids: [n]; table: [vocab, hidden] f16; x: [n, hidden] f32
extern "C" __global__ void embed_f16(const int* __restrict__ ids, const half_t* __restrict__ table,
                                     float* __restrict__ x, int hidden) {
    pdl_enter();
    const long t = blockIdx.x;
    const half_t* row = table + (long)ids[t] * hidden;
    for (int i = threadIdx.x; i < hidden; i += blockDim.x) x[t * hidden + i] = h2f(row[i]);
}
