// common.cuh: what every Braid kernel shares: bf16 as raw bits, index types, reductions.
//
// Included by each .cu as `#include "common.cuh"`; the runtime (kernels/src/cuda/compile.rs)
// pastes this file in place of that line before NVRTC compiles, so no header is searched
// for at run time. No CUDA headers: bf16 is `unsigned short` holding bfloat16 bits.
#pragma once

typedef unsigned short bf16_t;      // bfloat16 bits
typedef unsigned int u32;
typedef unsigned long long u64;
typedef long long i64;

// No <math.h> under NVRTC without headers: the infinities by their bits.
#define BRAID_INF __int_as_float(0x7f800000)
#define BRAID_NEG_INF __int_as_float(0xff800000)

// bf16 -> f32 is exact: the bits are the top half of an f32.
__device__ __forceinline__ float bf16_to_f32(bf16_t h) {
    return __uint_as_float(((u32)h) << 16);
}

// f32 -> bf16, round to nearest even (NaN stays NaN), as the CPU backend's `half` crate.
__device__ __forceinline__ bf16_t f32_to_bf16(float f) {
    u32 x = __float_as_uint(f);
    if ((x & 0x7fffffffu) > 0x7f800000u) {
        return (bf16_t)((x >> 16) | 0x0040u);  // quiet NaN
    }
    u32 rounding = 0x7fffu + ((x >> 16) & 1u);
    return (bf16_t)((x + rounding) >> 16);
}

// Loads and stores of either dtype through one template parameter T (float or bf16_t).
__device__ __forceinline__ float load_f(const float* p, i64 i) { return p[i]; }
__device__ __forceinline__ float load_f(const bf16_t* p, i64 i) { return bf16_to_f32(p[i]); }
__device__ __forceinline__ void store_f(float* p, i64 i, float v) { p[i] = v; }
__device__ __forceinline__ void store_f(bf16_t* p, i64 i, float v) { p[i] = f32_to_bf16(v); }

// Sum over a warp; every lane gets the result. Fixed butterfly order: deterministic.
__device__ __forceinline__ float warp_sum(float v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ double warp_sum_f64(double v) {
    for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
    return v;
}
__device__ __forceinline__ float warp_max(float v) {
    for (int o = 16; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
    return v;
}

// Sum over a block of blockDim.x threads (a multiple of 32, at most 1024); every thread
// gets the result. `scratch` is 32 floats of shared memory. Deterministic: the same
// tree for the same blockDim. Contains __syncthreads: call from every thread.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0f;
    return warp_sum(v);
}
// block_sum in f64, for row statistics summed as the CPU backend sums them; `scratch`
// is 32 doubles of shared memory.
__device__ __forceinline__ double block_sum_f64(double v, double* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_sum_f64(v);
    __syncthreads();  // scratch may still be read by a previous call
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : 0.0;
    return warp_sum_f64(v);
}
__device__ __forceinline__ float block_max(float v, float* scratch) {
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    v = warp_max(v);
    __syncthreads();
    if (lane == 0) scratch[warp] = v;
    __syncthreads();
    v = lane < nwarps ? scratch[lane] : BRAID_NEG_INF;
    return warp_max(v);
}
