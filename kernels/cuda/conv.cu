// conv.cu: the index kernels of conv1d as im2col + GEMM (the GEMMs are cuBLASLt's,
// launched from kernels/src/cuda/conv.rs), conv1d's deterministic bias grad, and
// patchify / unpatchify.
//
// conv1d layouts: x (B, CI, L), w (CO, CI*K), y and dy (B, CO, LO). A chunk of nb batch
// items starting at item b0 is unrolled into col (CI*K, nb*LO), columns ordered (b, o),
// so one GEMM per chunk covers all its items:
//   fwd  ytmp (CO, nb*LO) = w @ col,  y[b0 + b, co, o] = ytmp[co, b*LO + o] + bias[co]
//   bwd  dyt (CO, nb*LO) = dy permuted, dcol (CI*K, nb*LO) = wᵀ @ dyt -> col2im -> dx,
//        ytmp and dcol f32 for either T (a bf16 x bf16 -> f32 GEMM for bf16), so a bf16
//        y or dx is rounded once, after the bias or the taps' sum, as the CPU rounds;
//        dw (CO, CI*K) += dyt @ colᵀ (a bf16 x bf16 -> f32 GEMM when dw is the f32 grad
//        of a bf16-computed weight: mixed precision).
// T is float or bf16_t; indices are u64 (B*CI*L can pass 2^32).
#include "common.cuh"

#define GRID_STRIDE(i, n) \
    for (u64 i = blockIdx.x * (u64)blockDim.x + threadIdx.x; i < (n); i += (u64)gridDim.x * blockDim.x)

// col[ci*K + kk, b*LO + o] = x[b0 + b, ci, o*stride + kk - pad], 0 in the padding.
template <typename T>
__device__ void im2col(T* col, const T* x, u32 b0, u32 nb, u32 CI, u32 L, u32 K, u32 LO, u32 stride, u32 pad) {
    const u64 ncols = (u64)nb * LO;
    const u64 n = (u64)CI * K * ncols;
    GRID_STRIDE(idx, n) {
        const u64 r = idx / ncols, cidx = idx % ncols;
        const u64 b = cidx / LO, o = cidx % LO;
        const u64 ci = r / K, kk = r % K;
        const i64 pos = (i64)(o * stride + kk) - (i64)pad;
        float v = 0.0f;
        if (pos >= 0 && pos < (i64)L) v = load_f(x, (i64)((((u64)b0 + b) * CI + ci) * L) + pos);
        store_f(col, idx, v);
    }
}

// y[b0 + b, co, o] = ytmp[co, b*LO + o] (+ bias[co] when has_bias), over the chunk's
// nb*CO*LO outputs.
template <typename T>
__device__ void conv1d_out(T* y, const float* ytmp, const T* bias, int has_bias, u32 b0, u32 nb, u32 CO, u32 LO) {
    const u64 item = (u64)CO * LO;
    const u64 n = (u64)nb * item;
    GRID_STRIDE(idx, n) {
        const u64 b = idx / item, rem = idx % item;
        const u64 co = rem / LO, o = rem % LO;
        float v = ytmp[co * ((u64)nb * LO) + b * LO + o];
        if (has_bias) v += load_f(bias, (i64)co);
        store_f(y, (i64)((u64)b0 * item + idx), v);
    }
}

// dyt[co, b*LO + o] = dy[b0 + b, co, o]: the chunk's output grads as one (CO, nb*LO) matrix.
template <typename T>
__device__ void conv1d_dy_t(T* dyt, const T* dy, u32 b0, u32 nb, u32 CO, u32 LO) {
    const u64 ncols = (u64)nb * LO;
    const u64 n = (u64)CO * ncols;
    GRID_STRIDE(idx, n) {
        const u64 co = idx / ncols, rem = idx % ncols;
        const u64 b = rem / LO, o = rem % LO;
        store_f(dyt, idx, load_f(dy, (i64)((((u64)b0 + b) * CO + co) * LO + o)));
    }
}

// The adjoint of im2col: dx[b0 + b, ci, i] = sum over taps kk (increasing, as the CPU's
// col2im adds them) of dcol[ci*K + kk, b*LO + o] for the one o, if any, with
// o*stride + kk - pad = i. A gather, so each dx element is written once, no atomics.
template <typename T>
__device__ void col2im(T* dx, const float* dcol, u32 b0, u32 nb, u32 CI, u32 L, u32 K, u32 LO, u32 stride, u32 pad) {
    const u64 item = (u64)CI * L;
    const u64 n = (u64)nb * item;
    const u64 ncols = (u64)nb * LO;
    GRID_STRIDE(idx, n) {
        const u64 b = idx / item, rem = idx % item;
        const u64 ci = rem / L, i = rem % L;
        float acc = 0.0f;
        for (u32 kk = 0; kk < K; ++kk) {
            const i64 t = (i64)i + (i64)pad - (i64)kk;  // = o * stride
            if (t < 0 || t % (i64)stride != 0) continue;
            const u64 o = (u64)(t / (i64)stride);
            if (o >= LO) continue;
            acc += dcol[(ci * K + kk) * ncols + b * LO + o];
        }
        store_f(dx, (i64)((u64)b0 * item + idx), acc);
    }
}

// db[co] += sum over (b, o) of dy[b, co, o]: one block per channel co, a fixed
// per-thread stride and a fixed f64 tree, the total added once. G is db's dtype: T, or
// f32 with a bf16 dy (mixed precision: the f32 grad of the f32 master bias).
template <typename G, typename T>
__device__ void conv1d_bias_grad(G* db, const T* dy, u32 B, u32 CO, u32 LO) {
    __shared__ double scratch[32];
    const u32 co = blockIdx.x;
    const u64 n = (u64)B * LO;
    double acc = 0.0;
    for (u64 j = threadIdx.x; j < n; j += blockDim.x) {
        const u64 b = j / LO, o = j % LO;
        acc += (double)load_f(dy, (i64)((b * CO + co) * LO + o));
    }
    int lane = threadIdx.x & 31, warp = threadIdx.x >> 5, nwarps = blockDim.x >> 5;
    acc = warp_sum_f64(acc);
    if (lane == 0) scratch[warp] = acc;
    __syncthreads();
    if (warp == 0) {
        acc = lane < nwarps ? scratch[lane] : 0.0;
        acc = warp_sum_f64(acc);
        if (lane == 0) store_f(db, co, load_f(db, co) + (float)acc);
    }
}

// images (B, C, H, W) -> patches (B, HP*WP, C*P*P): out[bi, ph*WP + pw, (ci*P + i)*P + j]
// = img[bi, ci, ph*P + i, pw*P + j]. One thread per output element.
template <typename T>
__device__ void patchify(T* out, const T* img, u32 B, u32 C, u32 H, u32 W, u32 P) {
    const u64 hp = H / P, wp = W / P, pp = (u64)P * P, row_len = (u64)C * pp;
    const u64 n = (u64)B * hp * wp * row_len;
    GRID_STRIDE(idx, n) {
        const u64 r = idx / row_len, q = idx % row_len;
        const u64 bi = r / (hp * wp), np = r % (hp * wp);
        const u64 ph = np / wp, pw = np % wp;
        const u64 ci = q / pp, rem = q % pp;
        const u64 i = rem / P, j = rem % P;
        const u64 src = ((bi * C + ci) * H + ph * P + i) * W + pw * P + j;
        out[idx] = img[src];
    }
}

// The inverse permutation (and adjoint): img[bi, ci, y, x] = patches[bi, (y/P)*WP + x/P,
// (ci*P + y%P)*P + x%P]. Patches do not overlap, so each pixel has exactly one source.
template <typename T>
__device__ void unpatchify(T* img, const T* patches, u32 B, u32 C, u32 H, u32 W, u32 P) {
    const u64 hp = H / P, wp = W / P, row_len = (u64)C * P * P;
    const u64 n = (u64)B * C * H * W;
    GRID_STRIDE(idx, n) {
        const u64 x = idx % W, t = idx / W;
        const u64 y = t % H, bc = t / H;
        const u64 ci = bc % C, bi = bc / C;
        const u64 np = (y / P) * wp + x / P;
        const u64 src = (bi * hp * wp + np) * row_len + (ci * P + y % P) * P + x % P;
        img[idx] = patches[src];
    }
}

#define BRAID_CONV(SUFFIX, T)                                                                         \
    extern "C" __global__ void braid_conv1d_im2col_##SUFFIX(T* col, const T* x, u32 b0, u32 nb,      \
                                                            u32 CI, u32 L, u32 K, u32 LO,            \
                                                            u32 stride, u32 pad) {                   \
        im2col(col, x, b0, nb, CI, L, K, LO, stride, pad);                                           \
    }                                                                                                 \
    extern "C" __global__ void braid_conv1d_out_##SUFFIX(T* y, const float* ytmp, const T* bias,      \
                                                         int has_bias, u32 b0, u32 nb, u32 CO,       \
                                                         u32 LO) {                                   \
        conv1d_out(y, ytmp, bias, has_bias, b0, nb, CO, LO);                                         \
    }                                                                                                 \
    extern "C" __global__ void braid_conv1d_dy_t_##SUFFIX(T* dyt, const T* dy, u32 b0, u32 nb,        \
                                                          u32 CO, u32 LO) {                          \
        conv1d_dy_t(dyt, dy, b0, nb, CO, LO);                                                        \
    }                                                                                                 \
    extern "C" __global__ void braid_conv1d_col2im_##SUFFIX(T* dx, const float* dcol, u32 b0, u32 nb, \
                                                            u32 CI, u32 L, u32 K, u32 LO,            \
                                                            u32 stride, u32 pad) {                   \
        col2im(dx, dcol, b0, nb, CI, L, K, LO, stride, pad);                                         \
    }                                                                                                 \
    extern "C" __global__ void braid_conv1d_bias_grad_##SUFFIX(T* db, const T* dy, u32 B, u32 CO,     \
                                                               u32 LO) {                             \
        conv1d_bias_grad(db, dy, B, CO, LO);                                                         \
    }                                                                                                 \
    extern "C" __global__ void braid_patchify_##SUFFIX(T* out, const T* img, u32 B, u32 C, u32 H,     \
                                                       u32 W, u32 P) {                               \
        patchify(out, img, B, C, H, W, P);                                                           \
    }                                                                                                 \
    extern "C" __global__ void braid_unpatchify_##SUFFIX(T* img, const T* patches, u32 B, u32 C,      \
                                                         u32 H, u32 W, u32 P) {                      \
        unpatchify(img, patches, B, C, H, W, P);                                                     \
    }

BRAID_CONV(f32, float)
BRAID_CONV(bf16, bf16_t)

// The mixed pair, suffix <db dtype>_<dy dtype>: bf16 dy into an f32 db.
extern "C" __global__ void braid_conv1d_bias_grad_f32_bf16(float* db, const bf16_t* dy, u32 B, u32 CO,
                                                           u32 LO) {
    conv1d_bias_grad(db, dy, B, CO, LO);
}
