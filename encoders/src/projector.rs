//! Projectors from encoder width into the LLM width.
//!
//! - [`MlpProjector`] with `spatial_merge = 1`: LLaVA's `linear_1 -> GELU -> linear_2`
//!   per patch token.
//! - [`MlpProjector`] with `spatial_merge = m > 1`: Qwen2-VL's `PatchMerger`: `ln_q` on
//!   each patch (D), the m x m neighbouring patches of each image concatenated (row
//!   by row inside the block) into one (m*m*D) token, then `mlp.0 -> GELU -> mlp.2`
//!   (hidden width m*m*D). Tokens come in raster order per image; each image's grid
//!   must have both sides divisible by m.
//! - [`AudioProjector`]: `stride` consecutive frames of a clip concatenated (stride*D)
//!   -> `linear_1 -> GELU -> linear_2` (Ultravox-style stacking). A clip whose length
//!   is not a multiple of `stride` is ZERO-PADDED at its end to the next multiple
//!   (its last group holds the remaining frames then zeros), so no frame is dropped:
//!   a clip of L frames gives ceil(L / stride) tokens.

use braid_kernels::ops::{self, Activation};
use braid_kernels::{DType, Tensor};
use braid_nn::error::Context;
use braid_nn::norm::LayerNormCache;
use braid_nn::{Error, Init, LayerNorm, Linear, Module, Param, Result};

use crate::util::{ids, zeros};

/// `l2(act(l1(x)))` with its cache.
#[derive(Debug)]
struct TwoLayer {
    l1: Linear,
    l2: Linear,
    act: Activation,
}

#[derive(Debug)]
struct TwoLayerCache {
    /// (N, in), (N, hidden) pre-activation, (N, hidden) post-activation
    x: Tensor,
    h: Tensor,
    a: Tensor,
}

impl TwoLayer {
    fn forward(&self, x: Tensor) -> Result<(Tensor, TwoLayerCache)> {
        let h = self.l1.apply(&x)?; // (N, hidden)
        let a = ops::activation_fwd(&h, self.act).ctx(&self.l1.name, "activation")?;
        let y = self.l2.apply(&a)?; // (N, out)
        Ok((y, TwoLayerCache { x, h, a }))
    }

    fn backward(&mut self, c: TwoLayerCache, dy: &Tensor) -> Result<Tensor> {
        let da = self.l2.backward_with_input(&c.a, dy)?;
        let dh = ops::activation_bwd(&da, &c.h, self.act).ctx(&self.l1.name, "activation")?;
        self.l1.backward_with_input(&c.x, &dh)
    }

    fn visit<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        self.l1.visit_params(f);
        self.l2.visit_params(f);
    }

    fn visit_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.l1.visit_params_mut(f);
        self.l2.visit_params_mut(f);
    }
}

/// Sizes of a vision projector.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct ProjectorConfig {
    /// Encoder width D.
    pub in_dim: usize,
    /// LLM width.
    pub out_dim: usize,
    /// 1: per-token MLP (LLaVA); m > 1: merge m x m patches first (Qwen2-VL).
    pub spatial_merge: usize,
    pub act: Activation,
    /// eps of `ln_q` (Qwen2-VL: 1e-6); unused when spatial_merge = 1.
    pub ln_eps: f32,
}

/// A vision projector; see the module doc. Params `{name}.linear_1/linear_2`, or
/// `{name}.ln_q`, `{name}.mlp.0`, `{name}.mlp.2` with spatial merge.
#[derive(Debug)]
pub struct MlpProjector {
    pub config: ProjectorConfig,
    pub ln_q: Option<LayerNorm>,
    mlp: TwoLayer,
}

/// What [`MlpProjector::backward`] needs.
#[derive(Debug)]
pub struct ProjectorCache {
    ln: Option<LayerNormCache>,
    /// (T) u32: source row of each merged slot, when merging
    perm: Option<Tensor>,
    mlp: TwoLayerCache,
}

impl MlpProjector {
    pub fn new(init: &Init, name: &str, config: ProjectorConfig) -> Result<Self> {
        let ProjectorConfig {
            in_dim,
            out_dim,
            spatial_merge: m,
            act,
            ln_eps,
        } = config;
        if m == 0 {
            return Err(Error::config(
                "ProjectorConfig",
                "spatial_merge = 0 must be >= 1",
            ));
        }
        let (ln_q, mlp) = if m == 1 {
            let l1 = Linear::new(init, &format!("{name}.linear_1"), in_dim, out_dim, true)?;
            let l2 = Linear::new(init, &format!("{name}.linear_2"), out_dim, out_dim, true)?;
            (None, TwoLayer { l1, l2, act })
        } else {
            let hidden = in_dim * m * m;
            let ln = LayerNorm::new(init, &format!("{name}.ln_q"), in_dim, ln_eps, true)?;
            let l1 = Linear::new(init, &format!("{name}.mlp.0"), hidden, hidden, true)?;
            let l2 = Linear::new(init, &format!("{name}.mlp.2"), hidden, out_dim, true)?;
            (Some(ln), TwoLayer { l1, l2, act })
        };
        Ok(MlpProjector { config, ln_q, mlp })
    }

    /// The merged order: for each image (gh, gw), for each m x m block in raster
    /// order, its patches row by row. Returns the source row of every slot.
    fn merge_order(&self, grids: &[(usize, usize)], t: usize) -> Result<Vec<u32>> {
        let m = self.config.spatial_merge;
        let mut perm = Vec::with_capacity(t);
        let mut base = 0;
        for (i, &(gh, gw)) in grids.iter().enumerate() {
            if gh % m != 0 || gw % m != 0 {
                return Err(Error::input(
                    "projector",
                    format!(
                        "image {i}: patch grid {gh}x{gw} is not divisible by spatial_merge = {m}"
                    ),
                ));
            }
            for bi in 0..gh / m {
                for bj in 0..gw / m {
                    for di in 0..m {
                        for dj in 0..m {
                            perm.push((base + (bi * m + di) * gw + bj * m + dj) as u32);
                        }
                    }
                }
            }
            base += gh * gw;
        }
        if base != t {
            return Err(Error::input(
                "projector",
                format!("grids {grids:?} hold {base} patches but x has {t} rows"),
            ));
        }
        Ok(perm)
    }

    /// x (T, D) patch tokens of images packed in raster order, with each image's patch
    /// grid (gh, gw) (ignored and may be empty when spatial_merge = 1) ->
    /// (T / m^2, out_dim).
    pub fn forward(
        &self,
        x: &Tensor,
        grids: &[(usize, usize)],
    ) -> Result<(Tensor, ProjectorCache)> {
        let d = self.config.in_dim;
        let &[t, xd] = x.dims() else {
            return Err(Error::input(
                "projector",
                format!("x must be (T, D), got {}", x.shape()),
            ));
        };
        if xd != d {
            return Err(Error::input(
                "projector",
                format!("x {} has width {xd}, expected in_dim = {d}", x.shape()),
            ));
        }
        let x = x.try_clone().ctx("projector", "caching input")?;
        let Some(ln) = &self.ln_q else {
            let (y, mlp) = self.mlp.forward(x)?;
            return Ok((
                y,
                ProjectorCache {
                    ln: None,
                    perm: None,
                    mlp,
                },
            ));
        };
        let m2 = self.config.spatial_merge * self.config.spatial_merge;
        let perm = ids(self.merge_order(grids, t)?, x.device())?;
        let (xn, lnc) = ln.forward_owned(x)?; // (T, D)
        let merged = ops::gather_rows(&xn, &perm)
            .and_then(|g| g.reshape([t / m2, m2 * d]))
            .ctx("projector", "merge")?; // (T/m², m² D)
        let (y, mlp) = self.mlp.forward(merged)?;
        Ok((
            y,
            ProjectorCache {
                ln: Some(lnc),
                perm: Some(perm),
                mlp,
            },
        ))
    }

    /// dy (T / m^2, out_dim) -> dx (T, D); adds into the parameter grads.
    pub fn backward(&mut self, cache: ProjectorCache, dy: &Tensor) -> Result<Tensor> {
        let d = self.config.in_dim;
        let dm = self.mlp.backward(cache.mlp, dy)?;
        match (self.ln_q.as_mut(), cache.ln, cache.perm) {
            (None, None, None) => Ok(dm),
            (Some(ln), Some(lnc), Some(perm)) => {
                let t = perm.dims()[0];
                let dm = dm.reshape([t, d]).ctx("projector", "merge backward")?;
                // Summed in f32 (embedding grads always are), then in dm's dtype.
                let mut dxn = zeros(&[t, d], DType::F32, dm.device())?; // (T, D)
                ops::embedding_bwd(&dm, &perm, &mut dxn).ctx("projector", "merge backward")?;
                let dxn = ops::into_dtype(dxn, dm.dtype()).ctx("projector", "merge backward")?;
                ln.backward(lnc, &dxn)
            }
            _ => Err(Error::input(
                "projector backward",
                "cache does not match this projector",
            )),
        }
    }
}

impl Module for MlpProjector {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        if let Some(ln) = &self.ln_q {
            ln.visit_params(f);
        }
        self.mlp.visit(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some(ln) = &mut self.ln_q {
            ln.visit_params_mut(f);
        }
        self.mlp.visit_mut(f);
    }
}

/// Audio projector: `stride` frames stacked, then a two-layer MLP; see the module doc.
/// Params `{name}.linear_1` (out, stride*D), `{name}.linear_2` (out, out).
#[derive(Debug)]
pub struct AudioProjector {
    pub stride: usize,
    pub in_dim: usize,
    mlp: TwoLayer,
}

/// What [`AudioProjector::backward`] needs.
#[derive(Debug)]
pub struct AudioProjectorCache {
    /// (G*stride) u32 row of the padded input each slot reads (T = the zero row)
    idx: Tensor,
    /// T
    t: usize,
    mlp: TwoLayerCache,
}

impl AudioProjector {
    pub fn new(
        init: &Init,
        name: &str,
        in_dim: usize,
        out_dim: usize,
        stride: usize,
        act: Activation,
    ) -> Result<Self> {
        if stride == 0 {
            return Err(Error::config("AudioProjector", "stride = 0 must be >= 1"));
        }
        let l1 = Linear::new(
            init,
            &format!("{name}.linear_1"),
            stride * in_dim,
            out_dim,
            true,
        )?;
        let l2 = Linear::new(init, &format!("{name}.linear_2"), out_dim, out_dim, true)?;
        Ok(AudioProjector {
            stride,
            in_dim,
            mlp: TwoLayer { l1, l2, act },
        })
    }

    /// Output cu_seqlens for input clips `cu_seqlens`: ceil(L_i / stride) tokens each.
    pub fn out_cu_seqlens(&self, cu_seqlens: &[usize]) -> Vec<usize> {
        let mut out = vec![0];
        for w in cu_seqlens.windows(2) {
            let g = (w[1] - w[0]).div_ceil(self.stride);
            out.push(out[out.len() - 1] + g);
        }
        out
    }

    /// x (T, D) clips packed by `cu_seqlens` -> (G, out), G = sum ceil(L_i / stride).
    pub fn forward(
        &self,
        x: &Tensor,
        cu_seqlens: &[usize],
    ) -> Result<(Tensor, AudioProjectorCache)> {
        let (s, d) = (self.stride, self.in_dim);
        let &[t, xd] = x.dims() else {
            return Err(Error::input(
                "audio projector",
                format!("x must be (T, D), got {}", x.shape()),
            ));
        };
        let ok = xd == d
            && cu_seqlens.len() >= 2
            && cu_seqlens[0] == 0
            && cu_seqlens.windows(2).all(|w| w[0] <= w[1])
            && cu_seqlens.last() == Some(&t);
        if !ok {
            return Err(Error::input(
                "audio projector",
                format!(
                    "x {} must be (T, in_dim = {d}) and cu_seqlens {cu_seqlens:?} must run from 0 to T, nondecreasing",
                    x.shape()
                ),
            ));
        }
        let dev = x.device();
        // Slot (group, j) of a clip reads frame start + group*s + j, or the zero row T
        // past the clip's end.
        let mut idx = Vec::new();
        for w in cu_seqlens.windows(2) {
            let (start, len) = (w[0], w[1] - w[0]);
            for k in 0..len.div_ceil(s) * s {
                idx.push(if k < len {
                    (start + k) as u32
                } else {
                    t as u32
                });
            }
        }
        let g = idx.len() / s;
        let idx = ids(idx, dev)?;
        let mut padded = zeros(&[t + 1, d], x.dtype(), dev)?; // (T+1, D), row T stays zero
        let rows = ids((0..t as u32).collect(), dev)?;
        ops::scatter_rows(&mut padded, &rows, x).ctx("audio projector", "pad")?;
        let stacked = ops::gather_rows(&padded, &idx)
            .and_then(|v| v.reshape([g, s * d]))
            .ctx("audio projector", "stack frames")?; // (G, s D)
        let (y, mlp) = self.mlp.forward(stacked)?;
        Ok((y, AudioProjectorCache { idx, t, mlp }))
    }

    /// dy (G, out) -> dx (T, D); adds into the parameter grads.
    pub fn backward(&mut self, cache: AudioProjectorCache, dy: &Tensor) -> Result<Tensor> {
        let d = self.in_dim;
        let t = cache.t;
        let ds = self.mlp.backward(cache.mlp, dy)?; // (G, s D)
        let n = cache.idx.dims()[0];
        let ds = ds.reshape([n, d]).ctx("audio projector", "unstack")?;
        let mut dpad = zeros(&[t + 1, d], DType::F32, ds.device())?; // (T+1, D)
        ops::embedding_bwd(&ds, &cache.idx, &mut dpad).ctx("audio projector", "unstack")?;
        let rows = ids((0..t as u32).collect(), ds.device())?;
        ops::gather_rows(&dpad, &rows)
            .and_then(|dx| ops::into_dtype(dx, ds.dtype()))
            .ctx("audio projector", "unpad")
    }
}

impl Module for AudioProjector {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        self.mlp.visit(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.mlp.visit_mut(f);
    }
}
