//! Input files that cannot be read to the end (truncated WebDataset shards, LLaVA files cut
//! mid-array): each is one reject however many records it lost, so `braid pack` holds them
//! to `pack.max_reject_ratio` as a share of the input files, names them in `dataset.json`,
//! and fails (removing its shards) when there are too many.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;
use std::path::Path;

use braid_dataloader::dataset::DatasetInfo;
use braid_dataloader::job::{PackJob, PackJobError, run_pack};
use braid_dataloader::read::Format;

use common::{rejects, test_config};

const SHARDS: usize = 4;
const PER_SHARD: usize = 6;

/// `SHARDS` WebDataset shards of `PER_SHARD` caption-only samples each.
fn shards(dir: &Path) {
    fs::create_dir_all(dir).unwrap();
    for s in 0..SHARDS {
        let mut b = tar::Builder::new(Vec::new());
        for i in 0..PER_SHARD {
            let caption = format!("shard {s} sample {i}: a caption long enough to pack");
            let mut h = tar::Header::new_gnu();
            h.set_size(caption.len() as u64);
            h.set_mode(0o644);
            h.set_cksum();
            b.append_data(&mut h, format!("s{s}k{i}.txt"), caption.as_bytes())
                .unwrap();
        }
        fs::write(dir.join(format!("shard-{s}.tar")), b.into_inner().unwrap()).unwrap();
    }
}

/// Cuts shard `s` inside its fourth sample (each member: a 512-byte header and one block).
fn truncate(dir: &Path, s: usize) {
    let path = dir.join(format!("shard-{s}.tar"));
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..3 * 1024 + 700]).unwrap();
}

fn pack(input: &Path, format: Format, out: &Path, ratio: f64) -> Result<DatasetInfo, PackJobError> {
    let mut config = test_config();
    config.pack.max_reject_ratio = ratio;
    let job = PackJob {
        input: input.to_path_buf(),
        format,
        output: out.to_path_buf(),
        config,
        overwrite: true,
    };
    run_pack(&job, &mut |_| {})
}

fn damaged_rejects(out: &Path) -> Vec<String> {
    rejects(out)
        .iter()
        .filter(|r| r["kind"] == "damaged_file")
        .map(|r| r["damaged_file"].as_str().unwrap().to_string())
        .collect()
}

fn name_of(dir: &Path, s: usize) -> String {
    dir.join(format!("shard-{s}.tar")).display().to_string()
}

#[test]
fn one_truncated_shard_of_four_is_named_and_what_it_held_before_the_cut_is_kept() {
    let tmp = tempfile::tempdir().unwrap();
    let (input, out) = (tmp.path().join("in"), tmp.path().join("out"));
    shards(&input);
    truncate(&input, 2);
    let info = pack(&input, Format::Wds, &out, 0.5).unwrap();
    assert_eq!(info.damaged_files, vec![name_of(&input, 2)]);
    assert_eq!(damaged_rejects(&out), vec![name_of(&input, 2)]);
    assert_eq!(info.rejected_by_kind.get("read/damaged_file"), Some(&1));
    // Three whole shards and the three samples before the cut; the fourth is cut inside.
    assert_eq!(info.packed_samples as usize, 3 * PER_SHARD + 3);
    // The file list survives a read back.
    assert_eq!(
        DatasetInfo::read(&out).unwrap().damaged_files,
        info.damaged_files
    );
}

#[test]
fn more_damaged_files_than_the_ratio_allows_fail_and_leave_no_dataset() {
    for (damaged, ratio, fails) in [
        (&[1usize, 2, 3][..], 0.5, true),
        (&[0, 3], 0.5, false), // 2 of 4 is not above one half
        (&[0, 3], 0.25, true),
        (&[1, 2, 3], 1.0, false),
        (&[0, 1, 2, 3], 0.9, true),
    ] {
        let tmp = tempfile::tempdir().unwrap();
        let (input, out) = (tmp.path().join("in"), tmp.path().join("out"));
        shards(&input);
        for &s in damaged {
            truncate(&input, s);
        }
        let case = format!("{damaged:?} at ratio {ratio}");
        match pack(&input, Format::Wds, &out, ratio) {
            Err(PackJobError::TooManyDamagedFiles {
                damaged: names,
                files,
                ..
            }) if fails => {
                assert_eq!(files, SHARDS, "{case}");
                let want: Vec<String> = damaged.iter().map(|&s| name_of(&input, s)).collect();
                assert_eq!(names, want, "{case}");
                let msg = PackJobError::TooManyDamagedFiles {
                    damaged: names,
                    files,
                    max_ratio: ratio,
                    rejects: "rejects.jsonl".into(),
                }
                .to_string();
                assert!(
                    msg.contains(&format!("{} of {SHARDS} input files", damaged.len()))
                        && msg.contains("max_reject_ratio")
                        && msg.contains(&name_of(&input, damaged[0])),
                    "{case}: {msg}"
                );
                // No shards and no dataset.json: a failed pack is not a dataset.
                let left: Vec<_> = fs::read_dir(&out)
                    .unwrap()
                    .map(|e| e.unwrap().file_name().into_string().unwrap())
                    .filter(|n| n.ends_with(".parquet") || n == "dataset.json")
                    .collect();
                assert!(left.is_empty(), "{case}: {left:?}");
                assert_eq!(damaged_rejects(&out).len(), damaged.len(), "{case}");
            }
            Ok(info) if !fails => {
                assert_eq!(info.damaged_files.len(), damaged.len(), "{case}");
            }
            other => panic!("{case}: {other:?}"),
        }
    }
}

#[test]
fn a_llava_file_cut_mid_array_is_a_damaged_input() {
    let tmp = tempfile::tempdir().unwrap();
    let elements: Vec<String> = (0..8)
        .map(|i| {
            format!(
                r#"{{"id": "r{i}", "conversations": [{{"from": "human", "value": "question {i}"}}, {{"from": "gpt", "value": "answer {i}"}}]}}"#
            )
        })
        .collect();
    let whole = format!("[{}]", elements.join(",\n"));
    let cut = &whole[..whole.len() * 2 / 3];
    let path = tmp.path().join("llava.json");
    fs::write(&path, cut).unwrap();
    // The only input file lost its end: above any ratio below 1.
    let out = tmp.path().join("out");
    match pack(&path, Format::Llava, &out, 0.5) {
        Err(PackJobError::TooManyDamagedFiles { damaged, files, .. }) => {
            assert_eq!((damaged, files), (vec![path.display().to_string()], 1));
        }
        other => panic!("{other:?}"),
    }
    let info = pack(&path, Format::Llava, &out, 1.0).unwrap();
    assert_eq!(info.damaged_files, vec![path.display().to_string()]);
    assert!(info.packed_samples >= 4, "{info:?}");
}

/// The only input file unreadable from its first byte (a tar cut inside its first
/// header): nothing to pack, and the error names the file as unreadable instead of
/// counting it as one rejected sample.
#[test]
fn an_input_unreadable_from_the_start_is_named_when_nothing_is_left() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path().join("wds");
    shards(&dir);
    for s in 1..SHARDS {
        fs::remove_file(dir.join(format!("shard-{s}.tar"))).unwrap();
    }
    let path = dir.join("shard-0.tar");
    let bytes = fs::read(&path).unwrap();
    fs::write(&path, &bytes[..100]).unwrap();
    let err = pack(&dir, Format::Wds, &tmp.path().join("out"), 1.0).unwrap_err();
    let text = err.to_string();
    assert!(
        matches!(&err, PackJobError::NothingValid { damaged, .. } if damaged.len() == 1),
        "{err:?}"
    );
    assert!(
        text.contains("1 input file could not be read") && text.contains("shard-0.tar"),
        "{text}"
    );
}

/// A `dataset.json` that is a device or a FIFO (a symlink to /dev/zero) is refused at
/// once, naming it, instead of being read without end.
#[cfg(unix)]
#[test]
fn a_dataset_json_that_is_a_device_or_fifo_is_refused_at_once() {
    let tmp = tempfile::tempdir().unwrap();
    let zero = tmp.path().join("zero");
    std::fs::create_dir_all(&zero).unwrap();
    std::os::unix::fs::symlink("/dev/zero", zero.join("dataset.json")).unwrap();
    let fifo = tmp.path().join("fifo");
    std::fs::create_dir_all(&fifo).unwrap();
    let made = std::process::Command::new("mkfifo")
        .arg(fifo.join("dataset.json"))
        .status()
        .unwrap();
    assert!(made.success());
    for dir in [&zero, &fifo] {
        let e = DatasetInfo::read(dir).unwrap_err().to_string();
        assert!(
            e.contains("dataset.json") && e.contains("not a regular file"),
            "{e}"
        );
    }
}

/// A `dataset.json` edited to a smaller vocabulary than its shards' ids (or 0): reading a
/// pack names the shard, the sample and the id, instead of an out-of-range id surfacing
/// in a training step; 0 is refused when the file is read.
#[test]
fn token_ids_past_dataset_json_vocabulary_are_named() {
    let tmp = tempfile::tempdir().unwrap();
    let (input, out) = (tmp.path().join("in"), tmp.path().join("out"));
    shards(&input);
    pack(&input, Format::Wds, &out, 0.5).unwrap();
    let (_, ds) = DatasetInfo::open(&out).unwrap();
    ds.read_pack(0).unwrap();
    let json = out.join("dataset.json");
    let mut v: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(&json).unwrap()).unwrap();
    for (vocab, says) in [
        (3, "past the tokenizer's vocabulary of 3"),
        (0, "vocab_size is 0"),
    ] {
        v["tokenizer"]["vocab_size"] = serde_json::json!(vocab);
        fs::write(&json, serde_json::to_string_pretty(&v).unwrap()).unwrap();
        let e = match DatasetInfo::open(&out) {
            Ok((_, ds)) => ds.read_pack(0).unwrap_err().to_string(),
            Err(e) => e.to_string(),
        };
        assert!(e.contains(says), "{vocab}: {e}");
    }
}
