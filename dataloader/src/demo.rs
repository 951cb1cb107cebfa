//! `braid demo-data`: a small multimodal dataset in real formats (PNG/JPEG, WAV/FLAC, JSONL chat
//! records) whose answers can only be predicted from the media.
//!
//! Content (see `render`): images of one or two shapes (circle, square, triangle, cross) of one
//! colour (red, green, blue, yellow) on a noisy light background, captioned "a red circle" /
//! "two blue squares"; clips of one to three tones out of five pitches a fifth apart, named
//! "one" to "five" from low to high, transcribed "three one five". Each sample asks about its
//! image, its clip, or both, with a prompt drawn from a few that carry no information about the
//! answer, so a text-only model can do no better than the label priors (colour 1/4, shape 1/4,
//! count 1/2, each tone 1/5) while a tiny ViT / audio encoder can read the answers off the media.
//!
//! Determinism: every sample draws from its own SplitMix64 stream keyed by (seed, split, index),
//! so a seed gives identical bytes on every platform, and `heldout` does not change when `train`
//! does. The encoders (image's PNG and JPEG, the WAV header and `flac` here) are deterministic.

mod flac;
pub mod render;

use std::fmt::Write as _;
use std::fs::{self, File};
use std::io::{BufWriter, Write};
use std::path::{Path, PathBuf};

use image::{ExtendedColorType, ImageEncoder};
use serde::{Deserialize, Serialize};
use serde_json::json;

pub use flac::encode_flac;
use render::{COLOURS, ImageContent, MAX_TONES, PITCHES, SHAPES};

use crate::pack::synth::SplitMix64;

/// JPEG quality of the JPEG images (high enough that colours and edges survive).
pub const JPEG_QUALITY: u8 = 90;

const IMAGE_PROMPTS: [&str; 3] = [
    "What is in the image?",
    "Describe the image.",
    "What do you see?",
];
const AUDIO_PROMPTS: [&str; 3] = [
    "What do you hear?",
    "Transcribe the tones.",
    "Which tones are played?",
];
const BOTH_PROMPTS: [&str; 2] = [
    "Describe the image and the sound.",
    "What do you see and hear?",
];

/// What to generate (`[demo]`-style config; every field optional).
#[derive(Debug, Clone, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DemoConfig {
    pub seed: u64,
    /// Samples in `train.jsonl`.
    pub train: usize,
    /// Samples in `heldout.jsonl` (same distribution, independent draws).
    pub heldout: usize,
    /// Image side in pixels (square images).
    pub image_size: u32,
    /// Clip length in seconds.
    pub clip_seconds: f32,
    /// Clip sample rate in Hz.
    pub sample_rate: u32,
}

impl Default for DemoConfig {
    fn default() -> Self {
        DemoConfig {
            seed: 1234,
            train: 2000,
            heldout: 200,
            image_size: 32,
            clip_seconds: 1.0,
            sample_rate: 16_000,
        }
    }
}

impl DemoConfig {
    /// Checks every field; the error names the key.
    pub fn validate(&self) -> Result<(), DemoError> {
        let bad = |key: &str, why: String| Err(DemoError::Config(format!("{key}: {why}")));
        if self.train == 0 {
            return bad("train", "must be >= 1".into());
        }
        if self.train > 10_000_000 || self.heldout > 10_000_000 {
            return bad(
                "train/heldout",
                "at most 10 000 000 samples per split".into(),
            );
        }
        if !(16..=1024).contains(&self.image_size) {
            return bad(
                "image_size",
                format!("{} is outside 16..=1024", self.image_size),
            );
        }
        // The highest pitch must stay well below Nyquist.
        if !(8_000..=48_000).contains(&self.sample_rate) {
            return bad(
                "sample_rate",
                format!("{} is outside 8000..=48000", self.sample_rate),
            );
        }
        // Each of up to three tones needs ~0.1 s to be heard (and to fill 10 mel frames).
        if !(self.clip_seconds.is_finite() && (0.3..=30.0).contains(&self.clip_seconds)) {
            return bad(
                "clip_seconds",
                format!("{} is outside [0.3, 30]", self.clip_seconds),
            );
        }
        Ok(())
    }
}

/// What [`write_demo`] wrote.
#[derive(Debug, Clone, Default, PartialEq, Eq, Serialize)]
pub struct DemoSummary {
    pub train: usize,
    pub heldout: usize,
    /// Samples with only an image, only a clip, and both.
    pub image_only: usize,
    pub audio_only: usize,
    pub both: usize,
    pub png: usize,
    pub jpeg: usize,
    pub wav: usize,
    pub flac: usize,
    /// Every file written (manifests, media, README.md).
    pub total_bytes: u64,
}

#[derive(Debug, thiserror::Error)]
pub enum DemoError {
    #[error("demo config: {0}")]
    Config(String),
    #[error("cannot write {path}: {source}")]
    Io {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("cannot encode {path}: {reason}")]
    Encode { path: PathBuf, reason: String },
}

fn io_err(path: &Path) -> impl FnOnce(std::io::Error) -> DemoError + '_ {
    move |source| DemoError::Io {
        path: path.to_path_buf(),
        source,
    }
}

/// A canonical 44-byte RIFF/WAVE header plus 16-bit little-endian mono PCM.
pub fn encode_wav(samples: &[i16], sample_rate: u32) -> Vec<u8> {
    let data_len = (samples.len() * 2) as u32;
    let mut out = Vec::with_capacity(44 + samples.len() * 2);
    out.extend_from_slice(b"RIFF");
    out.extend_from_slice(&(36 + data_len).to_le_bytes());
    out.extend_from_slice(b"WAVEfmt ");
    out.extend_from_slice(&16u32.to_le_bytes()); // fmt chunk size
    out.extend_from_slice(&1u16.to_le_bytes()); // PCM
    out.extend_from_slice(&1u16.to_le_bytes()); // channels
    out.extend_from_slice(&sample_rate.to_le_bytes());
    out.extend_from_slice(&(sample_rate * 2).to_le_bytes()); // byte rate
    out.extend_from_slice(&2u16.to_le_bytes()); // block align
    out.extend_from_slice(&16u16.to_le_bytes()); // bits per sample
    out.extend_from_slice(b"data");
    out.extend_from_slice(&data_len.to_le_bytes());
    for s in samples {
        out.extend_from_slice(&s.to_le_bytes());
    }
    out
}

/// The independent random stream of sample `index` of split `split` (0 train, 1 heldout).
fn sample_rng(seed: u64, split: u64, index: usize) -> SplitMix64 {
    let key = SplitMix64::new(seed).next_u64()
        ^ split.wrapping_mul(0xD6E8_FEB8_6659_FD93)
        ^ (index as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15);
    let mut rng = SplitMix64::new(key);
    rng.next_u64();
    rng
}

/// Writes `bytes` to `dir/rel` and adds its size to the summary.
fn put_file(dir: &Path, rel: &str, bytes: &[u8], sum: &mut DemoSummary) -> Result<(), DemoError> {
    let path = dir.join(rel);
    fs::write(&path, bytes).map_err(io_err(&path))?;
    sum.total_bytes += bytes.len() as u64;
    Ok(())
}

/// Generates one sample's media into `dir` and returns its JSONL record.
fn write_sample(
    dir: &Path,
    cfg: &DemoConfig,
    split: &str,
    split_id: u64,
    index: usize,
    sum: &mut DemoSummary,
) -> Result<serde_json::Value, DemoError> {
    let mut rng = sample_rng(cfg.seed, split_id, index);
    let id = format!("{split}-{index:06}");
    // 40% image only, 40% clip only, 20% both.
    let kind = rng.f64();
    let (has_image, has_audio) = (kind < 0.6, kind >= 0.4);
    let mut content = Vec::new();
    let mut answer = Vec::new();
    let mut labels = serde_json::Map::new();

    if has_image {
        let (rgb, img) = render::draw_image(&mut rng, cfg.image_size);
        let png = rng.f64() < 0.5;
        let rel = format!("images/{id}.{}", if png { "png" } else { "jpg" });
        let mut bytes = Vec::new();
        let (s, t) = (cfg.image_size, ExtendedColorType::Rgb8);
        let res = if png {
            sum.png += 1;
            image::codecs::png::PngEncoder::new(&mut bytes).write_image(&rgb, s, s, t)
        } else {
            sum.jpeg += 1;
            image::codecs::jpeg::JpegEncoder::new_with_quality(&mut bytes, JPEG_QUALITY)
                .write_image(&rgb, s, s, t)
        };
        res.map_err(|e| DemoError::Encode {
            path: dir.join(&rel),
            reason: e.to_string(),
        })?;
        put_file(dir, &rel, &bytes, sum)?;
        content.push(json!({"type": "image", "path": rel}));
        answer.push(img.caption());
        labels.insert("image".into(), image_labels(&img));
    }
    if has_audio {
        let len = (f64::from(cfg.clip_seconds) * f64::from(cfg.sample_rate)).round() as usize;
        let (pcm, tones) = render::draw_clip(&mut rng, len, cfg.sample_rate);
        let wav = rng.f64() < 0.5;
        let rel = format!("audio/{id}.{}", if wav { "wav" } else { "flac" });
        let bytes = if wav {
            sum.wav += 1;
            encode_wav(&pcm, cfg.sample_rate)
        } else {
            sum.flac += 1;
            encode_flac(&pcm, cfg.sample_rate)
        };
        put_file(dir, &rel, &bytes, sum)?;
        content.push(json!({"type": "audio", "path": rel}));
        answer.push(render::transcript(&tones));
        let words: Vec<&str> = tones.iter().map(|&t| PITCHES[t].0).collect();
        labels.insert("audio".into(), json!({ "tones": words }));
    }
    let prompt = match (has_image, has_audio) {
        (true, true) => {
            sum.both += 1;
            BOTH_PROMPTS[rng.range(0, BOTH_PROMPTS.len() as u32 - 1) as usize]
        }
        (true, false) => {
            sum.image_only += 1;
            IMAGE_PROMPTS[rng.range(0, IMAGE_PROMPTS.len() as u32 - 1) as usize]
        }
        _ => {
            sum.audio_only += 1;
            AUDIO_PROMPTS[rng.range(0, AUDIO_PROMPTS.len() as u32 - 1) as usize]
        }
    };
    content.push(json!({"type": "text", "text": prompt}));
    Ok(json!({
        "id": id,
        "messages": [
            {"role": "user", "content": content},
            {"role": "assistant", "content": [{"type": "text", "text": answer.join("; ")}]},
        ],
        "labels": labels,
    }))
}

fn image_labels(img: &ImageContent) -> serde_json::Value {
    json!({
        "colour": COLOURS[img.colour].0,
        "shape": SHAPES[img.shape].0,
        "count": img.count,
    })
}

/// Writes `dir/{train,heldout}.jsonl`, `dir/images/`, `dir/audio/` and `dir/README.md`, creating
/// `dir` if needed. Existing files of the same names are overwritten; other files are left alone.
pub fn write_demo(dir: &Path, cfg: &DemoConfig) -> Result<DemoSummary, DemoError> {
    cfg.validate()?;
    for sub in ["images", "audio"] {
        let p = dir.join(sub);
        fs::create_dir_all(&p).map_err(io_err(&p))?;
    }
    let mut sum = DemoSummary {
        train: cfg.train,
        heldout: cfg.heldout,
        ..DemoSummary::default()
    };
    for (split, split_id, n) in [("train", 0, cfg.train), ("heldout", 1, cfg.heldout)] {
        let path = dir.join(format!("{split}.jsonl"));
        let file = File::create(&path).map_err(io_err(&path))?;
        let mut w = BufWriter::new(file);
        for i in 0..n {
            let record = write_sample(dir, cfg, split, split_id, i, &mut sum)?;
            let line = record.to_string();
            writeln!(w, "{line}").map_err(io_err(&path))?;
            sum.total_bytes += line.len() as u64 + 1;
        }
        w.flush().map_err(io_err(&path))?;
    }
    let readme = readme(cfg, &sum);
    put_file(dir, "README.md", readme.as_bytes(), &mut sum)?;
    Ok(sum)
}

fn readme(cfg: &DemoConfig, s: &DemoSummary) -> String {
    let colours: Vec<&str> = COLOURS.iter().map(|c| c.0).collect();
    let shapes: Vec<&str> = SHAPES.iter().map(|c| c.0).collect();
    let pitches: Vec<String> = PITCHES
        .iter()
        .map(|(w, f)| format!("\"{w}\" = {f} Hz"))
        .collect();
    let mut r = String::new();
    let _ = write!(
        r,
        r#"# Braid demo dataset

Written by `braid demo-data` (seed {seed}). Regenerate it rather than editing it: the same seed
and settings give the same bytes.

- `train.jsonl`: {train} samples; `heldout.jsonl`: {heldout} samples (same distribution,
  independent draws, disjoint ids). Samples: {io} image only, {ao} audio only, {both} both.
- `images/`: {size}x{size} RGB, {png} PNG and {jpeg} JPEG (quality {q}).
- `audio/`: {secs} s mono 16-bit clips at {sr} Hz, {wav} WAV and {flac} FLAC.

## Records

JSONL chat records as `braid pack --format jsonl` reads them (media paths relative to this
folder): a user turn with the image and/or clip and a prompt, an assistant turn with the answer.
Prompts are drawn from a fixed few per kind and say nothing about the answer.
A `labels` object repeats the answer as fields for evaluation; the packer ignores it.

## Content

- Image: one or two shapes of one kind and one colour on a light, slightly noisy background
  (two shapes never overlap: each takes one half of the image). Colours: {colours}.
  Shapes: {shapes}. Caption: "a red circle" or "two blue squares".
- Clip: one to {max_tones} tones, one per equal slot of the clip, over faint noise. Pitches
  (detuned by up to 1%): {pitches}. Transcript: the tone words in order, e.g. "three one five".
- Both: the caption, "; ", the transcript.

Only the media determine the answers. A text-only model can at best learn the answer
formats and the priors: colour 1/4, shape 1/4, count 1/2, number of tones 1/3, each tone 1/5.
A model that sees the media can get every answer right.
"#,
        seed = cfg.seed,
        train = s.train,
        heldout = s.heldout,
        io = s.image_only,
        ao = s.audio_only,
        both = s.both,
        size = cfg.image_size,
        png = s.png,
        jpeg = s.jpeg,
        q = JPEG_QUALITY,
        secs = cfg.clip_seconds,
        sr = cfg.sample_rate,
        wav = s.wav,
        flac = s.flac,
        colours = colours.join(", "),
        shapes = shapes.join(", "),
        max_tones = MAX_TONES,
        pitches = pitches.join(", "),
    );
    r
}
