// ---------------------------------------------------------------------------------------------
// paged_decode: the decode kernel (compiled after attention.cu, same module). Grid (n,
// num_kv_heads, splits), block 32 * WARPS, the first arguments as paged_attention's, then the
// RoPE inputs. With splits > 1 each CTA leaves its split's partial (m = -inf for an empty split)
// and attention_reduce merges them.
//
// Why a second kernel: a decode row reads its whole context once, so the step is a stream of
// K/V bytes and must run at memory bandwidth. paged_attention's K phase gives each lane its own
// key (a warp load touches 32 rows), its V phase re-reads V rows per key, and few bytes are in
// flight per SM. Here each CTA streams its key range through shared memory in tiles of DEC_TILE
// keys (16 KB of K + V for every HEAD_DIM) with 16-byte cp.async copies (a warp copies whole
// HEAD_DIM * 2-byte key rows), DEC_STAGES tiles deep: while one tile is computed the next two
// are in flight, 32 KB per CTA, and the host plans splits so every SM holds several CTAs.
//
// Per tile, warp w owns keys [w * DEC_KW, (w + 1) * DEC_KW):
// - QK: DEC_QD lanes share a key (lane = qd * DEC_KW + kk), each scoring 32 of its dims against
//   every GQA head (q from shared memory, the 8 lanes of a 16-byte access phase read one address),
//   partial sums joined by shuffles;
// - the warp's online softmax over its keys (its own m, l: warps merge at the end);
// - PV: lane owns output dims lane * DPL .. + DPL and walks the warp's keys, p by shuffle.
// Every K and V element is read from global memory once and converted once per CTA.
//
// Shared memory (dynamic, DEC_SMEM bytes, the host sets the attribute): DEC_STAGES stages of
// [K tile: DEC_TILE][HEAD_DIM] then [V tile: DEC_TILE][HEAD_DIM] f16, then q [GQA][DEC_QS] f32
// (pre-scaled; 8 floats of padding after each 32 dims, so lanes of different qd in one access
// phase hit different banks). K rows hold their 16-byte chunks XOR-swizzled by key (chunk c of
// key r at c ^ (r & 7)): in QK the 8 lanes of a phase read one chunk index of 8 different keys,
// which land in 8 different bank groups. V rows are plain (PV reads one row across the warp).
// After the key loop the stages hold the warps' partial outputs for the merge. Static: the
// warps' m and l, and kv_s (the fused RoPE's K and V of the row, f16).
//
// Tail and edge keys: keys past the split's end are zero-filled (no stale NaN reaches PV) and
// masked to -inf before the softmax; keys of this step are converted from the QKV rows into the
// tile with ordinary shared stores (the wait_group + __syncthreads before the tile is computed
// orders both kinds of writes).
//
// Fused RoPE (`cs` not null; the host passes it only when every row is a decode, query_len 1):
// the QKV rows arrive as the QKV matmul wrote them, and each CTA applies rope_qkv's arithmetic
// (rope.cu: bias, then QK-norm, then the rotation; v gets the bias only) to what it needs of its
// own row: the GQA group's query heads (into q, scaled) and, on split 0 (the fused KV write) and
// on the split that holds the row's own key (position ctx - 1), its K and V head, rounded to f16
// into kv_s. The own key's tile row is taken from kv_s instead of the QKV row; a tile already
// issued in the prologue gets it stored by the rope step itself. The QKV rows are never written
// back (other CTAs read them concurrently), so a decode step launches no rope_qkv. The rope step
// runs after the prologue's copies are issued (their latency hides its global reads), each warp
// taking whole heads through a scratch row in the last stage, which the prologue leaves idle.
// Without `cs` the rows must come roped, and the kernel is correct for any row, prompt rows too.
#define DEC_TILE (4096 / HEAD_DIM)   // keys per tile: 64, 32, 16
#define DEC_KW (DEC_TILE / WARPS)    // keys per warp per tile: 16, 8, 4
#define DEC_QD (32 / DEC_KW)         // lanes per key in QK (HEAD_DIM / 32)
#define DEC_CPR (HEAD_DIM / 8)       // 16-byte chunks per key row
#define DEC_STAGES 3
#define DEC_STAGE_HALVES (2 * DEC_TILE * HEAD_DIM)
#define DEC_LOADS (DEC_TILE * DEC_CPR / (32 * WARPS))  // 16-byte chunks per thread per tile (4)
#define DEC_KSTEP (32 * WARPS / DEC_CPR)                // keys between a thread's chunks
#define DEC_QS (HEAD_DIM / 32 * 40)  // floats per q head in shared memory
#define DEC_SMEM (DEC_STAGES * DEC_STAGE_HALVES * 2 + GQA * DEC_QS * 4)
// Registers: 4 CTAs per SM cap a thread at 128, enough up to GQA 4 at HEAD_DIM 128 (acc holds
// GQA * DPL floats); larger groups take 3 (170) rather than spill.
#define DEC_MIN_CTAS (GQA > 4 || GQA * DPL > 16 ? 3 : 4)
static_assert(DEC_TILE * DEC_CPR % (32 * WARPS) == 0 && 32 * WARPS % DEC_CPR == 0,
              "whole chunks per thread, one chunk column per thread");
static_assert(WARPS * GQA * HEAD_DIM * 4 <= DEC_STAGES * DEC_STAGE_HALVES * 2, "merge fits the stages");
static_assert(WARPS * HEAD_DIM * 4 <= DEC_STAGE_HALVES * 2, "rope scratch fits one stage");

// rope_qkv's block: 128 threads, i.e. its QK-norm sum of squares is a sum over 4 warps.
#define ROPE_WARPS 4

// Bias, QK-norm and RoPE of one head of this row by one warp, as rope_qkv computes them: x holds
// dims lane + 32 * j (j < DPL), un-roped on entry, roped on exit.
// bias_h: the head's [HEAD_DIM] bias or null; nw: its [HEAD_DIM] norm weight or null;
// c: pairs lane, lane + 32, ... of the (cos, sin) at the row's position (RC_N per lane, loaded
// before the kernel's wait); rotate: a q or k head (v gets the bias only);
// buf: the warp's [HEAD_DIM] f32 scratch
#define RC_N (DPL / 2 > 0 ? DPL / 2 : 1)  // pairs <= HEAD_DIM / 2 = 16 * DPL: per lane, DPL / 2
__device__ __forceinline__ void rope_head(float* x, const float* __restrict__ bias_h,
                                          const float* __restrict__ nw, const float2 (&c)[RC_N],
                                          bool rotate, int pairs, int neox, float eps, float* buf) {
    const int lane = threadIdx.x & 31;
    if (bias_h) {
#pragma unroll
        for (int j = 0; j < DPL; j++) x[j] += bias_h[lane + 32 * j];
    }
    if (nw) {
        // rope_qkv's block_sum, group by group, for the same bits: its thread t (warp t / 32,
        // lane t % 32) sums dims t, t + 128, ... in order; each warp's sums meet in a butterfly,
        // then the 4 warp sums (and 28 zeros) in another.
        float wsum = 0.0f;
#pragma unroll
        for (int w = 0; w < ROPE_WARPS; w++) {
            float ss = 0.0f;
#pragma unroll
            for (int j = w; j < DPL; j += ROPE_WARPS) ss += x[j] * x[j];
            ss = warp_sum(ss);
            if (lane == w) wsum = ss;
        }
        const float ss = warp_sum(wsum);
        const float sc = rsqrtf(ss / HEAD_DIM + eps);
#pragma unroll
        for (int j = 0; j < DPL; j++) x[j] = x[j] * (sc * nw[lane + 32 * j]);
    }
    if (rotate) {  // pairs (i, i + pairs) for neox, else (2i, 2i + 1); dims >= 2 * pairs stay
#pragma unroll
        for (int j = 0; j < DPL; j++) buf[lane + 32 * j] = x[j];
        __syncwarp();
#pragma unroll
        for (int j = 0; j < RC_N; j++) {
            const int i = lane + 32 * j;
            if (i >= pairs) break;
            const int a = neox ? i : 2 * i, b = neox ? i + pairs : 2 * i + 1;
            const float x0 = buf[a], x1 = buf[b], co = c[j].x, si = c[j].y;
            buf[a] = fmaf(x0, co, -(x1 * si));
            buf[b] = fmaf(x0, si, x1 * co);
        }
        __syncwarp();
#pragma unroll
        for (int j = 0; j < DPL; j++) x[j] = buf[lane + 32 * j];
        __syncwarp();  // the warp's next head rewrites buf
    }
}

// DPL f16 values (DPL = 2, 4 or 8) from shared memory, one vector load.
__device__ __forceinline__ void load_dpl(const half_t* p, float* v) {
#if DPL == 2
    unpack2(*reinterpret_cast<const unsigned*>(p), v);
#elif DPL == 4
    const uint2 u = *reinterpret_cast<const uint2*>(p);
    unpack2(u.x, v);
    unpack2(u.y, v + 2);
#else
    const uint4 u = *reinterpret_cast<const uint4*>(p);
    unpack2(u.x, v);
    unpack2(u.y, v + 2);
    unpack2(u.z, v + 4);
    unpack2(u.w, v + 6);
#endif

}

// The first 17 arguments and their shapes: as paged_attention's (qkv rows un-roped when `cs` is
// set), then
// bias: [qkv_stride] (q | k | v) or null; q_norm, k_norm: [HEAD_DIM] or null;
// cs: [max_pos, pairs] (cos, sin), or null: the rows come roped; positions: [n];
// pairs: rope_dim / 2 (<= HEAD_DIM / 2); neox: pairs (i, i + pairs) rather than (2i, 2i + 1);
// eps: the QK-norm epsilon
// grid: (n, num_kv_heads, splits); block: 32 * WARPS; dynamic shared memory: DEC_SMEM bytes.
extern "C" __global__ void __launch_bounds__(32 * WARPS, DEC_MIN_CTAS)
paged_decode(const float* __restrict__ qkv, int qkv_stride, half_t* __restrict__ k_cache,
             half_t* __restrict__ v_cache, const int* __restrict__ row_seq,
             const SeqInfo* __restrict__ seqs, const int* __restrict__ block_tables,
             const int* __restrict__ slot_mapping, int num_kv_heads, int block_size_log2,
             float scale, int window, void* __restrict__ out, int out_f32,
             float* __restrict__ part_acc, float2* __restrict__ part_ml, int skip_qlen,
             const float* __restrict__ bias, const float* __restrict__ q_norm, const float* __restrict__ k_norm,
             const float2* __restrict__ cs, const int* __restrict__ positions, int pairs,
             int neox, float eps) {
    // With the fused RoPE the kernel before this one (the QKV matmul) wrote nothing but the QKV
    // rows: the metadata came from the host before the step, and the cached keys from earlier
    // steps, whose kernels are complete once this one runs (every kernel waits for the one before
    // it before letting the next start). So everything up to the rope step, block-table reads and
    // the first tiles' copies included, is done before waiting for the QKV rows, while the
    // matmul still runs. Without it the rows (and the KV write) come first.
    const bool fused = cs != nullptr;  // bias, QK-norm and RoPE applied here
    if (!fused) pdl_enter();
    extern __shared__ __align__(16) unsigned char dec_smem[];
    half_t* stages = reinterpret_cast<half_t*>(dec_smem);
    float* q_s = reinterpret_cast<float*>(dec_smem + DEC_STAGES * DEC_STAGE_HALVES * 2);
    __shared__ float m_s[WARPS * GQA], l_s[WARPS * GQA];
    __shared__ __align__(16) half_t kv_s[2][HEAD_DIM];  // fused RoPE: the row's K, V (f16)

    const int row = blockIdx.x, kvh = blockIdx.y, split = blockIdx.z, splits = gridDim.z;
    const int tid = threadIdx.x, lane = tid & 31, warp = tid >> 5;
    {  // A launch with less shared memory than this layout needs would corrupt it: fail loudly.
        unsigned dyn;
        asm("mov.u32 %0, %%dynamic_smem_size;" : "=r"(dyn));
        if (dyn < DEC_SMEM) __trap();
    }
    const int num_heads = num_kv_heads * GQA;
    const int q_size = num_heads * HEAD_DIM, kv_size = num_kv_heads * HEAD_DIM;
    const SeqInfo s = seqs[row_seq[row]];
    if (skip_qlen > 0 && s.query_len >= skip_qlen) return;  // a paged_prefill row
    const int first_new = s.seq_len - s.query_len;
    const int ctx = first_new + (row - s.query_start) + 1;  // causal: keys 0..=pos
    const float* qrow = qkv + (long)row * qkv_stride;

    if (split == 0 && !fused)  // the fused KV write (the fused RoPE's does it itself)
        write_step_kv(qrow, q_size, kv_size, kvh, k_cache, v_cache, slot_mapping[row], num_kv_heads);
    // Splits of whole tiles, each row dividing its own keys (see paged_attention).
    const int lo = window > 0 ? max(0, ctx - window) : 0;
    const int keys_per_split =
        ((ctx - lo + splits - 1) / splits + DEC_TILE - 1) / DEC_TILE * DEC_TILE;
    const int start = lo + split * keys_per_split;
    const int end = min(ctx, start + keys_per_split);
    const long part = ((long)row * num_heads + kvh * GQA) * splits + split;  // the group's head 0
    if (start >= end) {  // an empty split (never split 0): nothing to attend, an empty partial
        if (fused) pdl_enter();  // no global write before the wait
        if (tid < GQA) part_ml[part + (long)tid * splits] = make_float2(-INFINITY, 0.0f);
        return;
    }
    const int ntiles = (end - start + DEC_TILE - 1) / DEC_TILE;
    const int* bt = block_tables + s.bt_offset;
    const int block_mask = (1 << block_size_log2) - 1;

    // The loader: thread tid copies chunk column c = tid % DEC_CPR of keys key0 + i * DEC_KSTEP
    // (a warp copies whole rows, 16 bytes per lane); offsets within a stage are fixed per thread.
    const int c_ld = tid % DEC_CPR, key0 = tid / DEC_CPR;
    unsigned k_off[DEC_LOADS], v_off[DEC_LOADS];  // bytes from the stage's start
#pragma unroll
    for (int i = 0; i < DEC_LOADS; i++) {
        const int key = key0 + i * DEC_KSTEP;
        k_off[i] = (key * HEAD_DIM + ((c_ld ^ (key & 7)) << 3)) * 2;
        v_off[i] = ((DEC_TILE + key) * HEAD_DIM + (c_ld << 3)) * 2;
    }
    const unsigned stages_u32 = smem_u32(stages);
    // 32-bit slot math, one wide multiply-add per address: slots < 2^31, slot rows of < 2^31 bytes.
    const unsigned row_bytes = num_kv_heads * HEAD_DIM * 2;  // from one slot to the next
    const char* k_col = reinterpret_cast<const char*>(k_cache + kvh * HEAD_DIM + (c_ld << 3));
    const char* v_col = reinterpret_cast<const char*>(v_cache + kvh * HEAD_DIM + (c_ld << 3));
    const int cached_end = min(end, first_new);  // keys below come from the cache
    // Issues tile t's copies into stage t % DEC_STAGES.
    auto load_tile = [&](int t) {
        const int stage = t % DEC_STAGES;
        const unsigned sbase = stages_u32 + stage * DEC_STAGE_HALVES * 2;
        const int kbase = start + t * DEC_TILE + key0;
        if (start + (t + 1) * DEC_TILE <= cached_end) {
            // The common case, every key in the cache: block-table reads first (all in flight
            // together), then the copies.
            int blk[DEC_LOADS];
#pragma unroll
            for (int i = 0; i < DEC_LOADS; i++)
                blk[i] = bt[(kbase + i * DEC_KSTEP) >> block_size_log2];
#pragma unroll
            for (int i = 0; i < DEC_LOADS; i++) {
                const int j = kbase + i * DEC_KSTEP;
                const unsigned slot = ((unsigned)blk[i] << block_size_log2) + (j & block_mask);
                cp_async16(sbase + k_off[i], k_col + (size_t)slot * row_bytes);
                cp_async16(sbase + v_off[i], v_col + (size_t)slot * row_bytes);
            }
            return;
        }
        // A tile with keys of this step (converted from their QKV rows) or past the split's end
        // (zeros).
        unsigned char* sgen = dec_smem + stage * DEC_STAGE_HALVES * 2;
#pragma unroll
        for (int i = 0; i < DEC_LOADS; i++) {
            const int j = kbase + i * DEC_KSTEP;
            uint4* kd = reinterpret_cast<uint4*>(sgen + k_off[i]);
            uint4* vd = reinterpret_cast<uint4*>(sgen + v_off[i]);
            if (j < cached_end) {
                const unsigned slot =
                    ((unsigned)bt[j >> block_size_log2] << block_size_log2) + (j & block_mask);
                cp_async16(sbase + k_off[i], k_col + (size_t)slot * row_bytes);
                cp_async16(sbase + v_off[i], v_col + (size_t)slot * row_bytes);
            } else if (j < end) {
                if (!fused) {
                    const float* r = qkv + (long)(s.query_start + (j - first_new)) * qkv_stride +
                                     q_size + kvh * HEAD_DIM + (c_ld << 3);
                    *kd = pack8(r);
                    *vd = pack8(r + kv_size);
                } else if (t >= DEC_STAGES - 1) {
                    // The row's own key (j = ctx - 1), roped into kv_s before the key loop. A
                    // prologue tile gets it from the rope step instead.
                    *kd = *reinterpret_cast<const uint4*>(&kv_s[0][c_ld << 3]);
                    *vd = *reinterpret_cast<const uint4*>(&kv_s[1][c_ld << 3]);
                }
            } else {
                *kd = make_uint4(0, 0, 0, 0);
                *vd = make_uint4(0, 0, 0, 0);
            }
        }
    };
    // One commit group per tile slot, empty past the last tile, so wait_group counts stay fixed.
#pragma unroll
    for (int t = 0; t < DEC_STAGES - 1; t++) {
        if (t < ntiles) load_tile(t);
        cp_async_commit();
    }
    if (fused) {
        float2 c[RC_N];  // this lane's (cos, sin) pairs for the rope step, read before the wait
        const float2* cp = cs + (long)positions[row] * pairs;
#pragma unroll
        for (int j = 0; j < RC_N; j++)
            c[j] = lane + 32 * j < pairs ? cp[lane + 32 * j] : make_float2(1.0f, 0.0f);
        pdl_enter();  // the QKV rows are written from here on (see the top)
        // The rope step: warp w takes heads w, w + WARPS, ... of [q_0 .. q_{GQA-1}, k, v] (k and
        // v only where they are needed: the fused KV write on split 0, the own key's split).
        const bool own = end == ctx;        // this split holds the row's own key ...
        const int own_r = ctx - 1 - start;  // ... at this index of the split
        const bool patch = own && own_r < (DEC_STAGES - 1) * DEC_TILE;  // in a prologue tile
        const int r_p = patch ? own_r : 0;
        const int r_t = r_p % DEC_TILE;  // its key in tile r_p / DEC_TILE, in the stage of that index
        const int k_at = r_p / DEC_TILE * DEC_STAGE_HALVES + r_t * HEAD_DIM;
        const int v_at = k_at + DEC_TILE * HEAD_DIM;
        const long slot_row = ((long)slot_mapping[row] * num_kv_heads + kvh) * HEAD_DIM;
        float* buf = reinterpret_cast<float*>(stages + (DEC_STAGES - 1) * DEC_STAGE_HALVES) +
                     warp * HEAD_DIM;
        const int nh = GQA + (split == 0 || own ? 2 : 0);
        for (int h = warp; h < nh; h += WARPS) {
            const bool is_q = h < GQA, is_k = h == GQA;
            const int off = is_q ? (kvh * GQA + h) * HEAD_DIM
                                 : q_size + (is_k ? 0 : kv_size) + kvh * HEAD_DIM;
            float x[DPL];
#pragma unroll
            for (int j = 0; j < DPL; j++) x[j] = qrow[off + lane + 32 * j];
            rope_head(x, bias ? bias + off : nullptr, is_q ? q_norm : (is_k ? k_norm : nullptr), c,
                      h <= GQA, pairs, neox, eps, buf);
            if (is_q) {
#pragma unroll
                for (int j = 0; j < DPL; j++) q_s[h * DEC_QS + j * 40 + lane] = x[j] * scale;
                continue;
            }
#pragma unroll
            for (int j = 0; j < DPL; j++) {
                const int d = lane + 32 * j;
                const half_t v = f2h(x[j]);
                kv_s[is_k ? 0 : 1][d] = v;
                if (split == 0) (is_k ? k_cache : v_cache)[slot_row + d] = v;  // fused KV write
                if (patch)  // K rows swizzled by 16-byte chunk (see above), V rows plain
                    stages[is_k ? k_at + ((((d >> 3) ^ (r_t & 7)) << 3) | (d & 7)) : v_at + d] = v;
            }
        }
    } else {
        for (int i = tid; i < GQA * HEAD_DIM; i += blockDim.x) {
            const int g = i / HEAD_DIM, d = i % HEAD_DIM;
            q_s[g * DEC_QS + (d >> 5) * 40 + (d & 31)] = qrow[kvh * GQA * HEAD_DIM + i] * scale;
        }
    }

    const int kk = lane % DEC_KW, qd = lane / DEC_KW;
    const int my_key = warp * DEC_KW + kk;  // this lane's key in the tile during QK
    const float* q_mine = q_s + qd * 40;
    float m[GQA], l[GQA], acc[GQA][DPL];
#pragma unroll
    for (int g = 0; g < GQA; g++) {
        m[g] = -INFINITY;
        l[g] = 0.0f;
#pragma unroll
        for (int i = 0; i < DPL; i++) acc[g][i] = 0.0f;
    }

    for (int t = 0; t < ntiles; t++) {
        // Tile t has landed (this thread's copies), and after the barrier everyone's; every warp
        // is also done with tile t - 1, whose stage the next copies overwrite.
        cp_async_wait<DEC_STAGES - 2>();
        __syncthreads();
        if (t + DEC_STAGES - 1 < ntiles) load_tile(t + DEC_STAGES - 1);
        cp_async_commit();
        const half_t* kt = stages + (t % DEC_STAGES) * DEC_STAGE_HALVES;
        const half_t* vt = kt + DEC_TILE * HEAD_DIM;

        // QK: this lane's 32 dims (chunks qd * 4 .. + 4) of key my_key.
        float sc[GQA];
#pragma unroll
        for (int g = 0; g < GQA; g++) sc[g] = 0.0f;
#pragma unroll
        for (int c = 0; c < 4; c++) {
            const int lc = qd * 4 + c;
            const uint4 u =
                *reinterpret_cast<const uint4*>(kt + my_key * HEAD_DIM + ((lc ^ (my_key & 7)) << 3));
            float k[8];
            unpack2(u.x, k);
            unpack2(u.y, k + 2);
            unpack2(u.z, k + 4);
            unpack2(u.w, k + 6);
#pragma unroll
            for (int g = 0; g < GQA; g++) {
                const float4 qa = *reinterpret_cast<const float4*>(q_mine + g * DEC_QS + c * 8);
                const float4 qb = *reinterpret_cast<const float4*>(q_mine + g * DEC_QS + c * 8 + 4);
                sc[g] += qa.x * k[0] + qa.y * k[1] + qa.z * k[2] + qa.w * k[3] +
                         qb.x * k[4] + qb.y * k[5] + qb.z * k[6] + qb.w * k[7];
            }
        }
        // Join the DEC_QD partial sums of a key (lanes kk, kk + DEC_KW, ...), then the warp's
        // online softmax over its DEC_KW keys (lanes 0 .. DEC_KW - 1 hold them all).
        const bool valid = start + t * DEC_TILE + my_key < end;
        float p[GQA];
#pragma unroll
        for (int g = 0; g < GQA; g++) {
#pragma unroll
            for (int o = DEC_KW; o < 32; o <<= 1) sc[g] += __shfl_xor_sync(0xffffffffu, sc[g], o);
            const float x = valid ? sc[g] : -INFINITY;
            float mx = x;
#pragma unroll
            for (int o = 1; o < DEC_KW; o <<= 1) mx = fmaxf(mx, __shfl_xor_sync(0xffffffffu, mx, o));
            const float m_new = fmaxf(m[g], mx);
            const float m_ref = m_new == -INFINITY ? 0.0f : m_new;  // no valid key yet
            const float corr = __expf(m[g] - m_ref);
            p[g] = __expf(x - m_ref);
            float ps = p[g];
#pragma unroll
            for (int o = 1; o < DEC_KW; o <<= 1) ps += __shfl_xor_sync(0xffffffffu, ps, o);
            l[g] = l[g] * corr + ps;
            m[g] = m_new;
#pragma unroll
            for (int i = 0; i < DPL; i++) acc[g][i] *= corr;
        }
        // PV over the warp's keys; key k2's p sits in lane k2.
#pragma unroll
        for (int k2 = 0; k2 < DEC_KW; k2++) {
            float v[DPL];
            load_dpl(vt + (warp * DEC_KW + k2) * HEAD_DIM + lane * DPL, v);
#pragma unroll
            for (int g = 0; g < GQA; g++) {
                const float pk = __shfl_sync(0xffffffffu, p[g], k2);
#pragma unroll
                for (int i = 0; i < DPL; i++) acc[g][i] = fmaf(pk, v[i], acc[g][i]);
            }
        }
    }

    // Merge the warps, their partial outputs parked in the (now idle) stages.
    cp_async_wait<0>();
    __syncthreads();
    float* acc_s = reinterpret_cast<float*>(dec_smem);  // [WARPS][GQA][HEAD_DIM]
#pragma unroll
    for (int g = 0; g < GQA; g++) {
#pragma unroll
        for (int i = 0; i < DPL; i++) acc_s[(warp * GQA + g) * HEAD_DIM + lane * DPL + i] = acc[g][i];
        if (lane == 0) {
            m_s[warp * GQA + g] = m[g];
            l_s[warp * GQA + g] = l[g];
        }
    }
    __syncthreads();
    merge_warps(acc_s, m_s, l_s, row, kvh, q_size, splits, part, out, out_f32, part_acc, part_ml);
}
