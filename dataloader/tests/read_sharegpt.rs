//! ShareGPT / LLaMA-Factory records (`messages` or `conversations` with top-level `images` /
//! `audios` lists and `<image>` / `<audio>` placeholders) in the JSONL and JSON-array readers,
//! packed end to end: media are placed in order, never dropped, and every mismatch is a reject
//! naming both counts.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;

use braid_dataloader::read::{Format, RawPart, ReadConfig};
use common::read_util::*;
use serde_json::json;

fn media_name(part: &RawPart) -> (&'static str, &str) {
    match part {
        RawPart::Image(m) => ("image", m.name.as_str()),
        RawPart::Audio(m) => ("audio", m.name.as_str()),
        RawPart::Text(t) => ("text", t.as_str()),
    }
}

/// The records every test below reads, as JSON values: `(id, record)`.
fn records() -> Vec<serde_json::Value> {
    vec![
        // LLaMA-Factory "messages" style, one image.
        json!({"id": "lf", "messages": [
            {"role": "user", "content": "<image>Describe."},
            {"role": "assistant", "content": "A picture."}],
            "images": ["img/a.png"]}),
        // ShareGPT "conversations" style with from/value, image + audio, system key.
        json!({"id": "sg", "system": "Be brief.", "conversations": [
            {"from": "human", "value": "Look <image> and hear <audio>, then <image>."},
            {"from": "gpt", "value": "Done."}],
            "images": ["img/a.png", "img/b.jpg"], "audios": ["audio/c.wav"]}),
        // LLaVA's single `image` key inside JSONL.
        json!({"id": "llava_in_jsonl", "image": "img/b.jpg", "conversations": [
            {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "jpeg"}]}),
        // Mismatches and things the reader cannot place.
        json!({"id": "more_ph", "messages": [
            {"role": "user", "content": "<image><image>"}, {"role": "assistant", "content": "x"}],
            "images": ["img/a.png"]}),
        json!({"id": "more_files", "messages": [
            {"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}],
            "images": ["img/a.png", "img/b.jpg", "img/a.png"]}),
        json!({"id": "no_ph", "messages": [
            {"role": "user", "content": "no placeholder"}, {"role": "assistant", "content": "x"}],
            "audios": ["audio/c.wav"]}),
        json!({"id": "no_list", "messages": [
            {"role": "user", "content": "<image>Describe."}, {"role": "assistant", "content": "x"}]}),
        json!({"id": "obj_list", "messages": [
            {"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}],
            "images": [{"bytes": null, "path": "img/a.png"}]}),
        json!({"id": "video", "messages": [
            {"role": "user", "content": "<video>"}, {"role": "assistant", "content": "x"}],
            "videos": ["v.mp4"]}),
        json!({"id": "missing", "messages": [
            {"role": "user", "content": "<image>"}, {"role": "assistant", "content": "x"}],
            "images": ["img/nope.png"]}),
        json!({"id": "observation", "conversations": [
            {"from": "observation", "value": "x"}, {"from": "gpt", "value": "y"}]}),
        json!({"id": "both_ways", "messages": [
            {"role": "user", "content": [{"type": "image", "path": "img/a.png"}]},
            {"role": "assistant", "content": "x"}], "images": ["img/a.png"]}),
    ]
}

fn check(good: &[braid_dataloader::read::RawSample], bad: &[braid_dataloader::read::Reject]) {
    assert_eq!(ids(good), ["lf", "sg", "llava_in_jsonl"], "{bad:#?}");
    let lf = &good[0].messages[0].parts;
    assert_eq!(media_name(&lf[0]), ("image", "img/a.png"));
    assert_eq!(media_name(&lf[1]), ("text", "Describe."));
    let sg = &good[1].messages;
    assert_eq!(sg.len(), 3, "system key becomes the first message");
    assert_eq!(media_name(&sg[0].parts[0]), ("text", "Be brief."));
    let order: Vec<_> = sg[1].parts.iter().map(media_name).collect();
    assert_eq!(
        order,
        [
            ("text", "Look "),
            ("image", "img/a.png"),
            ("text", " and hear "),
            ("audio", "audio/c.wav"),
            ("text", ", then "),
            ("image", "img/b.jpg"),
            ("text", "."),
        ]
    );
    assert_eq!(good[1].media().count(), 3);
    assert_eq!(good[2].media().count(), 1);

    let by_id = |id: &str| {
        bad.iter()
            .find(|r| r.id.as_deref() == Some(id))
            .unwrap_or_else(|| panic!("{id} not rejected: {bad:#?}"))
            .reason
            .clone()
    };
    let has = |id: &str, words: &[&str]| {
        let r = by_id(id);
        for w in words {
            assert!(r.contains(w), "{id}: {r:?} lacks {w:?}");
        }
    };
    has(
        "more_ph",
        &["2 image placeholder", "1 entries in \"images\""],
    );
    has(
        "more_files",
        &["1 image placeholder", "3 entries in \"images\""],
    );
    has("no_ph", &["0 audio placeholder", "1 entries in \"audios\""]);
    has("no_list", &["1 image placeholder", "no \"images\" list"]);
    has(
        "obj_list",
        &["\"images\" holds 1 media entries", "an object"],
    );
    has("video", &["video"]);
    has("missing", &["images[0]", "missing file"]);
    has("observation", &["unknown role \"observation\""]);
    has(
        "both_ways",
        &["name a \"path\"", "\"images\"/\"audios\" list"],
    );
    assert_eq!(bad.len(), 9, "{bad:#?}");
}

#[test]
fn jsonl_reads_sharegpt_and_llama_factory_records() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let lines: Vec<String> = records().iter().map(|r| r.to_string()).collect();
    let manifest = ds.join("sharegpt.jsonl");
    fs::write(&manifest, lines.join("\n")).unwrap();
    let (good, bad) = read_all(&manifest, &ReadConfig::new(Format::Jsonl));
    check(&good, &bad);
}

#[test]
fn json_array_reads_sharegpt_and_llama_factory_records() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let array = ds.join("sharegpt.json");
    fs::write(&array, serde_json::to_string(&records()).unwrap()).unwrap();
    let (good, bad) = read_all(&array, &ReadConfig::new(Format::Llava));
    check(&good, &bad);
}

/// The defect as a user met it: `{"messages": [...<image>...], "images": [...]}` packed as
/// text ("1 packed, 0 rejected, 0 images") with `<image>` left literal.
#[test]
fn pack_places_sharegpt_images_instead_of_literal_text() {
    use braid_dataloader::shard::StoredSample;
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    fs::create_dir_all(&data).unwrap();
    fs::write(data.join("a.png"), common::png(40, 36, 3)).unwrap();
    fs::write(data.join("b.wav"), common::wav(0.5, 16_000, 440.0)).unwrap();
    let rec = json!({"id": "lf", "messages": [
        {"role": "user", "content": "<image><audio>Describe."},
        {"role": "assistant", "content": "A picture and a tone."}],
        "images": ["a.png"], "audios": ["b.wav"]});
    let manifest = data.join("train.jsonl");
    fs::write(&manifest, format!("{rec}\n")).unwrap();
    let out = tmp.path().join("out");
    let info = common::pack(&manifest, Format::Jsonl, &out, &common::test_config());
    assert_eq!(
        (
            info.packed_samples,
            info.rejected,
            info.images,
            info.audio_clips
        ),
        (1, 0, 1, 1)
    );
    let (_, ds) = braid_dataloader::dataset::DatasetInfo::open(&out).unwrap();
    let s: Vec<StoredSample> = ds.read_pack(0).unwrap();
    assert_eq!(s[0].images.len(), 1);
    assert_eq!(s[0].audio.len(), 1);
    // No literal placeholder text survives: "<image>" in the byte tokenizer is its UTF-8 bytes.
    let literal: Vec<u32> = b"<image>".iter().map(|&b| u32::from(b)).collect();
    assert!(
        !s[0]
            .ids
            .windows(literal.len())
            .any(|w| w == literal.as_slice()),
        "literal <image> text in the packed ids"
    );
}
