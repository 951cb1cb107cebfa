//! Corpus writers shared by the pack-job and loader tests: real PNG/JPEG/WAV files and
//! manifests in every input format, plus one sample of every bad case `braid pack` must reject.
//! The `*_util` submodules hold the helpers of the image, audio, reader and tokenizer tests.
#![allow(dead_code, clippy::unwrap_used)]

pub mod audio_util;
pub mod hostile_util;
pub mod image_util;
pub mod read_util;
pub mod tokenize_util;

use std::fs;
use std::path::{Path, PathBuf};

use braid_dataloader::config::DataConfig;
use braid_dataloader::dataset::DatasetInfo;
use braid_dataloader::demo::encode_wav;
use braid_dataloader::job::{PackJob, run_pack};
use braid_dataloader::read::Format;
use serde_json::{Value, json};

pub fn png(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([
            (x * 7 + seed * 31) as u8,
            (y * 5 + seed) as u8,
            (x ^ y) as u8,
        ])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

pub fn jpeg(w: u32, h: u32, seed: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| {
        image::Rgb([(x * 3 + seed) as u8, (y * 3) as u8, (seed * 17) as u8])
    });
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Jpeg).unwrap();
    out.into_inner()
}

/// 16-bit mono PCM WAV of a `hz` tone.
pub fn wav(seconds: f32, rate: u32, hz: f32) -> Vec<u8> {
    let n = (seconds * rate as f32) as usize;
    let samples: Vec<i16> = (0..n)
        .map(|i| {
            (0.3 * (2.0 * std::f32::consts::PI * hz * i as f32 / rate as f32).sin() * 32767.0)
                as i16
        })
        .collect();
    encode_wav(&samples, rate)
}

/// CRC-32 (IEEE), as PNG chunks carry it.
pub fn crc32(bytes: &[u8]) -> u32 {
    let mut c = 0xffff_ffffu32;
    for &b in bytes {
        c ^= u32::from(b);
        for _ in 0..8 {
            c = if c & 1 == 1 {
                0xedb8_8320 ^ (c >> 1)
            } else {
                c >> 1
            };
        }
    }
    !c
}

fn text(t: &str) -> Value {
    json!({"type": "text", "text": t})
}

fn record(id: &str, user: Vec<Value>, answer: &str) -> Value {
    json!({"id": id, "messages": [
        {"role": "user", "content": user},
        {"role": "assistant", "content": [text(answer)]},
    ]})
}

/// The small config the tests pack with: 32 px images (4x4 patches of 8 -> 16 tokens),
/// 512-token rows, 2 threads.
pub fn test_config() -> DataConfig {
    let mut cfg = DataConfig::default();
    cfg.image.size = 32;
    cfg.image.patch = 8;
    cfg.pack.max_seq_len = 512;
    cfg.pack.window = 64;
    cfg.shards.threads = 2;
    cfg.shards.row_group_mib = 1;
    cfg
}

/// A JSONL corpus of `n` good samples (image, clip, both, text-only, varied lengths). Returns
/// the manifest path and the good ids.
pub fn jsonl_good(dir: &Path, n: usize) -> (PathBuf, Vec<String>) {
    fs::create_dir_all(dir.join("media")).unwrap();
    let mut lines = Vec::new();
    let mut ids = Vec::new();
    for i in 0..n {
        let id = format!("good{i:04}");
        let img = format!("media/{i}.{}", if i % 2 == 0 { "png" } else { "jpg" });
        let clip = format!("media/{i}.wav");
        let bytes = if i % 2 == 0 {
            png(40 + (i % 7) as u32 * 9, 36 + (i % 5) as u32 * 7, i as u32)
        } else {
            jpeg(48, 40, i as u32)
        };
        fs::write(dir.join(&img), bytes).unwrap();
        fs::write(
            dir.join(&clip),
            wav(0.3 + (i % 4) as f32 * 0.2, 22_050, 300.0 + i as f32),
        )
        .unwrap();
        let answer = "an answer ".repeat(1 + (i * 7) % 40);
        let user = match i % 4 {
            0 => vec![json!({"type": "image", "path": img}), text("What is it?")],
            1 => vec![
                json!({"type": "audio", "path": clip}),
                text("What is heard?"),
            ],
            2 => vec![
                json!({"type": "image", "path": img}),
                json!({"type": "audio", "path": clip}),
                text("Both?"),
            ],
            _ => vec![text("Just text, please.")],
        };
        lines.push(record(&id, user, &answer).to_string());
        ids.push(id);
    }
    let path = dir.join("train.jsonl");
    fs::write(&path, lines.join("\n") + "\n").unwrap();
    (path, ids)
}

/// Appends one sample of every bad case to the manifest (and the files they need); returns
/// the ids (or, for lines without a readable id, the `file:line` sources) that must be rejected.
pub fn append_bad_cases(dir: &Path, manifest: &Path) -> Vec<String> {
    let m = dir.join("media");
    let good_png = png(40, 40, 1);
    fs::write(m.join("truncated.png"), &good_png[..good_png.len() / 2]).unwrap();
    let good_jpg = jpeg(48, 40, 2);
    fs::write(m.join("truncated.jpg"), &good_jpg[..good_jpg.len() - 200]).unwrap();
    fs::write(m.join("garbage.png"), b"this is not an image at all").unwrap();
    fs::write(m.join("notes.txt"), b"plain text posing as an image").unwrap();
    fs::write(
        m.join("corrupt.wav"),
        b"RIFF\x10\x00\x00\x00WAVEjunkjunkjunk",
    )
    .unwrap();
    fs::write(m.join("zero.wav"), encode_wav(&[], 16_000)).unwrap();
    fs::write(m.join("empty.png"), b"").unwrap();
    // A PNG header claiming 100000 x 100000 pixels: the bomb check must fire before decoding.
    let mut bomb = good_png.clone();
    bomb[16..20].copy_from_slice(&100_000u32.to_be_bytes());
    bomb[20..24].copy_from_slice(&100_000u32.to_be_bytes());
    let crc = crc32(&bomb[12..29]);
    bomb[29..33].copy_from_slice(&crc.to_be_bytes());
    fs::write(m.join("bomb.png"), bomb).unwrap();
    // 31 s (max_seconds is 30 by default): rejected from the header, before decoding.
    fs::write(m.join("long.wav"), wav(31.0, 8_000, 440.0)).unwrap();
    let outside = dir.parent().unwrap().join(format!(
        "outside-{}.png",
        dir.file_name().unwrap().to_str().unwrap()
    ));
    fs::write(&outside, &good_png).unwrap();
    #[cfg(unix)]
    std::os::unix::fs::symlink(&outside, m.join("link-out.png")).unwrap();

    let img = |p: &str| json!({"type": "image", "path": p});
    let aud = |p: &str| json!({"type": "audio", "path": p});
    let mut bad = Vec::new();
    let mut lines = Vec::new();
    let mut add = |id: &str, user: Vec<Value>| {
        lines.push(record(id, user, "x").to_string());
        bad.push(id.to_string());
    };
    add("bad_truncated_png", vec![img("media/truncated.png")]);
    add("bad_truncated_jpg", vec![img("media/truncated.jpg")]);
    add("bad_garbage_image", vec![img("media/garbage.png")]);
    add("bad_unknown_format", vec![img("media/notes.txt")]);
    add("bad_empty_image", vec![img("media/empty.png")]);
    add("bad_corrupt_audio", vec![aud("media/corrupt.wav")]);
    add("bad_zero_length_audio", vec![aud("media/zero.wav")]);
    add("bad_missing_file", vec![img("media/nope.png")]);
    add("bad_dotdot", vec![img("../outside.png")]);
    add("bad_absolute", vec![img(outside.to_str().unwrap())]);
    #[cfg(unix)]
    add("bad_symlink_out", vec![img("media/link-out.png")]);
    add("bad_bomb", vec![img("media/bomb.png")]);
    add("bad_long_audio", vec![aud("media/long.wav")]);
    // No assistant turn: nothing to train on.
    lines.push(
        json!({"id": "bad_no_assistant", "messages": [{"role": "user", "content": [text("hi")]}]})
            .to_string(),
    );
    bad.push("bad_no_assistant".into());
    let mut text_lines = lines.join("\n") + "\n";
    // Malformed JSON and invalid UTF-8: no id can be read, so they are known by their line.
    text_lines.push_str("{\"id\": \"bad_json\", \"messages\": [\n");
    let mut bytes = fs::read(manifest).unwrap();
    let first_new_line = bytes.iter().filter(|&&b| b == b'\n').count() + 1;
    bytes.extend_from_slice(text_lines.as_bytes());
    bytes.extend_from_slice(b"{\"id\": \"bad_utf8\", \"x\": \"\xff\xfe\"}\n");
    fs::write(manifest, bytes).unwrap();
    let n = first_new_line + bad.len();
    bad.push(format!("{}:{}", manifest.display(), n));
    bad.push(format!("{}:{}", manifest.display(), n + 1));
    bad
}

/// Packs `input` into `out` with `cfg`.
pub fn pack(input: &Path, format: Format, out: &Path, cfg: &DataConfig) -> DatasetInfo {
    let job = PackJob {
        input: input.to_path_buf(),
        format,
        output: out.to_path_buf(),
        config: cfg.clone(),
        overwrite: true,
    };
    run_pack(&job, &mut |_| {}).unwrap()
}

/// `rejects.jsonl` as JSON values.
pub fn rejects(out: &Path) -> Vec<Value> {
    fs::read_to_string(out.join("rejects.jsonl"))
        .unwrap()
        .lines()
        .map(|l| serde_json::from_str(l).unwrap())
        .collect()
}
