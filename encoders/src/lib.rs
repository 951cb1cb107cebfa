//! braid-encoders: vision (CLIP/SigLIP ViT) and audio (Whisper-style) encoders, projectors, Hugging Face weight import.
//!
//! Every module is a forward/backward pair (see braid-nn): forward returns the output
//! and a cache, backward takes the cache and the output grad, returns the input grad
//! and adds into the parameter grads. Inputs are packed: several images (one size per
//! call) or several clips (any lengths) go through one call as variable-length
//! sequences, so attention never crosses samples.
//!
//! Hugging Face checkpoints are read with `from_hf_dir` and written with `export_hf`;
//! each family has ONE Braid <-> HF name table ([`vision_hf::vision_name_map`],
//! [`audio_hf::whisper_name_map`]) used in both directions.

pub mod audio;
pub mod audio_hf;
pub mod config;
pub mod projector;
pub mod siglip_head;
mod util;
pub mod vision;
pub mod vision_hf;
pub mod weights;

pub use audio::{
    AudioCache, AudioOutput, AudioStageCache, AudioStageGrad, AudioStageInput, AudioStageOutput,
    AudioStem, WhisperEncoder,
};
pub use config::{Act, VisionConfig, VisionFamily, WhisperEncoderConfig};
pub use projector::{AudioProjector, MlpProjector, ProjectorConfig};
pub use vision::{VisionCache, VisionEncoder, VisionOutput};
pub use vision::{VisionStageCache, VisionStageInput, VisionStageOutput};
pub use vision_hf::HfImport;
pub use weights::{Layout, MapEntry, NameMap};
