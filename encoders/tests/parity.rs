//! Parity with PyTorch/transformers on the committed fixtures (tests/fixtures/hf):
//! forward outputs (rel err <= 1e-4), every parameter grad by HF name and the input
//! grad (rel err <= 1e-3), for CLIP, SigLIP (with its pooling head) and Whisper
//! (30 s-style full clip and a short unpadded clip); forward parity on the "unseen"
//! checkpoints (other sizes, hub-style prefixes, WhisperForConditionalGeneration).
//!
//! Relative error = max |ours - ref| / max(|ref|_inf, 1e-6) over a whole tensor.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use braid_encoders::audio_hf::whisper_name_map;
use braid_encoders::vision_hf::vision_name_map;
use braid_encoders::weights::{Which, hf_tensors};
use braid_encoders::{VisionEncoder, WhisperEncoder};
use braid_kernels::Device;
use common::*;

const FWD_TOL: f32 = 1e-4;
const BWD_TOL: f32 = 1e-3;

/// Compares every grad in the fixture's grads file (except the input's) with ours.
fn check_grads(
    case: &str,
    ours: &braid_encoders::weights::HostTensors,
    input_grad: &str,
) -> TestResult<f32> {
    let refs = read_all(case, "grads")?;
    let inf = |v: &[f32]| v.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    // The largest grad of the model: the scale of f32 rounding noise.
    let scale = refs
        .iter()
        .filter(|(n, _)| *n != input_grad)
        .fold(0.0f32, |m, (_, (_, d))| m.max(inf(d)));
    let mut worst = 0.0f32;
    let mut n = 0;
    for (name, (shape, data)) in &refs {
        if name == input_grad {
            continue;
        }
        let (oshape, odata) = ours
            .get(name)
            .ok_or_else(|| format!("{case}: no Braid grad for {name}"))?;
        assert_eq!(oshape, shape, "{case}: {name} shape");
        if inf(data) <= 1e-6 * scale {
            // Analytically zero (the key-projection bias: it shifts every score of a
            // query equally and cancels in the softmax); both sides are rounding noise.
            assert!(
                inf(odata) <= 1e-5 * scale,
                "{case}: grad {name} should be ~0, got |.|_inf = {}",
                inf(odata)
            );
        } else {
            worst = worst.max(check(&format!("{case}: grad {name}"), odata, data, BWD_TOL));
        }
        n += 1;
    }
    assert_eq!(n, ours.len(), "{case}: Braid has grads the fixture lacks");
    Ok(worst)
}

fn vision_case(case: &str, dev: Device) -> TestResult {
    let imp = VisionEncoder::from_hf_dir(&fixture(case), dev)?;
    let mut model = imp.model;
    let inputs = read_all(case, "inputs")?;
    let outputs = read_all(case, "outputs")?;
    let px = tensor(get(&inputs, "pixel_values")?, dev)?;
    let (out, cache) = model.forward(&px)?;
    let e_last = check(
        &format!("{case}: last_hidden_state"),
        &out.last_hidden_state.to_vec_f32()?,
        &get(&outputs, "last_hidden_state")?.1,
        FWD_TOL,
    );
    let mut e_pool = 0.0;
    if let Some(want) = outputs.get("pooler_output") {
        let got = out.pooler_output.as_ref().ok_or("no pooler_output")?;
        e_pool = check(
            &format!("{case}: pooler_output"),
            &got.to_vec_f32()?,
            &want.1,
            FWD_TOL,
        );
    }
    let dl = tensor(get(&inputs, "loss_weight")?, dev)?;
    let dp = match inputs.get("loss_weight_pooler_output") {
        Some(t) => Some(tensor(t, dev)?),
        None => None,
    };
    let dpx = model.backward(cache, &dl, dp.as_ref())?;
    let grads = hf_tensors(
        &model,
        &vision_name_map(&model.config),
        &imp.prefix,
        Which::Grad,
    )?;
    let e_params = check_grads(case, &grads, "grad_pixel_values")?;
    let refs = read_all(case, "grads")?;
    let e_px = check(
        &format!("{case}: grad_pixel_values"),
        &dpx.to_vec_f32()?,
        &get(&refs, "grad_pixel_values")?.1,
        BWD_TOL,
    );
    eprintln!(
        "PARITY {case}: last_hidden_state {e_last:.2e} pooler {e_pool:.2e} param grads (max) {e_params:.2e} grad_pixel_values {e_px:.2e}; unused: {} tensors",
        imp.unused.len()
    );
    Ok(())
}

fn whisper_case(case: &str, dev: Device) -> TestResult {
    let imp = WhisperEncoder::from_hf_dir(&fixture(case), dev)?;
    let mut model = imp.model;
    assert!(imp.unused.iter().all(|n| !n.contains("encoder.")));
    let inputs = read_all(case, "inputs")?;
    let outputs = read_all(case, "outputs")?;
    let feats = tensor(get(&inputs, "input_features")?, dev)?;
    let clips = WhisperEncoder::split_batch(&feats, dev)?;
    let (out, cache) = model.forward(&clips)?;
    let e_fwd = check(
        &format!("{case}: last_hidden_state"),
        &out.hidden.to_vec_f32()?,
        &get(&outputs, "last_hidden_state")?.1,
        FWD_TOL,
    );
    let lw = get(&inputs, "loss_weight")?;
    let d = model.config.d_model;
    let dy = braid_kernels::Tensor::from_vec(lw.1.clone(), [lw.1.len() / d, d], dev)?;
    let dclips = model.backward(cache, &dy)?;
    let grads = hf_tensors(
        &model,
        &whisper_name_map(&model.config),
        &imp.prefix,
        Which::Grad,
    )?;
    let e_params = check_grads(case, &grads, "grad_input_features")?;
    let mut dx = Vec::new();
    for c in &dclips {
        dx.extend(c.to_vec_f32()?);
    }
    let refs = read_all(case, "grads")?;
    let e_in = check(
        &format!("{case}: grad_input_features"),
        &dx,
        &get(&refs, "grad_input_features")?.1,
        BWD_TOL,
    );
    eprintln!(
        "PARITY {case}: last_hidden_state {e_fwd:.2e} param grads (max) {e_params:.2e} grad_input_features {e_in:.2e}"
    );
    Ok(())
}

fn clip_vision(dev: Device) -> TestResult {
    vision_case("clip_vision", dev)
}
fn clip_full_vision(dev: Device) -> TestResult {
    vision_case("clip_full_vision", dev)
}
fn siglip_vision(dev: Device) -> TestResult {
    vision_case("siglip_vision", dev)
}
fn siglip_full(dev: Device) -> TestResult {
    vision_case("siglip_full", dev)
}
fn whisper_encoder(dev: Device) -> TestResult {
    whisper_case("whisper_encoder", dev)
}
fn whisper_short(dev: Device) -> TestResult {
    whisper_case("whisper_short", dev)
}

/// Forward-only parity of an unseen vision checkpoint.
fn unseen_vision(case: &str, dev: Device) -> TestResult {
    let imp = VisionEncoder::from_hf_dir(&fixture(case), dev)?;
    assert_eq!(imp.prefix, "vision_model.", "{case}: hub-style names");
    assert!(imp.unused.is_empty(), "{case}: unused {:?}", imp.unused);
    let inputs = read_all(case, "inputs")?;
    let outputs = read_all(case, "outputs")?;
    let (out, _) = imp
        .model
        .forward(&tensor(get(&inputs, "pixel_values")?, dev)?)?;
    let e = check(
        &format!("{case}: last_hidden_state"),
        &out.last_hidden_state.to_vec_f32()?,
        &get(&outputs, "last_hidden_state")?.1,
        FWD_TOL,
    );
    match (outputs.get("pooler_output"), &out.pooler_output) {
        (Some(want), Some(got)) => {
            check(
                &format!("{case}: pooler"),
                &got.to_vec_f32()?,
                &want.1,
                FWD_TOL,
            );
        }
        (None, None) => {}
        _ => return Err(format!("{case}: pooler_output presence differs").into()),
    }
    eprintln!("PARITY {case}: last_hidden_state {e:.2e}");
    Ok(())
}

fn unseen_clip(dev: Device) -> TestResult {
    unseen_vision("unseen/clip", dev)
}
fn unseen_siglip(dev: Device) -> TestResult {
    unseen_vision("unseen/siglip", dev)
}

fn unseen_whisper(dev: Device) -> TestResult {
    let case = "unseen/whisper";
    let imp = WhisperEncoder::from_hf_dir(&fixture(case), dev)?;
    assert_eq!(imp.architecture, "WhisperForConditionalGeneration");
    assert_eq!(imp.prefix, "model.encoder.");
    assert!(!imp.unused.is_empty() && imp.unused.iter().all(|n| n.starts_with("model.decoder.")));
    let inputs = read_all(case, "inputs")?;
    let outputs = read_all(case, "outputs")?;
    let clips = WhisperEncoder::split_batch(&tensor(get(&inputs, "input_features")?, dev)?, dev)?;
    let (out, _) = imp.model.forward(&clips)?;
    let e = check(
        &format!("{case}: last_hidden_state"),
        &out.hidden.to_vec_f32()?,
        &get(&outputs, "last_hidden_state")?.1,
        FWD_TOL,
    );
    eprintln!("PARITY {case}: last_hidden_state {e:.2e} (2 clips packed)");
    Ok(())
}

braid_kernels::test_on_devices!(
    clip_vision,
    clip_full_vision,
    siglip_vision,
    siglip_full,
    whisper_encoder,
    whisper_short,
    unseen_clip,
    unseen_siglip,
    unseen_whisper,
);
