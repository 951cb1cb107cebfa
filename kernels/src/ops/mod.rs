//! The op surface: every op validates its arguments, then runs on its inputs' device.
//!
//! Layers (`braid-nn`) call these functions only. Each forward has its backward beside
//! it in the same file. Validation here is device-independent — shapes, dtypes, that
//! all arguments share a device — so backends can assume consistent inputs.

pub mod activation;
pub mod attention;
pub mod conv;
pub mod elementwise;
pub mod embedding;
pub mod layout;
pub mod loss;
pub mod matmul;
pub mod norm;
pub mod optim;
pub mod rope;

pub use activation::{
    Activation, activation_bwd, activation_fwd, softmax_bwd, softmax_fwd, swiglu_bwd, swiglu_fwd,
};
pub use attention::{AttentionSpec, attention_bwd, attention_fwd};
pub use conv::{Conv1dSpec, conv1d_bwd, conv1d_fwd, patchify_bwd, patchify_fwd};
pub use elementwise::{add, add_assign, cast, global_norm, into_dtype, scale_assign, sum_squares};
pub use embedding::{embedding_bwd, embedding_fwd};
pub use layout::{copy_range, gather_rows, narrow_last, scatter_rows, transpose01};
pub use loss::{cross_entropy_fwd_bwd, vocab_loss_finish, vocab_loss_partials};
pub use matmul::{GemmSpec, add_bias, linear_bwd, linear_fwd, linear_wgrad, matmul, matmul_into};
pub use norm::{layer_norm_bwd, layer_norm_fwd, rms_norm_bwd, rms_norm_fwd};
pub use optim::{AdamWSpec, adamw_step, adamw_step_with_copy};
pub use rope::{rope_bwd, rope_fwd};

use crate::device::Device;
use crate::dtype::DType;
use crate::error::{Error, Result};
use crate::shape::Shape;
use crate::tensor::Tensor;

/// All named tensors must be on one device; returns it.
pub(crate) fn same_device(op: &'static str, args: &[(&'static str, &Tensor)]) -> Result<Device> {
    let Some(((_, first), rest)) = args.split_first() else {
        return Ok(Device::Cpu);
    };
    let device = first.device();
    for (name, t) in rest {
        if t.device() != device {
            return Err(Error::Device {
                op,
                arg: name,
                got: t.device(),
                expected: device,
            });
        }
    }
    Ok(device)
}

/// All named tensors must have `dtype`.
pub(crate) fn expect_dtype(
    op: &'static str,
    dtype: DType,
    args: &[(&'static str, &Tensor)],
) -> Result<()> {
    for (name, t) in args {
        if t.dtype() != dtype {
            return Err(Error::DType {
                op,
                arg: name,
                got: t.dtype(),
                expected: dtype,
            });
        }
    }
    Ok(())
}

/// All named float tensors must share the first one's float dtype; returns it.
pub(crate) fn same_float_dtype(
    op: &'static str,
    args: &[(&'static str, &Tensor)],
) -> Result<DType> {
    let dtype = args.first().map(|(_, t)| t.dtype()).unwrap_or(DType::F32);
    if !dtype.is_float() {
        let name = args.first().map(|(n, _)| *n).unwrap_or("?");
        return Err(Error::DType {
            op,
            arg: name,
            got: dtype,
            expected: DType::F32,
        });
    }
    expect_dtype(op, dtype, args)?;
    Ok(dtype)
}

/// An accumulator (`dw`, `db`, `dtable`, a GEMM's `c`) for results computed from
/// `input`-typed operands: the input's own dtype, or f32 — under mixed precision
/// the f32 grads of the master weights gather products of bf16 activations.
pub(crate) fn accumulator_dtype(
    op: &'static str,
    (name, acc): (&'static str, &Tensor),
    input: DType,
) -> Result<()> {
    if acc.dtype() == input || acc.dtype() == DType::F32 {
        return Ok(());
    }
    Err(Error::DType {
        op,
        arg: name,
        got: acc.dtype(),
        expected: input,
    })
}

/// `t` must have exactly `shape`.
pub(crate) fn expect_shape(op: &'static str, name: &str, t: &Tensor, shape: &Shape) -> Result<()> {
    if t.shape() != shape {
        return Err(Error::shape(
            op,
            format!("`{name}` has shape {}, expected {shape}", t.shape()),
        ));
    }
    Ok(())
}

/// `a` and `b` must have the same shape.
pub(crate) fn same_shape(
    op: &'static str,
    (an, a): (&str, &Tensor),
    (bn, b): (&str, &Tensor),
) -> Result<()> {
    if a.shape() != b.shape() {
        return Err(Error::shape(
            op,
            format!(
                "`{an}` {} and `{bn}` {} must have the same shape",
                a.shape(),
                b.shape()
            ),
        ));
    }
    Ok(())
}
