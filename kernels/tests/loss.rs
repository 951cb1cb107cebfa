//! Fused softmax cross-entropy: losses against an f64 reference, dlogits by finite
//! differences of `grad_scale * sum(losses)`, ignore_index, stability, errors,
//! determinism.

use braid_kernels::ops;
use braid_kernels::rng::Rng;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad};
use braid_kernels::{DType, Device, Error, Result, Tensor};

/// `-log softmax(x)[t]` per row in f64 (0 for ignored rows), with the max subtracted.
fn ce_ref(x: &[f32], t: &[u32], v: usize, ignore: u32) -> Vec<f32> {
    t.iter()
        .enumerate()
        .map(|(n, &tg)| {
            if tg == ignore {
                return 0.0;
            }
            let row: Vec<f64> = x[n * v..(n + 1) * v]
                .iter()
                .map(|&a| f64::from(a))
                .collect();
            let mx = row.iter().copied().fold(f64::NEG_INFINITY, f64::max);
            let lse = mx + row.iter().map(|a| (a - mx).exp()).sum::<f64>().ln();
            (lse - row[tg as usize]) as f32
        })
        .collect()
}

fn ce_host(
    dev: Device,
    x: &[f32],
    t: &[u32],
    v: usize,
    ignore: u32,
    scale: f32,
) -> Result<(Vec<f32>, Vec<f32>)> {
    let n = t.len();
    let (l, d) = ops::cross_entropy_fwd_bwd(
        &Tensor::from_vec(x.to_vec(), [n, v], dev)?,
        &Tensor::from_vec_u32(t.to_vec(), [n], dev)?,
        ignore,
        scale,
    )?;
    assert_eq!(l.dims(), &[n]);
    assert_eq!(d.dims(), &[n, v]);
    Ok((l.to_vec_f32()?, d.to_vec_f32()?))
}

const IGNORE: u32 = u32::MAX;

fn cross_entropy_forward_matches_reference(dev: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    for (n, v) in [(1, 1), (5, 7), (16, 300), (3, 50_000)] {
        let x = rng.normal_vec(n * v, 3.0);
        let mut t = rng.index_vec(n, v as u32);
        if n > 2 {
            t[1] = IGNORE;
        }
        let (l, _) = ce_host(dev, &x, &t, v, IGNORE, 1.0)?;
        assert_close(
            &format!("losses n{n} v{v}"),
            &l,
            &ce_ref(&x, &t, v, IGNORE),
            1e-5,
            1e-5,
        );
    }
    Ok(())
}

/// dlogits = d(grad_scale * sum(losses)) / dlogits, by central differences, with an
/// ignored row (its grad must be exactly 0) and a grad_scale that is not 1.
fn cross_entropy_grad_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(2);
    let (n, v, scale) = (4, 6, 0.37f32);
    let x = rng.normal_vec(n * v, 1.5);
    let t = vec![2, IGNORE, 5, 0];
    let (_, d) = ce_host(dev, &x, &t, v, IGNORE, scale)?;
    assert!(
        d[v..2 * v].iter().all(|&g| g == 0.0),
        "ignored row has a grad"
    );
    check_grad("dlogits", &x, &d, FdTolerance::default(), |xp| {
        let (l, _) = ce_host(dev, xp, &t, v, IGNORE, scale)?;
        Ok(f64::from(scale) * l.iter().map(|&a| f64::from(a)).sum::<f64>())
    })?;
    // Each valid row's grad sums to 0 (softmax sums to 1, minus the one-hot).
    for row in d.chunks(v) {
        assert!(row.iter().sum::<f32>().abs() < 1e-6);
    }
    Ok(())
}

/// ignore_index may be a real class id: those rows are skipped, others use it normally.
fn cross_entropy_ignore_index_inside_vocab(dev: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    let (v, ignore) = (5, 0u32);
    let x = rng.normal_vec(3 * v, 1.0);
    let t = vec![0, 3, 0];
    let (l, d) = ce_host(dev, &x, &t, v, ignore, 1.0)?;
    assert_eq!(l[0], 0.0);
    assert_eq!(l[2], 0.0);
    assert!(l[1] > 0.0);
    assert!(d[..v].iter().chain(&d[2 * v..]).all(|&g| g == 0.0));
    assert_close("loss row 1", &l, &ce_ref(&x, &t, v, ignore), 1e-6, 1e-6);
    Ok(())
}

/// Logits of 1e4 (which overflow a naive exp) give the same losses and grads as the
/// same logits shifted to 0: the log-sum-exp subtracts the max.
fn cross_entropy_is_stable(dev: Device) -> Result<()> {
    let mut rng = Rng::new(4);
    let (n, v) = (3, 8);
    let x = rng.normal_vec(n * v, 1.0);
    let big: Vec<f32> = x.iter().map(|a| a + 1e4).collect();
    let t = vec![1, 7, 4];
    let (l0, d0) = ce_host(dev, &x, &t, v, IGNORE, 1.0)?;
    let (l1, d1) = ce_host(dev, &big, &t, v, IGNORE, 1.0)?;
    assert!(l1.iter().chain(&d1).all(|a| a.is_finite()));
    // 1e4 + x is rounded to f32 (ulp 1e-3), so compare with that tolerance.
    assert_close("shifted losses", &l1, &l0, 5e-3, 0.0);
    assert_close("shifted grads", &d1, &d0, 5e-3, 0.0);
    // A confidently right row: loss ~ 0, not NaN.
    let mut sharp = vec![-50.0f32; v];
    sharp[3] = 50.0;
    let (l, d) = ce_host(dev, &sharp, &[3], v, IGNORE, 1.0)?;
    assert!(l[0] >= 0.0 && l[0] < 1e-6, "loss {}", l[0]);
    assert!(d.iter().all(|g| g.is_finite() && g.abs() < 1e-6));
    Ok(())
}

fn cross_entropy_errors(dev: Device) -> Result<()> {
    let x = Tensor::zeros([4, 5], DType::F32, dev)?;
    let t = Tensor::from_vec_u32(vec![0, 1, 2, 3], [4], dev)?;
    // Out-of-range target: Invalid, naming the first bad row.
    let t_bad = Tensor::from_vec_u32(vec![0, 1, 5, 9], [4], dev)?;
    match ops::cross_entropy_fwd_bwd(&x, &t_bad, IGNORE, 1.0) {
        Err(Error::Invalid { msg, .. }) => assert!(msg.contains("targets[2]"), "{msg}"),
        other => panic!("expected Invalid, got {other:?}"),
    }
    // ... but not when that row is the ignored one.
    assert!(
        ops::cross_entropy_fwd_bwd(
            &x,
            &Tensor::from_vec_u32(vec![0, 9, 1, 9], [4], dev)?,
            9,
            1.0
        )
        .is_ok()
    );
    // Shapes.
    let t3 = Tensor::from_vec_u32(vec![0, 1, 2], [3], dev)?;
    assert!(matches!(
        ops::cross_entropy_fwd_bwd(&x, &t3, IGNORE, 1.0),
        Err(Error::Shape { .. })
    ));
    let x1 = Tensor::zeros([20], DType::F32, dev)?;
    assert!(matches!(
        ops::cross_entropy_fwd_bwd(&x1, &t, IGNORE, 1.0),
        Err(Error::Shape { .. })
    ));
    let x0 = Tensor::zeros([4, 0], DType::F32, dev)?;
    assert!(matches!(
        ops::cross_entropy_fwd_bwd(&x0, &t, IGNORE, 1.0),
        Err(Error::Shape { .. })
    ));
    // Dtypes: f32 targets, u32 logits.
    let tf = Tensor::zeros([4], DType::F32, dev)?;
    assert!(matches!(
        ops::cross_entropy_fwd_bwd(&x, &tf, IGNORE, 1.0),
        Err(Error::DType { .. })
    ));
    let xu = Tensor::from_vec_u32(vec![0; 20], [4, 5], dev)?;
    assert!(matches!(
        ops::cross_entropy_fwd_bwd(&xu, &t, IGNORE, 1.0),
        Err(Error::DType { .. })
    ));
    // Values.
    assert!(matches!(
        ops::cross_entropy_fwd_bwd(&x, &t, IGNORE, f32::NAN),
        Err(Error::Invalid { .. })
    ));
    Ok(())
}

fn cross_entropy_deterministic(dev: Device) -> Result<()> {
    let mut rng = Rng::new(5);
    let (n, v) = (64, 1000);
    let x = rng.normal_vec(n * v, 2.0);
    let mut t = rng.index_vec(n, v as u32);
    t[7] = IGNORE;
    let run = || ce_host(dev, &x, &t, v, IGNORE, 1.0 / 63.0);
    let first = run()?;
    assert_eq!(first, run()?);
    let pool = pool(1)?;
    assert_eq!(first, pool.install(run)?);
    Ok(())
}

/// A rayon pool of `threads` threads, to show results do not depend on the count.
fn pool(threads: usize) -> Result<rayon::ThreadPool> {
    rayon::ThreadPoolBuilder::new()
        .num_threads(threads)
        .build()
        .map_err(|e| Error::invalid("test", e.to_string()))
}

braid_kernels::test_on_devices!(
    cross_entropy_forward_matches_reference,
    cross_entropy_grad_finite_differences,
    cross_entropy_ignore_index_inside_vocab,
    cross_entropy_is_stable,
    cross_entropy_errors,
    cross_entropy_deterministic,
);
