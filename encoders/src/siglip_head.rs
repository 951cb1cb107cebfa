//! SigLIP's attention-pooling head (`SiglipMultiheadAttentionPoolingHead`): a learned
//! probe attends over each image's tokens, then `a + mlp(layernorm(a))`.
//!
//! The probe is one query per image. The attention kernel takes queries and keys of
//! the same packed length, so the probe's query is broadcast to every token row of its
//! image and row 0 of each image is kept: all rows of an image are equal, and the
//! extra rows cost one (N x N) attention per image — about one encoder layer's
//! attention, once. Their output grads are zero, so they add nothing in the backward.

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::ops::{self, AttentionSpec};
use braid_kernels::{DType, Tensor};
use braid_nn::error::Context;
use braid_nn::norm::LayerNormCache;
use braid_nn::{
    Init, InitKind, LayerNorm, Linear, LinearCache, Mlp, MlpCache, MlpConfig, MlpKind, Module,
    Param, Result, SeqInfo, Shard,
};

use crate::config::VisionConfig;
use crate::util::{ids, zeros};

/// Params (Braid names): `head.probe` (1, D), `head.attention.{q,k,v,o}_proj`
/// (HF packs q/k/v as `in_proj_weight`), `head.layernorm`, `head.mlp.fc1/fc2`.
#[derive(Debug)]
pub struct AttentionPoolingHead {
    pub name: String,
    /// NH, HS
    nh: usize,
    hs: usize,
    /// (1, D)
    pub probe: Param,
    pub q_proj: Linear,
    pub k_proj: Linear,
    pub v_proj: Linear,
    pub o_proj: Linear,
    pub layernorm: LayerNorm,
    pub mlp: Mlp,
}

/// What [`AttentionPoolingHead::backward`] needs.
#[derive(Debug)]
pub struct HeadCache {
    /// (T, D): the encoder output the keys and values come from
    h: Tensor,
    /// (T, NH, HS) broadcast probe query, keys, values, attention output
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    /// (NH, T)
    lse: Tensor,
    /// (T) u32 zeros: the broadcast index
    zeros_t: Tensor,
    /// (B) u32: first row of each image
    first_rows: Tensor,
    cu_seqlens: Vec<usize>,
    o: LinearCache,
    ln: LayerNormCache,
    mlp: MlpCache,
}

impl AttentionPoolingHead {
    pub fn new(
        init: &Init,
        name: &str,
        config: &VisionConfig,
        group: Arc<dyn Comm>,
    ) -> Result<Self> {
        let d = config.hidden_size;
        let lin = |p: &str| Linear::new(init, &format!("{name}.attention.{p}"), d, d, true);
        Ok(AttentionPoolingHead {
            name: name.to_string(),
            nh: config.num_heads,
            hs: config.head_size(),
            probe: init.param(
                &format!("{name}.probe"),
                &[1, d],
                InitKind::Normal(init.std),
                Shard::Full,
            )?,
            q_proj: lin("q_proj")?,
            k_proj: lin("k_proj")?,
            v_proj: lin("v_proj")?,
            o_proj: lin("o_proj")?,
            layernorm: LayerNorm::new(
                init,
                &format!("{name}.layernorm"),
                d,
                config.layer_norm_eps,
                true,
            )?,
            mlp: Mlp::new(
                init,
                &format!("{name}.mlp"),
                MlpConfig {
                    c: d,
                    ff: config.intermediate_size,
                    kind: MlpKind::Gelu(config.act.kernel()),
                    bias: true,
                },
                group,
            )?,
        })
    }

    fn spec(&self) -> AttentionSpec {
        AttentionSpec {
            causal: false,
            scale: 1.0 / (self.hs as f32).sqrt(),
        }
    }

    /// h (T, D) packed images described by `seq`, `first_rows` (B) -> pooled (B, D).
    pub fn forward(
        &self,
        h: &Tensor,
        seq: &SeqInfo,
        first_rows: &Tensor,
    ) -> Result<(Tensor, HeadCache)> {
        let name = self.name.as_str();
        let t = h.dims()[0];
        let (nh, hs) = (self.nh, self.hs);
        let q1 = self.q_proj.apply(self.probe.compute())?; // (1, D)
        let zeros_t = ids(vec![0; t], h.device())?;
        let q = ops::gather_rows(&q1, &zeros_t)
            .and_then(|q| q.reshape([t, nh, hs]))
            .ctx(name, "broadcast probe")?; // (T, NH, HS)
        let k = self.k_proj.apply(h)?.reshape([t, nh, hs]).ctx(name, "k")?; // (T, NH, HS)
        let v = self.v_proj.apply(h)?.reshape([t, nh, hs]).ctx(name, "v")?; // (T, NH, HS)
        let (out, lse) = ops::attention_fwd(&q, &k, &v, &seq.cu_seqlens, &self.spec())
            .ctx(name, "attention forward")?;
        let sel = out
            .try_clone()
            .and_then(|o| o.reshape([t, nh * hs]))
            .and_then(|o| ops::gather_rows(&o, first_rows))
            .ctx(name, "pick one row per image")?; // (B, D)
        let (a, o) = self.o_proj.forward_owned(sel)?; // (B, D)
        let (an, ln) = self.layernorm.forward_owned(a)?;
        let (m, mlp) = self.mlp.forward_owned(an)?;
        let pooled = ops::add(&ln.x, &m).ctx(name, "residual")?; // (B, D)
        let cache = HeadCache {
            h: h.try_clone().ctx(name, "caching input")?,
            q,
            k,
            v,
            out,
            lse,
            zeros_t,
            first_rows: first_rows.try_clone().ctx(name, "caching rows")?,
            cu_seqlens: seq.cu_seqlens.clone(),
            o,
            ln,
            mlp,
        };
        Ok((pooled, cache))
    }

    /// d pooled (B, D) -> dh (T, D); adds into the head's parameter grads.
    pub fn backward(&mut self, cache: HeadCache, dp: &Tensor) -> Result<Tensor> {
        let HeadCache {
            h,
            q,
            k,
            v,
            out,
            lse,
            zeros_t,
            first_rows,
            cu_seqlens,
            o,
            ln,
            mlp,
        } = cache;
        let name = self.name.clone();
        let spec = self.spec();
        let t = h.dims()[0];
        let d = self.nh * self.hs;
        // pooled = a + mlp(ln(a))
        let dan = self.mlp.backward(mlp, dp)?;
        let mut da = self.layernorm.backward(ln, &dan)?;
        ops::add_assign(&mut da, dp).ctx(&name, "residual backward")?;
        let dsel = self.o_proj.backward(o, &da)?; // (B, D)
        let mut dout = zeros(&[t, d], dsel.dtype(), h.device())?; // (T, D)
        ops::scatter_rows(&mut dout, &first_rows, &dsel).ctx(&name, "row pick backward")?;
        let dout = dout
            .reshape([t, self.nh, self.hs])
            .ctx(&name, "row pick backward")?;
        let (dq, dk, dv) = ops::attention_bwd(&dout, &q, &k, &v, &out, &lse, &cu_seqlens, &spec)
            .ctx(&name, "attention backward")?;
        let dk = dk.reshape([t, d]).ctx(&name, "dk")?;
        let dv = dv.reshape([t, d]).ctx(&name, "dv")?;
        let mut dh = self.k_proj.backward_with_input(&h, &dk)?;
        let dhv = self.v_proj.backward_with_input(&h, &dv)?;
        ops::add_assign(&mut dh, &dhv).ctx(&name, "summing input grads")?;
        // The broadcast's adjoint: sum the query grads of all rows into the one probe.
        let dq = dq.reshape([t, d]).ctx(&name, "dq")?;
        let mut dq1 = zeros(&[1, d], DType::F32, h.device())?; // (1, D)
        ops::embedding_bwd(&dq, &zeros_t, &mut dq1).ctx(&name, "broadcast backward")?;
        let dq1 = ops::into_dtype(dq1, dq.dtype()).ctx(&name, "broadcast backward")?;
        let dprobe = self
            .q_proj
            .backward_with_input(self.probe.compute(), &dq1)?;
        if let Some(g) = self.probe.grad.as_mut() {
            ops::add_assign(g, &dprobe).ctx(&name, "probe grad")?;
        }
        Ok(dh)
    }
}

impl Module for AttentionPoolingHead {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        f(&self.probe);
        self.q_proj.visit_params(f);
        self.k_proj.visit_params(f);
        self.v_proj.visit_params(f);
        self.o_proj.visit_params(f);
        self.layernorm.visit_params(f);
        self.mlp.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        f(&mut self.probe);
        self.q_proj.visit_params_mut(f);
        self.k_proj.visit_params_mut(f);
        self.v_proj.visit_params_mut(f);
        self.o_proj.visit_params_mut(f);
        self.layernorm.visit_params_mut(f);
        self.mlp.visit_params_mut(f);
    }
}
