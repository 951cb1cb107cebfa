//! Packed batches give what each sample gives alone: several images in one call,
//! several clips of different lengths (odd ones too, equal ones batched) in one call — outputs, input
//! grads, and parameter grads (the packed call's = the sum of the single calls').

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use braid_encoders::{VisionEncoder, WhisperEncoder};
use braid_kernels::{Device, Tensor};
use braid_nn::Module;
use common::*;

const TOL: f32 = 1e-5;

fn grads_of<M: Module>(m: &M) -> Vec<(String, Vec<f32>)> {
    params_host(m)
        .into_iter()
        .map(|(n, _, g)| (n, g.unwrap()))
        .collect()
}

fn images_packed_equal_one_by_one(dev: Device) -> TestResult {
    for case in ["clip_vision", "siglip_vision"] {
        let mut model = VisionEncoder::from_hf_dir(&fixture(case), dev)?.model;
        let (c, side) = (model.config.num_channels, model.config.image_size);
        let (s, d) = (model.seq_len(), model.config.hidden_size);
        let b = 3;
        let img = c * side * side;
        let px = randn(11, b * img);
        let dl = randn(12, b * s * d);
        let dp = randn(13, b * d);
        let (out, cache) =
            model.forward(&Tensor::from_vec(px.clone(), [b, c, side, side], dev)?)?;
        let last = out.last_hidden_state.to_vec_f32()?;
        let pooled = out.pooler_output.unwrap().to_vec_f32()?;
        let dpx = model
            .backward(
                cache,
                &Tensor::from_vec(dl.clone(), [b, s, d], dev)?,
                Some(&Tensor::from_vec(dp.clone(), [b, d], dev)?),
            )?
            .to_vec_f32()?;
        let packed_grads = grads_of(&model);
        model.zero_grads()?;
        for i in 0..b {
            let x = Tensor::from_vec(px[i * img..(i + 1) * img].to_vec(), [1, c, side, side], dev)?;
            let (o, cache) = model.forward(&x)?;
            check(
                &format!("{case} image {i} last_hidden_state"),
                &o.last_hidden_state.to_vec_f32()?,
                &last[i * s * d..(i + 1) * s * d],
                TOL,
            );
            check(
                &format!("{case} image {i} pooled"),
                &o.pooler_output.unwrap().to_vec_f32()?,
                &pooled[i * d..(i + 1) * d],
                TOL,
            );
            let g = model.backward(
                cache,
                &Tensor::from_vec(dl[i * s * d..(i + 1) * s * d].to_vec(), [1, s, d], dev)?,
                Some(&Tensor::from_vec(
                    dp[i * d..(i + 1) * d].to_vec(),
                    [1, d],
                    dev,
                )?),
            )?;
            check(
                &format!("{case} image {i} d pixels"),
                &g.to_vec_f32()?,
                &dpx[i * img..(i + 1) * img],
                TOL,
            );
        }
        // Grads accumulated over the single calls = the packed call's grads.
        for ((n, a), (_, b)) in grads_of(&model).iter().zip(&packed_grads) {
            check(&format!("{case} grad {n}"), a, b, TOL);
        }
    }
    Ok(())
}

fn clips_packed_equal_one_by_one(dev: Device) -> TestResult {
    let mut model = WhisperEncoder::from_hf_dir(&fixture("whisper_encoder"), dev)?.model;
    let (m, d) = (model.config.num_mel_bins, model.config.d_model);
    // Equal lengths interleaved: clips 0/2 and 1/4 share a batched conv stem.
    let frames = [40usize, 24, 40, 17, 24, 1];
    let clips: Vec<Vec<f32>> = frames
        .iter()
        .enumerate()
        .map(|(i, &f)| randn(20 + i as u64, m * f))
        .collect();
    let tensors = |range: std::ops::Range<usize>| -> TestResult<Vec<Tensor>> {
        range
            .map(|i| Ok(Tensor::from_vec(clips[i].clone(), [m, frames[i]], dev)?))
            .collect()
    };
    let (out, cache) = model.forward(&tensors(0..frames.len())?)?;
    let cu = out.cu_seqlens.clone();
    assert_eq!(cu, vec![0, 20, 32, 52, 61, 73, 74]);
    let t = cu[cu.len() - 1];
    let hidden = out.hidden.to_vec_f32()?;
    let dy = randn(30, t * d);
    let dclips = model.backward(cache, &Tensor::from_vec(dy.clone(), [t, d], dev)?)?;
    let packed_grads = grads_of(&model);
    model.zero_grads()?;
    for i in 0..frames.len() {
        let (o, cache) = model.forward(&tensors(i..i + 1)?)?;
        let (a, b) = (cu[i] * d, cu[i + 1] * d);
        check(
            &format!("clip {i} output"),
            &o.hidden.to_vec_f32()?,
            &hidden[a..b],
            TOL,
        );
        let n = cu[i + 1] - cu[i];
        let g = model.backward(cache, &Tensor::from_vec(dy[a..b].to_vec(), [n, d], dev)?)?;
        check(
            &format!("clip {i} input grad"),
            &g[0].to_vec_f32()?,
            &dclips[i].to_vec_f32()?,
            TOL,
        );
    }
    for ((n, a), (_, b)) in grads_of(&model).iter().zip(&packed_grads) {
        check(&format!("whisper grad {n}"), a, b, TOL);
    }
    Ok(())
}

fn forward_is_deterministic(dev: Device) -> TestResult {
    let model = VisionEncoder::from_hf_dir(&fixture("siglip_vision"), dev)?.model;
    let side = model.config.image_size;
    let x = Tensor::from_vec(randn(5, 2 * 3 * side * side), [2, 3, side, side], dev)?;
    let a = model.forward(&x)?.0.last_hidden_state.to_vec_f32()?;
    let b = model.forward(&x)?.0.last_hidden_state.to_vec_f32()?;
    assert_eq!(a, b);
    Ok(())
}

braid_kernels::test_on_devices!(
    images_packed_equal_one_by_one,
    clips_packed_equal_one_by_one,
    forward_is_deterministic,
);
