//! CPU activations, SwiGLU and softmax: elementwise maps and per-row reductions,
//! parallel over fixed-size pieces so results do not depend on the thread count.

use rayon::prelude::*;

use super::norm::min_rows;
use super::{CpuBackend, PAR_MIN_ELEMS};
use crate::backend::ActivationKernels;
use crate::error::Result;
use crate::ops::activation::{Activation, erfc};
use crate::tensor::Tensor;

/// sqrt(2 / pi), the scale inside `gelu_pytorch_tanh`.
const SQRT_2_OVER_PI: f32 = 0.797_884_6;
/// The cubic coefficient of `gelu_pytorch_tanh`.
const GELU_CUBIC: f32 = 0.044_715;
/// CLIP's `quick_gelu` slope.
const QUICK_GELU_SLOPE: f32 = 1.702;

/// `1 / (1 + e^-x)`; for x << 0 the exponential overflows to inf and the result is an
/// exact 0, never NaN.
fn sigmoid(x: f32) -> f32 {
    1.0 / (1.0 + (-x).exp())
}

/// `act(x)`.
fn act_fwd(act: Activation, x: f32) -> f32 {
    match act {
        Activation::GeluTanh => {
            let u = SQRT_2_OVER_PI * (x + GELU_CUBIC * x * x * x);
            0.5 * x * (1.0 + u.tanh())
        }
        Activation::GeluErf => {
            // 0.5 x erfc(-x / sqrt 2): no cancellation in the negative tail.
            let x = f64::from(x);
            (0.5 * x * erfc(-x * std::f64::consts::FRAC_1_SQRT_2)) as f32
        }
        Activation::QuickGelu => x * sigmoid(QUICK_GELU_SLOPE * x),
        Activation::Silu => x * sigmoid(x),
    }
}

/// `act'(x)`.
fn act_grad(act: Activation, x: f32) -> f32 {
    match act {
        Activation::GeluTanh => {
            let x2 = x * x;
            let t = (SQRT_2_OVER_PI * (x + GELU_CUBIC * x2 * x)).tanh();
            let du = SQRT_2_OVER_PI * (1.0 + 3.0 * GELU_CUBIC * x2);
            0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * du
        }
        Activation::GeluErf => {
            // Phi(x) + x phi(x), phi the standard normal density.
            let x = f64::from(x);
            let cdf = 0.5 * erfc(-x * std::f64::consts::FRAC_1_SQRT_2);
            let pdf = (-0.5 * x * x).exp()
                * (0.5 * std::f64::consts::FRAC_2_SQRT_PI)
                * std::f64::consts::FRAC_1_SQRT_2;
            (cdf + x * pdf) as f32
        }
        Activation::QuickGelu => {
            let s = sigmoid(QUICK_GELU_SLOPE * x);
            s + QUICK_GELU_SLOPE * x * s * (1.0 - s)
        }
        Activation::Silu => silu_grad(x),
    }
}

/// d/dx [x sigmoid(x)] = s (1 + x (1 - s)).
fn silu_grad(x: f32) -> f32 {
    let s = sigmoid(x);
    s * (1.0 + x * (1.0 - s))
}

impl ActivationKernels for CpuBackend {
    fn activation_fwd(&self, x: &Tensor, act: Activation) -> Result<Tensor> {
        let xv = x.cpu_f32("activation_fwd", "x")?; // (N)
        let y: Vec<f32> = xv
            .par_iter()
            .with_min_len(PAR_MIN_ELEMS)
            .map(|&v| act_fwd(act, v))
            .collect(); // (N)
        Tensor::cpu_from_f32(y, x.shape().clone())
    }

    fn activation_bwd(&self, dy: &Tensor, x: &Tensor, act: Activation) -> Result<Tensor> {
        let dyv = dy.cpu_f32("activation_bwd", "dy")?; // (N)
        let xv = x.cpu_f32("activation_bwd", "x")?; // (N)
        let dx: Vec<f32> = dyv
            .par_iter()
            .zip(xv.par_iter())
            .with_min_len(PAR_MIN_ELEMS)
            .map(|(&d, &v)| d * act_grad(act, v))
            .collect(); // (N)
        Tensor::cpu_from_f32(dx, x.shape().clone())
    }

    fn swiglu_fwd(&self, gate: &Tensor, up: &Tensor) -> Result<Tensor> {
        let gv = gate.cpu_f32("swiglu_fwd", "gate")?; // (N)
        let uv = up.cpu_f32("swiglu_fwd", "up")?; // (N)
        let y: Vec<f32> = gv
            .par_iter()
            .zip(uv.par_iter())
            .with_min_len(PAR_MIN_ELEMS)
            .map(|(&g, &u)| g * sigmoid(g) * u)
            .collect(); // (N)
        Tensor::cpu_from_f32(y, gate.shape().clone())
    }

    fn swiglu_bwd(&self, dy: &Tensor, gate: &Tensor, up: &Tensor) -> Result<(Tensor, Tensor)> {
        let dyv = dy.cpu_f32("swiglu_bwd", "dy")?; // (N)
        let gv = gate.cpu_f32("swiglu_bwd", "gate")?; // (N)
        let uv = up.cpu_f32("swiglu_bwd", "up")?; // (N)
        let (dgate, dup): (Vec<f32>, Vec<f32>) = dyv
            .par_iter()
            .zip(gv.par_iter().zip(uv.par_iter()))
            .with_min_len(PAR_MIN_ELEMS)
            .map(|(&d, (&g, &u))| (d * u * silu_grad(g), d * g * sigmoid(g)))
            .unzip(); // (N), (N)
        Ok((
            Tensor::cpu_from_f32(dgate, gate.shape().clone())?,
            Tensor::cpu_from_f32(dup, up.shape().clone())?,
        ))
    }

    fn softmax_fwd(&self, x: &Tensor) -> Result<Tensor> {
        let xv = x.cpu_f32("softmax_fwd", "x")?; // (N, C)
        let c = x.dims().last().copied().unwrap_or(1).max(1);
        let mut y = vec![0.0f32; xv.len()]; // (N, C)
        y.par_chunks_mut(c)
            .zip(xv.par_chunks(c))
            .with_min_len(min_rows(c))
            .for_each(|(yr, xr)| {
                // Subtracting the row max keeps every exp <= 1: no overflow for any
                // finite logits, and the largest term is exactly 1 so the sum is >= 1.
                let m = xr.iter().copied().fold(f32::NEG_INFINITY, f32::max);
                let mut sum = 0.0f64;
                for (o, &v) in yr.iter_mut().zip(xr) {
                    *o = (v - m).exp();
                    sum += f64::from(*o);
                }
                let inv = (1.0 / sum) as f32;
                yr.iter_mut().for_each(|o| *o *= inv);
            });
        Tensor::cpu_from_f32(y, x.shape().clone())
    }

    fn softmax_bwd(&self, dy: &Tensor, y: &Tensor) -> Result<Tensor> {
        let dyv = dy.cpu_f32("softmax_bwd", "dy")?; // (N, C)
        let yv = y.cpu_f32("softmax_bwd", "y")?; // (N, C)
        let c = y.dims().last().copied().unwrap_or(1).max(1);
        let mut dx = vec![0.0f32; yv.len()]; // (N, C)
        dx.par_chunks_mut(c)
            .zip(dyv.par_chunks(c).zip(yv.par_chunks(c)))
            .with_min_len(min_rows(c))
            .for_each(|(dxr, (dyr, yr))| {
                let dot: f64 = dyr
                    .iter()
                    .zip(yr)
                    .map(|(&d, &p)| f64::from(d) * f64::from(p))
                    .sum();
                let dot = dot as f32;
                for ((o, &d), &p) in dxr.iter_mut().zip(dyr).zip(yr) {
                    *o = p * (d - dot);
                }
            });
        Tensor::cpu_from_f32(dx, y.shape().clone())
    }
}
