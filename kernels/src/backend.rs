//! The kernels a device must provide, grouped by family.
//!
//! [`crate::ops`] validates every argument (shapes, dtypes, devices) and then calls
//! these methods on the backend of the inputs' device, so a backend may assume its
//! inputs are consistent. Each family is its own trait so that each lives in its own
//! file per backend (`cpu/norm.rs`, later `cuda/norm.rs`); [`Backend`] is all of them.
//!
//! Conventions: shapes use the letters of llm.c — `B` batch, `T` tokens, `C` channels,
//! `NH` query heads, `NKV` key/value heads, `HS` head size, `V` vocab, `N` rows of a
//! matrix view (all leading dimensions flattened). Backward methods *add* into
//! parameter grads (`dw`, `db`) and *return* input grads.

use std::fmt;

use crate::dtype::DType;
use crate::error::Result;
use crate::ops::activation::Activation;
use crate::ops::attention::{AttentionSpec, QkSegment};
use crate::ops::conv::Conv1dSpec;
use crate::ops::matmul::GemmSpec;
use crate::ops::optim::AdamWSpec;
use crate::shape::Shape;
use crate::tensor::{CpuStorage, Tensor};

/// Allocation, host <-> device copies and casts.
pub trait MemoryKernels {
    fn zeros(&self, shape: &Shape, dtype: DType) -> Result<Tensor>;
    fn copy_from_host(&self, data: CpuStorage, shape: Shape) -> Result<Tensor>;
    fn copy_to_host(&self, t: &Tensor) -> Result<CpuStorage>;
    /// f32 <-> bf16 (round to nearest even).
    fn cast(&self, x: &Tensor, dtype: DType) -> Result<Tensor>;
}

/// Elementwise arithmetic and reductions used by residuals, grad accumulation and
/// grad clipping.
pub trait ElementwiseKernels {
    /// `a + b`, same shapes.
    fn add(&self, a: &Tensor, b: &Tensor) -> Result<Tensor>;
    /// `acc += x`, same shapes.
    fn add_assign(&self, acc: &mut Tensor, x: &Tensor) -> Result<()>;
    /// `x *= s`.
    fn scale_assign(&self, x: &mut Tensor, s: f32) -> Result<()>;
    /// `sum(x^2)` accumulated in f64, returned to the host (one scalar).
    fn sum_squares(&self, x: &Tensor) -> Result<f64>;
    /// `sum over xs of sum(x^2)`, each tensor's sum in f64 added in order: the squared
    /// global grad norm. One scalar reaches the host, however many tensors (on a GPU:
    /// one device accumulator, one copy per step).
    fn sum_squares_all(&self, xs: &[&Tensor]) -> Result<f64> {
        let mut total = 0.0f64;
        for x in xs {
            total += self.sum_squares(x)?;
        }
        Ok(total)
    }
}

/// Matrix products.
pub trait MatmulKernels {
    /// `c = alpha * op(a) @ op(b) + beta * c`, batched; see [`GemmSpec`].
    fn gemm(&self, a: &Tensor, b: &Tensor, c: &mut Tensor, spec: &GemmSpec) -> Result<()>;
    /// `y[n, :] += bias` for every row `n`. y (N, C), bias (C).
    fn add_bias(&self, y: &mut Tensor, bias: &Tensor) -> Result<()>;
    /// `dbias += sum_n dy[n, :]`. dy (N, C), dbias (C).
    fn bias_grad(&self, dy: &Tensor, dbias: &mut Tensor) -> Result<()>;
}

/// Data movement that changes layout without arithmetic (tensor-parallel regions).
pub trait LayoutKernels {
    /// x (A, B, C) -> (B, A, C): swaps the two leading axes, rows of C stay contiguous.
    fn transpose01(&self, x: &Tensor) -> Result<Tensor>;
    /// x (N, C) -> (N, len): columns `start .. start + len` of every row.
    fn narrow_last(&self, x: &Tensor, start: usize, len: usize) -> Result<Tensor>;
    /// x (N, C), idx (M) u32 -> (M, C): `out[m] = x[idx[m]]`. An index >= N is an
    /// `Error::Invalid` naming it.
    fn gather_rows(&self, x: &Tensor, idx: &Tensor) -> Result<Tensor>;
    /// dst (N, C), idx (M) u32 distinct, src (M, C): `dst[idx[m]] = src[m]`. An index
    /// >= N or a repeated index is an `Error::Invalid` naming it; `dst` is then unchanged.
    fn scatter_rows(&self, dst: &mut Tensor, idx: &Tensor, src: &Tensor) -> Result<()>;
    /// `dst[dst_start .. dst_start + n] = src[src_start .. src_start + n]` over the
    /// tensors' flat element order (same dtype; ranges checked by `ops`): packing many
    /// tensors into one flat buffer and back, on the device (gradient buckets).
    fn copy_range(
        &self,
        src: &Tensor,
        src_start: usize,
        dst: &mut Tensor,
        dst_start: usize,
        n: usize,
    ) -> Result<()>;
}

/// Token embeddings.
pub trait EmbeddingKernels {
    /// ids (N) u32, table (V, C) -> (N, C).
    fn embedding_fwd(&self, ids: &Tensor, table: &Tensor) -> Result<Tensor>;
    /// dtable[ids[n], :] += dy[n, :]. dy (N, C).
    fn embedding_bwd(&self, dy: &Tensor, ids: &Tensor, dtable: &mut Tensor) -> Result<()>;
}

/// LayerNorm and RMSNorm over the last dimension.
pub trait NormKernels {
    /// x (N, C), w (C), b (C) -> (y (N, C), mean (N), rstd (N)).
    fn layer_norm_fwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)>;
    /// -> dx (N, C); adds into dw, db when given.
    #[allow(clippy::too_many_arguments)]
    fn layer_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor>;
    /// x (N, C), w (C) -> (y (N, C), rstd (N)).
    fn rms_norm_fwd(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)>;
    /// -> dx (N, C); adds into dw when given.
    fn rms_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
    ) -> Result<Tensor>;
}

/// Rotary position embedding.
pub trait RopeKernels {
    /// x (T, NH, HS), cos/sin (T, R/2) with R <= HS even. Rotates the first R channels
    /// of every head in the "rotate half" layout (pairs `i` and `i + R/2`), as Hugging
    /// Face's Llama/Qwen2 do. `inverse` rotates by the negative angle: that is the
    /// backward (the rotation is orthogonal).
    fn rope(&self, x: &Tensor, cos: &Tensor, sin: &Tensor, inverse: bool) -> Result<Tensor>;
}

/// Pointwise activations, SwiGLU, softmax.
pub trait ActivationKernels {
    fn activation_fwd(&self, x: &Tensor, act: Activation) -> Result<Tensor>;
    /// dx = dy * act'(x).
    fn activation_bwd(&self, dy: &Tensor, x: &Tensor, act: Activation) -> Result<Tensor>;
    /// silu(gate) * up, same shapes.
    fn swiglu_fwd(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor>;
    /// -> (dgate, dup).
    fn swiglu_bwd(&self, dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)>;
    /// Softmax over the last dimension.
    fn softmax_fwd(&self, x: &Tensor) -> Result<Tensor>;
    /// dx = y * (dy - sum(dy * y)), per row.
    fn softmax_bwd(&self, dy: &Tensor, y: &Tensor) -> Result<Tensor>;
}

/// Scaled-dot-product attention over packed variable-length sequences.
pub trait AttentionKernels {
    /// q (T, NH, HS), k/v (T, NKV, HS), `cu_seqlens` = [0, t1, t1 + t2, ..., T]
    /// -> (out (T, NH, HS), lse (NH, T)): the log-sum-exp of each query row's scores,
    /// kept for the backward.
    fn attention_fwd(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        cu_seqlens: &[usize],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)>;
    /// -> (dq, dk, dv), shaped like q, k, v.
    #[allow(clippy::too_many_arguments)]
    fn attention_bwd(
        &self,
        dout: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        cu_seqlens: &[usize],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)>;
    /// q (Tq, NH, HS), k/v (Tk, NKV, HS), query ranges attending to key ranges (see
    /// [`QkSegment`]) -> (out (Tq, NH, HS), lse (NH, Tq)).
    fn attention_fwd_ranges(
        &self,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor)>;
    /// -> (dq (Tq, NH, HS), dk, dv (Tk, NKV, HS)); grads of key rows shared by several
    /// segments are summed in segment order.
    #[allow(clippy::too_many_arguments)]
    fn attention_bwd_ranges(
        &self,
        dout: &Tensor,
        q: &Tensor,
        k: &Tensor,
        v: &Tensor,
        out: &Tensor,
        lse: &Tensor,
        segs: &[QkSegment],
        spec: &AttentionSpec,
    ) -> Result<(Tensor, Tensor, Tensor)>;
}

/// Softmax cross-entropy, fused forward + backward.
pub trait LossKernels {
    /// logits (N, V), targets (N) u32 -> (losses (N), dlogits (N, V)).
    /// Rows whose target is `ignore_index` get loss 0 and grad 0; the others get
    /// `-log softmax(logits)[target]` and `grad_scale * (softmax - onehot)`.
    fn cross_entropy(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        ignore_index: u32,
        grad_scale: f32,
    ) -> Result<(Tensor, Tensor)>;
}

/// Cross-entropy over logits split along the vocabulary across a TP group (Megatron's
/// vocab-parallel loss) on the device: partials per shard, one all-gather of them by the
/// caller, then the loss and this shard's grad. No logit leaves the device.
pub trait VocabLossKernels {
    /// logits shard (T, Vl), targets (T) u32 -> partials (3, T) f32: per row the shard's
    /// max `m`, `s = sum_j exp(x_j - m)`, and the target's logit where
    /// `vocab_start <= target < vocab_start + Vl` (0 elsewhere and on ignored rows).
    fn vocab_loss_partials(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        vocab_start: usize,
        ignore_index: u32,
    ) -> Result<Tensor>;
    /// gathered (R, 3, T): every rank's partials in rank order -> (losses (T),
    /// dlogits shard (T, Vl)). With `M = max_r m_r` and `S = sum_r s_r e^(m_r - M)`
    /// (f64, in rank order): `loss = ln S + M - x_target`,
    /// `dlogits = grad_scale * (e^(x - M) / S - onehot)`; ignored rows 0.
    #[allow(clippy::too_many_arguments)]
    fn vocab_loss_finish(
        &self,
        logits: &Tensor,
        targets: &Tensor,
        gathered: &Tensor,
        vocab_start: usize,
        ignore_index: u32,
        grad_scale: f32,
    ) -> Result<(Tensor, Tensor)>;
}

/// Convolution-like ops of the encoder stems.
pub trait ConvKernels {
    /// x (B, CI, L), w (CO, CI, K), b (CO) -> (B, CO, LO).
    fn conv1d_fwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        spec: &Conv1dSpec,
    ) -> Result<Tensor>;
    /// -> dx (B, CI, L); adds into dw, db when given.
    fn conv1d_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        spec: &Conv1dSpec,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor>;
    /// images (B, C, H, W) -> patches (B, (H/P)*(W/P), C*P*P), rows in raster order,
    /// each row flattened as (C, P, P) — the order of a PyTorch conv weight, so a
    /// conv patch-embedding's weight reshaped to (D, C*P*P) is the matching linear.
    fn patchify(&self, images: &Tensor, patch: usize) -> Result<Tensor>;
    /// The adjoint of [`ConvKernels::patchify`]: dpatches -> dimages (B, C, H, W).
    fn unpatchify(&self, dpatches: &Tensor, image_shape: &Shape, patch: usize) -> Result<Tensor>;
}

/// Optimizer updates, in place.
pub trait OptimKernels {
    /// One AdamW step (decoupled weight decay, bias-corrected), as `torch.optim.AdamW`,
    /// on f32 `param`, `grad`, `m`, `v`. When `compute` is given (a bf16 tensor of the
    /// same shape: the weight's compute copy under mixed precision), the updated param
    /// is also written there, rounded to nearest even, in the same pass.
    fn adamw_step(
        &self,
        param: &mut Tensor,
        grad: &Tensor,
        m: &mut Tensor,
        v: &mut Tensor,
        compute: Option<&mut Tensor>,
        spec: &AdamWSpec,
    ) -> Result<()>;
}

/// Everything a device must implement. CPU: [`crate::cpu::CpuBackend`].
pub trait Backend:
    MemoryKernels
    + ElementwiseKernels
    + MatmulKernels
    + LayoutKernels
    + EmbeddingKernels
    + NormKernels
    + RopeKernels
    + ActivationKernels
    + AttentionKernels
    + LossKernels
    + VocabLossKernels
    + ConvKernels
    + OptimKernels
    + Send
    + Sync
    + fmt::Debug
{
    /// A short name for logs ("cpu", "cuda").
    fn name(&self) -> &'static str;
}
