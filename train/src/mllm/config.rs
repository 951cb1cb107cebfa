//! `MllmConfig`: the LLM, the optional vision and audio encoders and their projectors,
//! checked against each other; `Freeze`: which of the five modules are not trained.

use braid_encoders::{Act, ProjectorConfig, VisionConfig, WhisperEncoderConfig};
use braid_kernels::ops::Activation;
use braid_llm::LlmConfig;
use braid_nn::{Error, Result};
use serde::{Deserialize, Serialize};

/// The vision projector (`[model.projector.vision]`): LLaVA's two-layer MLP per patch
/// token (`spatial_merge = 1`) or Qwen2-VL's patch merger (`spatial_merge = m > 1`:
/// LayerNorm, m x m neighbouring patches concatenated, MLP). See
/// [`braid_encoders::MlpProjector`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct VisionProjectorConfig {
    /// Encoder width D; must equal `vision.hidden_size`.
    pub in_dim: usize,
    /// Must equal `llm.hidden`.
    pub out_dim: usize,
    #[serde(default = "one")]
    pub spatial_merge: usize,
    pub act: Act,
    /// eps of the merger's LayerNorm (Qwen2-VL: 1e-6); unused when spatial_merge = 1.
    #[serde(default = "default_ln_eps")]
    pub ln_eps: f32,
}

fn one() -> usize {
    1
}

fn default_ln_eps() -> f32 {
    1e-6
}

impl VisionProjectorConfig {
    /// The encoders crate's projector sizes.
    pub fn projector(&self) -> ProjectorConfig {
        ProjectorConfig {
            in_dim: self.in_dim,
            out_dim: self.out_dim,
            spatial_merge: self.spatial_merge,
            act: self.act.kernel(),
            ln_eps: self.ln_eps,
        }
    }
}

/// The audio projector (`[model.projector.audio]`): `stride` consecutive encoder frames
/// stacked, then a two-layer MLP (Ultravox); see [`braid_encoders::AudioProjector`].
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct AudioProjectorConfig {
    /// Encoder width D; must equal `audio.d_model`.
    pub in_dim: usize,
    /// Must equal `llm.hidden`.
    pub out_dim: usize,
    /// Frames stacked into one token.
    pub stride: usize,
    pub act: Act,
}

impl AudioProjectorConfig {
    pub fn activation(&self) -> Activation {
        self.act.kernel()
    }
}

/// A multimodal LLM: each encoder is optional and comes with its projector.
///
/// The vision features fed to the projector are the encoder's `last_hidden_state`
/// patch tokens (CLIP's class token is dropped, LLaVA's `"default"` feature select);
/// audio features are the Whisper encoder's output frames.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct MllmConfig {
    pub llm: LlmConfig,
    #[serde(default)]
    pub vision: Option<VisionConfig>,
    #[serde(default)]
    pub vision_projector: Option<VisionProjectorConfig>,
    #[serde(default)]
    pub audio: Option<WhisperEncoderConfig>,
    #[serde(default)]
    pub audio_projector: Option<AudioProjectorConfig>,
}

fn mismatch(msg: String) -> Error {
    Error::config("MllmConfig", msg)
}

impl MllmConfig {
    /// Every part valid on its own, and the widths chained: encoder width ==
    /// projector `in_dim`, projector `out_dim` == `llm.hidden`; an encoder without its
    /// projector (or the reverse) is an error.
    pub fn validate(&self) -> Result<()> {
        self.llm.validate()?;
        let c = self.llm.hidden;
        match (&self.vision, &self.vision_projector) {
            (None, None) => {}
            (Some(_), None) => {
                return Err(mismatch(
                    "`vision` is set but `vision_projector` is not: the encoder's output needs a projector into the LLM".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(mismatch(
                    "`vision_projector` is set but `vision` is not".into(),
                ));
            }
            (Some(v), Some(p)) => {
                v.validate()?;
                if p.in_dim != v.hidden_size {
                    return Err(mismatch(format!(
                        "vision_projector.in_dim = {} must equal vision.hidden_size = {}",
                        p.in_dim, v.hidden_size
                    )));
                }
                if p.out_dim != c {
                    return Err(mismatch(format!(
                        "vision_projector.out_dim = {} must equal llm.hidden = {c}",
                        p.out_dim
                    )));
                }
                let m = p.spatial_merge;
                let g = v.image_size / v.patch_size;
                if m == 0 || g % m != 0 {
                    return Err(mismatch(format!(
                        "vision_projector.spatial_merge = {m} must be >= 1 and divide the patch grid side vision.image_size / vision.patch_size = {g}"
                    )));
                }
                if !(p.ln_eps > 0.0 && p.ln_eps.is_finite()) {
                    return Err(mismatch(format!(
                        "vision_projector.ln_eps = {} must be a positive number",
                        p.ln_eps
                    )));
                }
            }
        }
        match (&self.audio, &self.audio_projector) {
            (None, None) => {}
            (Some(_), None) => {
                return Err(mismatch(
                    "`audio` is set but `audio_projector` is not: the encoder's output needs a projector into the LLM".into(),
                ));
            }
            (None, Some(_)) => {
                return Err(mismatch(
                    "`audio_projector` is set but `audio` is not".into(),
                ));
            }
            (Some(a), Some(p)) => {
                a.validate()?;
                if p.in_dim != a.d_model {
                    return Err(mismatch(format!(
                        "audio_projector.in_dim = {} must equal audio.d_model = {}",
                        p.in_dim, a.d_model
                    )));
                }
                if p.out_dim != c {
                    return Err(mismatch(format!(
                        "audio_projector.out_dim = {} must equal llm.hidden = {c}",
                        p.out_dim
                    )));
                }
                if p.stride == 0 {
                    return Err(mismatch("audio_projector.stride = 0 must be >= 1".into()));
                }
            }
        }
        Ok(())
    }

    /// LLM tokens one image gives after projection: (grid / spatial_merge)^2; `None`
    /// without a vision encoder.
    pub fn tokens_per_image(&self) -> Option<usize> {
        let (v, p) = (self.vision.as_ref()?, self.vision_projector.as_ref()?);
        let g = v.image_size / v.patch_size / p.spatial_merge.max(1);
        Some(g * g)
    }

    /// LLM tokens a clip of `frames` mel frames gives: the encoder halves the frames
    /// (ceil), the projector stacks `stride` of them (ceil, the last group zero-padded);
    /// `None` without an audio encoder.
    pub fn tokens_per_clip(&self, frames: usize) -> Option<usize> {
        let p = self.audio_projector.as_ref()?;
        self.audio.as_ref()?;
        Some(WhisperEncoderConfig::out_frames(frames).div_ceil(p.stride.max(1)))
    }
}

/// Which modules are not trained. A frozen module's parameters have no grad buffer
/// (`Param::freeze`), so no weight grad is computed for them; when an encoder and its
/// projector are both frozen, nothing of that branch runs backward at all.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields)]
pub struct Freeze {
    #[serde(default)]
    pub vision: bool,
    #[serde(default)]
    pub audio: bool,
    #[serde(default)]
    pub vision_projector: bool,
    #[serde(default)]
    pub audio_projector: bool,
    #[serde(default)]
    pub llm: bool,
}

impl Freeze {
    /// The module names a run config's `train.freeze = [...]` list may hold.
    pub const NAMES: [&str; 5] = [
        "vision",
        "audio",
        "vision_projector",
        "audio_projector",
        "llm",
    ];

    /// From a list of module names (`["vision", "audio"]`); an unknown name is an
    /// error listing the allowed ones.
    pub fn from_names<S: AsRef<str>>(names: &[S]) -> Result<Self> {
        let mut f = Freeze::default();
        for n in names {
            let slot = match n.as_ref() {
                "vision" => &mut f.vision,
                "audio" => &mut f.audio,
                "vision_projector" => &mut f.vision_projector,
                "audio_projector" => &mut f.audio_projector,
                "llm" => &mut f.llm,
                other => {
                    return Err(Error::config(
                        "train.freeze",
                        format!(
                            "unknown module {other:?}; allowed: {}",
                            Freeze::NAMES.join(", ")
                        ),
                    ));
                }
            };
            *slot = true;
        }
        Ok(f)
    }
}
