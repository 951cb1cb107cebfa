// embedding.cu: token-embedding lookup, and its deterministic scatter-add backward
// (a bitonic sort of (id, position) pairs, then one thread per (run of equal ids,
// channel) summing in position order: no float atomics).
#include "common.cuh"

// verdict[0] = min over positions p with ids[p] >= V of (p << 32 | ids[p]): the first
// bad id and its position in one word (integer atomicMin: the result does not depend
// on the schedule). The host sets it to all ones first; p < 2^32 - 1, so a real verdict
// is always smaller.
extern "C" __global__ void braid_check_ids(u64* verdict, const u32* ids, u32 n, u32 v) {
    for (u64 p = blockIdx.x * (u64)blockDim.x + threadIdx.x; p < n; p += (u64)gridDim.x * blockDim.x) {
        u32 id = ids[p];
        if (id >= v) atomicMin(verdict, (p << 32) | id);
    }
}

// y (N, C) = table (V, C)[ids]. An id >= V gives a zero row instead of a read out of
// bounds: braid_check_ids reports it and the host discards y.
template <typename T>
__device__ void embedding_fwd(T* y, const T* table, const u32* ids, u64 n, u32 v, u64 c) {
    u64 total = n * c;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < total; e += (u64)gridDim.x * blockDim.x) {
        u64 r = e / c, k = e % c;
        u32 id = ids[r];
        y[e] = id < v ? table[(u64)id * c + k] : (T)0;
    }
}

// keys (P), P the power of two >= N: keys[i] = ids[i] << 32 | i for i < N, all ones
// for the padding (larger than every real key, so it sorts to the end).
extern "C" __global__ void braid_embedding_keys(u64* keys, const u32* ids, u32 n, u32 p) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < p; i += (u64)gridDim.x * blockDim.x)
        keys[i] = i < n ? (((u64)ids[i] << 32) | i) : 0xffffffffffffffffull;
}

// One compare-exchange stage (k, j) of an ascending bitonic sort of keys (P): element i
// pairs with l = i ^ j, and the pair is ordered ascending when bit k of i is clear,
// descending when set. Only the lower index of a pair touches it, so a stage has no
// races; stages are separate launches, so each sees the previous one complete.
// The host runs k = 2, 4, .., P and, for each, j = k/2, k/4, .., 1.
extern "C" __global__ void braid_bitonic_step(u64* keys, u32 p, u32 j, u32 k) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < p; i += (u64)gridDim.x * blockDim.x) {
        u64 l = i ^ j;
        if (l <= i) continue;  // l < p: i < p and j < p flip a bit below P's
        u64 a = keys[i], b = keys[l];
        bool ascending = (i & k) == 0;
        if (ascending ? a > b : a < b) {
            keys[i] = b;
            keys[l] = a;
        }
    }
}

// dtable (V, C) f32 += dy (N, C) summed by id. keys (N..) are sorted, so the positions
// holding one id are a run keys[s .. e), in increasing position order. Block x walks
// sorted positions s = blockIdx.x, + gridDim.x, ..; at the start of a run (s == 0 or
// the id changes) each thread adds that run's dy rows into its channel ch of the id's
// row. Every (id, ch) is written by exactly one thread, once: no atomics, and the sum
// order is fixed. As the CPU backend: one occurrence is a plain f32 add, several are
// summed in f64 (in position order) and added once, so the bits are the CPU's.
template <typename T>
__device__ void embedding_bwd(float* dtable, const T* dy, const u64* keys, u32 n, u64 c) {
    u64 ch = blockIdx.y * (u64)blockDim.x + threadIdx.x;
    if (ch >= c) return;  // no barrier below
    for (u64 s = blockIdx.x; s < n; s += gridDim.x) {  // u64: s + gridDim.x never wraps
        u32 id = (u32)(keys[s] >> 32);
        if (s > 0 && (u32)(keys[s - 1] >> 32) == id) continue;  // inside a run, not its start
        u64 e = s + 1;
        while (e < n && (u32)(keys[e] >> 32) == id) e++;
        float* row = dtable + (u64)id * c;
        if (e - s == 1) {
            row[ch] += load_f(dy, (i64)((keys[s] & 0xffffffffull) * c + ch));
        } else {
            double acc = 0.0;
            for (u64 q = s; q < e; q++) acc += (double)load_f(dy, (i64)((keys[q] & 0xffffffffull) * c + ch));
            row[ch] += (float)acc;
        }
    }
}

#define BRAID_EMBEDDING(SUFFIX, T)                                                                   \
    extern "C" __global__ void braid_embedding_fwd_##SUFFIX(T* y, const T* table, const u32* ids,   \
                                                             u64 n, u32 v, u64 c) {                  \
        embedding_fwd(y, table, ids, n, v, c);                                                       \
    }                                                                                                \
    extern "C" __global__ void braid_embedding_bwd_##SUFFIX(float* dtable, const T* dy,             \
                                                             const u64* keys, u32 n, u64 c) {        \
        embedding_bwd(dtable, dy, keys, n, c);                                                       \
    }

BRAID_EMBEDDING(f32, float)
BRAID_EMBEDDING(bf16, bf16_t)
