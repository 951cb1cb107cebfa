//! The Whisper conv stem's layer: a `Conv1d` with bias, forward and backward.

use braid_kernels::Tensor;
use braid_kernels::ops::{self, Conv1dSpec};
use braid_nn::error::Context;
use braid_nn::{Init, InitKind, Param, Result, Shard};

/// A `Conv1d` with bias: weight (CO, CI, K), bias (CO).
#[derive(Debug)]
pub struct Conv1d {
    pub weight: Param,
    pub bias: Param,
    pub spec: Conv1dSpec,
}

impl Conv1d {
    pub(super) fn new(
        init: &Init,
        name: &str,
        ci: usize,
        co: usize,
        spec: Conv1dSpec,
    ) -> Result<Self> {
        Ok(Conv1d {
            weight: init.param(
                &format!("{name}.weight"),
                &[co, ci, 3],
                InitKind::Normal(init.std),
                Shard::Full,
            )?,
            bias: init.param(
                &format!("{name}.bias"),
                &[co],
                InitKind::Constant(0.0),
                Shard::Full,
            )?,
            spec,
        })
    }

    pub(super) fn forward(&self, x: &Tensor) -> Result<Tensor> {
        ops::conv1d_fwd(
            x,
            self.weight.compute(),
            Some(self.bias.compute()),
            &self.spec,
        )
        .ctx(&self.weight.name, "forward")
    }

    pub(super) fn backward(&mut self, x: &Tensor, dy: &Tensor) -> Result<Tensor> {
        let (w, dw) = self.weight.compute_and_grad();
        ops::conv1d_bwd(dy, x, w, &self.spec, dw, self.bias.grad.as_mut())
            .ctx(&self.weight.name, "backward")
    }
}
