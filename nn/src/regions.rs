//! Tensor-parallel communication regions, each written as an adjoint pair side by side
//! (Megatron-Core's `mappings.py`): what the forward does, the backward undoes with
//! the transposed collective.
//!
//! | region          | forward                    | backward                   |
//! |-----------------|----------------------------|----------------------------|
//! | copy_to_tp      | identity                   | all-reduce (sum)           |
//! | reduce_from_tp  | all-reduce (sum)           | identity                   |
//! | scatter_to_tp   | split last dim, keep rank  | all-gather last dim        |
//! | gather_from_tp  | all-gather last dim        | split last dim, keep rank  |
//!
//! The group is always passed in (`&dyn Comm`); with [`braid_comm::SingleRank`] every
//! region is the identity and costs nothing (no copy).
//!
//! `Comm::all_gather` concatenates along dim 0; the last-dim gather reorders that with
//! `ops::transpose01`, and the split is `ops::narrow_last`: both device ops, so no
//! region reads device memory on the host.

use std::ops::Deref;

use braid_comm::Comm;
use braid_kernels::{Tensor, ops};

use crate::error::{Context, Error, Result};

/// A tensor that is either borrowed (a region that was the identity) or new.
#[derive(Debug)]
pub enum MaybeOwned<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
}

impl Deref for MaybeOwned<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            MaybeOwned::Borrowed(t) => t,
            MaybeOwned::Owned(t) => t,
        }
    }
}

// ---- copy_to_tp: the input of a column-parallel layer -------------------------------

/// Forward of copy_to_tp: identity (every rank already holds the full input).
pub fn copy_to_tp_fwd<'a>(_group: &dyn Comm, x: &'a Tensor) -> &'a Tensor {
    x
}

/// Backward of copy_to_tp: each rank's input grad covers only its output shard, so
/// the full input grad is their sum.
pub fn copy_to_tp_bwd(group: &dyn Comm, mut dx: Tensor) -> Result<Tensor> {
    if group.size() > 1 {
        group
            .all_reduce_sum(&mut dx)
            .ctx("copy_to_tp", "backward all-reduce")?;
    }
    Ok(dx)
}

// ---- reduce_from_tp: the output of a row-parallel layer -----------------------------

/// Forward of reduce_from_tp: the partial products of the ranks are summed.
pub fn reduce_from_tp_fwd(group: &dyn Comm, mut y: Tensor) -> Result<Tensor> {
    if group.size() > 1 {
        group
            .all_reduce_sum(&mut y)
            .ctx("reduce_from_tp", "forward all-reduce")?;
    }
    Ok(y)
}

/// Backward of reduce_from_tp: identity (every rank's partial sum got the same grad).
pub fn reduce_from_tp_bwd<'a>(_group: &dyn Comm, dy: &'a Tensor) -> &'a Tensor {
    dy
}

// ---- scatter_to_tp: full input -> this rank's slice of the last dim -----------------

/// Forward of scatter_to_tp: keeps slice `rank` of the last dimension.
pub fn scatter_to_tp_fwd<'a>(group: &dyn Comm, x: &'a Tensor) -> Result<MaybeOwned<'a>> {
    if group.size() == 1 {
        return Ok(MaybeOwned::Borrowed(x));
    }
    split_last_dim(x, group.rank(), group.size(), "scatter_to_tp forward").map(MaybeOwned::Owned)
}

/// Backward of scatter_to_tp: all-gathers the slices' grads along the last dimension.
pub fn scatter_to_tp_bwd(group: &dyn Comm, dx: Tensor) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(dx);
    }
    gather_last_dim(group, &dx, "scatter_to_tp backward")
}

// ---- gather_from_tp: this rank's slice of the last dim -> full tensor ---------------

/// Forward of gather_from_tp: all-gathers the ranks' slices along the last dimension.
pub fn gather_from_tp_fwd(group: &dyn Comm, y: Tensor) -> Result<Tensor> {
    if group.size() == 1 {
        return Ok(y);
    }
    gather_last_dim(group, &y, "gather_from_tp forward")
}

/// Backward of gather_from_tp: keeps this rank's slice of the last dimension.
pub fn gather_from_tp_bwd<'a>(group: &dyn Comm, dy: &'a Tensor) -> Result<MaybeOwned<'a>> {
    if group.size() == 1 {
        return Ok(MaybeOwned::Borrowed(dy));
    }
    split_last_dim(dy, group.rank(), group.size(), "gather_from_tp backward").map(MaybeOwned::Owned)
}

// ---- last-dimension split and gather ------------------------------------------------

/// (rows, last) of `t`, erroring on scalars.
fn rows_last(t: &Tensor, step: &str) -> Result<(usize, usize)> {
    match t.dims().last() {
        Some(&c) => Ok((t.shape().rows(), c)),
        None => Err(Error::input(
            step,
            "a scalar has no last dimension to split",
        )),
    }
}

/// Slice `rank` of `size` of the last dimension: (..., C) -> (..., C / size).
fn split_last_dim(x: &Tensor, rank: usize, size: usize, step: &str) -> Result<Tensor> {
    let (_, c) = rows_last(x, step)?;
    if c % size != 0 {
        return Err(Error::input(
            step,
            format!(
                "last dimension of {} is not a multiple of the TP size {size}",
                x.shape()
            ),
        ));
    }
    let part = c / size;
    ops::narrow_last(x, rank * part, part).ctx(step, "narrow")
}

/// All-gather along the last dimension: (..., C) per rank -> (..., size * C).
fn gather_last_dim(group: &dyn Comm, x: &Tensor, step: &str) -> Result<Tensor> {
    let size = group.size();
    let (n, c) = rows_last(x, step)?;
    // all_gather stacks along dim 0: (size * N, C), i.e. (size, N, C).
    let stacked = group
        .all_gather(x)
        .ctx(step, "all-gather")?
        .reshape([size, n, c])
        .ctx(step, "view as (size, N, C)")?;
    // (size, N, C) -> (N, size, C) = (N, size * C): rank r's slice lands in columns
    // r * C .. (r + 1) * C of every row.
    let rows_first = ops::transpose01(&stacked).ctx(step, "transpose")?;
    let mut dims = x.dims().to_vec();
    if let Some(l) = dims.last_mut() {
        *l = c * size;
    }
    rows_first
        .reshape(dims)
        .ctx(step, "view as (..., size * C)")
}
