//! The mixed-precision tests' inputs and checks: bf16-representable values, and the
//! tolerances of bf16 outputs and f32 accumulators (see the test file's header).

use braid_kernels::ops;
use braid_kernels::rng::Rng;
use braid_kernels::{DType, Device, Result, Tensor};
use half::bf16;

/// `v` rounded to bf16 and back: the values a bf16 tensor holds.
pub fn rounded(v: &[f32]) -> Vec<f32> {
    v.iter().map(|&x| bf16::from_f32(x).to_f32()).collect()
}

/// Random normal values already representable in bf16, so the f32 reference and the
/// bf16 run see the same inputs.
pub fn values(rng: &mut Rng, n: usize, std: f32) -> Vec<f32> {
    rounded(&rng.normal_vec(n, std))
}

pub fn f32_cpu(v: &[f32], shape: &[usize]) -> Result<Tensor> {
    Tensor::from_vec(v.to_vec(), shape, Device::Cpu)
}

pub fn bf16_on(v: &[f32], shape: &[usize], dev: Device) -> Result<Tensor> {
    ops::cast(&Tensor::from_vec(v.to_vec(), shape, dev)?, DType::BF16)
}

/// Asserts `got` (any dtype, any device) is within `rel * max|want|` of `want`.
#[track_caller]
pub fn close(what: &str, got: &Tensor, want: &Tensor, rel: f32) -> Result<()> {
    assert_eq!(got.dims(), want.dims(), "{what}: shapes differ");
    let (g, w) = (got.to_vec_f32()?, want.to_vec_f32()?);
    let scale = w.iter().fold(0f32, |m, x| m.max(x.abs())).max(1e-30);
    for (i, (a, b)) in g.iter().zip(&w).enumerate() {
        let err = (a - b).abs();
        assert!(
            err <= rel * scale,
            "{what}: element {i} is {a}, reference {b}: |diff| {err} > {rel} x max|ref| {scale}"
        );
    }
    Ok(())
}

/// On the CPU, a bf16 result is exactly the f32 reference rounded once.
#[track_caller]
pub fn exact_on_cpu(what: &str, dev: Device, got: &Tensor, want: &Tensor) -> Result<()> {
    if dev != Device::Cpu {
        return Ok(());
    }
    assert_eq!(got.dtype(), DType::BF16, "{what}: expected a bf16 result");
    let want = ops::cast(want, DType::BF16)?;
    assert_eq!(
        got.to_host()?,
        want.to_host()?,
        "{what}: not the f32 result rounded once"
    );
    Ok(())
}

/// bf16 output check: dtype, tolerance, and exactness on the CPU.
#[track_caller]
pub fn bf16_out(what: &str, dev: Device, got: &Tensor, want: &Tensor) -> Result<()> {
    assert_eq!(got.dtype(), DType::BF16, "{what}: dtype");
    assert_eq!(got.device(), dev, "{what}: device");
    close(what, got, want, 2e-2)?;
    exact_on_cpu(what, dev, got, want)
}

/// f32 accumulator check.
#[track_caller]
pub fn f32_acc(what: &str, dev: Device, got: &Tensor, want: &Tensor) -> Result<()> {
    assert_eq!(got.dtype(), DType::F32, "{what}: dtype");
    close(
        what,
        got,
        want,
        if dev == Device::Cpu { 1e-5 } else { 1e-4 },
    )
}
