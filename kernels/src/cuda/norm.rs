//! LayerNorm and RMSNorm on CUDA (`kernels/cuda/norm.cu`): one block per row for the
//! forwards and the dx of the backwards; parameter grads (dw, db) as a two-stage column
//! sum over a fixed number of row groups, with no atomics, so the bits never change.
//!
//! The parameter grads need not have the inputs' dtype: under mixed precision dy, x and
//! w are bf16 while dw/db are the f32 grads of the f32 master weights. The partial sums
//! are f64 whatever the inputs, so only the finishing kernel depends on the grad's dtype.

use cudarc::driver::{CudaSlice, LaunchConfig};

use super::compile::NORM;
use super::storage::{DeviceFloat, slice, slice_mut};
use super::{CudaBackend, CudaStorage, grid_for, storage_err, to_u32};
use crate::backend::NormKernels;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::tensor::Tensor;

/// Row groups of the first stage of a parameter-grad sum. Fixed (not derived from the
/// GPU), so the partition of rows into partial sums — and so the bits — depend only on
/// the shapes. 128 groups x ceil(C / 256) column blocks fill an H200 for C >= 768.
const GROUPS: u32 = 128;

/// Threads per block of the column kernels (one column per thread).
const COL_THREADS: u32 = 256;

/// The f32 buffer of a statistics tensor (mean, rstd: always f32).
fn stats<'a>(op: &'static str, arg: &'static str, t: &'a Tensor) -> Result<&'a CudaSlice<f32>> {
    slice::<f32>(op, arg, t)
}

/// One block per row; threads a multiple of 32 (the block reductions need whole warps),
/// no more than the row has elements, at most 256. Depends only on C, so a row's bits
/// do not depend on how many rows come with it.
fn row_launch(n: u32, c: usize) -> LaunchConfig {
    let threads = (c.div_ceil(32) * 32).clamp(32, 256) as u32;
    LaunchConfig {
        grid_dim: (n, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// The grid of the first stage of a parameter-grad sum: column blocks x [`GROUPS`].
fn partial_launch(c: u32) -> LaunchConfig {
    LaunchConfig {
        grid_dim: (c.div_ceil(COL_THREADS), GROUPS, 1),
        block_dim: (COL_THREADS, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `(N, C)` of a normalized tensor, as the kernels' 32-bit counts.
fn dims(op: &'static str, x: &Tensor, w: &Tensor) -> Result<(u32, u32)> {
    let c = w.elem_count().max(1);
    let n = x.elem_count() / c;
    Ok((to_u32(op, "N (rows)", n)?, to_u32(op, "C", c)?))
}

/// A parameter grad (`dw`, `db`) the finishing kernel can add into: f32 or bf16,
/// whatever the inputs' dtype, holding at least C elements. Checked before any launch,
/// so a bad grad leaves every grad unchanged.
fn check_grad(op: &'static str, arg: &'static str, t: Option<&Tensor>, c: u32) -> Result<()> {
    let Some(t) = t else { return Ok(()) };
    if t.dtype() == DType::U32 {
        return Err(Error::invalid(
            op,
            format!("`{arg}` {t:?} is not a float tensor"),
        ));
    }
    if t.elem_count() < c as usize {
        return Err(Error::shape(
            op,
            format!("`{arg}` {t:?} holds fewer than C = {c} elements"),
        ));
    }
    Ok(())
}

impl NormKernels for CudaBackend {
    fn layer_norm_fwd(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        match x.dtype() {
            DType::F32 => self.ln_fwd::<f32>(x, w, b, eps),
            DType::BF16 => self.ln_fwd::<u16>(x, w, b, eps),
            DType::U32 => Err(storage_err("layer_norm_fwd", "x", x)),
        }
    }

    fn layer_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        match x.dtype() {
            DType::F32 => self.ln_bwd::<f32>(dy, x, w, mean, rstd, dw, db),
            DType::BF16 => self.ln_bwd::<u16>(dy, x, w, mean, rstd, dw, db),
            DType::U32 => Err(storage_err("layer_norm_bwd", "x", x)),
        }
    }

    fn rms_norm_fwd(&self, x: &Tensor, w: &Tensor, eps: f32) -> Result<(Tensor, Tensor)> {
        match x.dtype() {
            DType::F32 => self.rms_fwd::<f32>(x, w, eps),
            DType::BF16 => self.rms_fwd::<u16>(x, w, eps),
            DType::U32 => Err(storage_err("rms_norm_fwd", "x", x)),
        }
    }

    fn rms_norm_bwd(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        match x.dtype() {
            DType::F32 => self.rms_bwd::<f32>(dy, x, w, rstd, dw),
            DType::BF16 => self.rms_bwd::<u16>(dy, x, w, rstd, dw),
            DType::U32 => Err(storage_err("rms_norm_bwd", "x", x)),
        }
    }
}

impl CudaBackend {
    fn ln_fwd<T: DeviceFloat>(
        &self,
        x: &Tensor,
        w: &Tensor,
        b: Option<&Tensor>,
        eps: f32,
    ) -> Result<(Tensor, Tensor, Tensor)> {
        const OP: &str = "layer_norm_fwd";
        let (n, c) = dims(OP, x, w)?;
        let xs = slice::<T>(OP, "x", x)?; // (N, C)
        let ws = slice::<T>(OP, "w", w)?; // (C)
        // Without a bias the kernel reads no `b`: w stands in for the pointer.
        let bs = match b {
            Some(b) => slice::<T>(OP, "b", b)?, // (C)
            None => ws,
        };
        let has_bias = i32::from(b.is_some());
        let mut y = self.alloc::<T>(OP, x.elem_count(), || format!("the layer norm of {x:?}"))?; // (N, C)
        let mut mean = self.alloc::<f32>(OP, n as usize, || "layer norm means".into())?; // (N)
        let mut rstd = self.alloc::<f32>(OP, n as usize, || "layer norm rstds".into())?; // (N)
        if n > 0 {
            let f = self.function(
                &NORM,
                T::pick("braid_layer_norm_fwd_f32", "braid_layer_norm_fwd_bf16"),
            )?;
            // braid_layer_norm_fwd_T(T* y, float* mean, float* rstd, const T* x, const T* w,
            //                        const T* b, int has_bias, u32 C, float eps)
            // SAFETY: signature above; grid N blocks, block n writes row n of y (C values of
            // the N*C) and mean[n], rstd[n] (N each); x is N*C, w and b hold C.
            unsafe {
                launch!(self, OP, f, row_launch(n, c as usize); &mut y, &mut mean, &mut rstd, xs, ws, bs, &has_bias, &c, &eps)?
            };
        }
        Ok((
            Tensor::from_cuda(T::wrap(y), x.shape().clone())?,
            Tensor::from_cuda(CudaStorage::F32(mean), [n as usize])?,
            Tensor::from_cuda(CudaStorage::F32(rstd), [n as usize])?,
        ))
    }

    #[allow(clippy::too_many_arguments)]
    fn ln_bwd<T: DeviceFloat>(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        mean: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
        db: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        const OP: &str = "layer_norm_bwd";
        let (n, c) = dims(OP, x, w)?;
        check_grad(OP, "dw", dw.as_deref(), c)?;
        check_grad(OP, "db", db.as_deref(), c)?;
        let dys = slice::<T>(OP, "dy", dy)?; // (N, C)
        let xs = slice::<T>(OP, "x", x)?; // (N, C)
        let ws = slice::<T>(OP, "w", w)?; // (C)
        let ms = stats(OP, "mean", mean)?; // (N)
        let rs = stats(OP, "rstd", rstd)?; // (N)
        let mut dx = self.alloc::<T>(OP, x.elem_count(), || {
            format!("the layer norm grad of {x:?}")
        })?; // (N, C)
        if n == 0 {
            // No rows: dx is empty and the parameter grads gain nothing.
            return Tensor::from_cuda(T::wrap(dx), x.shape().clone());
        }
        let f = self.function(
            &NORM,
            T::pick("braid_layer_norm_bwd_f32", "braid_layer_norm_bwd_bf16"),
        )?;
        // braid_layer_norm_bwd_T(T* dx, const T* dy, const T* x, const T* w,
        //                        const float* mean, const float* rstd, u32 C)
        // SAFETY: signature above; block n writes row n of dx (N*C) and reads row n of dy
        // and x (N*C), mean[n], rstd[n] (N) and w (C).
        unsafe {
            launch!(self, OP, f, row_launch(n, c as usize); &mut dx, dys, xs, ws, ms, rs, &c)?
        };

        if dw.is_some() || db.is_some() {
            let (want_dw, want_db) = (i32::from(dw.is_some()), i32::from(db.is_some()));
            let g_c = GROUPS as usize * c as usize;
            // (2, G, C): the dw partials, then the db partials; every slot of a wanted
            // part is written by the first stage.
            let mut partial = self.alloc::<f64>(OP, 2 * g_c, || {
                "layer norm parameter-grad partial sums".into()
            })?;
            let f = self.function(
                &NORM,
                T::pick(
                    "braid_layer_norm_param_partial_f32",
                    "braid_layer_norm_param_partial_bf16",
                ),
            )?;
            // braid_layer_norm_param_partial_T(double* partial, const T* dy, const T* x,
            //     const float* mean, const float* rstd, u32 N, u32 C, int want_dw, int want_db)
            // SAFETY: signature above; grid (ceil(C/256), G): thread (j < C, g) writes
            // partial[g*C + j] and partial[(G + g)*C + j], inside the 2*G*C; reads rows
            // n < N of dy and x (N*C) and mean[n], rstd[n].
            unsafe {
                launch!(self, OP, f, partial_launch(c); &mut partial, dys, xs, ms, rs, &n, &c, &want_dw, &want_db)?
            };
            if let Some(dw) = dw {
                self.add_partials(OP, "dw", dw, &partial, 0, c)?;
            }
            if let Some(db) = db {
                self.add_partials(OP, "db", db, &partial, g_c as u64, c)?;
            }
        }
        Tensor::from_cuda(T::wrap(dx), x.shape().clone())
    }

    fn rms_fwd<T: DeviceFloat>(
        &self,
        x: &Tensor,
        w: &Tensor,
        eps: f32,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "rms_norm_fwd";
        let (n, c) = dims(OP, x, w)?;
        let xs = slice::<T>(OP, "x", x)?; // (N, C)
        let ws = slice::<T>(OP, "w", w)?; // (C)
        let mut y = self.alloc::<T>(OP, x.elem_count(), || format!("the RMS norm of {x:?}"))?; // (N, C)
        let mut rstd = self.alloc::<f32>(OP, n as usize, || "RMS norm rstds".into())?; // (N)
        if n > 0 {
            let f = self.function(
                &NORM,
                T::pick("braid_rms_norm_fwd_f32", "braid_rms_norm_fwd_bf16"),
            )?;
            // braid_rms_norm_fwd_T(T* y, float* rstd, const T* x, const T* w, u32 C, float eps)
            // SAFETY: signature above; block n writes row n of y (N*C) and rstd[n] (N),
            // reads row n of x (N*C) and w (C).
            unsafe {
                launch!(self, OP, f, row_launch(n, c as usize); &mut y, &mut rstd, xs, ws, &c, &eps)?
            };
        }
        Ok((
            Tensor::from_cuda(T::wrap(y), x.shape().clone())?,
            Tensor::from_cuda(CudaStorage::F32(rstd), [n as usize])?,
        ))
    }

    fn rms_bwd<T: DeviceFloat>(
        &self,
        dy: &Tensor,
        x: &Tensor,
        w: &Tensor,
        rstd: &Tensor,
        dw: Option<&mut Tensor>,
    ) -> Result<Tensor> {
        const OP: &str = "rms_norm_bwd";
        let (n, c) = dims(OP, x, w)?;
        check_grad(OP, "dw", dw.as_deref(), c)?;
        let dys = slice::<T>(OP, "dy", dy)?; // (N, C)
        let xs = slice::<T>(OP, "x", x)?; // (N, C)
        let ws = slice::<T>(OP, "w", w)?; // (C)
        let rs = stats(OP, "rstd", rstd)?; // (N)
        let mut dx =
            self.alloc::<T>(OP, x.elem_count(), || format!("the RMS norm grad of {x:?}"))?; // (N, C)
        if n == 0 {
            return Tensor::from_cuda(T::wrap(dx), x.shape().clone());
        }
        let f = self.function(
            &NORM,
            T::pick("braid_rms_norm_bwd_f32", "braid_rms_norm_bwd_bf16"),
        )?;
        // braid_rms_norm_bwd_T(T* dx, const T* dy, const T* x, const T* w, const float* rstd, u32 C)
        // SAFETY: signature above; block n writes row n of dx (N*C), reads row n of dy, x
        // (N*C), rstd[n] (N) and w (C).
        unsafe { launch!(self, OP, f, row_launch(n, c as usize); &mut dx, dys, xs, ws, rs, &c)? };
        if let Some(dw) = dw {
            // (1, G, C): only the dw part.
            let mut partial = self.alloc::<f64>(OP, GROUPS as usize * c as usize, || {
                "RMS norm dw partial sums".into()
            })?;
            let f = self.function(
                &NORM,
                T::pick(
                    "braid_rms_norm_param_partial_f32",
                    "braid_rms_norm_param_partial_bf16",
                ),
            )?;
            // braid_rms_norm_param_partial_T(double* partial, const T* dy, const T* x,
            //                                const float* rstd, u32 N, u32 C)
            // SAFETY: signature above; grid (ceil(C/256), G): thread (j < C, g) writes only
            // partial[g*C + j] (the kernel passes want_db = 0), inside the G*C; reads rows
            // n < N of dy, x (N*C) and rstd[n].
            unsafe { launch!(self, OP, f, partial_launch(c); &mut partial, dys, xs, rs, &n, &c)? };
            self.add_partials(OP, "dw", dw, &partial, 0, c)?;
        }
        Tensor::from_cuda(T::wrap(dx), x.shape().clone())
    }

    /// Stage 2: `out[j] += sum_g partial[offset + g*C + j]`, G = [`GROUPS`], for j < C,
    /// in the dtype of `out` (argument `arg`), whatever the inputs' dtype: f32 (the
    /// master weight's grad under mixed precision, or the f32 path) is added in f32; a
    /// bf16 `out` is read, summed in f32 and rounded back to bf16.
    fn add_partials(
        &self,
        op: &'static str,
        arg: &'static str,
        out: &mut Tensor,
        partial: &CudaSlice<f64>,
        offset: u64,
        c: u32,
    ) -> Result<()> {
        // dtype and length: check_grad, before the first launch.
        match out.dtype() {
            DType::F32 => {
                self.add_partials_typed(op, slice_mut::<f32>(op, arg, out)?, partial, offset, c)
            }
            DType::BF16 => {
                self.add_partials_typed(op, slice_mut::<u16>(op, arg, out)?, partial, offset, c)
            }
            DType::U32 => Err(storage_err(op, arg, out)),
        }
    }

    /// [`Self::add_partials`] for a grad buffer of dtype `G`, holding at least C elements.
    fn add_partials_typed<G: DeviceFloat>(
        &self,
        op: &'static str,
        out: &mut CudaSlice<G>,
        partial: &CudaSlice<f64>,
        offset: u64,
        c: u32,
    ) -> Result<()> {
        let f = self.function(
            &NORM,
            G::pick(
                "braid_norm_sum_partials_f32",
                "braid_norm_sum_partials_bf16",
            ),
        )?;
        // braid_norm_sum_partials_G(G* out, const double* partial, u64 offset, u32 G, u32 C)
        // SAFETY: signature above; `out` holds at least C (check_grad), `partial`
        // holds at least offset + G*C (the callers allocate (2, G, C) or (1, G, C) and pass
        // offset 0 or G*C); grid-stride over j < C.
        unsafe { launch!(self, op, f, grid_for(c as usize); out, partial, &offset, &GROUPS, &c) }
    }
}
