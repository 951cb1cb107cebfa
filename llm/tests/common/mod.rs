//! Shared test helpers: fixture paths, tiny random configs, parameter access by name,
//! the relative-error measure, and a thread-based `Comm` for 2-rank tests.
#![allow(dead_code, clippy::unwrap_used, clippy::expect_used)]

use std::path::PathBuf;

use braid_kernels::Tensor;
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
