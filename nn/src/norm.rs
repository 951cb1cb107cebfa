//! `LayerNorm`, `RMSNorm` and `Norm` (either, chosen by config) over the last dimension.

use braid_kernels::{Tensor, ops};

use crate::error::{Context, Error, Result};
use crate::param::{Init, InitKind, Module, Param, Shard};

/// Which normalization a block uses.
#[derive(Clone, Copy, Debug, PartialEq)]
pub enum NormKind {
    /// LayerNorm with weight and bias (ViT, Whisper, GPT-2).
    LayerNorm,
    /// RMSNorm, weight only (Llama, Qwen2).
    RmsNorm,
}

fn check_dims(what: &'static str, name: &str, c: usize, eps: f32) -> Result<()> {
    if c == 0 {
        return Err(Error::config(what, format!("{name}: c must be > 0")));
    }
    if !(eps > 0.0 && eps.is_finite()) {
        return Err(Error::config(
            what,
            format!("{name}: eps = {eps} must be a positive number"),
        ));
    }
    Ok(())
}

/// `y = (x - mean) * rstd * w + b` over the last dimension C. Params `{name}.weight`
/// (1) and `{name}.bias` (0).
#[derive(Debug)]
pub struct LayerNorm {
    pub name: String,
    pub weight: Param,
    pub bias: Option<Param>,
    pub eps: f32,
}

/// What [`LayerNorm::backward`] needs.
#[derive(Debug)]
pub struct LayerNormCache {
    /// (..., C)
    pub x: Tensor,
    /// (N)
    pub mean: Tensor,
    /// (N)
    pub rstd: Tensor,
}

impl LayerNorm {
    pub fn new(init: &Init, name: &str, c: usize, eps: f32, bias: bool) -> Result<Self> {
        check_dims("LayerNorm", name, c, eps)?;
        let weight = init.param(
            &format!("{name}.weight"),
            &[c],
            InitKind::Constant(1.0),
            Shard::Full,
        )?;
        let bias = if bias {
            Some(init.param(
                &format!("{name}.bias"),
                &[c],
                InitKind::Constant(0.0),
                Shard::Full,
            )?)
        } else {
            None
        };
        Ok(LayerNorm {
            name: name.to_string(),
            weight,
            bias,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, LayerNormCache)> {
        self.forward_owned(x.try_clone().ctx(&self.name, "caching input")?)
    }

    /// Forward that moves `x` into the cache.
    pub fn forward_owned(&self, x: Tensor) -> Result<(Tensor, LayerNormCache)> {
        let b = self.bias.as_ref().map(Param::compute);
        let (y, mean, rstd) = ops::layer_norm_fwd(&x, self.weight.compute(), b, self.eps)
            .ctx(&self.name, "forward")?;
        Ok((y, LayerNormCache { x, mean, rstd }))
    }

    pub fn backward(&mut self, cache: LayerNormCache, dy: &Tensor) -> Result<Tensor> {
        let (w, dw) = self.weight.compute_and_grad();
        let db = self.bias.as_mut().and_then(|b| b.grad.as_mut());
        ops::layer_norm_bwd(dy, &cache.x, w, &cache.mean, &cache.rstd, dw, db)
            .ctx(&self.name, "backward")
    }
}

impl Module for LayerNorm {
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

/// `y = x * rstd * w`, rstd = 1 / sqrt(mean(x^2) + eps). Param `{name}.weight` (1).
#[derive(Debug)]
pub struct RmsNorm {
    pub name: String,
    pub weight: Param,
    pub eps: f32,
}

/// What [`RmsNorm::backward`] needs.
#[derive(Debug)]
pub struct RmsNormCache {
    /// (..., C)
    pub x: Tensor,
    /// (N)
    pub rstd: Tensor,
}

impl RmsNorm {
    pub fn new(init: &Init, name: &str, c: usize, eps: f32) -> Result<Self> {
        check_dims("RmsNorm", name, c, eps)?;
        let weight = init.param(
            &format!("{name}.weight"),
            &[c],
            InitKind::Constant(1.0),
            Shard::Full,
        )?;
        Ok(RmsNorm {
            name: name.to_string(),
            weight,
            eps,
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, RmsNormCache)> {
        self.forward_owned(x.try_clone().ctx(&self.name, "caching input")?)
    }

    /// Forward that moves `x` into the cache.
    pub fn forward_owned(&self, x: Tensor) -> Result<(Tensor, RmsNormCache)> {
        let (y, rstd) =
            ops::rms_norm_fwd(&x, self.weight.compute(), self.eps).ctx(&self.name, "forward")?;
        Ok((y, RmsNormCache { x, rstd }))
    }

    pub fn backward(&mut self, cache: RmsNormCache, dy: &Tensor) -> Result<Tensor> {
        let (w, dw) = self.weight.compute_and_grad();
        ops::rms_norm_bwd(dy, &cache.x, w, &cache.rstd, dw).ctx(&self.name, "backward")
    }
}

impl Module for RmsNorm {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        f(&self.weight);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.weight);
    }
}

/// A LayerNorm or an RMSNorm, as the config says.
// Two or three per block, built once: the bytes a box would save do not matter.
#[allow(clippy::large_enum_variant)]
#[derive(Debug)]
pub enum Norm {
    LayerNorm(LayerNorm),
    RmsNorm(RmsNorm),
}

/// The cache of a [`Norm`].
#[derive(Debug)]
pub enum NormCache {
    LayerNorm(LayerNormCache),
    RmsNorm(RmsNormCache),
}

impl NormCache {
    /// The forward's input (kept for the backward; a block reuses it as the residual).
    pub fn input(&self) -> &Tensor {
        match self {
            NormCache::LayerNorm(c) => &c.x,
            NormCache::RmsNorm(c) => &c.x,
        }
    }

    /// The forward's input, the rest of the cache dropped.
    pub fn into_input(self) -> Tensor {
        match self {
            NormCache::LayerNorm(c) => c.x,
            NormCache::RmsNorm(c) => c.x,
        }
    }
}

impl Norm {
    /// `kind` over C features; a LayerNorm gets a bias.
    pub fn new(init: &Init, name: &str, kind: NormKind, c: usize, eps: f32) -> Result<Self> {
        Ok(match kind {
            NormKind::LayerNorm => Norm::LayerNorm(LayerNorm::new(init, name, c, eps, true)?),
            NormKind::RmsNorm => Norm::RmsNorm(RmsNorm::new(init, name, c, eps)?),
        })
    }

    pub fn forward(&self, x: &Tensor) -> Result<(Tensor, NormCache)> {
        match self {
            Norm::LayerNorm(n) => n.forward(x).map(|(y, c)| (y, NormCache::LayerNorm(c))),
            Norm::RmsNorm(n) => n.forward(x).map(|(y, c)| (y, NormCache::RmsNorm(c))),
        }
    }

    /// Forward that moves `x` into the cache.
    pub fn forward_owned(&self, x: Tensor) -> Result<(Tensor, NormCache)> {
        match self {
            Norm::LayerNorm(n) => n
                .forward_owned(x)
                .map(|(y, c)| (y, NormCache::LayerNorm(c))),
            Norm::RmsNorm(n) => n.forward_owned(x).map(|(y, c)| (y, NormCache::RmsNorm(c))),
        }
    }

    pub fn backward(&mut self, cache: NormCache, dy: &Tensor) -> Result<Tensor> {
        match (self, cache) {
            (Norm::LayerNorm(n), NormCache::LayerNorm(c)) => n.backward(c, dy),
            (Norm::RmsNorm(n), NormCache::RmsNorm(c)) => n.backward(c, dy),
            (n, _) => Err(Error::input(
                n.name(),
                "backward got the cache of the other norm kind",
            )),
        }
    }

    pub fn name(&self) -> &str {
        match self {
            Norm::LayerNorm(n) => &n.name,
            Norm::RmsNorm(n) => &n.name,
        }
    }
}

impl Module for Norm {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        match self {
            Norm::LayerNorm(n) => n.visit_params(f),
            Norm::RmsNorm(n) => n.visit_params(f),
        }
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        match self {
            Norm::LayerNorm(n) => n.visit_params_mut(f),
            Norm::RmsNorm(n) => n.visit_params_mut(f),
        }
    }
}
