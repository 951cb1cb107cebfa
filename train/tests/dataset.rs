//! A dataset made on first use (`data.build`): runs that start on it at once each get the
//! whole dataset, never another's half-written shards, also over a killed pack's
//! leftovers and through a symlinked folder; a folder holding the user's own files is
//! refused untouched.
#![allow(clippy::unwrap_used)]

use std::path::{Path, PathBuf};

use braid_dataloader::demo::{DemoConfig, write_demo};
use braid_train::data::{Prepared, ensure_dataset};

/// A demo input and its data config in a fresh folder.
fn input(tag: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-dataset-{tag}-{}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    std::fs::create_dir_all(&dir).unwrap();
    let demo = DemoConfig {
        train: 40,
        heldout: 2,
        ..DemoConfig::default()
    };
    write_demo(&dir.join("demo"), &demo).unwrap();
    std::fs::write(
        dir.join("data.toml"),
        format!(
            "[input]\npath = \"{}/demo/train.jsonl\"\nformat = \"jsonl\"\n[image]\npreset = \"siglip\"\nsize = 32\npatch = 8\n[audio]\npool_stride = 4\n[pack]\nmax_seq_len = 160\n",
            dir.display()
        ),
    )
    .unwrap();
    dir
}

fn make(dir: &Path) -> braid_train::error::Result<(u64, Prepared)> {
    let (info, how) = ensure_dataset(
        &dir.join("packed"),
        Some(&dir.join("data.toml")),
        None,
        None,
        &mut |_| {},
    )?;
    Ok((info.packed_samples, how))
}

/// What a packed folder holds besides a dataset's own files (shards, `dataset.json`,
/// rejects, the tokenizer's copies, the lock).
fn strays(packed: &Path) -> Vec<String> {
    std::fs::read_dir(packed)
        .unwrap()
        .map(|e| e.unwrap().file_name().to_string_lossy().to_string())
        .filter(|n| {
            !(n.starts_with("shard-") && n.ends_with(".parquet")
                || n == "dataset.json"
                || n == "rejects.jsonl"
                || n == ".pack.lock"
                || n.starts_with("tokenizer"))
        })
        .collect()
}

/// Six starters at once on `dir`'s dataset: each gets the whole of it, and one packed it.
fn race(dir: &Path) -> u64 {
    let got: Vec<(u64, Prepared)> = std::thread::scope(|s| {
        let hs: Vec<_> = (0..6).map(|_| s.spawn(|| make(dir).unwrap())).collect();
        hs.into_iter().map(|h| h.join().unwrap()).collect()
    });
    let samples = got[0].0;
    assert!(samples > 0);
    assert!(got.iter().all(|g| g.0 == samples), "{got:?}");
    let packed = got.iter().filter(|g| g.1 == Prepared::Packed).count();
    assert_eq!(packed, 1, "{got:?}");
    samples
}

#[test]
fn runs_starting_at_once_each_get_the_whole_dataset() {
    let dir = input("race");
    let samples = race(&dir);
    assert!(strays(&dir.join("packed")).is_empty());
    // What is in place reads back whole: the next start finds it.
    assert_eq!(make(&dir).unwrap(), (samples, Prepared::Existing));

    // The same over a killed pack's leftovers.
    let dir = input("left");
    let packed = dir.join("packed");
    std::fs::create_dir_all(&packed).unwrap();
    std::fs::write(packed.join("shard-00000.parquet"), b"torn").unwrap();
    std::fs::write(packed.join(".staging.bin"), b"torn").unwrap();
    assert_eq!(race(&dir), samples);
    assert!(strays(&packed).is_empty(), "{:?}", strays(&packed));
}

#[test]
fn a_symlinked_folder_is_packed_where_it_points_and_the_users_files_are_kept() {
    let dir = input("link");
    let target = dir.join("elsewhere");
    std::fs::create_dir_all(&target).unwrap();
    std::os::unix::fs::symlink(&target, dir.join("packed")).unwrap();
    let (samples, how) = make(&dir).unwrap();
    assert!(samples > 0 && how == Prepared::Packed);
    assert!(target.join("dataset.json").is_file());
    assert!(dir.join("packed").is_symlink());

    let dir = input("mine");
    let packed = dir.join("packed");
    std::fs::create_dir_all(&packed).unwrap();
    std::fs::write(packed.join("notes.txt"), b"mine").unwrap();
    let e = make(&dir).unwrap_err().to_string();
    assert!(e.contains("notes.txt"), "{e}");
    assert_eq!(std::fs::read(packed.join("notes.txt")).unwrap(), b"mine");
    // Nothing added either.
    assert_eq!(std::fs::read_dir(&packed).unwrap().count(), 1);
}
