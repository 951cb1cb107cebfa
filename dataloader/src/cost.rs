//! Per-sample metadata (lengths per modality) and the per-module cost estimate stored with each sample.
//!
//! A sample is one tokenized conversation. Its LLM sequence has `llm_len` positions, each either a text
//! token or a placeholder that the scatter replaces with an image/clip embedding. Each image is also a
//! sequence of `patches` tokens through the vision encoder; each clip a sequence of `encoder_frames`
//! through the audio encoder (after its conv stem, which halves the `mel_frames`).
//!
//! Cost model (forward FLOPs, documented approximations — backward is ~2x forward for every term, so
//! it does not change relative costs and is left out):
//!
//! - linear: every token of a module passes through the module's matmul weights once, at 2 FLOPs per
//!   multiply-accumulate: `linear = 2 * width * tokens`, `width` = matmul parameters a token meets
//!   (all layers; fold the projector into the encoder's width).
//! - attention: a sequence of `L` tokens costs `QK^T` + `PV` = `2 * 2 * L^2 * hidden` FLOPs per layer:
//!   `attention = 4 * attn_width * L^2`, `attn_width = layers * hidden`. The LLM is causal: half of it.
//!   Each image and each clip is its own encoder sequence; the LLM uses varlen attention over packed
//!   rows, so a packed sample only attends within itself: the cost of a pack is the SUM of its
//!   samples' costs (every term here is additive over samples), never `(row length)^2`.

use std::iter::Sum;
use std::ops::{Add, AddAssign};

use serde::{Deserialize, Serialize};

/// One image of a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct ImageMeta {
    /// Vision-encoder sequence length (patches, incl. any class/register tokens the encoder adds).
    pub patches: u32,
    /// Placeholder positions this image fills in the LLM sequence (what the projector emits).
    pub llm_tokens: u32,
    /// First placeholder position in the LLM sequence (placeholders are contiguous). Needed so that
    /// truncation never cuts through an image.
    pub llm_offset: u32,
}

/// One audio clip of a sample.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct AudioMeta {
    /// Log-mel frames (10 ms hop: 100 per second).
    pub mel_frames: u32,
    /// Audio-encoder sequence length (after the conv stem).
    pub encoder_frames: u32,
    /// Placeholder positions this clip fills in the LLM sequence.
    pub llm_tokens: u32,
    /// First placeholder position in the LLM sequence.
    pub llm_offset: u32,
}

/// Lengths of one sample per modality. Invariant (checked by [`SampleMeta::validate`]):
/// `llm_len = text_tokens + sum(image llm_tokens) + sum(audio llm_tokens)`, placeholder spans inside
/// `[0, llm_len)` and disjoint.
#[derive(Clone, Debug, Default, PartialEq, Eq, Hash, Serialize, Deserialize)]
pub struct SampleMeta {
    /// LLM positions that are not placeholders (chat template and special tokens included).
    pub text_tokens: u32,
    pub images: Vec<ImageMeta>,
    pub audio: Vec<AudioMeta>,
    /// Total LLM sequence length (text + placeholders).
    pub llm_len: u32,
}

/// Which encoder a placeholder span belongs to.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Modality {
    Image,
    Audio,
}

impl std::fmt::Display for Modality {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.write_str(match self {
            Modality::Image => "image",
            Modality::Audio => "audio",
        })
    }
}

/// A placeholder span `[start, end)` of the LLM sequence: item `index` of `modality`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct Span {
    pub modality: Modality,
    pub index: usize,
    pub start: u64,
    pub end: u64,
}

/// Why a [`SampleMeta`] is inconsistent.
#[derive(Clone, Debug, PartialEq, Eq, thiserror::Error, Serialize, Deserialize)]
pub enum MetaError {
    #[error("llm_len {llm_len} != text_tokens {text_tokens} + placeholder tokens {placeholders}")]
    LenMismatch {
        llm_len: u64,
        text_tokens: u64,
        placeholders: u64,
    },
    #[error("{modality} {index}: {field} is 0")]
    EmptyItem {
        modality: Modality,
        index: usize,
        field: String,
    },
    #[error(
        "{modality} {index}: placeholder span [{start}, {end}) outside the LLM sequence of {llm_len}"
    )]
    SpanOutOfRange {
        modality: Modality,
        index: usize,
        start: u64,
        end: u64,
        llm_len: u64,
    },
    #[error("{a} and {b} placeholder spans overlap")]
    SpanOverlap { a: String, b: String },
}

impl SampleMeta {
    /// A text-only sample of `n` tokens.
    pub fn text(n: u32) -> Self {
        SampleMeta {
            text_tokens: n,
            images: Vec::new(),
            audio: Vec::new(),
            llm_len: n,
        }
    }

    /// Builds a sample from its parts; `llm_len` is derived (saturating; `validate` catches overflow).
    pub fn new(text_tokens: u32, images: Vec<ImageMeta>, audio: Vec<AudioMeta>) -> Self {
        let total = text_tokens as u64 + placeholder_sum(&images, &audio);
        SampleMeta {
            text_tokens,
            images,
            audio,
            llm_len: total.min(u32::MAX as u64) as u32,
        }
    }

    /// Placeholder tokens of all images.
    pub fn image_tokens(&self) -> u64 {
        self.images.iter().map(|i| i.llm_tokens as u64).sum()
    }

    /// Placeholder tokens of all clips.
    pub fn audio_tokens(&self) -> u64 {
        self.audio.iter().map(|a| a.llm_tokens as u64).sum()
    }

    /// Vision-encoder tokens of all images.
    pub fn patches(&self) -> u64 {
        self.images.iter().map(|i| i.patches as u64).sum()
    }

    /// Audio-encoder tokens of all clips.
    pub fn encoder_frames(&self) -> u64 {
        self.audio.iter().map(|a| a.encoder_frames as u64).sum()
    }

    /// Placeholder spans of images then clips, in list order (not sorted by position).
    pub fn spans(&self) -> impl Iterator<Item = Span> + '_ {
        let img = self.images.iter().enumerate().map(|(index, i)| Span {
            modality: Modality::Image,
            index,
            start: i.llm_offset as u64,
            end: i.llm_offset as u64 + i.llm_tokens as u64,
        });
        let aud = self.audio.iter().enumerate().map(|(index, a)| Span {
            modality: Modality::Audio,
            index,
            start: a.llm_offset as u64,
            end: a.llm_offset as u64 + a.llm_tokens as u64,
        });
        img.chain(aud)
    }

    /// Checks the invariants in the type's doc. Never panics, whatever the field values.
    pub fn validate(&self) -> Result<(), MetaError> {
        let placeholders = placeholder_sum(&self.images, &self.audio);
        if self.text_tokens as u64 + placeholders != self.llm_len as u64 {
            return Err(MetaError::LenMismatch {
                llm_len: self.llm_len as u64,
                text_tokens: self.text_tokens as u64,
                placeholders,
            });
        }
        for (index, i) in self.images.iter().enumerate() {
            for (field, v) in [("patches", i.patches), ("llm_tokens", i.llm_tokens)] {
                if v == 0 {
                    let (modality, field) = (Modality::Image, field.to_string());
                    return Err(MetaError::EmptyItem {
                        modality,
                        index,
                        field,
                    });
                }
            }
        }
        for (index, a) in self.audio.iter().enumerate() {
            let fields = [
                ("mel_frames", a.mel_frames),
                ("encoder_frames", a.encoder_frames),
                ("llm_tokens", a.llm_tokens),
            ];
            for (field, v) in fields {
                if v == 0 {
                    let (modality, field) = (Modality::Audio, field.to_string());
                    return Err(MetaError::EmptyItem {
                        modality,
                        index,
                        field,
                    });
                }
            }
        }
        let mut spans: Vec<Span> = self.spans().collect();
        for s in &spans {
            if s.end > self.llm_len as u64 {
                return Err(MetaError::SpanOutOfRange {
                    modality: s.modality,
                    index: s.index,
                    start: s.start,
                    end: s.end,
                    llm_len: self.llm_len as u64,
                });
            }
        }
        spans.sort_by_key(|s| (s.start, s.end));
        for w in spans.windows(2) {
            if let [a, b] = w
                && b.start < a.end
            {
                return Err(MetaError::SpanOverlap {
                    a: format!("{} {}", a.modality, a.index),
                    b: format!("{} {}", b.modality, b.index),
                });
            }
        }
        Ok(())
    }
}

fn placeholder_sum(images: &[ImageMeta], audio: &[AudioMeta]) -> u64 {
    images.iter().map(|i| i.llm_tokens as u64).sum::<u64>()
        + audio.iter().map(|a| a.llm_tokens as u64).sum::<u64>()
}

/// Cost of one module for one sample (or, summed, for a pack): forward FLOPs split in two terms.
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct ModuleCost {
    /// Token-proportional matmul FLOPs.
    pub linear: f64,
    /// Sequence-length-quadratic attention FLOPs (sum over sequences of L^2, scaled).
    pub attention: f64,
}

impl ModuleCost {
    pub fn total(&self) -> f64 {
        self.linear + self.attention
    }
}

impl Add for ModuleCost {
    type Output = ModuleCost;
    fn add(self, o: ModuleCost) -> ModuleCost {
        ModuleCost {
            linear: self.linear + o.linear,
            attention: self.attention + o.attention,
        }
    }
}

impl AddAssign for ModuleCost {
    fn add_assign(&mut self, o: ModuleCost) {
        *self = *self + o;
    }
}

impl Sum for ModuleCost {
    fn sum<I: Iterator<Item = ModuleCost>>(it: I) -> ModuleCost {
        it.fold(ModuleCost::default(), Add::add)
    }
}

/// Cost of one sample per module. Additive over the samples of a pack (varlen attention).
#[derive(Clone, Copy, Debug, Default, PartialEq, Serialize, Deserialize)]
pub struct SampleCost {
    pub vision: ModuleCost,
    pub audio: ModuleCost,
    pub llm: ModuleCost,
}

impl SampleCost {
    pub fn total(&self) -> f64 {
        self.vision.total() + self.audio.total() + self.llm.total()
    }
}

impl Add for SampleCost {
    type Output = SampleCost;
    fn add(self, o: SampleCost) -> SampleCost {
        SampleCost {
            vision: self.vision + o.vision,
            audio: self.audio + o.audio,
            llm: self.llm + o.llm,
        }
    }
}

impl AddAssign for SampleCost {
    fn add_assign(&mut self, o: SampleCost) {
        *self = *self + o;
    }
}

impl Sum for SampleCost {
    fn sum<I: Iterator<Item = SampleCost>>(it: I) -> SampleCost {
        it.fold(SampleCost::default(), Add::add)
    }
}

/// Module sizes the cost model needs. Defaults: a SigLIP-so400m-like vision tower (~0.4 B matmul
/// params, 27 layers x 1152), a Whisper-large-like audio encoder (~0.6 B, 32 x 1280) and a 7 B
/// Qwen2-like LLM (~6.5 B non-embedding params, 28 x 3584). Only ratios matter for balancing.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct CostModelConfig {
    /// Matmul parameters a vision token meets (encoder layers + projector).
    pub vision_width: f64,
    /// Matmul parameters an audio-encoder frame meets (encoder layers + projector).
    pub audio_width: f64,
    /// Matmul parameters an LLM token meets (all layers, LM head included if wanted).
    pub llm_width: f64,
    /// `layers * hidden` of the vision encoder (bidirectional attention).
    pub vision_attn_width: f64,
    /// `layers * hidden` of the audio encoder (bidirectional attention).
    pub audio_attn_width: f64,
    /// `layers * hidden` of the LLM (causal: counted at half).
    pub llm_attn_width: f64,
}

impl Default for CostModelConfig {
    fn default() -> Self {
        CostModelConfig {
            vision_width: 4.0e8,
            audio_width: 6.3e8,
            llm_width: 6.5e9,
            vision_attn_width: 27.0 * 1152.0,
            audio_attn_width: 32.0 * 1280.0,
            llm_attn_width: 28.0 * 3584.0,
        }
    }
}

impl CostModelConfig {
    /// All widths 0.5 and attention widths 0.25 (0.5 for the causal LLM): `linear` is then exactly the
    /// token count and `attention` exactly the sum of squared sequence lengths. Handy in tests.
    pub fn unit() -> Self {
        CostModelConfig {
            vision_width: 0.5,
            audio_width: 0.5,
            llm_width: 0.5,
            vision_attn_width: 0.25,
            audio_attn_width: 0.25,
            llm_attn_width: 0.5,
        }
    }

    /// Forward-FLOP estimate of one sample per module (see the module doc for the formulas).
    pub fn sample_cost(&self, m: &SampleMeta) -> SampleCost {
        let sq = |x: u32| (x as f64) * (x as f64);
        let vision = ModuleCost {
            linear: 2.0 * self.vision_width * m.patches() as f64,
            attention: 4.0
                * self.vision_attn_width
                * m.images.iter().map(|i| sq(i.patches)).sum::<f64>(),
        };
        let audio = ModuleCost {
            linear: 2.0 * self.audio_width * m.encoder_frames() as f64,
            attention: 4.0
                * self.audio_attn_width
                * m.audio.iter().map(|a| sq(a.encoder_frames)).sum::<f64>(),
        };
        let llm = ModuleCost {
            linear: 2.0 * self.llm_width * m.llm_len as f64,
            attention: 2.0 * self.llm_attn_width * sq(m.llm_len),
        };
        SampleCost { vision, audio, llm }
    }
}
