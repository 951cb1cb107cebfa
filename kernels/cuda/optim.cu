// optim.cu: the AdamW step, in place, f32 param / grad / m / v, optionally also writing
// the bf16 compute copy of the updated param (mixed precision) in the same pass.
//
// Every operation is an explicit round-to-nearest intrinsic (__fmul_rn, __fadd_rn, ...)
// so that NVRTC's --fmad=true cannot fuse a multiply and an add: the update then has the
// order and roundings of torch's single-tensor AdamW, as kernels/src/cpu/optim.rs does,
// and the two backends agree bit for bit.
#include "common.cuh"

// a + w (b - a), as PyTorch's lerp computes it (from the nearer end).
__device__ __forceinline__ float lerp_rn(float a, float b, float w) {
    return fabsf(w) < 0.5f ? __fadd_rn(a, __fmul_rn(w, __fsub_rn(b, a)))
                           : __fsub_rn(b, __fmul_rn(__fsub_rn(b, a), __fsub_rn(1.0f, w)));
}

// Element i of the step: p *= decay; m = lerp(m, g, 1 - b1); v = v b2 + ((1 - b2) g) g;
// p += (-step_size m) / (sqrt(v) / sqrt(1 - b2^t) + eps). The scalars come from
// AdamWSpec::scalars() on the host (f64, rounded once to f32). Returns the new p (also
// stored), so the fused kernel below rounds exactly the value the f32 kernel stores.
__device__ __forceinline__ float adamw_elem(float* param, const float* grad, float* m, float* v,
                                            u64 i, float decay, float one_minus_beta1,
                                            float beta2, float one_minus_beta2, float step_size,
                                            float bias_correction2_sqrt, float eps) {
    const float g = grad[i];
    float p = __fmul_rn(param[i], decay);
    const float mi = lerp_rn(m[i], g, one_minus_beta1);
    const float vi = __fadd_rn(__fmul_rn(v[i], beta2), __fmul_rn(__fmul_rn(one_minus_beta2, g), g));
    const float denom = __fadd_rn(__fdiv_rn(__fsqrt_rn(vi), bias_correction2_sqrt), eps);
    p = __fadd_rn(p, __fdiv_rn(__fmul_rn(-step_size, mi), denom));  // negation is exact
    m[i] = mi;
    v[i] = vi;
    param[i] = p;
    return p;
}

extern "C" __global__ void braid_adamw_step_f32(float* param, const float* grad, float* m, float* v,
                                                float decay, float one_minus_beta1, float beta2,
                                                float one_minus_beta2, float step_size,
                                                float bias_correction2_sqrt, float eps, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        adamw_elem(param, grad, m, v, i, decay, one_minus_beta1, beta2, one_minus_beta2, step_size,
                   bias_correction2_sqrt, eps);
}

// The same step, and compute[i] = bf16(new p) rounded to nearest even (the CPU's
// `bf16::from_f32`): the weight's bf16 compute copy refreshed without a second pass over
// the f32 master weights.
extern "C" __global__ void braid_adamw_step_f32_copy(float* param, const float* grad, float* m,
                                                     float* v, bf16_t* compute, float decay,
                                                     float one_minus_beta1, float beta2,
                                                     float one_minus_beta2, float step_size,
                                                     float bias_correction2_sqrt, float eps, u64 n) {
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < n; i += (u64)gridDim.x * blockDim.x)
        compute[i] = f32_to_bf16(adamw_elem(param, grad, m, v, i, decay, one_minus_beta1, beta2,
                                            one_minus_beta2, step_size, bias_correction2_sqrt, eps));
}
