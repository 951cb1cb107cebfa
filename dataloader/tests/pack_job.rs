//! `braid pack` end to end: every input format, every bad case, counts that add up,
//! determinism across thread counts, and the shards read back.
#![allow(clippy::unwrap_used)]

mod common;

use std::collections::BTreeSet;
use std::fs;
use std::path::Path;

use braid_dataloader::config::MediaStorage;
use braid_dataloader::dataset::DatasetInfo;
use braid_dataloader::job::{PackJob, PackJobError, run_pack};
use braid_dataloader::read::Format;
use braid_dataloader::shard::StoredSample;
use common::*;
use serde_json::json;

fn all_samples(out: &Path) -> (DatasetInfo, Vec<StoredSample>) {
    let (info, ds) = DatasetInfo::open(out).unwrap();
    let mut all = Vec::new();
    for p in 0..ds.packs().len() {
        let samples = ds.read_pack(p).unwrap();
        let tokens: u64 = samples.iter().map(|s| s.ids.len() as u64).sum();
        assert_eq!(tokens, ds.packs()[p].tokens);
        assert!(tokens <= info.max_seq_len);
        all.extend(samples);
    }
    (info, all)
}

fn check_counts(info: &DatasetInfo, samples: &[StoredSample]) {
    assert_eq!(info.samples, info.packed_samples + info.rejected);
    assert_eq!(info.packed_samples, samples.len() as u64);
    assert_eq!(info.rejected, info.rejected_by_stage.values().sum::<u64>());
    assert_eq!(info.rejected, info.rejected_by_kind.values().sum::<u64>());
    let tokens: u64 = samples.iter().map(|s| s.ids.len() as u64).sum();
    assert_eq!(info.tokens, tokens);
    let fill = tokens as f64 / (info.packs * info.max_seq_len) as f64;
    assert!((info.fill - fill).abs() < 1e-12);
    assert_eq!(
        info.images,
        samples.iter().map(|s| s.images.len() as u64).sum::<u64>()
    );
    assert_eq!(
        info.audio_clips,
        samples.iter().map(|s| s.audio.len() as u64).sum::<u64>()
    );
    assert_eq!(info.histograms.llm_len.count, info.packed_samples);
    assert_eq!(
        info.shards.iter().map(|s| s.rows).sum::<u64>(),
        info.packed_samples
    );
    assert_eq!(info.shards.iter().map(|s| s.packs).sum::<u64>(), info.packs);
    for s in samples {
        assert_eq!(s.ids.len(), s.meta.llm_len as usize);
        for (m, im) in s.meta.images.iter().zip(&s.images) {
            // rgb8 at 32 x 32, placeholders are the template's image token (16 of them)
            assert_eq!(im.data.len(), 32 * 32 * 3);
            assert_eq!(m.llm_tokens, 16);
            let span = &s.ids[m.llm_offset as usize..(m.llm_offset + m.llm_tokens) as usize];
            assert!(span.iter().all(|&t| t == span[0]));
            assert!(
                s.loss_mask[m.llm_offset as usize..][..16]
                    .iter()
                    .all(|&b| b == 0)
            );
        }
        for (m, a) in s.meta.audio.iter().zip(&s.audio) {
            assert_eq!(a.data.len() / 2 / 160, m.mel_frames as usize);
        }
        assert!(s.loss_mask.contains(&1), "{} has no target", s.id);
    }
}

#[test]
fn jsonl_with_every_bad_case_keeps_every_good_sample() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let (manifest, good) = jsonl_good(&data, 48);
    let bad = append_bad_cases(&data, &manifest);
    let out = tmp.path().join("out");
    let info = pack(&manifest, Format::Jsonl, &out, &test_config());
    let (info2, samples) = all_samples(&out);
    assert_eq!(info, info2);
    check_counts(&info, &samples);

    let kept: BTreeSet<_> = samples.iter().map(|s| s.id.clone()).collect();
    assert_eq!(kept, good.iter().cloned().collect::<BTreeSet<_>>());
    let rej = rejects(&out);
    assert_eq!(rej.len(), bad.len(), "{rej:#?}");
    for b in &bad {
        let hit = rej
            .iter()
            .find(|r| r["id"] == json!(b) || r["source"] == json!(b));
        let r = hit.unwrap_or_else(|| panic!("{b} not in rejects.jsonl: {rej:#?}"));
        assert!(!r["reason"].as_str().unwrap().is_empty());
        assert!(r["stage"].is_string() && r["kind"].is_string());
    }
    let kind = |id: &str| {
        let r = rej.iter().find(|r| r["id"] == json!(id)).unwrap();
        format!(
            "{}/{}",
            r["stage"].as_str().unwrap(),
            r["kind"].as_str().unwrap()
        )
    };
    assert_eq!(kind("bad_bomb"), "media/too_many_pixels");
    assert!(kind("bad_truncated_png").starts_with("media/"));
    assert_eq!(kind("bad_no_assistant"), "tokenize/no_assistant_turn");
    assert!(
        kind("bad_long_audio").starts_with("media/too_long"),
        "{}",
        kind("bad_long_audio")
    );
    assert!(info.fill > 0.9, "fill {}", info.fill);
}

#[test]
fn output_is_identical_for_any_thread_count_and_verifies() {
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = jsonl_good(&tmp.path().join("data"), 40);
    let mut cfg = test_config();
    let a = pack(&manifest, Format::Jsonl, &tmp.path().join("a"), &cfg);
    cfg.shards.threads = 1;
    let b = pack(&manifest, Format::Jsonl, &tmp.path().join("b"), &cfg);
    assert_eq!(a.shards, b.shards);
    assert!(a.shards.len() == 1 && a.shards[0].sha256.len() == 64);
    a.verify_checksums(&tmp.path().join("a")).unwrap();
    // Flip one byte in the middle of the shard: the checksum names the file.
    let shard = tmp.path().join("a").join(&a.shards[0].file);
    let mut bytes = fs::read(&shard).unwrap();
    let mid = bytes.len() / 2;
    bytes[mid] ^= 0xff;
    fs::write(&shard, bytes).unwrap();
    let err = a
        .verify_checksums(&tmp.path().join("a"))
        .unwrap_err()
        .to_string();
    assert!(
        err.contains("checksum mismatch") && err.contains("shard-00000"),
        "{err}"
    );
}

#[test]
fn llava_wds_and_parquet_pack() {
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    let cfg = test_config();

    // LLaVA: an image root, `<image>` placeholders; one element has two placeholders for one image.
    fs::create_dir_all(d.join("llava/images")).unwrap();
    let mut elems = Vec::new();
    for i in 0..12 {
        fs::write(d.join(format!("llava/images/{i}.png")), png(50, 40, i)).unwrap();
        elems.push(
            json!({"id": format!("l{i}"), "image": format!("{i}.png"), "conversations": [
                {"from": "human", "value": "<image>\nDescribe."},
                {"from": "gpt", "value": "word ".repeat(3 + i as usize * 5)},
            ]}),
        );
    }
    elems.push(json!({"id": "l_bad", "image": "0.png", "conversations": [
        {"from": "human", "value": "<image><image>\nTwo?"}, {"from": "gpt", "value": "no"}]}));
    fs::write(
        d.join("llava/data.json"),
        serde_json::to_string(&elems).unwrap(),
    )
    .unwrap();
    let mut lcfg = cfg.clone();
    lcfg.input.image_root = Some(d.join("llava/images"));
    let info = pack(
        &d.join("llava/data.json"),
        Format::Llava,
        &d.join("out-llava"),
        &lcfg,
    );
    let (_, s) = all_samples(&d.join("out-llava"));
    check_counts(&info, &s);
    assert_eq!(
        (info.packed_samples, info.rejected, info.images),
        (12, 1, 12)
    );

    // WebDataset: png + txt, wav + txt, and a member named with `..`.
    let mut b = tar::Builder::new(Vec::new());
    let add = |b: &mut tar::Builder<Vec<u8>>, name: &str, data: &[u8]| {
        let mut h = tar::Header::new_gnu();
        h.set_size(data.len() as u64);
        h.set_mode(0o644);
        h.set_entry_type(tar::EntryType::Regular);
        h.as_gnu_mut().unwrap().name[..name.len()].copy_from_slice(name.as_bytes());
        h.set_cksum();
        b.append(&h, data).unwrap();
    };
    for i in 0..10u32 {
        if i % 2 == 0 {
            add(&mut b, &format!("w{i}.png"), &png(40, 40, i));
        } else {
            add(&mut b, &format!("w{i}.wav"), &wav(0.5, 16_000, 500.0));
        }
        add(
            &mut b,
            &format!("w{i}.txt"),
            format!("caption number {i}").as_bytes(),
        );
    }
    add(&mut b, "../evil.png", &png(40, 40, 0));
    add(&mut b, "../evil.txt", b"escape");
    fs::write(d.join("data.tar"), b.into_inner().unwrap()).unwrap();
    let info = pack(&d.join("data.tar"), Format::Wds, &d.join("out-wds"), &cfg);
    let (_, s) = all_samples(&d.join("out-wds"));
    check_counts(&info, &s);
    assert_eq!(
        (info.packed_samples, info.images, info.audio_clips),
        (10, 5, 5)
    );
    assert_eq!(
        info.rejected_by_kind.get("read/path_escape"),
        Some(&1),
        "{info:?}"
    );

    // Parquet exported by Hugging Face `datasets` (tests/fixtures/read, see read.rs).
    let fixture = Path::new(env!("CARGO_MANIFEST_DIR")).join("tests/fixtures/read/hf_chat.parquet");
    let mut pcfg = cfg.clone();
    pcfg.input.parquet.messages = Some("messages".into());
    pcfg.input.parquet.image = Some("images".into());
    let info = pack(&fixture, Format::Parquet, &d.join("out-parquet"), &pcfg);
    let (_, s) = all_samples(&d.join("out-parquet"));
    check_counts(&info, &s);
    assert_eq!((info.packed_samples, info.images), (2, 3));
}

#[test]
fn original_media_mode_and_overflow_and_nothing_valid() {
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = jsonl_good(&tmp.path().join("data"), 16);
    let mut cfg = test_config();
    cfg.shards.media = MediaStorage::Original;
    let info = pack(&manifest, Format::Jsonl, &tmp.path().join("orig"), &cfg);
    let (_, s) = all_samples(&tmp.path().join("orig"));
    assert_eq!(s.len(), 16);
    let img = s.iter().find(|s| !s.images.is_empty()).unwrap();
    assert_eq!(img.images[0].encoding.as_str(), "encoded");
    assert!(info.images > 0);

    // Rows of 64 tokens: longer samples are truncated (or rejected when that cuts an image).
    let mut short = test_config();
    short.pack.max_seq_len = 64;
    let info = pack(&manifest, Format::Jsonl, &tmp.path().join("short"), &short);
    let (_, s) = all_samples(&tmp.path().join("short"));
    check_counts(&info, &s);
    assert!(info.truncated > 0 && s.iter().all(|s| s.ids.len() <= 64));
    short.pack.on_overflow = braid_dataloader::pack::OnOverflow::Reject;
    // 15 of 16 samples are too long: above the default reject limit, allowed here.
    short.pack.max_reject_ratio = 1.0;
    let info = pack(&manifest, Format::Jsonl, &tmp.path().join("short2"), &short);
    assert!(
        info.rejected_by_kind.contains_key("pack/too_long"),
        "{info:?}"
    );

    // Nothing valid: an error naming rejects.jsonl, which lists every sample.
    let bad_dir = tmp.path().join("bad");
    fs::create_dir_all(&bad_dir).unwrap();
    fs::write(bad_dir.join("x.jsonl"), "{oops\n[]\n").unwrap();
    let job = PackJob {
        input: bad_dir.join("x.jsonl"),
        format: Format::Jsonl,
        output: tmp.path().join("none"),
        config: test_config(),
        overwrite: false,
    };
    let err = run_pack(&job, &mut |_| {}).unwrap_err();
    assert!(
        matches!(err, PackJobError::NothingValid { samples: 2, .. }),
        "{err}"
    );
    assert_eq!(rejects(&tmp.path().join("none")).len(), 2);
    assert!(!tmp.path().join("none/dataset.json").exists());

    // An existing dataset is replaced only on request; a foreign folder never.
    let again = PackJob {
        input: manifest.clone(),
        output: tmp.path().join("orig"),
        ..job.clone()
    };
    let err = run_pack(&again, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("--overwrite"), "{err}");
    fs::write(tmp.path().join("foreign.txt"), "mine").unwrap();
    let foreign = PackJob {
        input: manifest,
        output: tmp.path().to_path_buf(),
        overwrite: true,
        ..job
    };
    let err = run_pack(&foreign, &mut |_| {}).unwrap_err().to_string();
    assert!(err.contains("not a braid dataset"), "{err}");
    assert!(tmp.path().join("foreign.txt").exists());
}

/// `--overwrite` replaces a dataset only with a whole new one: a pack that fails (here,
/// nothing valid) leaves the old dataset as it was, verified; one that succeeds replaces
/// it, verified, with no staging left. A folder another pack holds is refused at once,
/// naming the reason, and packs once it is free.
#[test]
fn overwrite_replaces_only_on_success_and_a_held_folder_is_refused() {
    use braid_dataloader::job_output::{STAGING_DIR, lock_output, run_pack_locked};
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = jsonl_good(&tmp.path().join("data"), 12);
    let (other, _) = jsonl_good(&tmp.path().join("data2"), 20);
    let out = tmp.path().join("out");
    let job = PackJob {
        input: manifest,
        format: Format::Jsonl,
        output: out.clone(),
        config: test_config(),
        overwrite: true,
    };
    let first = run_pack_locked(&job, &mut |_| {}).unwrap();
    first.verify_checksums(&out).unwrap();

    let bad = tmp.path().join("bad.jsonl");
    fs::write(&bad, "{oops\n").unwrap();
    let failing = PackJob {
        input: bad,
        ..job.clone()
    };
    let err = run_pack_locked(&failing, &mut |_| {}).unwrap_err();
    assert!(matches!(err, PackJobError::NothingValid { .. }), "{err}");
    let (kept, _) = DatasetInfo::open(&out).unwrap();
    assert_eq!(kept.shards, first.shards, "the old dataset is untouched");
    kept.verify_checksums(&out).unwrap();
    assert!(!out.join(STAGING_DIR).exists());

    let replacing = PackJob {
        input: other,
        ..job.clone()
    };
    let second = run_pack_locked(&replacing, &mut |_| {}).unwrap();
    let (now, _) = DatasetInfo::open(&out).unwrap();
    assert_eq!(now.shards, second.shards);
    assert_ne!(now.shards, first.shards);
    assert_eq!(now.samples, 20);
    now.verify_checksums(&out).unwrap();
    assert!(!out.join(STAGING_DIR).exists());

    let held = lock_output(&out, false).unwrap();
    let err = run_pack_locked(&job, &mut |_| {}).unwrap_err().to_string();
    assert!(
        err.contains("another `braid pack`") && err.contains("out"),
        "{err}"
    );
    drop(held);
    run_pack_locked(&job, &mut |_| {}).unwrap();
}
