//! Shared test helpers: fixture paths and readers, error measures, FD checks of modules.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use braid_encoders::weights::HostTensors;
use std::path::PathBuf;

use braid_kernels::rng::Rng;
use braid_kernels::{Device, Tensor};
use braid_nn::hf::WeightFiles;
use braid_nn::{Module, Param};

pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// `tests/fixtures/hf/<case>` of the workspace.
pub fn fixture(case: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/hf")).join(case)
}

/// Every tensor of `<case>/<file>.safetensors` as (shape, data) on the host.
pub fn read_all(case: &str, file: &str) -> TestResult<HostTensors> {
    let path = fixture(case).join(format!("{file}.safetensors"));
    let w = WeightFiles::open_files(&[path])?;
    let mut out = HostTensors::new();
    for n in w.names() {
        let t = w.load_any(n, Device::Cpu)?;
        out.insert(n.to_string(), (t.dims().to_vec(), t.to_vec_f32()?));
    }
    Ok(out)
}

/// The (shape, data) of `name` in a read file, or an error naming it.
pub fn get<'a>(m: &'a HostTensors, name: &str) -> TestResult<&'a (Vec<usize>, Vec<f32>)> {
    m.get(name)
        .ok_or_else(|| format!("fixture has no tensor {name}").into())
}

pub fn tensor(t: &(Vec<usize>, Vec<f32>), dev: Device) -> TestResult<Tensor> {
    Ok(Tensor::from_vec(t.1.clone(), t.0.clone(), dev)?)
}

/// max |a - b| / max(|b|_inf, 1e-6): the error relative to the reference's scale.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-6);
    let diff = got
        .iter()
        .zip(want)
        .fold(0.0f32, |m, (a, b)| m.max((a - b).abs()));
    diff / scale
}

/// Asserts rel_err <= tol and returns it.
#[track_caller]
pub fn check(what: &str, got: &[f32], want: &[f32], tol: f32) -> f32 {
    let e = rel_err(got, want);
    assert!(e <= tol, "{what}: relative error {e:e} > {tol:e}");
    e
}

pub fn randn(seed: u64, n: usize) -> Vec<f32> {
    Rng::new(seed).normal_vec(n, 1.0)
}

/// Finds a parameter by name.
pub fn find_param<'a, M: Module>(m: &'a M, name: &str) -> Option<&'a Param> {
    let mut found = None;
    m.visit_params(&mut |p| {
        if p.name == name {
            found = Some(p);
        }
    });
    found
}

/// Sets every element of parameter `name` to `v`.
pub fn set_param<M: Module>(m: &mut M, name: &str, v: Vec<f32>) -> TestResult {
    let mut res: TestResult = Err(format!("no parameter {name}").into());
    m.visit_params_mut(&mut |p| {
        if p.name == name {
            let dims = p.value.dims().to_vec();
            res = Tensor::from_vec(v.clone(), dims, p.value.device())
                .map(|t| p.value = t)
                .map_err(Into::into);
        }
    });
    res
}

/// (name, value, grad) of every parameter.
pub fn params_host<M: Module>(m: &M) -> Vec<(String, Vec<f32>, Option<Vec<f32>>)> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| {
        out.push((
            p.name.clone(),
            p.value.to_vec_f32().unwrap(),
            p.grad.as_ref().map(|g| g.to_vec_f32().unwrap()),
        ))
    });
    out
}
