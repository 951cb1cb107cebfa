//! The MLP of a transformer block: GELU-style `fc1 -> act -> fc2` or SwiGLU
//! `(gate, up) -> silu(gate) * up -> down`; column-parallel in, row-parallel out.

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::Tensor;
use braid_kernels::ops::{self, Activation};

use crate::error::{Context, Error, Result};
use crate::parallel::{ColumnParallelLinear, RowParallelCache, RowParallelLinear};
use crate::param::{Init, Module, Param};
use crate::regions::{copy_to_tp_bwd, copy_to_tp_fwd};
use crate::wgrad::Held;

/// The two MLP families.
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub enum MlpKind {
    /// `fc2(act(fc1(x)))` (ViT/CLIP/SigLIP/Whisper: a GELU variant).
    Gelu(Activation),
    /// `down_proj(silu(gate_proj(x)) * up_proj(x))` (Llama, Qwen2).
    SwiGlu,
}

/// Sizes and kind of an MLP. `ff` is the full hidden width (split across TP).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MlpConfig {
    pub c: usize,
    pub ff: usize,
    pub kind: MlpKind,
    /// Biases on every projection (true for ViT/Whisper, false for Llama).
    pub bias: bool,
}

impl MlpConfig {
    /// Checks the sizes for a TP group of `tp` ranks.
    pub fn validate(&self, tp: usize) -> Result<()> {
        let err = |msg: String| Err(Error::config("MlpConfig", msg));
        if self.c == 0 || self.ff == 0 {
            return err(format!("c = {} and ff = {} must be > 0", self.c, self.ff));
        }
        if tp == 0 || !self.ff.is_multiple_of(tp) {
            return err(format!(
                "ff = {} is not a multiple of the TP size {tp}",
                self.ff
            ));
        }
        Ok(())
    }
}

/// A tensor-parallel MLP: (T, C) -> (T, C). Each rank holds ff/tp hidden units.
#[derive(Debug)]
pub struct Mlp {
    pub name: String,
    pub config: MlpConfig,
    /// `fc1` (GELU) or `up_proj` (SwiGLU): (ff/tp, C).
    pub up: ColumnParallelLinear,
    /// `gate_proj` (SwiGLU only): (ff/tp, C).
    pub gate: Option<ColumnParallelLinear>,
    /// `fc2` or `down_proj`: (C, ff/tp).
    pub down: RowParallelLinear,
    pub group: Arc<dyn Comm>,
}

/// The activations of the hidden layer kept for the backward (each (T, ff/tp)).
#[derive(Debug)]
enum Hidden {
    Gelu { h: Tensor },
    SwiGlu { gate: Tensor, up: Tensor },
}

/// What [`Mlp::backward`] needs.
#[derive(Debug)]
pub struct MlpCache {
    /// (T, C)
    x: Tensor,
    hidden: Hidden,
    down: RowParallelCache,
}

impl Mlp {
    pub fn new(init: &Init, name: &str, config: MlpConfig, group: Arc<dyn Comm>) -> Result<Self> {
        config.validate(group.size())?;
        let MlpConfig { c, ff, kind, bias } = config;
        let col = |proj: &str| {
            ColumnParallelLinear::new(
                init,
                &format!("{name}.{proj}"),
                c,
                ff,
                bias,
                false,
                Arc::clone(&group),
            )
        };
        let (gate, up, down_name) = match kind {
            MlpKind::Gelu(_) => (None, col("fc1")?, "fc2"),
            MlpKind::SwiGlu => (Some(col("gate_proj")?), col("up_proj")?, "down_proj"),
        };
        let down = RowParallelLinear::new(
            init,
            &format!("{name}.{down_name}"),
            ff,
            c,
            bias,
            true,
            Arc::clone(&group),
        )?;
        Ok(Mlp {
            name: name.to_string(),
            config,
            up,
            gate,
            down,
            group,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, MlpCache)> {
        self.forward_owned(x.try_clone().ctx(&self.name, "caching input")?)
    }

    /// Forward that moves `x` (T, C) into the cache.
    pub fn forward_owned(&self, x: Tensor) -> Result<(Tensor, MlpCache)> {
        let xi = copy_to_tp_fwd(self.group.as_ref(), &x);
        let (hidden, a) = match (self.config.kind, &self.gate) {
            (MlpKind::Gelu(act), _) => {
                let h = self.up.forward_local(xi)?; // (T, ff/tp)
                let a = ops::activation_fwd(&h, act).ctx(&self.name, "activation forward")?;
                (Hidden::Gelu { h }, a)
            }
            (MlpKind::SwiGlu, Some(gate)) => {
                let g = gate.forward_local(xi)?; // (T, ff/tp)
                let u = self.up.forward_local(xi)?; // (T, ff/tp)
                let a = ops::swiglu_fwd(&g, &u).ctx(&self.name, "swiglu forward")?;
                (Hidden::SwiGlu { gate: g, up: u }, a)
            }
            (MlpKind::SwiGlu, None) => return Err(self.missing_gate()),
        };
        let (y, down) = self.down.forward_parallel(a)?; // (T, C)
        Ok((y, MlpCache { x, hidden, down }))
    }

    pub fn backward(&mut self, cache: MlpCache, dy: &Tensor) -> Result<Tensor> {
        let MlpCache { x, hidden, down } = cache;
        let da = self.down.backward(down, dy)?; // (T, ff/tp)
        let dx = match (self.config.kind, hidden, self.gate.as_mut()) {
            (MlpKind::Gelu(act), Hidden::Gelu { h }, _) => {
                let dh =
                    ops::activation_bwd(&da, &h, act).ctx(&self.name, "activation backward")?;
                self.up.backward_local(Held::Owned(x), Held::Owned(dh))?
            }
            (MlpKind::SwiGlu, Hidden::SwiGlu { gate: g, up: u }, Some(gate)) => {
                let (dg, du) = ops::swiglu_bwd(&da, &g, &u).ctx(&self.name, "swiglu backward")?;
                // Gate and up read one input: a deferred W keeps it once for both.
                let x = Arc::new(x); // (T, C)
                let mut dx = gate.backward_local(Held::Shared(Arc::clone(&x)), Held::Owned(dg))?;
                let dx_up = self.up.backward_local(Held::Shared(x), Held::Owned(du))?;
                ops::add_assign(&mut dx, &dx_up).ctx(&self.name, "summing input grads")?;
                dx
            }
            _ => return Err(self.missing_gate()),
        };
        // One all-reduce for the input grad of every column-parallel projection.
        copy_to_tp_bwd(self.group.as_ref(), dx).ctx(&self.name, "backward")
    }

    fn missing_gate(&self) -> Error {
        Error::input(
            &self.name,
            "the SwiGLU MLP has no gate projection or the cache is of another kind",
        )
    }
}

impl Module for Mlp {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        if let Some(g) = &self.gate {
            g.visit_params(f);
        }
        self.up.visit_params(f);
        self.down.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some(g) = &mut self.gate {
            g.visit_params_mut(f);
        }
        self.up.visit_params_mut(f);
        self.down.visit_params_mut(f);
    }
}
