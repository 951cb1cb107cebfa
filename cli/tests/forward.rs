//! `braid forward` end to end: the binary on checkpoints none of the parity tests load
//! (other sizes and seeds, a bf16 checkpoint, a sharded one), against the outputs
//! `transformers` wrote for them (`tests/fixtures/hf/unseen`, made by
//! tools/fixtures/make_fixtures.py).

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};
use std::process::Command;

use braid_kernels::Device;
use braid_nn::hf::WeightFiles;

fn fixture(case: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../tests/fixtures/hf/unseen")
        .join(case)
}

fn out_path(case: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-forward-{}", std::process::id()));
    std::fs::create_dir_all(&dir).unwrap();
    dir.join(format!("{case}.safetensors"))
}

fn braid(args: &[&str]) -> std::process::Output {
    Command::new(env!("CARGO_BIN_EXE_braid"))
        .args(args)
        .output()
        .unwrap()
}

/// Runs `braid forward` on an unseen case and compares each output tensor with the
/// reference: max |ours - ref| <= 1e-4 * max |ref|.
fn check(case: &str, names: &[&str]) {
    let dir = fixture(case);
    let out = out_path(case);
    let res = braid(&[
        "forward",
        "--model",
        dir.to_str().unwrap(),
        "--input",
        dir.join("inputs.safetensors").to_str().unwrap(),
        "--output",
        out.to_str().unwrap(),
    ]);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(
        res.status.success(),
        "braid forward failed on {case}: {stderr}"
    );
    let ours = WeightFiles::open_files(&[out]).unwrap();
    let want = WeightFiles::open_files(&[dir.join("outputs.safetensors")]).unwrap();
    for name in names {
        let w = want.load_any(name, Device::Cpu).unwrap();
        let o = ours.load_any(name, Device::Cpu).unwrap();
        assert_eq!(o.dims(), w.dims(), "{case}/{name}: shape");
        let (o, w) = (o.to_vec_f32().unwrap(), w.to_vec_f32().unwrap());
        let scale = w.iter().fold(0f32, |m, v| m.max(v.abs()));
        let err = o
            .iter()
            .zip(&w)
            .fold(0f32, |m, (a, b)| m.max((a - b).abs()));
        assert!(
            err <= 1e-4 * scale,
            "{case}/{name}: max abs err {err} vs scale {scale}"
        );
    }
}

#[test]
fn llama_bf16_checkpoint_matches_transformers() {
    check("llama", &["logits"]);
}

#[test]
fn qwen2_sharded_checkpoint_matches_transformers() {
    check("qwen2", &["logits"]);
}

#[test]
fn clip_matches_transformers() {
    check("clip", &["last_hidden_state", "pooler_output"]);
}

#[test]
fn siglip_matches_transformers() {
    check("siglip", &["last_hidden_state"]);
}

#[test]
fn whisper_matches_transformers() {
    check("whisper", &["last_hidden_state"]);
}

#[test]
fn bad_inputs_fail_with_a_clear_message() {
    let llama = fixture("llama");
    // Vision input given to an LLM.
    let res = braid(&[
        "forward",
        "--model",
        llama.to_str().unwrap(),
        "--input",
        fixture("clip").join("inputs.safetensors").to_str().unwrap(),
        "--output",
        out_path("bad").to_str().unwrap(),
    ]);
    assert!(!res.status.success());
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(err.contains("no `input_ids` tensor"), "{err}");
    // A directory that is not a model.
    let res = braid(&[
        "forward",
        "--model",
        "/nonexistent/model",
        "--input",
        "x",
        "--output",
        "y",
    ]);
    assert!(!res.status.success());
    let err = String::from_utf8_lossy(&res.stderr);
    assert!(err.contains("/nonexistent/model/config.json"), "{err}");
}
