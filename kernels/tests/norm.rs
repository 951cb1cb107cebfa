//! LayerNorm and RMSNorm: forward against an f64 reference, backward by finite
//! differences for x, w and b, `+=` into parameter grads, errors, determinism.

use braid_kernels::assert_err;
use braid_kernels::ops::{self, layer_norm_bwd, layer_norm_fwd, rms_norm_bwd, rms_norm_fwd};
use braid_kernels::rng::Rng;
use braid_kernels::testing::in_pool;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, dot};
use braid_kernels::{DType, Device, Error, Result, Tensor};

fn tensor(v: &[f32], shape: &[usize], dev: Device) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape, dev)
}

/// LayerNorm in f64: (y, mean, rstd).
fn ln_ref(x: &[f32], w: &[f32], b: Option<&[f32]>, eps: f32) -> (Vec<f32>, Vec<f32>, Vec<f32>) {
    let c = w.len();
    let (mut y, mut means, mut rstds) = (vec![], vec![], vec![]);
    for row in x.chunks(c) {
        let mean = row.iter().map(|&v| v as f64).sum::<f64>() / c as f64;
        let var = row.iter().map(|&v| (v as f64 - mean).powi(2)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (var + eps as f64).sqrt();
        for j in 0..c {
            let bj = b.map_or(0.0, |b| b[j] as f64);
            y.push(((row[j] as f64 - mean) * rstd * w[j] as f64 + bj) as f32);
        }
        means.push(mean as f32);
        rstds.push(rstd as f32);
    }
    (y, means, rstds)
}

/// RMSNorm in f64: (y, rstd).
fn rms_ref(x: &[f32], w: &[f32], eps: f32) -> (Vec<f32>, Vec<f32>) {
    let c = w.len();
    let (mut y, mut rstds) = (vec![], vec![]);
    for row in x.chunks(c) {
        let ms = row.iter().map(|&v| (v as f64).powi(2)).sum::<f64>() / c as f64;
        let rstd = 1.0 / (ms + eps as f64).sqrt();
        for j in 0..c {
            y.push((row[j] as f64 * rstd * w[j] as f64) as f32);
        }
        rstds.push(rstd as f32);
    }
    (y, rstds)
}

fn layer_norm_fwd_matches_reference(dev: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    let (c, eps) = (7, 1e-5);
    // Rows with a non-zero mean and different scales.
    let x: Vec<f32> = rng
        .normal_vec(2 * 3 * c, 2.0)
        .iter()
        .enumerate()
        .map(|(i, v)| v + (i / c) as f32 - 2.0)
        .collect();
    let w = rng.normal_vec(c, 1.0);
    let b = rng.normal_vec(c, 1.0);
    let xt = tensor(&x, &[2, 3, c], dev)?;
    let (wt, bt) = (tensor(&w, &[c], dev)?, tensor(&b, &[c], dev)?);
    for bias in [true, false] {
        let (y, mean, rstd) = layer_norm_fwd(&xt, &wt, bias.then_some(&bt), eps)?;
        assert_eq!(y.dims(), &[2, 3, c]);
        assert_eq!(mean.dims(), &[6]);
        assert_eq!(rstd.dims(), &[6]);
        let (yr, mr, rr) = ln_ref(&x, &w, bias.then_some(&b[..]), eps);
        assert_close("ln y", &y.to_vec_f32()?, &yr, 1e-5, 1e-5);
        assert_close("ln mean", &mean.to_vec_f32()?, &mr, 1e-6, 1e-6);
        assert_close("ln rstd", &rstd.to_vec_f32()?, &rr, 1e-6, 1e-6);
    }
    // Rank 1: one row.
    let (y, mean, _) = layer_norm_fwd(&tensor(&x[..c], &[c], dev)?, &wt, Some(&bt), eps)?;
    assert_eq!((y.dims(), mean.dims()), (&[c][..], &[1][..]));
    Ok(())
}

/// |mean| >> std: a one-pass E[x^2] - E[x]^2 would lose every digit of the variance.
fn layer_norm_stats_accurate_with_large_mean(dev: Device) -> Result<()> {
    let c = 64;
    let mut rng = Rng::new(2);
    let x: Vec<f32> = rng.normal_vec(c, 1.0).iter().map(|v| 1e4 + v).collect();
    let w = vec![1.0; c];
    let (y, _, rstd) = layer_norm_fwd(
        &tensor(&x, &[1, c], dev)?,
        &tensor(&w, &[c], dev)?,
        None,
        0.0,
    )?;
    let (yr, _, rr) = ln_ref(&x, &w, None, 0.0);
    assert_close("rstd", &rstd.to_vec_f32()?, &rr, 0.0, 1e-6);
    assert_close("y", &y.to_vec_f32()?, &yr, 1e-3, 1e-3);
    Ok(())
}

fn layer_norm_bwd_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    let (n, c, eps) = (3, 5, 1e-5);
    let x = rng.normal_vec(n * c, 1.0);
    let w = rng.normal_vec(c, 1.0);
    let b = rng.normal_vec(c, 1.0);
    let r = rng.normal_vec(n * c, 1.0);
    let (xt, wt, bt) = (
        tensor(&x, &[n, c], dev)?,
        tensor(&w, &[c], dev)?,
        tensor(&b, &[c], dev)?,
    );
    let (_, mean, rstd) = layer_norm_fwd(&xt, &wt, Some(&bt), eps)?;
    let mut dw = Tensor::zeros([c], DType::F32, dev)?;
    let mut db = Tensor::zeros([c], DType::F32, dev)?;
    let dy = tensor(&r, &[n, c], dev)?;
    let dx = layer_norm_bwd(&dy, &xt, &wt, &mean, &rstd, Some(&mut dw), Some(&mut db))?;
    let loss = |x: &[f32], w: &[f32], b: &[f32]| -> Result<f64> {
        let (y, _, _) = layer_norm_fwd(
            &tensor(x, &[n, c], dev)?,
            &tensor(w, &[c], dev)?,
            Some(&tensor(b, &[c], dev)?),
            eps,
        )?;
        Ok(dot(&y.to_vec_f32()?, &r))
    };
    let tol = FdTolerance::default();
    check_grad("ln dx", &x, &dx.to_vec_f32()?, tol, |xp| loss(xp, &w, &b))?;
    check_grad("ln dw", &w, &dw.to_vec_f32()?, tol, |wp| loss(&x, wp, &b))?;
    check_grad("ln db", &b, &db.to_vec_f32()?, tol, |bp| loss(&x, &w, bp))?;
    // Without parameter grads dx is the same.
    let dx2 = layer_norm_bwd(&dy, &xt, &wt, &mean, &rstd, None, None)?;
    assert_eq!(dx.to_vec_f32()?, dx2.to_vec_f32()?);
    Ok(())
}

fn layer_norm_bwd_accumulates(dev: Device) -> Result<()> {
    let mut rng = Rng::new(4);
    let (n, c) = (4, 6);
    let xt = Tensor::randn([n, c], 1.0, &mut rng, dev)?;
    let wt = Tensor::randn([c], 1.0, &mut rng, dev)?;
    let dy = Tensor::randn([n, c], 1.0, &mut rng, dev)?;
    let (_, mean, rstd) = layer_norm_fwd(&xt, &wt, None, 1e-5)?;
    let mut dw0 = Tensor::zeros([c], DType::F32, dev)?;
    let mut db0 = Tensor::zeros([c], DType::F32, dev)?;
    layer_norm_bwd(&dy, &xt, &wt, &mean, &rstd, Some(&mut dw0), Some(&mut db0))?;
    let prev_w = rng.normal_vec(c, 1.0);
    let prev_b = rng.normal_vec(c, 1.0);
    let mut dw = tensor(&prev_w, &[c], dev)?;
    let mut db = tensor(&prev_b, &[c], dev)?;
    layer_norm_bwd(&dy, &xt, &wt, &mean, &rstd, Some(&mut dw), Some(&mut db))?;
    let sum = |p: &[f32], g: &[f32]| -> Vec<f32> { p.iter().zip(g).map(|(a, b)| a + b).collect() };
    assert_eq!(dw.to_vec_f32()?, sum(&prev_w, &dw0.to_vec_f32()?));
    assert_eq!(db.to_vec_f32()?, sum(&prev_b, &db0.to_vec_f32()?));
    Ok(())
}

fn layer_norm_errors(dev: Device) -> Result<()> {
    let x = Tensor::full(1.0, [2, 4], dev)?;
    let w = Tensor::full(1.0, [4], dev)?;
    let w3 = Tensor::full(1.0, [3], dev)?;
    assert_err!(layer_norm_fwd(&x, &w3, None, 1e-5), Error::Shape { .. });
    assert_err!(layer_norm_fwd(&x, &w, Some(&w3), 1e-5), Error::Shape { .. });
    let scalar = Tensor::full(1.0, (), dev)?;
    assert_err!(layer_norm_fwd(&scalar, &w, None, 1e-5), Error::Shape { .. });
    let empty = Tensor::zeros([2, 0], DType::F32, dev)?;
    let w0 = Tensor::zeros([0], DType::F32, dev)?;
    assert_err!(layer_norm_fwd(&empty, &w0, None, 1e-5), Error::Shape { .. });
    assert_err!(layer_norm_fwd(&x, &w, None, -1e-5), Error::Invalid { .. });
    assert_err!(
        layer_norm_fwd(&x, &w, None, f32::NAN),
        Error::Invalid { .. }
    );
    let ids = Tensor::from_vec_u32(vec![0; 8], [2, 4], dev)?;
    assert_err!(layer_norm_fwd(&ids, &w, None, 1e-5), Error::DType { .. });
    let xb = ops::cast(&x, DType::BF16)?;
    let wb = ops::cast(&w, DType::BF16)?;
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(layer_norm_fwd(&xb, &wb, None, 1e-5).is_ok());
    assert_err!(layer_norm_fwd(&xb, &w, None, 1e-5), Error::DType { .. });

    let (_, mean, rstd) = layer_norm_fwd(&x, &w, None, 1e-5)?;
    let dy_bad = Tensor::full(1.0, [2, 3], dev)?;
    assert_err!(
        layer_norm_bwd(&dy_bad, &x, &w, &mean, &rstd, None, None),
        Error::Shape { .. }
    );
    let mean_bad = Tensor::full(0.0, [3], dev)?;
    assert_err!(
        layer_norm_bwd(&x, &x, &w, &mean_bad, &rstd, None, None),
        Error::Shape { .. }
    );
    let mean_bf = ops::cast(&mean, DType::BF16)?;
    assert_err!(
        layer_norm_bwd(&x, &x, &w, &mean_bf, &rstd, None, None),
        Error::DType { .. }
    );
    let mut dw_bad = Tensor::zeros([5], DType::F32, dev)?;
    assert_err!(
        layer_norm_bwd(&x, &x, &w, &mean, &rstd, Some(&mut dw_bad), None),
        Error::Shape { .. }
    );
    let mut db_u32 = Tensor::zeros([4], DType::U32, dev)?;
    assert_err!(
        layer_norm_bwd(&x, &x, &w, &mean, &rstd, None, Some(&mut db_u32)),
        Error::DType { .. }
    );
    // bf16 inputs: dx in bf16, parameter grads into f32 (mixed precision) or bf16.
    let mut dw32 = Tensor::zeros([4], DType::F32, dev)?;
    let dx = layer_norm_bwd(&xb, &xb, &wb, &mean, &rstd, Some(&mut dw32), None)?;
    assert_eq!(dx.dtype(), DType::BF16);
    let mut dw_u32 = Tensor::zeros([4], DType::U32, dev)?;
    assert_err!(
        layer_norm_bwd(&xb, &xb, &wb, &mean, &rstd, Some(&mut dw_u32), None),
        Error::DType { .. }
    );
    Ok(())
}

fn rms_norm_fwd_matches_reference(dev: Device) -> Result<()> {
    let mut rng = Rng::new(5);
    let (c, eps) = (9, 1e-6);
    let x: Vec<f32> = rng.normal_vec(4 * c, 1.5).iter().map(|v| v + 0.5).collect();
    let w = rng.normal_vec(c, 1.0);
    let (y, rstd) = rms_norm_fwd(&tensor(&x, &[2, 2, c], dev)?, &tensor(&w, &[c], dev)?, eps)?;
    assert_eq!((y.dims(), rstd.dims()), (&[2, 2, c][..], &[4][..]));
    let (yr, rr) = rms_ref(&x, &w, eps);
    assert_close("rms y", &y.to_vec_f32()?, &yr, 1e-5, 1e-5);
    assert_close("rms rstd", &rstd.to_vec_f32()?, &rr, 1e-6, 1e-6);
    Ok(())
}

fn rms_norm_bwd_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(6);
    let (n, c, eps) = (3, 5, 1e-6);
    let x = rng.normal_vec(n * c, 1.0);
    let w = rng.normal_vec(c, 1.0);
    let r = rng.normal_vec(n * c, 1.0);
    let (xt, wt) = (tensor(&x, &[n, c], dev)?, tensor(&w, &[c], dev)?);
    let (_, rstd) = rms_norm_fwd(&xt, &wt, eps)?;
    let mut dw = Tensor::zeros([c], DType::F32, dev)?;
    let dy = tensor(&r, &[n, c], dev)?;
    let dx = rms_norm_bwd(&dy, &xt, &wt, &rstd, Some(&mut dw))?;
    let loss = |x: &[f32], w: &[f32]| -> Result<f64> {
        let (y, _) = rms_norm_fwd(&tensor(x, &[n, c], dev)?, &tensor(w, &[c], dev)?, eps)?;
        Ok(dot(&y.to_vec_f32()?, &r))
    };
    let tol = FdTolerance::default();
    check_grad("rms dx", &x, &dx.to_vec_f32()?, tol, |xp| loss(xp, &w))?;
    check_grad("rms dw", &w, &dw.to_vec_f32()?, tol, |wp| loss(&x, wp))?;
    let dx2 = rms_norm_bwd(&dy, &xt, &wt, &rstd, None)?;
    assert_eq!(dx.to_vec_f32()?, dx2.to_vec_f32()?);
    Ok(())
}

fn rms_norm_bwd_accumulates(dev: Device) -> Result<()> {
    let mut rng = Rng::new(7);
    let (n, c) = (4, 6);
    let xt = Tensor::randn([n, c], 1.0, &mut rng, dev)?;
    let wt = Tensor::randn([c], 1.0, &mut rng, dev)?;
    let dy = Tensor::randn([n, c], 1.0, &mut rng, dev)?;
    let (_, rstd) = rms_norm_fwd(&xt, &wt, 1e-6)?;
    let mut dw0 = Tensor::zeros([c], DType::F32, dev)?;
    rms_norm_bwd(&dy, &xt, &wt, &rstd, Some(&mut dw0))?;
    let prev = rng.normal_vec(c, 1.0);
    let mut dw = tensor(&prev, &[c], dev)?;
    rms_norm_bwd(&dy, &xt, &wt, &rstd, Some(&mut dw))?;
    let want: Vec<f32> = prev
        .iter()
        .zip(dw0.to_vec_f32()?)
        .map(|(a, b)| a + b)
        .collect();
    assert_eq!(dw.to_vec_f32()?, want);
    Ok(())
}

fn rms_norm_errors(dev: Device) -> Result<()> {
    let x = Tensor::full(1.0, [2, 4], dev)?;
    let w = Tensor::full(1.0, [4], dev)?;
    let w3 = Tensor::full(1.0, [3], dev)?;
    assert_err!(rms_norm_fwd(&x, &w3, 1e-6), Error::Shape { .. });
    assert_err!(rms_norm_fwd(&x, &w, -1.0), Error::Invalid { .. });
    assert_err!(rms_norm_fwd(&x, &w, f32::INFINITY), Error::Invalid { .. });
    let ids = Tensor::from_vec_u32(vec![0; 4], [4], dev)?;
    assert_err!(rms_norm_fwd(&x, &ids, 1e-6), Error::DType { .. });
    let xb = ops::cast(&x, DType::BF16)?;
    let wb = ops::cast(&w, DType::BF16)?;
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(rms_norm_fwd(&xb, &wb, 1e-6).is_ok());
    let (_, rstd) = rms_norm_fwd(&x, &w, 1e-6)?;
    let dy_bad = Tensor::full(1.0, [4, 2], dev)?;
    assert_err!(
        rms_norm_bwd(&dy_bad, &x, &w, &rstd, None),
        Error::Shape { .. }
    );
    let rstd_bad = Tensor::full(1.0, [2, 1], dev)?;
    assert_err!(
        rms_norm_bwd(&x, &x, &w, &rstd_bad, None),
        Error::Shape { .. }
    );
    let mut dw_bad = Tensor::zeros([2, 2], DType::F32, dev)?;
    assert_err!(
        rms_norm_bwd(&x, &x, &w, &rstd, Some(&mut dw_bad)),
        Error::Shape { .. }
    );
    // bf16 inputs: dx in bf16, dw into f32 (mixed precision); an f32 dy with bf16 x is
    // a mistake.
    let mut dw32 = Tensor::zeros([4], DType::F32, dev)?;
    let dx = rms_norm_bwd(&xb, &xb, &wb, &rstd, Some(&mut dw32))?;
    assert_eq!(dx.dtype(), DType::BF16);
    assert_err!(rms_norm_bwd(&x, &xb, &wb, &rstd, None), Error::DType { .. });
    Ok(())
}

/// Everything a norm produces, as host vectors, for bitwise comparison.
fn norm_outputs(x: &Tensor, w: &Tensor, b: &Tensor, dy: &Tensor) -> Result<Vec<Vec<f32>>> {
    let (y, mean, rstd) = layer_norm_fwd(x, w, Some(b), 1e-5)?;
    let mut dw = Tensor::full(0.5, w.dims(), x.device())?;
    let mut db = Tensor::full(0.5, w.dims(), x.device())?;
    let dx = layer_norm_bwd(dy, x, w, &mean, &rstd, Some(&mut dw), Some(&mut db))?;
    let (ry, rrstd) = rms_norm_fwd(x, w, 1e-6)?;
    let mut rdw = Tensor::full(0.5, w.dims(), x.device())?;
    let rdx = rms_norm_bwd(dy, x, w, &rrstd, Some(&mut rdw))?;
    [y, mean, rstd, dx, dw, db, ry, rrstd, rdx, rdw]
        .iter()
        .map(|t| t.to_vec_f32())
        .collect()
}

fn norms_deterministic_across_threads(dev: Device) -> Result<()> {
    let mut rng = Rng::new(8);
    let (n, c) = (384, 200);
    let x = Tensor::randn([n, c], 1.0, &mut rng, dev)?;
    let w = Tensor::randn([c], 1.0, &mut rng, dev)?;
    let b = Tensor::randn([c], 1.0, &mut rng, dev)?;
    let dy = Tensor::randn([n, c], 1.0, &mut rng, dev)?;
    let one = in_pool(1, || norm_outputs(&x, &w, &b, &dy))?;
    let four = in_pool(4, || norm_outputs(&x, &w, &b, &dy))?;
    let again = norm_outputs(&x, &w, &b, &dy)?;
    assert!(
        one == four && four == again,
        "norm outputs depend on the thread count"
    );
    Ok(())
}

/// A call of few rows (run on the calling thread) gives the same rows, bit for bit, as
/// one of many (split over rayon's pool), and the big call matches the f64 reference.
fn few_rows_and_many_rows_agree(dev: Device) -> Result<()> {
    let mut rng = Rng::new(9);
    let (n, few, c) = (1024, 8, 64); // 64K values: several pool tasks; 8 rows: one call
    let x = rng.normal_vec(n * c, 1.5);
    let dy = rng.normal_vec(n * c, 1.0);
    let (w, b) = (rng.normal_vec(c, 1.0), rng.normal_vec(c, 1.0));
    let (wt, bt) = (tensor(&w, &[c], dev)?, tensor(&b, &[c], dev)?);
    let rows = |v: &[f32], k: usize| tensor(&v[..k * c], &[k, c], dev);
    let outputs = |k: usize| -> Result<Vec<Vec<f32>>> {
        let (xt, dyt) = (rows(&x, k)?, rows(&dy, k)?);
        let (y, mean, rstd) = layer_norm_fwd(&xt, &wt, Some(&bt), 1e-5)?;
        let dx = layer_norm_bwd(&dyt, &xt, &wt, &mean, &rstd, None, None)?;
        let (ry, rrstd) = rms_norm_fwd(&xt, &wt, 1e-6)?;
        let rdx = rms_norm_bwd(&dyt, &xt, &wt, &rrstd, None)?;
        [y, dx, ry, rdx].iter().map(|t| t.to_vec_f32()).collect()
    };
    let (small, big) = (outputs(few)?, outputs(n)?);
    for (i, (s, b)) in small.iter().zip(&big).enumerate() {
        assert!(
            s[..] == b[..few * c],
            "output {i}: the first {few} rows differ"
        );
    }
    let (want_y, _, _) = ln_ref(&x, &w, Some(&b), 1e-5);
    assert_close("layer_norm (1024 rows)", &big[0], &want_y, 1e-5, 1e-5);
    let (want_ry, _) = rms_ref(&x, &w, 1e-6);
    assert_close("rms_norm (1024 rows)", &big[2], &want_ry, 1e-5, 1e-5);
    Ok(())
}

braid_kernels::test_on_devices!(
    layer_norm_fwd_matches_reference,
    layer_norm_stats_accurate_with_large_mean,
    layer_norm_bwd_finite_differences,
    layer_norm_bwd_accumulates,
    layer_norm_errors,
    rms_norm_fwd_matches_reference,
    rms_norm_bwd_finite_differences,
    rms_norm_bwd_accumulates,
    rms_norm_errors,
    norms_deterministic_across_threads,
    few_rows_and_many_rows_agree,
);
