//! Errors name what is wrong and never panic: unknown architecture, missing tensor,
//! wrong shape, bad config values, image size not a multiple of the patch, clips longer
//! than the position table.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::{Path, PathBuf};

use braid_encoders::{VisionConfig, VisionEncoder, WhisperEncoder, WhisperEncoderConfig};
use braid_kernels::{Device, Tensor, assert_err};
use braid_nn::Error;
use braid_nn::hf::{WeightFiles, save_safetensors, write_json};
use common::*;
use serde_json::{Value, json};

fn tmpdir(name: &str) -> PathBuf {
    let d = std::env::temp_dir().join(format!("braid-enc-err-{name}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&d);
    std::fs::create_dir_all(&d).unwrap();
    d
}

/// Copies a fixture's config and weights into `dst`, letting `edit` drop or replace
/// tensors.
fn copy_case(case: &str, dst: &Path, edit: &dyn Fn(&str, Tensor) -> Option<Tensor>) -> TestResult {
    std::fs::copy(fixture(case).join("config.json"), dst.join("config.json"))?;
    let w = WeightFiles::open_dir(&fixture(case))?;
    let mut kept = Vec::new();
    for n in w.names() {
        if let Some(t) = edit(n, w.load_any(n, Device::Cpu)?) {
            kept.push((n.to_string(), t));
        }
    }
    let list: Vec<(String, &Tensor)> = kept.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&dst.join("model.safetensors"), &list)?;
    Ok(())
}

fn unknown_architecture(_dev: Device) -> TestResult {
    let cfg = json!({"architectures": ["BertModel"], "hidden_size": 8});
    let e = VisionConfig::from_hf_config(&cfg).unwrap_err();
    let msg = e.to_string();
    assert!(matches!(e, Error::Config { .. }), "{e:?}");
    assert!(
        msg.contains("BertModel") && msg.contains("CLIPVisionModel") && msg.contains("SiglipModel"),
        "{msg}"
    );
    let e = WhisperEncoderConfig::from_hf_config(&cfg).unwrap_err();
    assert!(
        e.to_string().contains("WhisperForConditionalGeneration"),
        "{e}"
    );
    assert_err!(
        VisionConfig::from_hf_config(&json!({"hidden_size": 8})),
        Error::Config { .. }
    );
    Ok(())
}

fn bad_config_values(_dev: Device) -> TestResult {
    let base = || -> Value {
        serde_json::from_str(
            &std::fs::read_to_string(fixture("clip_vision").join("config.json")).unwrap(),
        )
        .unwrap()
    };
    let mut c = base();
    c["num_attention_heads"] = json!(7);
    let e = VisionConfig::from_hf_config(&c).unwrap_err();
    assert!(e.to_string().contains("num_heads"), "{e}");
    let mut c = base();
    c["hidden_act"] = json!("relu");
    let e = VisionConfig::from_hf_config(&c).unwrap_err();
    assert!(
        e.to_string().contains("hidden_act") && e.to_string().contains("relu"),
        "{e}"
    );
    let mut c = base();
    c["patch_size"] = json!(5);
    assert_err!(VisionConfig::from_hf_config(&c), Error::Config { .. });
    let mut c = base();
    c["hidden_size"] = json!("wide");
    assert_err!(VisionConfig::from_hf_config(&c), Error::Config { .. });
    // Sizes no model has: refused naming the key, before any weight is allocated (a
    // billion layers used to be built one by one until memory ran out).
    for (key, v, name) in [
        ("num_hidden_layers", json!(1_000_000_000u64), "num_layers"),
        ("intermediate_size", json!(1u64 << 62), "intermediate_size"),
        ("image_size", json!(1u64 << 32), "image_size"),
    ] {
        let mut c = base();
        c[key] = v;
        let e = VisionConfig::from_hf_config(&c).unwrap_err().to_string();
        assert!(
            e.contains(name) && e.contains("larger than any model"),
            "{e}"
        );
    }
    let mut c: Value = serde_json::from_str(
        &std::fs::read_to_string(fixture("whisper_encoder").join("config.json")).unwrap(),
    )
    .unwrap();
    c["encoder_layers"] = json!(1_000_000_000u64);
    let e = braid_encoders::WhisperEncoderConfig::from_hf_config(&c)
        .unwrap_err()
        .to_string();
    assert!(
        e.contains("encoder_layers") && e.contains("larger than any model"),
        "{e}"
    );
    // Braid's own TOML-facing config rejects unknown keys.
    let r: Result<VisionConfig, _> = serde_json::from_value(json!({
        "family": "clip", "hidden_size": 8, "intermediate_size": 8, "num_layers": 1,
        "num_heads": 2, "num_channels": 3, "image_size": 8, "patch_size": 4,
        "act": "quick_gelu", "layer_norm_eps": 1e-5, "colour": "blue"
    }));
    assert!(r.unwrap_err().to_string().contains("colour"));
    Ok(())
}

fn missing_tensor(dev: Device) -> TestResult {
    let dir = tmpdir("missing");
    let gone = "encoder.layers.1.mlp.fc2.weight";
    copy_case("clip_vision", &dir, &|n, t| (n != gone).then_some(t))?;
    let e = VisionEncoder::from_hf_dir(&dir, dev).unwrap_err();
    assert!(matches!(e, Error::Weights { .. }), "{e:?}");
    assert!(e.to_string().contains(gone), "{e}");
    // No patch embedding at all: the prefix search names what it looked for.
    let dir = tmpdir("noprefix");
    copy_case("siglip_vision", &dir, &|n, t| {
        (!n.starts_with("embeddings.patch")).then_some(t)
    })?;
    let e = VisionEncoder::from_hf_dir(&dir, dev).unwrap_err();
    assert!(
        e.to_string()
            .contains("vision_model.embeddings.patch_embedding.weight"),
        "{e}"
    );
    let dir = tmpdir("whisper-missing");
    copy_case("whisper_encoder", &dir, &|n, t| {
        (n != "encoder.layer_norm.bias").then_some(t)
    })?;
    let e = WhisperEncoder::from_hf_dir(&dir, dev).unwrap_err();
    assert!(e.to_string().contains("encoder.layer_norm.bias"), "{e}");
    Ok(())
}

fn wrong_shape(dev: Device) -> TestResult {
    let dir = tmpdir("shape");
    let name = "embeddings.position_embedding.weight";
    copy_case("clip_vision", &dir, &|n, t| {
        if n == name {
            Some(Tensor::from_vec(vec![0.0; 16 * 40], [16, 40], Device::Cpu).unwrap())
        } else {
            Some(t)
        }
    })?;
    let e = VisionEncoder::from_hf_dir(&dir, dev).unwrap_err();
    let msg = e.to_string();
    assert!(
        msg.contains(name) && msg.contains("[16, 40]") && msg.contains("[17, 40]"),
        "{msg}"
    );
    // A packed in_proj of the wrong height.
    let dir = tmpdir("shape-inproj");
    copy_case("siglip_vision", &dir, &|n, t| {
        if n == "head.attention.in_proj_weight" {
            Some(Tensor::from_vec(vec![0.0; 72 * 36], [72, 36], Device::Cpu).unwrap())
        } else {
            Some(t)
        }
    })?;
    let e = VisionEncoder::from_hf_dir(&dir, dev).unwrap_err();
    assert!(
        e.to_string().contains("in_proj_weight") && e.to_string().contains("[108, 36]"),
        "{e}"
    );
    Ok(())
}

fn bad_images(dev: Device) -> TestResult {
    let model = VisionEncoder::from_hf_dir(&fixture("clip_vision"), dev)?.model; // 24x24, P = 6
    let px = |dims: [usize; 4]| Tensor::from_vec(vec![0.0; dims.iter().product()], dims, dev);
    let e = model.forward(&px([1, 3, 25, 24])?).unwrap_err();
    assert!(
        matches!(e, Error::Input { .. }) && e.to_string().contains("multiple of the patch size"),
        "{e}"
    );
    let e = model.forward(&px([1, 3, 30, 30])?).unwrap_err();
    assert!(e.to_string().contains("image_size"), "{e}");
    assert_err!(model.forward(&px([1, 4, 24, 24])?), Error::Input { .. });
    assert_err!(
        model.forward(&Tensor::from_vec(vec![0.0; 3 * 24 * 24], [3, 24, 24], dev)?),
        Error::Input { .. }
    );
    Ok(())
}

fn bad_clips(dev: Device) -> TestResult {
    let model = WhisperEncoder::from_hf_dir(&fixture("whisper_encoder"), dev)?.model; // 10 mels, 20 positions
    let clip = |m: usize, f: usize| Tensor::from_vec(vec![0.0; m * f], [m, f], dev);
    // 42 frames -> 21 positions > 20.
    let e = model.forward(&[clip(10, 40)?, clip(10, 42)?]).unwrap_err();
    let msg = e.to_string();
    assert!(
        matches!(e, Error::Input { .. })
            && msg.contains("clip 1")
            && msg.contains("max_source_positions"),
        "{msg}"
    );
    // 41 frames -> 21 positions, also too long; 40 is the limit.
    assert_err!(model.forward(&[clip(10, 41)?]), Error::Input { .. });
    assert!(model.forward(&[clip(10, 40)?]).is_ok());
    assert_err!(model.forward(&[clip(12, 20)?]), Error::Input { .. });
    assert_err!(model.forward(&[clip(10, 0)?]), Error::Input { .. });
    assert_err!(model.forward(&[]), Error::Input { .. });
    Ok(())
}

fn unknown_architecture_dir(dev: Device) -> TestResult {
    let dir = tmpdir("arch");
    copy_case("clip_vision", &dir, &|_, t| Some(t))?;
    let mut cfg: Value = serde_json::from_str(&std::fs::read_to_string(dir.join("config.json"))?)?;
    cfg["architectures"] = json!(["ViTModel"]);
    write_json(&dir.join("config.json"), &cfg)?;
    let e = VisionEncoder::from_hf_dir(&dir, dev).unwrap_err();
    assert!(
        e.to_string().contains("ViTModel") && e.to_string().contains("supported"),
        "{e}"
    );
    assert_err!(WhisperEncoder::from_hf_dir(&dir, dev), Error::Config { .. });
    Ok(())
}

braid_kernels::test_on_devices!(
    unknown_architecture,
    bad_config_values,
    missing_tensor,
    wrong_shape,
    bad_images,
    bad_clips,
    unknown_architecture_dir,
);
