//! `Linear`: y = x @ Wᵀ + b with PyTorch's (out, in) weight layout, forward and backward.

use braid_kernels::Tensor;
use braid_kernels::ops;

use crate::error::{Context, Error, Result};
use crate::param::{Init, InitKind, Module, Param, Shard};
use crate::wgrad::Held;

/// A dense layer `y (..., out) = x (..., in) @ Wᵀ + b`, W stored (out, in) as in
/// `nn.Linear`, so Hugging Face weights load unchanged.
#[derive(Debug)]
pub struct Linear {
    /// Parameter prefix: the weight is `{name}.weight`, the bias `{name}.bias`.
    pub name: String,
    pub weight: Param,
    pub bias: Option<Param>,
}

/// What [`Linear::backward`] needs: the input.
#[derive(Debug)]
pub struct LinearCache {
    pub x: Tensor,
}

impl Linear {
    /// A new layer: W ~ Normal(0, init.std), b = 0.
    pub fn new(
        init: &Init,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
    ) -> Result<Self> {
        Self::sharded(
            init,
            name,
            in_features,
            out_features,
            bias,
            Shard::Full,
            Shard::Full,
        )
    }

    /// A layer holding `w_shard` of the full (out, in) weight and `b_shard` of the
    /// full (out) bias: the building block of the tensor-parallel linears.
    pub(crate) fn sharded(
        init: &Init,
        name: &str,
        in_features: usize,
        out_features: usize,
        bias: bool,
        w_shard: Shard,
        b_shard: Shard,
    ) -> Result<Self> {
        if in_features == 0 || out_features == 0 {
            return Err(Error::config(
                "Linear",
                format!(
                    "{name}: in_features = {in_features} and out_features = {out_features} must be > 0"
                ),
            ));
        }
        let weight = init.param(
            &format!("{name}.weight"),
            &[out_features, in_features],
            InitKind::Normal(init.std),
            w_shard,
        )?;
        let bias = if bias {
            Some(init.param(
                &format!("{name}.bias"),
                &[out_features],
                InitKind::Constant(0.0),
                b_shard,
            )?)
        } else {
            None
        };
        Ok(Linear {
            name: name.to_string(),
            weight,
            bias,
        })
    }

    /// (out, in) of the weight this layer holds.
    pub fn local_dims(&self) -> (usize, usize) {
        let d = self.weight.value.dims();
        (d[0], d[1])
    }

    /// y = x @ Wᵀ + b with no cache (the caller keeps `x` for [`Linear::backward_with_input`]).
    pub fn apply(&self, x: &Tensor) -> Result<Tensor> {
        ops::linear_fwd(
            x,
            self.weight.compute(),
            self.bias.as_ref().map(Param::compute),
        )
        .ctx(&self.name, "forward")
    }

    /// Forward; the cache holds a copy of `x`.
    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, LinearCache)> {
        let x = x.try_clone().ctx(&self.name, "caching input")?;
        self.forward_owned(x)
    }

    /// Forward that moves `x` into the cache (no copy).
    pub fn forward_owned(&self, x: Tensor) -> Result<(Tensor, LinearCache)> {
        let y = self.apply(&x)?;
        Ok((y, LinearCache { x }))
    }

    /// Backward: returns dx, adds into the weight/bias grads (skipped when frozen).
    pub fn backward(&mut self, cache: LinearCache, dy: &Tensor) -> Result<Tensor> {
        self.backward_held(Held::Owned(cache.x), Held::Borrowed(dy))
    }

    /// Backward given the forward's input `x` (layers that share one input between
    /// several projections keep a single copy of it).
    /// The weight gradient waits for a W pass while the weight defers
    /// ([`crate::wgrad`]).
    pub fn backward_with_input(&mut self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        self.backward_held(Held::Borrowed(x), Held::Borrowed(dy))
    }

    /// [`Self::backward_with_input`] with `x` and `dy` handed over as a deferred weight
    /// gradient would keep them (moved, shared, or copied where borrowed).
    pub fn backward_held(&mut self, x: Held<'_>, dy: Held<'_>) -> Result<Tensor> {
        let db = self.bias.as_mut().and_then(|b| b.grad.as_mut());
        crate::wgrad::linear_backward(&mut self.weight, db, x, dy, &self.name)
    }
}

impl Module for Linear {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        f(&self.weight);
        if let Some(b) = &self.bias {
            f(b);
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.weight);
        if let Some(b) = &mut self.bias {
            f(b);
        }
    }
}
