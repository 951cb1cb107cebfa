//! Projectors: forward against slow host references (LLaVA MLP, Qwen2-VL 2x2 patch
//! merge, audio frame stacking with zero padding), backward by central finite
//! differences for the input and every parameter, `+=` accumulation, errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use braid_encoders::{AudioProjector, MlpProjector, ProjectorConfig};
use braid_kernels::ops::Activation;
use braid_kernels::ops::activation::erfc;
use braid_kernels::testing::{FdTolerance, check_grad, dot};
use braid_kernels::{Device, Tensor};
use braid_nn::{Init, Module};
use common::*;

fn kerr(e: impl std::fmt::Display) -> braid_kernels::Error {
    braid_kernels::Error::invalid("fd", e.to_string())
}

fn gelu(x: f64) -> f64 {
    0.5 * x * erfc(-x / std::f64::consts::SQRT_2)
}

/// y (N, out) = x (N, in) W^T + b on the host, f64.
fn host_linear(x: &[f64], w: &[f32], b: &[f32], n_in: usize) -> Vec<f64> {
    let n_out = b.len();
    x.chunks(n_in)
        .flat_map(|row| {
            (0..n_out).map(move |o| {
                f64::from(b[o])
                    + (0..n_in)
                        .map(|i| row[i] * f64::from(w[o * n_in + i]))
                        .sum::<f64>()
            })
        })
        .collect()
}

fn host_mlp<M: Module>(m: &M, l1: &str, l2: &str, x: &[f64], n_in: usize) -> Vec<f64> {
    let p = |n: &str| find_param(m, n).unwrap().value.to_vec_f32().unwrap();
    let h: Vec<f64> = host_linear(
        x,
        &p(&format!("{l1}.weight")),
        &p(&format!("{l1}.bias")),
        n_in,
    )
    .into_iter()
    .map(gelu)
    .collect();
    let hidden = p(&format!("{l1}.bias")).len();
    host_linear(
        &h,
        &p(&format!("{l2}.weight")),
        &p(&format!("{l2}.bias")),
        hidden,
    )
}

/// Randomizes every parameter (norm weights/biases included) so every path is tested.
fn randomize<M: Module>(m: &mut M, seed: u64) -> TestResult {
    let names: Vec<(String, usize)> = params_host(m)
        .into_iter()
        .map(|(n, v, _)| (n, v.len()))
        .collect();
    for (i, (n, len)) in names.into_iter().enumerate() {
        let v: Vec<f32> = randn(seed + i as u64, len)
            .iter()
            .map(|x| 0.5 * x)
            .collect();
        set_param(m, &n, v)?;
    }
    Ok(())
}

/// `run(model, x) -> y` on the host.
type RunFn<M> = dyn Fn(&M, &[f32]) -> TestResult<Vec<f32>>;

/// FD check of dx and of every parameter grad of a module with `run(model, x) -> y`.
fn fd_module<M: Module>(
    mk: &dyn Fn() -> TestResult<M>,
    x: &[f32],
    run: &RunFn<M>,
    analytic_dx: &[f32],
    analytic: &M,
    r: &[f32],
) -> TestResult {
    let tol = FdTolerance::default();
    let probe = mk()?;
    check_grad("dx", x, analytic_dx, tol, |xs| {
        run(&probe, xs).map(|y| dot(&y, r)).map_err(kerr)
    })?;
    for (name, value, grad) in params_host(analytic) {
        let mut m = mk()?;
        check_grad(&name, &value, &grad.unwrap(), tol, |vs| {
            set_param(&mut m, &name, vs.to_vec()).map_err(kerr)?;
            run(&m, x).map(|y| dot(&y, r)).map_err(kerr)
        })?;
    }
    Ok(())
}

fn vision_projector_case(dev: Device, merge: usize, grids: &[(usize, usize)]) -> TestResult {
    let (d, out) = (4, 3);
    let cfg = ProjectorConfig {
        in_dim: d,
        out_dim: out,
        spatial_merge: merge,
        act: Activation::GeluErf,
        ln_eps: 1e-6,
    };
    let mk = || -> TestResult<MlpProjector> {
        let mut p = MlpProjector::new(&Init::new(3, dev), "proj", cfg)?;
        randomize(&mut p, 100)?;
        Ok(p)
    };
    let t: usize = grids.iter().map(|(h, w)| h * w).sum();
    let x = randn(1, t * d);
    let grids_v = grids.to_vec();
    let run = move |p: &MlpProjector, xs: &[f32]| -> TestResult<Vec<f32>> {
        let x = Tensor::from_vec(xs.to_vec(), [t, d], dev)?;
        Ok(p.forward(&x, &grids_v)?.0.to_vec_f32()?)
    };
    let mut p = mk()?;
    let (y, cache) = p.forward(&Tensor::from_vec(x.clone(), [t, d], dev)?, grids)?;
    let y = y.to_vec_f32()?;

    // Host reference: ln_q per patch, m x m blocks concatenated row by row, MLP.
    let m = merge;
    let xs: Vec<f64> = if m == 1 {
        x.iter().map(|&v| f64::from(v)).collect()
    } else {
        let w = find_param(&p, "proj.ln_q.weight")
            .unwrap()
            .value
            .to_vec_f32()?;
        let b = find_param(&p, "proj.ln_q.bias")
            .unwrap()
            .value
            .to_vec_f32()?;
        let ln: Vec<f64> = x
            .chunks(d)
            .flat_map(|row| {
                let mean = row.iter().map(|&v| f64::from(v)).sum::<f64>() / d as f64;
                let var = row
                    .iter()
                    .map(|&v| (f64::from(v) - mean).powi(2))
                    .sum::<f64>()
                    / d as f64;
                let rstd = 1.0 / (var + 1e-6).sqrt();
                (0..d)
                    .map(|c| (f64::from(row[c]) - mean) * rstd * f64::from(w[c]) + f64::from(b[c]))
                    .collect::<Vec<_>>()
            })
            .collect();
        let mut merged = vec![0.0; t * d];
        let mut base = 0;
        let mut gbase = 0;
        for &(gh, gw) in grids {
            for r in 0..gh {
                for c in 0..gw {
                    let group = gbase + (r / m) * (gw / m) + c / m;
                    let slot = (r % m) * m + c % m;
                    let dst = (group * m * m + slot) * d;
                    let src = (base + r * gw + c) * d;
                    merged[dst..dst + d].copy_from_slice(&ln[src..src + d]);
                }
            }
            base += gh * gw;
            gbase += gh * gw / (m * m);
        }
        merged
    };
    let (l1, l2) = if m == 1 {
        ("proj.linear_1", "proj.linear_2")
    } else {
        ("proj.mlp.0", "proj.mlp.2")
    };
    let want: Vec<f32> = host_mlp(&p, l1, l2, &xs, d * m * m)
        .into_iter()
        .map(|v| v as f32)
        .collect();
    assert_eq!(y.len(), t / (m * m) * out);
    check("projector forward vs host", &y, &want, 1e-5);

    let r = randn(2, y.len());
    let rt = Tensor::from_vec(r.clone(), [t / (m * m), out], dev)?;
    let dx = p.backward(cache, &rt)?.to_vec_f32()?;
    fd_module(&mk, &x, &run, &dx, &p, &r)?;

    // += semantics: a second backward doubles every grad.
    let once = params_host(&p);
    let (_, cache) = p.forward(&Tensor::from_vec(x.clone(), [t, d], dev)?, grids)?;
    p.backward(cache, &rt)?;
    for ((n, _, g1), (_, _, g2)) in once.iter().zip(params_host(&p)) {
        let twice: Vec<f32> = g1.as_ref().unwrap().iter().map(|v| 2.0 * v).collect();
        check(&format!("{n} accumulates"), &g2.unwrap(), &twice, 1e-6);
    }
    Ok(())
}

fn llava_mlp_projector(dev: Device) -> TestResult {
    vision_projector_case(dev, 1, &[(2, 3)])
}

fn spatial_merge_projector(dev: Device) -> TestResult {
    vision_projector_case(dev, 2, &[(2, 4), (4, 2), (2, 2)])
}

fn audio_projector(dev: Device) -> TestResult {
    let (d, out, s) = (3, 4, 3);
    let mk = || -> TestResult<AudioProjector> {
        let mut p = AudioProjector::new(
            &Init::new(4, dev),
            "audio_proj",
            d,
            out,
            s,
            Activation::GeluErf,
        )?;
        randomize(&mut p, 200)?;
        Ok(p)
    };
    // Clips of 4 (padded to 6), 3 (exact) and 1 (padded to 3) frames.
    let cu = vec![0usize, 4, 7, 8];
    let t = 8;
    let x = randn(7, t * d);
    let cu2 = cu.clone();
    let run = move |p: &AudioProjector, xs: &[f32]| -> TestResult<Vec<f32>> {
        let x = Tensor::from_vec(xs.to_vec(), [t, d], dev)?;
        Ok(p.forward(&x, &cu2)?.0.to_vec_f32()?)
    };
    let mut p = mk()?;
    assert_eq!(p.out_cu_seqlens(&cu), vec![0, 2, 3, 4]);
    let (y, cache) = p.forward(&Tensor::from_vec(x.clone(), [t, d], dev)?, &cu)?;
    let y = y.to_vec_f32()?;
    // Host reference: per clip, groups of s frames, zero-padded at the clip's end.
    let mut stacked = Vec::new();
    for w in cu.windows(2) {
        let len = w[1] - w[0];
        for k in 0..len.div_ceil(s) * s {
            for c in 0..d {
                stacked.push(if k < len {
                    f64::from(x[(w[0] + k) * d + c])
                } else {
                    0.0
                });
            }
        }
    }
    let want: Vec<f32> = host_mlp(
        &p,
        "audio_proj.linear_1",
        "audio_proj.linear_2",
        &stacked,
        s * d,
    )
    .into_iter()
    .map(|v| v as f32)
    .collect();
    check("audio projector forward vs host", &y, &want, 1e-5);
    let r = randn(8, y.len());
    let dx = p
        .backward(cache, &Tensor::from_vec(r.clone(), [4, out], dev)?)?
        .to_vec_f32()?;
    fd_module(&mk, &x, &run, &dx, &p, &r)
}

fn projector_errors(dev: Device) -> TestResult {
    let cfg = ProjectorConfig {
        in_dim: 4,
        out_dim: 3,
        spatial_merge: 2,
        act: Activation::GeluErf,
        ln_eps: 1e-6,
    };
    let p = MlpProjector::new(&Init::new(1, dev), "proj", cfg)?;
    let x = Tensor::from_vec(randn(1, 6 * 4), [6, 4], dev)?;
    // A 2x3 grid cannot be merged 2x2.
    braid_kernels::assert_err!(p.forward(&x, &[(2, 3)]), braid_nn::Error::Input { .. });
    // Grids that do not add up to the rows.
    braid_kernels::assert_err!(p.forward(&x, &[(2, 2)]), braid_nn::Error::Input { .. });
    // Wrong width.
    let x5 = Tensor::from_vec(randn(1, 4 * 5), [4, 5], dev)?;
    braid_kernels::assert_err!(p.forward(&x5, &[(2, 2)]), braid_nn::Error::Input { .. });
    braid_kernels::assert_err!(
        MlpProjector::new(
            &Init::new(1, dev),
            "p",
            ProjectorConfig {
                spatial_merge: 0,
                ..cfg
            }
        ),
        braid_nn::Error::Config { .. }
    );
    let a = AudioProjector::new(&Init::new(1, dev), "a", 4, 3, 2, Activation::GeluErf)?;
    braid_kernels::assert_err!(a.forward(&x, &[0, 5]), braid_nn::Error::Input { .. });
    braid_kernels::assert_err!(
        AudioProjector::new(&Init::new(1, dev), "a", 4, 3, 0, Activation::GeluErf),
        braid_nn::Error::Config { .. }
    );
    Ok(())
}

braid_kernels::test_on_devices!(
    llava_mlp_projector,
    spatial_merge_projector,
    audio_projector,
    projector_errors,
);
