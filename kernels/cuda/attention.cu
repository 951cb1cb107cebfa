// attention.cu: FlashAttention-2-style attention over query/key segments (varlen
// self-attention and context-parallel ranges), forward and backward, never holding more
// than one (32, 32) score tile per block.
//
// Work is a segment table `segs` (4 u32 per segment: q_start, q_len, k_start, k_len; the
// host builds it from cu_seqlens or QkSegments) and a tile table (2 u32 per tile: segment,
// first row of the tile relative to the segment's start; built on the host). Causal masks
// are bottom-right aligned as on the CPU: query i of a segment sees key j iff
// j <= k_len - q_len + i. Scores are kept pre-multiplied by log2(e) so the softmax uses
// exp2f; lse is returned in natural log. T is float or bf16_t; all math is f32.
//
// The bf16 forward for HS = 64, 80, 96, 128 runs on tensor cores (att_fwd_tc, at the end).
// SIMT kernels (f32 exact path, also the bf16 backward and other bf16 head sizes): 128 threads, tiles of BR = 32
// query rows x BC = 32 key rows. Thread t owns row t / 4 of the tile and, of the other
// axis, columns (t % 4) + 4 j (scores) / head channels (t % 4) + 4 i (accumulators); the
// four threads of a row are consecutive lanes, so row reductions and broadcasts of a
// row's probabilities are warp shuffles. Shared tiles have an odd row stride (hs | 1) so
// the 8 rows a warp reads at once fall in 8 different banks.
#include "common.cuh"

#define ATT_BR 32
#define ATT_BC 32
#define ATT_THREADS 128
#define ATT_LOG2E 1.4426950408889634f
#define ATT_LN2 0.6931471805599453f

// The segment of one tile, read from the tables.
struct AttSeg {
    int q_start, q_len, k_start, k_len;
    int off;  // causal diagonal shift k_len - q_len (>= 0: validated on the host)
};

__device__ __forceinline__ AttSeg att_seg(const u32* segs, u32 s) {
    AttSeg g;
    g.q_start = (int)segs[4 * s];
    g.q_len = (int)segs[4 * s + 1];
    g.k_start = (int)segs[4 * s + 2];
    g.k_len = (int)segs[4 * s + 3];
    g.off = g.k_len - g.q_len;
    return g;
}

// Query i sees key j (both relative to the segment's starts).
__device__ __forceinline__ bool att_visible(const AttSeg& g, int i, int j, int causal) {
    return i < g.q_len && j < g.k_len && (!causal || j <= g.off + i);
}

// dst (rows, ld) <- rows row0 .. row0 + n of head h of src (T, heads, hs); rows n ..
// rows are zero. Called by the whole block (no barrier inside).
// Columns hs .. W are zero too, so that products over all W channels add nothing for them.
template <typename T, int W>
__device__ __forceinline__ void att_load_tile(float* dst, int ld, const T* src, int row0, int n, int heads,
                                              int h, int hs, int rows) {
    for (int idx = threadIdx.x; idx < rows * W; idx += ATT_THREADS) {
        int r = idx / W, e = idx - r * W;
        float x = 0.0f;
        if (r < n && e < hs) x = load_f(src, ((i64)(row0 + r) * heads + h) * hs + e);
        dst[r * ld + e] = x;
    }
}

// lse in log2 units for the backward; a row that saw no key (lse = -inf, impossible for
// validated segments) gets +inf so that its probabilities are 0, not NaN.
__device__ __forceinline__ float att_lse2(float lse) {
    float l2 = lse * ATT_LOG2E;
    return l2 == BRAID_NEG_INF ? BRAID_INF : l2;
}

// ---------------------------------------------------------------------------------------
// Forward. Grid (tiles, NH); block ATT_THREADS; dynamic shared 3 * 32 * (HSMAX | 1) floats.
// out (Tq, NH, HS), lse (NH, Tq) f32.
template <typename T, int HSMAX, bool EXACT>
__device__ __forceinline__ void att_fwd(T* out, float* lse, const T* q, const T* k, const T* v, const u32* segs,
                                        const u32* tiles, int nh, int nkv, int tq, int hs_arg, float scale,
                                        int causal) {
    constexpr int NE = HSMAX / 4;   // accumulator channels per thread
    constexpr int ld = HSMAX | 1;  // shared row stride (odd)
    const int hs = EXACT ? HSMAX : hs_arg;
    extern __shared__ float att_smem[];
    float* qs = att_smem;          // (BR, ld)
    float* ks = qs + ATT_BR * ld;  // (BC, ld)
    float* vs = ks + ATT_BC * ld;  // (BC, ld)

    const AttSeg g = att_seg(segs, tiles[2 * blockIdx.x]);
    const int q0 = (int)tiles[2 * blockIdx.x + 1];
    const int h = blockIdx.y, kvh = h / (nh / nkv);
    const int tid = threadIdx.x, r = tid >> 2, q4 = tid & 3;
    const int i = q0 + r;  // this thread's query row, relative to the segment
    const int q1 = min(q0 + ATT_BR, g.q_len);
    // Causal: keys from off + q1 on are hidden from every row of the tile.
    const int kend = causal ? min(g.off + q1, g.k_len) : g.k_len;
    const float sl2 = scale * ATT_LOG2E;

    att_load_tile<T, HSMAX>(qs, ld, q, g.q_start + q0, q1 - q0, nh, h, hs, ATT_BR);
    float o[NE];
#pragma unroll
    for (int ii = 0; ii < NE; ++ii) o[ii] = 0.0f;
    float m = BRAID_NEG_INF, l = 0.0f;  // running max (log2 units) and sum of exp2(s - m)

    for (int k0 = 0; k0 < kend; k0 += ATT_BC) {
        const int nk = min(ATT_BC, kend - k0);
        __syncthreads();  // the previous tile's K/V are no longer read
        att_load_tile<T, HSMAX>(ks, ld, k, g.k_start + k0, nk, nkv, kvh, hs, ATT_BC);
        att_load_tile<T, HSMAX>(vs, ld, v, g.k_start + k0, nk, nkv, kvh, hs, ATT_BC);
        __syncthreads();
        float s[8];  // scores of keys k0 + q4 + 4 j
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j] = 0.0f;
        for (int e = 0; e < hs; ++e) {
            const float qv = qs[r * ld + e];
#pragma unroll
            for (int j = 0; j < 8; ++j) s[j] = fmaf(qv, ks[(q4 + 4 * j) * ld + e], s[j]);
        }
        float mt = BRAID_NEG_INF;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j] = att_visible(g, i, k0 + q4 + 4 * j, causal) ? s[j] * sl2 : BRAID_NEG_INF;
            mt = fmaxf(mt, s[j]);
        }
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 1));
        mt = fmaxf(mt, __shfl_xor_sync(0xffffffffu, mt, 2));
        const float m_new = fmaxf(m, mt);
        // All keys so far hidden: shift by 0, so every exp2 below is exp2(-inf) = 0.
        const float m_use = m_new == BRAID_NEG_INF ? 0.0f : m_new;
        const float corr = exp2f(m - m_use);  // 0 on the first visible tile (m = -inf)
        float ls = 0.0f;
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            s[j] = exp2f(s[j] - m_use);
            ls += s[j];
        }
        ls += __shfl_xor_sync(0xffffffffu, ls, 1);
        ls += __shfl_xor_sync(0xffffffffu, ls, 2);
        l = l * corr + ls;
        m = m_new;
#pragma unroll
        for (int ii = 0; ii < NE; ++ii) o[ii] *= corr;
        // o[r, e] += sum_c p[r, c] v[c, e]; p[r, c] lives in lane (row's first) + c % 4.
#pragma unroll
        for (int c = 0; c < ATT_BC; ++c) {
            const float p = __shfl_sync(0xffffffffu, s[c >> 2], (tid & 28) | (c & 3));
#pragma unroll
            for (int ii = 0; ii < NE; ++ii) {
                const int e = q4 + 4 * ii;
                o[ii] = fmaf(p, vs[c * ld + e], o[ii]);
            }
        }
    }
    if (i < g.q_len) {
        // Every validated row sees a key, so l > 0; the guard keeps a row without one at
        // out = 0, lse = -inf instead of NaN.
        const float inv = l > 0.0f ? 1.0f / l : 0.0f;
        const i64 row = (i64)(g.q_start + i);
        const i64 base = (row * nh + h) * hs;
#pragma unroll
        for (int ii = 0; ii < NE; ++ii) {
            const int e = q4 + 4 * ii;
            if (e < hs) store_f(out, base + e, o[ii] * inv);
        }
        if (q4 == 0) lse[(i64)h * tq + row] = l > 0.0f ? (m + log2f(l)) * ATT_LN2 : BRAID_NEG_INF;
    }
}

// ---------------------------------------------------------------------------------------
// D = rowsum(dout * out): dsum (NH, Tq) f32. One warp per (t, h) row, 8 warps a block.
template <typename T>
__device__ __forceinline__ void att_dsum(float* dsum, const T* dout, const T* out, int tq, int nh, int hs) {
    const i64 row = (i64)blockIdx.x * (blockDim.x >> 5) + (threadIdx.x >> 5);  // t * NH + h
    const int lane = threadIdx.x & 31;
    if (row >= (i64)tq * nh) return;  // the whole warp leaves together
    float acc = 0.0f;
    for (int e = lane; e < hs; e += 32) acc = fmaf(load_f(dout, row * hs + e), load_f(out, row * hs + e), acc);
    acc = warp_sum(acc);
    const i64 t = row / nh, h = row - t * nh;
    if (lane == 0) dsum[h * tq + t] = acc;
}

// ---------------------------------------------------------------------------------------
// dQ over query tiles: dq = scale * sum_keys dS k, dS = P * (dP - D), dP = dO v^T.
// Grid (tiles, NH); dynamic shared 4 * 32 * (HSMAX | 1) floats. dq (Tq, NH, HS).
template <typename T, int HSMAX, bool EXACT>
__device__ __forceinline__ void att_bwd_dq(T* dq, const T* dout, const T* q, const T* k, const T* v,
                                           const float* lse, const float* dsum, const u32* segs, const u32* tiles,
                                           int nh, int nkv, int tq, int hs_arg, float scale, int causal) {
    constexpr int NE = HSMAX / 4;
    constexpr int ld = HSMAX | 1;
    const int hs = EXACT ? HSMAX : hs_arg;
    extern __shared__ float att_smem[];
    float* qs = att_smem;            // (BR, ld)
    float* dos = qs + ATT_BR * ld;   // (BR, ld)
    float* ks = dos + ATT_BR * ld;   // (BC, ld)
    float* vs = ks + ATT_BC * ld;    // (BC, ld)

    const AttSeg g = att_seg(segs, tiles[2 * blockIdx.x]);
    const int q0 = (int)tiles[2 * blockIdx.x + 1];
    const int h = blockIdx.y, kvh = h / (nh / nkv);
    const int tid = threadIdx.x, r = tid >> 2, q4 = tid & 3;
    const int i = q0 + r;
    const int q1 = min(q0 + ATT_BR, g.q_len);
    const int kend = causal ? min(g.off + q1, g.k_len) : g.k_len;
    const float sl2 = scale * ATT_LOG2E;
    const i64 row = (i64)(g.q_start + i);

    att_load_tile<T, HSMAX>(qs, ld, q, g.q_start + q0, q1 - q0, nh, h, hs, ATT_BR);
    att_load_tile<T, HSMAX>(dos, ld, dout, g.q_start + q0, q1 - q0, nh, h, hs, ATT_BR);
    const float lse2 = i < g.q_len ? att_lse2(lse[(i64)h * tq + row]) : 0.0f;
    const float dd = i < g.q_len ? dsum[(i64)h * tq + row] : 0.0f;
    float acc[NE];
#pragma unroll
    for (int ii = 0; ii < NE; ++ii) acc[ii] = 0.0f;

    for (int k0 = 0; k0 < kend; k0 += ATT_BC) {
        const int nk = min(ATT_BC, kend - k0);
        __syncthreads();
        att_load_tile<T, HSMAX>(ks, ld, k, g.k_start + k0, nk, nkv, kvh, hs, ATT_BC);
        att_load_tile<T, HSMAX>(vs, ld, v, g.k_start + k0, nk, nkv, kvh, hs, ATT_BC);
        __syncthreads();
        float s[8], dp[8];  // keys k0 + q4 + 4 j: scores, then dS; dO . v
#pragma unroll
        for (int j = 0; j < 8; ++j) s[j] = dp[j] = 0.0f;
        for (int e = 0; e < hs; ++e) {
            const float qv = qs[r * ld + e], dv = dos[r * ld + e];
#pragma unroll
            for (int j = 0; j < 8; ++j) {
                s[j] = fmaf(qv, ks[(q4 + 4 * j) * ld + e], s[j]);
                dp[j] = fmaf(dv, vs[(q4 + 4 * j) * ld + e], dp[j]);
            }
        }
#pragma unroll
        for (int j = 0; j < 8; ++j) {
            const float p = att_visible(g, i, k0 + q4 + 4 * j, causal) ? exp2f(s[j] * sl2 - lse2) : 0.0f;
            s[j] = p * (dp[j] - dd);
        }
#pragma unroll
        for (int c = 0; c < ATT_BC; ++c) {
            const float ds = __shfl_sync(0xffffffffu, s[c >> 2], (tid & 28) | (c & 3));
#pragma unroll
            for (int ii = 0; ii < NE; ++ii) {
                const int e = q4 + 4 * ii;
                acc[ii] = fmaf(ds, ks[c * ld + e], acc[ii]);
            }
        }
    }
    if (i < g.q_len) {
        const i64 base = (row * nh + h) * hs;
#pragma unroll
        for (int ii = 0; ii < NE; ++ii) {
            const int e = q4 + 4 * ii;
            if (e < hs) store_f(dq, base + e, acc[ii] * scale);
        }
    }
}

// ---------------------------------------------------------------------------------------
// dK, dV over key tiles: for its 32 keys of kv head blockIdx.y, the block loops over the
// group's query heads, then the segment's query tiles (a fixed order), and ADDS the sums
// into dk, dv (Tk, NKV, HS) f32 (zeroed by the host). Tiles of one launch touch disjoint
// rows; segments whose key ranges overlap go to later launches, in segment order, so
// shared key rows sum their segments' grads in that order, deterministically.
// Grid (tiles of this launch, NKV); dynamic shared 4 * 32 * (HSMAX | 1) + 64 floats.
template <typename T, int HSMAX, bool EXACT>
__device__ __forceinline__ void att_bwd_dkv(float* dk, float* dv, const T* dout, const T* q, const T* k,
                                            const T* v, const float* lse, const float* dsum, const u32* segs,
                                            const u32* tiles, int tile_base, int nh, int nkv, int tq, int hs_arg,
                                            float scale, int causal) {
    constexpr int NE = HSMAX / 4;
    constexpr int ld = HSMAX | 1;
    const int hs = EXACT ? HSMAX : hs_arg;
    extern __shared__ float att_smem[];
    float* ks = att_smem;              // (BC, ld)
    float* vs = ks + ATT_BC * ld;      // (BC, ld)
    float* qs = vs + ATT_BC * ld;      // (BR, ld)
    float* dos = qs + ATT_BR * ld;     // (BR, ld)
    float* lse2s = dos + ATT_BR * ld;  // (BR)
    float* dds = lse2s + ATT_BR;       // (BR)

    const u32 tile = (u32)tile_base + blockIdx.x;
    const AttSeg g = att_seg(segs, tiles[2 * tile]);
    const int k0 = (int)tiles[2 * tile + 1];
    const int kvh = blockIdx.y, group = nh / nkv;
    const int tid = threadIdx.x, c = tid >> 2, q4 = tid & 3;
    const int j = k0 + c;  // this thread's key row, relative to the segment
    const int nk = min(ATT_BC, g.k_len - k0);
    const float sl2 = scale * ATT_LOG2E;
    // Causal: query tiles wholly before the first query that sees key k0 are skipped
    // (query i sees k0 iff i >= k0 - off); tiles start at multiples of BR as in dQ.
    const int qbeg = (causal && k0 > g.off) ? ((k0 - g.off) / ATT_BR) * ATT_BR : 0;

    att_load_tile<T, HSMAX>(ks, ld, k, g.k_start + k0, nk, nkv, kvh, hs, ATT_BC);
    att_load_tile<T, HSMAX>(vs, ld, v, g.k_start + k0, nk, nkv, kvh, hs, ATT_BC);
    float dka[NE], dva[NE];
#pragma unroll
    for (int ii = 0; ii < NE; ++ii) dka[ii] = dva[ii] = 0.0f;

    for (int h = kvh * group; h < (kvh + 1) * group; ++h) {
        for (int q0 = qbeg; q0 < g.q_len; q0 += ATT_BR) {
            const int nq = min(ATT_BR, g.q_len - q0);
            __syncthreads();  // the previous query tile is no longer read
            att_load_tile<T, HSMAX>(qs, ld, q, g.q_start + q0, nq, nh, h, hs, ATT_BR);
            att_load_tile<T, HSMAX>(dos, ld, dout, g.q_start + q0, nq, nh, h, hs, ATT_BR);
            if (tid < ATT_BR) {
                const i64 at = (i64)h * tq + g.q_start + q0 + tid;
                lse2s[tid] = tid < nq ? att_lse2(lse[at]) : 0.0f;
                dds[tid] = tid < nq ? dsum[at] : 0.0f;
            }
            __syncthreads();
            float p[8], ds[8];  // query rows q0 + q4 + 4 jj: scores then P; dP then dS
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) p[jj] = ds[jj] = 0.0f;
            for (int e = 0; e < hs; ++e) {
                const float kv_ = ks[c * ld + e], vv = vs[c * ld + e];
#pragma unroll
                for (int jj = 0; jj < 8; ++jj) {
                    p[jj] = fmaf(kv_, qs[(q4 + 4 * jj) * ld + e], p[jj]);
                    ds[jj] = fmaf(vv, dos[(q4 + 4 * jj) * ld + e], ds[jj]);
                }
            }
#pragma unroll
            for (int jj = 0; jj < 8; ++jj) {
                const int rl = q4 + 4 * jj;
                const float pv = att_visible(g, q0 + rl, j, causal) ? exp2f(p[jj] * sl2 - lse2s[rl]) : 0.0f;
                p[jj] = pv;
                ds[jj] = pv * (ds[jj] - dds[rl]);
            }
            // dv[c, e] += sum_r P[r, c] dO[r, e]; dk[c, e] += sum_r dS[r, c] q[r, e].
#pragma unroll
            for (int rl = 0; rl < ATT_BR; ++rl) {
                const int src = (tid & 28) | (rl & 3);
                const float pv = __shfl_sync(0xffffffffu, p[rl >> 2], src);
                const float dsv = __shfl_sync(0xffffffffu, ds[rl >> 2], src);
#pragma unroll
                for (int ii = 0; ii < NE; ++ii) {
                    const int e = q4 + 4 * ii;
                    dva[ii] = fmaf(pv, dos[rl * ld + e], dva[ii]);
                    dka[ii] = fmaf(dsv, qs[rl * ld + e], dka[ii]);
                }
            }
        }
    }
    if (c < nk) {
        const i64 base = ((i64)(g.k_start + j) * nkv + kvh) * hs;
#pragma unroll
        for (int ii = 0; ii < NE; ++ii) {
            const int e = q4 + 4 * ii;
            if (e < hs) {
                dk[base + e] += dka[ii] * scale;
                dv[base + e] += dva[ii];
            }
        }
    }
}

// ---------------------------------------------------------------------------------------
// Exported SIMT kernels, one per (head-size variant, dtype): EXACT variants have hs ==
// HSMAX (loops of constant length); the others take any hs <= HSMAX, the shared tiles'
// channels hs .. HSMAX being zero. Launch bounds: at least 4 blocks of 128 threads per SM
// (<= 128 registers; shared memory allows 3-4 such blocks at HS = 128 anyway), 3 for dK/dV,
// which holds two accumulator rows (<= 170 registers, no spills).
#define BRAID_ATT_SIMT(HSNAME, HSMAX, EXACT, SUFFIX, T)                                                         \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 4) braid_attention_fwd_##HSNAME##_##SUFFIX(        \
        T* out, float* lse, const T* q, const T* k, const T* v, const u32* segs, const u32* tiles, int nh,     \
        int nkv, int tq, int hs, float scale, int causal) {                                                     \
        att_fwd<T, HSMAX, EXACT>(out, lse, q, k, v, segs, tiles, nh, nkv, tq, hs, scale, causal);               \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 4) braid_attention_bwd_dq_##HSNAME##_##SUFFIX(     \
        T* dq, const T* dout, const T* q, const T* k, const T* v, const float* lse, const float* dsum,          \
        const u32* segs, const u32* tiles, int nh, int nkv, int tq, int hs, float scale, int causal) {          \
        att_bwd_dq<T, HSMAX, EXACT>(dq, dout, q, k, v, lse, dsum, segs, tiles, nh, nkv, tq, hs, scale, causal); \
    }                                                                                                           \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 3) braid_attention_bwd_dkv_##HSNAME##_##SUFFIX(    \
        float* dk, float* dv, const T* dout, const T* q, const T* k, const T* v, const float* lse,              \
        const float* dsum, const u32* segs, const u32* tiles, int tile_base, int nh, int nkv, int tq, int hs,   \
        float scale, int causal) {                                                                              \
        att_bwd_dkv<T, HSMAX, EXACT>(dk, dv, dout, q, k, v, lse, dsum, segs, tiles, tile_base, nh, nkv, tq, hs, \
                                     scale, causal);                                                            \
    }

#define BRAID_ATT_SIMT_ALL(SUFFIX, T)                                                                           \
    BRAID_ATT_SIMT(hs64, 64, true, SUFFIX, T)                                                                   \
    BRAID_ATT_SIMT(hs80, 80, true, SUFFIX, T)                                                                   \
    BRAID_ATT_SIMT(hs96, 96, true, SUFFIX, T)                                                                   \
    BRAID_ATT_SIMT(hs128, 128, true, SUFFIX, T)                                                                 \
    BRAID_ATT_SIMT(le32, 32, false, SUFFIX, T)                                                                  \
    BRAID_ATT_SIMT(le64, 64, false, SUFFIX, T)                                                                  \
    BRAID_ATT_SIMT(le128, 128, false, SUFFIX, T)                                                                \
    extern "C" __global__ void braid_attention_dsum_##SUFFIX(float* dsum, const T* dout, const T* out, int tq, \
                                                             int nh, int hs) {                                  \
        att_dsum(dsum, dout, out, tq, nh, hs);                                                                  \
    }

BRAID_ATT_SIMT_ALL(f32, float)
BRAID_ATT_SIMT_ALL(bf16, bf16_t)

// ---------------------------------------------------------------------------------------
// bf16 forward on tensor cores: mma.sync m16n8k16 (bf16 in, f32 accumulate), FA2-style.
// Block: 4 warps, a tile of TC_BR = 64 query rows (16 per warp) of one head; key tiles of
// TC_BC = 64. D = HS in {64, 80, 96, 128} (a multiple of 16). Per warp, in registers: Q's A fragments, the S
// block (16, 64) as C fragments, which are reused as P's A fragments for P V (the C
// layout of m16n8k16 is the A layout of the next product), and O (16, D).
// Shared (bf16): K tile (64, D + 8) row-major, also holding Q at the start; V tile
// transposed (D, 64 + 8), so every fragment is a 32-bit load, and the +8 pads put the 8
// rows a fragment load touches in distinct banks. Grid (64-row tiles, NH); block 128;
// static shared 64 * (D + 8) * 2 + D * 72 * 2 bytes (<= 36 KiB).
//
// Fragment layouts (PTX ISA, mma.m16n8k16 .bf16; g = lane / 4, t = lane % 4; each 32-bit
// register holds two bf16, the lower index in the low half):
//   A (16 x 16, row-major):  a0 (g, 2t..), a1 (g + 8, 2t..), a2 (g, 2t + 8..), a3 (g + 8, 2t + 8..)
//   B (16 x 8, "col"):        b0 (k = 2t.., n = g), b1 (k = 2t + 8.., n = g)
//   C (16 x 8, f32):          c0, c1 (g, 2t, 2t + 1), c2, c3 (g + 8, 2t, 2t + 1)
#define TC_BR 64
#define TC_BC 64
#define TC_LDV (TC_BC + 8)

struct alignas(16) AttU4 {
    u32 x, y, z, w;
};

__device__ __forceinline__ void att_mma(float* c, const u32* a, u32 b0, u32 b1) {
    asm("mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, "
        "{%0, %1, %2, %3};"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
}

// Two f32 -> bf16x2 (round to nearest even): lo in the low half.
__device__ __forceinline__ u32 att_pack_bf16(float lo, float hi) {
    u32 r;
    asm("cvt.rn.bf16x2.f32 %0, %1, %2;" : "=r"(r) : "f"(hi), "f"(lo));
    return r;
}

__device__ __forceinline__ u32 att_ld32(const bf16_t* p) { return *reinterpret_cast<const u32*>(p); }

// dst (64, D + 8) bf16 <- rows row0 .. row0 + n of head h of src (T, heads, D); rows n ..
// 64 zero. 16-byte loads: rows are D * 2 bytes, D a multiple of 8, buffers 256-byte aligned.
template <int D>
__device__ __forceinline__ void att_tc_load_rows(bf16_t* dst, const bf16_t* src, int row0, int n, int heads, int h) {
    constexpr int V = D / 8;  // 16-byte vectors per row
    for (int idx = threadIdx.x; idx < 64 * V; idx += ATT_THREADS) {
        const int r = idx / V, c = idx - r * V;
        AttU4 x = {0u, 0u, 0u, 0u};
        if (r < n) x = reinterpret_cast<const AttU4*>(src + ((i64)(row0 + r) * heads + h) * D)[c];
        *reinterpret_cast<AttU4*>(dst + r * (D + 8) + c * 8) = x;
    }
}

// dst (D, 64 + 8) bf16 <- the same rows transposed: dst[ch][row].
template <int D>
__device__ __forceinline__ void att_tc_load_rows_t(bf16_t* dst, const bf16_t* src, int row0, int n, int heads, int h) {
    constexpr int V = D / 8;
    for (int idx = threadIdx.x; idx < 64 * V; idx += ATT_THREADS) {
        const int r = idx / V, c = idx - r * V;
        AttU4 x = {0u, 0u, 0u, 0u};
        if (r < n) x = reinterpret_cast<const AttU4*>(src + ((i64)(row0 + r) * heads + h) * D)[c];
        const u32 w[4] = {x.x, x.y, x.z, x.w};
#pragma unroll
        for (int u = 0; u < 4; ++u) {
            dst[(c * 8 + 2 * u) * TC_LDV + r] = (bf16_t)(w[u] & 0xffffu);
            dst[(c * 8 + 2 * u + 1) * TC_LDV + r] = (bf16_t)(w[u] >> 16);
        }
    }
}

template <int D>
__device__ __forceinline__ void att_fwd_tc(bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k,
                                           const bf16_t* v, const u32* segs, const u32* tiles, int nh, int nkv,
                                           int tq, float scale, int causal) {
    constexpr int LD = D + 8;
    constexpr int KC = D / 16;  // k-steps over channels
    constexpr int DN = D / 8;   // n-tiles over channels
    constexpr int NT = TC_BC / 8;  // n-tiles over keys
    __shared__ __align__(16) bf16_t ks[TC_BR * LD];     // K tile (64, LD); Q first
    __shared__ __align__(16) bf16_t vts[D * TC_LDV];    // V tile transposed (D, 72)

    const AttSeg g = att_seg(segs, tiles[2 * blockIdx.x]);
    const int q0 = (int)tiles[2 * blockIdx.x + 1];
    const int h = blockIdx.y, kvh = h / (nh / nkv);
    const int lane = threadIdx.x & 31, warp = threadIdx.x >> 5;
    const int gr = lane >> 2, t4 = lane & 3;
    const int i0 = q0 + warp * 16 + gr, i1 = i0 + 8;  // this thread's two query rows
    const int q1 = min(q0 + TC_BR, g.q_len);
    const int kend = causal ? min(g.off + q1, g.k_len) : g.k_len;
    const float sl2 = scale * ATT_LOG2E;

    // Q -> shared -> A fragments (kept in registers for the whole tile).
    att_tc_load_rows<D>(ks, q, g.q_start + q0, q1 - q0, nh, h);
    __syncthreads();
    u32 qa[KC][4];
    {
        const bf16_t* qw = ks + (warp * 16 + gr) * LD + 2 * t4;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
            qa[kc][0] = att_ld32(qw + 16 * kc);
            qa[kc][1] = att_ld32(qw + 8 * LD + 16 * kc);
            qa[kc][2] = att_ld32(qw + 16 * kc + 8);
            qa[kc][3] = att_ld32(qw + 8 * LD + 16 * kc + 8);
        }
    }
    float o[DN][4];
#pragma unroll
    for (int dn = 0; dn < DN; ++dn) o[dn][0] = o[dn][1] = o[dn][2] = o[dn][3] = 0.0f;
    float m0 = BRAID_NEG_INF, m1 = BRAID_NEG_INF, l0 = 0.0f, l1 = 0.0f;  // rows i0, i1

    for (int k0 = 0; k0 < kend; k0 += TC_BC) {
        const int nk = min(TC_BC, kend - k0);
        __syncthreads();  // Q fragments / the previous tile are no longer read
        att_tc_load_rows<D>(ks, k, g.k_start + k0, nk, nkv, kvh);
        att_tc_load_rows_t<D>(vts, v, g.k_start + k0, nk, nkv, kvh);
        __syncthreads();
        float s[NT][4];  // S (16, 64) of this warp: keys k0 + 8 nt + 2 t4 + {0, 1}
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) s[nt][0] = s[nt][1] = s[nt][2] = s[nt][3] = 0.0f;
#pragma unroll
        for (int kc = 0; kc < KC; ++kc) {
#pragma unroll
            for (int nt = 0; nt < NT; ++nt) {
                const bf16_t* kp = ks + (8 * nt + gr) * LD + 16 * kc + 2 * t4;
                att_mma(s[nt], qa[kc], att_ld32(kp), att_ld32(kp + 8));
            }
        }
        float mx0 = BRAID_NEG_INF, mx1 = BRAID_NEG_INF;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                const int j = k0 + 8 * nt + 2 * t4 + u;
                s[nt][u] = att_visible(g, i0, j, causal) ? s[nt][u] * sl2 : BRAID_NEG_INF;
                s[nt][2 + u] = att_visible(g, i1, j, causal) ? s[nt][2 + u] * sl2 : BRAID_NEG_INF;
                mx0 = fmaxf(mx0, s[nt][u]);
                mx1 = fmaxf(mx1, s[nt][2 + u]);
            }
        }
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 1));
        mx0 = fmaxf(mx0, __shfl_xor_sync(0xffffffffu, mx0, 2));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 1));
        mx1 = fmaxf(mx1, __shfl_xor_sync(0xffffffffu, mx1, 2));
        const float mn0 = fmaxf(m0, mx0), mn1 = fmaxf(m1, mx1);
        const float mu0 = mn0 == BRAID_NEG_INF ? 0.0f : mn0, mu1 = mn1 == BRAID_NEG_INF ? 0.0f : mn1;
        const float c0 = exp2f(m0 - mu0), c1 = exp2f(m1 - mu1);
        float ls0 = 0.0f, ls1 = 0.0f;
#pragma unroll
        for (int nt = 0; nt < NT; ++nt) {
#pragma unroll
            for (int u = 0; u < 2; ++u) {
                s[nt][u] = exp2f(s[nt][u] - mu0);
                s[nt][2 + u] = exp2f(s[nt][2 + u] - mu1);
                ls0 += s[nt][u];
                ls1 += s[nt][2 + u];
            }
        }
        ls0 += __shfl_xor_sync(0xffffffffu, ls0, 1);
        ls0 += __shfl_xor_sync(0xffffffffu, ls0, 2);
        ls1 += __shfl_xor_sync(0xffffffffu, ls1, 1);
        ls1 += __shfl_xor_sync(0xffffffffu, ls1, 2);
        l0 = l0 * c0 + ls0;
        l1 = l1 * c1 + ls1;
        m0 = mn0;
        m1 = mn1;
#pragma unroll
        for (int dn = 0; dn < DN; ++dn) {
            o[dn][0] *= c0;
            o[dn][1] *= c0;
            o[dn][2] *= c1;
            o[dn][3] *= c1;
        }
        // O += P V: P's A fragment of keys 16 kk .. 16 kk + 15 is S's C fragments 2 kk, 2 kk + 1.
#pragma unroll
        for (int kk = 0; kk < TC_BC / 16; ++kk) {
            u32 pa[4];
            pa[0] = att_pack_bf16(s[2 * kk][0], s[2 * kk][1]);
            pa[1] = att_pack_bf16(s[2 * kk][2], s[2 * kk][3]);
            pa[2] = att_pack_bf16(s[2 * kk + 1][0], s[2 * kk + 1][1]);
            pa[3] = att_pack_bf16(s[2 * kk + 1][2], s[2 * kk + 1][3]);
#pragma unroll
            for (int dn = 0; dn < DN; ++dn) {
                const bf16_t* vp = vts + (8 * dn + gr) * TC_LDV + 16 * kk + 2 * t4;
                att_mma(o[dn], pa, att_ld32(vp), att_ld32(vp + 8));
            }
        }
    }
    // Rows i0, i1: columns 8 dn + 2 t4 + {0, 1}, one 32-bit store each.
    const float inv0 = l0 > 0.0f ? 1.0f / l0 : 0.0f, inv1 = l1 > 0.0f ? 1.0f / l1 : 0.0f;
    if (i0 < g.q_len) {
        const i64 row = (i64)(g.q_start + i0);
        u32* dst = reinterpret_cast<u32*>(out + (row * nh + h) * D + 2 * t4);
#pragma unroll
        for (int dn = 0; dn < DN; ++dn) dst[4 * dn] = att_pack_bf16(o[dn][0] * inv0, o[dn][1] * inv0);
        if (t4 == 0) lse[(i64)h * tq + row] = l0 > 0.0f ? (m0 + log2f(l0)) * ATT_LN2 : BRAID_NEG_INF;
    }
    if (i1 < g.q_len) {
        const i64 row = (i64)(g.q_start + i1);
        u32* dst = reinterpret_cast<u32*>(out + (row * nh + h) * D + 2 * t4);
#pragma unroll
        for (int dn = 0; dn < DN; ++dn) dst[4 * dn] = att_pack_bf16(o[dn][2] * inv1, o[dn][3] * inv1);
        if (t4 == 0) lse[(i64)h * tq + row] = l1 > 0.0f ? (m1 + log2f(l1)) * ATT_LN2 : BRAID_NEG_INF;
    }
}

// Exported tensor-core forwards (bf16 only). Tables as for the SIMT forward, with
// 64-row tiles.
#define BRAID_ATT_TC(D)                                                                                          \
    extern "C" __global__ void __launch_bounds__(ATT_THREADS, 2) braid_attention_fwd_tc_hs##D##_bf16(         \
        bf16_t* out, float* lse, const bf16_t* q, const bf16_t* k, const bf16_t* v, const u32* segs,           \
        const u32* tiles, int nh, int nkv, int tq, float scale, int causal) {                                   \
        att_fwd_tc<D>(out, lse, q, k, v, segs, tiles, nh, nkv, tq, scale, causal);                              \
    }
BRAID_ATT_TC(64)
BRAID_ATT_TC(80)
BRAID_ATT_TC(96)
BRAID_ATT_TC(128)
