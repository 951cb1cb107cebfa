//! What stops `braid pack` before it writes a wrong dataset: template tokens the tokenizer lacks
//! (checked before any data is read), `pack.max_reject_ratio`, media roots and symlinks, and
//! the leftovers of a killed pack.
#![allow(clippy::unwrap_used)]

mod common;

use std::fs;
use std::path::{Path, PathBuf};

use braid_dataloader::config::DataConfig;
use braid_dataloader::job::{PackJob, PackJobError, run_pack};
use braid_dataloader::read::Format;
use braid_dataloader::tokenize::ChatTemplate;
use common::tokenize_util::fixture;
use common::*;
use serde_json::{Value, json};

fn job(input: &Path, format: Format, out: &Path, cfg: &DataConfig, overwrite: bool) -> PackJob {
    PackJob {
        input: input.to_path_buf(),
        format,
        output: out.to_path_buf(),
        config: cfg.clone(),
        overwrite,
    }
}

/// `tiny_bpe.json` without the given added tokens: a small stand-in for a real vocabulary
/// that lacks Braid's default `<|image|>` / `<|audio|>` (and, like Qwen3's, any audio token).
fn tokenizer_without(dir: &Path, drop: &[&str]) -> PathBuf {
    let mut t: Value =
        serde_json::from_str(&fs::read_to_string(fixture("tiny_bpe.json")).unwrap()).unwrap();
    let added = t["added_tokens"].as_array_mut().unwrap();
    added.retain(|a| !drop.contains(&a["content"].as_str().unwrap()));
    let path = dir.join("tokenizer.json");
    fs::write(&path, serde_json::to_string(&t).unwrap()).unwrap();
    path
}

const QWEN3_LIKE_DROPS: &[&str] = &[
    "<|image|>",
    "<|audio|>",
    "<|audio_start|>",
    "<|audio_end|>",
    "<|audio_pad|>",
];

#[test]
fn missing_template_tokens_fail_before_reading_and_name_a_working_choice() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let (manifest, _) = jsonl_good(&data, 8);
    let mut cfg = test_config();
    cfg.tokenizer.path = Some(tokenizer_without(tmp.path(), QWEN3_LIKE_DROPS));
    let out = tmp.path().join("out");
    let err = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    for w in [
        "is not a single token of",
        "[template.image] pad = \"<|image|>\"",
        "pad = \"<|image_pad|>\", begin = \"<|vision_start|>\", end = \"<|vision_end|>\"",
    ] {
        assert!(err.contains(w), "{err}\nlacks {w}");
    }
    assert!(!out.exists(), "nothing may be written before the check");

    // With Qwen2-VL's image tokens the image side passes; audio has no known tokens here.
    cfg.template = ChatTemplate::qwen2_vl();
    let err = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("[template.audio]")
            && err.contains("no audio tokens")
            && err.contains("audio = false"),
        "{err}"
    );
    // `audio = false` (as the TOML says it): audio samples are rejected, images packed.
    let toml = "[template]\naudio = false\n[template.image]\npad = \"<|image_pad|>\"\nbegin = \"<|vision_start|>\"\nend = \"<|vision_end|>\"\n";
    let parsed = DataConfig::from_toml(toml, "t.toml").unwrap();
    assert!(parsed.template.audio.is_none());
    cfg.template = parsed.template;
    cfg.pack.max_reject_ratio = 1.0;
    let info = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap();
    assert!(info.images > 0 && info.audio_clips == 0, "{info:?}");
    assert!(info.rejected > 0);
    // `false` round-trips through dataset.json.
    let (again, _) = braid_dataloader::dataset::DatasetInfo::open(&out).unwrap();
    assert!(again.settings.template.audio.is_none());
}

/// The real Qwen3 `tokenizer.json` (11 MB, not committed): only where `../shared` has it.
#[test]
fn qwen3_tokenizer_needs_qwen_vision_tokens_and_has_no_audio_tokens() {
    let qwen3 = Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../../shared/data/tokenizers/qwen3/tokenizer.json");
    if !qwen3.is_file() {
        println!(
            "SKIPPED: no Qwen3 tokenizer.json beside the repo ({})",
            qwen3.display()
        );
        return;
    }
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = jsonl_good(&tmp.path().join("data"), 8);
    let mut cfg = test_config();
    cfg.tokenizer.path = Some(qwen3);
    let out = tmp.path().join("out");
    let err = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(
        err.contains("<|image_pad|>") && err.contains("<|vision_start|>"),
        "{err}"
    );
    cfg.template = ChatTemplate::qwen2_vl();
    let err = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("no audio tokens"), "{err}");
    cfg.template.audio = None;
    cfg.pack.max_reject_ratio = 1.0;
    let info = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap();
    assert!(
        info.images > 0 && info.tokenizer.vocab_size > 151_000,
        "{info:?}"
    );
    // Each image: <|vision_start|> (151652), <|image_pad|> (151655) x N, <|vision_end|> (151653).
    let (_, ds) = braid_dataloader::dataset::DatasetInfo::open(&out).unwrap();
    let mut seen = 0;
    for p in 0..ds.packs().len() {
        for s in ds.read_pack(p).unwrap() {
            for m in &s.meta.images {
                let (at, n) = (m.llm_offset as usize, m.llm_tokens as usize);
                assert_eq!(s.ids[at - 1], 151_652);
                assert!(s.ids[at..at + n].iter().all(|&t| t == 151_655));
                assert_eq!(s.ids[at + n], 151_653);
                seen += 1;
            }
        }
    }
    assert_eq!(seen, info.images);
}

#[test]
fn too_many_rejects_fail_with_the_breakdown_and_leave_no_dataset() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("data");
    let (manifest, _) = jsonl_good(&data, 4);
    let bad = append_bad_cases(&data, &manifest);
    assert!(bad.len() > 4);
    let out = tmp.path().join("out");
    let cfg = test_config();
    assert_eq!(cfg.pack.max_reject_ratio, 0.5);
    let err = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap_err();
    let PackJobError::TooManyRejects {
        rejected,
        samples,
        by_kind,
        ..
    } = &err
    else {
        panic!("{err}");
    };
    assert_eq!(*rejected as usize, bad.len());
    assert_eq!(*samples as usize, bad.len() + 4);
    assert_eq!(by_kind.values().sum::<u64>(), *rejected);
    let msg = err.to_string();
    assert!(
        msg.contains("max_reject_ratio = 0.5") && msg.contains("media/too_many_pixels 1"),
        "{msg}"
    );
    // No dataset: no dataset.json, no shards; rejects.jsonl stays to say why.
    let names: Vec<String> = fs::read_dir(&out)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().into_owned())
        .collect();
    assert_eq!(names, ["rejects.jsonl"], "{names:?}");
    assert_eq!(rejects(&out).len(), bad.len());

    // The rerun into the same folder (no --overwrite: there is no dataset) with a higher limit.
    let mut cfg = cfg;
    cfg.pack.max_reject_ratio = 1.0;
    let info = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(info.packed_samples, 4);

    // The key is validated by name.
    cfg.pack.max_reject_ratio = 1.5;
    let err = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, true),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("max_reject_ratio"), "{err}");
    let err = DataConfig::from_toml("[pack]\nmax_reject_ratio = -0.1\n", "x.toml")
        .unwrap()
        .validate()
        .unwrap_err()
        .to_string();
    assert!(err.contains("max_reject_ratio"), "{err}");
}

#[test]
fn leftovers_of_a_killed_pack_are_cleaned_but_user_files_are_refused() {
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, good) = jsonl_good(&tmp.path().join("data"), 6);
    let out = tmp.path().join("out");
    fs::create_dir_all(&out).unwrap();
    // What a pack killed mid-way leaves: rejects, staging, a shard in progress, no dataset.json.
    fs::write(out.join("rejects.jsonl"), "{\"id\": \"old\"}\n").unwrap();
    fs::write(out.join(".staging.bin"), vec![7u8; 4096]).unwrap();
    fs::write(out.join("shard-00000.parquet.tmp"), b"half a shard").unwrap();
    fs::write(out.join("shard-00001.parquet"), b"an old shard").unwrap();
    let cfg = test_config();
    let info = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!(info.packed_samples as usize, good.len());
    assert!(!out.join(".staging.bin").exists());
    assert!(!out.join("shard-00000.parquet.tmp").exists());
    assert!(rejects(&out).is_empty(), "the old rejects were replaced");
    info.verify_checksums(&out).unwrap();

    // A real dataset is still protected without --overwrite.
    let err = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("already holds a packed dataset"), "{err}");

    // A folder with a file the pack did not write is refused, and the file survives.
    let mixed = tmp.path().join("mixed");
    fs::create_dir_all(&mixed).unwrap();
    fs::write(mixed.join(".staging.bin"), b"x").unwrap();
    fs::write(mixed.join("notes.txt"), b"mine").unwrap();
    for overwrite in [false, true] {
        let err = run_pack(
            &job(&manifest, Format::Jsonl, &mixed, &cfg, overwrite),
            &mut |_| {},
        )
        .unwrap_err()
        .to_string();
        assert!(
            err.contains("did not write") && err.contains("notes.txt"),
            "{err}"
        );
    }
    assert_eq!(fs::read(mixed.join("notes.txt")).unwrap(), b"mine");
    assert!(mixed.join(".staging.bin").exists());
}

/// A dataset whose media folder is a symlink into another tree (a cluster file system).
#[cfg(unix)]
#[test]
fn media_roots_trust_linked_folders_and_still_refuse_links_out() {
    let tmp = tempfile::tempdir().unwrap();
    let store = tmp.path().join("lustre/images");
    let elsewhere = tmp.path().join("elsewhere");
    fs::create_dir_all(&store).unwrap();
    fs::create_dir_all(&elsewhere).unwrap();
    fs::write(store.join("a.png"), png(40, 40, 1)).unwrap();
    fs::write(store.join("b.png"), png(36, 44, 2)).unwrap();
    fs::write(elsewhere.join("c.png"), png(40, 40, 3)).unwrap();
    let data = tmp.path().join("data");
    fs::create_dir_all(&data).unwrap();
    std::os::unix::fs::symlink(&store, data.join("images")).unwrap();
    std::os::unix::fs::symlink(elsewhere.join("c.png"), store.join("c-link.png")).unwrap();
    let rec = |id: &str, path: &str| {
        json!({"id": id, "messages": [
            {"role": "user", "content": [{"type": "image", "path": path}, {"type": "text", "text": "?"}]},
            {"role": "assistant", "content": "an image"}]})
        .to_string()
    };
    let manifest = data.join("train.jsonl");
    fs::write(
        &manifest,
        [
            rec("linked_a", "images/a.png"),
            rec("linked_b", "images/b.png"),
            rec("bare_name", "a.png"),
            rec("link_out", "images/c-link.png"),
            rec("text", "images/a.png"),
        ]
        .join("\n"),
    )
    .unwrap();
    let mut cfg = test_config();
    cfg.pack.max_reject_ratio = 1.0;
    // Default: the linked folder points outside the manifest's folder: every image refused.
    let out = tmp.path().join("out0");
    let info = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap_err();
    assert!(matches!(info, PackJobError::NothingValid { .. }), "{info}");
    assert!(
        rejects(&out).iter().any(
            |r| r["id"] == "linked_a" && r["reason"].as_str().unwrap().contains("--media-root")
        ),
        "{:#?}",
        rejects(&out)
    );
    // Trusting the store: linked paths and bare names in the store are read; the link out of
    // every trusted root is still a path-escape reject.
    cfg.input.media_roots = vec![store.clone()];
    let out = tmp.path().join("out1");
    let info = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap();
    assert_eq!((info.packed_samples, info.images, info.rejected), (4, 4, 1));
    let rej = rejects(&out);
    assert_eq!(rej[0]["id"], "link_out");
    assert!(
        rej[0]["reason"].as_str().unwrap().contains("outside"),
        "{rej:#?}"
    );

    // A media root that does not exist is an error up front, not thousands of rejects.
    cfg.input.media_roots = vec![tmp.path().join("typo")];
    let err = run_pack(
        &job(
            &manifest,
            Format::Jsonl,
            &tmp.path().join("out2"),
            &cfg,
            false,
        ),
        &mut |_| {},
    )
    .unwrap_err()
    .to_string();
    assert!(err.contains("media root") && err.contains("typo"), "{err}");
}

/// The dataset's fingerprint (what the ranks of a world compare): two packs of the same
/// input with the same settings agree, and a dataset whose shards differ does not.
#[test]
fn the_fingerprint_is_the_same_for_the_same_pack_and_differs_otherwise() {
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = jsonl_good(&tmp.path().join("data"), 6);
    let cfg = test_config();
    let pack = |name: &str| {
        let out = tmp.path().join(name);
        run_pack(
            &job(&manifest, Format::Jsonl, &out, &cfg, false),
            &mut |_| {},
        )
        .unwrap()
    };
    let (a, b) = (pack("a"), pack("b"));
    assert_eq!(a.fingerprint().len(), 64);
    assert_eq!(a.fingerprint(), b.fingerprint());
    let mut c = b.clone();
    c.shards[0].sha256 = "0".repeat(64);
    assert_ne!(a.fingerprint(), c.fingerprint());
    let mut d = b;
    d.shards[0].packs += 1;
    assert_ne!(a.fingerprint(), d.fingerprint());
}

/// A `dataset.json` whose shard or tokenizer file names leave the dataset's folder (`..`,
/// an absolute path such as `/dev/zero`) is refused when read, and a shard that is not a regular file (a
/// FIFO: opening it would block forever) is refused before it is opened, by the pack
/// index and by the checksum pass alike.
#[cfg(unix)]
#[test]
fn shard_names_stay_in_the_dataset_folder_and_shards_are_regular_files() {
    use braid_dataloader::dataset::DatasetInfo;
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = jsonl_good(&tmp.path().join("data"), 6);
    let out = tmp.path().join("out");
    let cfg = test_config();
    let info = run_pack(
        &job(&manifest, Format::Jsonl, &out, &cfg, false),
        &mut |_| {},
    )
    .unwrap();
    let first = info.shards[0].file.clone();
    let meta: Value =
        serde_json::from_str(&fs::read_to_string(out.join("dataset.json")).unwrap()).unwrap();
    for name in [
        "/dev/zero".to_string(),
        format!("../out/{first}"),
        format!("sub/{first}"),
        "..".to_string(),
        String::new(),
    ] {
        let mut m = meta.clone();
        m["shards"][0]["file"] = json!(name);
        fs::write(out.join("dataset.json"), serde_json::to_string(&m).unwrap()).unwrap();
        let err = DatasetInfo::open(&out).unwrap_err().to_string();
        assert!(
            err.contains("shards[0].file") && err.contains("not a file name inside"),
            "{name:?}: {err}"
        );
    }
    // The tokenizer's copied files likewise: a checkpoint copies them, an export writes them.
    for name in ["../secret.txt", "/dev/zero"] {
        let mut m = meta.clone();
        m["tokenizer"]["files"] = json!(["tokenizer.json", name]);
        fs::write(out.join("dataset.json"), serde_json::to_string(&m).unwrap()).unwrap();
        let err = DatasetInfo::open(&out).unwrap_err().to_string();
        assert!(err.contains("tokenizer.files[1]"), "{name:?}: {err}");
    }
    fs::write(
        out.join("dataset.json"),
        serde_json::to_string(&meta).unwrap(),
    )
    .unwrap();
    DatasetInfo::open(&out).unwrap();

    // The shard replaced by a FIFO (nothing ever writes to it) and by a folder: both
    // readers answer at once, naming the shard.
    let shard = out.join(&first);
    fs::remove_file(&shard).unwrap();
    let status = std::process::Command::new("mkfifo")
        .arg(&shard)
        .status()
        .unwrap();
    assert!(status.success());
    let err = DatasetInfo::open(&out).unwrap_err().to_string();
    assert!(
        err.contains(&first) && err.contains("not a regular file"),
        "{err}"
    );
    let err = info.verify_checksums(&out).unwrap_err().to_string();
    assert!(
        err.contains(&first) && err.contains("not a regular file"),
        "{err}"
    );
    fs::remove_file(&shard).unwrap();
    fs::create_dir(&shard).unwrap();
    let err = info.verify_checksums(&out).unwrap_err().to_string();
    assert!(err.contains("not a regular file"), "{err}");
}
