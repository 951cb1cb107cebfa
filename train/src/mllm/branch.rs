//! The encoder branches of [`super::Mllm`]: images or clips through their encoder and
//! projector to LLM rows, and back, with the state each branch's backward keeps.

use braid_encoders::projector::{AudioProjectorCache, ProjectorCache};
use braid_encoders::{
    AudioCache, AudioProjector, MlpProjector, VisionCache, VisionEncoder, WhisperEncoder,
};
use braid_kernels::{Tensor, ops};
use braid_nn::error::Context;
use braid_nn::{Error, Result};

use super::{ids, trainable};

/// The vision branch's backward state; absent when encoder and projector are frozen.
#[derive(Debug)]
pub(crate) struct VisionBranch<E = VisionCache> {
    /// B_img, S tokens per image out of the encoder
    b: usize,
    s: usize,
    /// (B*N) u32 patch-token rows of the (B*S, D) encoder output (CLIP: without the
    /// class tokens); `None` when every token is a patch token.
    patch_rows: Option<Tensor>,
    /// `None` when the encoder is frozen: its backward is skipped.
    pub(super) encoder: Option<E>,
    projector: ProjectorCache,
}

/// The audio branch's backward state; absent when encoder and projector are frozen.
#[derive(Debug)]
pub(crate) struct AudioBranch<E = AudioCache> {
    pub(super) encoder: Option<E>,
    projector: AudioProjectorCache,
}

/// pixel_values (B, C, H, W) -> projected rows (B * tokens_per_image, C) and the
/// branch's backward state when something in it is trainable.
pub(crate) fn vision_forward(
    enc: &VisionEncoder,
    proj: &MlpProjector,
    px: &Tensor,
) -> Result<(Tensor, Option<VisionBranch>)> {
    let (out, enc_cache) = enc.forward(px)?;
    vision_project(enc, proj, out.last_hidden_state, enc_cache)
}

/// The projector over an encoder's output (B, S, D) -> (B * tokens_per_image, C), and
/// the branch's backward state (holding `enc_cache`, the encoder's or its last
/// stage's) when something in it is trainable.
pub(crate) fn vision_project<E>(
    enc: &VisionEncoder,
    proj: &MlpProjector,
    last_hidden_state: Tensor,
    enc_cache: E,
) -> Result<(Tensor, Option<VisionBranch<E>>)> {
    let cfg = &enc.config;
    let (enc_train, proj_train) = (trainable(enc), trainable(proj));
    let &[b, s, d] = last_hidden_state.dims() else {
        return Err(Error::input("mllm", "vision output is not (B, S, D)"));
    };
    let n = cfg.num_patches();
    let last = last_hidden_state
        .reshape([b * s, d])
        .ctx("mllm", "vision features")?; // (B*S, D)
    // CLIP's class token (first of each image) is not an image token.
    let (feats, patch_rows) = if s == n {
        (last, None)
    } else {
        let off = s - n;
        let r: Vec<u32> = (0..b)
            .flat_map(|i| (0..n).map(move |j| (i * s + off + j) as u32))
            .collect();
        let r = ids(r, last.device())?;
        let f = ops::gather_rows(&last, &r).ctx("mllm", "patch tokens")?; // (B*N, D)
        (f, Some(r))
    };
    let g = cfg.image_size / cfg.patch_size;
    let (y, projector) = proj.forward(&feats, &vec![(g, g); b])?; // (B*N/m², C)
    let branch = (enc_train || proj_train).then(|| VisionBranch {
        b,
        s,
        patch_rows,
        encoder: enc_train.then_some(enc_cache),
        projector,
    });
    Ok((y, branch))
}

/// clips -> projected rows (sum of tokens_per_clip, C) and the branch's backward
/// state when something in it is trainable.
pub(crate) fn audio_forward(
    enc: &WhisperEncoder,
    proj: &AudioProjector,
    clips: &[Tensor],
) -> Result<(Tensor, Option<AudioBranch>)> {
    let (out, enc_cache) = enc.forward(clips)?; // hidden (T_a, D)
    audio_project(enc, proj, &out.hidden, &out.cu_seqlens, enc_cache)
}

/// The projector over an encoder's packed output (T_a, D) -> (G_a, C), and the branch's
/// backward state (holding `enc_cache`) when something in it is trainable.
pub(crate) fn audio_project<E>(
    enc: &WhisperEncoder,
    proj: &AudioProjector,
    hidden: &Tensor,
    cu_seqlens: &[usize],
    enc_cache: E,
) -> Result<(Tensor, Option<AudioBranch<E>>)> {
    let (enc_train, proj_train) = (trainable(enc), trainable(proj));
    let (y, projector) = proj.forward(hidden, cu_seqlens)?; // (G_a, C)
    let branch = (enc_train || proj_train).then(|| AudioBranch {
        encoder: enc_train.then_some(enc_cache),
        projector,
    });
    Ok((y, branch))
}

/// dy (B * tokens_per_image, C) -> d pixel_values, when the encoder is trainable.
pub(crate) fn vision_backward(
    enc: &mut VisionEncoder,
    proj: &mut MlpProjector,
    vb: VisionBranch,
    dy: &Tensor,
) -> Result<Option<Tensor>> {
    let d = enc.config.hidden_size;
    match vision_unproject(d, proj, vb, dy)? {
        Some((ec, dlast)) => Ok(Some(enc.backward(ec, &dlast, None)?)),
        None => Ok(None),
    }
}

/// The projector's backward: dy (B * tokens_per_image, C) -> the encoder's cache and the
/// grad of its output (B, S, D), when the encoder is trainable.
pub(crate) fn vision_unproject<E>(
    d: usize,
    proj: &mut MlpProjector,
    vb: VisionBranch<E>,
    dy: &Tensor,
) -> Result<Option<(E, Tensor)>> {
    let dfeat = proj.backward(vb.projector, dy)?; // (B*N, D)
    let Some(ec) = vb.encoder else {
        return Ok(None);
    };
    let (b, s) = (vb.b, vb.s);
    let dlast = match &vb.patch_rows {
        None => dfeat,
        Some(r) => {
            // Class tokens feed no image token: their rows stay zero.
            let mut dl =
                Tensor::zeros(vec![b * s, d], dfeat.dtype(), dy.device()).ctx("mllm", "zeros")?; // (B*S, D)
            ops::scatter_rows(&mut dl, r, &dfeat).ctx("mllm", "patch token grads")?;
            dl
        }
    };
    let dlast = dlast.reshape([b, s, d]).ctx("mllm", "vision grads")?; // (B, S, D)
    Ok(Some((ec, dlast)))
}

/// dy (G_a, C) -> d clips, when the encoder is trainable.
pub(crate) fn audio_backward(
    enc: &mut WhisperEncoder,
    proj: &mut AudioProjector,
    ab: AudioBranch,
    dy: &Tensor,
) -> Result<Option<Vec<Tensor>>> {
    match audio_unproject(proj, ab, dy)? {
        Some((ec, dh)) => Ok(Some(enc.backward(ec, &dh)?)),
        None => Ok(None),
    }
}

/// The projector's backward: dy (G_a, C) -> the encoder's cache and the grad of its
/// output (T_a, D), when the encoder is trainable.
pub(crate) fn audio_unproject<E>(
    proj: &mut AudioProjector,
    ab: AudioBranch<E>,
    dy: &Tensor,
) -> Result<Option<(E, Tensor)>> {
    let dh = proj.backward(ab.projector, dy)?; // (T_a, D)
    Ok(ab.encoder.map(|ec| (ec, dh)))
}
