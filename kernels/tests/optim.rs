//! AdamW against `torch.optim.AdamW`'s update written out in f64, over several steps
//! with weight decay; a hand-computed fixture; argument errors; determinism.

use braid_kernels::ops::{self, AdamWSpec};
use braid_kernels::rng::Rng;
use braid_kernels::testing::assert_close;
use braid_kernels::{DType, Device, Error, Result, Tensor};

/// Hyperparameters as PyTorch holds them: Python floats (f64) of the decimals written.
#[derive(Clone, Copy, Debug)]
struct Hyper {
    lr: f64,
    wd: f64,
    b1: f64,
    b2: f64,
    eps: f64,
}

impl Hyper {
    fn new(lr: f64, wd: f64) -> Self {
        Hyper {
            lr,
            wd,
            b1: 0.9,
            b2: 0.999,
            eps: 1e-8,
        }
    }

    /// The same step as an `AdamWSpec` (its fields are f32).
    fn spec(&self, step: u64) -> AdamWSpec {
        AdamWSpec {
            lr: self.lr as f32,
            beta1: self.b1 as f32,
            beta2: self.b2 as f32,
            eps: self.eps as f32,
            weight_decay: self.wd as f32,
            step,
        }
    }
}

/// One step of torch.optim.AdamW (amsgrad = False, maximize = False) in f64:
/// ```text
/// p = p * (1 - lr * wd)
/// m = beta1 * m + (1 - beta1) * g
/// v = beta2 * v + (1 - beta2) * g^2
/// p = p - lr / (1 - beta1^t) * m / (sqrt(v) / sqrt(1 - beta2^t) + eps)
/// ```
fn adamw_ref(p: &mut [f64], g: &[f32], m: &mut [f64], v: &mut [f64], h: Hyper, step: u64) {
    let Hyper {
        lr,
        wd,
        b1,
        b2,
        eps,
    } = h;
    let t = step as i32;
    let step_size = lr / (1.0 - b1.powi(t));
    let bc2_sqrt = (1.0 - b2.powi(t)).sqrt();
    for i in 0..p.len() {
        let g = f64::from(g[i]);
        p[i] *= 1.0 - lr * wd;
        m[i] = b1 * m[i] + (1.0 - b1) * g;
        v[i] = b2 * v[i] + (1.0 - b2) * g * g;
        p[i] -= step_size * m[i] / (v[i].sqrt() / bc2_sqrt + eps);
    }
}

fn spec(lr: f32, weight_decay: f32, step: u64) -> AdamWSpec {
    AdamWSpec {
        lr,
        beta1: 0.9,
        beta2: 0.999,
        eps: 1e-8,
        weight_decay,
        step,
    }
}

fn to_f32(v: &[f64]) -> Vec<f32> {
    v.iter().map(|&a| a as f32).collect()
}

/// Several steps with fresh gradients each step, with and without weight decay, on a
/// tensor large enough for the parallel path; param, m and v all checked every step.
fn adamw_matches_reference_over_steps(dev: Device) -> Result<()> {
    let mut rng = Rng::new(1);
    for (n, lr, wd) in [(37, 1e-2, 0.1), (40_000, 3e-3, 0.0), (40_000, 1e-3, 0.05)] {
        let h = Hyper::new(lr, wd);
        let p0 = rng.normal_vec(n, 1.0);
        let mut p = Tensor::from_vec(p0.clone(), [n], dev)?;
        let mut m = Tensor::zeros([n], DType::F32, dev)?;
        let mut v = Tensor::zeros([n], DType::F32, dev)?;
        let mut rp: Vec<f64> = p0.iter().map(|&a| f64::from(a)).collect();
        let (mut rm, mut rv) = (vec![0.0f64; n], vec![0.0f64; n]);
        for step in 1..=6 {
            let g = rng.normal_vec(n, 0.5);
            let gt = Tensor::from_vec(g.clone(), [n], dev)?;
            ops::adamw_step(&mut p, &gt, &mut m, &mut v, &h.spec(step))?;
            adamw_ref(&mut rp, &g, &mut rm, &mut rv, h, step);
            let what = format!("n{n} lr{lr} wd{wd} step {step}");
            assert_close(
                &format!("param {what}"),
                &p.to_vec_f32()?,
                &to_f32(&rp),
                1e-6,
                1e-5,
            );
            assert_close(
                &format!("m {what}"),
                &m.to_vec_f32()?,
                &to_f32(&rm),
                1e-7,
                1e-5,
            );
            assert_close(
                &format!("v {what}"),
                &v.to_vec_f32()?,
                &to_f32(&rv),
                1e-9,
                1e-5,
            );
        }
    }
    Ok(())
}

/// A scalar worked by hand: lr 0.1, betas (0.9, 0.999), eps 1e-8, wd 0.01, p0 = 1,
/// grads 0.5, -0.25, 2.0. Step 1:
/// p = 1 * (1 - 0.1 * 0.01) = 0.999; m = 0.1 * 0.5 = 0.05; v = 0.001 * 0.25 = 2.5e-4;
/// m̂ = 0.05 / 0.1 = 0.5; sqrt(v̂) = sqrt(2.5e-4 / 0.001) = 0.5;
/// p = 0.999 - 0.1 * 0.5 / (0.5 + 1e-8) = 0.899000002.
/// Steps 2 and 3 are the same arithmetic (t = 2: 1 - b1^2 = 0.19, 1 - b2^2 = 0.001999).
fn adamw_hand_fixture(dev: Device) -> Result<()> {
    let want = [
        // (param, m, v) after each step
        (0.899000002f64, 0.05f64, 2.5e-4f64),
        (0.8714672987058463, 0.02, 3.1225e-4),
        (0.8035310672284472, 0.218, 4.31193775e-3),
    ];
    let mut p = Tensor::from_vec(vec![1.0], [1], dev)?;
    let mut m = Tensor::zeros([1], DType::F32, dev)?;
    let mut v = Tensor::zeros([1], DType::F32, dev)?;
    for (step, (g, (wp, wm, wv))) in [0.5f32, -0.25, 2.0].into_iter().zip(want).enumerate() {
        let s = spec(0.1, 0.01, step as u64 + 1);
        ops::adamw_step(
            &mut p,
            &Tensor::from_vec(vec![g], [1], dev)?,
            &mut m,
            &mut v,
            &s,
        )?;
        let what = format!("step {}", step + 1);
        assert_close(
            &format!("p {what}"),
            &p.to_vec_f32()?,
            &[wp as f32],
            0.0,
            2e-6,
        );
        assert_close(
            &format!("m {what}"),
            &m.to_vec_f32()?,
            &[wm as f32],
            0.0,
            2e-6,
        );
        assert_close(
            &format!("v {what}"),
            &v.to_vec_f32()?,
            &[wv as f32],
            0.0,
            2e-6,
        );
    }
    Ok(())
}

/// Weight decay is decoupled: with a zero gradient (and zero state) the update is
/// exactly the decay, `p * (1 - lr wd)`, not an L2 term divided by sqrt(v).
fn adamw_weight_decay_is_decoupled(dev: Device) -> Result<()> {
    let p0 = vec![1.0f32, -2.0, 0.5];
    let mut p = Tensor::from_vec(p0.clone(), [3], dev)?;
    let mut m = Tensor::zeros([3], DType::F32, dev)?;
    let mut v = Tensor::zeros([3], DType::F32, dev)?;
    let g = Tensor::zeros([3], DType::F32, dev)?;
    ops::adamw_step(&mut p, &g, &mut m, &mut v, &spec(0.1, 0.5, 1))?;
    let want: Vec<f32> = p0.iter().map(|a| a * (1.0 - 0.05)).collect();
    assert_close("decay only", &p.to_vec_f32()?, &want, 0.0, 1e-7);
    Ok(())
}

fn adamw_errors(dev: Device) -> Result<()> {
    let n = 4;
    let mut p = Tensor::zeros([n], DType::F32, dev)?;
    let mut m = Tensor::zeros([n], DType::F32, dev)?;
    let mut v = Tensor::zeros([n], DType::F32, dev)?;
    let g = Tensor::zeros([n], DType::F32, dev)?;
    let ok = spec(1e-3, 0.1, 1);
    // Values.
    for bad in [
        spec(1e-3, 0.1, 0),
        spec(-1e-3, 0.1, 1),
        spec(f32::NAN, 0.1, 1),
        spec(1e-3, -0.1, 1),
        AdamWSpec { beta1: 1.0, ..ok },
        AdamWSpec { beta2: -0.1, ..ok },
        AdamWSpec { eps: -1.0, ..ok },
    ] {
        let r = ops::adamw_step(&mut p, &g, &mut m, &mut v, &bad);
        assert!(
            matches!(r, Err(Error::Invalid { .. })),
            "{bad:?} gave {r:?}"
        );
    }
    // Shapes.
    let g5 = Tensor::zeros([5], DType::F32, dev)?;
    assert!(matches!(
        ops::adamw_step(&mut p, &g5, &mut m, &mut v, &ok),
        Err(Error::Shape { .. })
    ));
    let mut v22 = Tensor::zeros([2, 2], DType::F32, dev)?;
    assert!(matches!(
        ops::adamw_step(&mut p, &g, &mut m, &mut v22, &ok),
        Err(Error::Shape { .. })
    ));
    // Dtypes: all four must be f32 (bf16 grad, u32 m, bf16 param).
    let gbf = ops::cast(&g, DType::BF16)?;
    assert!(matches!(
        ops::adamw_step(&mut p, &gbf, &mut m, &mut v, &ok),
        Err(Error::DType { .. })
    ));
    let mut mu = Tensor::from_vec_u32(vec![0; n], [n], dev)?;
    assert!(matches!(
        ops::adamw_step(&mut p, &g, &mut mu, &mut v, &ok),
        Err(Error::DType { .. })
    ));
    let mut pbf = ops::cast(&p, DType::BF16)?;
    assert!(matches!(
        ops::adamw_step(&mut pbf, &g, &mut m, &mut v, &ok),
        Err(Error::DType { .. })
    ));
    // Nothing was touched by the failed calls.
    assert!(
        p.to_vec_f32()?
            .iter()
            .chain(&m.to_vec_f32()?)
            .all(|&a| a == 0.0)
    );
    Ok(())
}

fn adamw_deterministic(dev: Device) -> Result<()> {
    let mut rng = Rng::new(2);
    let n = 50_000;
    let p0 = rng.normal_vec(n, 1.0);
    let g = Tensor::from_vec(rng.normal_vec(n, 1.0), [n], dev)?;
    let run = || -> Result<[Vec<f32>; 3]> {
        let mut p = Tensor::from_vec(p0.clone(), [n], dev)?;
        let mut m = Tensor::zeros([n], DType::F32, dev)?;
        let mut v = Tensor::zeros([n], DType::F32, dev)?;
        for step in 1..=3 {
            ops::adamw_step(&mut p, &g, &mut m, &mut v, &spec(1e-2, 0.1, step))?;
        }
        Ok([p.to_vec_f32()?, m.to_vec_f32()?, v.to_vec_f32()?])
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
    adamw_matches_reference_over_steps,
    adamw_hand_fixture,
    adamw_weight_decay_is_decoupled,
    adamw_errors,
    adamw_deterministic,
);
