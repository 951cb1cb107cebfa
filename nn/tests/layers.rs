//! Embedding, LayerNorm, RMSNorm and the two MLP kinds: finite-difference grads,
// Test code: a failed expectation is a panic by design.
#![allow(clippy::unwrap_used, clippy::expect_used)]
//! frozen params, accumulation and tensor-parallel equivalence.

mod common;

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::ops::Activation;
use braid_kernels::testing::{FdTolerance, assert_close, dot, fd_grad};
use braid_kernels::{Device, Tensor};
use braid_nn::{Embedding, LayerNorm, Mlp, MlpConfig, MlpKind, Module, Norm, NormKind, RmsNorm};
use common::*;

fn embedding_grads(dev: Device) -> TestResult {
    let mut e = Embedding::new(&test_init(1, dev), "embed_tokens", 5, 3)?;
    let ids = Tensor::from_vec_u32(vec![4, 0, 4, 2], [4], dev)?;
    let (y, cache) = e.forward(&ids)?;
    assert_eq!(y.dims(), &[4, 3]);
    let (table, _) = param_host(&e, "embed_tokens.weight")?;
    assert_eq!(y.to_vec_f32()?[..3], table[12..15], "row 0 is token 4");
    let r = randn(2, 12);
    e.zero_grads()?;
    e.backward(cache, &tensor(&r, &[4, 3], dev)?)?;
    let (_, g) = param_host(&e, "embed_tokens.weight")?;
    let numeric = fd_grad(&table, 1e-2, |tp| {
        let t = Tensor::from_vec(tp.to_vec(), [5, 3], dev)?;
        Ok(dot(
            &braid_kernels::ops::embedding_fwd(&ids, &t)?.to_vec_f32()?,
            &r,
        ))
    })?;
    assert_close("dembed", &g.ok_or("grad")?, &numeric, 2e-3, 2e-2);
    e.freeze();
    let (_, cache) = e.forward(&ids)?;
    e.backward(cache, &tensor(&r, &[4, 3], dev)?)?;
    assert!(e.weight.grad.is_none());
    Ok(())
}

fn norm_grads(dev: Device) -> TestResult {
    let x = randn(3, 4 * 6);
    for kind in [NormKind::LayerNorm, NormKind::RmsNorm] {
        let mut n = Norm::new(&test_init(4, dev), "norm", kind, 6, 1e-5)?;
        // Weights and bias away from 1 and 0, so that their grads matter.
        let names: Vec<String> = n.param_shapes().into_iter().map(|p| p.0).collect();
        for (i, name) in names.iter().enumerate() {
            set_param(&mut n, name, &randn(10 + i as u64, 6))?;
        }
        check_layer(
            &format!("{kind:?}"),
            &mut n,
            &x,
            &[4, 6],
            dev,
            FdTolerance::default(),
            |n, x| Ok(n.forward(x)?.0),
            |n, x, dy| {
                let (_, c) = n.forward(x)?;
                Ok(n.backward(c, dy)?)
            },
        )?;
    }
    Ok(())
}

fn norm_init_and_names(dev: Device) -> TestResult {
    let ln = LayerNorm::new(&test_init(1, dev), "ln", 4, 1e-5, true)?;
    assert_eq!(
        ln.param_shapes(),
        vec![("ln.weight".into(), vec![4]), ("ln.bias".into(), vec![4])]
    );
    assert_eq!(param_host(&ln, "ln.weight")?.0, vec![1.0; 4]);
    assert_eq!(param_host(&ln, "ln.bias")?.0, vec![0.0; 4]);
    let rms = RmsNorm::new(&test_init(1, dev), "rms", 4, 1e-6)?;
    assert_eq!(rms.param_shapes(), vec![("rms.weight".into(), vec![4])]);
    let err = RmsNorm::new(&test_init(1, dev), "rms", 4, 0.0).expect_err("eps 0");
    assert!(
        err.to_string()
            .contains("eps = 0 must be a positive number"),
        "{err}"
    );
    Ok(())
}

fn mlp(dev: Device, kind: MlpKind, bias: bool, group: Arc<dyn Comm>) -> braid_nn::Result<Mlp> {
    let config = MlpConfig {
        c: 4,
        ff: 6,
        kind,
        bias,
    };
    Mlp::new(&test_init(5, dev), "mlp", config, group)
}

fn mlp_grads(dev: Device) -> TestResult {
    let x = randn(6, 3 * 4);
    for (kind, bias) in [
        (MlpKind::Gelu(Activation::GeluTanh), true),
        (MlpKind::SwiGlu, false),
    ] {
        let mut m = mlp(dev, kind, bias, single())?;
        check_layer(
            &format!("{kind:?}"),
            &mut m,
            &x,
            &[3, 4],
            dev,
            FdTolerance::default(),
            |m, x| Ok(m.forward(x)?.0),
            |m, x, dy| {
                let (_, c) = m.forward(x)?;
                Ok(m.backward(c, dy)?)
            },
        )?;
    }
    Ok(())
}

fn mlp_names(dev: Device) -> TestResult {
    let names = |m: &Mlp| m.param_shapes();
    let gelu = mlp(dev, MlpKind::Gelu(Activation::GeluErf), true, single())?;
    assert_eq!(
        names(&gelu),
        vec![
            ("mlp.fc1.weight".into(), vec![6, 4]),
            ("mlp.fc1.bias".into(), vec![6]),
            ("mlp.fc2.weight".into(), vec![4, 6]),
            ("mlp.fc2.bias".into(), vec![4]),
        ]
    );
    let swiglu = mlp(
        dev,
        MlpKind::SwiGlu,
        false,
        Arc::new(EchoRank { rank: 1, size: 2 }),
    )?;
    assert_eq!(
        names(&swiglu),
        vec![
            ("mlp.gate_proj.weight".into(), vec![3, 4]),
            ("mlp.up_proj.weight".into(), vec![3, 4]),
            ("mlp.down_proj.weight".into(), vec![4, 3]),
        ]
    );
    let err = mlp(
        dev,
        MlpKind::SwiGlu,
        false,
        Arc::new(EchoRank { rank: 0, size: 4 }),
    )
    .expect_err("6 % 4");
    assert_eq!(
        err.to_string(),
        "invalid MlpConfig: ff = 6 is not a multiple of the TP size 4"
    );
    Ok(())
}

/// Frozen MLP: same input grad, no param grads; trainable: grads accumulate (+=).
fn mlp_frozen_and_accumulate(dev: Device) -> TestResult {
    let x = tensor(&randn(7, 3 * 4), &[3, 4], dev)?;
    let dy = tensor(&randn(8, 3 * 4), &[3, 4], dev)?;
    let mut m = mlp(dev, MlpKind::SwiGlu, true, single())?;
    let step = |m: &mut Mlp| -> TestResult<Vec<f32>> {
        let (_, c) = m.forward(&x)?;
        Ok(m.backward(c, &dy)?.to_vec_f32()?)
    };
    let dx = step(&mut m)?;
    let once = grads(&m)?;
    assert_eq!(step(&mut m)?, dx);
    for ((n, g1), (_, g2)) in once.iter().zip(grads(&m)?) {
        let twice: Vec<f32> = g1.as_ref().ok_or("grad")?.iter().map(|v| 2.0 * v).collect();
        assert_close(n, &g2.ok_or("grad")?, &twice, 1e-6, 1e-6);
    }
    m.freeze();
    assert_eq!(step(&mut m)?, dx);
    assert!(grads(&m)?.iter().all(|(_, g)| g.is_none()));
    Ok(())
}

/// Two ranks as threads, each with half the hidden units, give the single-rank MLP.
fn mlp_tp2_matches_single_rank(dev: Device) -> TestResult {
    let x = randn(9, 3 * 4);
    let dy = randn(10, 3 * 4);
    for kind in [MlpKind::SwiGlu, MlpKind::Gelu(Activation::GeluTanh)] {
        let run = |g: Arc<dyn Comm>| -> TestResult<Outcome> {
            let mut m = mlp(dev, kind, true, g)?;
            let (y, c) = m.forward(&tensor(&x, &[3, 4], dev)?)?;
            let dx = m.backward(c, &tensor(&dy, &[3, 4], dev)?)?;
            Ok((y.to_vec_f32()?, dx.to_vec_f32()?, grads(&m)?))
        };
        let (y, dx, g) = run(single())?;
        let results = run_on_ranks(2, |r| run(Arc::new(r)).map_err(|e| e.to_string()));
        let mut up_w = Vec::new();
        for r in results {
            let (ry, rdx, rg) = r?;
            assert_close("tp2 mlp y", &ry, &y, 1e-5, 1e-5);
            assert_close("tp2 mlp dx", &rdx, &dx, 1e-5, 1e-5);
            let i = rg
                .iter()
                .position(|(n, _)| n.ends_with("up_proj.weight") || n.ends_with("fc1.weight"));
            up_w.extend(rg[i.ok_or("up weight")?].1.clone().ok_or("grad")?);
        }
        let i = g
            .iter()
            .position(|(n, _)| n.ends_with("up_proj.weight") || n.ends_with("fc1.weight"));
        assert_close(
            "tp2 up grad",
            &up_w,
            g[i.ok_or("up weight")?].1.as_ref().ok_or("grad")?,
            1e-6,
            1e-6,
        );
    }
    Ok(())
}

braid_kernels::test_on_devices!(
    embedding_grads,
    norm_grads,
    norm_init_and_names,
    mlp_grads,
    mlp_names,
    mlp_frozen_and_accumulate,
    mlp_tp2_matches_single_rank,
);

/// A parameter shape whose element count overflows, or whose bytes no allocator can give,
/// is an error naming the parameter and its shape, not a wrapped size or an abort.
#[test]
fn an_impossible_parameter_shape_is_an_error_naming_it() {
    let init = braid_nn::Init::new(0, Device::Cpu);
    for (shape, why) in [
        (vec![1usize << 40, 1 << 40], "overflows"),
        // 2^62 f32 values: more bytes than an address space (no allocation is tried).
        (vec![1usize << 62], "cannot be allocated"),
    ] {
        let e = init
            .param(
                "llm.w",
                &shape,
                braid_nn::InitKind::Normal(0.02),
                braid_nn::Shard::Full,
            )
            .unwrap_err()
            .to_string();
        assert!(e.contains("`llm.w`") && e.contains(why), "{e}");
    }
}
