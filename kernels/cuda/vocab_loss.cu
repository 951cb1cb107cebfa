// vocab_loss.cu: vocab-parallel cross-entropy on the device (Megatron's, with one
// all-gather of per-shard partials instead of two all-reduces). One block per row.
#include "common.cuh"

// partials (3, T): [0] the shard row's max m, [1] sum_j exp(x_j - m), [2] the target's
// logit when this shard holds it (else 0). logits (T, Vl), targets (T).
template <typename T>
__device__ void vocab_loss_partials(float* partials, const T* logits, const u32* targets,
                                    u32 t, u32 vl, u64 vocab_start, u32 ignore_index) {
    __shared__ float scratch[32];
    __shared__ double scratch64[32];
    u32 row = blockIdx.x;
    if (row >= t) return;  // uniform per block: every thread of it returns
    const T* x = logits + (u64)row * vl;
    float m = BRAID_NEG_INF;
    for (u32 j = threadIdx.x; j < vl; j += blockDim.x) m = fmaxf(m, load_f(x, j));
    m = block_max(m, scratch);
    // Summed in f64 and rounded once, as the CPU backend sums it (f32 exps).
    double s64 = 0.0;
    for (u32 j = threadIdx.x; j < vl; j += blockDim.x) s64 += (double)expf(load_f(x, j) - m);
    float s = (float)block_sum_f64(s64, scratch64);
    if (threadIdx.x == 0) {
        u32 tg = targets[row];
        float tl = 0.0f;
        if (tg != ignore_index && (u64)tg >= vocab_start && (u64)tg - vocab_start < vl)
            tl = load_f(x, (u32)((u64)tg - vocab_start));
        partials[row] = m;
        partials[t + row] = s;
        partials[2 * (u64)t + row] = tl;
    }
}

// losses (T) and dlogits (T, Vl) from gathered (R, 3, T).
template <typename T>
__device__ void vocab_loss_finish(float* losses, T* dlogits, const T* logits, const u32* targets,
                                  const float* gathered, u32 ranks, u32 t, u32 vl,
                                  u64 vocab_start, u32 ignore_index, float grad_scale) {
    u32 row = blockIdx.x;
    if (row >= t) return;
    T* d = dlogits + (u64)row * vl;
    u32 tg = targets[row];
    if (tg == ignore_index) {
        for (u32 j = threadIdx.x; j < vl; j += blockDim.x) store_f(d, j, 0.0f);
        if (threadIdx.x == 0) losses[row] = 0.0f;
        return;
    }
    // Every thread combines the R partials itself (R is the TP size: a handful), in
    // rank order, so all agree on M and S without a broadcast.
    float big_m = BRAID_NEG_INF;
    for (u32 r = 0; r < ranks; ++r) big_m = fmaxf(big_m, gathered[(u64)(r * 3 + 0) * t + row]);
    double big_s = 0.0, target_logit = 0.0;
    for (u32 r = 0; r < ranks; ++r) {
        float m_r = gathered[(u64)(r * 3 + 0) * t + row];
        big_s += (double)gathered[(u64)(r * 3 + 1) * t + row] * exp((double)(m_r - big_m));
        target_logit += (double)gathered[(u64)(r * 3 + 2) * t + row];
    }
    const T* x = logits + (u64)row * vl;
    float scale = (float)((double)grad_scale / big_s);
    long long local = -1;
    if ((u64)tg >= vocab_start && (u64)tg - vocab_start < vl) local = (long long)((u64)tg - vocab_start);
    for (u32 j = threadIdx.x; j < vl; j += blockDim.x) {
        // __fmul_rn: never contracted with the subtraction below into one FMA, which
        // would round once where the CPU backend rounds twice (loss.cu does the same).
        float g = __fmul_rn(expf(load_f(x, j) - big_m), scale);
        if ((long long)j == local) g -= grad_scale;
        store_f(d, j, g);
    }
    if (threadIdx.x == 0) losses[row] = (float)(log(big_s) + (double)big_m - target_logit);
}

#define BRAID_VOCAB_LOSS(SUFFIX, T)                                                              \
    extern "C" __global__ void braid_vocab_loss_partials_##SUFFIX(                               \
        float* p, const T* x, const u32* tg, u32 t, u32 vl, u64 start, u32 ignore) {             \
        vocab_loss_partials(p, x, tg, t, vl, start, ignore);                                     \
    }                                                                                            \
    extern "C" __global__ void braid_vocab_loss_finish_##SUFFIX(                                 \
        float* losses, T* d, const T* x, const u32* tg, const float* g, u32 ranks, u32 t,        \
        u32 vl, u64 start, u32 ignore, float scale) {                                            \
        vocab_loss_finish(losses, d, x, tg, g, ranks, t, vl, start, ignore, scale);              \
    }

BRAID_VOCAB_LOSS(f32, float)
BRAID_VOCAB_LOSS(bf16, bf16_t)
