//! `braid demo-data` end to end: writes the dataset, refuses a non-empty folder without
//! `--force`, and fails clearly when the output cannot be a folder.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use std::path::PathBuf;
mod common;
use common::braid;

fn scratch(name: &str) -> PathBuf {
    let dir = std::env::temp_dir().join(format!("braid-demo-{}-{name}", std::process::id()));
    let _ = std::fs::remove_dir_all(&dir);
    dir
}

fn lines(path: &std::path::Path) -> usize {
    std::fs::read_to_string(path).unwrap().lines().count()
}

#[test]
fn demo_data_writes_then_needs_force() {
    let dir = scratch("ok");
    let out = dir.to_str().unwrap();
    let args = [
        "demo-data",
        "--output",
        out,
        "--train",
        "12",
        "--heldout",
        "4",
        "--seed",
        "3",
    ];
    let res = braid(&args);
    let stdout = String::from_utf8_lossy(&res.stdout);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert_eq!(stdout.lines().count(), 1, "{stdout}");
    assert!(stdout.contains("12 train + 4 heldout"), "{stdout}");
    assert_eq!(lines(&dir.join("train.jsonl")), 12);
    assert_eq!(lines(&dir.join("heldout.jsonl")), 4);
    assert!(dir.join("README.md").is_file());
    let first = std::fs::read(dir.join("train.jsonl")).unwrap();

    // Non-empty: refused, nothing changed.
    let res = braid(&args);
    let stderr = String::from_utf8_lossy(&res.stderr);
    assert!(!res.status.success());
    assert!(
        stderr.contains("not empty") && stderr.contains("--force"),
        "{stderr}"
    );

    // --force: rewritten, identical for the same seed.
    let mut forced = args.to_vec();
    forced.push("--force");
    let res = braid(&forced);
    assert!(
        res.status.success(),
        "{}",
        String::from_utf8_lossy(&res.stderr)
    );
    assert_eq!(std::fs::read(dir.join("train.jsonl")).unwrap(), first);
    std::fs::remove_dir_all(&dir).unwrap();
}

#[test]
fn demo_data_fails_clearly_on_unwritable_output() {
    let dir = scratch("bad");
    std::fs::create_dir_all(&dir).unwrap();
    let file = dir.join("a-file");
    std::fs::write(&file, b"x").unwrap();
    for target in [file.clone(), file.join("below")] {
        let res = braid(&[
            "demo-data",
            "--output",
            target.to_str().unwrap(),
            "--train",
            "2",
        ]);
        let stderr = String::from_utf8_lossy(&res.stderr);
        assert!(!res.status.success(), "{}", target.display());
        assert!(
            stderr.contains("braid demo-data: error:") && stderr.contains("a-file"),
            "{stderr}"
        );
    }
    let res = braid(&[
        "demo-data",
        "--output",
        dir.join("x").to_str().unwrap(),
        "--train",
        "0",
    ]);
    assert!(!res.status.success());
    assert!(String::from_utf8_lossy(&res.stderr).contains("train"));
    std::fs::remove_dir_all(&dir).unwrap();
}
