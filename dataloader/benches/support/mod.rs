//! Test media shared by the dataloader benches: photo-like images and multi-tone WAV clips.
#![allow(dead_code)]

use image::{ImageBuffer, Rgb};

pub const RATE: u32 = 44_100;
pub const SECONDS: usize = 10;

/// Photo-like content: smooth illumination, a few shapes, fine texture and sensor-like noise (JPEG decode cost
/// grows with entropy; flat synthetic images would flatter both decoders).
pub fn photo(seed: u64, w: u32, h: u32) -> ImageBuffer<Rgb<u8>, Vec<u8>> {
    let mut s = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut rnd = move || {
        s ^= s << 13;
        s ^= s >> 7;
        s ^= s << 17;
        s
    };
    let shapes: Vec<(f32, f32, f32, [f32; 3])> = (0..6)
        .map(|_| {
            let r = rnd();
            let (cx, cy) = ((r % u64::from(w)) as f32, ((r >> 20) % u64::from(h)) as f32);
            let rad = 20.0 + ((r >> 40) % 120) as f32;
            let c = rnd();
            (
                cx,
                cy,
                rad,
                [
                    (c & 255) as f32,
                    ((c >> 8) & 255) as f32,
                    ((c >> 16) & 255) as f32,
                ],
            )
        })
        .collect();
    let phase = (rnd() % 100) as f32;
    ImageBuffer::from_fn(w, h, |x, y| {
        let (xf, yf) = (x as f32, y as f32);
        let mut px = [
            90.0 + 80.0 * (xf / w as f32) + 20.0 * ((xf + phase) / 9.0).sin(),
            70.0 + 100.0 * (yf / h as f32) + 15.0 * (yf / 7.0).cos(),
            120.0 + 40.0 * ((xf + yf) / 50.0).sin(),
        ];
        for &(cx, cy, rad, col) in &shapes {
            if (xf - cx).powi(2) + (yf - cy).powi(2) < rad * rad {
                px = col;
            }
        }
        let n = rnd();
        Rgb(std::array::from_fn(|c| {
            (px[c] + ((n >> (8 * c)) & 15) as f32 - 7.5).clamp(0.0, 255.0) as u8
        }))
    })
}

/// A 10 s stereo clip: a few drifting tones plus noise, different per clip.
pub fn make_wav(seed: u64) -> Vec<u8> {
    let n = RATE as usize * SECONDS;
    let mut x = seed.wrapping_mul(0x9E37_79B9_7F4A_7C15) | 1;
    let mut data = Vec::with_capacity(n * 4);
    for i in 0..n {
        let t = i as f64 / RATE as f64;
        x ^= x << 13;
        x ^= x >> 7;
        x ^= x << 17;
        let noise = (x >> 40) as f64 / (1u64 << 24) as f64 - 0.5;
        let f = 200.0 + 50.0 * seed as f64 + 30.0 * t;
        let l = 0.3 * (2.0 * std::f64::consts::PI * f * t).sin() + 0.05 * noise;
        let r = 0.3 * (2.0 * std::f64::consts::PI * 1.5 * f * t).sin() - 0.05 * noise;
        for v in [l, r] {
            data.extend_from_slice(&((v * 32767.0) as i16).to_le_bytes());
        }
    }
    let mut w = Vec::with_capacity(44 + data.len());
    w.extend_from_slice(b"RIFF");
    w.extend_from_slice(&(36 + data.len() as u32).to_le_bytes());
    w.extend_from_slice(b"WAVEfmt ");
    w.extend_from_slice(&16u32.to_le_bytes());
    w.extend_from_slice(&1u16.to_le_bytes()); // PCM
    w.extend_from_slice(&2u16.to_le_bytes()); // channels
    w.extend_from_slice(&RATE.to_le_bytes());
    w.extend_from_slice(&(RATE * 4).to_le_bytes());
    w.extend_from_slice(&4u16.to_le_bytes());
    w.extend_from_slice(&16u16.to_le_bytes());
    w.extend_from_slice(b"data");
    w.extend_from_slice(&(data.len() as u32).to_le_bytes());
    w.extend_from_slice(&data);
    w
}
