//! Tensor-parallel linears (Megatron-LM): `ColumnParallelLinear` splits the output
//! features across the TP group, `RowParallelLinear` the input features.
//!
//! With [`braid_comm::SingleRank`] both are exactly [`Linear`] (same weights for the
//! same seed and name, bitwise-equal outputs and grads).

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::{Tensor, ops};

use crate::error::{Context, Error, Result};
use crate::linear::Linear;
use crate::param::{Init, Module, Param, Shard};
use crate::regions::{
    copy_to_tp_bwd, copy_to_tp_fwd, gather_from_tp_bwd, gather_from_tp_fwd, reduce_from_tp_bwd,
    reduce_from_tp_fwd, scatter_to_tp_bwd, scatter_to_tp_fwd,
};
use crate::wgrad::Held;

/// `size`-way split of `n` (`what` names it in the error).
pub(crate) fn split_evenly(what: &'static str, name: &str, n: usize, size: usize) -> Result<usize> {
    if size == 0 || !n.is_multiple_of(size) {
        return Err(Error::config(
            what,
            format!("{name}: {n} features cannot be split evenly across a TP group of {size}"),
        ));
    }
    Ok(n / size)
}

/// y = x @ Wᵀ + b with W's rows (output features) split across the TP group: this rank
/// holds W[(out/tp) rank .., :] (out/tp, in) and the matching bias slice.
///
/// Input region: copy_to_tp (backward all-reduces dx). Output: this rank's slice of
/// the features (for a following [`RowParallelLinear`]), or the full output when
/// `gather_output` (all-gather along the last dim).
#[derive(Debug)]
pub struct ColumnParallelLinear {
    /// The local shard, as a plain linear.
    pub linear: Linear,
    pub group: Arc<dyn Comm>,
    pub gather_output: bool,
    pub in_features: usize,
    /// Full (unsharded) output features.
    pub out_features: usize,
}

/// What [`ColumnParallelLinear::backward`] needs: the input.
#[derive(Debug)]
pub struct ColumnParallelCache {
    pub x: Tensor,
}

impl ColumnParallelLinear {
    pub fn new(
        init: &Init,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        gather_output: bool,
        group: Arc<dyn Comm>,
    ) -> Result<Self> {
        let (rank, size) = (group.rank(), group.size());
        split_evenly("ColumnParallelLinear", name, out_features, size)?;
        let shard = Shard::Split { dim: 0, rank, size };
        let linear = Linear::sharded(init, name, in_features, out_features, bias, shard, shard)?;
        Ok(ColumnParallelLinear {
            linear,
            group,
            gather_output,
            in_features,
            out_features,
        })
    }

    pub fn name(&self) -> &str {
        &self.linear.name
    }

    /// The local product x @ W_shardᵀ + b_shard, no communication: for layers that
    /// apply copy_to_tp once to an input shared by several projections (q/k/v,
    /// gate/up).
    pub fn forward_local(&self, x: &Tensor) -> Result<Tensor> {
        self.linear.apply(x)
    }

    /// Backward of [`Self::forward_local`]: this rank's partial dx (not yet summed
    /// over the group); adds into the local weight/bias grads.
    pub fn backward_local(&mut self, x: Held<'_>, dy_local: Held<'_>) -> Result<Tensor> {
        self.linear.backward_held(x, dy_local)
    }

    /// Forward; the cache holds a copy of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, ColumnParallelCache)> {
        let x = x.try_clone().ctx(self.name(), "caching input")?;
        self.forward_owned(x)
    }

    /// Forward that moves `x` into the cache.
    pub fn forward_owned(&self, x: Tensor) -> Result<(Tensor, ColumnParallelCache)> {
        let group = self.group.as_ref();
        // (N, out/tp)
        let y = self.forward_local(copy_to_tp_fwd(group, &x))?;
        let y = if self.gather_output {
            gather_from_tp_fwd(group, y).ctx(self.name(), "forward")?
        } else {
            y
        };
        Ok((y, ColumnParallelCache { x }))
    }

    /// Backward: returns the full dx (summed over the group).
    pub fn backward(&mut self, cache: ColumnParallelCache, dy: &Tensor) -> Result<Tensor> {
        let group = Arc::clone(&self.group);
        // (N, out/tp): this rank's slice of the output grad.
        let dy_local = if self.gather_output {
            gather_from_tp_bwd(group.as_ref(), dy).ctx(self.name(), "backward")?
        } else {
            crate::regions::MaybeOwned::Borrowed(dy)
        };
        let dx = self.backward_local(Held::Owned(cache.x), dy_local.into())?;
        copy_to_tp_bwd(group.as_ref(), dx).ctx(self.name(), "backward")
    }
}

impl Module for ColumnParallelLinear {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        self.linear.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.linear.visit_params_mut(f);
    }
}

/// y = x @ Wᵀ + b with W's columns (input features) split across the TP group: this
/// rank holds W[:, (in/tp) rank ..] (out, in/tp); the bias is replicated and added
/// once, after the partial products are summed (reduce_from_tp).
///
/// The input is this rank's slice of the features (`input_is_parallel`, the output of
/// a [`ColumnParallelLinear`]), or the full input, split here (scatter_to_tp).
#[derive(Debug)]
pub struct RowParallelLinear {
    /// The local weight shard (its bias field is unused: see `bias`).
    pub linear: Linear,
    /// The full bias, added after the reduction.
    pub bias: Option<Param>,
    pub group: Arc<dyn Comm>,
    pub input_is_parallel: bool,
    /// Full (unsharded) input features.
    pub in_features: usize,
    pub out_features: usize,
}

/// What [`RowParallelLinear::backward`] needs: this rank's slice of the input.
#[derive(Debug)]
pub struct RowParallelCache {
    pub x_local: Tensor,
}

impl RowParallelLinear {
    pub fn new(
        init: &Init,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        input_is_parallel: bool,
        group: Arc<dyn Comm>,
    ) -> Result<Self> {
        let (rank, size) = (group.rank(), group.size());
        split_evenly("RowParallelLinear", name, in_features, size)?;
        let w_shard = Shard::Split { dim: 1, rank, size };
        let mut linear = Linear::sharded(
            init,
            name,
            in_features,
            out_features,
            bias,
            w_shard,
            Shard::Full,
        )?;
        // The bias lives outside the local linear so that it is added after the sum.
        let bias = linear.bias.take();
        Ok(RowParallelLinear {
            linear,
            bias,
            group,
            input_is_parallel,
            in_features,
            out_features,
        })
    }

    pub fn name(&self) -> &str {
        &self.linear.name
    }

    /// Forward; the cache holds this rank's input slice (a copy of `x` when it is
    /// already parallel).
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, RowParallelCache)> {
        let x_local = if self.input_is_parallel {
            x.try_clone().ctx(self.name(), "caching input")?
        } else {
            match scatter_to_tp_fwd(self.group.as_ref(), x).ctx(self.name(), "forward")? {
                crate::regions::MaybeOwned::Owned(t) => t,
                crate::regions::MaybeOwned::Borrowed(t) => {
                    t.try_clone().ctx(self.name(), "caching input")?
                }
            }
        };
        self.forward_parallel(x_local)
    }

    /// Forward from this rank's input slice (N, in/tp), moved into the cache.
    pub fn forward_parallel(&self, x_local: Tensor) -> Result<(Tensor, RowParallelCache)> {
        // (N, out) partial product of this rank's input features
        let y = self.linear.apply(&x_local)?;
        let mut y = reduce_from_tp_fwd(self.group.as_ref(), y).ctx(self.name(), "forward")?;
        if let Some(b) = &self.bias {
            y = add_row_bias(y, b.compute()).ctx(self.name(), "forward bias")?;
        }
        Ok((y, RowParallelCache { x_local }))
    }

    /// Backward: returns dx (full when the input was not parallel, else this rank's slice).
    pub fn backward(&mut self, cache: RowParallelCache, dy: &Tensor) -> Result<Tensor> {
        let dx_local = self.backward_parallel(Held::Owned(cache.x_local), dy)?;
        if self.input_is_parallel {
            Ok(dx_local)
        } else {
            scatter_to_tp_bwd(self.group.as_ref(), dx_local).ctx(self.name(), "backward")
        }
    }

    /// Backward to this rank's input slice given that slice (N, in/tp).
    pub fn backward_parallel(&mut self, x_local: Held<'_>, dy: &Tensor) -> Result<Tensor> {
        let dy = reduce_from_tp_bwd(self.group.as_ref(), dy);
        // The bias grad is the row sum of the (replicated) output grad: every rank
        // computes the same full db.
        let db = self.bias.as_mut().and_then(|b| b.grad.as_mut());
        let name = self.linear.name.clone();
        crate::wgrad::linear_backward(
            &mut self.linear.weight,
            db,
            x_local,
            Held::Borrowed(dy),
            &name,
        )
    }
}

/// `y[n, :] += b` for y (N, C), b (C): the bias of a row-parallel layer, added once
/// after the reduction so it is not counted `tp` times.
pub(crate) fn add_row_bias(mut y: Tensor, b: &Tensor) -> braid_kernels::Result<Tensor> {
    ops::add_bias(&mut y, b)?;
    Ok(y)
}

impl Module for RowParallelLinear {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        f(&self.linear.weight);
        if let Some(b) = &self.bias {
            f(b);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.linear.weight);
        if let Some(b) = &mut self.bias {
            f(b);
        }
    }
}
