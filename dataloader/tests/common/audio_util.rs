//! Audio test helpers: hand-written WAVs (every PCM width and float), sines, noise, RMS and
//! peak-frequency measurement, and fixture loading.

use std::f64::consts::PI;

use braid_dataloader::media::audio::AudioConfig;
use realfft::RealFftPlanner;

pub const FIXTURES: &str = concat!(env!("CARGO_MANIFEST_DIR"), "/tests/fixtures");

#[derive(Clone, Copy, Debug)]
pub enum Fmt {
    U8,
    I16,
    I24,
    I32,
    F32,
}

/// A canonical 44-byte-header WAV from interleaved samples in [-1, 1]. `data_len_override`
/// lets a test lie in the header about the data size.
pub fn wav_with(
    fmt: Fmt,
    rate: u32,
    ch: u16,
    x: &[f32],
    data_len_override: Option<u32>,
) -> Vec<u8> {
    let (tag, bits): (u16, u16) = match fmt {
        Fmt::U8 => (1, 8),
        Fmt::I16 => (1, 16),
        Fmt::I24 => (1, 24),
        Fmt::I32 => (1, 32),
        Fmt::F32 => (3, 32),
    };
    let mut data = Vec::new();
    for &s in x {
        let c = s.clamp(-1.0, 1.0) as f64;
        match fmt {
            Fmt::U8 => data.push(((c * 127.0).round() + 128.0) as u8),
            Fmt::I16 => data.extend_from_slice(&((c * 32767.0).round() as i16).to_le_bytes()),
            Fmt::I24 => {
                let v = (c * 8_388_607.0).round() as i32;
                data.extend_from_slice(&v.to_le_bytes()[..3]);
            }
            Fmt::I32 => {
                data.extend_from_slice(&((c * 2_147_483_647.0).round() as i32).to_le_bytes())
            }
            Fmt::F32 => data.extend_from_slice(&s.to_le_bytes()),
        }
    }
    let block = ch * bits / 8;
    let data_len = data_len_override.unwrap_or(data.len() as u32);
    let mut w = Vec::new();
    w.extend_from_slice(b"RIFF");
    w.extend_from_slice(&(36u32.wrapping_add(data_len)).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt ");
    w.extend_from_slice(&16u32.to_le_bytes());
    w.extend_from_slice(&tag.to_le_bytes());
    w.extend_from_slice(&ch.to_le_bytes());
    w.extend_from_slice(&rate.to_le_bytes());
    w.extend_from_slice(&(rate.wrapping_mul(block as u32)).to_le_bytes());
    w.extend_from_slice(&block.to_le_bytes());
    w.extend_from_slice(&bits.to_le_bytes());
    w.extend_from_slice(b"data");
    w.extend_from_slice(&data_len.to_le_bytes());
    w.extend_from_slice(&data);
    w
}

pub fn wav(fmt: Fmt, rate: u32, ch: u16, x: &[f32]) -> Vec<u8> {
    wav_with(fmt, rate, ch, x, None)
}

pub fn sine(freq: f64, rate: u32, n: usize, amp: f64) -> Vec<f32> {
    (0..n)
        .map(|i| (amp * (2.0 * PI * freq * i as f64 / rate as f64).sin()) as f32)
        .collect()
}

pub fn interleave(l: &[f32], r: &[f32]) -> Vec<f32> {
    l.iter().zip(r).flat_map(|(&a, &b)| [a, b]).collect()
}

/// Uniform noise in [-1, 1), bit-exact with `xorshift_uniform` in make_mel_fixture.py.
pub fn uniform_noise(n: usize, seed: u64) -> Vec<f32> {
    let mut x = seed;
    (0..n)
        .map(|_| {
            x ^= x >> 12;
            x ^= x << 25;
            x ^= x >> 27;
            let v = x.wrapping_mul(0x2545_F491_4F6C_DD1D);
            (v >> 40) as f32 / (1u32 << 23) as f32 - 1.0
        })
        .collect()
}

pub fn rms(x: &[f32]) -> f64 {
    (x.iter().map(|&v| v as f64 * v as f64).sum::<f64>() / x.len().max(1) as f64).sqrt()
}

/// Frequency (Hz) of the largest bin of the Hann-windowed spectrum, refined by parabolic
/// interpolation on the log magnitude.
pub fn peak_freq(x: &[f32], rate: f64) -> f64 {
    let n = x.len();
    let fft = RealFftPlanner::<f64>::new().plan_fft_forward(n);
    let mut input: Vec<f64> = x
        .iter()
        .enumerate()
        .map(|(i, &v)| v as f64 * (0.5 - 0.5 * (2.0 * PI * i as f64 / n as f64).cos()))
        .collect();
    let mut out = fft.make_output_vec();
    fft.process(&mut input, &mut out).unwrap();
    let mag: Vec<f64> = out.iter().map(|c| c.norm().max(1e-30).ln()).collect();
    let k = (1..mag.len() - 1)
        .max_by(|&a, &b| mag[a].total_cmp(&mag[b]))
        .unwrap();
    let (a, b, c) = (mag[k - 1], mag[k], mag[k + 1]);
    let delta = 0.5 * (a - c) / (a - 2.0 * b + c);
    (k as f64 + delta) * rate / n as f64
}

pub fn cfg() -> AudioConfig {
    AudioConfig::default()
}

pub fn read_fixture(name: &str) -> Vec<u8> {
    std::fs::read(format!("{FIXTURES}/{name}")).unwrap()
}
