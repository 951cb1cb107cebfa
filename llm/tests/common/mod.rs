//! Shared test helpers: fixture paths, tiny random configs, parameter access by name,
//! the relative-error measure, and a thread-based `Comm` for 2-rank tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;
use std::sync::{Arc, Barrier, Mutex};

use braid_comm::{Comm, CommError};
use braid_kernels::{Shape, Tensor};
use braid_llm::{Family, LlmConfig, RopeScaling, RopeSpec};
use braid_nn::Module;

pub type TestResult<T = ()> = Result<T, Box<dyn std::error::Error>>;

/// `tests/fixtures/hf/<case>` of the workspace.
pub fn fixture(case: &str) -> PathBuf {
    PathBuf::from(concat!(env!("CARGO_MANIFEST_DIR"), "/../tests/fixtures/hf")).join(case)
}

/// A fresh, empty temporary directory for one test.
pub fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-llm-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// `max |a - b| / max(max |b|, 1e-12)`: the error relative to the reference's scale,
/// the measure the parity tolerances (1e-4 forward, 1e-3 backward) are stated in.
pub fn rel_err(got: &[f32], want: &[f32]) -> f32 {
    assert_eq!(got.len(), want.len(), "lengths differ");
    let scale = want.iter().fold(0.0f32, |m, x| m.max(x.abs())).max(1e-12);
    let diff = got.iter().zip(want).fold(0.0f32, |m, (a, b)| {
        if (a - b).is_nan() {
            f32::NAN
        } else {
            m.max((a - b).abs())
        }
    });
    diff / scale
}

/// A tiny Llama-style config (GQA 4/2, head 4) for finite differences and stage tests;
/// `bias` puts biases on q/k/v/o (Llama's `attention_bias`).
pub fn tiny_config(tie: bool, bias: bool) -> LlmConfig {
    LlmConfig {
        family: Family::Llama,
        vocab: 11,
        hidden: 8,
        intermediate: 12,
        layers: 3,
        heads: 4,
        kv_heads: 2,
        head_dim: 4,
        rms_norm_eps: 1e-5,
        max_position_embeddings: 32,
        rope: RopeSpec {
            theta: 10_000.0,
            scaling: RopeScaling::Default,
        },
        tie_embeddings: tie,
        qkv_bias: bias,
        o_bias: bias,
        mlp_bias: false,
    }
}

/// (name, value) of every parameter on the host.
pub fn values<M: Module>(m: &M) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| out.push((p.name.clone(), p.value.to_vec_f32().unwrap())));
    out
}

/// (name, grad) of every trainable parameter on the host.
pub fn grads<M: Module>(m: &M) -> Vec<(String, Vec<f32>)> {
    let mut out = Vec::new();
    m.visit_params(&mut |p| {
        if let Some(g) = &p.grad {
            out.push((p.name.clone(), g.to_vec_f32().unwrap()));
        }
    });
    out
}

/// Replaces the value of parameter `name`.
pub fn set_param<M: Module>(m: &mut M, name: &str, data: &[f32]) {
    let mut found = false;
    m.visit_params_mut(&mut |p| {
        if p.name == name {
            p.value =
                Tensor::from_vec(data.to_vec(), p.value.shape().clone(), p.value.device()).unwrap();
            found = true;
        }
    });
    assert!(found, "no parameter {name}");
}

fn unsupported(op: &'static str) -> CommError {
    CommError::Invalid {
        op,
        rank: 0,
        size: 0,
        msg: "not supported by this test comm".into(),
    }
}

/// Ranks as threads (f32, CPU): all-reduce sums in rank order, all-gather stacks along
/// dim 0. The minimal part of nn's test comm, until braid-comm's `LocalComm` lands.
#[derive(Debug)]
pub struct ThreadRank {
    rank: usize,
    size: usize,
    slots: Arc<Mutex<Vec<Option<Vec<f32>>>>>,
    barrier: Arc<Barrier>,
}

impl ThreadRank {
    /// The `size` ranks of one group.
    pub fn group(size: usize) -> Vec<ThreadRank> {
        let slots = Arc::new(Mutex::new(vec![None; size]));
        let barrier = Arc::new(Barrier::new(size));
        (0..size)
            .map(|rank| ThreadRank {
                rank,
                size,
                slots: Arc::clone(&slots),
                barrier: Arc::clone(&barrier),
            })
            .collect()
    }

    /// Every rank's `data`, in rank order.
    fn exchange(&self, data: Vec<f32>) -> Vec<Vec<f32>> {
        self.slots.lock().unwrap()[self.rank] = Some(data);
        self.barrier.wait();
        let all = self
            .slots
            .lock()
            .unwrap()
            .iter()
            .map(|s| s.clone().unwrap())
            .collect();
        // Nobody overwrites a slot before every rank has read them all.
        self.barrier.wait();
        all
    }
}

impl Comm for ThreadRank {
    fn rank(&self) -> usize {
        self.rank
    }
    fn size(&self) -> usize {
        self.size
    }
    fn all_reduce_sum(&self, t: &mut Tensor) -> braid_comm::Result<()> {
        let all = self.exchange(t.to_vec_f32()?);
        let mut sum = all[0].clone();
        for v in &all[1..] {
            sum.iter_mut().zip(v).for_each(|(s, x)| *s += x);
        }
        *t = Tensor::from_vec(sum, t.shape().clone(), t.device())?;
        Ok(())
    }
    fn all_gather(&self, t: &Tensor) -> braid_comm::Result<Tensor> {
        let all = self.exchange(t.to_vec_f32()?);
        let mut dims = t.dims().to_vec();
        dims[0] *= self.size;
        Ok(Tensor::from_vec(all.concat(), dims, t.device())?)
    }
    fn reduce_scatter_sum(&self, _t: &Tensor) -> braid_comm::Result<Tensor> {
        Err(unsupported("reduce_scatter_sum"))
    }
    fn broadcast(&self, _t: &mut Tensor, _root: usize) -> braid_comm::Result<()> {
        Err(unsupported("broadcast"))
    }
    fn send(&self, _t: &Tensor, _dst: usize) -> braid_comm::Result<()> {
        Err(unsupported("send"))
    }
    fn recv(&self, _shape: &Shape, _src: usize) -> braid_comm::Result<Tensor> {
        Err(unsupported("recv"))
    }
    fn all_to_all_v(&self, _parts: Vec<Tensor>) -> braid_comm::Result<Vec<Tensor>> {
        Err(unsupported("all_to_all_v"))
    }
    fn barrier(&self) -> braid_comm::Result<()> {
        self.barrier.wait();
        Ok(())
    }
}
