//! Audio decoding: hand-written WAVs (every PCM width, float, stereo), FLAC/OGG/MP3 fixtures,
//! resampling accuracy, config validation and decoders on worker threads.

#![allow(clippy::unwrap_used)]

mod common;

use std::f64::consts::PI;

use braid_dataloader::media::audio::{AudioConfig, AudioDecoder, OnLong, decode_audio};
use braid_dataloader::media::mel::MelExtractor;

use common::audio_util::*;

// ---------------------------------------------------------------- WAV decoding

#[test]
fn wav_every_pcm_width_and_float_round_trips_at_16k() {
    let x: Vec<f32> = sine(440.0, 16_000, 4000, 0.8)
        .iter()
        .zip(uniform_noise(4000, 7))
        .map(|(s, n)| s + 0.1 * n)
        .collect();
    // Tolerance: one quantisation step of each format (symphonia scales by 2^(bits-1)).
    for (fmt, tol) in [
        (Fmt::U8, 2.0 / 128.0),
        (Fmt::I16, 2.0 / 32768.0),
        (Fmt::I24, 2.0 / 8_388_608.0),
        (Fmt::I32, 1e-6),
        (Fmt::F32, 0.0),
    ] {
        let got = decode_audio(&wav(fmt, 16_000, 1, &x), "clip.wav", &cfg())
            .unwrap_or_else(|e| panic!("{fmt:?}: {e}"));
        assert_eq!(got.len(), x.len(), "{fmt:?}");
        let err = got
            .iter()
            .zip(&x)
            .map(|(a, b)| (a - b).abs())
            .fold(0.0f32, f32::max);
        assert!(err <= tol, "{fmt:?}: max err {err} > {tol}");
    }
}

#[test]
fn wav_stereo_is_downmixed_to_the_mean() {
    let l = sine(300.0, 16_000, 3200, 0.6);
    let r: Vec<f32> = uniform_noise(3200, 3).iter().map(|v| 0.2 * v).collect();
    let got = decode_audio(
        &wav(Fmt::F32, 16_000, 2, &interleave(&l, &r)),
        "st.wav",
        &cfg(),
    )
    .unwrap();
    assert_eq!(got.len(), 3200);
    for i in 0..3200 {
        assert!((got[i] - 0.5 * (l[i] + r[i])).abs() < 1e-6, "frame {i}");
    }
    // Opposite-phase channels cancel.
    let neg: Vec<f32> = l.iter().map(|v| -v).collect();
    let got = decode_audio(
        &wav(Fmt::I16, 16_000, 2, &interleave(&l, &neg)),
        "c.wav",
        &cfg(),
    )
    .unwrap();
    assert!(got.iter().all(|v| v.abs() < 1e-4));
}

#[test]
fn format_is_probed_from_bytes_not_the_name() {
    let x = sine(500.0, 16_000, 2000, 0.5);
    let bytes = wav(Fmt::I16, 16_000, 1, &x);
    for name in ["a.mp3", "a.flac", "noext", "a.WAV", ""] {
        let got = decode_audio(&bytes, name, &cfg()).unwrap_or_else(|e| panic!("{name}: {e}"));
        assert_eq!(got.len(), 2000, "{name}");
    }
}

// ---------------------------------------------------------------- resampling

#[test]
fn resampling_preserves_a_1khz_tone_frequency_and_amplitude() {
    let mut dec = AudioDecoder::new(cfg()).unwrap();
    // 44 101 Hz has no common factor with 16 000 worth an FFT: it takes the sinc path.
    for rate in [
        8_000u32, 11_025, 22_050, 32_000, 44_100, 48_000, 96_000, 44_101,
    ] {
        let n = rate as usize; // 1 s
        let l = sine(1000.0, rate, n, 0.5);
        let bytes = wav(Fmt::F32, rate, 2, &interleave(&l, &l));
        let got = dec
            .decode(&bytes, "tone.wav")
            .unwrap_or_else(|e| panic!("{rate}: {e}"));
        assert!(
            (got.len() as i64 - 16_000).abs() <= 1,
            "{rate}: {} samples",
            got.len()
        );
        // Ignore the edges, where the resampler's filter sees the clip boundary.
        let mid = &got[800..got.len() - 800];
        let f = peak_freq(mid, 16_000.0);
        assert!((f - 1000.0).abs() < 0.5, "{rate}: peak at {f} Hz");
        let r = rms(mid);
        let want = 0.5 / 2f64.sqrt();
        assert!((r / want - 1.0).abs() < 0.01, "{rate}: rms {r} vs {want}");
        // Alignment: rubato trims its delay to within a sample (its filters leave a fractional
        // offset, observed 0 to 0.73 output samples, <= 46 us), so the best-fitting delay of the
        // ideal 16 kHz tone is under one sample, and after it the waveform matches closely.
        // Least-squares phase of the 1 kHz component: v ~ A sin(w (t - d)) gives
        // sum v sin(wt) ~ A cos(wd) N/2 and sum v cos(wt) ~ -A sin(wd) N/2.
        let w = 2.0 * PI * 1000.0 / 16_000.0;
        let (mut ps, mut pc) = (0.0f64, 0.0f64);
        for (i, &v) in mid.iter().enumerate() {
            let t = (i + 800) as f64;
            ps += v as f64 * (w * t).sin();
            pc += v as f64 * (w * t).cos();
        }
        let best_d = (-pc).atan2(ps) / w;
        let best_err = mid
            .iter()
            .enumerate()
            .map(|(i, &v)| {
                let t = (i + 800) as f64 - best_d;
                (v as f64 - 0.5 * (w * t).sin()).abs()
            })
            .fold(0.0, f64::max);
        assert!(best_d.abs() < 1.0, "{rate}: delay {best_d} samples");
        assert!(
            best_err < 2e-3,
            "{rate}: max deviation {best_err} after a {best_d} sample delay"
        );
    }
}

#[test]
fn resampling_removes_content_above_8khz() {
    // A 12 kHz tone at 48 kHz is above the 16 kHz Nyquist: it must vanish, not alias to 4 kHz.
    let x = sine(12_000.0, 48_000, 48_000, 0.5);
    let got = decode_audio(&wav(Fmt::F32, 48_000, 1, &x), "hf.wav", &cfg()).unwrap();
    let r = rms(&got[800..got.len() - 800]);
    assert!(r < 1e-3, "alias energy {r}");
}

// ---------------------------------------------------------------- FLAC / OGG / MP3 fixtures

#[test]
fn compressed_fixtures_decode_to_the_tone() {
    // tone.*: 0.5 s, 44.1 kHz stereo, 1 kHz, left 0.5, right 0.25 -> mono amplitude 0.375.
    let want_rms = 0.375 / 2f64.sqrt();
    for (file, rms_tol) in [("tone.flac", 0.002), ("tone.ogg", 0.03), ("tone.mp3", 0.03)] {
        let bytes = read_fixture(file);
        assert!(bytes.len() < 50_000, "{file} is {} bytes", bytes.len());
        let got = decode_audio(&bytes, file, &cfg()).unwrap_or_else(|e| panic!("{file}: {e}"));
        assert!(
            (got.len() as i64 - 8000).abs() <= 8,
            "{file}: {} samples",
            got.len()
        );
        let mid = &got[1000..got.len() - 1000];
        let f = peak_freq(mid, 16_000.0);
        assert!((f - 1000.0).abs() < 1.0, "{file}: peak {f} Hz");
        let r = rms(mid);
        assert!(
            (r / want_rms - 1.0).abs() < rms_tol,
            "{file}: rms {r} vs {want_rms}"
        );
        // The name is only a hint: a wrong extension still decodes.
        let again = decode_audio(&bytes, "misnamed.wav", &cfg()).unwrap();
        assert_eq!(again, got, "{file}");
    }
}

#[test]
fn decoders_move_to_worker_threads() {
    fn send<T: Send>() {}
    send::<AudioDecoder>();
    send::<MelExtractor>();
}

#[test]
fn config_is_strict_and_validated() {
    let c: AudioConfig = serde_json::from_str(r#"{"n_mels": 128, "on_long": "truncate"}"#).unwrap();
    assert_eq!(c.n_mels, 128);
    assert_eq!(c.on_long, OnLong::Truncate);
    assert_eq!(c.max_seconds, 30.0);
    assert!(serde_json::from_str::<AudioConfig>(r#"{"n_mel": 80}"#).is_err());
    for bad in [
        r#"{"n_mels": 64}"#,
        r#"{"sample_rate": 22050}"#,
        r#"{"max_seconds": 0}"#,
        r#"{"min_samples": 100}"#,
        r#"{"max_bytes": 0}"#,
    ] {
        let c: AudioConfig = serde_json::from_str(bad).unwrap();
        let e = AudioDecoder::new(c).unwrap_err();
        assert_eq!(e.kind(), "config", "{bad}");
    }
}
