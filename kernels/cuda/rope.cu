// rope.cu: rotary position embedding, rotate-half layout, forward and inverse.
// x (T, NH, HS) of dtype X, cos/sin (T, R/2) of dtype C (f32 tables may rotate bf16
// activations); y has x's shape and dtype.
#include "common.cuh"

// One thread per element of y (a grid-stride loop over T*NH*HS). With half = R/2 and
// ch the channel within the head:
//   ch <  half:      y = x[ch] c - x[ch + half] s
//   ch <  R:         y = x[ch] c + x[ch - half] s     (c, s of pair ch - half)
//   otherwise:       y = x[ch]                        (partial rotary: passes through)
// s is negated for the inverse (the backward: cos is even, sin odd). Each product is
// rounded on its own (__fmul_rn, no fused multiply-add), as the CPU backend computes.
template <typename X, typename C>
__device__ void rope(X* y, const X* x, const C* cos_tab, const C* sin_tab, u64 nh, u64 hs, u64 half, float sign, u64 n) {
    for (u64 e = blockIdx.x * (u64)blockDim.x + threadIdx.x; e < n; e += (u64)gridDim.x * blockDim.x) {
        u64 ch = e % hs;
        u64 head = e - ch;  // index of channel 0 of this (token, head)
        u64 t = (e / hs) / nh;
        float out;
        if (ch < half) {
            float c = load_f(cos_tab, t * half + ch), s = sign * load_f(sin_tab, t * half + ch);
            out = __fsub_rn(__fmul_rn(load_f(x, e), c), __fmul_rn(load_f(x, head + ch + half), s));
        } else if (ch < 2 * half) {
            u64 i = ch - half;
            float c = load_f(cos_tab, t * half + i), s = sign * load_f(sin_tab, t * half + i);
            out = __fadd_rn(__fmul_rn(load_f(x, e), c), __fmul_rn(load_f(x, head + i), s));
        } else {
            out = load_f(x, e);
        }
        store_f(y, e, out);
    }
}

#define BRAID_ROPE(SUFFIX, X, C)                                                               \
    extern "C" __global__ void braid_rope_##SUFFIX(X* y, const X* x, const C* cos_tab,        \
                                                   const C* sin_tab, u64 nh, u64 hs, u64 half, \
                                                   float sign, u64 n) {                        \
        rope(y, x, cos_tab, sin_tab, nh, hs, half, sign, n);                                   \
    }

// braid_rope_<x dtype>_<table dtype>
BRAID_ROPE(f32_f32, float, float)
BRAID_ROPE(f32_bf16, float, bf16_t)
BRAID_ROPE(bf16_f32, bf16_t, float)
BRAID_ROPE(bf16_bf16, bf16_t, bf16_t)
