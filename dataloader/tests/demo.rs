//! The demo dataset: deterministic, readable by the JSONL reader with zero rejects, and its media
//! show what the answers say (colour, count and shape measured on the decoded pixels; tone
//! pitches by DFT on the decoded clips). The FLAC encoder round-trips losslessly through
//! symphonia.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use std::collections::{BTreeMap, HashSet};
use std::path::Path;

use braid_dataloader::demo::render::{COLOURS, PITCHES, SHAPES};
use braid_dataloader::demo::{DemoConfig, DemoError, encode_flac, encode_wav, write_demo};
use braid_dataloader::media::audio::{AudioConfig, decode_audio};
use braid_dataloader::media::image::{ImageConfig, decode_image};
use braid_dataloader::read::{self, Format, MediaBytes, RawPart, RawSample, ReadConfig, Role};

fn small(seed: u64) -> DemoConfig {
    DemoConfig {
        seed,
        train: 40,
        heldout: 12,
        ..DemoConfig::default()
    }
}

/// Every file under `dir`, by relative path.
fn files(dir: &Path) -> BTreeMap<String, Vec<u8>> {
    let mut out = BTreeMap::new();
    let mut stack = vec![dir.to_path_buf()];
    while let Some(d) = stack.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                stack.push(p);
            } else {
                let rel = p.strip_prefix(dir).unwrap().display().to_string();
                out.insert(rel, std::fs::read(&p).unwrap());
            }
        }
    }
    out
}

fn read_split(dir: &Path, split: &str) -> Vec<RawSample> {
    let path = dir.join(format!("{split}.jsonl"));
    read::open(&path, &ReadConfig::new(Format::Jsonl))
        .unwrap()
        .map(|r| r.unwrap_or_else(|rej| panic!("reject: {rej}")))
        .collect()
}

/// The `labels` objects by id, straight from the manifest.
fn labels(dir: &Path, split: &str) -> BTreeMap<String, serde_json::Value> {
    std::fs::read_to_string(dir.join(format!("{split}.jsonl")))
        .unwrap()
        .lines()
        .map(|l| {
            let v: serde_json::Value = serde_json::from_str(l).unwrap();
            (v["id"].as_str().unwrap().to_string(), v["labels"].clone())
        })
        .collect()
}

fn media_bytes(m: &braid_dataloader::read::Media) -> Vec<u8> {
    match &m.bytes {
        MediaBytes::Path(p) => std::fs::read(p).unwrap(),
        MediaBytes::Inline(b) => b.clone(),
    }
}

fn answer(s: &RawSample) -> String {
    let m = s
        .messages
        .iter()
        .find(|m| m.role == Role::Assistant)
        .unwrap();
    match &m.parts[..] {
        [RawPart::Text(t)] => t.clone(),
        other => panic!("{}: answer parts {other:?}", s.id),
    }
}

#[test]
fn same_seed_same_bytes_other_seed_differs() {
    let (a, b, c) = (
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
        tempfile::tempdir().unwrap(),
    );
    let sa = write_demo(a.path(), &small(7)).unwrap();
    let sb = write_demo(b.path(), &small(7)).unwrap();
    write_demo(c.path(), &small(8)).unwrap();
    assert_eq!(sa, sb);
    let (fa, fb, fc) = (files(a.path()), files(b.path()), files(c.path()));
    assert_eq!(fa.keys().collect::<Vec<_>>(), fb.keys().collect::<Vec<_>>());
    for (name, bytes) in &fa {
        assert!(bytes == &fb[name], "{name} differs between two runs");
    }
    let total: u64 = fa.values().map(|b| b.len() as u64).sum();
    assert_eq!(sa.total_bytes, total, "summary bytes vs files on disk");
    assert_ne!(fa["train.jsonl"], fc["train.jsonl"]);
    let same_media = fa
        .iter()
        .filter(|(n, b)| fc.get(*n) == Some(*b) && n.contains('/'))
        .count();
    assert_eq!(same_media, 0, "media identical across seeds");

    // Heldout does not depend on the train count.
    let d = tempfile::tempdir().unwrap();
    write_demo(
        d.path(),
        &DemoConfig {
            train: 3,
            ..small(7)
        },
    )
    .unwrap();
    let fd = files(d.path());
    assert_eq!(fd["heldout.jsonl"], fa["heldout.jsonl"]);
}

#[test]
fn records_read_back_with_zero_rejects() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small(11);
    let sum = write_demo(dir.path(), &cfg).unwrap();
    let train = read_split(dir.path(), "train");
    let heldout = read_split(dir.path(), "heldout");
    assert_eq!((train.len(), heldout.len()), (cfg.train, cfg.heldout));
    let ids: HashSet<&str> = train.iter().map(|s| s.id.as_str()).collect();
    assert_eq!(ids.len(), train.len(), "duplicate train ids");
    assert!(heldout.iter().all(|s| !ids.contains(s.id.as_str())));

    let (mut io, mut ao, mut both) = (0, 0, 0);
    for s in train.iter().chain(&heldout) {
        assert_eq!(s.messages.len(), 2, "{}", s.id);
        assert_eq!(s.messages[0].role, Role::User);
        let n_img = s.media().filter(|(_, img)| *img).count();
        let n_aud = s.media().filter(|(_, img)| !*img).count();
        match (n_img, n_aud) {
            (1, 0) => io += 1,
            (0, 1) => ao += 1,
            (1, 1) => both += 1,
            other => panic!("{}: media {other:?}", s.id),
        }
        // The prompt is the last user part and never contains an answer word.
        let Some(RawPart::Text(prompt)) = s.messages[0].parts.last() else {
            panic!("{}: no prompt", s.id)
        };
        let words = COLOURS
            .iter()
            .map(|c| c.0)
            .chain(SHAPES.iter().map(|s| s.0))
            .chain(PITCHES.iter().map(|p| p.0));
        let prompt_words: Vec<String> = prompt
            .split(|c: char| !c.is_alphanumeric())
            .map(str::to_lowercase)
            .collect();
        for w in words.chain(["a", "two"]) {
            assert!(!prompt_words.iter().any(|p| p == w), "{}: {prompt:?}", s.id);
        }
        assert!(!answer(s).is_empty());
    }
    assert_eq!((io, ao, both), (sum.image_only, sum.audio_only, sum.both));
    assert!(io > 0 && ao > 0 && both > 0, "{sum:?}");
    assert_eq!(sum.png + sum.jpeg, io + both);
    assert_eq!(sum.wav + sum.flac, ao + both);
    assert!(
        sum.png > 0 && sum.jpeg > 0 && sum.wav > 0 && sum.flac > 0,
        "{sum:?}"
    );
}

/// Colour, count and shape read off decoded pixels: foreground = saturated pixels.
fn measure_image(rgb: &[[f32; 3]], n: usize) -> (usize, usize, usize) {
    let fg: Vec<bool> = rgb
        .iter()
        .map(|p| {
            p.iter().fold(0f32, |m, &v| m.max(v)) - p.iter().fold(255f32, |m, &v| m.min(v)) > 60.0
        })
        .collect();
    let mut mean = [0f64; 3];
    let mut cnt = 0f64;
    for (p, &f) in rgb.iter().zip(&fg) {
        if f {
            for c in 0..3 {
                mean[c] += f64::from(p[c]);
            }
            cnt += 1.0;
        }
    }
    let dist = |c: &[u8; 3]| -> f64 {
        (0..3)
            .map(|k| (mean[k] / cnt - f64::from(c[k])).powi(2))
            .sum()
    };
    let colour = (0..COLOURS.len())
        .min_by(|&a, &b| dist(&COLOURS[a].1).total_cmp(&dist(&COLOURS[b].1)))
        .unwrap();
    // 4-connected components of at least 4 pixels.
    let mut seen = vec![false; n * n];
    let mut comps: Vec<Vec<(usize, usize)>> = Vec::new();
    for start in 0..n * n {
        if !fg[start] || seen[start] {
            continue;
        }
        let mut comp = Vec::new();
        let mut stack = vec![start];
        seen[start] = true;
        while let Some(i) = stack.pop() {
            let (y, x) = (i / n, i % n);
            comp.push((y, x));
            let mut nb = Vec::new();
            if y > 0 {
                nb.push(i - n);
            }
            if y + 1 < n {
                nb.push(i + n);
            }
            if x > 0 {
                nb.push(i - 1);
            }
            if x + 1 < n {
                nb.push(i + 1);
            }
            for j in nb {
                if fg[j] && !seen[j] {
                    seen[j] = true;
                    stack.push(j);
                }
            }
        }
        if comp.len() >= 4 {
            comps.push(comp);
        }
    }
    // Shape of the largest component: fill of its bounding box, then top-heaviness.
    let comp = comps.iter().max_by_key(|c| c.len()).unwrap();
    let (y0, y1) = (
        comp.iter().map(|p| p.0).min().unwrap(),
        comp.iter().map(|p| p.0).max().unwrap(),
    );
    let (x0, x1) = (
        comp.iter().map(|p| p.1).min().unwrap(),
        comp.iter().map(|p| p.1).max().unwrap(),
    );
    let fill = comp.len() as f64 / ((y1 - y0 + 1) * (x1 - x0 + 1)) as f64;
    let top = comp.iter().filter(|p| 2 * (p.0 - y0) < y1 - y0).count() as f64 / comp.len() as f64;
    let shape = if fill > 0.88 {
        1
    } else if fill > 0.66 {
        0
    } else if top < 0.38 {
        2
    } else {
        3
    };
    (colour, comps.len(), shape)
}

#[test]
fn images_show_their_caption() {
    let dir = tempfile::tempdir().unwrap();
    for size in [32u32, 48] {
        let cfg = DemoConfig {
            image_size: size,
            ..small(21)
        };
        write_demo(dir.path(), &cfg).unwrap();
        let labels = labels(dir.path(), "train");
        // SigLIP preprocessing at the native size: mean = std = 0.5, so v * 127.5 + 127.5 is the byte.
        let icfg = ImageConfig::siglip(size as usize);
        let mut checked = 0;
        for s in read_split(dir.path(), "train") {
            for (m, is_image) in s.media() {
                if !is_image {
                    continue;
                }
                let px = decode_image(&media_bytes(m), &m.name, &icfg).unwrap();
                let n = size as usize;
                assert_eq!((px.c, px.h, px.w), (3, n, n));
                let rgb: Vec<[f32; 3]> = (0..n * n)
                    .map(|i| std::array::from_fn(|c| px.data[c * n * n + i] * 127.5 + 127.5))
                    .collect();
                let (colour, count, shape) = measure_image(&rgb, n);
                let l = &labels[&s.id]["image"];
                let want = (
                    l["colour"].as_str().unwrap(),
                    l["count"].as_u64().unwrap() as usize,
                    l["shape"].as_str().unwrap(),
                );
                assert_eq!(
                    (COLOURS[colour].0, count, SHAPES[shape].0),
                    want,
                    "{} ({})",
                    s.id,
                    m.name
                );
                let caption = answer(&s);
                assert!(caption.starts_with(if count == 1 { "a " } else { "two " }));
                assert!(caption.contains(COLOURS[colour].0), "{caption}");
                checked += 1;
            }
        }
        assert!(checked > 10, "{checked}");
    }
}

/// Power near `f` (within the +-1% detuning) in `x` at 16 kHz: the best of a few DFT bins.
fn tone_power(x: &[f32], f: f32) -> f64 {
    (-3..=3)
        .map(|k| {
            let w = std::f64::consts::TAU * f64::from(f) * (1.0 + 0.004 * f64::from(k)) / 16_000.0;
            let (mut re, mut im) = (0f64, 0f64);
            for (t, &v) in x.iter().enumerate() {
                re += f64::from(v) * (w * t as f64).cos();
                im -= f64::from(v) * (w * t as f64).sin();
            }
            re * re + im * im
        })
        .fold(0f64, f64::max)
}

#[test]
fn clips_play_their_transcript() {
    let dir = tempfile::tempdir().unwrap();
    let cfg = small(31);
    write_demo(dir.path(), &cfg).unwrap();
    let labels = labels(dir.path(), "train");
    let acfg = AudioConfig::default();
    let mut checked = 0;
    for s in read_split(dir.path(), "train") {
        for (m, is_image) in s.media() {
            if is_image {
                continue;
            }
            let x = decode_audio(&media_bytes(m), &m.name, &acfg).unwrap();
            assert_eq!(x.len(), 16_000, "{}", m.name);
            let words: Vec<&str> = labels[&s.id]["audio"]["tones"]
                .as_array()
                .unwrap()
                .iter()
                .map(|w| w.as_str().unwrap())
                .collect();
            assert!(answer(&s).ends_with(&words.join(" ")), "{}", s.id);
            let n = words.len();
            let heard: Vec<&str> = (0..n)
                .map(|i| {
                    // The central half of slot i lies inside its tone.
                    let (s0, s1) = braid_dataloader::demo::render::tone_slot(x.len(), n, i);
                    let q = (s1 - s0) / 4;
                    let seg = &x[s0 + q..s1 - q];
                    let best = (0..PITCHES.len())
                        .max_by(|&a, &b| {
                            tone_power(seg, PITCHES[a].1).total_cmp(&tone_power(seg, PITCHES[b].1))
                        })
                        .unwrap();
                    PITCHES[best].0
                })
                .collect();
            assert_eq!(heard, words, "{} ({})", s.id, m.name);
            checked += 1;
        }
    }
    assert!(checked > 10, "{checked}");
}

#[test]
fn flac_and_wav_round_trip_losslessly() {
    let mut state = 1u32;
    let mut noise = move || {
        state = state.wrapping_mul(1_664_525).wrapping_add(1_013_904_223);
        (state >> 16) as i16
    };
    // Lengths around the 4096-sample block (a last block under 16 samples goes VERBATIM).
    // Over 128 frames (33 s): frame numbers take two bytes of FLAC's UTF-8 coding.
    let lens = [
        1601usize,
        4096,
        4097,
        4096 * 2 + 5,
        4096 * 3 + 15,
        4096 * 3 + 16,
        4096 * 130 + 7,
    ];
    let acfg = AudioConfig {
        max_seconds: 40.0,
        ..AudioConfig::default()
    };
    for len in lens {
        let signals: Vec<(&str, Vec<i16>)> = vec![
            ("silence", vec![0; len]),
            (
                "sine+noise",
                (0..len)
                    .map(|t| ((t as f32 * 0.07).sin() * 12_000.0) as i16 + noise() / 2048)
                    .collect(),
            ),
            // Full-scale alternation: the largest fixed-predictor residuals there are.
            (
                "extremes",
                (0..len)
                    .map(|t| if (t / 3) % 2 == 0 { i16::MAX } else { i16::MIN })
                    .collect(),
            ),
            ("white", (0..len).map(|_| noise()).collect()),
        ];
        for (what, pcm) in signals {
            let want: Vec<f32> = pcm.iter().map(|&s| f32::from(s) / 32768.0).collect();
            let flac = encode_flac(&pcm, 16_000);
            let got = decode_audio(&flac, "x.flac", &acfg).unwrap();
            assert!(got == want, "FLAC {what} len {len}: not lossless");
            let wav = encode_wav(&pcm, 16_000);
            assert_eq!(wav.len(), 44 + 2 * len);
            let got = decode_audio(&wav, "x.wav", &acfg).unwrap();
            assert!(got == want, "WAV {what} len {len}: not lossless");
            if what == "silence" || what == "sine+noise" {
                assert!(
                    flac.len() < wav.len() / 2,
                    "{what}: {} vs {}",
                    flac.len(),
                    wav.len()
                );
            }
        }
    }
}

#[test]
fn bad_config_and_unwritable_folder_are_errors() {
    let bad = [
        DemoConfig {
            train: 0,
            ..DemoConfig::default()
        },
        DemoConfig {
            image_size: 8,
            ..DemoConfig::default()
        },
        DemoConfig {
            clip_seconds: 0.1,
            ..DemoConfig::default()
        },
        DemoConfig {
            clip_seconds: f32::NAN,
            ..DemoConfig::default()
        },
        DemoConfig {
            sample_rate: 4000,
            ..DemoConfig::default()
        },
    ];
    let dir = tempfile::tempdir().unwrap();
    for cfg in bad {
        let err = write_demo(dir.path(), &cfg).unwrap_err();
        assert!(matches!(err, DemoError::Config(_)), "{cfg:?}: {err}");
    }
    // A partial config takes the defaults; an unknown key is refused.
    let cfg: DemoConfig = serde_json::from_str(r#"{"seed": 5, "train": 10}"#).unwrap();
    assert_eq!(
        cfg,
        DemoConfig {
            seed: 5,
            train: 10,
            ..DemoConfig::default()
        }
    );
    assert!(serde_json::from_str::<DemoConfig>(r#"{"trian": 10}"#).is_err());

    // The output "folder" is a regular file: the error names the path.
    let file = dir.path().join("plain-file");
    std::fs::write(&file, b"x").unwrap();
    let err = write_demo(&file, &small(1)).unwrap_err();
    assert!(matches!(err, DemoError::Io { .. }), "{err}");
    assert!(err.to_string().contains("plain-file"), "{err}");
}
