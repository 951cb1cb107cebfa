//! Whisper log-mel spectrogram, numerically matching transformers' `WhisperFeatureExtractor`
//! (and openai-whisper's `log_mel_spectrogram`) on an unpadded 16 kHz clip.
//!
//! Recipe: n_fft 400 (25 ms), hop 160 (10 ms), periodic Hann window, `center=True` with reflect
//! padding of 200 samples each side, power spectrum |STFT|^2, Slaney mel filterbank (librosa's
//! `mel(htk=False, norm="slaney")`, fmin 0, fmax 8000), `log10(max(mel, 1e-10))`, drop the last
//! STFT frame, clamp to `max - 8.0` (max over the whole clip), then `(x + 4) / 4`.
//! Frames: the centred STFT has `1 + L / 160` frames; the last is dropped, so `L / 160`.
//!
//! Padding: Whisper pads every clip with zeros to 30 s before this. Braid does not (the encoder
//! takes short clips), and the two differ only (a) in the frames past the clip, which Whisper
//! has and which sit at the clamp floor since silence is -10 in log10 while the floor is
//! `max - 8`, (b) in the last two frames of the clip, whose windows reach past its end and see
//! reflected samples here but zeros in Whisper, and (c) in the clamp floor when the clip's loudest
//! frame is one of those two. Frames 0 .. L/160 - 2 are otherwise identical.
//!
//! Precision: f32 FFT (realfft) and f32 accumulation against numpy's f64; the reference test
//! (tests/audio_mel.rs) holds the difference under 1e-4 absolute on the scaled output (observed
//! <= 4e-5); transformers' own torch (f32) path differs from its numpy path by up to 6e-5.

use std::cell::RefCell;
use std::sync::Arc;

use realfft::num_complex::Complex;
use realfft::{RealFftPlanner, RealToComplex};

/// STFT window and FFT length in samples (25 ms at 16 kHz).
pub const N_FFT: usize = 400;
/// STFT hop in samples (10 ms at 16 kHz).
pub const HOP: usize = 160;
/// The sample rate the filterbank is built for.
pub const SAMPLE_RATE: u32 = 16_000;
/// Frequency bins of the one-sided spectrum.
pub const N_FREQ: usize = N_FFT / 2 + 1;
const MEL_FLOOR: f32 = 1e-10;

/// Why a log-mel could not be computed.
#[derive(Debug, Clone, PartialEq, thiserror::Error)]
pub enum MelError {
    #[error("log-mel: n_mels {0} is not supported (80 or 128)")]
    BadNMels(usize),
    #[error("log-mel: {samples} samples; reflect padding needs more than {min}")]
    TooShort { samples: usize, min: usize },
    #[error("log-mel: non-finite input sample at index {index}")]
    NonFinite { index: usize },
    #[error("log-mel: FFT failed: {0}")]
    Fft(String),
}

/// One triangular mel filter: nonzero weights over bins `start .. start + weights.len()`.
#[derive(Debug, Clone)]
struct MelBand {
    start: usize,
    weights: Vec<f32>,
}

/// Holds the FFT plan, window, filterbank and scratch: build once per worker, call
/// [`MelExtractor::compute`] per clip.
pub struct MelExtractor {
    n_mels: usize,
    fft: Arc<dyn RealToComplex<f32>>,
    window: Vec<f32>,            // (N_FFT,)
    bands: Vec<MelBand>,         // (n_mels,) sparse rows of the (n_mels, N_FREQ) filterbank
    frame: Vec<f32>,             // (N_FFT,) windowed frame, clobbered by the FFT
    spectrum: Vec<Complex<f32>>, // (N_FREQ,)
    scratch: Vec<Complex<f32>>,
    power: Vec<f32>, // (N_FREQ,)
}

impl std::fmt::Debug for MelExtractor {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        f.debug_struct("MelExtractor")
            .field("n_mels", &self.n_mels)
            .field("n_fft", &N_FFT)
            .field("hop", &HOP)
            .finish()
    }
}

impl MelExtractor {
    /// Plans the FFT and builds the Slaney filterbank for `n_mels` (80 or 128).
    pub fn new(n_mels: usize) -> Result<Self, MelError> {
        if n_mels != 80 && n_mels != 128 {
            return Err(MelError::BadNMels(n_mels));
        }
        let fft = RealFftPlanner::<f32>::new().plan_fft_forward(N_FFT);
        let scratch = fft.make_scratch_vec();
        Ok(MelExtractor {
            n_mels,
            window: hann_periodic(N_FFT),
            bands: slaney_filterbank(n_mels, N_FREQ, SAMPLE_RATE as f64, 0.0, 8000.0),
            frame: fft.make_input_vec(),
            spectrum: fft.make_output_vec(),
            scratch,
            power: vec![0.0; N_FREQ],
            fft,
        })
    }

    pub fn n_mels(&self) -> usize {
        self.n_mels
    }

    /// Frames produced for a clip of `n_samples` samples.
    pub fn num_frames(n_samples: usize) -> usize {
        n_samples / HOP
    }

    /// The dense (n_mels, N_FREQ) filterbank, row-major (for tests and inspection).
    pub fn filterbank(&self) -> Vec<f32> {
        let mut fb = vec![0.0f32; self.n_mels * N_FREQ];
        for (m, band) in self.bands.iter().enumerate() {
            for (k, w) in band.weights.iter().enumerate() {
                if let Some(x) = fb.get_mut(m * N_FREQ + band.start + k) {
                    *x = *w;
                }
            }
        }
        fb
    }

    /// Log-mel of a 16 kHz mono clip: `(mel (n_mels, frames) row-major, frames)`.
    pub fn compute(&mut self, samples: &[f32]) -> Result<(Vec<f32>, usize), MelError> {
        let mut out = Vec::new();
        let frames = self.compute_into(samples, &mut out)?;
        Ok((out, frames))
    }

    /// Like [`compute`](Self::compute), writing into `out` (resized to n_mels * frames).
    pub fn compute_into(&mut self, samples: &[f32], out: &mut Vec<f32>) -> Result<usize, MelError> {
        let n = samples.len();
        let pad = N_FFT / 2;
        if n <= pad {
            return Err(MelError::TooShort {
                samples: n,
                min: pad,
            });
        }
        if let Some(index) = samples.iter().position(|x| !x.is_finite()) {
            return Err(MelError::NonFinite { index });
        }
        let frames = Self::num_frames(n);
        let nm = self.n_mels;
        out.clear();
        out.resize(nm * frames, 0.0); // (n_mels, frames)
        let mut max = f32::NEG_INFINITY;
        for t in 0..frames {
            // Frame t covers padded samples [t*HOP, t*HOP + N_FFT), i.e. original samples
            // [t*HOP - pad, t*HOP - pad + N_FFT), reflected at both ends (numpy "reflect":
            // the edge sample is not repeated). n > pad makes one reflection always enough.
            let lo = (t * HOP) as isize - pad as isize;
            if lo >= 0 && lo as usize + N_FFT <= n {
                let src = &samples[lo as usize..lo as usize + N_FFT];
                for ((f, &x), &w) in self.frame.iter_mut().zip(src).zip(&self.window) {
                    *f = x * w;
                }
            } else {
                for (k, (f, &w)) in self.frame.iter_mut().zip(&self.window).enumerate() {
                    *f = samples[reflect(lo + k as isize, n)] * w;
                }
            }
            self.fft
                .process_with_scratch(&mut self.frame, &mut self.spectrum, &mut self.scratch)
                .map_err(|e| MelError::Fft(e.to_string()))?;
            for (p, c) in self.power.iter_mut().zip(&self.spectrum) {
                *p = c.re * c.re + c.im * c.im;
            }
            for (m, band) in self.bands.iter().enumerate() {
                let bins = &self.power[band.start..band.start + band.weights.len()];
                let e: f32 = bins.iter().zip(&band.weights).map(|(p, w)| p * w).sum();
                // log10 as ln * log10(e): glibc's logf is ~2x faster than its log10f, and the
                // two agree to an ulp or two (far below the reference tolerance).
                let v = e.max(MEL_FLOOR).ln() * std::f32::consts::LOG10_E;
                max = max.max(v);
                out[m * frames + t] = v;
            }
        }
        // Whisper's dynamic range clamp (8 decades of power below the clip's peak) and scaling.
        let floor = max - 8.0;
        for v in out.iter_mut() {
            *v = (v.max(floor) + 4.0) / 4.0;
        }
        Ok(frames)
    }
}

/// numpy `mode="reflect"` index for one reflection; callers guarantee `-n < i < 2n - 1`.
fn reflect(i: isize, n: usize) -> usize {
    let n = n as isize;
    let r = if i < 0 {
        -i
    } else if i >= n {
        2 * (n - 1) - i
    } else {
        i
    };
    r.clamp(0, n - 1) as usize
}

/// Periodic Hann window (torch.hann_window(n) / numpy hanning(n + 1)[:-1]), computed in f64.
fn hann_periodic(n: usize) -> Vec<f32> {
    (0..n)
        .map(|i| (0.5 - 0.5 * (2.0 * std::f64::consts::PI * i as f64 / n as f64).cos()) as f32)
        .collect()
}

/// Slaney mel scale: linear below 1 kHz (3 mels per 200 Hz), logarithmic above.
fn hz_to_mel(f: f64) -> f64 {
    let logstep = 27.0 / 6.4f64.ln();
    if f >= 1000.0 {
        15.0 + (f / 1000.0).ln() * logstep
    } else {
        3.0 * f / 200.0
    }
}

fn mel_to_hz(m: f64) -> f64 {
    let logstep = 6.4f64.ln() / 27.0;
    if m >= 15.0 {
        1000.0 * ((m - 15.0) * logstep).exp()
    } else {
        200.0 * m / 3.0
    }
}

/// librosa.filters.mel(htk=False, norm="slaney") / transformers' `mel_filter_bank(norm="slaney",
/// mel_scale="slaney")`: triangles in Hz between mel-spaced edges, area-normalised by
/// 2 / (right edge - left edge). Computed in f64, stored as sparse f32 rows.
fn slaney_filterbank(n_mels: usize, n_freq: usize, sr: f64, fmin: f64, fmax: f64) -> Vec<MelBand> {
    let (mmin, mmax) = (hz_to_mel(fmin), hz_to_mel(fmax));
    // (n_mels + 2,) band edges in Hz
    let edges: Vec<f64> = (0..n_mels + 2)
        .map(|i| mel_to_hz(mmin + (mmax - mmin) * i as f64 / (n_mels + 1) as f64))
        .collect();
    // (n_freq,) bin centre frequencies: linspace(0, sr // 2, n_freq)
    let half = (sr / 2.0).floor();
    let fft_freqs: Vec<f64> = (0..n_freq)
        .map(|k| half * k as f64 / (n_freq - 1) as f64)
        .collect();
    (0..n_mels)
        .map(|m| {
            let (l, c, r) = (edges[m], edges[m + 1], edges[m + 2]);
            let enorm = 2.0 / (r - l);
            let w: Vec<f64> = fft_freqs
                .iter()
                .map(|&f| {
                    let down = (f - l) / (c - l);
                    let up = (r - f) / (r - c);
                    down.min(up).max(0.0) * enorm
                })
                .collect();
            match (
                w.iter().position(|&x| x > 0.0),
                w.iter().rposition(|&x| x > 0.0),
            ) {
                (Some(s), Some(e)) => MelBand {
                    start: s,
                    weights: w[s..=e].iter().map(|&x| x as f32).collect(),
                },
                _ => MelBand {
                    start: 0,
                    weights: Vec::new(),
                },
            }
        })
        .collect()
}

thread_local! {
    // One extractor per thread and n_mels, so the free function reuses plans too.
    static EXTRACTORS: RefCell<Vec<MelExtractor>> = const { RefCell::new(Vec::new()) };
}

/// Log-mel of a 16 kHz mono clip: `(mel (n_mels, frames) row-major, frames)`, frames =
/// `len / 160`. Reuses a per-thread [`MelExtractor`].
pub fn log_mel(samples: &[f32], n_mels: usize) -> Result<(Vec<f32>, usize), MelError> {
    EXTRACTORS.with(|cell| {
        let mut cache = cell.borrow_mut();
        let idx = match cache.iter().position(|e| e.n_mels == n_mels) {
            Some(i) => i,
            None => {
                cache.push(MelExtractor::new(n_mels)?);
                cache.len() - 1
            }
        };
        cache[idx].compute(samples)
    })
}
