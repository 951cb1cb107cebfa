//! Core types: tensor construction, host copies, devices, shapes, seeded RNG.

// Test bodies are plain functions run by `test_on_devices!`, outside the reach of
// clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use braid_kernels::rng::Rng;
use braid_kernels::tensor::CpuStorage;
use braid_kernels::{DType, Device, Error, Result, Shape, Tensor};

fn roundtrip_and_metadata(dev: Device) -> Result<()> {
    let t = Tensor::from_vec(vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0], [2, 3], dev)?;
    assert_eq!(t.dims(), &[2, 3]);
    assert_eq!(t.dtype(), DType::F32);
    assert_eq!(t.device(), dev);
    assert_eq!(t.elem_count(), 6);
    assert_eq!(t.to_vec_f32()?, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let r = t.reshape([3, 2])?;
    assert_eq!(r.dims(), &[3, 2]);
    assert_eq!(r.to_vec_f32()?, vec![1.0, 2.0, 3.0, 4.0, 5.0, 6.0]);
    let z = Tensor::zeros([4], DType::U32, dev)?;
    assert_eq!(z.to_vec_u32()?, vec![0; 4]);
    let mut c = r.try_clone()?;
    c.zero_()?;
    assert_eq!(c.to_vec_f32()?, vec![0.0; 6]);
    assert_eq!(r.to_vec_f32()?[5], 6.0, "try_clone is a deep copy");
    Ok(())
}

fn bad_construction_is_an_error(dev: Device) -> Result<()> {
    let e = Tensor::from_vec(vec![1.0; 5], [2, 3], dev).unwrap_err();
    assert!(matches!(e, Error::BufferLen { len: 5, .. }), "{e}");
    assert!(e.to_string().contains("[2, 3]"), "{e}");
    let t = Tensor::from_vec(vec![1.0; 6], [2, 3], dev)?;
    let e = t.reshape([4, 2]).unwrap_err();
    assert!(
        e.to_string().contains("[2, 3]") && e.to_string().contains("[4, 2]"),
        "{e}"
    );
    let t = Tensor::from_vec(vec![1.0; 6], [6], dev)?;
    assert!(matches!(
        t.to_vec_u32(),
        Err(Error::DType {
            got: DType::F32,
            ..
        })
    ));
    let ids = Tensor::from_vec_u32(vec![1, 2], [2], dev)?;
    assert!(matches!(
        ids.to_vec_f32(),
        Err(Error::DType {
            got: DType::U32,
            ..
        })
    ));
    Ok(())
}

fn bf16_cast_roundtrip(dev: Device) -> Result<()> {
    let vals = vec![1.0f32, -2.5, 3.140625, 1e-3, 65504.0, 0.0];
    let t = Tensor::from_vec(vals.clone(), [6], dev)?;
    let h = braid_kernels::ops::cast(&t, DType::BF16)?;
    assert_eq!(h.dtype(), DType::BF16);
    let back = braid_kernels::ops::cast(&h, DType::F32)?.to_vec_f32()?;
    for (a, b) in vals.iter().zip(&back) {
        // bf16 keeps 8 significant bits: relative error <= 2^-8.
        assert!((a - b).abs() <= a.abs() * (1.0 / 256.0), "{a} -> {b}");
    }
    // Values exactly representable in bf16 survive bit for bit.
    assert_eq!(&back[..3], &[1.0, -2.5, 3.140625]);
    // Round to nearest even: 1 + 2^-8 is a tie between 1 and 1 + 2^-7 -> 1.
    let tie = Tensor::from_vec(vec![1.0 + 1.0 / 256.0], [1], dev)?;
    let r = braid_kernels::ops::cast(&braid_kernels::ops::cast(&tie, DType::BF16)?, DType::F32)?;
    assert_eq!(r.to_vec_f32()?, vec![1.0]);
    let ids = Tensor::from_vec_u32(vec![1], [1], dev)?;
    assert!(matches!(
        braid_kernels::ops::cast(&ids, DType::F32),
        Err(Error::DType { op: "cast", .. })
    ));
    Ok(())
}

braid_kernels::test_on_devices!(
    roundtrip_and_metadata,
    bad_construction_is_an_error,
    bf16_cast_roundtrip
);

/// Without an NVIDIA driver, `Device::Cuda` is an error naming the missing library,
/// never a panic (cudarc panics if a context is made without libcuda: the backend checks
/// first). A GPU that does not exist is an error too.
#[test]
fn cuda_without_a_driver_is_a_clear_error() {
    if std::path::Path::new("/dev/nvidiactl").exists() {
        // A GPU machine: a missing ordinal is still an error, not a panic.
        let e = Tensor::zeros([2], DType::F32, Device::Cuda(4096)).unwrap_err();
        assert!(e.to_string().contains("cuda:4096"), "{e}");
        return;
    }
    let dev = Device::Cuda(0);
    assert!(!dev.is_available());
    assert!(
        dev.unavailable_reason()
            .is_some_and(|r| r.contains("libcuda.so"))
    );
    let e = Tensor::zeros([2], DType::F32, dev).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::DeviceUnavailable { .. }), "{msg}");
    assert!(
        msg.contains("cuda:0") && msg.contains("libcuda.so"),
        "{msg}"
    );
    assert!(Tensor::from_vec(vec![1.0], [1], dev).is_err());
    assert!(Device::Cuda(3).backend().is_err());
}

#[test]
fn host_storage_reports_its_dtype() {
    let s = CpuStorage::BF16(vec![half::bf16::ONE; 3]);
    assert_eq!(s.dtype(), DType::BF16);
    assert_eq!(s.len(), 3);
    let t = Tensor::from_host(s, [3], Device::Cpu).unwrap();
    assert_eq!(t.dtype(), DType::BF16);
    assert_eq!(t.to_vec_f32().unwrap(), vec![1.0; 3]);
}

#[test]
fn shape_helpers_name_the_problem() {
    let s = Shape::new([2, 3, 4]);
    assert_eq!(s.rows(), 6);
    assert_eq!(s.elem_count(), 24);
    assert_eq!(s.last_dim("t").unwrap(), 4);
    assert_eq!(s.dims_n::<3>("t", "x").unwrap(), [2, 3, 4]);
    let e = s.dims_n::<2>("my_op", "x").unwrap_err().to_string();
    assert!(
        e.contains("my_op") && e.contains("rank 2") && e.contains("[2, 3, 4]"),
        "{e}"
    );
    assert!(Shape::from(()).last_dim("t").is_err());
    assert_eq!(Shape::from(()).elem_count(), 1);
}

#[test]
fn named_rng_streams_are_deterministic_and_independent() {
    let a = Rng::for_name(1, "blocks.0.attn.q_proj.weight").normal_vec(64, 1.0);
    let b = Rng::for_name(1, "blocks.0.attn.q_proj.weight").normal_vec(64, 1.0);
    let c = Rng::for_name(1, "blocks.0.attn.k_proj.weight").normal_vec(64, 1.0);
    let d = Rng::for_name(2, "blocks.0.attn.q_proj.weight").normal_vec(64, 1.0);
    assert_eq!(a, b);
    assert_ne!(a, c);
    assert_ne!(a, d);
    // Roughly standard normal.
    let big = Rng::new(3).normal_vec(20_000, 2.0);
    let mean = big.iter().map(|&x| f64::from(x)).sum::<f64>() / big.len() as f64;
    let var = big
        .iter()
        .map(|&x| (f64::from(x) - mean).powi(2))
        .sum::<f64>()
        / big.len() as f64;
    assert!(mean.abs() < 0.05, "mean {mean}");
    assert!((var.sqrt() - 2.0).abs() < 0.05, "std {}", var.sqrt());
    let ids = Rng::new(4).index_vec(1000, 7);
    assert!(ids.iter().all(|&i| i < 7));
}
