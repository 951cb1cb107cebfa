//! Rotary position embedding tables and packed-sequence metadata (`SeqInfo`).

use braid_kernels::{Device, Tensor};

use crate::error::{Context, Error, Result};

/// RoPE settings: `theta` (Llama 2: 1e4, Qwen2: 1e6) and the rotated channels per head
/// `rot_dim` (R, even, <= HS; R = HS for Llama/Qwen2).
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct RopeConfig {
    pub theta: f32,
    pub rot_dim: usize,
}

impl RopeConfig {
    /// Checks the settings against the head size.
    pub fn validate(&self, hs: usize) -> Result<()> {
        let err = |msg: String| Err(Error::config("RopeConfig", msg));
        if !(self.theta > 0.0 && self.theta.is_finite()) {
            return err(format!("theta = {} must be a positive number", self.theta));
        }
        if self.rot_dim == 0 || self.rot_dim % 2 != 0 {
            return err(format!("rot_dim = {} must be even and > 0", self.rot_dim));
        }
        if self.rot_dim > hs {
            return err(format!(
                "rot_dim = {} is larger than the head size hs = {hs}",
                self.rot_dim
            ));
        }
        Ok(())
    }
}

/// Builds the cos/sin tables the `rope` kernel takes, from per-token positions.
///
/// `inv_freq[i] = theta^(-2i/R)` for i < R/2 (computed in f64, stored in f32 as Hugging
/// Face does); the angle of token t is `positions[t] * inv_freq[i]` in f32. Scaled
/// variants (linear, NTK, Llama 3, YaRN) only change `inv_freq` and positions.
#[derive(Clone, Debug, PartialEq)]
pub struct Rope {
    pub rot_dim: usize,
    /// (R/2)
    pub inv_freq: Vec<f32>,
}

impl Rope {
    pub fn new(config: RopeConfig) -> Result<Self> {
        config.validate(config.rot_dim)?;
        let r = config.rot_dim;
        let inv_freq = (0..r / 2)
            .map(|i| (1.0 / f64::from(config.theta).powf((2 * i) as f64 / r as f64)) as f32)
            .collect();
        Ok(Rope {
            rot_dim: r,
            inv_freq,
        })
    }

    /// (cos, sin), each (T, R/2), for tokens at `positions` (T).
    pub fn tables(&self, positions: &[u32], device: Device) -> Result<(Tensor, Tensor)> {
        let half = self.inv_freq.len();
        let t = positions.len();
        let mut cos = Vec::with_capacity(t * half); // (T, R/2)
        let mut sin = Vec::with_capacity(t * half); // (T, R/2)
        for &p in positions {
            for &f in &self.inv_freq {
                let angle = p as f32 * f;
                cos.push(angle.cos());
                sin.push(angle.sin());
            }
        }
        let cos = Tensor::from_vec(cos, [t, half], device).ctx("rope", "cos table")?;
        let sin = Tensor::from_vec(sin, [t, half], device).ctx("rope", "sin table")?;
        Ok((cos, sin))
    }
}

/// Where the packed samples of a (T, C) token batch start and each token's position.
///
/// `cu_seqlens = [0, t1, t1 + t2, ..., T]`; tokens of different samples never attend to
/// each other, and `positions` restart at 0 in every sample (what RoPE sees).
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqInfo {
    pub cu_seqlens: Vec<usize>,
    pub positions: Vec<u32>,
}

impl SeqInfo {
    /// Samples of lengths `lens` packed back to back, positions 0.. in each.
    pub fn packed(lens: &[usize]) -> Self {
        let mut cu_seqlens = Vec::with_capacity(lens.len() + 1);
        let mut positions = Vec::with_capacity(lens.iter().sum());
        cu_seqlens.push(0);
        for &l in lens {
            cu_seqlens.push(cu_seqlens[cu_seqlens.len() - 1] + l);
            positions.extend(0..l as u32);
        }
        SeqInfo {
            cu_seqlens,
            positions,
        }
    }

    /// One sample of `t` tokens.
    pub fn single(t: usize) -> Self {
        Self::packed(&[t])
    }

    /// Number of tokens T.
    pub fn num_tokens(&self) -> usize {
        self.positions.len()
    }

    /// Number of packed samples.
    pub fn num_seqs(&self) -> usize {
        self.cu_seqlens.len().saturating_sub(1)
    }

    /// Checks that the offsets describe exactly `t` tokens.
    pub fn validate(&self, t: usize) -> Result<()> {
        let err = |msg: String| Err(Error::input("SeqInfo", msg));
        let cu = &self.cu_seqlens;
        if cu.len() < 2 || cu[0] != 0 {
            return err(format!(
                "cu_seqlens must start with 0 and hold at least one sample, got {cu:?}"
            ));
        }
        if let Some(i) = cu.windows(2).position(|w| w[1] < w[0]) {
            return err(format!(
                "cu_seqlens must be nondecreasing, but cu_seqlens[{}] = {} > cu_seqlens[{}] = {}",
                i,
                cu[i],
                i + 1,
                cu[i + 1]
            ));
        }
        let last = cu[cu.len() - 1];
        if last != t {
            return err(format!(
                "cu_seqlens ends at {last} but the input has T = {t} tokens"
            ));
        }
        if self.positions.len() != t {
            return err(format!(
                "{} positions given for T = {t} tokens",
                self.positions.len()
            ));
        }
        Ok(())
    }
}
