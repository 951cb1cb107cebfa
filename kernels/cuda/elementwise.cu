// elementwise.cu: add, add-assign, scale, and the deterministic sum of squares used by
// grad clipping. T is float or bf16_t; arithmetic is f32, sums of squares f64.
#include "common.cuh"

template <typename T>
__device__ void add(T* out, const T* a, const T* b, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        store_f(out, i, load_f(a, i) + load_f(b, i));
}

// acc (A) += x (X): equal dtypes, or an f32 acc with bf16 x (mixed precision adds bf16
// grads into f32 accumulators; the upcast is exact, the sum rounds once in f32).
template <typename A, typename X>
__device__ void add_assign(A* acc, const X* x, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        store_f(acc, i, load_f(acc, i) + load_f(x, i));
}

template <typename T>
__device__ void scale_assign(T* x, float s, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        store_f(x, i, load_f(x, i) * s);
}

// Stage 1 of sum(x^2): block b sums a fixed grid-stride subset into partial[b] (f64).
// The grid size is fixed by the caller, so the partition (and the bits) never change.
template <typename T>
__device__ void sum_squares_partial(double* partial, const T* x, u64 n) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x) {
        double v = (double)load_f(x, i);
        acc += v * v;
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    acc = warp_sum_f64(acc);
    if (lane == 0) scratch[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < nwarps ? scratch[lane] : 0.0;
        acc = warp_sum_f64(acc);
        if (lane == 0) partial[blockIdx.x] = acc;
    }
}

// Stage 2: one block adds the partials in a fixed order into out[slot] (+= when
// accumulate, so one launch per tensor builds a global norm in one buffer).
extern "C" __global__ void braid_sum_partials_f64(double* out, const double* partial, u32 count, u32 slot, int accumulate) {
    __shared__ double scratch[32];
    double acc = 0.0;
    for (u32 i = threadIdx.x; i < count; i += blockDim.x) acc += partial[i];
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    acc = warp_sum_f64(acc);
    if (lane == 0) scratch[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < nwarps ? scratch[lane] : 0.0;
        acc = warp_sum_f64(acc);
        if (lane == 0) out[slot] = accumulate ? out[slot] + acc : acc;
    }
}

#define BRAID_ELEMENTWISE(SUFFIX, T)                                                              \
    extern "C" __global__ void braid_add_##SUFFIX(T* out, const T* a, const T* b, u64 n) {      \
        add(out, a, b, n);                                                                        \
    }                                                                                             \
    extern "C" __global__ void braid_add_assign_##SUFFIX(T* acc, const T* x, u64 n) {           \
        add_assign(acc, x, n);                                                                    \
    }                                                                                             \
    extern "C" __global__ void braid_scale_assign_##SUFFIX(T* x, float s, u64 n) {              \
        scale_assign(x, s, n);                                                                    \
    }                                                                                             \
    extern "C" __global__ void braid_sum_squares_partial_##SUFFIX(double* p, const T* x, u64 n) { \
        sum_squares_partial(p, x, n);                                                             \
    }

BRAID_ELEMENTWISE(f32, float)
BRAID_ELEMENTWISE(bf16, bf16_t)

// braid_add_assign_<acc dtype>_<x dtype>: the one mixed pair.
extern "C" __global__ void braid_add_assign_f32_bf16(float* acc, const bf16_t* x, u64 n) {
    add_assign(acc, x, n);
}

// ---- bias (the linear layer's; the matmul family's kernels) ----

// y[n, c] += bias[c]. y (N, C), bias (C).
template <typename T>
__device__ void add_bias(T* y, const T* bias, u64 n_rows, u32 c) {
    u64 total = n_rows * c;
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < total; i += (u64)gridDim.x * blockDim.x)
        store_f(y, i, load_f(y, i) + load_f(bias, i % c));
}

// Stage 1 of dbias = sum_n dy[n, :]: grid (ceil(C / blockDim), G); block (cx, g) sums rows
// g, g + G, g + 2G, ... of its columns into partial[g, c] (f64, as the CPU backend sums
// a bias grad). Fixed G: deterministic.
template <typename T>
__device__ void bias_grad_partial(double* partial, const T* dy, u64 n_rows, u32 c) {
    u32 col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= c) return;
    double acc = 0.0;
    for (u64 r = blockIdx.y; r < n_rows; r += gridDim.y) acc += (double)load_f(dy, r * c + col);
    partial[(u64)blockIdx.y * c + col] = acc;
}

// Stage 2: dbias[c] += sum_g partial[g, c], g in order. G is dbias's dtype, picked by the
// host independently of dy's (the partials are f64 either way): a bf16 dy's partials
// finish into an f32 dbias (the master bias's grad) under mixed precision. The sum is
// rounded to f32 once, then added, as the CPU backend does.
template <typename G>
__device__ void bias_grad_finish(G* dbias, const double* partial, u32 groups, u32 c) {
    u32 col = blockIdx.x * blockDim.x + threadIdx.x;
    if (col >= c) return;
    double acc = 0.0;
    for (u32 g = 0; g < groups; ++g) acc += partial[(u64)g * c + col];
    store_f(dbias, col, load_f(dbias, col) + (float)acc);
}

#define BRAID_BIAS(SUFFIX, T)                                                                          \
    extern "C" __global__ void braid_add_bias_##SUFFIX(T* y, const T* bias, u64 n, u32 c) {           \
        add_bias(y, bias, n, c);                                                                       \
    }                                                                                                  \
    extern "C" __global__ void braid_bias_grad_partial_##SUFFIX(double* p, const T* dy, u64 n, u32 c) { \
        bias_grad_partial(p, dy, n, c);                                                                 \
    }                                                                                                   \
    extern "C" __global__ void braid_bias_grad_finish_##SUFFIX(T* db, const double* p, u32 g, u32 c) { \
        bias_grad_finish(db, p, g, c);                                                                  \
    }

BRAID_BIAS(f32, float)
BRAID_BIAS(bf16, bf16_t)
