//! RoPE inverse frequencies of every supported `rope_type`, computed as transformers
//! 5.24's `modeling_rope_utils.py` does (f32 tensor arithmetic where PyTorch uses f32,
//! f64 where it uses Python floats), so the cos/sin tables match to the last bit or so.

use std::f64::consts::PI;

use braid_nn::{DynamicNtk, Result, Rope};

use crate::config::{LlmConfig, RopeScaling};

/// The unscaled `inv_freq` (R/2): `1 / theta^(f32(2i) / f32(R))`, as
/// `1.0 / (base ** (torch.arange(0, dim, 2).float() / dim))` in f32.
pub fn default_inv_freq(theta: f64, dim: usize) -> Vec<f32> {
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            1.0f32 / (theta.powf(f64::from(e)) as f32)
        })
        .collect()
}

/// (inv_freq (R/2), attention factor) of a config's rope at its pretraining length.
pub fn inv_freq_and_factor(config: &LlmConfig) -> (Vec<f32>, f32) {
    let dim = config.head_dim;
    let theta = config.rope.theta;
    let base = default_inv_freq(theta, dim);
    match &config.rope.scaling {
        // Dynamic NTK equals the default up to max_position_embeddings; beyond, the
        // rope recomputes (see `braid_nn::DynamicNtk`).
        RopeScaling::Default | RopeScaling::Dynamic { .. } => (base, 1.0),
        RopeScaling::Linear { factor } => {
            let f = *factor as f32;
            (base.into_iter().map(|x| x / f).collect(), 1.0)
        }
        RopeScaling::Llama3 {
            factor,
            low_freq_factor,
            high_freq_factor,
            original_max_position_embeddings,
        } => (
            llama3(
                &base,
                *factor,
                *low_freq_factor,
                *high_freq_factor,
                *original_max_position_embeddings,
            ),
            1.0,
        ),
        RopeScaling::Yarn {
            factor,
            original_max_position_embeddings,
            attention_factor,
            beta_fast,
            beta_slow,
            mscale,
            mscale_all_dim,
            truncate,
        } => {
            let inv = yarn(
                theta,
                dim,
                *factor,
                *original_max_position_embeddings,
                beta_fast.filter(|b| *b != 0.0).unwrap_or(32.0),
                beta_slow.filter(|b| *b != 0.0).unwrap_or(1.0),
                truncate.unwrap_or(true),
            );
            let get_mscale = |scale: f64, m: f64| {
                if scale <= 1.0 {
                    1.0
                } else {
                    0.1 * m * scale.ln() + 1.0
                }
            };
            let a = match (attention_factor, mscale, mscale_all_dim) {
                (Some(a), _, _) => *a,
                (None, Some(m), Some(mad)) if *m != 0.0 && *mad != 0.0 => {
                    get_mscale(*factor, *m) / get_mscale(*factor, *mad)
                }
                _ => get_mscale(*factor, 1.0),
            };
            (inv, a as f32)
        }
    }
}

/// `_compute_llama3_parameters`, in f32 like the PyTorch tensors it works on.
fn llama3(inv_freq: &[f32], factor: f64, low: f64, high: f64, old_ctx: usize) -> Vec<f32> {
    let low_wavelen = (old_ctx as f64 / low) as f32;
    let high_wavelen = (old_ctx as f64 / high) as f32;
    // `high - low` is a Python float in Hugging Face's code, the rest f32 tensors.
    let span = (high - low) as f32;
    let (factor, low, old_ctx) = (factor as f32, low as f32, old_ctx as f32);
    let two_pi = (2.0 * PI) as f32;
    inv_freq
        .iter()
        .map(|&f| {
            let wavelen = two_pi / f;
            if wavelen > low_wavelen {
                f / factor // long wavelengths: interpolated
            } else if wavelen < high_wavelen {
                f // short wavelengths: kept
            } else {
                let smooth = (old_ctx / wavelen - low) / span;
                (1.0 - smooth) * f / factor + smooth * f
            }
        })
        .collect()
}

/// `_compute_yarn_parameters`' inv_freq (the attention factor is computed by the caller).
fn yarn(
    theta: f64,
    dim: usize,
    factor: f64,
    original: usize,
    beta_fast: f64,
    beta_slow: f64,
    truncate: bool,
) -> Vec<f32> {
    // Inverse of "dimension -> number of rotations over the original context".
    let correction_dim = |rotations: f64| {
        dim as f64 * (original as f64 / (rotations * 2.0 * PI)).ln() / (2.0 * theta.ln())
    };
    let (mut low, mut high) = (correction_dim(beta_fast), correction_dim(beta_slow));
    if truncate {
        low = low.floor();
        high = high.ceil();
    }
    let low = low.max(0.0);
    let mut high = high.min((dim - 1) as f64);
    if low == high {
        high += 0.001; // as Hugging Face: avoids a division by zero
    }
    let (low, high) = (low as f32, high as f32);
    let factor = factor as f32;
    (0..dim / 2)
        .map(|i| {
            let e = (2 * i) as f32 / dim as f32;
            let pos_freq = theta.powf(f64::from(e)) as f32;
            let extrapolation = 1.0 / pos_freq;
            let interpolation = 1.0 / (factor * pos_freq);
            let ramp = ((i as f32 - low) / (high - low)).clamp(0.0, 1.0);
            let extrapolation_factor = 1.0 - ramp;
            interpolation * (1.0 - extrapolation_factor) + extrapolation * extrapolation_factor
        })
        .collect()
}

/// The `braid_nn::Rope` of a config (dynamic NTK included).
pub fn build_rope(config: &LlmConfig) -> Result<Rope> {
    let (inv_freq, factor) = inv_freq_and_factor(config);
    let rope = Rope::from_inv_freq(inv_freq, factor)?;
    Ok(match config.rope.scaling {
        RopeScaling::Dynamic { factor } => rope.with_dynamic_ntk(DynamicNtk {
            theta: config.rope.theta,
            factor,
            max_positions: config.max_position_embeddings,
        }),
        _ => rope,
    })
}
