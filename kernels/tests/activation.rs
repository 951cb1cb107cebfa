//! Activations, SwiGLU and softmax: forward against f64 references (erf from its
//! Taylor series and continued fraction), backward by finite differences, errors,
//! determinism.

use braid_kernels::assert_err;
use braid_kernels::ops::activation::erfc;
use braid_kernels::ops::{
    self, Activation, activation_bwd, activation_fwd, softmax_bwd, softmax_fwd, swiglu_bwd,
    swiglu_fwd,
};
use braid_kernels::rng::Rng;
use braid_kernels::testing::in_pool;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, dot};
use braid_kernels::{DType, Device, Error, Result, Tensor};

const ALL: [Activation; 4] = [
    Activation::GeluTanh,
    Activation::GeluErf,
    Activation::QuickGelu,
    Activation::Silu,
];

fn tensor(v: &[f32], shape: &[usize], dev: Device) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape, dev)
}

/// erf by its Maclaurin series, summed until the terms stop mattering (|x| <= 3,
/// where the largest term is ~1e3, so f64 keeps ~13 digits).
fn erf_series(x: f64) -> f64 {
    let (mut term, mut sum) = (x, x); // term_n = (-1)^n x^(2n+1) / n!
    for n in 1..200 {
        term *= -x * x / n as f64;
        let add = term / (2 * n + 1) as f64;
        sum += add;
        if add.abs() < 1e-18 * sum.abs() {
            break;
        }
    }
    sum * 2.0 / std::f64::consts::PI.sqrt()
}

/// erfc by its continued fraction (x >= 2), evaluated bottom-up:
/// erfc(x) = exp(-x^2)/sqrt(pi) * 1/(x + (1/2)/(x + 1/(x + (3/2)/(x + ...)))).
fn erfc_cf(x: f64) -> f64 {
    let mut f = x;
    for k in (1..400).rev() {
        f = x + (k as f64 / 2.0) / f;
    }
    (-x * x).exp() / std::f64::consts::PI.sqrt() / f
}

/// Reference erfc on the whole line, accurate to ~1e-13 relative.
fn erfc_ref(x: f64) -> f64 {
    if x < 0.0 {
        2.0 - erfc_ref(-x)
    } else if x < 2.0 {
        1.0 - erf_series(x)
    } else {
        erfc_cf(x)
    }
}

fn act_ref(act: Activation, x: f64) -> f64 {
    let sigmoid = |z: f64| 1.0 / (1.0 + (-z).exp());
    match act {
        Activation::GeluTanh => {
            let k = (2.0 / std::f64::consts::PI).sqrt();
            0.5 * x * (1.0 + (k * (x + 0.044715 * x.powi(3))).tanh())
        }
        Activation::GeluErf => 0.5 * x * erfc_ref(-x / std::f64::consts::SQRT_2),
        Activation::QuickGelu => x * sigmoid(1.702 * x),
        Activation::Silu => x * sigmoid(x),
    }
}

/// The reference erf itself against published values (Abramowitz & Stegun table 7.1).
fn erf_reference_is_right(_dev: Device) -> Result<()> {
    let known = [
        (0.5, 1.0 - 0.520_499_877_813_046_5),
        (1.0, 1.0 - 0.842_700_792_949_714_9),
        (2.0, 4.677_734_981_047_266e-3),
        (3.0, 2.209_049_699_858_544e-5),
        (5.0, 1.537_459_794_428_035e-12),
    ];
    for (x, want) in known {
        let got = erfc_ref(x);
        assert!(
            ((got - want) / want).abs() < 1e-12,
            "erfc_ref({x}) = {got}, want {want}"
        );
    }
    // The two branches agree where they meet.
    assert!(((1.0 - erf_series(2.0)) / erfc_cf(2.0) - 1.0).abs() < 1e-11);
    Ok(())
}

/// `erfc` (Numerical Recipes' Chebyshev fit) at 20001 points: |erf error| <= 1.5e-7
/// on [-6, 6] and fractional erfc error <= 1.5e-7 into the far tail [0, 9].
fn erfc_accuracy(_dev: Device) -> Result<()> {
    let (mut worst_abs, mut worst_rel) = (0.0f64, 0.0f64);
    for i in 0..=12_000 {
        let x = -6.0 + i as f64 * 1e-3;
        worst_abs = worst_abs.max((erfc(x) - erfc_ref(x)).abs());
    }
    for i in 0..=8_000 {
        let x = i as f64 * 9.0 / 8_000.0;
        let want = erfc_ref(x);
        worst_rel = worst_rel.max(((erfc(x) - want) / want).abs());
    }
    assert!(worst_abs <= 1.5e-7, "max |erf error| = {worst_abs:e}");
    assert!(
        worst_rel <= 1.5e-7,
        "max fractional erfc error = {worst_rel:e}"
    );
    Ok(())
}

fn activation_fwd_matches_reference(dev: Device) -> Result<()> {
    let mut x: Vec<f32> = (0..=2400).map(|i| -12.0 + i as f32 * 0.01).collect();
    x.extend([
        0.0, -0.0, 1e-6, -1e-6, 30.0, -30.0, 100.0, -100.0, 1e4, -1e4,
    ]);
    let xt = tensor(&x, &[x.len()], dev)?;
    for act in ALL {
        let y = activation_fwd(&xt, act)?.to_vec_f32()?;
        let want: Vec<f32> = x.iter().map(|&v| act_ref(act, v as f64) as f32).collect();
        assert_close(&format!("{act:?}"), &y, &want, 1e-6, 2e-6);
        assert!(
            y.iter().all(|v| v.is_finite()),
            "{act:?} gave a non-finite value"
        );
    }
    // Shape is kept.
    let y = activation_fwd(&Tensor::full(1.0, [2, 3, 4], dev)?, Activation::Silu)?;
    assert_eq!(y.dims(), &[2, 3, 4]);
    Ok(())
}

fn activation_bwd_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(11);
    let x: Vec<f32> = rng.uniform_vec(24, -4.0, 4.0);
    let r = rng.normal_vec(24, 1.0);
    for act in ALL {
        let dx = activation_bwd(&tensor(&r, &[4, 6], dev)?, &tensor(&x, &[4, 6], dev)?, act)?;
        assert_eq!(dx.dims(), &[4, 6]);
        check_grad(
            &format!("{act:?} dx"),
            &x,
            &dx.to_vec_f32()?,
            FdTolerance::default(),
            |xp| {
                Ok(dot(
                    &activation_fwd(&tensor(xp, &[4, 6], dev)?, act)?.to_vec_f32()?,
                    &r,
                ))
            },
        )?;
    }
    Ok(())
}

/// The analytic derivative against an f64 central difference of the f64 reference,
/// on a dense grid (tighter than the f32 FD check above).
fn activation_grad_matches_reference(dev: Device) -> Result<()> {
    let x: Vec<f32> = (0..=1600).map(|i| -8.0 + i as f32 * 0.01).collect();
    let ones = vec![1.0; x.len()];
    for act in ALL {
        let g = activation_bwd(
            &tensor(&ones, &[x.len()], dev)?,
            &tensor(&x, &[x.len()], dev)?,
            act,
        )?;
        let h = 1e-5;
        let want: Vec<f32> = x
            .iter()
            .map(|&v| {
                let v = v as f64;
                ((act_ref(act, v + h) - act_ref(act, v - h)) / (2.0 * h)) as f32
            })
            .collect();
        assert_close(&format!("{act:?}'"), &g.to_vec_f32()?, &want, 2e-5, 1e-5);
    }
    Ok(())
}

fn swiglu_matches_reference_and_fd(dev: Device) -> Result<()> {
    let mut rng = Rng::new(12);
    let (g, u, r) = (
        rng.normal_vec(15, 2.0),
        rng.normal_vec(15, 1.0),
        rng.normal_vec(15, 1.0),
    );
    let (gt, ut) = (tensor(&g, &[3, 5], dev)?, tensor(&u, &[3, 5], dev)?);
    let y = swiglu_fwd(&gt, &ut)?;
    assert_eq!(y.dims(), &[3, 5]);
    let want: Vec<f32> = g
        .iter()
        .zip(&u)
        .map(|(&g, &u)| (act_ref(Activation::Silu, g as f64) * u as f64) as f32)
        .collect();
    assert_close("swiglu", &y.to_vec_f32()?, &want, 1e-6, 1e-6);
    let (dg, du) = swiglu_bwd(&tensor(&r, &[3, 5], dev)?, &gt, &ut)?;
    let loss = |g: &[f32], u: &[f32]| -> Result<f64> {
        let y = swiglu_fwd(&tensor(g, &[3, 5], dev)?, &tensor(u, &[3, 5], dev)?)?;
        Ok(dot(&y.to_vec_f32()?, &r))
    };
    let tol = FdTolerance::default();
    check_grad("swiglu dgate", &g, &dg.to_vec_f32()?, tol, |gp| {
        loss(gp, &u)
    })?;
    check_grad("swiglu dup", &u, &du.to_vec_f32()?, tol, |up| loss(&g, up))?;
    Ok(())
}

fn softmax_matches_reference(dev: Device) -> Result<()> {
    let mut rng = Rng::new(13);
    let c = 7;
    let mut x = rng.normal_vec(4 * c, 3.0);
    // Logits that overflow exp() without the max subtraction, and a -inf (masked) entry.
    x[c..2 * c].iter_mut().for_each(|v| *v += 1000.0);
    x[2 * c + 3] = f32::NEG_INFINITY;
    let y = softmax_fwd(&tensor(&x, &[2, 2, c], dev)?)?;
    assert_eq!(y.dims(), &[2, 2, c]);
    let y = y.to_vec_f32()?;
    let mut want = vec![];
    for row in x.chunks(c) {
        let m = row.iter().fold(f64::NEG_INFINITY, |m, &v| m.max(v as f64));
        let e: Vec<f64> = row.iter().map(|&v| (v as f64 - m).exp()).collect();
        let s: f64 = e.iter().sum();
        want.extend(e.iter().map(|v| (v / s) as f32));
    }
    assert_close("softmax", &y, &want, 1e-7, 1e-5);
    assert_eq!(y[2 * c + 3], 0.0);
    for row in y.chunks(c) {
        let s: f32 = row.iter().sum();
        assert!((s - 1.0).abs() < 1e-5, "row sums to {s}");
    }
    Ok(())
}

fn softmax_bwd_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(14);
    let (x, r) = (rng.normal_vec(12, 1.5), rng.normal_vec(12, 1.0));
    let y = softmax_fwd(&tensor(&x, &[3, 4], dev)?)?;
    let dx = softmax_bwd(&tensor(&r, &[3, 4], dev)?, &y)?;
    assert_eq!(dx.dims(), &[3, 4]);
    check_grad(
        "softmax dx",
        &x,
        &dx.to_vec_f32()?,
        FdTolerance::default(),
        |xp| {
            Ok(dot(
                &softmax_fwd(&tensor(xp, &[3, 4], dev)?)?.to_vec_f32()?,
                &r,
            ))
        },
    )?;
    Ok(())
}

fn activation_errors(dev: Device) -> Result<()> {
    let x = Tensor::full(0.5, [2, 3], dev)?;
    let x32 = Tensor::full(0.5, [3, 2], dev)?;
    let ids = Tensor::from_vec_u32(vec![1; 6], [2, 3], dev)?;
    let xb = ops::cast(&x, DType::BF16)?;
    for act in ALL {
        assert_err!(activation_fwd(&ids, act), Error::DType { .. });
        // bf16 computes on every device (the CPU widens it to f32 and rounds once).
        assert!(activation_fwd(&xb, act).is_ok());
        assert_err!(activation_bwd(&x32, &x, act), Error::Shape { .. });
        assert_err!(activation_bwd(&xb, &x, act), Error::DType { .. });
        // bf16 computes on every device (the CPU widens it to f32 and rounds once).
        assert!(activation_bwd(&xb, &xb, act).is_ok());
    }
    assert_err!(swiglu_fwd(&x, &x32), Error::Shape { .. });
    assert_err!(swiglu_fwd(&x, &ids), Error::DType { .. });
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(swiglu_fwd(&xb, &xb).is_ok());
    assert_err!(swiglu_bwd(&x32, &x, &x), Error::Shape { .. });
    assert_err!(swiglu_bwd(&x, &x, &x32), Error::Shape { .. });
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(swiglu_bwd(&xb, &xb, &xb).is_ok());
    let scalar = Tensor::full(1.0, (), dev)?;
    assert_err!(softmax_fwd(&scalar), Error::Shape { .. });
    assert_err!(
        softmax_fwd(&Tensor::zeros([3, 0], DType::F32, dev)?),
        Error::Shape { .. }
    );
    assert_err!(softmax_fwd(&ids), Error::DType { .. });
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(softmax_fwd(&xb).is_ok());
    assert_err!(softmax_bwd(&x32, &x), Error::Shape { .. });
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(softmax_bwd(&xb, &xb).is_ok());
    // Empty inputs are fine: no rows.
    assert_eq!(
        softmax_fwd(&Tensor::zeros([0, 5], DType::F32, dev)?)?.dims(),
        &[0, 5]
    );
    assert_eq!(
        activation_fwd(&Tensor::zeros([0], DType::F32, dev)?, Activation::Silu)?.elem_count(),
        0
    );
    Ok(())
}

fn all_outputs(
    x: &Tensor,
    u: &Tensor,
    dy: &Tensor,
    sx: &Tensor,
    sdy: &Tensor,
) -> Result<Vec<Vec<f32>>> {
    let mut out = vec![];
    for act in ALL {
        out.push(activation_fwd(x, act)?.to_vec_f32()?);
        out.push(activation_bwd(dy, x, act)?.to_vec_f32()?);
    }
    out.push(swiglu_fwd(x, u)?.to_vec_f32()?);
    let (dg, du) = swiglu_bwd(dy, x, u)?;
    out.push(dg.to_vec_f32()?);
    out.push(du.to_vec_f32()?);
    let y = softmax_fwd(sx)?;
    out.push(softmax_bwd(sdy, &y)?.to_vec_f32()?);
    out.push(y.to_vec_f32()?);
    Ok(out)
}

fn activations_deterministic_across_threads(dev: Device) -> Result<()> {
    let mut rng = Rng::new(15);
    let n = 1 << 16;
    let x = Tensor::randn([n], 2.0, &mut rng, dev)?;
    let u = Tensor::randn([n], 1.0, &mut rng, dev)?;
    let dy = Tensor::randn([n], 1.0, &mut rng, dev)?;
    let sx = Tensor::randn([256, 300], 3.0, &mut rng, dev)?;
    let sdy = Tensor::randn([256, 300], 1.0, &mut rng, dev)?;
    let one = in_pool(1, || all_outputs(&x, &u, &dy, &sx, &sdy))?;
    let four = in_pool(4, || all_outputs(&x, &u, &dy, &sx, &sdy))?;
    let again = all_outputs(&x, &u, &dy, &sx, &sdy)?;
    assert!(
        one == four && four == again,
        "activation outputs depend on the thread count"
    );
    Ok(())
}

braid_kernels::test_on_devices!(
    erf_reference_is_right,
    erfc_accuracy,
    activation_fwd_matches_reference,
    activation_bwd_finite_differences,
    activation_grad_matches_reference,
    swiglu_matches_reference_and_fd,
    softmax_matches_reference,
    softmax_bwd_finite_differences,
    activation_errors,
    activations_deterministic_across_threads,
);
