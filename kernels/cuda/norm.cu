// norm.cu: LayerNorm and RMSNorm over the last dimension, forward and backward, and the
// two-stage deterministic column sums of their parameter grads (dw, db).
//
// Layout: x, y, dy, dx (N, C) row-major; w, b, dw, db (C); mean, rstd (N) f32.
// T is float or bf16_t; all math is f32, row statistics are summed in f64 (as the CPU
// backend does) with a fixed tree, so a row's result depends only on its values and C.
#include "common.cuh"

// One block per row. mean and 1/sqrt(biased var + eps) two-pass in f64 (a one-pass
// E[x^2] - E[x]^2 loses every digit when |mean| >> std), then y with the f32 statistics
// the backward will see. b is read only when has_bias.
template <typename T>
__device__ void layer_norm_fwd(T* y, float* mean, float* rstd, const T* x, const T* w, const T* b,
                               int has_bias, u32 C, float eps) {
    __shared__ double scratch[32];
    const i64 row = (i64)blockIdx.x * C;
    double s = 0.0;
    for (u32 j = threadIdx.x; j < C; j += blockDim.x) s += (double)load_f(x, row + j);
    const double mu_d = block_sum_f64(s, scratch) / (double)C;
    double q = 0.0;
    for (u32 j = threadIdx.x; j < C; j += blockDim.x) {
        double d = (double)load_f(x, row + j) - mu_d;
        q += d * d;
    }
    const double var = block_sum_f64(q, scratch) / (double)C;
    const float mu = (float)mu_d;
    const float rs = (float)(1.0 / sqrt(var + (double)eps));
    if (threadIdx.x == 0) {
        mean[blockIdx.x] = mu;
        rstd[blockIdx.x] = rs;
    }
    for (u32 j = threadIdx.x; j < C; j += blockDim.x) {
        float v = (load_f(x, row + j) - mu) * rs * load_f(w, j);
        if (has_bias) v += load_f(b, j);
        store_f(y, row + j, v);
    }
}

// One block per row: with xhat = (x - mean) rstd and g = dy w,
// dx = rstd (g - mean(g) - xhat mean(g xhat)).
template <typename T>
__device__ void layer_norm_bwd(T* dx, const T* dy, const T* x, const T* w, const float* mean,
                               const float* rstd, u32 C) {
    __shared__ double scratch[32];
    const i64 row = (i64)blockIdx.x * C;
    const float mu = mean[blockIdx.x], rs = rstd[blockIdx.x];
    double sg = 0.0, sgx = 0.0;
    for (u32 j = threadIdx.x; j < C; j += blockDim.x) {
        float g = load_f(dy, row + j) * load_f(w, j);
        sg += (double)g;
        sgx += (double)(g * ((load_f(x, row + j) - mu) * rs));
    }
    const float mean_g = (float)(block_sum_f64(sg, scratch) / (double)C);
    const float mean_gx = (float)(block_sum_f64(sgx, scratch) / (double)C);
    for (u32 j = threadIdx.x; j < C; j += blockDim.x) {
        float xhat = (load_f(x, row + j) - mu) * rs;
        store_f(dx, row + j, (load_f(dy, row + j) * load_f(w, j) - mean_g - xhat * mean_gx) * rs);
    }
}

// One block per row: rstd = 1/sqrt(mean(x^2) + eps) in f64; y = (x rstd) w (HF order).
template <typename T>
__device__ void rms_norm_fwd(T* y, float* rstd, const T* x, const T* w, u32 C, float eps) {
    __shared__ double scratch[32];
    const i64 row = (i64)blockIdx.x * C;
    double s = 0.0;
    for (u32 j = threadIdx.x; j < C; j += blockDim.x) {
        double v = (double)load_f(x, row + j);
        s += v * v;
    }
    const double ms = block_sum_f64(s, scratch) / (double)C;
    const float rs = (float)(1.0 / sqrt(ms + (double)eps));
    if (threadIdx.x == 0) rstd[blockIdx.x] = rs;
    for (u32 j = threadIdx.x; j < C; j += blockDim.x)
        store_f(y, row + j, (load_f(x, row + j) * rs) * load_f(w, j));
}

// One block per row: with xhat = x rstd and g = dy w, dx = rstd (g - xhat mean(g xhat)).
template <typename T>
__device__ void rms_norm_bwd(T* dx, const T* dy, const T* x, const T* w, const float* rstd, u32 C) {
    __shared__ double scratch[32];
    const i64 row = (i64)blockIdx.x * C;
    const float rs = rstd[blockIdx.x];
    double sgx = 0.0;
    for (u32 j = threadIdx.x; j < C; j += blockDim.x)
        sgx += (double)((load_f(dy, row + j) * load_f(w, j)) * (load_f(x, row + j) * rs));
    const float mean_gx = (float)(block_sum_f64(sgx, scratch) / (double)C);
    for (u32 j = threadIdx.x; j < C; j += blockDim.x) {
        float xhat = load_f(x, row + j) * rs;
        store_f(dx, row + j, (load_f(dy, row + j) * load_f(w, j) - xhat * mean_gx) * rs);
    }
}

// Stage 1 of dw (C) += sum_n dy[n] xhat[n] and db (C) += sum_n dy[n].
// Grid (ceil(C / blockDim.x), G): thread (column j, group g) sums rows g, g + G, g + 2G,
// ... in increasing order in f64 and writes partial[g * C + j] (dw part) and
// partial[(G + g) * C + j] (db part): partial is (2, G, C). Every (g, j < C) slot of a
// wanted part is written, even when the group has no rows. RMS: xhat = x rstd (mean unused).
template <typename T, bool RMS>
__device__ void norm_param_partial(double* partial, const T* dy, const T* x, const float* mean,
                                   const float* rstd, u32 N, u32 C, int want_dw, int want_db) {
    const u32 j = blockIdx.x * blockDim.x + threadIdx.x;
    if (j >= C) return;
    const u32 g = blockIdx.y, G = gridDim.y;
    double adw = 0.0, adb = 0.0;
    for (u64 n = g; n < N; n += G) {  // u64: n + G never wraps
        const i64 at = (i64)n * C + j;
        const float d = load_f(dy, at);
        const float xv = load_f(x, at);
        const float xhat = RMS ? xv * rstd[n] : (xv - mean[n]) * rstd[n];
        adw += (double)(d * xhat);
        adb += (double)d;
    }
    if (want_dw) partial[(i64)g * C + j] = adw;
    if (want_db) partial[((i64)G + g) * C + j] = adb;
}

// Stage 2: out[j] = out[j] + (float)sum_g partial[offset + g * C + j], the G partials in
// increasing g (f64), the total added once in f32 (like the CPU's `*o += a as f32`).
// Grid-stride over j < C. T here is the grad's dtype, chosen by the host independently of
// the inputs' (the partials are f64 either way): bf16 inputs under mixed precision use
// the f32 kernel to add into the master weight's f32 grad.
template <typename T>
__device__ void norm_sum_partials(T* out, const double* partial, u64 offset, u32 G, u32 C) {
    for (u64 j = blockIdx.x * (u64)blockDim.x + threadIdx.x; j < C; j += (u64)gridDim.x * blockDim.x) {
        double acc = 0.0;
        for (u32 g = 0; g < G; ++g) acc += partial[offset + (u64)g * C + j];
        store_f(out, j, load_f(out, j) + (float)acc);
    }
}

#define BRAID_NORM(SUFFIX, T)                                                                        \
    extern "C" __global__ void braid_layer_norm_fwd_##SUFFIX(T* y, float* mean, float* rstd,        \
                                                             const T* x, const T* w, const T* b,    \
                                                             int has_bias, u32 C, float eps) {      \
        layer_norm_fwd(y, mean, rstd, x, w, b, has_bias, C, eps);                                   \
    }                                                                                                \
    extern "C" __global__ void braid_layer_norm_bwd_##SUFFIX(T* dx, const T* dy, const T* x,         \
                                                             const T* w, const float* mean,         \
                                                             const float* rstd, u32 C) {            \
        layer_norm_bwd(dx, dy, x, w, mean, rstd, C);                                                \
    }                                                                                                \
    extern "C" __global__ void braid_rms_norm_fwd_##SUFFIX(T* y, float* rstd, const T* x,            \
                                                           const T* w, u32 C, float eps) {          \
        rms_norm_fwd(y, rstd, x, w, C, eps);                                                        \
    }                                                                                                \
    extern "C" __global__ void braid_rms_norm_bwd_##SUFFIX(T* dx, const T* dy, const T* x,           \
                                                           const T* w, const float* rstd, u32 C) {  \
        rms_norm_bwd(dx, dy, x, w, rstd, C);                                                        \
    }                                                                                                \
    extern "C" __global__ void braid_layer_norm_param_partial_##SUFFIX(                              \
        double* partial, const T* dy, const T* x, const float* mean, const float* rstd, u32 N,      \
        u32 C, int want_dw, int want_db) {                                                           \
        norm_param_partial<T, false>(partial, dy, x, mean, rstd, N, C, want_dw, want_db);           \
    }                                                                                                \
    extern "C" __global__ void braid_rms_norm_param_partial_##SUFFIX(                                \
        double* partial, const T* dy, const T* x, const float* rstd, u32 N, u32 C) {                \
        norm_param_partial<T, true>(partial, dy, x, rstd, rstd, N, C, 1, 0);                        \
    }                                                                                                \
    extern "C" __global__ void braid_norm_sum_partials_##SUFFIX(T* out, const double* partial,       \
                                                                u64 offset, u32 G, u32 C) {         \
        norm_sum_partials(out, partial, offset, G, C);                                              \
    }

BRAID_NORM(f32, float)
BRAID_NORM(bf16, bf16_t)
