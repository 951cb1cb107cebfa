//! conv1d (im2col + GEMM through [`MatmulKernels::gemm`]) and patchify on CUDA
//! (`kernels/cuda/conv.cu`).
//!
//! The batch is cut into chunks of whole items whose column matrix fits
//! [`COL_BUDGET`]; each chunk is one GEMM (its items side by side as columns), so a
//! Whisper stem is a handful of large GEMMs, not one small one per item. The chunking
//! depends only on the shapes, so dw — summed chunk after chunk with `beta = 1` — has
//! the same bits on every run; db is one fixed-order reduction over the whole dy.
//!
//! Mixed precision: with dy, x, w bf16, dw and db may be f32 (the master weights'
//! grads): dw's GEMM is then bf16 x bf16 -> f32 (cuBLASLt, f32 accumulate) and db has
//! its own kernel, `braid_conv1d_bias_grad_f32_bf16`.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::compile::CONV;
use super::storage::{DeviceFloat, slice, slice_mut};
use super::{CudaBackend, grid_for, storage_err, to_u32};
use crate::backend::{ConvKernels, MatmulKernels};
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::ops::conv::{Conv1dDims, Conv1dSpec};
use crate::ops::matmul::GemmSpec;
use crate::shape::Shape;
use crate::tensor::Tensor;

/// Elements of scratch (col, dcol, ytmp / dyt) one chunk of batch items may use: 2^26
/// (256 MiB in f32). A chunk always holds at least one item.
const COL_BUDGET: usize = 1 << 26;

/// The conv's dims (shared with the CPU backend).
type Dims = Conv1dDims;

impl Conv1dDims {
    /// Batch items per chunk: as many as fit [`COL_BUDGET`] of col + dcol + ytmp/dyt.
    fn items_per_chunk(&self) -> usize {
        let per_item = (2 * self.cik() + self.co) * self.lo;
        (COL_BUDGET / per_item.max(1)).clamp(1, self.b.max(1))
    }

    /// The kernels' 32-bit view of the dims: [CI, L, K, LO, stride, pad, CO, B].
    fn u32s(&self, op: &'static str) -> Result<[u32; 8]> {
        Ok([
            to_u32(op, "CI", self.ci)?,
            to_u32(op, "L", self.l)?,
            to_u32(op, "K", self.k)?,
            to_u32(op, "LO", self.lo)?,
            to_u32(op, "stride", self.stride)?,
            to_u32(op, "padding", self.pad)?,
            to_u32(op, "CO", self.co)?,
            to_u32(op, "B", self.b)?,
        ])
    }
}

/// A plain (batch 1, no broadcast) GEMM spec: `C (m, n) = alpha op(A) op(B) + beta C`.
fn gemm_spec(m: usize, n: usize, k: usize, trans_a: bool, trans_b: bool, beta: f32) -> GemmSpec {
    GemmSpec {
        batch: 1,
        m,
        n,
        k,
        trans_a,
        trans_b,
        stride_a: 0,
        stride_b: 0,
        alpha: 1.0,
        beta,
    }
}

/// Dispatches `$self.$f::<T>(args)` on the storage dtype of `$x`.
macro_rules! by_dtype {
    ($self:ident, $op:expr, $x:expr, $f:ident($($arg:expr),*)) => {
        match $x.dtype() {
            DType::F32 => $self.$f::<f32>($($arg),*),
            DType::BF16 => $self.$f::<u16>($($arg),*),
            DType::U32 => Err(storage_err($op, "x", $x)),
        }
    };
}

impl ConvKernels for CudaBackend {
    fn conv1d_fwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        spec: &Conv1dSpec,
    ) -> Result<Tensor> {
        by_dtype!(self, "conv1d_fwd", x, conv_fwd(x, w, b, spec))
    }

    fn conv1d_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        spec: &Conv1dSpec,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        by_dtype!(self, "conv1d_bwd", x, conv_bwd(dy, x, w, spec, dw, db))
    }

    fn patchify(&self, images: &Tensor, patch: usize) -> Result<Tensor> {
        by_dtype!(self, "patchify", images, patchify_t(images, patch))
    }

    fn unpatchify(&self, dpatches: &Tensor, image_shape: &Shape, patch: usize) -> Result<Tensor> {
        by_dtype!(
            self,
            "unpatchify",
            dpatches,
            unpatchify_t(dpatches, image_shape, patch)
        )
    }
}

/// `(B, C, H, W, P)` of a patchify, P re-checked against H and W (the ops layer did it
/// already; the kernels index whole patches).
fn patch_dims(op: &'static str, shape: &Shape, patch: usize) -> Result<[usize; 5]> {
    let [b, c, h, w] = shape.dims_n::<4>(op, "images")?;
    if patch == 0 || !h.is_multiple_of(patch) || !w.is_multiple_of(patch) {
        return Err(Error::shape(
            op,
            format!("H = {h}, W = {w} are not multiples of the patch size {patch}"),
        ));
    }
    Ok([b, c, h, w, patch])
}

impl CudaBackend {
    /// A new tensor around a device buffer, for handing scratch matrices to [`Self::gemm`].
    fn matrix<T: DeviceFloat>(s: CudaSlice<T>, rows: usize, cols: usize) -> Result<Tensor> {
        Tensor::from_cuda(T::wrap(s), [rows, cols])
    }

    /// col (CI*K, nb*LO) of items `b0 .. b0 + nb` of x.
    fn im2col<T: DeviceFloat>(
        &self,
        op: &'static str,
        d: &Dims,
        xs: &CudaSlice<T>,
        b0: u32,
        nb: u32,
    ) -> Result<Tensor> {
        let [ci, l, k, lo, stride, pad, _, _] = d.u32s(op)?;
        let n = d.cik() * nb as usize * d.lo;
        let mut col = self.alloc::<T>(op, n, || "the conv1d column matrix".into())?;
        let f = self.function(
            &CONV,
            T::pick("braid_conv1d_im2col_f32", "braid_conv1d_im2col_bf16"),
        )?;
        // braid_conv1d_im2col_T(T* col, const T* x, u32 b0, u32 nb, u32 CI, u32 L, u32 K,
        //                       u32 LO, u32 stride, u32 pad)
        // SAFETY: signature above; col holds CI*K*nb*LO (written in full, grid-stride);
        // x reads stay inside items b0 .. b0 + nb <= B of x (B*CI*L), positions in [0, L).
        unsafe {
            launch!(self, op, f, grid_for(n); &mut col, xs, &b0, &nb, &ci, &l, &k, &lo, &stride, &pad)?
        };
        Self::matrix(col, d.cik(), nb as usize * d.lo)
    }

    fn conv_fwd<T: DeviceFloat>(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        spec: &Conv1dSpec,
    ) -> Result<Tensor> {
        const OP: &str = "conv1d_fwd";
        let d = Dims::new(OP, x, w, spec)?;
        let [.., co, _] = d.u32s(OP)?;
        let lo = to_u32(OP, "LO", d.lo)?;
        let xs = slice::<T>(OP, "x", x)?; // (B, CI, L)
        let ws = slice::<T>(OP, "w", w)?; // (CO, CI*K)
        let bs = match b {
            Some(b) => slice::<T>(OP, "b", b)?, // (CO)
            None => ws,                         // not read without a bias
        };
        let has_bias = i32::from(b.is_some());
        let mut y = self.alloc::<T>(OP, d.b * d.co * d.lo, || format!("the conv1d of {x:?}"))?; // (B, CO, LO)
        let shape = [d.b, d.co, d.lo];
        if y.is_empty() {
            return Tensor::from_cuda(T::wrap(y), shape);
        }
        let per = d.items_per_chunk();
        let f_out = self.function(
            &CONV,
            T::pick("braid_conv1d_out_f32", "braid_conv1d_out_bf16"),
        )?;
        for first in (0..d.b).step_by(per) {
            let items = per.min(d.b - first);
            let (b0, nb) = (
                to_u32(OP, "batch item", first)?,
                to_u32(OP, "batch items", items)?,
            );
            let ncols = items * d.lo;
            // ytmp (CO, nb*LO) = w (CO, CI*K) @ col (CI*K, nb*LO); zeros when CI*K = 0.
            // f32 for either T: a bf16 y is rounded once, after the bias (as the CPU).
            let ytmp = if d.cik() == 0 {
                Self::matrix(
                    self.alloc_zeros::<f32>(OP, d.co * ncols, || "conv1d outputs".into())?,
                    d.co,
                    ncols,
                )?
            } else {
                let col = self.im2col::<T>(OP, &d, xs, b0, nb)?;
                let out = self.alloc::<f32>(OP, d.co * ncols, || "conv1d outputs".into())?;
                let mut ytmp = Self::matrix(out, d.co, ncols)?;
                // w is passed as stored, (CO, CI, K): the (CO, CI*K) matrix of the spec.
                self.gemm(
                    w,
                    &col,
                    &mut ytmp,
                    &gemm_spec(d.co, ncols, d.cik(), false, false, 0.0),
                )?;
                ytmp
            };
            let ys = slice::<f32>(OP, "ytmp", &ytmp)?;
            // braid_conv1d_out_T(T* y, const float* ytmp, const T* bias, int has_bias, u32 b0,
            //                    u32 nb, u32 CO, u32 LO)
            // SAFETY: signature above; writes y[b0*CO*LO ..][.. nb*CO*LO], inside the
            // B*CO*LO as b0 + nb <= B; reads ytmp (CO*nb*LO) and bias[co < CO].
            unsafe {
                launch!(self, OP, f_out, grid_for(d.co * ncols); &mut y, ys, bs, &has_bias, &b0, &nb, &co, &lo)?
            };
        }
        Tensor::from_cuda(T::wrap(y), shape)
    }

    #[allow(clippy::too_many_arguments)]
    fn conv_bwd<T: DeviceFloat>(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        spec: &Conv1dSpec,
        mut dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        const OP: &str = "conv1d_bwd";
        let d = Dims::new(OP, x, w, spec)?;
        if dy.elem_count() != d.b * d.co * d.lo {
            return Err(Error::shape(
                OP,
                format!(
                    "dy {} does not fit x {} and w {}",
                    dy.shape(),
                    x.shape(),
                    w.shape()
                ),
            ));
        }
        let [ci, l, k, lo, stride, pad, co, bsz] = d.u32s(OP)?;
        let db_kernel = match db.as_deref() {
            Some(db) => Some(Self::bias_grad_kernel::<T>(db, co)?),
            None => None,
        };
        let dys = slice::<T>(OP, "dy", dy)?; // (B, CO, LO)
        let xs = slice::<T>(OP, "x", x)?; // (B, CI, L)
        let dx_n = d.b * d.ci * d.l;
        let dx_what = || format!("the conv1d input grad of {x:?}");
        if d.co == 0 || d.b == 0 {
            // No outputs: dx is zero and the parameter grads gain nothing.
            let dx = self.alloc_zeros::<T>(OP, dx_n, dx_what)?;
            return Tensor::from_cuda(T::wrap(dx), [d.b, d.ci, d.l]);
        }
        let mut dx = self.alloc::<T>(OP, dx_n, dx_what)?; // (B, CI, L)
        let per = d.items_per_chunk();
        let f_dyt = self.function(
            &CONV,
            T::pick("braid_conv1d_dy_t_f32", "braid_conv1d_dy_t_bf16"),
        )?;
        let f_col2im = self.function(
            &CONV,
            T::pick("braid_conv1d_col2im_f32", "braid_conv1d_col2im_bf16"),
        )?;
        // CI = 0: dx is empty and dw has no elements, so only db below has work.
        let chunks = if d.cik() == 0 { 0 } else { d.b };
        for first in (0..chunks).step_by(per) {
            let items = per.min(d.b - first);
            let (b0, nb) = (
                to_u32(OP, "batch item", first)?,
                to_u32(OP, "batch items", items)?,
            );
            let ncols = items * d.lo;
            // dyt (CO, nb*LO): the chunk's dy with its items side by side.
            let mut dyt = self.alloc::<T>(OP, d.co * ncols, || {
                "the permuted conv1d output grad".into()
            })?;
            // braid_conv1d_dy_t_T(T* dyt, const T* dy, u32 b0, u32 nb, u32 CO, u32 LO)
            // SAFETY: signature above; writes all CO*nb*LO of dyt; reads items
            // b0 .. b0 + nb <= B of dy (B*CO*LO).
            unsafe {
                launch!(self, OP, f_dyt, grid_for(d.co * ncols); &mut dyt, dys, &b0, &nb, &co, &lo)?
            };
            let dyt = Self::matrix(dyt, d.co, ncols)?;
            // dcol (CI*K, nb*LO) = wᵀ (CI*K, CO) @ dyt (CO, nb*LO), then folded into dx;
            // f32 for either T, so a bf16 dx is rounded once, after the taps' sum.
            let mut dcol = Self::matrix(
                self.alloc::<f32>(OP, d.cik() * ncols, || "the conv1d column grad".into())?,
                d.cik(),
                ncols,
            )?;
            self.gemm(
                w,
                &dyt,
                &mut dcol,
                &gemm_spec(d.cik(), ncols, d.co, true, false, 0.0),
            )?;
            if d.l > 0 {
                let dcs = slice::<f32>(OP, "dcol", &dcol)?;
                // braid_conv1d_col2im_T(T* dx, const float* dcol, u32 b0, u32 nb, u32 CI, u32 L,
                //                       u32 K, u32 LO, u32 stride, u32 pad)
                // SAFETY: signature above; writes dx[b0*CI*L ..][.. nb*CI*L], inside the
                // B*CI*L; reads dcol at (ci*K + kk)*nb*LO + b*LO + o < CI*K*nb*LO.
                unsafe {
                    launch!(self, OP, f_col2im, grid_for(items * d.ci * d.l);
                        &mut dx, dcs, &b0, &nb, &ci, &l, &k, &lo, &stride, &pad)?
                };
            }
            if let Some(dw) = dw.as_deref_mut() {
                // dw (CO, CI*K) += dyt (CO, nb*LO) @ colᵀ (nb*LO, CI*K), chunk after chunk.
                let col = self.im2col::<T>(OP, &d, xs, b0, nb)?;
                self.gemm(
                    &dyt,
                    &col,
                    dw,
                    &gemm_spec(d.co, d.cik(), ncols, false, true, 1.0),
                )?;
            }
        }
        if let (Some(db), Some(kernel)) = (db, db_kernel) {
            self.conv_bias_grad::<T>(kernel, dys, db, [bsz, co, lo])?;
        }
        Tensor::from_cuda(T::wrap(dx), [d.b, d.ci, d.l])
    }

    /// The bias-grad kernel for a dy of dtype T into `db`: db of dtype T, or f32 with a
    /// bf16 dy (mixed precision: the f32 grad of the f32 master bias). Kernel names:
    /// `braid_conv1d_bias_grad_<G>` when db and dy share dtype G, `<db>_<dy>` for the
    /// mixed pair. Called before any launch, so a bad `db` leaves `dw` unchanged too.
    fn bias_grad_kernel<T: DeviceFloat>(db: &Tensor, co: u32) -> Result<&'static str> {
        const OP: &str = "conv1d_bwd";
        if db.elem_count() < co as usize {
            return Err(Error::shape(
                OP,
                format!("`db` {db:?} holds fewer than CO = {co} elements"),
            ));
        }
        match (T::IS_BF16, db.dtype()) {
            (false, DType::F32) => Ok("braid_conv1d_bias_grad_f32"),
            (true, DType::F32) => Ok("braid_conv1d_bias_grad_f32_bf16"),
            (true, DType::BF16) => Ok("braid_conv1d_bias_grad_bf16"),
            _ => Err(Error::invalid(
                OP,
                format!(
                    "`db` {db:?} cannot take the grad of an f32 `dy`: db must be f32 or dy's dtype"
                ),
            )),
        }
    }

    /// `db (CO) += sum over (b, o) of dy[b, co, o]` with `kernel` from
    /// [`Self::bias_grad_kernel`].
    fn conv_bias_grad<T: DeviceFloat>(
        &self,
        kernel: &'static str,
        dys: &CudaSlice<T>,
        db: &mut Tensor,
        [bsz, co, lo]: [u32; 3],
    ) -> Result<()> {
        const OP: &str = "conv1d_bwd";
        let f = self.function(&CONV, kernel)?;
        let cfg = LaunchConfig {
            grid_dim: (co, 1, 1),
            block_dim: (256, 1, 1),
            shared_mem_bytes: 0,
        };
        // braid_conv1d_bias_grad_<G>[_<T>](G* db, const T* dy, u32 B, u32 CO, u32 LO)
        // SAFETY (both arms): signature above, `kernel` picked for exactly these dtypes
        // of db and dy; block co < CO updates db[co] (db holds at least CO, checked by
        // bias_grad_kernel); reads dy (B*CO*LO, checked by conv_bwd against the dims).
        match db.dtype() {
            DType::F32 => {
                let dbs = slice_mut::<f32>(OP, "db", db)?;
                // SAFETY: see above.
                unsafe { launch!(self, OP, f, cfg; dbs, dys, &bsz, &co, &lo) }
            }
            _ => {
                let dbs = slice_mut::<u16>(OP, "db", db)?;
                // SAFETY: see above.
                unsafe { launch!(self, OP, f, cfg; dbs, dys, &bsz, &co, &lo) }
            }
        }
    }

    fn patchify_t<T: DeviceFloat>(&self, images: &Tensor, patch: usize) -> Result<Tensor> {
        const OP: &str = "patchify";
        let [b, c, h, w, p] = patch_dims(OP, images.shape(), patch)?;
        let (hp, wp) = (h / p, w / p);
        let n = images.elem_count();
        let img = slice::<T>(OP, "images", images)?; // (B, C, H, W)
        let mut out = self.alloc::<T>(OP, n, || format!("the patches of {images:?}"))?; // (B, HP*WP, C*P*P)
        if n > 0 {
            let dims = [
                to_u32(OP, "B", b)?,
                to_u32(OP, "C", c)?,
                to_u32(OP, "H", h)?,
                to_u32(OP, "W", w)?,
                to_u32(OP, "P", p)?,
            ];
            let f = self.function(&CONV, T::pick("braid_patchify_f32", "braid_patchify_bf16"))?;
            // braid_patchify_T(T* out, const T* img, u32 B, u32 C, u32 H, u32 W, u32 P)
            // SAFETY: signature above; out and img both hold B*C*H*W (a permutation; P
            // divides H and W, checked above); grid-stride over the outputs.
            unsafe {
                launch!(self, OP, f, grid_for(n); &mut out, img, &dims[0], &dims[1], &dims[2], &dims[3], &dims[4])?
            };
        }
        Tensor::from_cuda(T::wrap(out), [b, hp * wp, c * p * p])
    }

    fn unpatchify_t<T: DeviceFloat>(
        &self,
        dpatches: &Tensor,
        image_shape: &Shape,
        patch: usize,
    ) -> Result<Tensor> {
        const OP: &str = "unpatchify";
        let [b, c, h, w, p] = patch_dims(OP, image_shape, patch)?;
        let n = b * c * h * w;
        if dpatches.elem_count() != n {
            return Err(Error::shape(
                OP,
                format!(
                    "dpatches {} does not fit images {image_shape} with patch {p}",
                    dpatches.shape()
                ),
            ));
        }
        let dp = slice::<T>(OP, "dpatches", dpatches)?; // (B, HP*WP, C*P*P)
        let mut img =
            self.alloc::<T>(OP, n, || format!("the image grad of shape {image_shape}"))?; // (B, C, H, W)
        if n > 0 {
            let dims = [
                to_u32(OP, "B", b)?,
                to_u32(OP, "C", c)?,
                to_u32(OP, "H", h)?,
                to_u32(OP, "W", w)?,
                to_u32(OP, "P", p)?,
            ];
            let f = self.function(
                &CONV,
                T::pick("braid_unpatchify_f32", "braid_unpatchify_bf16"),
            )?;
            // braid_unpatchify_T(T* img, const T* patches, u32 B, u32 C, u32 H, u32 W, u32 P)
            // SAFETY: signature above; img and dpatches both hold B*C*H*W (checked above);
            // grid-stride over the pixels, each written once.
            unsafe {
                launch!(self, OP, f, grid_for(n); &mut img, dp, &dims[0], &dims[1], &dims[2], &dims[3], &dims[4])?
            };
        }
        Tensor::from_cuda(T::wrap(img), image_shape.clone())
    }
}
