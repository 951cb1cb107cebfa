//! Multi-head self-attention over packed variable-length samples: q/k/v projections
//! (column-parallel), optional RoPE, GQA, causal or bidirectional, output projection
//! (row-parallel). Heads are split across the TP group.
//!
//! Context parallelism: with a CP group (`Attention::cp`) and a `SeqInfo` carrying a
//! rank's share of a [`CpPlan`](crate::cp::CpPlan), each rank holds a shard of the
//! tokens; K and V are all-gathered over the CP group before attention and their
//! grads reduce-scattered back after it (see [`crate::cp`]). Without it, nothing
//! changes.

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::Tensor;
use braid_kernels::ops::attention::{attention_bwd_ranges, attention_fwd_ranges};
use braid_kernels::ops::{self, AttentionSpec};

use crate::cp::{CpLocal, gather_kv_bwd, gather_kv_fwd};
use crate::error::{Context, Error, Result};
use crate::parallel::{ColumnParallelLinear, RowParallelCache, RowParallelLinear};
use crate::param::{Init, Module, Param};
use crate::regions::{copy_to_tp_bwd, copy_to_tp_fwd};
use crate::rope::{Rope, RopeConfig, SeqInfo};
use crate::wgrad::Held;

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
    /// The context-parallel group: the ranks that hold the other token shards of the
    /// same rows (with the same TP rank). `None`: no context parallelism.
    pub cp: Option<Arc<dyn Comm>>,
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
    /// Context parallelism: the plan share (k and v above are local rows; the full
    /// rows are gathered again in the backward).
    cp: Option<Arc<CpLocal>>,
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
            cp: None,
        })
    }

    /// The same layer over the context-parallel group `cp` (see [`crate::cp`]).
    pub fn with_cp(self, cp: Arc<dyn Comm>) -> Self {
        Attention {
            cp: Some(cp),
            ..self
        }
    }

    /// The CP share and group for a batch described by `seq`: both or neither (a CP
    /// group of more than one rank without a plan would attend within shards only).
    fn cp_of<'a>(&'a self, seq: &'a SeqInfo) -> Result<Option<(&'a CpLocal, &'a dyn Comm)>> {
        match (&seq.cp, &self.cp) {
            (None, None) => Ok(None),
            (None, Some(g)) if g.size() == 1 => Ok(None),
            (None, Some(g)) => Err(Error::input(
                &self.name,
                format!(
                    "this layer has a CP group of {} ranks but the SeqInfo has no CP plan (CpPlan::seq_info)",
                    g.size()
                ),
            )),
            (Some(_), None) => Err(Error::input(
                &self.name,
                "the SeqInfo has a CP plan but this layer has no CP group (Attention::with_cp)",
            )),
            (Some(local), Some(g)) => {
                local.check_group(&self.name, g.as_ref())?;
                if local.causal() != self.config.causal {
                    return Err(Error::input(
                        &self.name,
                        format!(
                            "the CP plan was made for causal = {} but this layer has causal = {}",
                            local.causal(),
                            self.config.causal
                        ),
                    ));
                }
                Ok(Some((local.as_ref(), g.as_ref())))
            }
        }
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
        let cp = self.cp_of(seq)?;
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
                // Under CP, dynamic NTK scaling must see the full rows' length.
                let (cos, sin) = match cp {
                    Some((local, _)) => {
                        rope.tables_for_len(&seq.positions, local.seq_len(), x.device())?
                    }
                    None => rope.tables(&seq.positions, x.device())?,
                }; // (T, R/2)
                let q = ops::rope_fwd(&q, &cos, &sin).ctx(name, "rope q")?;
                let k = ops::rope_fwd(&k, &cos, &sin).ctx(name, "rope k")?;
                (q, k, Some((cos, sin)))
            }
            None => (q, k, None),
        };
        // out (T, NH, HS), lse (NH, T)
        let (out, lse) = match cp {
            None => ops::attention_fwd(&q, &k, &v, &seq.cu_seqlens, &self.spec())
                .ctx(name, "attention forward")?,
            Some((local, group)) => {
                // k_full, v_full (T_full, NKV, HS) in global token order
                let (k_full, v_full) = self.gather_kv(group, local, &k, &v)?;
                attention_fwd_ranges(&q, &k_full, &v_full, local.segments(), &self.spec())
                    .ctx(name, "context-parallel attention forward")?
            }
        };
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
            cp: seq.cp.clone(),
        };
        Ok((y, cache))
    }

    /// k, v (T, NKV, HS) local rows -> the full rows (T_full, NKV, HS) in global token
    /// order, gathered over the CP group.
    fn gather_kv(
        &self,
        group: &dyn Comm,
        local: &CpLocal,
        k: &Tensor,
        v: &Tensor,
    ) -> Result<(Tensor, Tensor)> {
        let name = self.name.as_str();
        let [t, nkv, hs] = *k.dims() else {
            return Err(Error::input(
                name,
                format!("k must be (T, NKV, HS), got {}", k.shape()),
            ));
        };
        let full = |x: &Tensor| -> Result<Tensor> {
            let x = x
                .try_clone()
                .and_then(|x| x.reshape([t, nkv * hs]))
                .ctx(name, "cp k/v")?;
            gather_kv_fwd(group, local, &x)?
                .reshape([local.total_tokens(), nkv, hs])
                .ctx(name, "cp k/v")
        };
        Ok((full(k)?, full(v)?))
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
            cp,
        } = cache;
        let spec = self.spec();
        let hs = self.config.dims.hs;
        let (nh, nkv) = self.local_heads();
        let t = q.dims()[0];
        let name = self.name.clone();
        let RowParallelCache { x_local: out } = o;
        let dout = self.o_proj.backward_parallel(Held::Borrowed(&out), dy)?; // (T, NH * HS)
        let out = out.reshape([t, nh, hs]).ctx(&name, "attention output")?;
        let dout = dout
            .reshape([t, nh, hs])
            .ctx(&name, "attention output grad")?;
        let (dq, dk, dv) = match &cp {
            None => ops::attention_bwd(&dout, &q, &k, &v, &out, &lse, &cu_seqlens, &spec)
                .ctx(&name, "attention backward")?,
            Some(local) => {
                let group = match &self.cp {
                    Some(g) => g.as_ref(),
                    None => {
                        return Err(Error::input(
                            &name,
                            "the cache is context-parallel but this layer has no CP group",
                        ));
                    }
                };
                // K and V again rather than cached: the cache stays O(T / cp).
                let (k_full, v_full) = self.gather_kv(group, local, &k, &v)?;
                let segs = local.segments();
                // dk_full, dv_full (T_full, NKV, HS): this rank's queries' share
                let (dq, dk_full, dv_full) =
                    attention_bwd_ranges(&dout, &q, &k_full, &v_full, &out, &lse, segs, &spec)
                        .ctx(&name, "context-parallel attention backward")?;
                // -> this rank's rows (T, NKV, HS), summed over the CP ranks.
                let tf = local.total_tokens();
                let local_rows = |d: Tensor| -> Result<Tensor> {
                    let d = d.reshape([tf, nkv * hs]).ctx(&name, "cp dk/dv")?;
                    gather_kv_bwd(group, local, &d)?
                        .reshape([t, nkv, hs])
                        .ctx(&name, "cp dk/dv")
                };
                (dq, local_rows(dk_full)?, local_rows(dv_full)?)
            }
        };
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
        // q, k and v read one input: a deferred W keeps it once for the three.
        let x = Arc::new(x); // (T, C)
        let shared = || Held::Shared(Arc::clone(&x));
        let mut dx = self.q_proj.backward_local(shared(), Held::Owned(dq))?;
        let dxk = self.k_proj.backward_local(shared(), Held::Owned(dk))?;
        ops::add_assign(&mut dx, &dxk).ctx(&name, "summing input grads")?;
        let dxv = self.v_proj.backward_local(shared(), Held::Owned(dv))?;
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
