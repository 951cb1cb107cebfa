//! Audio decoding of hostile input: truncations, garbage and bit flips, empty/silent/NaN clips,
//! headers claiming hours, long clips, and absurd rates or channel counts.

#![allow(clippy::unwrap_used)]

mod common;

use braid_dataloader::media::audio::{AudioDecoder, AudioError, OnLong, decode_audio};

use common::audio_util::*;

// ---------------------------------------------------------------- hostile input

fn assert_rejects_or_shorter(bytes: &[u8], full_len: usize, what: &str) -> bool {
    match decode_audio(bytes, what, &cfg()) {
        Ok(x) => {
            assert!(x.len() <= full_len + 1, "{what}: {} > {full_len}", x.len());
            assert!(x.iter().all(|v| v.is_finite()), "{what}");
            true
        }
        Err(e) => {
            let msg = e.to_string();
            assert!(
                msg.contains(what),
                "{what}: message does not name the input: {msg}"
            );
            assert!(
                !msg.contains("panicked"),
                "{what}: the decoder panicked (caught): {msg}"
            );
            false
        }
    }
}

#[test]
fn every_prefix_of_a_wav_is_rejected_or_shorter_never_a_panic() {
    let x = sine(700.0, 22_050, 4410, 0.5); // 0.2 s -> 3200 samples at 16 kHz
    let bytes = wav(Fmt::I16, 22_050, 1, &x);
    let full = decode_audio(&bytes, "full.wav", &cfg()).unwrap();
    let mut ok = 0;
    for cut in 0..bytes.len() {
        if assert_rejects_or_shorter(&bytes[..cut], full.len(), &format!("prefix{cut}.wav")) {
            ok += 1;
        }
    }
    // Policy (audio.rs): a cut data chunk is `Truncated`, so no strict prefix decodes.
    assert_eq!(ok, 0, "{ok} truncated prefixes were accepted");
    let e = decode_audio(&bytes[..bytes.len() - 1000], "cut.wav", &cfg()).unwrap_err();
    assert_eq!(e.kind(), "truncated", "{e}");
}

#[test]
fn prefixes_of_compressed_files_never_panic() {
    for file in ["tone.flac", "tone.ogg", "tone.mp3"] {
        let bytes = read_fixture(file);
        let full = decode_audio(&bytes, file, &cfg()).unwrap().len();
        let step = (bytes.len() / 300).max(1);
        for cut in (0..bytes.len()).step_by(step) {
            assert_rejects_or_shorter(&bytes[..cut], full, &format!("{file}@{cut}"));
        }
    }
}

#[test]
fn garbage_and_bit_flips_never_panic() {
    let mut rng = 0x9E37_79B9_7F4A_7C15u64;
    let mut next = move || {
        rng ^= rng << 13;
        rng ^= rng >> 7;
        rng ^= rng << 17;
        rng
    };
    // Pure garbage, with and without plausible magic numbers in front.
    for (i, magic) in [
        &b""[..],
        b"RIFF\x00\x00\x00\x00WAVE",
        b"fLaC",
        b"OggS",
        b"ID3\x03",
        b"\xff\xfb",
    ]
    .iter()
    .enumerate()
    {
        for len in [1usize, 7, 64, 1000, 20_000] {
            let mut b = magic.to_vec();
            b.extend((0..len).map(|_| next() as u8));
            let name = format!("garbage{i}_{len}.bin");
            assert!(decode_audio(&b, &name, &cfg()).is_err(), "{name} decoded");
        }
    }
    // Random byte corruption of valid files: Err or a valid clip, never a panic.
    let sources = [
        (
            "w.wav",
            wav(
                Fmt::I16,
                44_100,
                2,
                &interleave(
                    &sine(440.0, 44_100, 4410, 0.5),
                    &sine(880.0, 44_100, 4410, 0.5),
                ),
            ),
        ),
        ("tone.flac", read_fixture("tone.flac")),
        ("tone.ogg", read_fixture("tone.ogg")),
        ("tone.mp3", read_fixture("tone.mp3")),
    ];
    let mut caught_panics = Vec::new();
    for (file, src) in &sources {
        for trial in 0..60 {
            let mut b = src.clone();
            let flips = 1 + (next() % 8) as usize;
            for _ in 0..flips {
                let pos = (next() as usize) % b.len();
                b[pos] = next() as u8;
            }
            let name = format!("{file}#{trial}");
            match decode_audio(&b, &name, &cfg()) {
                Ok(x) => assert!(x.iter().all(|v| v.is_finite()), "{name}"),
                Err(AudioError::Corrupt { reason, .. }) if reason.contains("panicked") => {
                    caught_panics.push(name)
                }
                Err(_) => {}
            }
        }
    }
    // A panic inside symphonia is caught and reported as Corrupt; list them so a regression
    // in the decoder is visible, but they are handled input either way.
    if !caught_panics.is_empty() {
        eprintln!("decoder panics caught (reported as corrupt): {caught_panics:?}");
    }
}

#[test]
fn empty_silent_short_and_nan_inputs_are_rejected_with_a_reason() {
    let e = decode_audio(&[], "empty.wav", &cfg()).unwrap_err();
    assert_eq!(e.kind(), "empty_input");
    assert!(e.to_string().contains("empty.wav"));

    let e = decode_audio(&wav(Fmt::I16, 16_000, 1, &[]), "zero.wav", &cfg()).unwrap_err();
    assert_eq!(e.kind(), "no_samples", "{e}");

    // 100 samples at 16 kHz < min_samples 1600.
    let e = decode_audio(&wav(Fmt::I16, 16_000, 1, &[0.1; 100]), "short.wav", &cfg()).unwrap_err();
    assert!(
        matches!(
            e,
            AudioError::TooShort {
                samples: 100,
                min: 1600,
                ..
            }
        ),
        "{e}"
    );

    let mut x = sine(440.0, 16_000, 4000, 0.5);
    x[1234] = f32::NAN;
    let e = decode_audio(&wav(Fmt::F32, 16_000, 1, &x), "nan.wav", &cfg()).unwrap_err();
    assert_eq!(e.kind(), "non_finite", "{e}");

    // Finite but huge float samples would overflow the log-mel (every step holding the
    // clip NaN); loud but plausible ones (integer-scaled floats) still decode.
    let mut loud = sine(440.0, 16_000, 4000, 0.5);
    loud[2000] = 1e30;
    let e = decode_audio(&wav(Fmt::F32, 16_000, 1, &loud), "loud.wav", &cfg()).unwrap_err();
    assert_eq!(e.kind(), "too_loud", "{e}");
    assert!(
        e.to_string().contains("loud.wav") && e.to_string().contains("1e30"),
        "{e}"
    );
    let scaled: Vec<f32> = sine(440.0, 16_000, 4000, 0.5)
        .iter()
        .map(|v| v * 32768.0)
        .collect();
    decode_audio(&wav(Fmt::F32, 16_000, 1, &scaled), "scaled.wav", &cfg()).unwrap();

    let mut small = cfg();
    small.max_bytes = 1000;
    let e = decode_audio(&wav(Fmt::I16, 16_000, 1, &x), "big.wav", &small).unwrap_err();
    assert!(
        matches!(e, AudioError::TooManyBytes { max: 1000, .. }),
        "{e}"
    );
}

#[test]
fn a_header_claiming_ten_hours_is_rejected_before_decoding() {
    let x = sine(440.0, 16_000, 2000, 0.5);
    let ten_hours = 10 * 3600 * 16_000 * 2; // bytes of 16-bit mono at 16 kHz
    let bytes = wav_with(Fmt::I16, 16_000, 1, &x, Some(ten_hours));
    let e = decode_audio(&bytes, "bomb.wav", &cfg()).unwrap_err();
    match &e {
        AudioError::TooLong { seconds, when, .. } => {
            assert!((seconds - 36_000.0).abs() < 1.0, "{e}");
            assert!(when.contains("header"), "{e}");
        }
        _ => panic!("expected TooLong, got {e}"),
    }
    // With Truncate the header is no reason to reject, but the data really is cut short.
    let mut c = cfg();
    c.on_long = OnLong::Truncate;
    let e = decode_audio(&bytes, "bomb.wav", &c).unwrap_err();
    assert_eq!(e.kind(), "truncated", "{e}");
}

#[test]
fn long_clips_are_rejected_or_truncated_per_config() {
    // 31 s at 8 kHz, 8-bit (248 KB): over the 30 s default.
    let x = sine(200.0, 8_000, 31 * 8_000, 0.5);
    let bytes = wav(Fmt::U8, 8_000, 1, &x);
    let e = decode_audio(&bytes, "long.wav", &cfg()).unwrap_err();
    assert_eq!(e.kind(), "too_long", "{e}");
    let mut c = cfg();
    c.on_long = OnLong::Truncate;
    let got = decode_audio(&bytes, "long.wav", &c).unwrap();
    assert_eq!(got.len(), 30 * 16_000);
    c.max_seconds = 2.5;
    let got = decode_audio(&bytes, "long.wav", &c).unwrap();
    assert_eq!(got.len(), 40_000);
}

/// A header claiming 65,535 channels over a few samples: symphonia's WAV reader overflows
/// on it (a panic where overflow checks are on). It is a reject naming the file, and a
/// caught panic's reason carries the panic's own message and place, not just "panicked".
#[test]
fn a_wav_claiming_65535_channels_is_a_reject_with_the_reason() {
    let mut b = wav(Fmt::I16, 16_000, 1, &sine(440.0, 16_000, 2000, 0.5));
    // The canonical header's channel count (bytes 22-23, little-endian).
    b[22] = 0xff;
    b[23] = 0xff;
    let e = decode_audio(&b, "ch65535.wav", &cfg()).unwrap_err();
    let msg = e.to_string();
    assert!(msg.contains("ch65535.wav"), "{msg}");
    if msg.contains("panicked") {
        assert!(msg.contains("overflow") && msg.contains("(at "), "{msg}");
    }
}

#[test]
fn absurd_rates_and_channel_counts_are_rejected() {
    let x = sine(440.0, 16_000, 2000, 0.5);
    for (rate, ch, what) in [
        (0u32, 1u16, "rate0"),
        (10, 1, "rate10"),
        (5_000_000, 1, "rate5M"),
        (16_000, 0, "ch0"),
        (16_000, 100, "ch100"),
    ] {
        let data: Vec<f32> = x
            .iter()
            .cycle()
            .take(2000 * ch.max(1) as usize)
            .copied()
            .collect();
        let name = format!("{what}.wav");
        let e = decode_audio(&wav(Fmt::I16, rate, ch, &data), &name, &cfg()).unwrap_err();
        assert!(
            matches!(e.kind(), "bad_format" | "unsupported_format" | "corrupt"),
            "{name}: {e}"
        );
        assert!(e.to_string().contains(&name), "{e}");
    }
}

#[test]
fn extreme_but_accepted_rates_resample() {
    // The ends of SOURCE_RATE_RANGE, and rates with no useful common factor with 16 kHz
    // (the sinc path at ratios 16 and 1/48): 0.25 s each.
    let mut dec = AudioDecoder::new(cfg()).unwrap();
    for rate in [1_000u32, 1_001, 7_919, 767_999, 768_000] {
        let n = rate as usize / 4;
        let x = sine(rate as f64 / 10.0, rate, n, 0.5);
        let got = dec
            .decode(&wav(Fmt::F32, rate, 1, &x), "edge.wav")
            .unwrap_or_else(|e| panic!("{rate}: {e}"));
        let want = (n as u64 * 16_000).div_ceil(rate as u64) as i64;
        assert!(
            (got.len() as i64 - want).abs() <= 1,
            "{rate}: {} vs {want}",
            got.len()
        );
        assert!(got.iter().all(|v| v.is_finite() && v.abs() < 1.0), "{rate}");
    }
}
