// Sampling on the GPU, so only token ids cross to the host: argmax_rows for all-greedy batches,
// sample_rows (below) for rows with a temperature, top-k, top-p and min-p.

// logits: [rows, vocab] f32; out: [rows]; block: 1024
extern "C" __global__ void argmax_rows(const float* __restrict__ logits, int vocab, int* __restrict__ out) {
    pdl_enter();
    __shared__ float bv[32];
    __shared__ int bi[32];
    const float* l = logits + (long)blockIdx.x * vocab;
    float best = -INFINITY;
    int idx = 0x7fffffff;
    for (int i = threadIdx.x; i < vocab; i += blockDim.x) {
        const float v = l[i];
        if (v > best) { best = v; idx = i; }
    }
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const float ov = __shfl_xor_sync(0xffffffffu, best, o);
        const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
        if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
    }
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    if (warp == 0) {
        const int nw = blockDim.x >> 5;
        best = lane < nw ? bv[lane] : -INFINITY;
        idx = lane < nw ? bi[lane] : 0x7fffffff;
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, best, o);
            const int oi = __shfl_xor_sync(0xffffffffu, idx, o);
            if (ov > best || (ov == best && oi < idx)) { best = ov; idx = oi; }
        }
        if (lane == 0) out[blockIdx.x] = idx == 0x7fffffff ? 0 : idx;
    }
    trace_mark();  // the step's end, for the decode timeline
}

// argmax_split: argmax_rows over several CTAs per row, for long rows (a 128K vocabulary is 28 µs
// in one CTA, ~3 µs over 32). CTA c takes the c-th slice of the row, parks its (value, index) in
// part, and counts its arrival on the row's counter; the last to arrive reduces the slices (ties
// to the lowest index, NaN never wins, as argmax_rows) and resets the counter, so no CTA waits for
// another and the counters are 0 again for the next launch. Same picks as argmax_rows.
// logits: [rows, vocab] f32; out: [rows]; part: [rows, ctas] (value, index bits);
// counters: [rows], 0 before the launch. grid: (ctas, rows); block: 256.
extern "C" __global__ void argmax_split(const float* __restrict__ logits, int vocab,
                                        int* __restrict__ out, float2* __restrict__ part,
                                        int* __restrict__ counters) {
    pdl_enter();
    __shared__ float bv[32];
    __shared__ int bi[32];
    __shared__ int last_s;
    const int row = blockIdx.y, ctas = gridDim.x;
    const int per = (vocab + ctas - 1) / ctas;
    const int lo = blockIdx.x * per, hi = min(vocab, lo + per);
    const float* l = logits + (long)row * vocab;
    float best = -INFINITY;
    int idx = 0x7fffffff;
#pragma unroll 4
    for (int i = lo + threadIdx.x; i < hi; i += blockDim.x) {
        const float v = l[i];
        if (v > best) { best = v; idx = i; }
    }
    auto reduce = [&](float& b, int& x) {
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) {
            const float ov = __shfl_xor_sync(0xffffffffu, b, o);
            const int oi = __shfl_xor_sync(0xffffffffu, x, o);
            if (ov > b || (ov == b && oi < x)) { b = ov; x = oi; }
        }
    };
    reduce(best, idx);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nw = blockDim.x >> 5;
    if (lane == 0) { bv[warp] = best; bi[warp] = idx; }
    __syncthreads();
    if (warp != 0) return;
    best = lane < nw ? bv[lane] : -INFINITY;
    idx = lane < nw ? bi[lane] : 0x7fffffff;
    reduce(best, idx);
    float2* prow = part + (long)row * ctas;
    if (lane == 0) {
        prow[blockIdx.x] = make_float2(best, __int_as_float(idx));
        __threadfence();  // release the slice before the arrival
        const int last = atomicAdd(&counters[row], 1) == ctas - 1;
        if (last) {
            counters[row] = 0;  // every slice has arrived: clean for the next launch
            __threadfence();    // acquire the other slices
        }
        last_s = last;
    }
    __syncwarp();
    if (!last_s) return;
    best = -INFINITY;
    idx = 0x7fffffff;
    for (int c = lane; c < ctas; c += 32) {  // slices in order: a lane keeps its first best
        const float2 p = __ldcg(prow + c);
        const int pi = __float_as_int(p.y);
        if (p.x > best || (p.x == best && pi < idx)) { best = p.x; idx = pi; }
    }
    reduce(best, idx);
    if (lane == 0) {
        out[row] = idx == 0x7fffffff ? 0 : idx;
        if (row == 0) trace_stamp();  // the step's end, for the decode timeline
    }
}

// ---------------------------------------------------------------------------------------------
// sample_rows: quire_backend::sample_row on the device, one CTA per logits row.
//
// The host sorts the finite logits (logit desc, id asc), keeps the top-k, cuts that list by top-p
// (a running probability) and min-p (a probability floor), and walks what is left with
// u · Σ weights. Each step is "the first element of the sorted order where a running count or sum
// reaches a target", so the vocabulary is never sorted. A pass buckets every finite logit by
// d = max - l (256 buckets per octave of d; the order's ties stay inside a bucket) and counts
// each bucket; prefix sums of the counts say which buckets hold the top-k.
// - A top-k of at most S_CAP whose buckets fit in shared memory: those buckets are gathered and
//   sorted, and z, top-p, min-p and the draw are all read off that sorted prefix (three passes
//   over the row in all).
// - Otherwise the pass also sums e = exp(l - max) (for top-p and min-p) and w = exp((l - max) / T)
//   (for the draw) per bucket; prefix sums locate the bucket holding each target, and only it is
//   gathered and sorted (the leading buckets, up to S_CAP elements, are gathered once and serve
//   every target inside them). A bucket too big to sort is split by 8-bit digits of the exact key
//   first; a run of more than S_CAP equal logits needs no sort, only the m-th id among them.
//
// e and w are f32 (within about an ulp of the host's exp), summed as 64-bit fixed point with 2^S
// per unit (S = 62 - ceil(log2 vocab), so no sum overflows): integer sums do not depend on the
// order the atomics land in, so the buckets' sums and the sorted lists' running sums agree exactly
// and every pick is deterministic. Weights below 2^-S of the largest round to 0: such tokens (each
// at most 2^-S of the mass: 3e-14 for a 128k vocabulary) are never drawn. What can still differ
// from the host is where its f32 sums (z and the top-p running sum, added in sorted order) round
// differently from exact ones: near a top-p or min-p boundary, or where u · total lies within
// about 1e-7 of a cumulative boundary.

typedef unsigned int su32;
typedef unsigned long long su64;

#define S_THREADS 1024             // threads per CTA
#define S_BUCKETS 4096             // buckets of d
#define S_CAP 4096                 // most elements gathered and sorted in shared memory
#define S_PER (S_CAP / S_THREADS)  // gathered elements per thread
#define S_FULL 0xffffffffu

// The CTA's shared memory. Dynamic: efx[S_BUCKETS], wfx[S_BUCKETS], list[S_CAP] (u64),
// cnt[S_BUCKETS] (u32): 114688 bytes (SAMPLE_SMEM in cuda/sample.rs).
extern __shared__ su64 s_dyn[];
#define S_EFX (s_dyn)                    // sums of e (fixed point), then inclusive prefix sums
#define S_WFX (s_dyn + S_BUCKETS)        // sums of w (fixed point), then inclusive prefix sums
#define S_LIST (s_dyn + 2 * S_BUCKETS)   // gathered (~key << 32 | id), sorted ascending
#define S_CNT ((su32*)(s_dyn + 2 * S_BUCKETS + S_CAP))  // counts, then inclusive prefix sums
__shared__ su32 s_sub_cnt[256];  // sub-histograms of one bucket by key digit
__shared__ su64 s_sub_e[256];
__shared__ su64 s_sub_w[256];
__shared__ su32 s_red32[32];     // block reductions
__shared__ su64 s_red64[32];

// Order-preserving key of a float: the total order of Rust's total_cmp (-0 below +0).
__device__ __forceinline__ su32 fkey(float f) {
    const su32 b = __float_as_uint(f);
    return (b & 0x80000000u) ? ~b : (b | 0x80000000u);
}
__device__ __forceinline__ float kfloat(su32 k) {
    return __uint_as_float((k & 0x80000000u) ? (k & 0x7fffffffu) : ~k);
}
// Bit tests: fast math does not promise IEEE classification of NaN and infinities.
__device__ __forceinline__ bool is_finite_bits(float f) {
    return (__float_as_uint(f) & 0x7f800000u) != 0x7f800000u;
}
__device__ __forceinline__ bool is_nan_bits(float f) {
    return (__float_as_uint(f) & 0x7fffffffu) > 0x7f800000u;
}

// e^x for x <= 0 within about an ulp: Cody-Waite reduction by ln 2, degree-7 Taylor polynomial
// on |r| <= ln2 / 2. Exactly 1 at 0; 0 below -87 (where the result would leave the normal range).
__device__ __forceinline__ float exp_neg(float x) {
    if (!(x > -87.0f)) return 0.0f;
    const float k = rintf(x * 1.44269504f);
    float r = fmaf(k, -0.693359375f, x);
    r = fmaf(k, 2.12194440e-4f, r);
    float p = 1.98412698e-4f;
    p = fmaf(p, r, 1.38888889e-3f);
    p = fmaf(p, r, 8.33333333e-3f);
    p = fmaf(p, r, 4.16666667e-2f);
    p = fmaf(p, r, 1.66666667e-1f);
    p = fmaf(p, r, 0.5f);
    p = fmaf(p, r, 1.0f);
    p = fmaf(p, r, 1.0f);
    return p * __int_as_float(((int)k + 127) << 23);
}

// Bucket of d = max - l >= 0 (monotone in d): 0 for d < 2^-4, then 256 per octave; the last
// bucket holds d >= 2^12.
__device__ __forceinline__ int bucket_of(float d) {
    const su32 b = __float_as_uint(d);
    if (b >= 0x80000000u || b < 0x3d800000u) return 0;  // -0 (l == max) or d < 2^-4
    const su32 i = 1u + ((b - 0x3d800000u) >> 15);
    return i < S_BUCKETS ? (int)i : S_BUCKETS - 1;
}

// One row.
struct SampleRow {
    const float* row;
    const su32* mask;  // the row's allowed-token bits (bit i % 32 of word i / 32), or null: all
    int vocab;
    float mx, temp, scale;
    float x_zero;   // below this x = l - max, e^x rounds to 0 in fixed point
    bool need_e;    // top-p or min-p: e is needed
    bool sums;      // the histogram carries sums of e and w (else counts alone)
    int prefix_b;   // buckets [0, prefix_b] hold at most S_CAP elements (-1: bucket 0 holds more)
};

// What a search found, and what `list` holds: buckets [list_lo, list_hi] (one bucket when they
// are equal, then only keys matching list_prefix under list_mask).
struct SampleState {
    su32 rank, id, found;
    su64 ce, cw;  // running e and w through the found element
    su32 list_n, list_mask, list_prefix;
    int list_lo, list_hi;
};
__shared__ SampleState s_st;

// Fixed-point e and w of a logit at x = l - max (x <= 0).
__device__ __forceinline__ void row_vals(const SampleRow& c, float x, su64& e, su64& w) {
    e = c.need_e && x > c.x_zero ? __float2ull_rn(exp_neg(x) * c.scale) : 0ull;
    w = x > c.x_zero * c.temp ? __float2ull_rn(exp_neg(__fdiv_rn(x, c.temp)) * c.scale) : 0ull;
}

// Logit i of the row as the sampler sees it: -inf where the mask forbids the token.
__device__ __forceinline__ float row_logit(const SampleRow& c, int i) {
    const float v = __ldg(c.row + i);
    return c.mask && !((__ldg(c.mask + (i >> 5)) >> (i & 31)) & 1u) ? -INFINITY : v;
}

// Calls f(i, l, in_range) for every index of the row, four loads in flight per thread; every
// thread makes the same number of calls, so f may use full-warp intrinsics.
template <typename F>
__device__ __forceinline__ void for_each_logit(const SampleRow& c, F f) {
    for (int i0 = 0; i0 < c.vocab; i0 += 4 * S_THREADS) {
        float v[4];
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = i0 + k * S_THREADS + threadIdx.x;
            v[k] = i < c.vocab ? row_logit(c, i) : 0.0f;
        }
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = i0 + k * S_THREADS + threadIdx.x;
            f(i, v[k], i < c.vocab);
        }
    }
}

// Exclusive prefix of v over the CTA; `total` gets the sum. `red` holds 32 values.
template <typename T>
__device__ __forceinline__ T block_excl_scan(T v, T* red, T& total) {
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    T x = v;
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(S_FULL, x, o);
        if (lane >= o) x += y;
    }
    __syncthreads();  // an earlier call may still read `red`
    if (lane == 31) red[warp] = x;
    __syncthreads();
    T w = red[lane];
#pragma unroll
    for (int o = 1; o < 32; o <<= 1) {
        const T y = __shfl_up_sync(S_FULL, w, o);
        if (lane >= o) w += y;
    }
    total = __shfl_sync(S_FULL, w, 31);
    const T before = __shfl_sync(S_FULL, w, (warp + 31) & 31);
    return (warp ? before : (T)0) + x - v;
}

template <typename T>
__device__ __forceinline__ T block_total(T v, T* red) {
    T total;
    block_excl_scan(v, red, total);
    return total;
}

template <typename T>
__device__ __forceinline__ T block_max(T v, T* red) {
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const T y = __shfl_xor_sync(S_FULL, v, o);
        v = y > v ? y : v;
    }
    __syncthreads();
    if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = v;
    __syncthreads();
    v = red[threadIdx.x & 31];
#pragma unroll
    for (int o = 16; o > 0; o >>= 1) {
        const T y = __shfl_xor_sync(S_FULL, v, o);
        v = y > v ? y : v;
    }
    return v;
}

// In-place inclusive prefix of a[S_BUCKETS].
template <typename T>
__device__ __forceinline__ void scan_buckets(T* a, T* red) {
    constexpr int per = S_BUCKETS / S_THREADS;
    T loc[per];
    T s = 0;
#pragma unroll
    for (int k = 0; k < per; ++k) {
        loc[k] = a[threadIdx.x * per + k];
        s += loc[k];
    }
    T total;
    T run = block_excl_scan(s, red, total);
#pragma unroll
    for (int k = 0; k < per; ++k) {
        run += loc[k];
        a[threadIdx.x * per + k] = run;
    }
    __syncthreads();
}

// Quantity q of a prefix: 0 count, 1 e, 2 w.
__device__ __forceinline__ su64 pick_q(int q, su64 n, su64 e, su64 w) {
    return q == 0 ? n : (q == 1 ? e : w);
}

// The bucket histograms (counts; with c.sums, also e and w) as inclusive prefix sums.
__device__ void histogram(const SampleRow& c) {
    __syncthreads();  // a second call follows reads of the first one's counts
    for (int i = threadIdx.x; i < S_BUCKETS; i += S_THREADS) {
        S_CNT[i] = 0;
        S_EFX[i] = 0;
        S_WFX[i] = 0;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for_each_logit(c, [&](int i, float l, bool in) {
        int b = -1;
        su64 e = 0, w = 0;
        if (in && is_finite_bits(l)) {
            const float x = __fsub_rn(l, c.mx);
            b = bucket_of(-x);
            if (c.sums) row_vals(c, x, e, w);
        }
        const su32 peers = __match_any_sync(S_FULL, b);
        if (b >= 0 && lane == __ffs(peers) - 1) atomicAdd(&S_CNT[b], (su32)__popc(peers));
        if (e) atomicAdd(&S_EFX[b], e);
        if (w) atomicAdd(&S_WFX[b], w);
    });
    __syncthreads();
    scan_buckets(S_CNT, s_red32);
    if (c.sums) {
        scan_buckets(S_EFX, s_red64);
        scan_buckets(S_WFX, s_red64);
    }
}

// Sub-histograms of the next 8 key bits (index 255 - digit, so ascending index is descending
// logit) of the elements of bucket b whose key matches prefix under mask; inclusive prefixes.
__device__ void sub_histogram(const SampleRow& c, int b, su32 mask, su32 prefix, int shift) {
    for (int i = threadIdx.x; i < 256; i += S_THREADS) {
        s_sub_cnt[i] = 0;
        s_sub_e[i] = 0;
        s_sub_w[i] = 0;
    }
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for_each_logit(c, [&](int i, float l, bool in) {
        int dg = -1;
        su64 e = 0, w = 0;
        if (in && is_finite_bits(l)) {
            const float x = __fsub_rn(l, c.mx);
            const su32 k = fkey(l);
            if (bucket_of(-x) == b && (k & mask) == prefix) {
                dg = 255 - (int)((k >> shift) & 255u);
                row_vals(c, x, e, w);
            }
        }
        const su32 peers = __match_any_sync(S_FULL, dg);
        if (dg >= 0 && lane == __ffs(peers) - 1) atomicAdd(&s_sub_cnt[dg], (su32)__popc(peers));
        if (e) atomicAdd(&s_sub_e[dg], e);
        if (w) atomicAdd(&s_sub_w[dg], w);
    });
    __syncthreads();
    if (threadIdx.x < 32) {
        su32 n = 0;
        su64 e = 0, w = 0;
        for (int k = 0; k < 8; ++k) {
            n += s_sub_cnt[lane * 8 + k];
            e += s_sub_e[lane * 8 + k];
            w += s_sub_w[lane * 8 + k];
        }
        su32 xn = n;
        su64 xe = e, xw = w;
#pragma unroll
        for (int o = 1; o < 32; o <<= 1) {
            const su32 yn = __shfl_up_sync(S_FULL, xn, o);
            const su64 ye = __shfl_up_sync(S_FULL, xe, o);
            const su64 yw = __shfl_up_sync(S_FULL, xw, o);
            if (lane >= o) {
                xn += yn;
                xe += ye;
                xw += yw;
            }
        }
        xn -= n;
        xe -= e;
        xw -= w;
        for (int k = 0; k < 8; ++k) {
            xn += s_sub_cnt[lane * 8 + k];
            xe += s_sub_e[lane * 8 + k];
            xw += s_sub_w[lane * 8 + k];
            s_sub_cnt[lane * 8 + k] = xn;
            s_sub_e[lane * 8 + k] = xe;
            s_sub_w[lane * 8 + k] = xw;
        }
    }
    __syncthreads();
}

// Gathers the elements of buckets [lo, hi] (keys matching prefix under mask) into `list`, sorted
// (logit desc, id asc), unless `list` holds them already. At most S_CAP of them.
__device__ void gather_sorted(const SampleRow& c, int lo, int hi, su32 mask, su32 prefix) {
    const SampleState& st = s_st;
    if (st.list_lo == lo && st.list_hi == hi && st.list_mask == mask && st.list_prefix == prefix)
        return;
    __syncthreads();
    if (threadIdx.x == 0) s_st.list_n = 0;
    __syncthreads();
    const int lane = threadIdx.x & 31;
    for_each_logit(c, [&](int i, float l, bool in) {
        bool ok = false;
        su32 k = 0;
        if (in && is_finite_bits(l)) {
            k = fkey(l);
            const int b = bucket_of(-__fsub_rn(l, c.mx));
            ok = b >= lo && b <= hi && (k & mask) == prefix;
        }
        const su32 bal = __ballot_sync(S_FULL, ok);
        if (bal) {
            const int leader = __ffs(bal) - 1;
            su32 base = 0;
            if (lane == leader) base = atomicAdd(&s_st.list_n, (su32)__popc(bal));
            base = __shfl_sync(S_FULL, base, leader);
            const su32 pos = base + __popc(bal & ((1u << lane) - 1u));
            if (ok && pos < S_CAP) S_LIST[pos] = ((su64)(~k) << 32) | (su32)i;
        }
    });
    __syncthreads();
    const su32 n = s_st.list_n < S_CAP ? s_st.list_n : S_CAP;
    su32 p2 = 1;
    while (p2 < n) p2 <<= 1;
    for (su32 j = n + threadIdx.x; j < p2; j += S_THREADS) S_LIST[j] = ~0ull;
    __syncthreads();
    // Bitonic sort, ascending.
    for (su32 k = 2; k <= p2; k <<= 1) {
        for (su32 j = k >> 1; j > 0; j >>= 1) {
            for (su32 t = threadIdx.x; t < p2 / 2; t += S_THREADS) {
                const su32 i = 2 * t - (t & (j - 1));
                const su64 a = S_LIST[i], o = S_LIST[i + j];
                if ((a > o) == ((i & k) == 0)) {
                    S_LIST[i] = o;
                    S_LIST[i + j] = a;
                }
            }
            __syncthreads();
        }
    }
    if (threadIdx.x == 0) {
        s_st.list_lo = lo;
        s_st.list_hi = hi;
        s_st.list_mask = mask;
        s_st.list_prefix = prefix;
        s_st.list_n = n;
    }
    __syncthreads();
}

// x = l - max of list entry j.
__device__ __forceinline__ float list_x(const SampleRow& c, su32 j) {
    return __fsub_rn(kfloat(~(su32)(S_LIST[j] >> 32)), c.mx);
}

// The first element of the sorted `list` (which follows ex_n elements with sums ex_e, ex_w)
// whose inclusive running q reaches target, into s_st.
__device__ void search_list(const SampleRow& c, int q, su64 target, su64 ex_n, su64 ex_e,
                            su64 ex_w) {
    const su32 n = s_st.list_n;
    su64 le[S_PER], lw[S_PER];
    su64 se = 0, sw = 0;
#pragma unroll
    for (int k = 0; k < S_PER; ++k) {
        const su32 j = threadIdx.x * S_PER + k;
        le[k] = lw[k] = 0;
        if (j < n) row_vals(c, list_x(c, j), le[k], lw[k]);
        se += le[k];
        sw += lw[k];
    }
    if (threadIdx.x == 0) s_st.found = 0;
    su64 te, tw;
    su64 ce = ex_e + block_excl_scan(se, s_red64, te);
    su64 cw = ex_w + block_excl_scan(sw, s_red64, tw);
#pragma unroll
    for (int k = 0; k < S_PER; ++k) {
        const su32 j = threadIdx.x * S_PER + k;
        if (j < n) {
            const su64 before = pick_q(q, ex_n + j, ce, cw);
            ce += le[k];
            cw += lw[k];
            const su64 after = pick_q(q, ex_n + j + 1, ce, cw);
            if (after >= target && before < target) {
                s_st.rank = (su32)(ex_n + j);
                s_st.id = (su32)S_LIST[j];
                s_st.ce = ce;
                s_st.cw = cw;
                s_st.found = 1;
            }
        }
    }
    __syncthreads();
    // Unreachable with consistent sums; the last element keeps the result defined.
    if (!s_st.found && n > 0 && threadIdx.x == (n - 1) / S_PER) {
        s_st.rank = (su32)(ex_n + n - 1);
        s_st.id = (su32)S_LIST[n - 1];
        s_st.ce = ce;
        s_st.cw = cw;
        s_st.found = 1;
    }
    __syncthreads();
}

// The id of the m-th (0-based) element with key `key`, in id order.
__device__ su32 mth_with_key(const SampleRow& c, su32 key, su32 m) {
    su32 seen = 0;
    for (int i0 = 0; i0 < c.vocab; i0 += 4 * S_THREADS) {
        const int base = i0 + threadIdx.x * 4;
        bool hit[4];
        su32 mine = 0;
#pragma unroll
        for (int k = 0; k < 4; ++k) {
            const int i = base + k;
            hit[k] = i < c.vocab && fkey(row_logit(c, i)) == key;
            mine += hit[k];
        }
        su32 total;
        su32 rank = seen + block_excl_scan(mine, s_red32, total);
        if (seen + total > m) {
#pragma unroll
            for (int k = 0; k < 4; ++k) {
                if (hit[k]) {
                    if (rank == m) s_st.id = base + k;
                    ++rank;
                }
            }
            break;
        }
        seen += total;
    }
    __syncthreads();
    return s_st.id;
}

// First bucket whose inclusive prefix of q reaches target.
__device__ __forceinline__ int find_bucket(const SampleRow& c, int q, su64 target) {
    int lo = 0, hi = S_BUCKETS - 1;
    while (lo < hi) {
        const int mid = (lo + hi) >> 1;
        if (pick_q(q, S_CNT[mid], S_EFX[mid], S_WFX[mid]) >= target) hi = mid;
        else lo = mid + 1;
    }
    return lo;
}

// Into s_st: the first element in sorted order whose inclusive running q (0 count, 1 e, 2 w)
// reaches target (1 <= target <= the row's total of q; without c.sums, only counts up to the
// sorted prefix's and the prefix's own e and w). Every thread calls it.
__device__ void locate(const SampleRow& c, int q, su64 target) {
    const int b = c.sums ? find_bucket(c, q, target) : 0;
    if (b <= c.prefix_b) {
        gather_sorted(c, 0, c.prefix_b, 0, 0);
        search_list(c, q, target, 0, 0, 0);
        return;
    }
    su64 ex_n = b ? S_CNT[b - 1] : 0, ex_e = b ? S_EFX[b - 1] : 0, ex_w = b ? S_WFX[b - 1] : 0;
    su64 count = S_CNT[b] - ex_n;
    su32 mask = 0, prefix = 0;
    for (int shift = 24;; shift -= 8) {
        if (count <= S_CAP) {
            gather_sorted(c, b, b, mask, prefix);
            search_list(c, q, target, ex_n, ex_e, ex_w);
            return;
        }
        if (shift < 0) {
            // `count` equal logits: equal e and w, ordered by id.
            su64 ve, vw;
            row_vals(c, __fsub_rn(kfloat(prefix), c.mx), ve, vw);
            const su64 v = pick_q(q, 1, ve, vw);
            const su64 have = pick_q(q, ex_n, ex_e, ex_w);
            su64 m = v ? (target - have + v - 1) / v - 1 : 0;
            if (m > count - 1) m = count - 1;
            const su32 id = mth_with_key(c, prefix, (su32)m);
            __syncthreads();
            if (threadIdx.x == 0) {
                s_st.rank = (su32)(ex_n + m);
                s_st.id = id;
                s_st.ce = ex_e + (m + 1) * ve;
                s_st.cw = ex_w + (m + 1) * vw;
                s_st.found = 1;
            }
            __syncthreads();
            return;
        }
        sub_histogram(c, b, mask, prefix, shift);
        const su64 have = pick_q(q, ex_n, ex_e, ex_w);
        int s = 0, shi = 255;
        while (s < shi) {
            const int mid = (s + shi) >> 1;
            if (have + pick_q(q, s_sub_cnt[mid], s_sub_e[mid], s_sub_w[mid]) >= target) shi = mid;
            else s = mid + 1;
        }
        if (s > 0) {
            ex_n += s_sub_cnt[s - 1];
            ex_e += s_sub_e[s - 1];
            ex_w += s_sub_w[s - 1];
        }
        count = s_sub_cnt[s] - (s > 0 ? s_sub_cnt[s - 1] : 0);
        prefix |= (su32)(255 - s) << shift;
        mask |= 0xffu << shift;
        __syncthreads();  // the sub-histograms are read above; the next level rewrites them
    }
}

// How many finite logits have l - max >= x_min.
__device__ su32 count_from(const SampleRow& c, float x_min) {
    su32 m = 0;
    if (c.prefix_b >= 0 && (!c.sums || bucket_of(-x_min) <= c.prefix_b)) {
        // All of them lie in the sorted prefix (or, with counts alone, the whole prefix passes
        // when they do not, and only the prefix matters).
        gather_sorted(c, 0, c.prefix_b, 0, 0);
        for (int k = 0; k < S_PER; ++k) {
            const su32 j = threadIdx.x * S_PER + k;
            m += j < s_st.list_n && list_x(c, j) >= x_min;
        }
    } else {
        for_each_logit(c, [&](int i, float l, bool in) {
            m += in && is_finite_bits(l) && __fsub_rn(l, c.mx) >= x_min;
        });
    }
    return block_total(m, s_red32);
}

// logits: [rows, stride] f32 (the first vocab of each row); params: [rows, 6] (temperature f32
// bits, top_k, top_p f32 bits, min_p f32 bits, u f64 bits low word then high); mask: null, or
// [rows, ceil(vocab / 32)] allowed-token bits (a forbidden token's logit counts as -inf, as
// quire_backend::sample_row_masked has it); out: [rows].
// block: 1024; dynamic shared memory: 114688 bytes.
extern "C" __global__ void __launch_bounds__(S_THREADS, 1)
sample_rows(const float* __restrict__ logits, long stride, int vocab,
            const int* __restrict__ params, const su32* __restrict__ mask,
            int* __restrict__ out) {
    pdl_enter();
    const int* pr = params + 6 * blockIdx.x;
    const float temp = __int_as_float(pr[0]);
    const su32 top_k = (su32)pr[1];
    const float top_p = __int_as_float(pr[2]);
    const float min_p = __int_as_float(pr[3]);
    const double u = __longlong_as_double(((long long)pr[5] << 32) | (su32)pr[4]);

    SampleRow c;
    c.row = logits + (long)blockIdx.x * stride;
    c.mask = mask ? mask + (long)blockIdx.x * ((vocab + 31) >> 5) : nullptr;
    c.vocab = vocab;

    if (!(temp > 0.0f)) {
        // The host argmax: the first of the largest non-NaN values (-0 equal to +0); 0 if none.
        su64 best = 0;
        for_each_logit(c, [&](int i, float l, bool in) {
            if (in && !is_nan_bits(l)) {
                const float lz = (__float_as_uint(l) << 1) == 0u ? 0.0f : l;
                const su64 k = ((su64)fkey(lz) << 32) | (su32)~i;
                best = k > best ? k : best;
            }
        });
        best = block_max(best, s_red64);
        if (threadIdx.x == 0) out[blockIdx.x] = best ? (int)~(su32)best : 0;
        return;
    }

    // The finite logits: how many, and the largest.
    su32 n = 0, kmax = 0;
    for_each_logit(c, [&](int i, float l, bool in) {
        if (in && is_finite_bits(l)) {
            ++n;
            const su32 k = fkey(l);
            kmax = k > kmax ? k : kmax;
        }
    });
    n = block_total(n, s_red32);
    kmax = block_max(kmax, s_red32);
    if (n == 0) {
        if (threadIdx.x == 0) out[blockIdx.x] = 0;
        return;
    }
    c.mx = kfloat(kmax);
    c.temp = temp;
    const int fx_bits = 62 - (vocab > 1 ? 32 - __clz(vocab - 1) : 0);
    c.scale = __int_as_float((127 + fx_bits) << 23);
    c.x_zero = -0.6931472f * (float)(fx_bits + 1);
    c.need_e = top_p < 1.0f || min_p > 0.0f;
    if (threadIdx.x == 0) {
        s_st.list_lo = s_st.list_hi = -1;
        s_st.list_n = 0;
    }
    const su32 keep_k = top_k > 0 && top_k < n ? top_k : n;
    // A small top-k needs counts alone, if its buckets fit in shared memory.
    c.sums = !(keep_k < n && keep_k <= S_CAP);
    histogram(c);
    {
        int lo = 0, hi = S_BUCKETS;  // the first bucket whose prefix holds more than S_CAP
        while (lo < hi) {
            const int mid = (lo + hi) >> 1;
            if (S_CNT[mid] > S_CAP) hi = mid;
            else lo = mid + 1;
        }
        c.prefix_b = lo - 1;
    }
    if (!c.sums) {
        const int bk = find_bucket(c, 0, keep_k);
        if (bk <= c.prefix_b) {
            c.prefix_b = bk;
        } else {
            c.sums = true;
            histogram(c);
        }
    }

    su32 keep = keep_k;
    if (c.need_e) {
        // z: the sum of e over the top-k.
        su64 z = S_EFX[S_BUCKETS - 1];
        if (keep_k < n) {
            locate(c, 0, keep_k);
            z = s_st.ce;
        }
        if (top_p < 1.0f) {
            // The shortest prefix whose e reaches top_p · z.
            const double t = ceil((double)top_p * (double)z);
            su64 target = t < 1.0 ? 1ull : (su64)t;
            target = target < z ? target : z;
            locate(c, 1, target);
            keep = s_st.rank + 1 < keep ? s_st.rank + 1 : keep;
        }
        if (min_p > 0.0f) {
            // The host keeps the leading run with e / z >= min_p · (1 / z) in f32; that holds
            // down to some x = l - max, found by bisection over the bits of x in [-inf, -0].
            const float zf = (float)((double)z / (double)c.scale);
            const float floor_p = __fmul_rn(min_p, __fdiv_rn(1.0f, zf));
            auto passes = [&](su32 bits) {
                return __fdiv_rn(exp_neg(__uint_as_float(bits)), zf) >= floor_p;
            };
            su32 keep_m = 1;
            if (passes(0x80000000u)) {
                su32 lo = 0x80000000u, hi = 0xff800000u;
                if (passes(hi)) {
                    lo = hi;
                } else {
                    while (hi - lo > 1) {
                        const su32 mid = lo + (hi - lo) / 2;
                        if (passes(mid)) lo = mid;
                        else hi = mid;
                    }
                }
                const su32 m = count_from(c, __uint_as_float(lo));
                keep_m = m > 1 ? m : 1;
            }
            keep = keep_m < keep ? keep_m : keep;
        }
    }
    // The draw: the first kept element whose running w exceeds u · total.
    su64 total = S_WFX[S_BUCKETS - 1];
    if (keep < n) {
        locate(c, 0, keep);
        total = s_st.cw;
    }
    su64 t = (su64)floor(u * (double)total);
    t = t < total ? t : total - 1;
    locate(c, 2, t + 1);
    if (threadIdx.x == 0) out[blockIdx.x] = (int)s_st.id;
}
