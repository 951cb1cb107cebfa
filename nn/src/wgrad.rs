//! Zero-bubble pipelining's split backward (ZB-H1): a linear layer's weight gradient
//! deferred from its backward pass (B, which makes the input gradient the stage before
//! waits for) to a pass of its own (W), which the schedule runs where 1F1B would idle.
//!
//! While a module defers ([`defer_weight_grads`]), each linear backward computes `dx`
//! (and the bias grad, a row sum) and keeps `(dy, x)` on its weight; [`take_deferred`]
//! collects them after a microbatch's B, and [`apply_deferred`] adds `dyᵀ x` into each
//! weight's grad in its W. Per weight the products accumulate in the same order as
//! without deferring (a stage's B and W passes both run in microbatch order), so the
//! gradient is the same.

use braid_kernels::{Tensor, ops};

use crate::error::{Context, Result};
use crate::param::{Module, Param};

/// Backward of `y = x @ wᵀ + b` for `weight` w: returns `dx`, adds the row sum of `dy`
/// into `bias_grad`, and adds `dyᵀ x` into the weight's grad now, or keeps `(dy, x)`
/// for [`apply_deferred`] while the weight defers (nothing for a frozen weight).
pub(crate) fn linear_backward(
    weight: &mut Param,
    bias_grad: Option<&mut Tensor>,
    x: &Tensor,
    dy: &Tensor,
    name: &str,
) -> Result<Tensor> {
    let defer = weight.defer_wgrad && weight.grad.is_some();
    let (w, dw) = weight.compute_and_grad();
    let dw = if defer { None } else { dw };
    let dx = ops::linear_bwd(dy, x, w, dw, bias_grad).ctx(name, "backward")?;
    if defer {
        let kept = (
            dy.try_clone()
                .ctx(name, "keeping dy for the weight gradient")?,
            x.try_clone()
                .ctx(name, "keeping x for the weight gradient")?,
        );
        weight.deferred.push(kept);
    }
    Ok(dx)
}

/// Makes every linear layer of `m` defer its weight gradient (`on`) or compute it in its
/// backward again.
pub fn defer_weight_grads<M: Module + ?Sized>(m: &mut M, on: bool) {
    m.visit_params_mut(&mut |p| p.defer_wgrad = on);
}

/// The weight gradients of `m` deferred since the last take: `(parameter index in
/// visiting order, dy, x)`, in backward order per parameter.
#[derive(Debug, Default)]
pub struct DeferredGrads {
    entries: Vec<(usize, Tensor, Tensor)>,
}

impl DeferredGrads {
    /// How many weight gradients are held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }
}

/// Takes every weight gradient `m` deferred since the last take.
pub fn take_deferred<M: Module + ?Sized>(m: &mut M) -> DeferredGrads {
    let mut entries = Vec::new();
    let mut i = 0;
    m.visit_params_mut(&mut |p| {
        entries.extend(p.deferred.drain(..).map(|(dy, x)| (i, dy, x)));
        i += 1;
    });
    DeferredGrads { entries }
}

/// Adds the weight gradients `d` (taken from `m`) into `m`'s grads: the W pass.
pub fn apply_deferred<M: Module + ?Sized>(m: &mut M, d: DeferredGrads) -> Result<()> {
    let mut entries = d.entries.into_iter().peekable();
    let (mut i, mut res) = (0, Ok(()));
    m.visit_params_mut(&mut |p| {
        while let Some((_, dy, x)) = entries.next_if(|e| e.0 == i) {
            if res.is_ok()
                && let Some(g) = p.grad.as_mut()
            {
                res = ops::linear_wgrad(&dy, &x, g).ctx(&p.name, "weight gradient (W pass)");
            }
        }
        i += 1;
    });
    res?;
    match entries.next() {
        Some((j, ..)) => Err(crate::error::Error::input(
            "apply_deferred",
            format!("a weight gradient of parameter {j} of {i}: not from this module"),
        )),
        None => Ok(()),
    }
}
