//! Symphonia decode of one audio stream to mono f32 at the source rate: probe, header checks
//! (rate, channels, declared duration) before any decoding, packet loop with downmix and the
//! frame budget, and the truncation/corruption policy described in the parent module.

use std::io::Cursor;

use symphonia::core::codecs::audio::AudioDecoderOptions;
use symphonia::core::codecs::audio::well_known::{CODEC_ID_MP1, CODEC_ID_MP2, CODEC_ID_MP3};
use symphonia::core::errors::Error as SymError;
use symphonia::core::formats::probe::Hint;
use symphonia::core::formats::{FormatOptions, TrackType};
use symphonia::core::io::{MediaSourceStream, MediaSourceStreamOptions};
use symphonia::core::meta::MetadataOptions;

use super::{
    AudioConfig, AudioError, Decoded, MAX_AMPLITUDE, MAX_CHANNELS, OnLong, SOURCE_RATE_RANGE,
};

/// Human-readable symphonia error.
fn sym_reason(e: &SymError) -> String {
    e.to_string()
}

pub(super) fn decode_mono(
    bytes: &[u8],
    name: &str,
    cfg: &AudioConfig,
) -> Result<Decoded, AudioError> {
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
    let peak = mono.iter().fold(0.0f32, |m, x| m.max(x.abs()));
    if peak > MAX_AMPLITUDE {
        return Err(AudioError::TooLoud {
            name: name.into(),
            peak,
        });
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
