//! Media decoding for the encoders: images (decode, resize, normalize) and audio
//! (decode, mono, 16 kHz, Whisper log-mel). Host data only.

pub mod audio;
pub mod image;
pub mod mel;
mod resize;
