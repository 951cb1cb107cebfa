//! Rotary position embedding: forward against Hugging Face's `q * cos + rotate_half(q) * sin`
//! (full-width, duplicated-half tables), positions, backward by finite differences and
//! as the inverse rotation, errors, determinism.

use braid_kernels::assert_err;
use braid_kernels::ops::{self, rope_bwd, rope_fwd};
use braid_kernels::rng::Rng;
use braid_kernels::testing::in_pool;
use braid_kernels::testing::{FdTolerance, assert_close, check_grad, dot};
use braid_kernels::{DType, Device, Error, Result, Tensor};

fn tensor(v: &[f32], shape: &[usize], dev: Device) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape, dev)
}

/// cos/sin tables (T, R/2) as Llama builds them: angle = pos * theta^(-2i/R).
fn tables(positions: &[usize], r: usize, theta: f64) -> (Vec<f32>, Vec<f32>) {
    let (mut cos, mut sin) = (vec![], vec![]);
    for &p in positions {
        for i in 0..r / 2 {
            let angle = p as f64 * theta.powf(-((2 * i) as f64) / r as f64);
            cos.push(angle.cos() as f32);
            sin.push(angle.sin() as f32);
        }
    }
    (cos, sin)
}

/// Hugging Face's `apply_rotary_pos_emb` in f64 with partial rotary: on the first R
/// channels of each head, `q * cos_full + rotate_half(q) * sin_full` where the full
/// tables repeat the half ones (`torch.cat((freqs, freqs), -1)`) and
/// `rotate_half(q) = cat(-q[R/2:], q[:R/2])`; the other channels pass through.
fn hf_rope(x: &[f32], cos: &[f32], sin: &[f32], t: usize, nh: usize, hs: usize) -> Vec<f32> {
    let half = cos.len() / t;
    let r = 2 * half;
    let mut out = x.to_vec();
    for ti in 0..t {
        let cos_full: Vec<f64> = (0..r).map(|i| cos[ti * half + i % half] as f64).collect();
        let sin_full: Vec<f64> = (0..r).map(|i| sin[ti * half + i % half] as f64).collect();
        for h in 0..nh {
            let base = (ti * nh + h) * hs;
            let q: Vec<f64> = x[base..base + r].iter().map(|&v| v as f64).collect();
            let rot: Vec<f64> = (0..r)
                .map(|i| if i < half { -q[i + half] } else { q[i - half] })
                .collect();
            for i in 0..r {
                out[base + i] = (q[i] * cos_full[i] + rot[i] * sin_full[i]) as f32;
            }
        }
    }
    out
}

fn rope_fwd_matches_hf_formula(dev: Device) -> Result<()> {
    let mut rng = Rng::new(31);
    let (t, nh, hs) = (5, 3, 8);
    let positions = [0, 1, 2, 7, 100];
    for r in [8, 4, 2] {
        let x = rng.normal_vec(t * nh * hs, 1.0);
        let (cos, sin) = tables(&positions, r, 10_000.0);
        let y = rope_fwd(
            &tensor(&x, &[t, nh, hs], dev)?,
            &tensor(&cos, &[t, r / 2], dev)?,
            &tensor(&sin, &[t, r / 2], dev)?,
        )?;
        assert_eq!(y.dims(), &[t, nh, hs]);
        let y = y.to_vec_f32()?;
        assert_close(
            &format!("rope R={r}"),
            &y,
            &hf_rope(&x, &cos, &sin, t, nh, hs),
            1e-6,
            1e-6,
        );
        // Channels >= R pass through bit for bit.
        for (i, (&a, &b)) in y.iter().zip(&x).enumerate() {
            if i % hs >= r {
                assert_eq!(
                    a.to_bits(),
                    b.to_bits(),
                    "channel {} moved (R = {r})",
                    i % hs
                );
            }
        }
    }
    Ok(())
}

fn rope_positions_rotate_differently(dev: Device) -> Result<()> {
    let (nh, hs) = (2, 6);
    let positions = [0, 1, 5, 5];
    let t = positions.len();
    let head: Vec<f32> = (0..hs).map(|i| 0.3 + i as f32 * 0.25).collect();
    // The same vector at every token and head.
    let x: Vec<f32> = head.iter().copied().cycle().take(t * nh * hs).collect();
    let (cos, sin) = tables(&positions, hs, 100.0);
    let y = rope_fwd(
        &tensor(&x, &[t, nh, hs], dev)?,
        &tensor(&cos, &[t, hs / 2], dev)?,
        &tensor(&sin, &[t, hs / 2], dev)?,
    )?
    .to_vec_f32()?;
    let tok = |i: usize| &y[i * nh * hs..i * nh * hs + hs];
    assert_close("position 0 is the identity", tok(0), &head, 1e-7, 0.0);
    assert!(tok(1) != tok(2), "positions 1 and 5 rotate alike");
    assert!(tok(0) != tok(1), "positions 0 and 1 rotate alike");
    assert_eq!(tok(2), tok(3), "equal positions must rotate alike");
    // A rotation keeps the norm of every (i, i + R/2) pair.
    for i in 0..hs / 2 {
        let before = head[i].hypot(head[i + hs / 2]);
        let after = tok(2)[i].hypot(tok(2)[i + hs / 2]);
        assert!(
            (before - after).abs() < 1e-5,
            "pair {i}: |{before}| -> |{after}|"
        );
    }
    Ok(())
}

fn rope_bwd_finite_differences(dev: Device) -> Result<()> {
    let mut rng = Rng::new(32);
    let (t, nh, hs, r) = (3, 2, 6, 4);
    let x = rng.normal_vec(t * nh * hs, 1.0);
    let dy = rng.normal_vec(t * nh * hs, 1.0);
    let (cos, sin) = tables(&[2, 0, 9], r, 50.0);
    let (ct, st) = (
        tensor(&cos, &[t, r / 2], dev)?,
        tensor(&sin, &[t, r / 2], dev)?,
    );
    let dx = rope_bwd(&tensor(&dy, &[t, nh, hs], dev)?, &ct, &st)?;
    assert_eq!(dx.dims(), &[t, nh, hs]);
    let dx = dx.to_vec_f32()?;
    check_grad("rope dx", &x, &dx, FdTolerance::default(), |xp| {
        Ok(dot(
            &rope_fwd(&tensor(xp, &[t, nh, hs], dev)?, &ct, &st)?.to_vec_f32()?,
            &dy,
        ))
    })?;
    // The backward is the rotation by -theta, element by element.
    let half = r / 2;
    for ti in 0..t {
        for h in 0..nh {
            let base = (ti * nh + h) * hs;
            for i in 0..half {
                let (c, s) = (cos[ti * half + i], sin[ti * half + i]);
                let (a, b) = (dy[base + i], dy[base + i + half]);
                assert!((dx[base + i] - (a * c + b * s)).abs() < 1e-6);
                assert!((dx[base + i + half] - (b * c - a * s)).abs() < 1e-6);
            }
        }
    }
    // And undoes the forward.
    let xt = tensor(&x, &[t, nh, hs], dev)?;
    let back = rope_bwd(&rope_fwd(&xt, &ct, &st)?, &ct, &st)?;
    assert_close("rope_bwd(rope_fwd(x))", &back.to_vec_f32()?, &x, 1e-6, 1e-6);
    Ok(())
}

fn rope_errors(dev: Device) -> Result<()> {
    let x = Tensor::full(1.0, [4, 2, 8], dev)?;
    let cs = Tensor::full(0.5, [4, 3], dev)?;
    assert_err!(
        rope_fwd(&Tensor::full(1.0, [4, 16], dev)?, &cs, &cs),
        Error::Shape { .. }
    );
    assert_err!(
        rope_fwd(
            &x,
            &Tensor::full(0.5, [3, 3], dev)?,
            &Tensor::full(0.5, [3, 3], dev)?
        ),
        Error::Shape { .. }
    );
    assert_err!(
        rope_fwd(&x, &cs, &Tensor::full(0.5, [4, 2], dev)?),
        Error::Shape { .. }
    );
    // R = 10 > HS = 8, and R = 0.
    let wide = Tensor::full(0.5, [4, 5], dev)?;
    assert_err!(rope_fwd(&x, &wide, &wide), Error::Shape { .. });
    let none = Tensor::zeros([4, 0], DType::F32, dev)?;
    assert_err!(rope_fwd(&x, &none, &none), Error::Shape { .. });
    assert_err!(
        rope_fwd(&x, &Tensor::full(0.5, [12], dev)?, &cs),
        Error::Shape { .. }
    );
    let ucs = Tensor::from_vec_u32(vec![0; 12], [4, 3], dev)?;
    assert_err!(rope_fwd(&x, &ucs, &ucs), Error::DType { .. });
    assert_err!(rope_fwd(&x, &cs, &ucs), Error::DType { .. });
    let xb = ops::cast(&x, DType::BF16)?;
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(rope_fwd(&xb, &cs, &cs).is_ok());
    assert!(rope_bwd(&xb, &cs, &cs).is_ok());
    let csb = ops::cast(&cs, DType::BF16)?;
    // bf16 computes on every device (the CPU widens it to f32 and rounds once).
    assert!(rope_fwd(&x, &csb, &csb).is_ok());
    assert_err!(
        rope_bwd(&Tensor::full(1.0, [5, 2, 8], dev)?, &cs, &cs),
        Error::Shape { .. }
    );
    Ok(())
}

fn rope_deterministic_across_threads(dev: Device) -> Result<()> {
    let mut rng = Rng::new(33);
    let (t, nh, hs, r) = (256, 4, 64, 48);
    let positions: Vec<usize> = (0..t).collect();
    let (cos, sin) = tables(&positions, r, 10_000.0);
    let (ct, st) = (
        tensor(&cos, &[t, r / 2], dev)?,
        tensor(&sin, &[t, r / 2], dev)?,
    );
    let x = Tensor::randn([t, nh, hs], 1.0, &mut rng, dev)?;
    let run = || -> Result<Vec<Vec<f32>>> {
        Ok(vec![
            rope_fwd(&x, &ct, &st)?.to_vec_f32()?,
            rope_bwd(&x, &ct, &st)?.to_vec_f32()?,
        ])
    };
    let one = in_pool(1, run)?;
    let four = in_pool(4, run)?;
    assert!(
        one == four && four == run()?,
        "rope depends on the thread count"
    );
    Ok(())
}

braid_kernels::test_on_devices!(
    rope_fwd_matches_hf_formula,
    rope_positions_rotate_differently,
    rope_bwd_finite_differences,
    rope_errors,
    rope_deterministic_across_threads,
);
