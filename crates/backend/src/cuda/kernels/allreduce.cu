// The all-reduce of a tensor-parallel group's residual rows for small steps, done by the GPUs
// themselves through peer memory (NVLink) instead of NCCL: a decode step's rows are a few KiB to
// a MiB, where NCCL's ~10 us per call is latency, not bandwidth (64 of them were 12% of a 2-GPU
// 8B decode step). One kernel per all-reduce: each CTA copies its slice of `x` into this rank's
// staging buffer, tells every peer its slice is ready (a flag in the peer's memory), waits for
// the peers' flags for the same slice, then sums the ranks' slices in rank order (so every rank
// ends with the same bits) back into `x`.
//
// Staging buffers alternate by call (two per rank): a rank writes buffer (e & 1) at call e only
// after the peers reached call e - 1 (they signalled it), which they do only after finishing call
// e - 2, the last to read that buffer (stream order; the kernel's first statement waits for the
// grid before it). The grid is always PEER_GRID CTAs, so every CTA's count of calls (`epochs`) is
// the same on every rank. Flags only grow; a peer may already be one call ahead when it is read.

#define PEER_GRID 32
#define PEER_THREADS 256

__device__ __forceinline__ void st_release_sys(unsigned* p, unsigned v) {
    asm volatile("st.release.sys.global.u32 [%0], %1;" ::"l"(p), "r"(v) : "memory");
}
__device__ __forceinline__ unsigned ld_acquire_sys(const unsigned* p) {
    unsigned v;
    asm volatile("ld.acquire.sys.global.u32 %0, [%1];" : "=r"(v) : "l"(p) : "memory");
    return v;
}
__device__ __forceinline__ unsigned long long global_ns() {
    unsigned long long t;
    asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
    return t;
}

// x: [count] f32 (count a multiple of 4), summed over the group in place.
// table: [nranks][3] addresses: rank r's staging buffers 0 and 1 (each >= count f32) and its flags
// [PEER_MAX_RANKS][PEER_GRID] u32 (flags[q][b]: the last call whose slice b rank q has staged).
// epochs: [PEER_GRID] u32, this rank's calls so far per CTA. stop: page-locked host word, nonzero
// once the group is stopping (a rank failed): waiting CTAs then leave without a result.
extern "C" __global__ void __launch_bounds__(PEER_THREADS)
    peer_all_reduce_f32(float* __restrict__ x, int count, int rank, int nranks,
                        const unsigned long long* __restrict__ table,
                        unsigned* __restrict__ epochs, const volatile unsigned* stop) {
    pdl_enter();
    __shared__ int leave;
    const int b = blockIdx.x;
    const unsigned e = epochs[b] + 1;
    const int n4 = count >> 2;
    const int per = (n4 + PEER_GRID - 1) / PEER_GRID;
    const int lo = b * per, hi = min(n4, lo + per);
    const float4* x4 = (const float4*)x;
    float4* mine = (float4*)table[rank * 3 + (e & 1)];
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) mine[i] = x4[i];
    if (threadIdx.x == 0) leave = 0;
    __syncthreads();
    // Thread q (< nranks, not this rank) signals peer q and waits for peer q.
    const int q = threadIdx.x;
    if (q < nranks && q != rank) {
        __threadfence_system();
        unsigned* theirs = (unsigned*)table[q * 3 + 2];
        st_release_sys(theirs + rank * PEER_GRID + b, e);
        const unsigned* flag = (const unsigned*)table[rank * 3 + 2] + q * PEER_GRID + b;
        const unsigned long long t0 = global_ns();
        unsigned spins = 0;
        while ((int)(ld_acquire_sys(flag) - e) < 0) {
            if ((++spins & 1023u) == 0) {
                if (*stop) {
                    leave = 1;
                    break;
                }
                // A peer that never arrives and no stop: fail loudly rather than hang the step.
                if (global_ns() - t0 > 120ull * 1000000000ull) __trap();
            }
        }
    }
    __syncthreads();
    if (leave) return;
    const int buf = e & 1;
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        float4 acc = make_float4(0.0f, 0.0f, 0.0f, 0.0f);
        for (int r = 0; r < nranks; ++r) {
            const float4 v = r == rank ? x4[i] : __ldcg((const float4*)table[r * 3 + buf] + i);
            if (r == 0) {
                acc = v;
            } else {
                acc.x += v.x;
                acc.y += v.y;
                acc.z += v.z;
                acc.w += v.w;
            }
        }
        ((float4*)x)[i] = acc;
    }
    if (threadIdx.x == 0) epochs[b] = e;
}
