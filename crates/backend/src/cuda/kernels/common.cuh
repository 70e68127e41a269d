// Shared by every quire kernel file (prepended by the Rust side before NVRTC compiles it).
// NVRTC 13 ships no cuda_fp16.h, so f16/bf16 conversions are written with PTX here.
#ifndef INFINITY
#define INFINITY __int_as_float(0x7f800000)
#endif
typedef unsigned short half_t;
typedef unsigned short bf16_t;

__device__ __forceinline__ float h2f(half_t h) {
    float f;
    asm("cvt.f32.f16 %0, %1;" : "=f"(f) : "h"(h));
    return f;
}
__device__ __forceinline__ half_t f2h(float f) {
    half_t h;
    asm("cvt.rn.f16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}
__device__ __forceinline__ float bf2f(bf16_t h) {
    return __uint_as_float(((unsigned int)h) << 16);
}
__device__ __forceinline__ bf16_t f2bf(float f) {
    bf16_t h;
    asm("cvt.rn.bf16.f32 %0, %1;" : "=h"(h) : "f"(f));
    return h;
}

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of up to 1024 threads; every thread gets the result. `red` holds 32 floats.
__device__ __forceinline__ float block_sum(float v, float* red) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    v = warp_sum(v);
    __syncthreads();
    if (lane == 0) red[warp] = v;
    __syncthreads();
    const int nw = (blockDim.x + 31) >> 5;
    float t = lane < nw ? red[lane] : 0.0f;
    return warp_sum(t);
}

// The decode timeline (`QUIRE_CUDA_TRACE=1`, cuda/trace.rs): compiled in only then. The first CTA
// appends the global timer to the buffer the host points `quire_trace` at ([0]: count).
#ifdef QUIRE_TRACE
#define QUIRE_TRACE_CAP (1ull << 20)
extern "C" {
__device__ unsigned long long* quire_trace;
}
// One mark, by the calling thread.
__device__ __forceinline__ void trace_stamp() {
    if (quire_trace) {
        unsigned long long t;
        asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
        const unsigned long long i = atomicAdd(quire_trace, 1ull);
        if (i < QUIRE_TRACE_CAP) quire_trace[1 + i] = t;
    }
}
// One mark per launch: by the grid's first thread.
__device__ __forceinline__ void trace_mark() {
    if ((threadIdx.x | threadIdx.y | threadIdx.z | blockIdx.x | blockIdx.y | blockIdx.z) == 0)
        trace_stamp();
}
#else
__device__ __forceinline__ void trace_stamp() {}
__device__ __forceinline__ void trace_mark() {}
#endif

// Programmatic dependent launch (sm_90+; the Rust side launches with the attribute). The first
// statement of every kernel, unconditionally: wait until the grid before this one on the stream
// has finished and its writes are visible (so every earlier grid has too: each of them waited the
// same way before it could finish), then let the next grid be scheduled so its CTAs sit resident
// and waiting when this one ends. No-op for a launch without the attribute and before sm_90.
__device__ __forceinline__ void pdl_enter() {
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
    asm volatile("griddepcontrol.wait;" ::: "memory");
    asm volatile("griddepcontrol.launch_dependents;" ::: "memory");
#endif
    trace_mark();  // after the trigger, so the mark's atomic does not hold the next grid back
}
