//! Drawing the demo content: coloured shapes on a noisy light background, tone sequences.

use crate::pack::synth::SplitMix64;

/// Colour words and their nominal RGB (each shape's colour is jittered by up to +-15 per channel).
/// Saturated and far apart, so a mean over the non-background pixels names the colour even after JPEG.
pub const COLOURS: [(&str, [u8; 3]); 4] = [
    ("red", [220, 40, 40]),
    ("green", [40, 170, 60]),
    ("blue", [40, 80, 220]),
    ("yellow", [235, 200, 40]),
];

/// Shape words, singular and plural.
pub const SHAPES: [(&str, &str); 4] = [
    ("circle", "circles"),
    ("square", "squares"),
    ("triangle", "triangles"),
    ("cross", "crosses"),
];

/// Tone words and their pitches (Hz): C4, G4, D5, A5, E6, a perfect fifth apart, so neighbours
/// sit 3 or more Whisper mel bins apart (80 bins: ~37 Hz per bin below 1 kHz).
pub const PITCHES: [(&str, f32); 5] = [
    ("one", 261.63),
    ("two", 392.0),
    ("three", 587.33),
    ("four", 880.0),
    ("five", 1318.51),
];

/// At most this many tones per clip; the clip is split into equal slots, one tone per slot.
pub const MAX_TONES: u32 = 3;

/// What an image shows: `count` (1 or 2) shapes of one kind and one colour.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct ImageContent {
    /// Index into [`COLOURS`].
    pub colour: usize,
    /// Index into [`SHAPES`].
    pub shape: usize,
    pub count: u32,
}

impl ImageContent {
    /// "a red circle", "two blue squares".
    pub fn caption(&self) -> String {
        let (one, many) = SHAPES[self.shape];
        let colour = COLOURS[self.colour].0;
        if self.count == 1 {
            format!("a {colour} {one}")
        } else {
            format!("two {colour} {many}")
        }
    }
}

/// Uniform in [lo, hi).
fn uniform(rng: &mut SplitMix64, lo: f64, hi: f64) -> f64 {
    lo + (hi - lo) * rng.f64()
}

/// Whether the point (dx, dy), in units of the shape's radius from its centre, is inside.
fn inside(shape: usize, dx: f64, dy: f64) -> bool {
    match shape {
        0 => dx * dx + dy * dy <= 1.0,
        1 => dx.abs() <= 0.8 && dy.abs() <= 0.8,
        // Apex up at y = -0.95, base at y = 0.75 spanning x in [-0.95, 0.95].
        2 => (-0.95..=0.75).contains(&dy) && dx.abs() <= 0.95 * (dy + 0.95) / 1.7,
        _ => (dx.abs() <= 0.3 && dy.abs() <= 0.95) || (dy.abs() <= 0.3 && dx.abs() <= 0.95),
    }
}

/// Draws a random [`ImageContent`] into a `size x size` packed RGB8 buffer (h, w, 3).
pub fn draw_image(rng: &mut SplitMix64, size: u32) -> (Vec<u8>, ImageContent) {
    let content = ImageContent {
        colour: rng.range(0, COLOURS.len() as u32 - 1) as usize,
        shape: rng.range(0, SHAPES.len() as u32 - 1) as usize,
        count: rng.range(1, 2),
    };
    let s = f64::from(size);
    let n = size as usize;
    // Background: a light grey with a faint random tint, plus +-6 of per-pixel noise.
    let grey = uniform(rng, 195.0, 245.0);
    let tint: [f64; 3] = std::array::from_fn(|_| uniform(rng, -5.0, 5.0));
    // (H, W, 3) f64
    let mut px = vec![0f64; n * n * 3];
    for (i, v) in px.iter_mut().enumerate() {
        *v = grey + tint[i % 3] + uniform(rng, -6.0, 6.0);
    }
    let base = COLOURS[content.colour].1;
    // (cx, cy, r) per shape. Two shapes each get one half of the image (split left/right or
    // top/bottom at random), so they never overlap.
    let mut shapes = Vec::with_capacity(2);
    if content.count == 1 {
        let r = s * uniform(rng, 0.26, 0.38);
        let cx = uniform(rng, r + 1.0, s - r - 1.0);
        let cy = uniform(rng, r + 1.0, s - r - 1.0);
        shapes.push((cx, cy, r));
    } else {
        let vertical_split = rng.f64() < 0.5;
        let half = s / 2.0;
        let r = s * uniform(rng, 0.15, 0.21);
        for k in 0..2 {
            let off = half * f64::from(k);
            let a = uniform(rng, off + r + 0.5, off + half - r - 0.5);
            let b = uniform(rng, r + 1.0, s - r - 1.0);
            shapes.push(if vertical_split { (a, b, r) } else { (b, a, r) });
        }
    }
    for &(cx, cy, r) in &shapes {
        let colour: [f64; 3] = std::array::from_fn(|c| {
            (f64::from(base[c]) + uniform(rng, -15.0, 15.0)).clamp(0.0, 255.0)
        });
        // Coverage by 4x4 supersampling: anti-aliased edges, as a photo or a renderer would give.
        for y in 0..n {
            for x in 0..n {
                let mut hits = 0u32;
                for sy in 0..4 {
                    for sx in 0..4 {
                        let fx = x as f64 + (f64::from(sx) + 0.5) / 4.0;
                        let fy = y as f64 + (f64::from(sy) + 0.5) / 4.0;
                        hits += u32::from(inside(content.shape, (fx - cx) / r, (fy - cy) / r));
                    }
                }
                if hits > 0 {
                    let cov = f64::from(hits) / 16.0;
                    for c in 0..3 {
                        let v = &mut px[(y * n + x) * 3 + c];
                        *v = *v * (1.0 - cov) + colour[c] * cov;
                    }
                }
            }
        }
    }
    let rgb = px
        .iter()
        .map(|v| v.round().clamp(0.0, 255.0) as u8)
        .collect();
    (rgb, content)
}

/// The sample range `[start, end)` of slot `i` of `n` in a clip of `len` samples.
pub fn tone_slot(len: usize, n: usize, i: usize) -> (usize, usize) {
    (i * len / n, (i + 1) * len / n)
}

/// Draws 1..=[`MAX_TONES`] tones into `len` samples of 16-bit PCM at `sample_rate`. Returns the
/// samples and the tone indices into [`PITCHES`], in order.
///
/// Tone `i` of `n` lies inside slot `i` ([`tone_slot`]), starting 3-15% into it and ending 3-15%
/// before its end, with 10 ms raised-cosine ramps; pitch detuned by up to 1%, amplitude
/// 0.25-0.5 of full scale, random phase, over faint white noise.
pub fn draw_clip(rng: &mut SplitMix64, len: usize, sample_rate: u32) -> (Vec<i16>, Vec<usize>) {
    let n = rng.range(1, MAX_TONES) as usize;
    let tones: Vec<usize> = (0..n)
        .map(|_| rng.range(0, PITCHES.len() as u32 - 1) as usize)
        .collect();
    let sr = f64::from(sample_rate);
    // (len,) f64 in [-1, 1]
    let mut x: Vec<f64> = (0..len).map(|_| uniform(rng, -0.005, 0.005)).collect();
    let ramp = (0.010 * sr) as usize;
    for (i, &t) in tones.iter().enumerate() {
        let (s0, s1) = tone_slot(len, n, i);
        let slot = (s1 - s0) as f64;
        let start = s0 + (slot * uniform(rng, 0.03, 0.15)) as usize;
        let end = s1 - (slot * uniform(rng, 0.03, 0.15)) as usize;
        let f = f64::from(PITCHES[t].1) * uniform(rng, 0.99, 1.01);
        let amp = uniform(rng, 0.25, 0.5);
        let phase = uniform(rng, 0.0, std::f64::consts::TAU);
        let dur = end.saturating_sub(start);
        let ramp = ramp.min(dur / 2).max(1);
        for (k, v) in x[start..end].iter_mut().enumerate() {
            let edge = k.min(dur - 1 - k) as f64 / ramp as f64;
            let env = if edge >= 1.0 {
                1.0
            } else {
                0.5 - 0.5 * (std::f64::consts::PI * edge).cos()
            };
            let t = k as f64 / sr;
            *v += amp * env * (std::f64::consts::TAU * f * t + phase).sin();
        }
    }
    let pcm = x
        .iter()
        .map(|v| (v * 32767.0).round().clamp(-32768.0, 32767.0) as i16)
        .collect();
    (pcm, tones)
}

/// "three one five".
pub fn transcript(tones: &[usize]) -> String {
    tones
        .iter()
        .map(|&t| PITCHES[t].0)
        .collect::<Vec<_>>()
        .join(" ")
}
