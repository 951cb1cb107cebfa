//! A hostile corpus through the real `braid pack` job: hundreds of broken and mutated files
//! (truncated, bit-flipped, zero-length, bomb-sized images of five formats; broken WAV/FLAC/MP3/
//! OGG; malformed JSON, bad UTF-8, missing files, path escapes, placeholder and ShareGPT
//! mismatches) among good samples of a wide sweep of image sizes and pixel formats. Every good
//! sample must be packed, every broken one rejected with a reason, and nothing may crash.
//!
//! The sizes include the landscape shapes that crashed `fast_image_resize` 6.1.0's two-axis
//! crop path (every backend, not only AVX2) under the CLIP preset (h = 32 at CLIP 224 with widths 35-39, 49-53, 65-95, ...; issue 19):
//! a segfault in release builds, a caught "attempt to subtract with overflow" panic (so the
//! sample was wrongly rejected) in the test profile. Both failed this test until the resize
//! moved to two single-axis passes (`media/resize.rs`).
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use braid_dataloader::config::{DataConfig, ImagePreset};
use braid_dataloader::demo::encode_wav;
use braid_dataloader::read::Format;
use common::hostile_util::{Rng, bomb, good_image};
use common::{pack, rejects};
use serde_json::{Value, json};

/// The good image sizes: both sides swept over 1..=64 against 32 (every CLIP 224 crash band
/// below 64 lies there), the landscape widths that crashed, and extreme aspect ratios.
fn good_sizes() -> Vec<(u32, u32)> {
    let mut sizes: Vec<(u32, u32)> = (1..=64).map(|w| (w, 32)).collect();
    sizes.extend((1..=64).filter(|&h| h != 32).map(|h| (32, h)));
    // Wider and taller, through the crash bands 65-95, 161-213 and 289-399 at h = 32.
    sizes.extend((65..=400).step_by(7).map(|w| (w, 32)));
    sizes.extend((65..=400).step_by(7).map(|h| (32, h)));
    sizes.extend([
        (95, 32),
        (81, 32),
        (213, 32),
        (399, 32),
        (95, 16),
        (1, 512),
        (512, 1),
        (3, 1),
        (1, 3),
        (224, 224),
        (300, 7),
    ]);
    sizes
}

fn user_with(parts: Vec<Value>) -> Value {
    json!([{"role": "user", "content": parts}, {"role": "assistant", "content": "an answer"}])
}

fn img_part(p: &str) -> Value {
    json!({"type": "image", "path": p})
}

fn aud_part(p: &str) -> Value {
    json!({"type": "audio", "path": p})
}

struct Corpus {
    lines: Vec<String>,
    good: BTreeSet<String>,
    broken: BTreeSet<String>,
    /// Bit-flipped bodies: decoding may fail or yield other pixels; either way accounted for.
    mutated: BTreeSet<String>,
}

impl Corpus {
    fn add(&mut self, set: char, id: String, record: Value) {
        let mut r = record;
        r["id"] = json!(id);
        self.lines.push(r.to_string());
        match set {
            'g' => self.good.insert(id),
            'b' => self.broken.insert(id),
            _ => self.mutated.insert(id),
        };
    }
    fn chat(&mut self, set: char, id: String, parts: Vec<Value>) {
        self.add(set, id, json!({"messages": user_with(parts)}));
    }
}

fn build(dir: &Path) -> Corpus {
    let m = dir.join("m");
    fs::create_dir_all(&m).unwrap();
    let mut c = Corpus {
        lines: Vec::new(),
        good: BTreeSet::new(),
        broken: BTreeSet::new(),
        mutated: BTreeSet::new(),
    };
    let mut rng = Rng(0x2545_F491_4F6C_DD1D);
    // Good images: every size, pixel formats and containers cycled.
    for (k, (w, h)) in good_sizes().into_iter().enumerate() {
        let (bytes, ext) = good_image(w, h, k);
        let name = format!("g{k}_{w}x{h}.{ext}");
        fs::write(m.join(&name), bytes).unwrap();
        c.chat(
            'g',
            format!("good_img_{w}x{h}_{k}"),
            vec![
                img_part(&format!("m/{name}")),
                json!({"type": "text", "text": "What?"}),
            ],
        );
    }
    // A valid PNG named .jpg: the bytes decide, so it is good.
    fs::write(m.join("named-wrong.jpg"), good_image(20, 10, 0).0).unwrap();
    c.chat(
        'g',
        "good_png_named_jpg".into(),
        vec![img_part("m/named-wrong.jpg")],
    );
    // Good audio: WAV at five rates, the committed FLAC / MP3 / OGG fixtures.
    for (i, rate) in [8_000u32, 16_000, 22_050, 44_100, 48_000]
        .into_iter()
        .enumerate()
    {
        let n = rate as usize * 3 / 10;
        let pcm: Vec<i16> = (0..n).map(|j| ((j * 97 % 2000) as i16) - 1000).collect();
        fs::write(m.join(format!("a{i}.wav")), encode_wav(&pcm, rate)).unwrap();
        c.chat(
            'g',
            format!("good_wav_{rate}"),
            vec![aud_part(&format!("m/a{i}.wav"))],
        );
    }
    let fixtures = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures");
    for ext in ["flac", "mp3", "ogg"] {
        fs::copy(
            fixtures.join(format!("tone.{ext}")),
            m.join(format!("tone.{ext}")),
        )
        .unwrap();
        c.chat(
            'g',
            format!("good_{ext}"),
            vec![aud_part(&format!("m/tone.{ext}"))],
        );
    }
    // Good ShareGPT records, and text-only ones.
    for i in 0..6 {
        c.add('g', format!("good_sharegpt_{i}"), json!({"conversations": [
            {"from": "human", "value": "<image>Look at <audio> this."}, {"from": "gpt", "value": "Seen and heard."}],
            "images": [format!("m/g{i}_{}x32.png", i + 1)], "audios": ["m/a1.wav"]}));
        c.chat(
            'g',
            format!("good_text_{i}"),
            vec![json!({"type": "text", "text": "Just words ".repeat(i + 1)})],
        );
    }

    // Broken images: for each container, truncations, a flipped signature, zero length, a bomb.
    for (k, ext) in [
        (0usize, "png"),
        (7, "jpg"),
        (9, "gif"),
        (10, "webp"),
        (10, "bmp"),
    ] {
        // (w + h) odd picks BMP over WebP in `good_image`'s last slot.
        let (w, h) = if ext == "bmp" { (23, 18) } else { (24, 18) };
        let (good, got) = good_image(w, h, k);
        assert_eq!(got, ext);
        let len = good.len();
        // Prefixes shorter than the last 16 bytes never decode (image_hostile.rs checks every one).
        for (j, cut) in [
            0,
            1,
            2,
            5,
            8,
            12,
            16,
            24,
            33,
            len / 8,
            len / 4,
            len / 3,
            len / 2,
            2 * len / 3,
            3 * len / 4,
            len - 17,
        ]
        .into_iter()
        .enumerate()
        {
            let name = format!("cut{j}.{ext}");
            fs::write(m.join(&name), &good[..cut]).unwrap();
            c.chat(
                'b',
                format!("bad_{ext}_truncated_{j}_{cut}"),
                vec![img_part(&format!("m/{name}"))],
            );
        }
        // Bytes `guess_format` checks: flipping one makes the file no known format. (JPEG's
        // fourth byte and BMP's size field may change without breaking the file.)
        let magic_len = match ext {
            "jpg" => 3,
            "bmp" => 2,
            _ => 4,
        };
        for byte in 0..magic_len {
            for bit in [0u8, 3, 7] {
                let mut b = good.clone();
                b[byte] ^= 1 << bit;
                let name = format!("sig{byte}_{bit}.{ext}");
                fs::write(m.join(&name), b).unwrap();
                c.chat(
                    'b',
                    format!("bad_{ext}_signature_{byte}_{bit}"),
                    vec![img_part(&format!("m/{name}"))],
                );
            }
        }
        fs::write(m.join(format!("bomb.{ext}")), bomb(ext, &good)).unwrap();
        c.chat(
            'b',
            format!("bad_{ext}_bomb"),
            vec![img_part(&format!("m/bomb.{ext}"))],
        );
        // Random bit flips past the header: undetermined, must not crash.
        for j in 0..8 {
            let mut b = good.clone();
            for _ in 0..1 + j % 3 {
                let at = 16 + (rng.next() as usize) % (len - 16);
                b[at] ^= 1 << (rng.next() % 8);
            }
            let name = format!("flip{j}.{ext}");
            fs::write(m.join(&name), b).unwrap();
            c.chat(
                'm',
                format!("mut_{ext}_flip_{j}"),
                vec![img_part(&format!("m/{name}"))],
            );
        }
    }
    fs::write(m.join("empty.png"), b"").unwrap();
    c.chat(
        'b',
        "bad_zero_length_image".into(),
        vec![img_part("m/empty.png")],
    );
    // Wrong kinds: audio as an image, an image as audio, text as either.
    fs::write(m.join("sound.png"), encode_wav(&[1, 2, 3, 4], 16_000)).unwrap();
    fs::write(m.join("notes.wav"), b"just some text, not audio at all").unwrap();
    c.chat(
        'b',
        "bad_wav_as_image".into(),
        vec![img_part("m/sound.png")],
    );
    c.chat(
        'b',
        "bad_png_as_audio".into(),
        vec![aud_part("m/g0_1x32.png")],
    );
    c.chat(
        'b',
        "bad_text_as_audio".into(),
        vec![aud_part("m/notes.wav")],
    );

    // Broken audio: garbage behind real magic numbers, header-only WAVs, absurd headers.
    for (i, magic) in [
        &b"RIFF\x00\x00\x00\x00WAVE"[..],
        b"fLaC",
        b"OggS",
        b"ID3\x03",
        b"\xff\xfb",
        b"",
    ]
    .iter()
    .enumerate()
    {
        for len in [1usize, 64, 4000] {
            let mut b = magic.to_vec();
            b.extend((0..len).map(|_| rng.next() as u8));
            let name = format!("junk{i}_{len}.wav");
            fs::write(m.join(&name), b).unwrap();
            c.chat(
                'b',
                format!("bad_audio_junk_{i}_{len}"),
                vec![aud_part(&format!("m/{name}"))],
            );
        }
    }
    let wav = encode_wav(&vec![100i16; 8000], 16_000);
    for cut in (0..=44).step_by(4) {
        let name = format!("hdr{cut}.wav");
        fs::write(m.join(&name), &wav[..cut]).unwrap();
        c.chat(
            'b',
            format!("bad_wav_header_{cut}"),
            vec![aud_part(&format!("m/{name}"))],
        );
    }
    for (what, at, value) in [("rate0", 24usize, 0u32), ("rate10", 24, 10)] {
        let mut b = wav.clone();
        b[at..at + 4].copy_from_slice(&value.to_le_bytes());
        fs::write(m.join(format!("{what}.wav")), b).unwrap();
        c.chat(
            'b',
            format!("bad_wav_{what}"),
            vec![aud_part(&format!("m/{what}.wav"))],
        );
    }
    let mut ch0 = wav.clone();
    ch0[22..24].copy_from_slice(&0u16.to_le_bytes());
    fs::write(m.join("ch0.wav"), ch0).unwrap();
    c.chat('b', "bad_wav_ch0".into(), vec![aud_part("m/ch0.wav")]);
    let flac = fs::read(fixtures.join("tone.flac")).unwrap();
    for cut in [4usize, 10, 42] {
        fs::write(m.join(format!("flac{cut}.flac")), &flac[..cut]).unwrap();
        c.chat(
            'b',
            format!("bad_flac_truncated_{cut}"),
            vec![aud_part(&format!("m/flac{cut}.flac"))],
        );
    }

    // Records: missing files, escapes, placeholder and ShareGPT mismatches.
    let outside = dir.parent().unwrap().join(format!(
        "outside-{}.png",
        dir.file_name().unwrap().to_string_lossy()
    ));
    fs::write(&outside, good_image(8, 8, 0).0).unwrap();
    std::os::unix::fs::symlink(&outside, m.join("link-out.png")).unwrap();
    for i in 0..10 {
        c.chat(
            'b',
            format!("bad_missing_{i}"),
            vec![img_part(&format!("m/nope{i}.png"))],
        );
    }
    for (i, p) in [
        "../x.png",
        "m/../../x.png",
        "/etc/passwd",
        outside.to_str().unwrap(),
        "m/link-out.png",
        "",
        "m",
        "./",
    ]
    .into_iter()
    .enumerate()
    {
        c.chat('b', format!("bad_escape_{i}"), vec![img_part(p)]);
    }
    c.chat(
        'b',
        "bad_image_without_path".into(),
        vec![json!({"type": "image"})],
    );
    c.chat(
        'b',
        "bad_video_part".into(),
        vec![json!({"type": "video", "path": "m/v.mp4"})],
    );
    let sg = |content: &str, images: Value, audios: Value| {
        json!({"messages": [{"role": "user", "content": content}, {"role": "assistant", "content": "x"}],
               "images": images, "audios": audios})
    };
    let one = json!(["m/g0_1x32.png"]);
    let two = json!(["m/g0_1x32.png", "m/g0_1x32.png"]);
    let clip = json!(["m/a1.wav"]);
    for (i, r) in [
        sg("<image><image>", one.clone(), json!(null)),
        sg("<image>", two.clone(), json!(null)),
        sg("no placeholder", one.clone(), json!(null)),
        sg("<audio>", json!(null), json!([])),
        sg("<audio><audio>", json!(null), clip.clone()),
        sg("<image><audio>", one.clone(), json!(null)),
        sg("<image>", json!([{"path": "m/g0_1x32.png"}]), json!(null)),
        sg("<image>", json!(7), json!(null)),
        sg("<image>", json!(["m/nope.png"]), json!(null)),
        sg("<image>", json!(["../x.png"]), json!(null)),
        json!({"messages": [{"role": "user", "content": "<image>Describe."}, {"role": "assistant", "content": "x"}]}),
        json!({"conversations": [{"from": "human", "value": "<image>"}, {"from": "gpt", "value": "x"}], "images": two.clone()}),
        json!({"conversations": [{"from": "robot", "value": "hi"}, {"from": "gpt", "value": "x"}]}),
        json!({"conversations": [{"from": "human", "value": "<video>"}, {"from": "gpt", "value": "x"}], "videos": ["v.mp4"]}),
        json!({"messages": [], "images": one.clone()}),
        json!({"conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}),
        json!({"messages": [{"role": "user", "content": "hi"}]}),
        json!({"image": "m/g0_1x32.png", "images": one.clone(), "conversations": [{"from": "human", "value": "<image>"}]}),
    ]
    .into_iter()
    .enumerate()
    {
        c.add('b', format!("bad_sharegpt_{i}"), r);
    }
    c
}

#[test]
fn hostile_corpus_keeps_every_good_sample_and_rejects_every_broken_one() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("corpus");
    let mut corpus = build(&dir);
    let manifest = dir.join("train.jsonl");
    let mut bytes = corpus.lines.join("\n").into_bytes();
    bytes.push(b'\n');
    // Lines with no readable id, known by `file:line`: malformed JSON and bad UTF-8.
    let first = corpus.lines.len() + 1;
    let junk: Vec<Vec<u8>> = vec![
        b"{\"id\": \"cut".to_vec(),
        b"{\"messages\": [".to_vec(),
        b"not json at all".to_vec(),
        b"[1, 2, 3]".to_vec(),
        b"\"a string\"".to_vec(),
        b"{\"id\": \"x\", \"messages\": \"\xff\xfe\"}".to_vec(),
        b"\xc3\x28\xa0\xa1".to_vec(),
        b"{\"id\": \"y\" \"messages\": []}".to_vec(),
        b"{\"id\": {\"nested\": 1}, \"messages\": []}".to_vec(),
        b"{\"id\": \"z\", \"messages\": [{\"role\": \"user\", \"content\": \"\xed\xa0\x80\"}]}"
            .to_vec(),
    ];
    let mut by_source = BTreeSet::new();
    for (j, line) in junk.iter().enumerate() {
        bytes.extend_from_slice(line);
        bytes.push(b'\n');
        by_source.insert(format!("{}:{}", manifest.display(), first + j));
    }
    fs::write(&manifest, bytes).unwrap();
    assert!(
        corpus.broken.len() + by_source.len() >= 200,
        "{} broken",
        corpus.broken.len()
    );
    assert!(corpus.good.len() >= 140, "{} good", corpus.good.len());

    let mut cfg = DataConfig::default();
    cfg.image.preset = ImagePreset::Clip;
    cfg.image.size = 224;
    cfg.image.patch = 14;
    cfg.pack.max_seq_len = 1024;
    cfg.pack.max_reject_ratio = 1.0;
    cfg.shards.threads = 2;
    let out = tmp.path().join("out");
    let started = std::time::Instant::now();
    let info = pack(&manifest, Format::Jsonl, &out, &cfg);
    eprintln!(
        "hostile corpus: {} read, {} packed, {} rejected in {:.1} s",
        info.samples,
        info.packed_samples,
        info.rejected,
        started.elapsed().as_secs_f64()
    );

    let (_, ds) = braid_dataloader::dataset::DatasetInfo::open(&out).unwrap();
    let mut packed = BTreeSet::new();
    for p in 0..ds.packs().len() {
        packed.extend(ds.read_pack(p).unwrap().into_iter().map(|s| s.id));
    }
    let rej = rejects(&out);
    let mut rejected = BTreeSet::new();
    for r in &rej {
        let reason = r["reason"].as_str().unwrap();
        assert!(!reason.trim().is_empty(), "empty reason: {r}");
        let key = r["id"]
            .as_str()
            .map_or_else(|| r["source"].as_str().unwrap().to_string(), str::to_string);
        // Lines whose id could not be read are known by their source.
        let key = if by_source.contains(r["source"].as_str().unwrap()) {
            r["source"].as_str().unwrap().to_string()
        } else {
            key
        };
        assert!(rejected.insert(key.clone()), "{key} rejected twice");
    }
    let missing: Vec<_> = corpus.good.difference(&packed).collect();
    assert!(
        missing.is_empty(),
        "good samples not packed: {missing:?}\n{rej:#?}"
    );
    corpus.broken.extend(by_source);
    let through: Vec<_> = corpus.broken.difference(&rejected).collect();
    assert!(
        through.is_empty(),
        "broken samples not rejected: {through:?}"
    );
    for id in &corpus.mutated {
        assert!(
            packed.contains(id) ^ rejected.contains(id),
            "{id} lost or doubled"
        );
    }
    assert_eq!(
        info.samples as usize,
        corpus.good.len() + corpus.broken.len() + corpus.mutated.len()
    );
    assert_eq!(packed.len() + rejected.len(), info.samples as usize);
}
