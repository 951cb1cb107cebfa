//! Multi-head self-attention over packed variable-length samples: q/k/v projections
//! (column-parallel), optional RoPE, GQA, causal or bidirectional, output projection
//! (row-parallel). Heads are split across the TP group.

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::Tensor;
use braid_kernels::ops::{self, AttentionSpec};

use crate::error::{Context, Error, Result};
use crate::parallel::{ColumnParallelLinear, RowParallelCache, RowParallelLinear};
use crate::param::{Init, Module, Param};
use crate::regions::{copy_to_tp_bwd, copy_to_tp_fwd};
use crate::rope::{Rope, RopeConfig, SeqInfo};

/// Head layout: model width `c`, `nh` query heads, `nkv` key/value heads (GQA: nh a
/// multiple of nkv; MQA: nkv = 1), head size `hs` (nh * hs need not equal c).
#[derive(Clone, Copy, Debug, PartialEq, Eq)]
pub struct AttentionDims {
    pub c: usize,
    pub nh: usize,
    pub nkv: usize,
    pub hs: usize,
}

impl AttentionDims {
    /// Checks the head layout for a TP group of `tp` ranks (each holds nh/tp query and
    /// nkv/tp key/value heads).
    pub fn validate(&self, tp: usize) -> Result<()> {
        let err = |msg: String| Err(Error::config("AttentionDims", msg));
        let AttentionDims { c, nh, nkv, hs } = *self;
        if c == 0 || nh == 0 || nkv == 0 || hs == 0 {
            return err(format!(
                "c = {c}, nh = {nh}, nkv = {nkv}, hs = {hs} must all be > 0"
            ));
        }
        if nh % nkv != 0 {
            return err(format!("nh = {nh} is not a multiple of nkv = {nkv}"));
        }
        if tp == 0 || nh % tp != 0 {
            return err(format!(
                "nh = {nh} query heads cannot be split across a TP group of {tp}"
            ));
        }
        if nkv % tp != 0 {
            return err(format!(
                "nkv = {nkv} key/value heads cannot be split across a TP group of {tp}"
            ));
        }
        Ok(())
    }
}

/// Everything that defines an attention layer.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct AttentionConfig {
    pub dims: AttentionDims,
    /// Each token sees only earlier tokens of its own sample (decoders) or all of them.
    pub causal: bool,
    /// Biases on q/k/v (Qwen2, ViT, Whisper's q/v).
    pub qkv_bias: bool,
    /// Bias on the output projection.
    pub o_bias: bool,
    /// Rotary embedding of q and k (decoders), or none (encoders with learned or
    /// sinusoidal absolute positions).
    pub rope: Option<RopeConfig>,
}

impl AttentionConfig {
    pub fn validate(&self, tp: usize) -> Result<()> {
        self.dims.validate(tp)?;
        if let Some(r) = &self.rope {
            r.validate(self.dims.hs)?;
        }
        Ok(())
    }
}

/// Self-attention `(T, C) -> (T, C)`. Params `{name}.{q,k,v,o}_proj.{weight,bias}`.
#[derive(Debug)]
pub struct Attention {
    pub name: String,
    pub config: AttentionConfig,
    /// (nh/tp * hs, C)
    pub q_proj: ColumnParallelLinear,
    /// (nkv/tp * hs, C)
    pub k_proj: ColumnParallelLinear,
    /// (nkv/tp * hs, C)
    pub v_proj: ColumnParallelLinear,
    /// (C, nh/tp * hs)
    pub o_proj: RowParallelLinear,
    pub rope: Option<Rope>,
    pub group: Arc<dyn Comm>,
}

/// What [`Attention::backward`] needs.
#[derive(Debug)]
pub struct AttentionCache {
    /// (T, C)
    x: Tensor,
    /// (T, NH/tp, HS), after RoPE
    q: Tensor,
    /// (T, NKV/tp, HS), after RoPE
    k: Tensor,
    /// (T, NKV/tp, HS)
    v: Tensor,
    /// (NH/tp, T)
    lse: Tensor,
    /// o_proj's input: the attention output (T, NH/tp * HS)
    o: RowParallelCache,
    /// (cos, sin), each (T, R/2)
    rope: Option<(Tensor, Tensor)>,
    cu_seqlens: Vec<usize>,
}

impl Attention {
    pub fn new(
        init: &Init,
        name: &str,
        config: AttentionConfig,
        group: Arc<dyn Comm>,
    ) -> Result<Self> {
        config.validate(group.size())?;
        let AttentionDims { c, nh, nkv, hs } = config.dims;
        let col = |proj: &str, heads: usize| {
            ColumnParallelLinear::new(
                init,
                &format!("{name}.{proj}"),
                c,
                heads * hs,
                config.qkv_bias,
                false,
                Arc::clone(&group),
            )
        };
        let q_proj = col("q_proj", nh)?;
        let k_proj = col("k_proj", nkv)?;
        let v_proj = col("v_proj", nkv)?;
        let o_proj = RowParallelLinear::new(
            init,
            &format!("{name}.o_proj"),
            nh * hs,
            c,
            config.o_bias,
            true,
            Arc::clone(&group),
        )?;
        let rope = config.rope.map(Rope::new).transpose()?;
        Ok(Attention {
            name: name.to_string(),
            config,
            q_proj,
            k_proj,
            v_proj,
            o_proj,
            rope,
            group,
        })
    }

    /// (query heads, key/value heads) on this rank.
    pub fn local_heads(&self) -> (usize, usize) {
        let tp = self.group.size();
        (self.config.dims.nh / tp, self.config.dims.nkv / tp)
    }

    fn spec(&self) -> AttentionSpec {
        AttentionSpec {
            causal: self.config.causal,
            scale: 1.0 / (self.config.dims.hs as f32).sqrt(),
        }
    }

    /// Checks that x is (T, C) and `seq` describes T tokens; returns T.
    fn check_input(&self, x: &Tensor, seq: &SeqInfo) -> Result<usize> {
        let c = self.config.dims.c;
        let t = match *x.dims() {
            [t, xc] if xc == c => t,
            _ => {
                return Err(Error::input(
                    &self.name,
                    format!(
                        "x must be (T, C = {c}) packed tokens, got shape {}",
                        x.shape()
                    ),
                ));
            }
        };
        seq.validate(t)
            .map_err(|e| Error::input(&self.name, e.to_string()))?;
        Ok(t)
    }

    pub fn forward(&self, x: &Tensor, seq: &SeqInfo) -> Result<(Tensor, AttentionCache)> {
        self.forward_owned(x.try_clone().ctx(&self.name, "caching input")?, seq)
    }

    /// Forward that moves `x` (T, C) into the cache.
    pub fn forward_owned(&self, x: Tensor, seq: &SeqInfo) -> Result<(Tensor, AttentionCache)> {
        let t = self.check_input(&x, seq)?;
        let hs = self.config.dims.hs;
        let (nh, nkv) = self.local_heads();
        let name = self.name.as_str();
        let xi = copy_to_tp_fwd(self.group.as_ref(), &x);
        let q = self
            .q_proj
            .forward_local(xi)?
            .reshape([t, nh, hs])
            .ctx(name, "q")?; // (T, NH, HS)
        let k = self
            .k_proj
            .forward_local(xi)?
            .reshape([t, nkv, hs])
            .ctx(name, "k")?; // (T, NKV, HS)
        let v = self
            .v_proj
            .forward_local(xi)?
            .reshape([t, nkv, hs])
            .ctx(name, "v")?; // (T, NKV, HS)
        let (q, k, rope) = match &self.rope {
            Some(rope) => {
                let (cos, sin) = rope.tables(&seq.positions, x.device())?; // (T, R/2)
                let q = ops::rope_fwd(&q, &cos, &sin).ctx(name, "rope q")?;
                let k = ops::rope_fwd(&k, &cos, &sin).ctx(name, "rope k")?;
                (q, k, Some((cos, sin)))
            }
            None => (q, k, None),
        };
        // out (T, NH, HS), lse (NH, T)
        let (out, lse) = ops::attention_fwd(&q, &k, &v, &seq.cu_seqlens, &self.spec())
            .ctx(name, "attention forward")?;
        let out = out.reshape([t, nh * hs]).ctx(name, "attention output")?;
        let (y, o) = self.o_proj.forward_parallel(out)?; // (T, C)
        let cache = AttentionCache {
            x,
            q,
            k,
            v,
            lse,
            o,
            rope,
            cu_seqlens: seq.cu_seqlens.clone(),
        };
        Ok((y, cache))
    }

    pub fn backward(&mut self, cache: AttentionCache, dy: &Tensor) -> Result<Tensor> {
        let AttentionCache {
            x,
            q,
            k,
            v,
            lse,
            o,
            rope,
            cu_seqlens,
        } = cache;
        let spec = self.spec();
        let hs = self.config.dims.hs;
        let (nh, nkv) = self.local_heads();
        let t = q.dims()[0];
        let name = self.name.clone();
        let RowParallelCache { x_local: out } = o;
        let dout = self.o_proj.backward_parallel(&out, dy)?; // (T, NH * HS)
        let out = out.reshape([t, nh, hs]).ctx(&name, "attention output")?;
        let dout = dout
            .reshape([t, nh, hs])
            .ctx(&name, "attention output grad")?;
        let (dq, dk, dv) = ops::attention_bwd(&dout, &q, &k, &v, &out, &lse, &cu_seqlens, &spec)
            .ctx(&name, "attention backward")?;
        let (dq, dk) = match &rope {
            Some((cos, sin)) => (
                ops::rope_bwd(&dq, cos, sin).ctx(&name, "rope q backward")?,
                ops::rope_bwd(&dk, cos, sin).ctx(&name, "rope k backward")?,
            ),
            None => (dq, dk),
        };
        let dq = dq.reshape([t, nh * hs]).ctx(&name, "dq")?;
        let dk = dk.reshape([t, nkv * hs]).ctx(&name, "dk")?;
        let dv = dv.reshape([t, nkv * hs]).ctx(&name, "dv")?;
        let mut dx = self.q_proj.backward_local(&x, &dq)?;
        let dxk = self.k_proj.backward_local(&x, &dk)?;
        ops::add_assign(&mut dx, &dxk).ctx(&name, "summing input grads")?;
        let dxv = self.v_proj.backward_local(&x, &dv)?;
        ops::add_assign(&mut dx, &dxv).ctx(&name, "summing input grads")?;
        // One all-reduce for the input grad of q, k and v together.
        copy_to_tp_bwd(self.group.as_ref(), dx).ctx(&name, "backward")
    }
}

impl Module for Attention {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        self.q_proj.visit_params(f);
        self.k_proj.visit_params(f);
        self.v_proj.visit_params(f);
        self.o_proj.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        self.q_proj.visit_params_mut(f);
        self.k_proj.visit_params_mut(f);
        self.v_proj.visit_params_mut(f);
        self.o_proj.visit_params_mut(f);
    }
}
