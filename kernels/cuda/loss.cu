// loss.cu: fused softmax cross-entropy, forward and backward in one kernel, one block
// per row of the logits (N, V). Losses are f32, dlogits the logits' dtype T.
#include "common.cuh"

// Threads per block of braid_cross_entropy_T (the Rust side launches this many).
#define CE_THREADS 512

// Row r = blockIdx.x of logits (N, V), target t = targets[r]:
// - t == ignore: losses[r] = 0, dlogits[r, :] = 0;
// - t >= V (and not ignore): the row is bad: verdict (set to all ones by the host) is
//   lowered to (r << 32 | t) by an integer atomicMin, so it ends as the first bad row,
//   as the CPU reports; the row is written as an ignored one (the host discards all);
// - else losses[r] = lse - x[t], dlogits[r, i] = grad_scale * (softmax_i - [i == t]).
// Pass 1 keeps, per thread, an online (max m, sum s of e^(x - m)) over its strided
// columns, s in f64; the block then rescales every thread's s to the row max M and sums
// them in f64. Pass 2 writes e^(x - M) * (grad_scale / S), as the CPU backend does.
template <typename T>
__device__ void cross_entropy(float* losses, T* dlogits, u64* verdict, const T* logits, const u32* targets,
                              u32 v, u32 ignore, float grad_scale) {
    __shared__ float fscratch[32];
    __shared__ double dscratch[32];
    u64 row = blockIdx.x;
    const T* x = logits + row * v;  // (V)
    T* d = dlogits + row * v;       // (V)
    u32 t = targets[row];
    if (t == ignore || t >= v) {  // the same for the whole block: it leaves together
        if (threadIdx.x == 0) {
            losses[row] = 0.0f;
            if (t != ignore) atomicMin(verdict, (row << 32) | t);
        }
        for (u32 i = threadIdx.x; i < v; i += blockDim.x) store_f(d, i, 0.0f);
        return;
    }

    float m = BRAID_NEG_INF;
    double s = 0.0;
    for (u32 i = threadIdx.x; i < v; i += blockDim.x) {
        float xi = load_f(x, i);
        if (xi > m) {
            // New running max: rescale what was summed so far (s = 0 at the first one,
            // and e^(-inf) = 0, so no NaN from the initial -inf).
            s = s * (double)expf(m - xi) + 1.0;
            m = xi;
        } else if (xi != BRAID_NEG_INF) {
            // A -inf logit adds e^(-inf) = 0; skipping it avoids (-inf) - (-inf) = NaN
            // while m is still -inf. A NaN logit gets here and makes s NaN, as on the CPU.
            s += (double)expf(xi - m);
        }
    }
    float mx = block_max(m, fscratch);
    // A thread whose columns were all -inf (or that had none) has s = 0.
    double mine = s > 0.0 ? s * (double)expf(m - mx) : s;
    double sum = block_sum_f64(mine, dscratch);

    if (threadIdx.x == 0) {
        double lse = (double)mx + log(sum);
        losses[row] = (float)(lse - (double)load_f(x, t));
    }
    float scale = (float)((double)grad_scale / sum);
    for (u32 i = threadIdx.x; i < v; i += blockDim.x) {
        // __fmul_rn: no fused multiply-subtract at the target, the CPU's two roundings.
        float g = __fmul_rn(expf(load_f(x, i) - mx), scale);
        if (i == t) g -= grad_scale;
        store_f(d, i, g);
    }
}

#define BRAID_LOSS(SUFFIX, T)                                                                          \
    extern "C" __global__ void __launch_bounds__(CE_THREADS) braid_cross_entropy_##SUFFIX(            \
        float* losses, T* dlogits, u64* verdict, const T* logits, const u32* targets, u32 v,          \
        u32 ignore, float grad_scale) {                                                                \
        cross_entropy(losses, dlogits, verdict, logits, targets, v, ignore, grad_scale);               \
    }

BRAID_LOSS(f32, float)
BRAID_LOSS(bf16, bf16_t)
