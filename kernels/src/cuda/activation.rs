//! Activations, SwiGLU and softmax on CUDA (`kernels/cuda/activation.cu`): grid-stride
//! elementwise kernels, and one block per row for softmax.

use cudarc::driver::LaunchConfig;

use super::compile::ACTIVATION;
use super::storage::{DeviceFloat, slice};
use super::{CudaBackend, grid_for, storage_err, to_u32};
use crate::backend::ActivationKernels;
use crate::dtype::DType;
use crate::error::Result;
use crate::ops::activation::Activation;
use crate::tensor::Tensor;

/// The kernels' code of each activation (`BRAID_ACT_*` in activation.cu).
fn act_code(act: Activation) -> u32 {
    match act {
        Activation::GeluTanh => 0,
        Activation::GeluErf => 1,
        Activation::QuickGelu => 2,
        Activation::Silu => 3,
    }
}

/// One block per row for softmax: threads a multiple of 32 (the block reductions need
/// whole warps), no more than the row has elements, at most 256; a function of C
/// alone, so a row's bits do not depend on the other rows.
fn row_launch(n: u32, c: usize) -> LaunchConfig {
    let threads = (c.div_ceil(32) * 32).clamp(32, 256) as u32;
    LaunchConfig {
        grid_dim: (n, 1, 1),
        block_dim: (threads, 1, 1),
        shared_mem_bytes: 0,
    }
}

/// `(rows, C)` of a softmax input: C the last dimension, rows all the others.
fn softmax_dims(op: &'static str, x: &Tensor) -> Result<(u32, u32)> {
    let c = x.dims().last().copied().unwrap_or(1).max(1);
    Ok((to_u32(op, "rows", x.elem_count() / c)?, to_u32(op, "C", c)?))
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

impl ActivationKernels for CudaBackend {
    fn activation_fwd(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        by_dtype!(self, "activation_fwd", x, act_fwd(x, act))
    }

    fn activation_bwd(&self, dy: &Tensor, x: &Tensor, act: Activation) -> Result<Tensor> {
        by_dtype!(self, "activation_bwd", x, act_bwd(dy, x, act))
    }

    fn swiglu_fwd(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        by_dtype!(self, "swiglu_fwd", gate, swiglu_fwd_t(gate, up))
    }

    fn swiglu_bwd(&self, dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
        by_dtype!(self, "swiglu_bwd", gate, swiglu_bwd_t(dy, gate, up))
    }

    fn softmax_fwd(&self, x: &Tensor) -> Result<Tensor> {
        by_dtype!(self, "softmax_fwd", x, softmax_fwd_t(x))
    }

    fn softmax_bwd(&self, dy: &Tensor, y: &Tensor) -> Result<Tensor> {
        by_dtype!(self, "softmax_bwd", y, softmax_bwd_t(dy, y))
    }
}

impl CudaBackend {
    fn act_fwd<T: DeviceFloat>(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        const OP: &str = "activation_fwd";
        let n = x.elem_count();
        let xs = slice::<T>(OP, "x", x)?; // (N)
        let mut y = self.alloc::<T>(OP, n, || format!("{act:?} of {x:?}"))?; // (N)
        if n > 0 {
            let f = self.function(
                &ACTIVATION,
                T::pick("braid_activation_fwd_f32", "braid_activation_fwd_bf16"),
            )?;
            let (code, n64) = (act_code(act), n as u64);
            // braid_activation_fwd_T(T* y, const T* x, u32 act, u64 n)
            // SAFETY: signature above; y and x hold n elements; grid-stride over i < n.
            unsafe { launch!(self, OP, f, grid_for(n); &mut y, xs, &code, &n64)? };
        }
        Tensor::from_cuda(T::wrap(y), x.shape().clone())
    }

    fn act_bwd<T: DeviceFloat>(&self, dy: &Tensor, x: &Tensor, act: Activation) -> Result<Tensor> {
        const OP: &str = "activation_bwd";
        let n = x.elem_count();
        let dys = slice::<T>(OP, "dy", dy)?; // (N)
        let xs = slice::<T>(OP, "x", x)?; // (N)
        let mut dx = self.alloc::<T>(OP, n, || format!("the {act:?} grad of {x:?}"))?; // (N)
        if n > 0 {
            let f = self.function(
                &ACTIVATION,
                T::pick("braid_activation_bwd_f32", "braid_activation_bwd_bf16"),
            )?;
            let (code, n64) = (act_code(act), n as u64);
            // braid_activation_bwd_T(T* dx, const T* dy, const T* x, u32 act, u64 n)
            // SAFETY: signature above; dx, dy, x hold n elements (ops checked the shapes).
            unsafe { launch!(self, OP, f, grid_for(n); &mut dx, dys, xs, &code, &n64)? };
        }
        Tensor::from_cuda(T::wrap(dx), x.shape().clone())
    }

    fn swiglu_fwd_t<T: DeviceFloat>(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        const OP: &str = "swiglu_fwd";
        let n = gate.elem_count();
        let gs = slice::<T>(OP, "gate", gate)?; // (N)
        let us = slice::<T>(OP, "up", up)?; // (N)
        let mut y = self.alloc::<T>(OP, n, || format!("the SwiGLU of {gate:?}"))?; // (N)
        if n > 0 {
            let f = self.function(
                &ACTIVATION,
                T::pick("braid_swiglu_fwd_f32", "braid_swiglu_fwd_bf16"),
            )?;
            let n64 = n as u64;
            // braid_swiglu_fwd_T(T* y, const T* gate, const T* up, u64 n)
            // SAFETY: signature above; all three hold n elements (ops checked the shapes).
            unsafe { launch!(self, OP, f, grid_for(n); &mut y, gs, us, &n64)? };
        }
        Tensor::from_cuda(T::wrap(y), gate.shape().clone())
    }

    fn swiglu_bwd_t<T: DeviceFloat>(
        &self,
        dy: &Tensor,
        gate: &Tensor,
        up: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        const OP: &str = "swiglu_bwd";
        let n = gate.elem_count();
        let dys = slice::<T>(OP, "dy", dy)?; // (N)
        let gs = slice::<T>(OP, "gate", gate)?; // (N)
        let us = slice::<T>(OP, "up", up)?; // (N)
        let mut dgate = self.alloc::<T>(OP, n, || format!("the SwiGLU gate grad of {gate:?}"))?; // (N)
        let mut dup = self.alloc::<T>(OP, n, || format!("the SwiGLU up grad of {up:?}"))?; // (N)
        if n > 0 {
            let f = self.function(
                &ACTIVATION,
                T::pick("braid_swiglu_bwd_f32", "braid_swiglu_bwd_bf16"),
            )?;
            let n64 = n as u64;
            // braid_swiglu_bwd_T(T* dgate, T* dup, const T* dy, const T* gate, const T* up, u64 n)
            // SAFETY: signature above; all five hold n elements (ops checked the shapes).
            unsafe { launch!(self, OP, f, grid_for(n); &mut dgate, &mut dup, dys, gs, us, &n64)? };
        }
        Ok((
            Tensor::from_cuda(T::wrap(dgate), gate.shape().clone())?,
            Tensor::from_cuda(T::wrap(dup), up.shape().clone())?,
        ))
    }

    fn softmax_fwd_t<T: DeviceFloat>(&self, x: &Tensor) -> Result<Tensor> {
        const OP: &str = "softmax_fwd";
        let (rows, c) = softmax_dims(OP, x)?;
        let xs = slice::<T>(OP, "x", x)?; // (N, C)
        let mut y = self.alloc::<T>(OP, x.elem_count(), || format!("the softmax of {x:?}"))?; // (N, C)
        if rows > 0 {
            let f = self.function(
                &ACTIVATION,
                T::pick("braid_softmax_fwd_f32", "braid_softmax_fwd_bf16"),
            )?;
            // braid_softmax_fwd_T(T* y, const T* x, u32 C)
            // SAFETY: signature above; grid = rows blocks, block r reads and writes row r
            // of x and y (rows * C elements each).
            unsafe { launch!(self, OP, f, row_launch(rows, c as usize); &mut y, xs, &c)? };
        }
        Tensor::from_cuda(T::wrap(y), x.shape().clone())
    }

    fn softmax_bwd_t<T: DeviceFloat>(&self, dy: &Tensor, y: &Tensor) -> Result<Tensor> {
        const OP: &str = "softmax_bwd";
        let (rows, c) = softmax_dims(OP, y)?;
        let dys = slice::<T>(OP, "dy", dy)?; // (N, C)
        let ys = slice::<T>(OP, "y", y)?; // (N, C)
        let mut dx =
            self.alloc::<T>(OP, y.elem_count(), || format!("the softmax grad of {y:?}"))?; // (N, C)
        if rows > 0 {
            let f = self.function(
                &ACTIVATION,
                T::pick("braid_softmax_bwd_f32", "braid_softmax_bwd_bf16"),
            )?;
            // braid_softmax_bwd_T(T* dx, const T* dy, const T* y, u32 C)
            // SAFETY: signature above; block r reads row r of dy and y and writes row r of
            // dx (rows * C elements each; ops checked dy and y have one shape).
            unsafe { launch!(self, OP, f, row_launch(rows, c as usize); &mut dx, dys, ys, &c)? };
        }
        Tensor::from_cuda(T::wrap(dx), y.shape().clone())
    }
}
