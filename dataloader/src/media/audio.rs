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
//! reported as `Corrupt`; the default panic hook still prints it to stderr.

use std::collections::HashMap;
use std::io::Cursor;
use std::panic::{AssertUnwindSafe, catch_unwind};

use rubato::audioadapter_buffers::direct::InterleavedSlice;
use rubato::{
    Async, Fft, FixedAsync, FixedSync, Resampler, SincInterpolationParameters, WindowFunction,
};
use serde::{Deserialize, Serialize};
use symphonia::core::codecs::audio::AudioDecoderOptions;
use symphonia::core::codecs::audio::well_known::{CODEC_ID_MP1, CODEC_ID_MP2, CODEC_ID_MP3};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, TrackType};
use symphonia::core::io::{MediaSourceStream, MediaSourceStreamOptions};
use symphonia::core::meta::MetadataOptions;

/// Source sample rates outside this range are rejected as absurd (Hz).
pub const SOURCE_RATE_RANGE: std::ops::RangeInclusive<u32> = 1_000..=768_000;
/// Most channels a source may have (7.1.4 and similar layouts fit; 1000 channels do not).
pub const MAX_CHANNELS: usize = 32;
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
        let decoded = catch_unwind(AssertUnwindSafe(|| decode_mono(bytes, name, &self.cfg)))
            .unwrap_or_else(|_| {
                Err(AudioError::Corrupt {
                    name: name.into(),
                    reason: "the decoder panicked on this stream".into(),
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

/// Human-readable symphonia error.
fn sym_reason(e: &SymError) -> String {
    e.to_string()
}

fn decode_mono(bytes: &[u8], name: &str, cfg: &AudioConfig) -> Result<Decoded, AudioError> {
    let corrupt = |reason: String| AudioError::Corrupt {
        name: name.into(),
        reason,
    };
    let mss = MediaSourceStream::new(
        Box::new(Cursor::new(bytes)),
        MediaSourceStreamOptions::default(),
    );
    let mut hint = Hint::new();
    if let Some(ext) = name.rsplit_once('.').map(|(_, e)| e.to_ascii_lowercase()) {
        hint.with_extension(&ext);
    }
    let mut format = symphonia::default::get_probe()
        .probe(
            &hint,
            mss,
            FormatOptions::default(),
            MetadataOptions::default(),
        )
        .map_err(|e| match e {
            SymError::Unsupported(_) => AudioError::Unsupported {
                name: name.into(),
                reason: sym_reason(&e),
            },
            // Some readers scan to the end at open time (OGG looks for the last granule).
            SymError::IoError(ref io) if io.kind() == std::io::ErrorKind::UnexpectedEof => {
                AudioError::Truncated {
                    name: name.into(),
                    detail: "the stream ends while its header or index is read".into(),
                }
            }
            _ => corrupt(format!("while reading the header: {}", sym_reason(&e))),
        })?;

    let track = format
        .default_track(TrackType::Audio)
        .ok_or_else(|| AudioError::Unsupported {
            name: name.into(),
            reason: "no audio track".into(),
        })?;
    let track_id = track.id;
    let params = track
        .codec_params
        .as_ref()
        .and_then(|p| p.audio())
        .ok_or_else(|| AudioError::Unsupported {
            name: name.into(),
            reason: "the audio track has no codec parameters".into(),
        })?
        .clone();

    // ---- header checks, before a single packet is decoded ----
    let header_rate = params.sample_rate;
    if let Some(rate) = header_rate {
        check_rate(rate, name)?;
    }
    if let Some(ch) = &params.channels {
        check_channels(ch.count(), name)?;
    }
    // Declared length in source frames: num_frames, else the duration in the track's time base.
    let declared_frames = track.num_frames;
    let declared_seconds = match (declared_frames, header_rate) {
        (Some(n), Some(rate)) => Some(n as f64 / rate as f64),
        _ => match (track.duration, track.time_base) {
            (Some(d), Some(tb)) => tb.calc_duration(d).map(|t| t.as_secs_f64()),
            _ => None,
        },
    };
    if let Some(secs) = declared_seconds
        && secs > cfg.max_seconds as f64
        && cfg.on_long == OnLong::Reject
    {
        return Err(AudioError::TooLong {
            name: name.into(),
            seconds: secs,
            max: cfg.max_seconds,
            when: " (declared by the header; not decoded)",
        });
    }

    let mut decoder = symphonia::default::get_codecs()
        .make_audio_decoder(&params, &AudioDecoderOptions::default())
        .map_err(|e| AudioError::Unsupported {
            name: name.into(),
            reason: format!("codec: {}", sym_reason(&e)),
        })?;

    // ---- decode, downmixing to mono as we go ----
    let mut mono: Vec<f32> = Vec::new(); // (frames,)
    let mut planes: Vec<Vec<f32>> = Vec::new(); // (C, frames_in_packet)
    let mut rate: Option<u32> = None;
    let mut channels = 0usize;
    let mut budget = u64::MAX; // source frames allowed, known once the rate is
    let mut truncated_to_budget = false;
    let mut decoded_frames: u64 = 0;
    let mut packet_no = 0u64;
    loop {
        let packet = match format.next_packet() {
            Ok(Some(p)) => p,
            Ok(None) => break,
            Err(SymError::IoError(e)) if e.kind() == std::io::ErrorKind::UnexpectedEof => {
                // The stream ended inside a packet or a chunk header: cut short.
                return Err(AudioError::Truncated {
                    name: name.into(),
                    detail: format!(
                        "the stream ends inside packet {packet_no} ({decoded_frames} frames decoded before it): {e}"
                    ),
                });
            }
            Err(SymError::ResetRequired) => {
                return Err(corrupt(
                    "the stream changes its track layout (chained stream)".into(),
                ));
            }
            Err(e) => {
                return Err(corrupt(format!(
                    "demuxing packet {packet_no}: {}",
                    sym_reason(&e)
                )));
            }
        };
        packet_no += 1;
        if packet.track_id != track_id {
            continue;
        }
        let buf = decoder.decode(&packet).map_err(|e| {
            corrupt(format!(
                "decoding packet {} : {}",
                packet_no - 1,
                sym_reason(&e)
            ))
        })?;
        let spec = buf.spec();
        let (r, c) = (spec.rate(), spec.channels().count());
        match rate {
            None => {
                check_rate(r, name)?;
                check_channels(c, name)?;
                rate = Some(r);
                channels = c;
                budget = (cfg.max_seconds as f64 * r as f64).floor() as u64;
            }
            Some(r0) if r0 != r || channels != c => {
                return Err(corrupt(format!(
                    "the format changes mid-stream ({r0} Hz x {channels} ch -> {r} Hz x {c} ch)"
                )));
            }
            Some(_) => {}
        }
        let frames = buf.frames();
        if frames == 0 {
            continue;
        }
        // Planar copy (symphonia's native layout), converted to f32 in [-1, 1].
        buf.copy_to_vecs_planar(&mut planes);
        // Keep only what the budget allows (Truncate), or stop at the first frame over (Reject).
        let room = budget.saturating_sub(decoded_frames);
        let take = (frames as u64).min(room) as usize;
        if take < frames {
            if cfg.on_long == OnLong::Reject {
                return Err(AudioError::TooLong {
                    name: name.into(),
                    seconds: (decoded_frames + frames as u64) as f64 / r as f64,
                    max: cfg.max_seconds,
                    when: " (found while decoding)",
                });
            }
            truncated_to_budget = true;
        }
        downmix_into(&planes, take, &mut mono);
        decoded_frames += take as u64;
        if truncated_to_budget {
            break;
        }
    }

    if mono.is_empty() {
        return Err(match declared_frames {
            Some(d) if d > 0 => AudioError::Truncated {
                name: name.into(),
                detail: format!("the header declares {d} frames, none decode"),
            },
            _ => AudioError::NoSamples { name: name.into() },
        });
    }
    let Some(rate) = rate else {
        return Err(AudioError::NoSamples { name: name.into() });
    };
    // A header that declares more frames than decode means the data was cut. WAV, FLAC and
    // Vorbis declare the exact count; an MP3 without a Xing/VBRI tag gets an estimate from the
    // first 16 frames and the file size (trailing tags count), so it is only held to 90%.
    if !truncated_to_budget && let Some(declared) = declared_frames {
        let is_mpeg = [CODEC_ID_MP1, CODEC_ID_MP2, CODEC_ID_MP3].contains(&params.codec);
        let slack = if is_mpeg { declared / 10 } else { 0 };
        if decoded_frames + slack < declared {
            return Err(AudioError::Truncated {
                name: name.into(),
                detail: format!(
                    "the header declares {declared} frames, only {decoded_frames} decode"
                ),
            });
        }
    }
    if mono.iter().any(|x| !x.is_finite()) {
        return Err(AudioError::NonFinite { name: name.into() });
    }
    Ok(Decoded { mono, rate })
}

/// Appends the mean of the channels' first `frames` samples: plane 0 copied, the others
/// added in order (contiguous loops the compiler vectorises), then one scale.
fn downmix_into(planes: &[Vec<f32>], frames: usize, out: &mut Vec<f32>) {
    let start = out.len();
    let Some((first, rest)) = planes.split_first() else {
        return;
    };
    let frames = planes.iter().map(|p| p.len()).fold(frames, usize::min);
    out.extend_from_slice(&first[..frames]);
    if rest.is_empty() {
        return;
    }
    let dst = &mut out[start..];
    for p in rest {
        for (d, &v) in dst.iter_mut().zip(&p[..frames]) {
            *d += v;
        }
    }
    let inv = 1.0 / planes.len() as f32;
    for d in dst.iter_mut() {
        *d *= inv;
    }
}

fn check_rate(rate: u32, name: &str) -> Result<(), AudioError> {
    if SOURCE_RATE_RANGE.contains(&rate) {
        Ok(())
    } else {
        Err(AudioError::BadFormat {
            name: name.into(),
            what: "sample rate (Hz)",
            value: rate as u64,
            range: format!(
                "{}..={}",
                SOURCE_RATE_RANGE.start(),
                SOURCE_RATE_RANGE.end()
            ),
        })
    }
}

fn check_channels(c: usize, name: &str) -> Result<(), AudioError> {
    if (1..=MAX_CHANNELS).contains(&c) {
        Ok(())
    } else {
        Err(AudioError::BadFormat {
            name: name.into(),
            what: "channel count",
            value: c as u64,
            range: format!("1..={MAX_CHANNELS}"),
        })
    }
}
