//! Export round trip: fixture -> Braid -> export_hf gives back exactly the fixture's
//! tensors under the same HF names (packed SigLIP in_proj included) and a config that
//! parses to the same Braid config; after a training step, export -> re-import gives
//! the trained tensors bitwise and the same outputs.
//!
//! The trained exports are left under `$CARGO_TARGET_TMPDIR/encoder-export/<case>`
//! with Braid's outputs on the fixture inputs (`braid_outputs.safetensors`), for
//! `tools/fixtures/check_export_encoders.py` to load with transformers.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::path::PathBuf;

use braid_encoders::{VisionConfig, VisionEncoder, WhisperEncoder, WhisperEncoderConfig};
use braid_kernels::{Device, Tensor, ops};
use braid_nn::Module;
use braid_nn::hf::{WeightFiles, read_json, save_safetensors};
use common::*;
use serde_json::Value;

fn export_dir(case: &str) -> PathBuf {
    let d = PathBuf::from(env!("CARGO_TARGET_TMPDIR"))
        .join("encoder-export")
        .join(case.replace('/', "_"));
    let _ = std::fs::remove_dir_all(&d);
    d
}

/// Every tensor of a checkpoint directory, (name, shape, data), sorted.
type Named = Vec<(String, Vec<usize>, Vec<f32>)>;

fn dir_tensors(dir: &std::path::Path) -> TestResult<Named> {
    let w = WeightFiles::open_dir(dir)?;
    let mut out = Vec::new();
    for n in w.names() {
        let t = w.load_any(n, Device::Cpu)?;
        out.push((n.to_string(), t.dims().to_vec(), t.to_vec_f32()?));
    }
    Ok(out)
}

/// One SGD step w -= 0.01 * grad: weights that differ from the fixture's.
fn sgd_step<M: Module>(m: &mut M) -> TestResult {
    let mut res: TestResult = Ok(());
    m.visit_params_mut(&mut |p| {
        if let Some(g) = &p.grad {
            let r = g.try_clone().and_then(|mut g| {
                ops::scale_assign(&mut g, -0.01)?;
                ops::add_assign(&mut p.value, &g)
            });
            if let Err(e) = r {
                res = Err(e.into());
            }
        }
    });
    res
}

fn vision_round_trip(case: &str, dev: Device) -> TestResult {
    let imp = VisionEncoder::from_hf_dir(&fixture(case), dev)?;
    let mut model = imp.model;
    // 1. Untouched weights: export == the fixture's tensors (prefix dropped).
    let dir = export_dir(&format!("{case}-as-loaded"));
    model.export_hf(&dir)?;
    let ours = dir_tensors(&dir)?;
    let fix: Vec<_> = dir_tensors(&fixture(case))?
        .into_iter()
        .filter(|(n, _, _)| !imp.unused.contains(n))
        .map(|(n, s, d)| (n[imp.prefix.len()..].to_string(), s, d))
        .collect();
    let mut fix = fix;
    fix.sort_by(|a, b| a.0.cmp(&b.0));
    assert_eq!(ours.len(), fix.len(), "{case}: tensor count");
    for (a, b) in ours.iter().zip(&fix) {
        assert_eq!((&a.0, &a.1), (&b.0, &b.1), "{case}: name/shape");
        assert_eq!(a.2, b.2, "{case}: {} differs", a.0);
    }
    let cfg: Value = read_json(&dir.join("config.json"))?;
    assert_eq!(VisionConfig::from_hf_config(&cfg)?.config, model.config);

    // 2. After a step: re-import gives the trained weights and outputs bitwise.
    let inputs = read_all(case, "inputs")?;
    let px = tensor(get(&inputs, "pixel_values")?, dev)?;
    let (out, cache) = model.forward(&px)?;
    let dp = match inputs.get("loss_weight_pooler_output") {
        Some(t) => Some(tensor(t, dev)?),
        None => None,
    };
    let dl = match inputs.get("loss_weight") {
        Some(t) => tensor(t, dev)?,
        None => Tensor::full(1.0, out.last_hidden_state.dims().to_vec(), dev)?,
    };
    model.backward(cache, &dl, dp.as_ref())?;
    sgd_step(&mut model)?;
    let dir = export_dir(case);
    model.export_hf(&dir)?;
    let back = VisionEncoder::from_hf_dir(&dir, dev)?;
    assert!(back.unused.is_empty() && back.prefix.is_empty());
    for ((n, a, _), (_, b, _)) in params_host(&model).iter().zip(params_host(&back.model)) {
        assert_eq!(a, &b, "{case}: {n} after round trip");
    }
    let (o1, _) = model.forward(&px)?;
    let (o2, _) = back.model.forward(&px)?;
    let last = o1.last_hidden_state.to_vec_f32()?;
    assert_eq!(last, o2.last_hidden_state.to_vec_f32()?);
    let mut outs = vec![("last_hidden_state".to_string(), o1.last_hidden_state)];
    if let Some(p) = o1.pooler_output {
        outs.push(("pooler_output".to_string(), p));
    }
    let list: Vec<(String, &Tensor)> = outs.iter().map(|(n, t)| (n.clone(), t)).collect();
    save_safetensors(&dir.join("braid_outputs.safetensors"), &list)?;
    Ok(())
}

fn whisper_round_trip(case: &str, dev: Device) -> TestResult {
    let imp = WhisperEncoder::from_hf_dir(&fixture(case), dev)?;
    let mut model = imp.model;
    let dir = export_dir(&format!("{case}-as-loaded"));
    model.export_hf(&dir)?;
    let ours = dir_tensors(&dir)?;
    let fix: Vec<_> = dir_tensors(&fixture(case))?
        .into_iter()
        .filter(|(n, _, _)| n.starts_with(&imp.prefix))
        .map(|(n, s, d)| (format!("encoder.{}", &n[imp.prefix.len()..]), s, d))
        .collect();
    assert_eq!(ours.len(), fix.len(), "{case}: tensor count");
    for (a, b) in ours.iter().zip(&fix) {
        assert_eq!((&a.0, &a.1), (&b.0, &b.1), "{case}: name/shape");
        assert_eq!(a.2, b.2, "{case}: {} differs", a.0);
    }
    let cfg: Value = read_json(&dir.join("config.json"))?;
    assert_eq!(WhisperEncoderConfig::from_hf_config(&cfg)?.0, model.config);

    let inputs = read_all(case, "inputs")?;
    let clips = WhisperEncoder::split_batch(&tensor(get(&inputs, "input_features")?, dev)?, dev)?;
    let (out, cache) = model.forward(&clips)?;
    let dy = Tensor::full(1.0, out.hidden.dims().to_vec(), dev)?;
    model.backward(cache, &dy)?;
    sgd_step(&mut model)?;
    let dir = export_dir(case);
    model.export_hf(&dir)?;
    let back = WhisperEncoder::from_hf_dir(&dir, dev)?;
    assert!(back.unused.is_empty() && back.prefix == "encoder.");
    for ((n, a, _), (_, b, _)) in params_host(&model).iter().zip(params_host(&back.model)) {
        assert_eq!(a, &b, "{case}: {n} after round trip");
    }
    let (o1, _) = model.forward(&clips)?;
    let (o2, _) = back.model.forward(&clips)?;
    assert_eq!(o1.hidden.to_vec_f32()?, o2.hidden.to_vec_f32()?);
    save_safetensors(
        &dir.join("braid_outputs.safetensors"),
        &[("last_hidden_state".to_string(), &o1.hidden)],
    )?;
    Ok(())
}

fn export_clip_vision(dev: Device) -> TestResult {
    vision_round_trip("clip_vision", dev)
}
fn export_clip_full_vision(dev: Device) -> TestResult {
    vision_round_trip("clip_full_vision", dev)
}
fn export_siglip_vision(dev: Device) -> TestResult {
    vision_round_trip("siglip_vision", dev)
}
fn export_siglip_full(dev: Device) -> TestResult {
    vision_round_trip("siglip_full", dev)
}
fn export_unseen_clip(dev: Device) -> TestResult {
    vision_round_trip("unseen/clip", dev)
}
fn export_unseen_siglip(dev: Device) -> TestResult {
    vision_round_trip("unseen/siglip", dev)
}
fn export_whisper_encoder(dev: Device) -> TestResult {
    whisper_round_trip("whisper_encoder", dev)
}
fn export_whisper_short(dev: Device) -> TestResult {
    whisper_round_trip("whisper_short", dev)
}
fn export_unseen_whisper(dev: Device) -> TestResult {
    whisper_round_trip("unseen/whisper", dev)
}

braid_kernels::test_on_devices!(
    export_clip_vision,
    export_clip_full_vision,
    export_siglip_vision,
    export_siglip_full,
    export_unseen_clip,
    export_unseen_siglip,
    export_whisper_encoder,
    export_whisper_short,
    export_unseen_whisper,
);
