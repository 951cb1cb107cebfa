//! conv1d and patchify: forward against plain loops, backward by finite differences,
//! `+=` into parameter grads, the patch-embedding identity, error cases, determinism.

use braid_kernels::ops::{self, Conv1dSpec};
use braid_kernels::rng::Rng;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, dot};
use braid_kernels::{DType, Device, Error, Result, Shape, Tensor};

// ---- references ----

/// Direct conv1d in f64: y[b, o, t] = bias[o] + sum_{c, k} w[o, c, k] x[b, c, t s + k - p].
#[allow(clippy::too_many_arguments)]
fn conv1d_ref(
    x: &[f32],
    w: &[f32],
    bias: Option<&[f32]>,
    (b, ci, l): (usize, usize, usize),
    (co, k): (usize, usize),
    spec: Conv1dSpec,
) -> Vec<f32> {
    let lo = (l + 2 * spec.padding - k) / spec.stride + 1;
    let mut y = vec![0.0f32; b * co * lo];
    for bi in 0..b {
        for o in 0..co {
            for t in 0..lo {
                let mut acc = bias.map_or(0.0, |bv| f64::from(bv[o]));
                for c in 0..ci {
                    for kk in 0..k {
                        let pos = (t * spec.stride + kk) as isize - spec.padding as isize;
                        if pos >= 0 && (pos as usize) < l {
                            acc += f64::from(w[(o * ci + c) * k + kk])
                                * f64::from(x[(bi * ci + c) * l + pos as usize]);
                        }
                    }
                }
                y[(bi * co + o) * lo + t] = acc as f32;
            }
        }
    }
    y
}

/// Direct Conv2d(kernel = stride = P, no padding) in f64: (B, C, H, W) -> (B, D, H/P, W/P).
fn conv2d_patch_ref(
    img: &[f32],
    w: &[f32],
    bias: &[f32],
    [b, c, h, wd]: [usize; 4],
    d: usize,
    p: usize,
) -> Vec<f32> {
    let (hp, wp) = (h / p, wd / p);
    let mut y = vec![0.0f32; b * d * hp * wp];
    for bi in 0..b {
        for o in 0..d {
            for ph in 0..hp {
                for pw in 0..wp {
                    let mut acc = f64::from(bias[o]);
                    for ci in 0..c {
                        for i in 0..p {
                            for j in 0..p {
                                acc += f64::from(w[((o * c + ci) * p + i) * p + j])
                                    * f64::from(
                                        img[((bi * c + ci) * h + ph * p + i) * wd + pw * p + j],
                                    );
                            }
                        }
                    }
                    y[((bi * d + o) * hp + ph) * wp + pw] = acc as f32;
                }
            }
        }
    }
    y
}

/// patchify by its definition, one output element at a time.
fn patchify_ref(img: &[f32], [b, c, h, w]: [usize; 4], p: usize) -> Vec<f32> {
    let (hp, wp) = (h / p, w / p);
    let row = c * p * p;
    let mut out = vec![0.0f32; b * hp * wp * row];
    for bi in 0..b {
        for ph in 0..hp {
            for pw in 0..wp {
                for ci in 0..c {
                    for i in 0..p {
                        for j in 0..p {
                            out[(bi * hp * wp + ph * wp + pw) * row + (ci * p + i) * p + j] =
                                img[((bi * c + ci) * h + ph * p + i) * w + pw * p + j];
                        }
                    }
                }
            }
        }
    }
    out
}

fn conv_fwd_host(
    dev: Device,
    x: &[f32],
    w: &[f32],
    b: Option<&[f32]>,
    xs: [usize; 3],
    ws: [usize; 3],
    spec: Conv1dSpec,
) -> Result<Vec<f32>> {
    let xt = Tensor::from_vec(x.to_vec(), xs, dev)?;
    let wt = Tensor::from_vec(w.to_vec(), ws, dev)?;
    let bt = b
        .map(|b| Tensor::from_vec(b.to_vec(), [ws[0]], dev))
        .transpose()?;
    ops::conv1d_fwd(&xt, &wt, bt.as_ref(), &spec)?.to_vec_f32()
}

const SPECS: [(usize, usize, usize); 6] = [
    // (K, stride, padding)
    (3, 1, 1), // Whisper conv1
    (3, 2, 1), // Whisper conv2
    (3, 2, 0),
    (2, 3, 2),
    (1, 1, 0),
    (4, 1, 3), // padding wider than the kernel reach
];

// ---- conv1d ----

fn conv1d_forward_matches_reference(dev: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    for &(k, stride, padding) in &SPECS {
        for l in [1usize, 5, 8] {
            let spec = Conv1dSpec { stride, padding };
            if l + 2 * padding < k {
                continue;
            }
            let (b, ci, co) = (2, 3, 4);
            let x = rng.normal_vec(b * ci * l, 1.0);
            let w = rng.normal_vec(co * ci * k, 1.0);
            let bias = rng.normal_vec(co, 1.0);
            for with_bias in [false, true] {
                let bb = with_bias.then_some(bias.as_slice());
                let got = conv_fwd_host(dev, &x, &w, bb, [b, ci, l], [co, ci, k], spec)?;
                let want = conv1d_ref(&x, &w, bb, (b, ci, l), (co, k), spec);
                assert_close(
                    &format!("conv1d k{k} s{stride} p{padding} l{l} bias {with_bias}"),
                    &got,
                    &want,
                    1e-5,
                    1e-5,
                );
            }
        }
    }
    Ok(())
}

/// The Whisper stem at a size that takes the multi-threaded paths: conv(K3, s1, p1)
/// then conv(K3, s2, p1), each against the reference.
fn conv1d_whisper_stem(dev: Device) -> Result<()> {
    let mut rng = Rng::new(2);
    let (b, mel, d, l) = (3, 16, 24, 60);
    let x = rng.normal_vec(b * mel * l, 1.0);
    let w1 = rng.normal_vec(d * mel * 3, 0.2);
    let b1 = rng.normal_vec(d, 0.2);
    let w2 = rng.normal_vec(d * d * 3, 0.2);
    let b2 = rng.normal_vec(d, 0.2);
    let s1 = Conv1dSpec {
        stride: 1,
        padding: 1,
    };
    let s2 = Conv1dSpec {
        stride: 2,
        padding: 1,
    };
    let h = conv_fwd_host(dev, &x, &w1, Some(&b1), [b, mel, l], [d, mel, 3], s1)?;
    assert_close(
        "stem conv1",
        &h,
        &conv1d_ref(&x, &w1, Some(&b1), (b, mel, l), (d, 3), s1),
        1e-4,
        1e-4,
    );
    let y = conv_fwd_host(dev, &h, &w2, Some(&b2), [b, d, l], [d, d, 3], s2)?;
    assert_eq!(y.len(), b * d * (l / 2));
    assert_close(
        "stem conv2",
        &y,
        &conv1d_ref(&h, &w2, Some(&b2), (b, d, l), (d, 3), s2),
        1e-4,
        1e-4,
    );
    Ok(())
}

fn conv1d_backward_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(3);
    let tol = FdTolerance::default();
    for &(k, stride, padding) in &SPECS {
        let spec = Conv1dSpec { stride, padding };
        let (b, ci, l, co) = (2, 2, 6, 3);
        let lo = (l + 2 * padding - k) / stride + 1;
        let (xs, ws) = ([b, ci, l], [co, ci, k]);
        let x = rng.normal_vec(b * ci * l, 1.0);
        let w = rng.normal_vec(co * ci * k, 1.0);
        let bias = rng.normal_vec(co, 1.0);
        let r = rng.normal_vec(b * co * lo, 1.0);
        // Pre-filled grads: the backward must add, not overwrite.
        let dw0 = rng.normal_vec(w.len(), 1.0);
        let db0 = rng.normal_vec(co, 1.0);

        let mut dw = Tensor::from_vec(dw0.clone(), ws, dev)?;
        let mut db = Tensor::from_vec(db0.clone(), [co], dev)?;
        let dx = ops::conv1d_bwd(
            &Tensor::from_vec(r.clone(), [b, co, lo], dev)?,
            &Tensor::from_vec(x.clone(), xs, dev)?,
            &Tensor::from_vec(w.clone(), ws, dev)?,
            &spec,
            Some(&mut dw),
            Some(&mut db),
        )?
        .to_vec_f32()?;
        assert_eq!(dx.len(), x.len());
        let sub = |a: Vec<f32>, base: &[f32]| -> Vec<f32> {
            a.iter().zip(base).map(|(a, b)| a - b).collect()
        };
        let dw = sub(dw.to_vec_f32()?, &dw0);
        let db = sub(db.to_vec_f32()?, &db0);

        let what = format!("k{k} s{stride} p{padding}");
        check_grad(&format!("conv1d dx {what}"), &x, &dx, tol, |xp| {
            Ok(dot(
                &conv_fwd_host(dev, xp, &w, Some(&bias), xs, ws, spec)?,
                &r,
            ))
        })?;
        check_grad(&format!("conv1d dw {what}"), &w, &dw, tol, |wp| {
            Ok(dot(
                &conv_fwd_host(dev, &x, wp, Some(&bias), xs, ws, spec)?,
                &r,
            ))
        })?;
        check_grad(&format!("conv1d db {what}"), &bias, &db, tol, |bp| {
            Ok(dot(
                &conv_fwd_host(dev, &x, &w, Some(bp), xs, ws, spec)?,
                &r,
            ))
        })?;
    }
    Ok(())
}

/// dw/db `None` (frozen parameters) give the same dx, and the grads accumulate over
/// two calls exactly as two separate sums would.
fn conv1d_backward_optional_and_accumulating(dev: Device) -> Result<()> {
    let mut rng = Rng::new(4);
    let spec = Conv1dSpec {
        stride: 2,
        padding: 1,
    };
    let (b, ci, l, co, k) = (2, 3, 9, 4, 3);
    let lo = (l + 2 - k) / 2 + 1;
    let x = Tensor::from_vec(rng.normal_vec(b * ci * l, 1.0), [b, ci, l], dev)?;
    let w = Tensor::from_vec(rng.normal_vec(co * ci * k, 1.0), [co, ci, k], dev)?;
    let dy = Tensor::from_vec(rng.normal_vec(b * co * lo, 1.0), [b, co, lo], dev)?;
    let dx_none = ops::conv1d_bwd(&dy, &x, &w, &spec, None, None)?.to_vec_f32()?;
    let mut dw = Tensor::zeros([co, ci, k], DType::F32, dev)?;
    let mut db = Tensor::zeros([co], DType::F32, dev)?;
    let dx = ops::conv1d_bwd(&dy, &x, &w, &spec, Some(&mut dw), Some(&mut db))?.to_vec_f32()?;
    assert_eq!(
        dx, dx_none,
        "dx must not depend on which grads are asked for"
    );
    let (dw1, db1) = (dw.to_vec_f32()?, db.to_vec_f32()?);
    ops::conv1d_bwd(&dy, &x, &w, &spec, Some(&mut dw), Some(&mut db))?;
    let twice = |v: &[f32]| v.iter().map(|a| a + a).collect::<Vec<_>>();
    assert_close("dw twice", &dw.to_vec_f32()?, &twice(&dw1), 1e-6, 1e-6);
    assert_close("db twice", &db.to_vec_f32()?, &twice(&db1), 1e-6, 1e-6);
    Ok(())
}

fn conv1d_errors(dev: Device) -> Result<()> {
    let spec = Conv1dSpec {
        stride: 1,
        padding: 1,
    };
    let x = Tensor::zeros([2, 3, 8], DType::F32, dev)?;
    let w = Tensor::zeros([4, 3, 3], DType::F32, dev)?;
    let dy = Tensor::zeros([2, 4, 8], DType::F32, dev)?;
    // Shapes.
    let x2 = Tensor::zeros([3, 8], DType::F32, dev)?;
    assert!(matches!(
        ops::conv1d_fwd(&x2, &w, None, &spec),
        Err(Error::Shape { .. })
    ));
    let w_ci = Tensor::zeros([4, 2, 3], DType::F32, dev)?;
    assert!(matches!(
        ops::conv1d_fwd(&x, &w_ci, None, &spec),
        Err(Error::Shape { .. })
    ));
    let b_bad = Tensor::zeros([3], DType::F32, dev)?;
    assert!(matches!(
        ops::conv1d_fwd(&x, &w, Some(&b_bad), &spec),
        Err(Error::Shape { .. })
    ));
    // LO < 1: L + 2p < K.
    let x_short = Tensor::zeros([2, 3, 1], DType::F32, dev)?;
    let w_long = Tensor::zeros([4, 3, 5], DType::F32, dev)?;
    assert!(matches!(
        ops::conv1d_fwd(&x_short, &w_long, None, &spec),
        Err(Error::Shape { .. })
    ));
    let w_k0 = Tensor::zeros([4, 3, 0], DType::F32, dev)?;
    assert!(matches!(
        ops::conv1d_fwd(&x, &w_k0, None, &spec),
        Err(Error::Shape { .. })
    ));
    // Values.
    let s0 = Conv1dSpec {
        stride: 0,
        padding: 1,
    };
    assert!(matches!(
        ops::conv1d_fwd(&x, &w, None, &s0),
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        ops::conv1d_bwd(&dy, &x, &w, &s0, None, None),
        Err(Error::Invalid { .. })
    ));
    // Dtypes: u32 input, mixed f32/bf16.
    let xu = Tensor::from_vec_u32(vec![0; 48], [2, 3, 8], dev)?;
    assert!(matches!(
        ops::conv1d_fwd(&xu, &w, None, &spec),
        Err(Error::DType { .. })
    ));
    let wbf = ops::cast(&w, DType::BF16)?;
    assert!(matches!(
        ops::conv1d_fwd(&x, &wbf, None, &spec),
        Err(Error::DType { .. })
    ));
    // Backward shapes: dy, dw, db.
    let dy_bad = Tensor::zeros([2, 4, 7], DType::F32, dev)?;
    assert!(matches!(
        ops::conv1d_bwd(&dy_bad, &x, &w, &spec, None, None),
        Err(Error::Shape { .. })
    ));
    let mut dw_bad = Tensor::zeros([4, 3, 2], DType::F32, dev)?;
    assert!(matches!(
        ops::conv1d_bwd(&dy, &x, &w, &spec, Some(&mut dw_bad), None),
        Err(Error::Shape { .. })
    ));
    let mut db_bad = Tensor::zeros([5], DType::F32, dev)?;
    assert!(matches!(
        ops::conv1d_bwd(&dy, &x, &w, &spec, None, Some(&mut db_bad)),
        Err(Error::Shape { .. })
    ));
    let mut db_u32 = Tensor::from_vec_u32(vec![0; 4], [4], dev)?;
    assert!(matches!(
        ops::conv1d_bwd(&dy, &x, &w, &spec, None, Some(&mut db_u32)),
        Err(Error::DType { .. })
    ));
    Ok(())
}

/// Same inputs twice, and on rayon pools of 1 and 3 threads: bitwise equal outputs.
fn conv1d_deterministic(dev: Device) -> Result<()> {
    let mut rng = Rng::new(5);
    let spec = Conv1dSpec {
        stride: 2,
        padding: 1,
    };
    for b in [1, 3] {
        let (ci, l, co, k) = (32, 80, 48, 3);
        let lo = (l + 2 - k) / 2 + 1;
        let x = Tensor::from_vec(rng.normal_vec(b * ci * l, 1.0), [b, ci, l], dev)?;
        let w = Tensor::from_vec(rng.normal_vec(co * ci * k, 0.2), [co, ci, k], dev)?;
        let bias = Tensor::from_vec(rng.normal_vec(co, 0.2), [co], dev)?;
        let dy = Tensor::from_vec(rng.normal_vec(b * co * lo, 1.0), [b, co, lo], dev)?;
        let run = || -> Result<[Vec<f32>; 4]> {
            let y = ops::conv1d_fwd(&x, &w, Some(&bias), &spec)?;
            let mut dw = Tensor::zeros([co, ci, k], DType::F32, dev)?;
            let mut db = Tensor::zeros([co], DType::F32, dev)?;
            let dx = ops::conv1d_bwd(&dy, &x, &w, &spec, Some(&mut dw), Some(&mut db))?;
            Ok([
                y.to_vec_f32()?,
                dx.to_vec_f32()?,
                dw.to_vec_f32()?,
                db.to_vec_f32()?,
            ])
        };
        let first = run()?;
        assert_eq!(first, run()?, "two runs differ");
        for threads in [1, 3] {
            let pool = pool(threads)?;
            assert_eq!(
                first,
                pool.install(run)?,
                "b {b}: {threads}-thread run differs"
            );
        }
    }
    Ok(())
}

// ---- patchify ----

fn patchify_matches_reference_and_inverts(dev: Device) -> Result<()> {
    let mut rng = Rng::new(6);
    for (dims, p) in [
        ([2, 3, 4, 6], 2),
        ([1, 1, 3, 3], 3),
        ([2, 2, 5, 10], 5),
        ([1, 3, 2, 2], 1),
    ] {
        let img = rng.normal_vec(dims.iter().product(), 1.0);
        let t = Tensor::from_vec(img.clone(), dims, dev)?;
        let patches = ops::patchify_fwd(&t, p)?;
        let [b, c, h, w] = dims;
        assert_eq!(patches.dims(), &[b, (h / p) * (w / p), c * p * p]);
        assert_eq!(
            patches.to_vec_f32()?,
            patchify_ref(&img, dims, p),
            "{dims:?} p{p}"
        );
        // A permutation: the backward is its exact inverse.
        let back = ops::patchify_bwd(&patches, &Shape::new(dims), p)?;
        assert_eq!(back.dims(), &dims);
        assert_eq!(
            back.to_vec_f32()?,
            img,
            "unpatchify(patchify(x)) != x for {dims:?}"
        );
    }
    Ok(())
}

fn patchify_backward_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(7);
    let (dims, p) = ([2, 2, 4, 6], 2);
    let img = rng.normal_vec(dims.iter().product(), 1.0);
    let np = (4 / p) * (6 / p);
    let r = rng.normal_vec(2 * np * 2 * p * p, 1.0);
    let dimg = ops::patchify_bwd(
        &Tensor::from_vec(r.clone(), [2, np, 2 * p * p], dev)?,
        &Shape::new(dims),
        p,
    )?
    .to_vec_f32()?;
    check_grad(
        "patchify dimages",
        &img,
        &dimg,
        FdTolerance::default(),
        |xp| {
            let y = ops::patchify_fwd(&Tensor::from_vec(xp.to_vec(), dims, dev)?, p)?;
            Ok(dot(&y.to_vec_f32()?, &r))
        },
    )
}

/// A `Conv2d(C, D, kernel = stride = P)` patch embedding equals patchify + linear with
/// the conv weight reshaped to (D, C*P*P) — no permutation of the weight needed.
fn patch_embedding_equals_conv2d(dev: Device) -> Result<()> {
    let mut rng = Rng::new(8);
    let (dims, p, d) = ([2, 3, 8, 12], 4, 5);
    let [b, c, h, w] = dims;
    let (hp, wp) = (h / p, w / p);
    let img = rng.normal_vec(dims.iter().product(), 1.0);
    let wconv = rng.normal_vec(d * c * p * p, 0.3); // (D, C, P, P)
    let bias = rng.normal_vec(d, 0.3);
    let patches = ops::patchify_fwd(&Tensor::from_vec(img.clone(), dims, dev)?, p)?;
    let wlin = Tensor::from_vec(wconv.clone(), [d, c * p * p], dev)?; // the same buffer
    let bt = Tensor::from_vec(bias.clone(), [d], dev)?;
    let y = ops::linear_fwd(&patches, &wlin, Some(&bt))?; // (B, HP*WP, D)
    assert_eq!(y.dims(), &[b, hp * wp, d]);
    let y = y.to_vec_f32()?;
    let conv = conv2d_patch_ref(&img, &wconv, &bias, dims, d, p); // (B, D, HP, WP)
    // Token n = ph * WP + pw of image bi is the conv output column (ph, pw).
    let mut want = vec![0.0f32; y.len()];
    for bi in 0..b {
        for o in 0..d {
            for n in 0..hp * wp {
                want[(bi * hp * wp + n) * d + o] = conv[(bi * d + o) * hp * wp + n];
            }
        }
    }
    assert_close("patch embedding vs conv2d", &y, &want, 1e-4, 1e-4);
    Ok(())
}

fn patchify_errors(dev: Device) -> Result<()> {
    let img = Tensor::zeros([1, 3, 6, 8], DType::F32, dev)?;
    // H (6) not a multiple of 4; W (8) not a multiple of 3.
    assert!(matches!(
        ops::patchify_fwd(&img, 4),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::patchify_fwd(&img, 3),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::patchify_fwd(&img, 0),
        Err(Error::Invalid { .. })
    ));
    let img3 = Tensor::zeros([3, 6, 8], DType::F32, dev)?;
    assert!(matches!(
        ops::patchify_fwd(&img3, 2),
        Err(Error::Shape { .. })
    ));
    let imgu = Tensor::from_vec_u32(vec![0; 144], [1, 3, 6, 8], dev)?;
    assert!(matches!(
        ops::patchify_fwd(&imgu, 2),
        Err(Error::DType { .. })
    ));
    // Backward: dpatches must be (B, (H/P)(W/P), C P P) of the given image shape.
    let shape = Shape::new([1, 3, 6, 8]);
    let dp = Tensor::zeros([1, 12, 12], DType::F32, dev)?;
    assert!(ops::patchify_bwd(&dp, &shape, 2).is_ok());
    let dp_bad = Tensor::zeros([1, 11, 12], DType::F32, dev)?;
    assert!(matches!(
        ops::patchify_bwd(&dp_bad, &shape, 2),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::patchify_bwd(&dp, &shape, 4),
        Err(Error::Shape { .. })
    ));
    assert!(matches!(
        ops::patchify_bwd(&dp, &shape, 0),
        Err(Error::Invalid { .. })
    ));
    assert!(matches!(
        ops::patchify_bwd(&dp, &Shape::new([3, 6, 8]), 2),
        Err(Error::Shape { .. })
    ));
    let dpu = Tensor::from_vec_u32(vec![0; 144], [1, 12, 12], dev)?;
    assert!(matches!(
        ops::patchify_bwd(&dpu, &shape, 2),
        Err(Error::DType { .. })
    ));
    Ok(())
}

fn patchify_deterministic(dev: Device) -> Result<()> {
    let mut rng = Rng::new(9);
    let dims = [2, 3, 64, 48];
    let img = Tensor::from_vec(rng.normal_vec(dims.iter().product(), 1.0), dims, dev)?;
    let run = || -> Result<(Vec<f32>, Vec<f32>)> {
        let p = ops::patchify_fwd(&img, 8)?;
        let back = ops::patchify_bwd(&p, &Shape::new(dims), 8)?;
        Ok((p.to_vec_f32()?, back.to_vec_f32()?))
    };
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
    conv1d_forward_matches_reference,
    conv1d_whisper_stem,
    conv1d_backward_finite_differences,
    conv1d_backward_optional_and_accumulating,
    conv1d_errors,
    conv1d_deterministic,
    patchify_matches_reference_and_inverts,
    patchify_backward_finite_differences,
    patch_embedding_equals_conv2d,
    patchify_errors,
    patchify_deterministic,
);
