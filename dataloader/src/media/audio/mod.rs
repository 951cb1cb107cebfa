//! Audio decoding for the Whisper-style audio encoder: bytes (WAV, FLAC, MP3, OGG/Vorbis) ->
//! mono f32 at 16 kHz, with every hostile-input case an `Err` naming the input, never a panic.
//!
//! Pipeline: size check (`max_bytes`) -> symphonia probe (format from the bytes, the file name
//! only as a hint) -> header checks BEFORE decoding: sample rate and channel count in sane
//! ranges, and the duration the header declares against `max_seconds` (the decompression-bomb
//! guard: a 200-byte WAV may claim ten hours) -> decode packet by packet, downmixing to mono
//! (mean of channels) as we go, with the frame budget enforced again while decoding (streams
//! whose header gives no length) -> resample to 16 kHz with rubato's FFT resampler (sinc for
//! rates whose ratio to 16 kHz reduces to a huge FFT) -> length checks.
//!
//! Corrupt-input policy (a choice, made here once): a container or codec error anywhere in the
//! stream rejects the clip with the reason, rather than keeping the decodable prefix. A corrupt
//! packet usually means audible garbage, and a truncated file (its header declares more frames
//! than decode, or the data ends inside a packet) is rejected as `Truncated`: training data is
//! better without a silently cut clip. Exceptions, by necessity: a stream with no declared length
//! that ends on a packet boundary is indistinguishable from a short one and is accepted, and an
//! MP3 whose length is only estimated (no Xing/VBRI tag) is held to 90% of the estimate.
//! A panic inside symphonia (it documents that malformed streams may panic) is caught and
//! reported as `Corrupt` with the panic's message ([`crate::guard`]), printed nowhere.

use std::collections::HashMap;

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{
    Async, Fft, FixedAsync, FixedSync, Resampler, SincInterpolationParameters, WindowFunction,
};
use serde::{Deserialize, Serialize};

mod decode;
use decode::decode_mono;

/// Source sample rates outside this range are rejected as absurd (Hz).
pub const SOURCE_RATE_RANGE: std::ops::RangeInclusive<u32> = 1_000..=768_000;
/// Most channels a source may have (7.1.4 and similar layouts fit; 1000 channels do not).
pub const MAX_CHANNELS: usize = 32;
/// The largest sample magnitude accepted (float audio lies within [-1, 1], integer PCM is
/// scaled into it): a window's power stays far below f32's range, where samples near 1e18
/// and up would overflow the log-mel to infinity and every step holding the clip to NaN.
pub const MAX_AMPLITUDE: f32 = 1e6;
/// A reduced rate ratio with a larger input side than this would make the FFT resampler's
/// plan huge (a 44 101 Hz file has no common factor with 16 000): use the sinc resampler.
const MAX_FFT_RATIO_SIDE: usize = 2048;
/// Resamplers kept per input rate; cleared when full so that odd rates cannot grow memory.
const MAX_CACHED_RESAMPLERS: usize = 8;
/// Target chunk size handed to rubato (frames of input per FFT block, before rounding).
const RESAMPLE_CHUNK: usize = 1024;

/// What to do with a clip longer than `max_seconds`.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum OnLong {
    /// Reject it (before decoding when the header declares the length).
    Reject,
    /// Keep its first `max_seconds` (decoding stops there).
    Truncate,
}

/// Audio decoding settings (`[data.audio]` in the data config).
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AudioConfig {
    /// Output sample rate; Whisper's log-mel is defined at 16 kHz, the only accepted value.
    pub sample_rate: u32,
    /// Mel bins: 80 (Whisper up to large-v2) or 128 (large-v3).
    pub n_mels: usize,
    /// Longest clip in seconds (Whisper's window is 30 s).
    pub max_seconds: f32,
    /// Longer clips are rejected or cut.
    pub on_long: OnLong,
    /// Shortest clip in output samples (at `sample_rate`); must exceed 200, half the STFT
    /// window, for the reflect padding of the log-mel. Default 1600 = 0.1 s = 10 mel frames.
    pub min_samples: usize,
    /// Largest encoded input in bytes, checked before anything is parsed.
    pub max_bytes: usize,
}

impl Default for AudioConfig {
    fn default() -> Self {
        AudioConfig {
            sample_rate: 16_000,
            n_mels: 80,
            max_seconds: 30.0,
            on_long: OnLong::Reject,
            min_samples: 1_600,
            max_bytes: 64 << 20,
        }
    }
}

impl AudioConfig {
    /// Checks every field; the error names the key.
    pub fn validate(&self) -> Result<(), AudioError> {
        let bad = |key: &str, why: String| Err(AudioError::Config(format!("{key}: {why}")));
        if self.sample_rate != 16_000 {
            return bad(
                "sample_rate",
                format!("{} (the Whisper log-mel needs 16000)", self.sample_rate),
            );
        }
        if self.n_mels != 80 && self.n_mels != 128 {
            return bad("n_mels", format!("{} (80 or 128)", self.n_mels));
        }
        if !(self.max_seconds.is_finite() && self.max_seconds > 0.0 && self.max_seconds <= 3600.0) {
            return bad(
                "max_seconds",
                format!("{} (must be in (0, 3600])", self.max_seconds),
            );
        }
        if self.min_samples <= crate::media::mel::N_FFT / 2 {
            return bad(
                "min_samples",
                format!(
                    "{} (must exceed {}, half the STFT window)",
                    self.min_samples,
                    crate::media::mel::N_FFT / 2
                ),
            );
        }
        if (self.min_samples as f64) > self.max_seconds as f64 * self.sample_rate as f64 {
            return bad(
                "min_samples",
                format!("{} is longer than max_seconds", self.min_samples),
            );
        }
        if self.max_bytes == 0 {
            return bad("max_bytes", "0".to_string());
        }
        Ok(())
    }

    /// Most output samples a clip may have.
    pub fn max_samples(&self) -> usize {
        (self.max_seconds as f64 * self.sample_rate as f64).floor() as usize
    }
}

/// Why a clip was rejected. Every message names the input.
#[derive(Debug, thiserror::Error)]
pub enum AudioError {
    #[error("invalid audio config: {0}")]
    Config(String),
    #[error("{name}: empty input (0 bytes)")]
    EmptyInput { name: String },
    #[error("{name}: {bytes} bytes exceeds max_bytes {max}")]
    TooManyBytes {
        name: String,
        bytes: usize,
        max: usize,
    },
    #[error("{name}: not a supported audio file (WAV, FLAC, MP3, OGG/Vorbis): {reason}")]
    Unsupported { name: String, reason: String },
    #[error("{name}: corrupt audio: {reason}")]
    Corrupt { name: String, reason: String },
    #[error("{name}: truncated: {detail}")]
    Truncated { name: String, detail: String },
    #[error("{name}: {what} {value} is out of range ({range})")]
    BadFormat {
        name: String,
        what: &'static str,
        value: u64,
        range: String,
    },
    #[error("{name}: {seconds:.2} s is longer than max_seconds {max}{when}")]
    TooLong {
        name: String,
        seconds: f64,
        max: f32,
        when: &'static str,
    },
    #[error("{name}: no audio samples")]
    NoSamples { name: String },
    #[error("{name}: {samples} samples at 16 kHz, fewer than min_samples {min}")]
    TooShort {
        name: String,
        samples: usize,
        min: usize,
    },
    #[error("{name}: non-finite sample value (NaN or infinity) in the stream")]
    NonFinite { name: String },
    #[error(
        "{name}: samples reach {peak:e}, over {MAX_AMPLITUDE:e} where float audio lies within [-1, 1]: its log-mel frames would overflow f32"
    )]
    TooLoud { name: String, peak: f32 },
    #[error("{name}: resampling {from} Hz -> {to} Hz failed: {reason}")]
    Resample {
        name: String,
        from: u32,
        to: u32,
        reason: String,
    },
}

impl AudioError {
    /// Short stable code for `rejects.jsonl` and counters.
    pub fn kind(&self) -> &'static str {
        match self {
            AudioError::Config(_) => "config",
            AudioError::EmptyInput { .. } => "empty_input",
            AudioError::TooManyBytes { .. } => "too_many_bytes",
            AudioError::Unsupported { .. } => "unsupported_format",
            AudioError::Corrupt { .. } => "corrupt",
            AudioError::Truncated { .. } => "truncated",
            AudioError::BadFormat { .. } => "bad_format",
            AudioError::TooLong { .. } => "too_long",
            AudioError::NoSamples { .. } => "no_samples",
            AudioError::TooShort { .. } => "too_short",
            AudioError::NonFinite { .. } => "non_finite",
            AudioError::TooLoud { .. } => "too_loud",
            AudioError::Resample { .. } => "resample",
        }
    }
}

/// Decodes one clip with a fresh [`AudioDecoder`]. Use an `AudioDecoder` per worker to reuse
/// the resampler plans across clips.
pub fn decode_audio(bytes: &[u8], name: &str, cfg: &AudioConfig) -> Result<Vec<f32>, AudioError> {
    AudioDecoder::new(cfg.clone())?.decode(bytes, name)
}

/// A reusable decoder: holds the config and one resampler per source rate seen.
pub struct AudioDecoder {
    cfg: AudioConfig,
    resamplers: HashMap<u32, Box<dyn Resampler<f32>>>,
}

impl std::fmt::Debug for AudioDecoder {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        let mut rates: Vec<_> = self.resamplers.keys().collect();
        rates.sort();
        f.debug_struct("AudioDecoder")
            .field("cfg", &self.cfg)
            .field("cached_resampler_rates", &rates)
            .finish()
    }
}

/// Decoded source audio before resampling.
struct Decoded {
    // (frames,) mono, at `rate`
    mono: Vec<f32>,
    rate: u32,
}

impl AudioDecoder {
    /// Validates the config.
    pub fn new(cfg: AudioConfig) -> Result<Self, AudioError> {
        cfg.validate()?;
        Ok(AudioDecoder {
            cfg,
            resamplers: HashMap::new(),
        })
    }

    pub fn config(&self) -> &AudioConfig {
        &self.cfg
    }

    /// bytes -> mono f32 at `cfg.sample_rate`, at most `cfg.max_samples()` long.
    pub fn decode(&mut self, bytes: &[u8], name: &str) -> Result<Vec<f32>, AudioError> {
        if bytes.is_empty() {
            return Err(AudioError::EmptyInput { name: name.into() });
        }
        if bytes.len() > self.cfg.max_bytes {
            return Err(AudioError::TooManyBytes {
                name: name.into(),
                bytes: bytes.len(),
                max: self.cfg.max_bytes,
            });
        }
        // symphonia is safe Rust but documents that some malformed streams may panic; a panic
        // in a third-party decoder on hostile bytes must still be a reject, not a dead worker.
        let decoded =
            crate::guard::catch(|| decode_mono(bytes, name, &self.cfg)).unwrap_or_else(|why| {
                Err(AudioError::Corrupt {
                    name: name.into(),
                    reason: format!("the decoder panicked on this stream: {why}"),
                })
            })?;
        let mut out = self.resample(decoded, name)?;
        // The resampler rounds the length up; never exceed the budget after Truncate.
        out.truncate(self.cfg.max_samples());
        if out.len() < self.cfg.min_samples {
            return Err(AudioError::TooShort {
                name: name.into(),
                samples: out.len(),
                min: self.cfg.min_samples,
            });
        }
        Ok(out)
    }

    fn resample(&mut self, d: Decoded, name: &str) -> Result<Vec<f32>, AudioError> {
        let to = self.cfg.sample_rate;
        if d.rate == to {
            return Ok(d.mono);
        }
        let err = |reason: String| AudioError::Resample {
            name: name.into(),
            from: d.rate,
            to,
            reason,
        };
        if !self.resamplers.contains_key(&d.rate) {
            if self.resamplers.len() >= MAX_CACHED_RESAMPLERS {
                self.resamplers.clear();
            }
            let r = make_resampler(d.rate, to).map_err(err)?;
            self.resamplers.insert(d.rate, r);
        }
        let r = self
            .resamplers
            .get_mut(&d.rate)
            .ok_or_else(|| err("resampler cache miss".into()))?;
        let frames = d.mono.len();
        let input = InterleavedSlice::new(&d.mono, 1, frames).map_err(|e| err(e.to_string()))?;
        // process_all resets the resampler, runs it chunk by chunk and trims its delay, so the
        // output lines up with the input and has ceil(frames * to / from) samples.
        let out = r
            .process_all(&input, frames, None)
            .map_err(|e| err(e.to_string()))?;
        Ok(out.take_data())
    }
}

fn make_resampler(from: u32, to: u32) -> Result<Box<dyn Resampler<f32>>, String> {
    let (from_us, to_us) = (from as usize, to as usize);
    let g = gcd(from_us, to_us);
    if from_us / g <= MAX_FFT_RATIO_SIDE && to_us / g <= MAX_FFT_RATIO_SIDE {
        // Synchronous FFT resampler: fixed ratio, full quality, cheapest per sample.
        let r = Fft::<f32>::new(from_us, to_us, RESAMPLE_CHUNK, 1, FixedSync::Both)
            .map_err(|e| e.to_string())?;
        Ok(Box::new(r))
    } else {
        // Same quality class (rubato's docs: cubic sinc ~ FFT), no giant FFT plan.
        let params = SincInterpolationParameters::new(256, WindowFunction::BlackmanHarris2);
        let r = Async::<f32>::new_sinc(
            to as f64 / from as f64,
            1.0,
            &params,
            RESAMPLE_CHUNK,
            1,
            FixedAsync::Input,
        )
        .map_err(|e| e.to_string())?;
        Ok(Box::new(r))
    }
}

fn gcd(mut a: usize, mut b: usize) -> usize {
    while b != 0 {
        (a, b) = (b, a % b);
    }
    a.max(1)
}
