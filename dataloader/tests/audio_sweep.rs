//! The SIMD code that runs on user audio (symphonia's decoders, rubato's FFT and sinc resamplers, the log-mel's
//! realfft), swept over input lengths, rates, channel counts and sample formats: every clip decodes to the expected
//! length or is rejected with a reason, never a fault, and every log-mel has `n / 160` finite frames.
#![allow(clippy::unwrap_used)]

mod common;

use braid_dataloader::demo::encode_flac;
use braid_dataloader::media::audio::AudioDecoder;
use braid_dataloader::media::mel::{MelExtractor, N_FFT};
use common::audio_util::{Fmt, cfg, sine, wav};

/// Input lengths: every one up to a little past two resampler chunks (1024 frames), then a coarser stride to ~5
/// chunks, so each length class around the chunk boundaries is seen at every rate.
fn lengths(every_to: usize, stride: usize, to: usize) -> impl Iterator<Item = usize> {
    (1..=every_to).chain((every_to + 1..=to).step_by(stride))
}

fn check_decode(dec: &mut AudioDecoder, bytes: &[u8], rate: u32, frames: usize, what: &str) {
    let min = dec.config().min_samples;
    let want = (frames as u64 * 16_000).div_ceil(u64::from(rate)) as usize;
    match dec.decode(bytes, what) {
        Ok(x) => {
            assert!(
                x.len().abs_diff(want) <= 1,
                "{what}: {} samples, want {want}",
                x.len()
            );
            assert!(x.len() >= min, "{what}: {} < min_samples {min}", x.len());
            assert!(x.iter().all(|v| v.is_finite() && v.abs() <= 1.5), "{what}");
        }
        Err(e) => {
            // Only clips shorter than min_samples (after resampling) may be refused.
            assert!(
                matches!(e.kind(), "too_short" | "no_samples") && want <= min + 1,
                "{what}: {e}"
            );
            assert!(e.to_string().contains(what), "{what}: {e}");
        }
    }
}

#[test]
fn every_length_at_the_fft_resampler_rates() {
    let mut dec = AudioDecoder::new(cfg()).unwrap();
    for rate in [
        8_000u32, 11_025, 16_000, 22_050, 24_000, 32_000, 44_100, 48_000, 96_000,
    ] {
        // Shorter than min_samples at every rate here below ~rate / 10 frames.
        for n in lengths(2_300, 37, 6_000) {
            let x = sine(440.0, rate, n, 0.5);
            let what = format!("{rate}Hz-{n}.wav");
            check_decode(&mut dec, &wav(Fmt::I16, rate, 1, &x), rate, n, &what);
        }
    }
}

#[test]
fn every_length_at_rates_that_take_the_sinc_resampler() {
    let mut dec = AudioDecoder::new(cfg()).unwrap();
    // No useful common factor with 16 kHz: rubato's asynchronous sinc path (its SIMD interpolation).
    for rate in [7_919u32, 12_345, 44_101] {
        for n in lengths(1_200, 53, 8_000).filter(|n| n * 16_000 / rate as usize > 1_500) {
            let x = sine(300.0, rate, n, 0.5);
            let what = format!("{rate}Hz-{n}.wav");
            check_decode(&mut dec, &wav(Fmt::F32, rate, 1, &x), rate, n, &what);
        }
    }
}

#[test]
fn every_format_and_channel_count_at_many_lengths() {
    let mut dec = AudioDecoder::new(cfg()).unwrap();
    for fmt in [Fmt::U8, Fmt::I16, Fmt::I24, Fmt::I32, Fmt::F32] {
        for ch in [1u16, 2, 3, 6] {
            for rate in [16_000u32, 44_100] {
                for n in (1_000..=6_000).step_by(211) {
                    let mono = sine(500.0, rate, n, 0.4);
                    let inter: Vec<f32> = mono
                        .iter()
                        .flat_map(|&v| std::iter::repeat_n(v, usize::from(ch)))
                        .collect();
                    let what = format!("{fmt:?}-{ch}ch-{rate}Hz-{n}.wav");
                    check_decode(&mut dec, &wav(fmt, rate, ch, &inter), rate, n, &what);
                }
            }
        }
    }
}

#[test]
fn flac_of_many_lengths_and_rates() {
    // symphonia's FLAC decoder (LPC and verbatim subframes, partial last blocks) on the demo's own FLAC encoder.
    let mut dec = AudioDecoder::new(cfg()).unwrap();
    for rate in [8_000u32, 16_000, 22_050, 44_100] {
        for n in lengths(300, 97, 12_000) {
            let x: Vec<i16> = sine(440.0, rate, n, 0.5)
                .iter()
                .map(|v| (v * 32_767.0) as i16)
                .collect();
            let what = format!("{rate}Hz-{n}.flac");
            check_decode(&mut dec, &encode_flac(&x, rate), rate, n, &what);
        }
    }
}

#[test]
fn log_mel_of_every_length() {
    for n_mels in [80usize, 128] {
        let mut mel = MelExtractor::new(n_mels).unwrap();
        let x = sine(1_000.0, 16_000, 9_000, 0.5);
        for n in 0..=9_000 {
            match mel.compute(&x[..n]) {
                Ok((m, frames)) => {
                    assert!(n > N_FFT / 2, "{n} samples accepted");
                    assert_eq!(frames, MelExtractor::num_frames(n), "{n}");
                    assert_eq!(m.len(), n_mels * frames, "{n}");
                    assert!(m.iter().all(|v| v.is_finite()), "{n}");
                }
                Err(e) => assert!(n <= N_FFT / 2, "{n} samples: {e}"),
            }
        }
    }
}
