//! The already-implemented basic ops: add / add_assign / scale_assign / sum_squares /
//! global_norm / cast, and matmul / matmul_into / linear_fwd / linear_bwd — forward
//! against plain loops (every transpose, batched and broadcast), linear backward by
//! finite differences, `+=` accumulation, error cases, determinism.

use braid_kernels::ops;
use braid_kernels::rng::Rng;
use braid_kernels::testing::thread_pool;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, dot};
use braid_kernels::{DType, Device, Error, Result, Tensor};

// ---- elementwise ----

fn add_and_assign_match_loops(dev: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    for n in [1usize, 7, 40_000] {
        let a = rng.normal_vec(n, 1.0);
        let b = rng.normal_vec(n, 1.0);
        let sum: Vec<f32> = a.iter().zip(&b).map(|(x, y)| x + y).collect();
        let at = Tensor::from_vec(a.clone(), [n], dev)?;
        let bt = Tensor::from_vec(b.clone(), [n], dev)?;
        assert_eq!(ops::add(&at, &bt)?.to_vec_f32()?, sum, "add n{n}");
        let mut acc = at.try_clone()?;
        ops::add_assign(&mut acc, &bt)?;
        assert_eq!(acc.to_vec_f32()?, sum, "add_assign n{n}");
        ops::scale_assign(&mut acc, -0.5)?;
        let scaled: Vec<f32> = sum.iter().map(|x| x * -0.5).collect();
        assert_eq!(acc.to_vec_f32()?, scaled, "scale_assign n{n}");
    }
    // Rank is kept.
    let a = Tensor::full(1.0, [2, 3], dev)?;
    assert_eq!(ops::add(&a, &a)?.dims(), &[2, 3]);
    Ok(())
}

fn sum_squares_and_global_norm(dev: Device) -> Result<()> {
    let mut rng = Rng::new(2);
    let mut tensors = Vec::new();
    let mut total = 0.0f64;
    for n in [3usize, 16_384, 100_001] {
        let x = rng.normal_vec(n, 2.0);
        let want: f64 = x.iter().map(|&a| f64::from(a) * f64::from(a)).sum();
        let t = Tensor::from_vec(x, [n], dev)?;
        let got = ops::sum_squares(&t)?;
        assert!(
            (got - want).abs() <= 1e-12 * want,
            "sum_squares n{n}: {got} vs {want}"
        );
        total += want;
        tensors.push(t);
    }
    let norm = ops::global_norm(&tensors)?;
    assert!((norm - total.sqrt()).abs() <= 1e-12 * total.sqrt());
    assert_eq!(ops::global_norm(std::iter::empty::<&Tensor>())?, 0.0);
    // Deterministic, whatever the thread count (fixed chunks, ordered partial sums).
    let pool = thread_pool(1)?;
    let single = pool.install(|| ops::global_norm(&tensors))?;
    assert_eq!(single.to_bits(), norm.to_bits());
    Ok(())
}

/// f32 -> bf16 rounds to nearest, ties to even; bf16 -> f32 is exact.
fn cast_rounds_to_nearest_even(dev: Device) -> Result<()> {
    let ulp = 1.0f32 / 128.0; // bf16 spacing in [1, 2)
    let x = vec![
        1.0 + ulp / 2.0,             // tie -> even (1.0)
        1.0 + ulp + ulp / 2.0,       // tie -> even (1 + 2 ulp)
        1.0 + ulp / 2.0 + ulp / 8.0, // above the tie -> up
        -3.0,
        0.0,
    ];
    let want = vec![1.0, 1.0 + 2.0 * ulp, 1.0 + ulp, -3.0, 0.0];
    let t = Tensor::from_vec(x.clone(), [5], dev)?;
    let h = ops::cast(&t, DType::BF16)?;
    assert_eq!(h.dtype(), DType::BF16);
    assert_eq!(h.dims(), &[5]);
    assert_eq!(h.to_vec_f32()?, want);
    let back = ops::cast(&h, DType::F32)?;
    assert_eq!(back.dtype(), DType::F32);
    assert_eq!(back.to_vec_f32()?, want);
    // Same dtype: a copy.
    assert_eq!(ops::cast(&t, DType::F32)?.to_vec_f32()?, x);
    Ok(())
}

fn elementwise_errors(dev: Device) -> Result<()> {
    let a = Tensor::zeros([2, 3], DType::F32, dev)?;
    let b = Tensor::zeros([3, 2], DType::F32, dev)?;
    let u = Tensor::from_vec_u32(vec![0; 6], [2, 3], dev)?;
    let h = ops::cast(&a, DType::BF16)?;
    assert!(matches!(ops::add(&a, &b), Err(Error::Shape { .. })));
    assert!(matches!(ops::add(&a, &u), Err(Error::DType { .. })));
    assert!(matches!(ops::add(&u, &u), Err(Error::DType { .. })));
    assert!(matches!(ops::add(&a, &h), Err(Error::DType { .. })));
    let mut acc = a.try_clone()?;
    assert!(matches!(
        ops::add_assign(&mut acc, &b),
        Err(Error::Shape { .. })
    ));
    // An f32 accumulator takes bf16 terms (mixed precision's grads); a bf16 one does
    // not take f32 terms (they would be rounded silently).
    ops::add_assign(&mut acc, &h)?;
    let mut hacc = h.try_clone()?;
    assert!(matches!(
        ops::add_assign(&mut hacc, &a),
        Err(Error::DType { .. })
    ));
    let mut uu = u.try_clone()?;
    assert!(matches!(
        ops::scale_assign(&mut uu, 2.0),
        Err(Error::DType { .. })
    ));
    assert!(matches!(ops::sum_squares(&u), Err(Error::DType { .. })));
    assert!(matches!(
        ops::global_norm([&a, &u]),
        Err(Error::DType { .. })
    ));
    assert!(matches!(
        ops::cast(&u, DType::F32),
        Err(Error::DType { .. })
    ));
    assert!(matches!(
        ops::cast(&a, DType::U32),
        Err(Error::DType { .. })
    ));
    Ok(())
}

// ---- matmul ----

/// op(a_i) @ op(b_i) in f64 for a (ba, *, *), b (bb, *, *) with ba, bb in {1, batch}.
#[allow(clippy::too_many_arguments)]
fn matmul_ref(
    a: &[f32],
    b: &[f32],
    (ba, bb): (usize, usize),
    (m, n, k): (usize, usize, usize),
    trans_a: bool,
    trans_b: bool,
) -> Vec<f32> {
    let batch = ba.max(bb);
    let mut c = vec![0.0f32; batch * m * n];
    for i in 0..batch {
        let ai = &a[if ba == 1 { 0 } else { i * m * k }..];
        let bi = &b[if bb == 1 { 0 } else { i * k * n }..];
        for r in 0..m {
            for col in 0..n {
                let mut acc = 0.0f64;
                for kk in 0..k {
                    let av = if trans_a {
                        ai[kk * m + r]
                    } else {
                        ai[r * k + kk]
                    };
                    let bv = if trans_b {
                        bi[col * k + kk]
                    } else {
                        bi[kk * n + col]
                    };
                    acc += f64::from(av) * f64::from(bv);
                }
                c[(i * m + r) * n + col] = acc as f32;
            }
        }
    }
    c
}

/// Dims of a stored operand: `lead` is the batch dim when present.
fn stored(lead: Option<usize>, rows: usize, cols: usize) -> Vec<usize> {
    match lead {
        Some(b) => vec![b, rows, cols],
        None => vec![rows, cols],
    }
}

fn matmul_matches_loops(dev: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    // (lead dim of a, lead dim of b, m, n, k): single, batched, broadcast either way,
    // a batch of 1 against a batch, shapes small (many tasks) and large (threaded GEMM).
    type Case = (Option<usize>, Option<usize>, usize, usize, usize);
    let cases: [Case; 8] = [
        (None, None, 3, 4, 5),
        (None, None, 1, 1, 1),
        (None, None, 40, 70, 30),
        (Some(3), Some(3), 4, 5, 6),
        (None, Some(3), 4, 5, 6),
        (Some(3), None, 4, 5, 6),
        (Some(1), Some(2), 4, 5, 6),
        (Some(2), Some(2), 64, 72, 80),
    ];
    for (la, lb, m, n, k) in cases {
        for (trans_a, trans_b) in [(false, false), (true, false), (false, true), (true, true)] {
            let a_dims = stored(la, if trans_a { k } else { m }, if trans_a { m } else { k });
            let b_dims = stored(lb, if trans_b { n } else { k }, if trans_b { k } else { n });
            let a = rng.normal_vec(a_dims.iter().product(), 1.0);
            let b = rng.normal_vec(b_dims.iter().product(), 1.0);
            let at = Tensor::from_vec(a.clone(), a_dims.clone(), dev)?;
            let bt = Tensor::from_vec(b.clone(), b_dims.clone(), dev)?;
            let c = ops::matmul(&at, &bt, trans_a, trans_b)?;
            let (ba, bb) = (la.unwrap_or(1), lb.unwrap_or(1));
            let batch = ba.max(bb);
            let want_dims = if la.is_some() || lb.is_some() {
                vec![batch, m, n]
            } else {
                vec![m, n]
            };
            let what = format!("matmul a{a_dims:?} b{b_dims:?} ta {trans_a} tb {trans_b}");
            assert_eq!(c.dims(), want_dims.as_slice(), "{what}");
            let want = matmul_ref(&a, &b, (ba, bb), (m, n, k), trans_a, trans_b);
            assert_close(&what, &c.to_vec_f32()?, &want, 1e-4, 1e-4);
        }
    }
    Ok(())
}

/// c = alpha op(a) op(b) + beta c; beta = 0 ignores c (even NaN), beta = 1 accumulates.
fn matmul_into_alpha_beta(dev: Device) -> Result<()> {
    let mut rng = Rng::new(4);
    let (m, n, k) = (5, 3, 4);
    let a = rng.normal_vec(m * k, 1.0);
    let b = rng.normal_vec(n * k, 1.0);
    let c0 = rng.normal_vec(m * n, 1.0);
    let at = Tensor::from_vec(a.clone(), [m, k], dev)?;
    let bt = Tensor::from_vec(b.clone(), [n, k], dev)?; // used transposed
    let prod = matmul_ref(&a, &b, (1, 1), (m, n, k), false, true);
    let mut c = Tensor::from_vec(c0.clone(), [m, n], dev)?;
    ops::matmul_into(&at, &bt, &mut c, false, true, 0.5, 2.0)?;
    let want: Vec<f32> = prod
        .iter()
        .zip(&c0)
        .map(|(p, c)| 0.5 * p + 2.0 * c)
        .collect();
    assert_close("alpha 0.5 beta 2", &c.to_vec_f32()?, &want, 1e-5, 1e-5);
    let mut c = Tensor::full(f32::NAN, [m, n], dev)?;
    ops::matmul_into(&at, &bt, &mut c, false, true, 1.0, 0.0)?;
    assert_close("beta 0 over NaN", &c.to_vec_f32()?, &prod, 1e-5, 1e-5);
    ops::matmul_into(&at, &bt, &mut c, false, true, 1.0, 1.0)?;
    let twice: Vec<f32> = prod.iter().map(|p| 2.0 * p).collect();
    assert_close("beta 1 accumulates", &c.to_vec_f32()?, &twice, 1e-5, 1e-5);
    Ok(())
}

fn matmul_errors(dev: Device) -> Result<()> {
    let z = |dims: &[usize]| Tensor::zeros(dims.to_vec(), DType::F32, dev);
    let (a, b) = (z(&[3, 4])?, z(&[5, 6])?);
    assert!(matches!(
        ops::matmul(&a, &b, false, false),
        Err(Error::Shape { .. })
    ));
    assert!(ops::matmul(&a, &z(&[4, 6])?, false, false).is_ok());
    assert!(matches!(
        ops::matmul(&a, &z(&[4, 6])?, true, false),
        Err(Error::Shape { .. })
    ));
    // Batches 2 and 3 do not broadcast.
    assert!(matches!(
        ops::matmul(&z(&[2, 3, 4])?, &z(&[3, 4, 5])?, false, false),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::matmul(&z(&[4])?, &a, false, false),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::matmul(&z(&[1, 2, 3, 4])?, &a, false, false),
        Err(Error::Shape { .. })
    ));
    let u = Tensor::from_vec_u32(vec![0; 24], [4, 6], dev)?;
    assert!(matches!(
        ops::matmul(&a, &u, false, false),
        Err(Error::DType { .. })
    ));
    let h = ops::cast(&z(&[4, 6])?, DType::BF16)?;
    assert!(matches!(
        ops::matmul(&a, &h, false, false),
        Err(Error::DType { .. })
    ));
    let mut c_bad = z(&[3, 5])?;
    assert!(matches!(
        ops::matmul_into(&a, &z(&[4, 6])?, &mut c_bad, false, false, 1.0, 0.0),
        Err(Error::Shape { .. })
    ));
    let mut c_u = Tensor::from_vec_u32(vec![0; 18], [3, 6], dev)?;
    assert!(matches!(
        ops::matmul_into(&a, &z(&[4, 6])?, &mut c_u, false, false, 1.0, 0.0),
        Err(Error::DType { .. })
    ));
    Ok(())
}

fn matmul_deterministic(dev: Device) -> Result<()> {
    let mut rng = Rng::new(5);
    let (m, n, k) = (96, 80, 112);
    let a = Tensor::from_vec(rng.normal_vec(m * k, 1.0), [m, k], dev)?;
    let b = Tensor::from_vec(rng.normal_vec(k * n, 1.0), [k, n], dev)?;
    let ab = Tensor::from_vec(rng.normal_vec(4 * m * k, 1.0), [4, m, k], dev)?;
    let run = || -> Result<(Vec<f32>, Vec<f32>)> {
        Ok((
            ops::matmul(&a, &b, false, false)?.to_vec_f32()?,
            ops::matmul(&ab, &b, false, false)?.to_vec_f32()?,
        ))
    };
    let first = run()?;
    assert_eq!(first, run()?);
    for threads in [1, 3] {
        let pool = thread_pool(threads)?;
        assert_eq!(first, pool.install(run)?, "{threads} threads");
    }
    Ok(())
}

// ---- linear ----

fn linear_host(dev: Device, x: &[f32], w: &[f32], b: &[f32], xs: &[usize]) -> Result<Vec<f32>> {
    let k = xs[xs.len() - 1];
    let n = b.len();
    let y = ops::linear_fwd(
        &Tensor::from_vec(x.to_vec(), xs.to_vec(), dev)?,
        &Tensor::from_vec(w.to_vec(), [n, k], dev)?,
        Some(&Tensor::from_vec(b.to_vec(), [n], dev)?),
    )?;
    y.to_vec_f32()
}

fn linear_forward_matches_loops(dev: Device) -> Result<()> {
    let mut rng = Rng::new(6);
    let (bsz, t, k, n) = (2, 3, 5, 4);
    let x = rng.normal_vec(bsz * t * k, 1.0);
    let w = rng.normal_vec(n * k, 1.0);
    let b = rng.normal_vec(n, 1.0);
    let y = ops::linear_fwd(
        &Tensor::from_vec(x.clone(), [bsz, t, k], dev)?,
        &Tensor::from_vec(w.clone(), [n, k], dev)?,
        Some(&Tensor::from_vec(b.clone(), [n], dev)?),
    )?;
    assert_eq!(y.dims(), &[bsz, t, n]);
    let mut want = matmul_ref(&x, &w, (1, 1), (bsz * t, n, k), false, true);
    for (i, v) in want.iter_mut().enumerate() {
        *v += b[i % n];
    }
    assert_close("linear_fwd", &y.to_vec_f32()?, &want, 1e-5, 1e-5);
    // No bias, and a single vector input (rank 1).
    let y1 = ops::linear_fwd(
        &Tensor::from_vec(x[..k].to_vec(), [k], dev)?,
        &Tensor::from_vec(w.clone(), [n, k], dev)?,
        None,
    )?;
    assert_eq!(y1.dims(), &[n]);
    let want1 = matmul_ref(&x[..k], &w, (1, 1), (1, n, k), false, true);
    assert_close("linear_fwd rank 1", &y1.to_vec_f32()?, &want1, 1e-5, 1e-5);
    Ok(())
}

fn linear_backward_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(7);
    let (bsz, t, k, n) = (2, 3, 4, 5);
    let xs = [bsz, t, k];
    let x = rng.normal_vec(bsz * t * k, 1.0);
    let w = rng.normal_vec(n * k, 1.0);
    let b = rng.normal_vec(n, 1.0);
    let r = rng.normal_vec(bsz * t * n, 1.0);
    let dw0 = rng.normal_vec(n * k, 1.0);
    let db0 = rng.normal_vec(n, 1.0);
    let mut dw = Tensor::from_vec(dw0.clone(), [n, k], dev)?;
    let mut db = Tensor::from_vec(db0.clone(), [n], dev)?;
    let dx = ops::linear_bwd(
        &Tensor::from_vec(r.clone(), [bsz, t, n], dev)?,
        &Tensor::from_vec(x.clone(), xs, dev)?,
        &Tensor::from_vec(w.clone(), [n, k], dev)?,
        Some(&mut dw),
        Some(&mut db),
    )?;
    assert_eq!(dx.dims(), &xs);
    let dx = dx.to_vec_f32()?;
    // The backward added into the pre-filled grads: subtract what was there.
    let sub = |a: Vec<f32>, base: &[f32]| -> Vec<f32> {
        a.iter().zip(base).map(|(a, b)| a - b).collect()
    };
    let dw = sub(dw.to_vec_f32()?, &dw0);
    let db = sub(db.to_vec_f32()?, &db0);
    let tol = FdTolerance::default();
    check_grad("linear dx", &x, &dx, tol, |xp| {
        Ok(dot(&linear_host(dev, xp, &w, &b, &xs)?, &r))
    })?;
    check_grad("linear dw", &w, &dw, tol, |wp| {
        Ok(dot(&linear_host(dev, &x, wp, &b, &xs)?, &r))
    })?;
    check_grad("linear db", &b, &db, tol, |bp| {
        Ok(dot(&linear_host(dev, &x, &w, bp, &xs)?, &r))
    })?;
    // Frozen params: None gives the same dx.
    let dx_none = ops::linear_bwd(
        &Tensor::from_vec(r, [bsz, t, n], dev)?,
        &Tensor::from_vec(x, xs, dev)?,
        &Tensor::from_vec(w, [n, k], dev)?,
        None,
        None,
    )?;
    assert_eq!(dx_none.to_vec_f32()?, dx);
    Ok(())
}

fn linear_errors(dev: Device) -> Result<()> {
    let z = |dims: &[usize]| Tensor::zeros(dims.to_vec(), DType::F32, dev);
    let (x, w) = (z(&[2, 3, 4])?, z(&[5, 4])?);
    assert!(matches!(
        ops::linear_fwd(&x, &z(&[5, 3])?, None),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::linear_fwd(&x, &z(&[5, 4, 1])?, None),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::linear_fwd(&x, &w, Some(&z(&[4])?)),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::linear_fwd(&z(&[])?, &w, None),
        Err(Error::Shape { .. })
    ));
    let u = Tensor::from_vec_u32(vec![0; 20], [5, 4], dev)?;
    assert!(matches!(
        ops::linear_fwd(&x, &u, None),
        Err(Error::DType { .. })
    ));
    let h = ops::cast(&w, DType::BF16)?;
    assert!(matches!(
        ops::linear_fwd(&x, &h, None),
        Err(Error::DType { .. })
    ));
    let dy = z(&[2, 3, 5])?;
    assert!(ops::linear_bwd(&dy, &x, &w, None, None).is_ok());
    assert!(matches!(
        ops::linear_bwd(&z(&[2, 3, 6])?, &x, &w, None, None),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::linear_bwd(&z(&[2, 2, 5])?, &x, &w, None, None),
        Err(Error::Shape { .. })
    ));
    // Same row count, different leading dims: dy does not belong to this x.
    assert!(matches!(
        ops::linear_bwd(&z(&[3, 2, 5])?, &x, &w, None, None),
        Err(Error::Shape { .. })
    ));
    let mut dw_bad = z(&[4, 5])?;
    assert!(matches!(
        ops::linear_bwd(&dy, &x, &w, Some(&mut dw_bad), None),
        Err(Error::Shape { .. })
    ));
    let mut db_bad = z(&[4])?;
    assert!(matches!(
        ops::linear_bwd(&dy, &x, &w, None, Some(&mut db_bad)),
        Err(Error::Shape { .. })
    ));
    let mut db_u = Tensor::from_vec_u32(vec![0; 5], [5], dev)?;
    assert!(matches!(
        ops::linear_bwd(&dy, &x, &w, None, Some(&mut db_u)),
        Err(Error::DType { .. })
    ));
    // The weight gradient alone: dw (N, K) for dy (.., N) and x (.., K) of equal rows.
    let mut dw = z(&[5, 4])?;
    assert!(ops::linear_wgrad(&dy, &x, &mut dw).is_ok());
    assert!(matches!(
        ops::linear_wgrad(&dy, &x, &mut dw_bad),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::linear_wgrad(&z(&[2, 2, 5])?, &x, &mut dw),
        Err(Error::Shape { .. })
    ));
    Ok(())
}

braid_kernels::test_on_devices!(
    add_and_assign_match_loops,
    sum_squares_and_global_norm,
    cast_rounds_to_nearest_even,
    elementwise_errors,
    matmul_matches_loops,
    matmul_into_alpha_beta,
    matmul_errors,
    matmul_deterministic,
    linear_forward_matches_loops,
    linear_backward_finite_differences,
    linear_errors,
);
