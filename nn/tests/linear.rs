//! Linear, Column/RowParallelLinear, the TP comm regions, parameters and init.
// Test code: a failed expectation is a panic by design.
#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::sync::Arc;

use braid_comm::Comm;
use braid_kernels::testing::FdTolerance;
use braid_kernels::{Device, Tensor};
use braid_nn::regions::{
    gather_from_tp_bwd, gather_from_tp_fwd, scatter_to_tp_bwd, scatter_to_tp_fwd,
};
use braid_nn::{ColumnParallelLinear, Init, Linear, Module, RowParallelLinear};
use common::*;

fn linear_grads(dev: Device) -> TestResult {
    for bias in [false, true] {
        let mut l = Linear::new(&test_init(1, dev), "proj", 5, 3, bias)?;
        let x = randn(2, 4 * 5);
        check_layer(
            "linear",
            &mut l,
            &x,
            &[4, 5],
            dev,
            FdTolerance::default(),
            |l, x| Ok(l.apply(x)?),
            |l, x, dy| {
                let (_, c) = l.forward(x)?;
                Ok(l.backward(c, dy)?)
            },
        )?;
    }
    Ok(())
}

fn column_parallel_grads(dev: Device) -> TestResult {
    for gather in [false, true] {
        let mut l =
            ColumnParallelLinear::new(&test_init(3, dev), "fc", 4, 6, true, gather, single())?;
        let x = randn(4, 3 * 4);
        check_layer(
            "column",
            &mut l,
            &x,
            &[3, 4],
            dev,
            FdTolerance::default(),
            |l, x| Ok(l.forward(x)?.0),
            |l, x, dy| {
                let (_, c) = l.forward(x)?;
                Ok(l.backward(c, dy)?)
            },
        )?;
    }
    Ok(())
}

fn row_parallel_grads(dev: Device) -> TestResult {
    for parallel in [false, true] {
        let mut l =
            RowParallelLinear::new(&test_init(5, dev), "fc2", 6, 4, true, parallel, single())?;
        let x = randn(6, 3 * 6);
        check_layer(
            "row",
            &mut l,
            &x,
            &[3, 6],
            dev,
            FdTolerance::default(),
            |l, x| Ok(l.forward(x)?.0),
            |l, x, dy| {
                let (_, c) = l.forward(x)?;
                Ok(l.backward(c, dy)?)
            },
        )?;
    }
    Ok(())
}

/// With SingleRank, the parallel linears are exactly Linear: same weights for the same
/// seed and name, bitwise-equal outputs, input grads and param grads.
fn parallel_single_rank_equals_linear(dev: Device) -> TestResult {
    let init = test_init(7, dev);
    let x = tensor(&randn(8, 5 * 6), &[5, 6], dev)?;
    let dy = tensor(&randn(9, 5 * 4), &[5, 4], dev)?;
    let mut plain = Linear::new(&init, "p", 6, 4, true)?;
    let (y0, c) = plain.forward(&x)?;
    let dx0 = plain.backward(c, &dy)?;
    let want = (y0.to_vec_f32()?, dx0.to_vec_f32()?, grads(&plain)?);

    for gather in [false, true] {
        let mut col = ColumnParallelLinear::new(&init, "p", 6, 4, true, gather, single())?;
        assert_eq!(col.param_shapes(), plain.param_shapes());
        let (y, c) = col.forward(&x)?;
        let dx = col.backward(c, &dy)?;
        assert_eq!(
            (y.to_vec_f32()?, dx.to_vec_f32()?, grads(&col)?),
            want,
            "column gather={gather}"
        );
    }
    for parallel in [false, true] {
        let mut row = RowParallelLinear::new(&init, "p", 6, 4, true, parallel, single())?;
        assert_eq!(row.param_shapes(), plain.param_shapes());
        let (y, c) = row.forward(&x)?;
        let dx = row.backward(c, &dy)?;
        assert_eq!(
            (y.to_vec_f32()?, dx.to_vec_f32()?, grads(&row)?),
            want,
            "row parallel={parallel}"
        );
    }
    Ok(())
}

/// A frozen weight gets no grad buffer and no grad; the input grad does not change.
fn frozen_params_get_no_grad(dev: Device) -> TestResult {
    let x = tensor(&randn(10, 3 * 4), &[3, 4], dev)?;
    let dy = tensor(&randn(11, 3 * 5), &[3, 5], dev)?;
    let mut l = Linear::new(&test_init(12, dev), "p", 4, 5, true)?;
    let (_, c) = l.forward(&x)?;
    let dx_trainable = l.backward(c, &dy)?.to_vec_f32()?;
    l.freeze();
    let (_, c) = l.forward(&x)?;
    let dx_frozen = l.backward(c, &dy)?.to_vec_f32()?;
    assert_eq!(dx_frozen, dx_trainable);
    assert!(grads(&l)?.iter().all(|(_, g)| g.is_none()));
    // Only the bias frozen: the weight grad is still computed.
    l.unfreeze()?;
    l.bias.as_mut().ok_or("bias")?.freeze();
    let (_, c) = l.forward(&x)?;
    l.backward(c, &dy)?;
    let g = grads(&l)?;
    assert!(g[0].1.is_some() && g[1].1.is_none());
    Ok(())
}

/// Backward adds into the grads: two calls give twice one call.
fn grads_accumulate(dev: Device) -> TestResult {
    let x = tensor(&randn(13, 3 * 4), &[3, 4], dev)?;
    let dy = tensor(&randn(14, 3 * 2), &[3, 2], dev)?;
    let mut l = RowParallelLinear::new(&test_init(15, dev), "p", 4, 2, true, false, single())?;
    let (_, c) = l.forward(&x)?;
    l.backward(c, &dy)?;
    let once = grads(&l)?;
    let (_, c) = l.forward(&x)?;
    l.backward(c, &dy)?;
    for ((n, g1), (_, g2)) in once.iter().zip(grads(&l)?) {
        let twice: Vec<f32> = g1.as_ref().ok_or("grad")?.iter().map(|v| 2.0 * v).collect();
        braid_kernels::testing::assert_close(n, &g2.ok_or("grad")?, &twice, 1e-6, 1e-6);
    }
    l.zero_grads()?;
    assert!(
        grads(&l)?
            .iter()
            .all(|(_, g)| g.as_ref().is_some_and(|g| g.iter().all(|&v| v == 0.0)))
    );
    Ok(())
}

/// The TP shards of every rank, put back together, are the single-rank weights.
fn tp_shards_cover_the_full_weight(dev: Device) -> TestResult {
    let init = test_init(16, dev);
    let full = Linear::new(&init, "w", 6, 4, true)?;
    let (w, _) = param_host(&full, "w.weight")?; // (4, 6)
    let (b, _) = param_host(&full, "w.bias")?;
    let tp = 2;
    let (mut col_w, mut col_b) = (Vec::new(), Vec::new());
    for rank in 0..tp {
        let g: Arc<dyn Comm> = Arc::new(EchoRank { rank, size: tp });
        let col = ColumnParallelLinear::new(&init, "w", 6, 4, true, false, Arc::clone(&g))?;
        assert_eq!(
            col.param_shapes(),
            vec![("w.weight".into(), vec![2, 6]), ("w.bias".into(), vec![2])]
        );
        col_w.extend(param_host(&col, "w.weight")?.0);
        col_b.extend(param_host(&col, "w.bias")?.0);
        let row = RowParallelLinear::new(&init, "w", 6, 4, true, true, g)?;
        assert_eq!(
            row.param_shapes(),
            vec![("w.weight".into(), vec![4, 3]), ("w.bias".into(), vec![4])]
        );
        let rw = param_host(&row, "w.weight")?.0;
        for o in 0..4 {
            assert_eq!(
                &rw[o * 3..o * 3 + 3],
                &w[o * 6 + rank * 3..o * 6 + rank * 3 + 3]
            );
        }
        assert_eq!(
            param_host(&row, "w.bias")?.0,
            b,
            "the row-parallel bias is replicated"
        );
    }
    assert_eq!(col_w, w);
    assert_eq!(col_b, b);
    let err = ColumnParallelLinear::new(
        &init,
        "w",
        6,
        5,
        false,
        false,
        Arc::new(EchoRank { rank: 0, size: 2 }),
    )
    .expect_err("5 outputs over 2 ranks");
    assert!(
        err.to_string()
            .contains("5 features cannot be split evenly across a TP group of 2"),
        "{err}"
    );
    Ok(())
}

/// Last-dim split/gather for a group of 3 (EchoRank: every rank holds the same tensor,
/// shifted by 100 per rank in all-gathers).
fn regions_split_and_gather_last_dim(dev: Device) -> TestResult {
    let g = EchoRank { rank: 1, size: 3 };
    // (2, 6): row i = [10 i + j]
    let x: Vec<f32> = (0..12).map(|k| (10 * (k / 6) + k % 6) as f32).collect();
    let xt = tensor(&x, &[2, 6], dev)?;
    let s = scatter_to_tp_fwd(&g, &xt)?;
    assert_eq!(s.dims(), &[2, 2]);
    assert_eq!(s.to_vec_f32()?, vec![2.0, 3.0, 12.0, 13.0]);
    let s2 = gather_from_tp_bwd(&g, &xt)?;
    assert_eq!(s2.to_vec_f32()?, s.to_vec_f32()?);
    // gather (2, 2) -> (2, 6): [t_i, t_i + 100, t_i + 200] per row
    let part = tensor(&[1.0, 2.0, 3.0, 4.0], &[2, 2], dev)?;
    let gathered = gather_from_tp_fwd(&g, part.try_clone()?)?;
    assert_eq!(gathered.dims(), &[2, 6]);
    assert_eq!(
        gathered.to_vec_f32()?,
        vec![
            1.0, 2.0, 101.0, 102.0, 201.0, 202.0, 3.0, 4.0, 103.0, 104.0, 203.0, 204.0
        ]
    );
    assert_eq!(
        scatter_to_tp_bwd(&g, part)?.to_vec_f32()?,
        gathered.to_vec_f32()?
    );
    // A last dim that does not split is an error, not a panic.
    let bad = tensor(&[0.0; 4], &[1, 4], dev)?;
    let err = scatter_to_tp_fwd(&g, &bad).expect_err("4 columns over 3 ranks");
    assert!(
        err.to_string().contains("not a multiple of the TP size 3"),
        "{err}"
    );
    Ok(())
}

/// Two ranks as threads: column -> row parallel linears equal the single-rank pair.
fn tp2_column_row_matches_single_rank(dev: Device) -> TestResult {
    let init = test_init(17, dev);
    let x = randn(18, 3 * 4);
    let dy = randn(19, 3 * 4);
    let run = |g: Arc<dyn Comm>| -> TestResult<Outcome> {
        let mut fc1 = ColumnParallelLinear::new(&init, "fc1", 4, 8, true, false, Arc::clone(&g))?;
        let mut fc2 = RowParallelLinear::new(&init, "fc2", 8, 4, true, true, g)?;
        let (h, c1) = fc1.forward(&tensor(&x, &[3, 4], dev)?)?;
        let (y, c2) = fc2.forward(&h)?;
        let dh = fc2.backward(c2, &tensor(&dy, &[3, 4], dev)?)?;
        let dx = fc1.backward(c1, &dh)?;
        let mut g = grads(&fc1)?;
        g.extend(grads(&fc2)?);
        Ok((y.to_vec_f32()?, dx.to_vec_f32()?, g))
    };
    let (y, dx, g) = run(single())?;
    let results = run_on_ranks(2, |r| run(Arc::new(r)).map_err(|e| e.to_string()));
    let mut fc1_w = Vec::new();
    for r in results {
        let (ry, rdx, rg) = r?;
        braid_kernels::testing::assert_close("tp2 y", &ry, &y, 1e-5, 1e-5);
        braid_kernels::testing::assert_close("tp2 dx", &rdx, &dx, 1e-5, 1e-5);
        fc1_w.extend(rg[0].1.clone().ok_or("grad")?);
        // fc2's bias grad is the full one on every rank.
        braid_kernels::testing::assert_close(
            "tp2 fc2.bias",
            rg[3].1.as_ref().ok_or("grad")?,
            g[3].1.as_ref().ok_or("grad")?,
            1e-6,
            1e-6,
        );
    }
    braid_kernels::testing::assert_close(
        "tp2 fc1.weight grad",
        &fc1_w,
        g[0].1.as_ref().ok_or("grad")?,
        1e-6,
        1e-6,
    );
    Ok(())
}

/// Same seed -> same weights bitwise; another seed or name -> other weights.
fn init_is_deterministic_by_seed_and_name(dev: Device) -> TestResult {
    let a = Linear::new(&Init::new(1, dev), "a", 8, 8, false)?;
    let b = Linear::new(&Init::new(1, dev), "a", 8, 8, false)?;
    let c = Linear::new(&Init::new(2, dev), "a", 8, 8, false)?;
    let d = Linear::new(&Init::new(1, dev), "b", 8, 8, false)?;
    let w = |l: &Linear| param_host(l, &format!("{}.weight", l.name)).map(|p| p.0);
    assert_eq!(w(&a)?, w(&b)?);
    assert_ne!(w(&a)?, w(&c)?);
    assert_ne!(w(&a)?, w(&d)?);
    let std = (w(&a)?.iter().map(|v| v * v).sum::<f32>() / 64.0).sqrt();
    assert!(
        (0.01..0.03).contains(&std),
        "init std {std}, expected about 0.02"
    );
    Ok(())
}

/// Layers on a device this machine cannot use fail with a clear error, not a panic.
#[test]
fn cuda_without_a_driver_is_a_clear_error() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        return; // a GPU machine: the layer tests run on it as `<name>::cuda`
    }
    let err = Linear::new(&Init::new(1, Device::Cuda(0)), "lm_head", 4, 4, false)
        .expect_err("no CUDA backend");
    let msg = err.to_string();
    assert!(
        msg.contains("lm_head.weight") && msg.contains("cuda:0") && msg.contains("not available"),
        "{msg}"
    );
}

fn shape_errors_name_the_layer(dev: Device) -> TestResult {
    let l = Linear::new(&test_init(1, dev), "blocks.0.mlp.fc1", 4, 4, false)?;
    let err = l
        .forward(&Tensor::zeros([2, 3], braid_kernels::DType::F32, dev)?)
        .expect_err("3 != 4 features");
    let msg = err.to_string();
    assert!(
        msg.starts_with("blocks.0.mlp.fc1: forward: linear_fwd: shape mismatch"),
        "{msg}"
    );
    Ok(())
}

braid_kernels::test_on_devices!(
    linear_grads,
    column_parallel_grads,
    row_parallel_grads,
    parallel_single_rank_equals_linear,
    frozen_params_get_no_grad,
    grads_accumulate,
    tp_shards_cover_the_full_weight,
    regions_split_and_gather_last_dim,
    tp2_column_row_matches_single_rank,
    init_is_deterministic_by_seed_and_name,
    shape_errors_name_the_layer,
);
