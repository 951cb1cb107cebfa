//! `Mllm`: a vision encoder and an audio encoder (each optional), their projectors and
//! the LLM, trained as one model on packed rows of text with images and clips.
//!
//! Forward: images -> vision encoder -> patch tokens -> vision projector; clips ->
//! audio encoder -> frames -> audio projector; the projected rows are scattered over
//! their placeholder tokens of the packed text (one [`ModalityEmbeds`]: the image rows
//! first, image by image, then the clip rows, clip by clip), the LLM runs, and the
//! cross-entropy is taken on the target tokens only (mean over valid targets).
//!
//! Backward runs the whole way back, except what cannot change a trainable weight: a
//! frozen module gets no weight grad (its params have no grad buffer); a branch whose
//! encoder AND projector are frozen does not run backward at all, and its caches are
//! dropped at the end of the forward, so its activations are not held either; the
//! projector alone being trainable runs the projector's backward but not the encoder's;
//! with everything frozen the LLM backward is skipped too. Which modules are trainable
//! is read at forward time.

mod batch;
mod branch;
mod build;
mod config;

pub use batch::MllmBatch;
pub(crate) use branch::{
    AudioBranch, VisionBranch, audio_backward, audio_forward, audio_project, audio_unproject,
    vision_backward, vision_forward, vision_project, vision_unproject,
};
pub(crate) use build::module_init;
pub use build::{Loaded, MllmParts};
pub use config::{AudioProjectorConfig, Freeze, MllmConfig, VisionProjectorConfig};

use braid_encoders::{AudioProjector, MlpProjector, VisionEncoder, WhisperEncoder};
use braid_kernels::{Device, Tensor, ops};
use braid_llm::{Llm, ModalityEmbeds, StageCache, cross_entropy_loss};
use braid_nn::error::Context;
use braid_nn::{Error, Module, Param, Result};

use crate::trace::Tracer;

/// Name prefixes of the five modules' parameters (`vision.encoder.layers.0...`,
/// `llm.layers.0...`), in the order [`Module::visit_params`] lists them.
pub const VISION: &str = "vision.";
pub const VISION_PROJECTOR: &str = "vision_projector.";
pub const AUDIO: &str = "audio.";
pub const AUDIO_PROJECTOR: &str = "audio_projector.";
pub const LLM: &str = "llm.";

/// The model. Parameter names are the parts' own names behind a module prefix
/// ([`VISION`], [`VISION_PROJECTOR`], [`AUDIO`], [`AUDIO_PROJECTOR`], [`LLM`]); use
/// [`Mllm::into_parts`] to get the parts back with their own names (e.g. to export
/// each to Hugging Face).
#[derive(Debug)]
pub struct Mllm {
    pub config: MllmConfig,
    pub vision: Option<VisionEncoder>,
    pub vision_projector: Option<MlpProjector>,
    pub audio: Option<WhisperEncoder>,
    pub audio_projector: Option<AudioProjector>,
    pub llm: Llm,
}

/// The loss of one forward, on the host.
#[derive(Clone, Copy, Debug, PartialEq)]
pub struct MllmLoss {
    /// `loss_sum / normalizer` (by default the number of valid targets).
    pub loss: f32,
    /// Sum of the per-token losses.
    pub loss_sum: f64,
    /// Targets that are not `IGNORE_INDEX`.
    pub n_valid: usize,
}

/// Grads of the batch's float inputs, present when that encoder ran backward.
#[derive(Debug, Default)]
pub struct InputGrads {
    /// (B_img, C, H, W)
    pub pixel_values: Option<Tensor>,
    /// one (n_mels, F_j) per clip
    pub clips: Option<Vec<Tensor>>,
}

/// The modality block of one forward and the branches' backward state.
struct Embedded {
    modality: Option<ModalityEmbeds>,
    vision: Option<VisionBranch>,
    audio: Option<AudioBranch>,
    g_v: usize,
    g_a: usize,
}

/// What [`Mllm::backward`] needs.
#[derive(Debug)]
pub struct MllmCache {
    /// LLM activations and d loss / d logits (T, V); `None` when nothing is trainable.
    llm: Option<(StageCache, Tensor)>,
    vision: Option<VisionBranch>,
    audio: Option<AudioBranch>,
    /// Modality rows from images (the first `g_v` rows) and from clips (the next `g_a`).
    g_v: usize,
    g_a: usize,
}

impl MllmCache {
    /// Whether backward will run anything at all.
    pub fn runs_backward(&self) -> bool {
        self.llm.is_some()
    }
    /// Whether the vision encoder's activations were kept (it will run backward).
    pub fn holds_vision_encoder(&self) -> bool {
        self.vision.as_ref().is_some_and(|b| b.encoder.is_some())
    }
    /// Whether the audio encoder's activations were kept (it will run backward).
    pub fn holds_audio_encoder(&self) -> bool {
        self.audio.as_ref().is_some_and(|b| b.encoder.is_some())
    }
}

/// Whether any parameter of `m` has a grad buffer.
pub(crate) fn trainable<M: Module + ?Sized>(m: &M) -> bool {
    let mut any = false;
    m.visit_params(&mut |p| any |= p.is_trainable());
    any
}

fn ids(v: Vec<u32>, dev: Device) -> Result<Tensor> {
    let n = v.len();
    Tensor::from_vec_u32(v, [n], dev).ctx("mllm", "index tensor")
}

/// (M) u32: every image's placeholder positions, then every clip's, in block order.
fn placeholder_positions(batch: &MllmBatch) -> Result<Tensor> {
    let pos: Vec<u32> = batch
        .image_positions
        .iter()
        .chain(&batch.clip_positions)
        .flatten()
        .copied()
        .collect();
    ids(pos, batch.ids.device())
}

/// Rows `start .. start + n` of x (M, C), without a copy when that is all of x.
fn rows(x: &Tensor, start: usize, n: usize) -> Result<Option<Tensor>> {
    if start == 0 && n == x.dims()[0] {
        return Ok(None);
    }
    let idx = ids((start as u32..(start + n) as u32).collect(), x.device())?;
    Ok(Some(
        ops::gather_rows(x, &idx).ctx("mllm", "modality rows")?,
    ))
}

fn missing(what: &str) -> Error {
    Error::input(
        "mllm",
        format!("the cache needs `{what}`, which this model lacks"),
    )
}

impl Mllm {
    /// Forward and loss, the mean over the batch's valid targets.
    pub fn forward(&self, batch: &MllmBatch) -> Result<(MllmLoss, MllmCache)> {
        self.forward_normalized(batch, None)
    }

    /// Forward and loss `loss_sum / normalizer` (`None`: the batch's valid targets;
    /// the step's global count gives an exact mean over microbatches and ranks).
    pub fn forward_normalized(
        &self,
        batch: &MllmBatch,
        normalizer: Option<usize>,
    ) -> Result<(MllmLoss, MllmCache)> {
        self.forward_traced(batch, normalizer, &mut Tracer::off(), 0)
    }

    /// [`Mllm::forward_normalized`] of microbatch `mb`, each module's forward and the
    /// loss a span of `trace` (a one-rank run's timeline).
    pub fn forward_traced(
        &self,
        batch: &MllmBatch,
        normalizer: Option<usize>,
        trace: &mut Tracer,
        mb: usize,
    ) -> Result<(MllmLoss, MllmCache)> {
        batch.validate(&self.config)?;
        let Embedded {
            modality,
            vision,
            audio,
            g_v,
            g_a,
        } = self.embed_modalities(batch, false, trace, mb)?;
        let t0 = trace.start();
        let (logits, llm_cache) = self
            .llm
            .forward(&batch.ids, &batch.seq, modality.as_ref())?; // (T, V)
        span(trace, t0, "llm", "fwd", mb)?;
        let t0 = trace.start();
        let out = cross_entropy_loss(&logits, &batch.targets, normalizer)?;
        drop(logits);
        trace
            .end_on_device(t0, format!("llm loss mb{mb}"), "llm")
            .ctx("mllm", "trace")?;
        let loss = MllmLoss {
            loss: out.loss,
            loss_sum: out.loss_sum,
            n_valid: out.n_valid,
        };
        let needs_backward = trainable(&self.llm) || vision.is_some() || audio.is_some();
        let cache = MllmCache {
            llm: needs_backward.then_some((llm_cache, out.dlogits)),
            vision,
            audio,
            g_v,
            g_a,
        };
        Ok((loss, cache))
    }

    /// Encoders and projectors over the batch's images and clips, as one (M, C) block
    /// for the placeholder positions (image rows, then clip rows). `zeroed`: the block is
    /// all zeros and the encoders do not run (the text-only ablation of evaluation).
    fn embed_modalities(
        &self,
        batch: &MllmBatch,
        zeroed: bool,
        trace: &mut Tracer,
        mb: usize,
    ) -> Result<Embedded> {
        if zeroed {
            let m = batch.num_modality_tokens();
            let dev = batch.ids.device();
            let modality = if m == 0 {
                None
            } else {
                Some(ModalityEmbeds {
                    positions: placeholder_positions(batch)?,
                    embeds: Tensor::zeros(
                        vec![m, self.config.llm.hidden],
                        self.compute_dtype(),
                        dev,
                    )
                    .ctx("mllm", "zeros")?, // (M, C)
                })
            };
            return Ok(Embedded {
                modality,
                vision: None,
                audio: None,
                g_v: 0,
                g_a: 0,
            });
        }
        let dev = batch.ids.device();
        let c = self.config.llm.hidden;
        let (yv, vision) = match &batch.images {
            Some(px) => {
                let t0 = trace.start();
                let (y, b) = self.vision_forward(px)?;
                span(trace, t0, "vision", "fwd", mb)?;
                (Some(y), b)
            }
            None => (None, None),
        };
        let (ya, audio) = if batch.clips.is_empty() {
            (None, None)
        } else {
            let t0 = trace.start();
            let (y, b) = self.audio_forward(&batch.clips)?;
            span(trace, t0, "audio", "fwd", mb)?;
            (Some(y), b)
        };
        let g_v = yv.as_ref().map_or(0, |y| y.dims()[0]);
        let g_a = ya.as_ref().map_or(0, |y| y.dims()[0]);
        let m = g_v + g_a;
        if m != batch.num_modality_tokens() {
            return Err(Error::input(
                "mllm",
                format!(
                    "the projectors gave {g_v} image + {g_a} audio rows for {} placeholder positions",
                    batch.num_modality_tokens()
                ),
            ));
        }
        // One (M, C) block: image rows, then clip rows; positions in the same order.
        let embeds = match (yv, ya) {
            (None, None) => None,
            (Some(y), None) | (None, Some(y)) => Some(y),
            (Some(v), Some(a)) => {
                let mut all = Tensor::zeros(vec![m, c], v.dtype(), dev).ctx("mllm", "zeros")?; // (M, C)
                let iv = ids((0..g_v as u32).collect(), dev)?;
                let ia = ids((g_v as u32..m as u32).collect(), dev)?;
                ops::scatter_rows(&mut all, &iv, &v).ctx("mllm", "image rows")?;
                ops::scatter_rows(&mut all, &ia, &a).ctx("mllm", "clip rows")?;
                Some(all)
            }
        };
        let modality = match embeds {
            Some(embeds) => Some(ModalityEmbeds {
                positions: placeholder_positions(batch)?,
                embeds,
            }),
            None => None,
        };
        Ok(Embedded {
            modality,
            vision,
            audio,
            g_v,
            g_a,
        })
    }

    /// Activation recomputation per module: a module that recomputes keeps only each
    /// block's input for its backward.
    pub fn set_recompute(&mut self, llm: bool, vision: bool, audio: bool) {
        self.llm.stage.recompute = llm;
        if let Some(v) = &mut self.vision {
            v.recompute = vision;
        }
        if let Some(a) = &mut self.audio {
            a.recompute = audio;
        }
    }

    /// Logits (T, V) of a batch without keeping anything for backward; `zero_modality`
    /// replaces every image and clip embedding by zeros (what the model predicts from the
    /// text alone).
    pub fn logits(&self, batch: &MllmBatch, zero_modality: bool) -> Result<Tensor> {
        batch.validate(&self.config)?;
        let e = self.embed_modalities(batch, zero_modality, &mut Tracer::off(), 0)?;
        let (logits, _cache) = self
            .llm
            .forward(&batch.ids, &batch.seq, e.modality.as_ref())?;
        Ok(logits)
    }

    fn vision_forward(&self, px: &Tensor) -> Result<(Tensor, Option<VisionBranch>)> {
        let (Some(enc), Some(proj)) = (&self.vision, &self.vision_projector) else {
            return Err(missing("vision"));
        };
        vision_forward(enc, proj, px)
    }

    fn audio_forward(&self, clips: &[Tensor]) -> Result<(Tensor, Option<AudioBranch>)> {
        let (Some(enc), Some(proj)) = (&self.audio, &self.audio_projector) else {
            return Err(missing("audio"));
        };
        audio_forward(enc, proj, clips)
    }

    /// Adds the grad of the forward's loss into every trainable parameter's grad and
    /// returns the grads of the pixel values and clips whose encoder ran backward.
    pub fn backward(&mut self, cache: MllmCache) -> Result<InputGrads> {
        self.backward_traced(cache, &mut Tracer::off(), 0)
    }

    /// [`Mllm::backward`] of microbatch `mb`, each module's backward a span of `trace`.
    pub fn backward_traced(
        &mut self,
        cache: MllmCache,
        trace: &mut Tracer,
        mb: usize,
    ) -> Result<InputGrads> {
        let MllmCache {
            llm,
            vision,
            audio,
            g_v,
            g_a,
        } = cache;
        let mut grads = InputGrads::default();
        let Some((llm_cache, dlogits)) = llm else {
            return Ok(grads);
        };
        let t0 = trace.start();
        let dmod = self.llm.backward(llm_cache, &dlogits)?; // (M, C)
        drop(dlogits);
        span(trace, t0, "llm", "bwd", mb)?;
        if vision.is_none() && audio.is_none() {
            return Ok(grads);
        }
        let dmod = dmod.ok_or_else(|| missing("modality grads"))?;
        if let Some(vb) = vision {
            let t0 = trace.start();
            let part = rows(&dmod, 0, g_v)?;
            grads.pixel_values = self.vision_backward(vb, part.as_ref().unwrap_or(&dmod))?;
            span(trace, t0, "vision", "bwd", mb)?;
        }
        if let Some(ab) = audio {
            let t0 = trace.start();
            let part = rows(&dmod, g_v, g_a)?;
            grads.clips = self.audio_backward(ab, part.as_ref().unwrap_or(&dmod))?;
            span(trace, t0, "audio", "bwd", mb)?;
        }
        Ok(grads)
    }

    fn vision_backward(&mut self, vb: VisionBranch, dy: &Tensor) -> Result<Option<Tensor>> {
        let (Some(enc), Some(proj)) = (&mut self.vision, &mut self.vision_projector) else {
            return Err(missing("vision"));
        };
        vision_backward(enc, proj, vb, dy)
    }

    fn audio_backward(&mut self, ab: AudioBranch, dy: &Tensor) -> Result<Option<Vec<Tensor>>> {
        let (Some(enc), Some(proj)) = (&mut self.audio, &mut self.audio_projector) else {
            return Err(missing("audio"));
        };
        audio_backward(enc, proj, ab, dy)
    }
}

/// Ends `module`'s span of a pass (`fwd`, `bwd`) of microbatch `mb`, named as the parallel
/// engine names a stage's ("vision fwd s0 mb3": one rank is every module's only stage).
fn span(
    trace: &mut Tracer,
    t0: Option<std::time::Instant>,
    module: &str,
    pass: &str,
    mb: usize,
) -> Result<()> {
    trace
        .end_on_device(t0, format!("{module} {pass} s0 mb{mb}"), module)
        .ctx("mllm", "trace")
}

impl Module for Mllm {
    fn visit_params<'a>(&'a self, f: &mut dyn FnMut(&'a Param)) {
        if let Some(m) = &self.vision {
            m.visit_params(f);
        }
        if let Some(m) = &self.vision_projector {
            m.visit_params(f);
        }
        if let Some(m) = &self.audio {
            m.visit_params(f);
        }
        if let Some(m) = &self.audio_projector {
            m.visit_params(f);
        }
        self.llm.visit_params(f);
    }
    fn visit_params_mut(&mut self, f: &mut dyn FnMut(&mut Param)) {
        if let Some(m) = &mut self.vision {
            m.visit_params_mut(f);
        }
        if let Some(m) = &mut self.vision_projector {
            m.visit_params_mut(f);
        }
        if let Some(m) = &mut self.audio {
            m.visit_params_mut(f);
        }
        if let Some(m) = &mut self.audio_projector {
            m.visit_params_mut(f);
        }
        self.llm.visit_params_mut(f);
    }
}
