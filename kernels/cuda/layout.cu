// layout.cu: row copies of any dtype (transpose01, narrow_last, gather_rows, scatter_rows)
// and the device-side index checks of gather/scatter.
//
// The copies move bits, not values: T is the element type (float, bf16_t or u32) and
// nothing is converted. Every copy kernel is a grid-stride loop over the OUTPUT's (or,
// for the scatter, the source's) elements, with u64 counts (rows x C can pass 2^31).
#include "common.cuh"

// The "no bad index seen" value of a verdict (see check_rows).
#define BRAID_NO_VERDICT 0xffffffffffffffffull

// out (B, A, C) from x (A, B, C): output row r = j * A + i is input row i * B + j.
template <typename T>
__device__ void transpose01(T* out, const T* x, u64 a, u64 b, u64 c) {
    u64 n = a * b * c;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        u64 r = e / c, k = e % c;   // output row (j, i) and column
        u64 j = r / a, i = r % a;
        out[e] = x[(i * b + j) * c + k];
    }
}

// out (N, len) = x (N, C)[:, start .. start + len].
template <typename T>
__device__ void narrow_last(T* out, const T* x, u64 rows, u64 c, u64 start, u64 len) {
    u64 n = rows * len;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        u64 r = e / len, k = e % len;
        out[e] = x[r * c + start + k];
    }
}

// out (M, C) = x (N, C)[idx]. A row whose index is out of range (>= N) is written as
// zero bits instead of read: braid_check_rows reports it and the host discards `out`.
template <typename T>
__device__ void gather_rows(T* out, const T* x, const u32* idx, u64 m, u32 rows, u64 c) {
    u64 n = m * c;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        u64 r = e / c, k = e % c;
        u32 i = idx[r];
        out[e] = i < rows ? x[(u64)i * c + k] : (T)0;
    }
}

// dst (N, C)[idx] = src (M, C). Launched only after the checks below found every
// index in range and distinct, so no two threads write one element.
template <typename T>
__device__ void scatter_rows(T* dst, const T* src, const u32* idx, u64 m, u64 c) {
    u64 n = m * c;
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        u64 r = e / c, k = e % c;
        dst[(u64)idx[r] * c + k] = src[e];
    }
}

// verdict[0] = min over positions m with idx[m] >= N of (m << 32 | idx[m]): the first
// out-of-range position and its value in one word, so one integer atomicMin keeps the
// first whatever the schedule (the CPU reports the first in position order). Stays
// BRAID_NO_VERDICT (set by the host) when every index is in range. m < 2^32 - 1, so a
// real verdict never equals BRAID_NO_VERDICT.
extern "C" __global__ void braid_check_rows(u64* verdict, const u32* idx, u32 m, u32 rows) {
    for (u64 p = blockIdx.x * (u64)blockDim.x + threadIdx.x; p < m; p += (u64)gridDim.x * blockDim.x) {
        u32 i = idx[p];
        if (i >= rows) atomicMin(verdict, ((u64)p << 32) | i);
    }
}

// p[0 .. n) = v: the scatter's `first` scratch starts at "no position" (0xffffffff).
extern "C" __global__ void braid_fill_u32(u32* p, u32 v, u64 n) {
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x)
        p[e] = v;
}

// Scatter check, pass 1: first (N) gets, for each row, the smallest position that names
// it (first[] is pre-filled with 0xffffffff); out-of-range positions go to verdict[0]
// as in braid_check_rows. Integer atomics: the result does not depend on the order.
extern "C" __global__ void braid_scatter_first(u32* first, u64* verdict, const u32* idx, u32 m, u32 rows) {
    for (u64 p = blockIdx.x * (u64)blockDim.x + threadIdx.x; p < m; p += (u64)gridDim.x * blockDim.x) {
        u32 i = idx[p];
        if (i >= rows) atomicMin(&verdict[0], ((u64)p << 32) | i);
        else atomicMin(&first[i], (u32)p);
    }
}

// Scatter check, pass 2 (after pass 1 has finished: a separate launch): position p
// repeats an earlier index exactly when the first position naming idx[p] is not p
// itself (then it is smaller). verdict[1] gets the smallest such (p << 32 | idx[p]),
// the CPU's "first repeat".
extern "C" __global__ void braid_scatter_repeats(u64* verdict, const u32* first, const u32* idx, u32 m, u32 rows) {
    for (u64 p = blockIdx.x * (u64)blockDim.x + threadIdx.x; p < m; p += (u64)gridDim.x * blockDim.x) {
        u32 i = idx[p];
        if (i < rows && first[i] != (u32)p) atomicMin(&verdict[1], ((u64)p << 32) | i);
    }
}

#define BRAID_LAYOUT(SUFFIX, T)                                                                         \
    extern "C" __global__ void braid_transpose01_##SUFFIX(T* out, const T* x, u64 a, u64 b, u64 c) {   \
        transpose01(out, x, a, b, c);                                                                   \
    }                                                                                                   \
    extern "C" __global__ void braid_narrow_last_##SUFFIX(T* out, const T* x, u64 rows, u64 c,         \
                                                           u64 start, u64 len) {                        \
        narrow_last(out, x, rows, c, start, len);                                                       \
    }                                                                                                   \
    extern "C" __global__ void braid_gather_rows_##SUFFIX(T* out, const T* x, const u32* idx, u64 m,  \
                                                           u32 rows, u64 c) {                           \
        gather_rows(out, x, idx, m, rows, c);                                                           \
    }                                                                                                   \
    extern "C" __global__ void braid_scatter_rows_##SUFFIX(T* dst, const T* src, const u32* idx,       \
                                                            u64 m, u64 c) {                             \
        scatter_rows(dst, src, idx, m, c);                                                              \
    }

BRAID_LAYOUT(f32, float)
BRAID_LAYOUT(bf16, bf16_t)
BRAID_LAYOUT(u32, u32)
