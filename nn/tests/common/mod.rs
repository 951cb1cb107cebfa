//! Shared test helpers: random inputs, finite-difference checks of a layer's input and
//! parameter grads, and small `Comm` implementations for tensor-parallel tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::sync::Arc;

use braid_comm::{Comm, CommError, SingleRank};
use braid_kernels::rng::Rng;
use braid_kernels::testing::{FdTolerance, check_grad, dot};
use braid_kernels::{Device, Shape, Tensor};
use braid_nn::{
    AttentionConfig, AttentionDims, BlockConfig, Init, MlpConfig, MlpKind, Module, NormKind,
    RopeConfig,
};

pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// (name, grad) of every parameter, None when frozen.
pub type NamedGrads = Vec<(String, Option<Vec<f32>>)>;
/// (name, value) of every parameter.
pub type NamedValues = Vec<(String, Vec<f32>)>;
/// (output, input grad, param grads) of one forward + backward.
pub type Outcome = (Vec<f32>, Vec<f32>, NamedGrads);

pub fn single() -> Arc<dyn Comm> {
    Arc::new(SingleRank)
}

/// Init with a larger std than training's 0.02, so that every path carries O(1)
/// signal and finite differences see it.
pub fn test_init(seed: u64, dev: Device) -> Init {
    Init::new(seed, dev).with_std(0.3)
}

pub fn randn(seed: u64, n: usize) -> Vec<f32> {
    Rng::new(seed).normal_vec(n, 1.0)
}

pub fn tensor(data: &[f32], dims: &[usize], dev: Device) -> TestResult<Tensor> {
    Ok(Tensor::from_vec(data.to_vec(), dims, dev)?)
}

/// (value, grad) of the parameter `name` on the host.
pub fn param_host<M: Module>(m: &M, name: &str) -> TestResult<(Vec<f32>, Option<Vec<f32>>)> {
    let mut found = None;
    m.visit_params(&mut |p| {
        if p.name == name {
            found = Some(p);
        }
    });
    let p = found.ok_or_else(|| format!("no parameter named {name}"))?;
    let g = match &p.grad {
        Some(g) => Some(g.to_vec_f32()?),
        None => None,
    };
    Ok((p.value.to_vec_f32()?, g))
}

/// Replaces the value of parameter `name`.
pub fn set_param<M: Module>(m: &mut M, name: &str, data: &[f32]) -> TestResult<()> {
    let mut res: TestResult<()> = Err(format!("no parameter named {name}").into());
    m.visit_params_mut(&mut |p| {
        if p.name == name {
            res = Tensor::from_vec(data.to_vec(), p.value.shape().clone(), p.value.device())
                .map(|t| p.value = t)
                .map_err(Into::into);
        }
    });
    res
}

/// Every parameter's grad on the host, by name (None when frozen).
pub fn grads<M: Module>(m: &M) -> TestResult<NamedGrads> {
    let mut out = Vec::new();
    let mut err = None;
    m.visit_params(&mut |p| {
        let g = p.grad.as_ref().map(|g| g.to_vec_f32());
        match g {
            Some(Err(e)) => err = Some(e),
            Some(Ok(v)) => out.push((p.name.clone(), Some(v))),
            None => out.push((p.name.clone(), None)),
        }
    });
    match err {
        Some(e) => Err(e.into()),
        None => Ok(out),
    }
}

/// Checks a layer's input grad and every trainable parameter's grad by central
/// differences of `L = dot(forward(x), r)`.
///
/// `fwd(m, x)` runs the forward only; `fwd_bwd(m, x, r)` runs forward + backward with
/// output grad r and returns dx. The grads are zeroed first.
#[allow(clippy::too_many_arguments)]
pub fn check_layer<M: Module>(
    what: &str,
    m: &mut M,
    x: &[f32],
    x_dims: &[usize],
    dev: Device,
    tol: FdTolerance,
    fwd: impl Fn(&M, &Tensor) -> TestResult<Tensor>,
    fwd_bwd: impl FnOnce(&mut M, &Tensor, &Tensor) -> TestResult<Tensor>,
) -> TestResult<()> {
    let xt = tensor(x, x_dims, dev)?;
    let y = fwd(m, &xt)?;
    let r = randn(0x5eed, y.elem_count());
    let rt = tensor(&r, y.dims(), dev)?;
    m.zero_grads()?;
    let dx = fwd_bwd(m, &xt, &rt)?.to_vec_f32()?;
    let loss = |m: &M, x: &Tensor| -> TestResult<f64> { Ok(dot(&fwd(m, x)?.to_vec_f32()?, &r)) };
    check_grad(&format!("{what}: dx"), x, &dx, tol, |xp| {
        let xt = Tensor::from_vec(xp.to_vec(), x_dims, dev)?;
        loss(m, &xt).map_err(|e| braid_kernels::Error::invalid("fd", e.to_string()))
    })?;
    for (name, g) in grads(m)? {
        let Some(g) = g else { continue };
        let (v, _) = param_host(m, &name)?;
        let mut fd_err = None;
        let numeric = braid_kernels::testing::fd_grad(&v, tol.eps, |vp| {
            let r = set_param(m, &name, vp).and_then(|_| loss(m, &xt));
            r.map_err(|e| {
                fd_err = Some(e.to_string());
                braid_kernels::Error::invalid("fd", "loss failed")
            })
        });
        if let Some(e) = fd_err {
            return Err(e.into());
        }
        let numeric = numeric?;
        set_param(m, &name, &v)?;
        braid_kernels::testing::assert_close(
            &format!("{what}: d{name}"),
            &g,
            &numeric,
            tol.atol,
            tol.rtol,
        );
    }
    Ok(())
}

/// A stand-in TP rank for shape and sharding tests: `rank` of `size`. Collectives act
/// as if every rank held the same tensor as this one, offset by 100 per rank in
/// all-gathers (so that the order of the ranks is visible).
#[derive(Debug)]
pub struct EchoRank {
    pub rank: usize,
    pub size: usize,
}

impl Comm for EchoRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, t: &mut Tensor) -> braid_comm::Result<()> {
        braid_kernels::ops::scale_assign(t, self.size as f32)?;
        Ok(())
    }
    fn all_gather(&self, t: &Tensor) -> braid_comm::Result<Tensor> {
        let v = t.to_vec_f32()?;
        let mut out = Vec::with_capacity(v.len() * self.size);
        for r in 0..self.size {
            out.extend(v.iter().map(|x| x + 100.0 * r as f32));
        }
        let mut dims = t.dims().to_vec();
        dims[0] *= self.size;
        Ok(Tensor::from_vec(out, dims, t.device())?)
    }
    fn reduce_scatter_sum(&self, _t: &Tensor) -> braid_comm::Result<Tensor> {
        Err(unsupported("reduce_scatter_sum"))
    }
    fn broadcast(&self, _t: &mut Tensor, _root: usize) -> braid_comm::Result<()> {
        Err(unsupported("broadcast"))
    }
    fn send(&self, _t: &Tensor, _dst: usize) -> braid_comm::Result<()> {
        Err(unsupported("send"))
    }
    fn recv(&self, _shape: &Shape, _src: usize) -> braid_comm::Result<Tensor> {
        Err(unsupported("recv"))
    }
    fn all_to_all_v(&self, _parts: Vec<Tensor>) -> braid_comm::Result<Vec<Tensor>> {
        Err(unsupported("all_to_all_v"))
    }
    fn barrier(&self) -> braid_comm::Result<()> {
        Ok(())
    }
}

fn unsupported(op: &'static str) -> CommError {
    CommError::Invalid {
        op,
        rank: 0,
        size: 0,
        msg: "not supported by this test comm".into(),
    }
}

pub use braid_comm::testing::run_on_ranks;

/// A pre-norm block: causal, RoPE, GQA 4 query / 2 kv heads, RMSNorm, SwiGLU (C = 8).
pub fn causal_rope_gqa() -> BlockConfig {
    BlockConfig {
        attn: AttentionConfig {
            dims: AttentionDims {
                c: 8,
                nh: 4,
                nkv: 2,
                hs: 4,
            },
            causal: true,
            qkv_bias: true,
            o_bias: false,
            rope: Some(RopeConfig {
                theta: 100.0,
                rot_dim: 4,
            }),
        },
        mlp: MlpConfig {
            c: 8,
            ff: 12,
            kind: MlpKind::SwiGlu,
            bias: false,
        },
        norm: NormKind::RmsNorm,
        norm_eps: 1e-6,
    }
}
