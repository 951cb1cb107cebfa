//! Rotary position embedding tables and packed-sequence metadata (`SeqInfo`).

use std::sync::{Arc, Mutex};

use braid_kernels::{Device, Tensor};

use crate::cp::CpLocal;
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
        if self.rot_dim == 0 || !self.rot_dim.is_multiple_of(2) {
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
///
/// A scaled variant built elsewhere (the LLM's config knows Hugging Face's rope types)
/// enters through [`Rope::from_inv_freq`]: its `inv_freq`, the factor YaRN multiplies
/// cos and sin by, and for dynamic NTK the rule that recomputes `inv_freq` from the
/// batch's length.
#[derive(Clone, Debug)]
pub struct Rope {
    pub rot_dim: usize,
    /// (R/2)
    pub inv_freq: Vec<f32>,
    /// cos and sin are multiplied by it (YaRN's `attention_factor`); 1 otherwise.
    pub attention_factor: f32,
    /// Dynamic NTK scaling: `inv_freq` is recomputed when a batch is longer than the
    /// pretraining length.
    pub dynamic_ntk: Option<DynamicNtk>,
    /// The last tables made, shared by every clone of this rope (the blocks of an LLM
    /// stage hold clones of one): each layer of a forward reads the same positions, so
    /// the tables are computed and placed on the device once per microbatch, not once
    /// per layer.
    cache: Arc<Mutex<Option<Tables>>>,
}

/// (cos, sin) of one batch, and what they were made for.
#[derive(Debug)]
struct Tables {
    positions: Vec<u32>,
    seq_len: usize,
    device: Device,
    cos: Tensor, // (T, R/2)
    sin: Tensor, // (T, R/2)
}

/// Equal ropes rotate alike; the cache is not part of what a rope is.
impl PartialEq for Rope {
    fn eq(&self, other: &Self) -> bool {
        self.rot_dim == other.rot_dim
            && self.inv_freq == other.inv_freq
            && self.attention_factor == other.attention_factor
            && self.dynamic_ntk == other.dynamic_ntk
    }
}

/// Hugging Face's `dynamic` rope type (`_compute_dynamic_ntk_parameters`): for a batch
/// whose largest position + 1 is `L > max_positions`, the base becomes
/// `theta * (factor * L / max_positions - (factor - 1))^(R / (R - 2))`; for `L <=
/// max_positions` the unscaled `inv_freq` is used.
///
/// Unlike Hugging Face, whose module caches the longest length seen until a short
/// batch resets it, this is a function of the batch alone (same result for a batch
/// whatever ran before), which is what a training step wants.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct DynamicNtk {
    pub theta: f64,
    pub factor: f64,
    pub max_positions: usize,
}

impl DynamicNtk {
    /// inv_freq (R/2) for a batch of length `seq_len` (> max_positions), computed in f32
    /// step by step as PyTorch does it there.
    pub fn inv_freq(&self, rot_dim: usize, seq_len: usize) -> Vec<f32> {
        let r = rot_dim as f32;
        let ratio = (self.factor as f32) * seq_len as f32 / self.max_positions as f32
            - (self.factor as f32 - 1.0);
        let base = self.theta as f32 * ratio.powf(r / (r - 2.0));
        (0..rot_dim / 2)
            .map(|i| 1.0 / base.powf((2 * i) as f32 / r))
            .collect()
    }
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
            attention_factor: 1.0,
            dynamic_ntk: None,
            cache: Arc::default(),
        })
    }

    /// A rope from precomputed inverse frequencies (R/2 of them, R = 2 * len) and the
    /// factor cos/sin are multiplied by (1 for all but YaRN).
    pub fn from_inv_freq(inv_freq: Vec<f32>, attention_factor: f32) -> Result<Self> {
        let err = |msg: String| Err(Error::config("Rope", msg));
        if inv_freq.is_empty() {
            return err("inv_freq is empty: at least one rotated channel pair is needed".into());
        }
        if let Some(i) = inv_freq.iter().position(|f| !f.is_finite() || *f < 0.0) {
            return err(format!(
                "inv_freq[{i}] = {} must be finite and >= 0",
                inv_freq[i]
            ));
        }
        if !(attention_factor.is_finite() && attention_factor > 0.0) {
            return err(format!(
                "attention_factor = {attention_factor} must be a positive number"
            ));
        }
        Ok(Rope {
            rot_dim: 2 * inv_freq.len(),
            inv_freq,
            attention_factor,
            dynamic_ntk: None,
            cache: Arc::default(),
        })
    }

    /// The same rope with dynamic NTK scaling (see [`DynamicNtk`]).
    pub fn with_dynamic_ntk(self, ntk: DynamicNtk) -> Self {
        Rope {
            dynamic_ntk: Some(ntk),
            cache: Arc::default(), // tables made without the scaling must not be reused
            ..self
        }
    }

    /// The inverse frequencies used for a batch of largest position + 1 = `seq_len`.
    pub fn inv_freq_for(&self, seq_len: usize) -> std::borrow::Cow<'_, [f32]> {
        match &self.dynamic_ntk {
            Some(ntk) if seq_len > ntk.max_positions => {
                std::borrow::Cow::Owned(ntk.inv_freq(self.rot_dim, seq_len))
            }
            _ => std::borrow::Cow::Borrowed(&self.inv_freq),
        }
    }

    /// (cos, sin), each (T, R/2), for tokens at `positions` (T).
    pub fn tables(&self, positions: &[u32], device: Device) -> Result<(Tensor, Tensor)> {
        let seq_len = positions.iter().max().map_or(0, |&p| p as usize + 1);
        self.tables_for_len(positions, seq_len, device)
    }

    /// [`Rope::tables`] for tokens that are part of a batch of largest position + 1 =
    /// `seq_len` (a context-parallel shard: dynamic NTK scaling depends on the whole
    /// batch's length, which the shard's own positions may not reach).
    pub fn tables_for_len(
        &self,
        positions: &[u32],
        seq_len: usize,
        device: Device,
    ) -> Result<(Tensor, Tensor)> {
        let mut cache = self.cache.lock().unwrap_or_else(|p| p.into_inner());
        if let Some(c) = cache.as_ref()
            && c.seq_len == seq_len
            && c.device == device
            && c.positions == positions
        {
            let cos = c.cos.try_clone().ctx("rope", "cos table")?;
            let sin = c.sin.try_clone().ctx("rope", "sin table")?;
            return Ok((cos, sin));
        }
        let (cos, sin) = self.make_tables(positions, seq_len, device)?;
        *cache = Some(Tables {
            positions: positions.to_vec(),
            seq_len,
            device,
            cos: cos.try_clone().ctx("rope", "cos table")?,
            sin: sin.try_clone().ctx("rope", "sin table")?,
        });
        Ok((cos, sin))
    }

    /// The tables of [`Rope::tables_for_len`], computed on the host and copied to `device`.
    fn make_tables(
        &self,
        positions: &[u32],
        seq_len: usize,
        device: Device,
    ) -> Result<(Tensor, Tensor)> {
        let inv_freq = self.inv_freq_for(seq_len);
        let half = inv_freq.len();
        let t = positions.len();
        let a = self.attention_factor;
        let mut cos = Vec::with_capacity(t * half); // (T, R/2)
        let mut sin = Vec::with_capacity(t * half); // (T, R/2)
        for &p in positions {
            for &f in inv_freq.iter() {
                let angle = p as f32 * f;
                // `a == 1` multiplies exactly, so unscaled tables are unchanged.
                cos.push(angle.cos() * a);
                sin.push(angle.sin() * a);
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
///
/// Under context parallelism ([`crate::cp`]) a rank's `SeqInfo` describes its shard:
/// `cu_seqlens` delimits the chunks it holds, `positions` are the tokens' original
/// positions, and `cp` says which query chunks attend to which keys of the full rows.
/// `cp: None` everywhere else.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct SeqInfo {
    pub cu_seqlens: Vec<usize>,
    pub positions: Vec<u32>,
    /// This rank's share of a [`crate::cp::CpPlan`] (see there), or `None`.
    pub cp: Option<Arc<CpLocal>>,
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
            cp: None,
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
        if let Some(cp) = &self.cp {
            let held = cp.tokens(cp.rank())?.len();
            if held != t {
                return err(format!(
                    "the CP plan gives rank {} of {} {held} tokens, but the input has T = {t}",
                    cp.rank(),
                    cp.cp()
                ));
            }
        }
        Ok(())
    }
}
