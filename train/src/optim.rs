//! `[optim]`: AdamW over a model's trainable parameters, the learning-rate schedule
//! (linear warmup, then cosine, linear or constant) and global-norm gradient clipping.
//!
//! Optimizer state exists only for trainable parameters (a frozen module has none) and is
//! keyed by parameter name, so checkpoints are readable and survive module reordering.

use braid_kernels::ops::{self, AdamWSpec};
use braid_kernels::{DType, Tensor};
use braid_nn::error::Context;
use braid_nn::{Error, Module, Param, Result};
use serde::{Deserialize, Serialize};

use crate::config::{ConfigError, invalid};

#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Schedule {
    /// Cosine decay from `lr` to `lr * min_lr_ratio` after warmup.
    #[default]
    Cosine,
    /// Linear decay from `lr` to `lr * min_lr_ratio` after warmup.
    Linear,
    /// `lr` after warmup.
    Constant,
}

#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct OptimConfig {
    pub lr: f32,
    pub beta1: f32,
    pub beta2: f32,
    pub eps: f32,
    /// Decoupled weight decay, applied to matrices (rank >= 2: linear and embedding
    /// weights), not to norms and biases.
    pub weight_decay: f32,
    /// Steps of linear warmup from 0 to `lr`.
    pub warmup_steps: u64,
    pub schedule: Schedule,
    /// Final learning rate as a fraction of `lr` (cosine and linear).
    pub min_lr_ratio: f32,
    /// Global grad-norm clip; 0 disables clipping.
    pub clip_grad: f32,
}

impl Default for OptimConfig {
    fn default() -> Self {
        OptimConfig {
            lr: 3e-4,
            beta1: 0.9,
            beta2: 0.95,
            eps: 1e-8,
            weight_decay: 0.1,
            warmup_steps: 0,
            schedule: Schedule::Cosine,
            min_lr_ratio: 0.1,
            clip_grad: 1.0,
        }
    }
}

impl OptimConfig {
    pub fn validate(&self, steps: u64) -> Result<(), ConfigError> {
        if !(self.lr.is_finite() && self.lr > 0.0) {
            return Err(invalid(
                "optim.lr",
                format!("{} must be a finite number > 0", self.lr),
            ));
        }
        for (k, b) in [("optim.beta1", self.beta1), ("optim.beta2", self.beta2)] {
            if !(0.0..1.0).contains(&b) {
                return Err(invalid(k, format!("{b} must be in [0, 1)")));
            }
        }
        if !(self.eps.is_finite() && self.eps >= 0.0) {
            return Err(invalid(
                "optim.eps",
                format!("{} must be a finite number >= 0", self.eps),
            ));
        }
        if !(self.weight_decay.is_finite() && self.weight_decay >= 0.0) {
            return Err(invalid(
                "optim.weight_decay",
                format!("{} must be a finite number >= 0", self.weight_decay),
            ));
        }
        if self.warmup_steps > steps {
            return Err(invalid(
                "optim.warmup_steps",
                format!("{} is more than train.steps = {steps}", self.warmup_steps),
            ));
        }
        if !(0.0..=1.0).contains(&self.min_lr_ratio) {
            return Err(invalid(
                "optim.min_lr_ratio",
                format!("{} must be in [0, 1]", self.min_lr_ratio),
            ));
        }
        if !(self.clip_grad.is_finite() && self.clip_grad >= 0.0) {
            return Err(invalid(
                "optim.clip_grad",
                format!(
                    "{} must be a finite number >= 0 (0 = no clipping)",
                    self.clip_grad
                ),
            ));
        }
        Ok(())
    }

    /// Learning rate of step `step` (1-based) of a run of `total` steps.
    pub fn lr_at(&self, step: u64, total: u64) -> f32 {
        let lr = f64::from(self.lr);
        let w = self.warmup_steps;
        if step <= w && w > 0 {
            return (lr * step as f64 / w as f64) as f32;
        }
        let decay_steps = total.saturating_sub(w).max(1) as f64;
        let progress = ((step.saturating_sub(w)) as f64 / decay_steps).clamp(0.0, 1.0);
        let min = lr * f64::from(self.min_lr_ratio);
        let lr = match self.schedule {
            Schedule::Constant => lr,
            Schedule::Linear => lr + (min - lr) * progress,
            Schedule::Cosine => {
                min + 0.5 * (lr - min) * (1.0 + (std::f64::consts::PI * progress).cos())
            }
        };
        lr as f32
    }
}

/// AdamW moments of one trainable parameter.
#[derive(Debug)]
pub struct Moments {
    pub name: String,
    /// Same shape as the parameter.
    pub exp_avg: Tensor,
    pub exp_avg_sq: Tensor,
    pub decay: bool,
}

/// AdamW state of a model: one [`Moments`] per trainable parameter, in visiting order.
#[derive(Debug)]
pub struct AdamW {
    pub config: OptimConfig,
    /// Updates applied so far (bias correction counts from here).
    pub step: u64,
    pub moments: Vec<Moments>,
    /// Whether this optimizer holds the state of only some trainable parameters (ZeRO-1:
    /// each data-parallel rank updates its share); the others are skipped by `update`.
    pub partial: bool,
}

impl AdamW {
    /// Zero moments for every trainable parameter of `model`.
    pub fn new<M: Module + ?Sized>(config: OptimConfig, model: &M) -> Result<Self> {
        Self::new_owned(config, model, &|_| true, false)
    }

    /// Zero moments for the trainable parameters `owns` picks; with `partial`, `update`
    /// skips the others (another rank updates them).
    pub fn new_owned<M: Module + ?Sized>(
        config: OptimConfig,
        model: &M,
        owns: &dyn Fn(&Param) -> bool,
        partial: bool,
    ) -> Result<Self> {
        let mut moments = Vec::new();
        let mut res = Ok(());
        model.visit_params(&mut |p| {
            if !p.is_trainable() || !owns(p) || res.is_err() {
                return;
            }
            let v = &p.value;
            let zeros = || {
                Tensor::zeros(v.shape().clone(), DType::F32, v.device())
                    .ctx(&p.name, "optimizer state")
            };
            match (zeros(), zeros()) {
                (Ok(m), Ok(s)) => moments.push(Moments {
                    name: p.name.clone(),
                    exp_avg: m,
                    exp_avg_sq: s,
                    decay: v.dims().len() >= 2,
                }),
                (Err(e), _) | (_, Err(e)) => res = Err(e),
            }
        });
        res?;
        Ok(AdamW {
            config,
            step: 0,
            moments,
            partial,
        })
    }

    /// Elements of optimizer state (two per trainable parameter element).
    pub fn num_state(&self) -> usize {
        self.moments
            .iter()
            .map(|m| 2 * m.exp_avg.elem_count())
            .sum()
    }

    /// One update of every trainable parameter with learning rate `lr`.
    pub fn update<M: Module + ?Sized>(&mut self, model: &mut M, lr: f32) -> Result<()> {
        self.step += 1;
        let c = &self.config;
        let base = AdamWSpec {
            lr,
            beta1: c.beta1,
            beta2: c.beta2,
            eps: c.eps,
            weight_decay: c.weight_decay,
            step: self.step,
        };
        let mut k = 0;
        let mut res = Ok(());
        let partial = self.partial;
        let moments = &mut self.moments;
        model.visit_params_mut(&mut |p| {
            if res.is_err() {
                return;
            }
            if p.grad.is_none() {
                return;
            }
            if partial && moments.get(k).is_none_or(|m| m.name != p.name) {
                return; // another rank's share
            }
            let Some(m) = moments.get_mut(k) else {
                res = Err(Error::input(
                    "AdamW",
                    format!(
                        "parameter `{}` is trainable but has no optimizer state",
                        p.name
                    ),
                ));
                return;
            };
            k += 1;
            if m.name != p.name {
                res = Err(Error::input(
                    "AdamW",
                    format!(
                        "optimizer state `{}` found where `{}` was expected",
                        m.name, p.name
                    ),
                ));
                return;
            }
            let spec = AdamWSpec {
                weight_decay: if m.decay { base.weight_decay } else { 0.0 },
                ..base
            };
            let (value, grad, compute) = p.parts_mut();
            let Some(g) = grad else { return };
            // Under mixed precision the step also refreshes the bf16 compute copy.
            res = match compute {
                Some(c) => {
                    ops::adamw_step_with_copy(value, g, &mut m.exp_avg, &mut m.exp_avg_sq, c, &spec)
                }
                None => ops::adamw_step(value, g, &mut m.exp_avg, &mut m.exp_avg_sq, &spec),
            }
            .ctx(&p.name, "AdamW update");
        });
        res?;
        if k != self.moments.len() {
            return Err(Error::input(
                "AdamW",
                format!(
                    "{} trainable parameters but optimizer state for {}",
                    k,
                    self.moments.len()
                ),
            ));
        }
        Ok(())
    }
}

/// The global L2 norm of every trainable parameter's grad (f64 accumulation).
pub fn grad_norm<M: Module + ?Sized>(model: &M) -> Result<f64> {
    let mut grads = Vec::new();
    model.visit_params(&mut |p| {
        if let Some(g) = &p.grad {
            grads.push(g);
        }
    });
    ops::global_norm(grads).ctx("grad_norm", "global norm")
}

/// Scales every grad by `s` (clipping).
pub fn scale_grads<M: Module + ?Sized>(model: &mut M, s: f32) -> Result<()> {
    let mut res = Ok(());
    model.visit_params_mut(&mut |p| {
        if let (Ok(()), Some(g)) = (&res, &mut p.grad) {
            res = ops::scale_assign(g, s).ctx(&p.name, "clip");
        }
    });
    res
}

/// torch's `clip_grad_norm_`: scale by `max / (norm + 1e-6)` when that is below 1.
pub fn clip_factor(norm: f64, max: f32) -> Option<f32> {
    if max <= 0.0 {
        return None;
    }
    let f = f64::from(max) / (norm + 1e-6);
    (f < 1.0).then_some(f as f32)
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn warmup_then_cosine_reaches_the_floor() {
        let c = OptimConfig {
            lr: 1.0,
            warmup_steps: 10,
            min_lr_ratio: 0.1,
            ..OptimConfig::default()
        };
        assert_eq!(c.lr_at(5, 110), 0.5);
        assert_eq!(c.lr_at(10, 110), 1.0);
        assert!((c.lr_at(60, 110) - 0.55).abs() < 1e-6);
        assert!((c.lr_at(110, 110) - 0.1).abs() < 1e-6);
        let k = OptimConfig {
            schedule: Schedule::Constant,
            ..c.clone()
        };
        assert_eq!(k.lr_at(100, 110), 1.0);
        let l = OptimConfig {
            schedule: Schedule::Linear,
            ..c
        };
        assert!((l.lr_at(60, 110) - 0.55).abs() < 1e-6);
    }

    #[test]
    fn clip_only_scales_down() {
        assert_eq!(clip_factor(0.5, 1.0), None);
        assert_eq!(clip_factor(4.0, 0.0), None);
        let f = clip_factor(4.0, 1.0).unwrap();
        assert!((f - 0.25).abs() < 1e-6);
    }
}
