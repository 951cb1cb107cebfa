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
//!
//! What a microbatch holds between its B and its W is what the planner charges it
//! (`braid_balancer`'s activations per token): each tensor once. A layer that owns its
//! cache moves `x` and `dy` in ([`Held::Owned`]); q, k and v, and gate and up, share one
//! input ([`Held::Shared`]) instead of a copy each.

use std::collections::HashSet;
use std::ops::Deref;
use std::sync::Arc;

use braid_kernels::{Tensor, ops};

use crate::error::{Context, Result};
use crate::param::{Module, Param};

/// A tensor a linear backward reads and, while its weight defers, keeps for the W pass:
/// borrowed (copied if kept), owned (moved), or shared with other layers (kept once).
#[derive(Debug)]
pub enum Held<'a> {
    Borrowed(&'a Tensor),
    Owned(Tensor),
    Shared(Arc<Tensor>),
}

impl Deref for Held<'_> {
    type Target = Tensor;
    fn deref(&self) -> &Tensor {
        match self {
            Held::Borrowed(t) => t,
            Held::Owned(t) => t,
            Held::Shared(t) => t,
        }
    }
}

impl<'a> From<crate::regions::MaybeOwned<'a>> for Held<'a> {
    fn from(t: crate::regions::MaybeOwned<'a>) -> Self {
        match t {
            crate::regions::MaybeOwned::Borrowed(t) => Held::Borrowed(t),
            crate::regions::MaybeOwned::Owned(t) => Held::Owned(t),
        }
    }
}

impl Held<'_> {
    /// The tensor for a deferred W: a copy only of a borrowed one.
    fn keep(self, name: &str, what: &str) -> Result<Arc<Tensor>> {
        Ok(match self {
            Held::Borrowed(t) => Arc::new(t.try_clone().ctx(name, what)?),
            Held::Owned(t) => Arc::new(t),
            Held::Shared(t) => t,
        })
    }
}

/// Backward of `y = x @ wᵀ + b` for `weight` w: returns `dx`, adds the row sum of `dy`
/// into `bias_grad`, and adds `dyᵀ x` into the weight's grad now, or keeps `(dy, x)`
/// for [`apply_deferred`] while the weight defers (nothing for a frozen weight).
pub(crate) fn linear_backward(
    weight: &mut Param,
    bias_grad: Option<&mut Tensor>,
    x: Held<'_>,
    dy: Held<'_>,
    name: &str,
) -> Result<Tensor> {
    let defer = weight.defer_wgrad && weight.grad.is_some();
    let (w, dw) = weight.compute_and_grad();
    let dw = if defer { None } else { dw };
    let dx = ops::linear_bwd(&dy, &x, w, dw, bias_grad).ctx(name, "backward")?;
    if defer {
        let kept = (
            dy.keep(name, "keeping dy for the weight gradient")?,
            x.keep(name, "keeping x for the weight gradient")?,
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
    entries: Vec<(usize, Arc<Tensor>, Arc<Tensor>)>,
}

impl DeferredGrads {
    /// How many weight gradients are held.
    pub fn len(&self) -> usize {
        self.entries.len()
    }

    pub fn is_empty(&self) -> bool {
        self.entries.is_empty()
    }

    /// The bytes these weight gradients hold, each tensor counted once however many
    /// weights share it (what a microbatch waiting for its W keeps in memory).
    pub fn held_bytes(&self) -> usize {
        let mut seen = HashSet::new();
        self.entries
            .iter()
            .flat_map(|(_, dy, x)| [dy, x])
            .filter(|t| seen.insert(Arc::as_ptr(t)))
            .map(|t| t.elem_count() * t.dtype().size_in_bytes())
            .sum()
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
