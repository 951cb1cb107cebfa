// memory.cu: dtype casts (f32 <-> bf16, round to nearest even).
#include "common.cuh"

extern "C" __global__ void braid_cast_f32_bf16(bf16_t* out, const float* x, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = f32_to_bf16(x[i]);
}

extern "C" __global__ void braid_cast_bf16_f32(float* out, const bf16_t* x, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        out[i] = bf16_to_f32(x[i]);
}
