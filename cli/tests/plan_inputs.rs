//! `braid plan` on bad input: flags, configs and values with no meaning exit 2 naming the
//! fix, and outputs that could not be written, or would replace an input, are refused
//! before anything is written.
#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

mod common;
use common::braid_at_root as braid;

#[test]
fn bad_input_exits_2_naming_the_fix() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.toml");
    let out = out.to_str().unwrap();
    for (args, says) in [
        (
            vec!["plan", "--config", "configs/tiny.toml", "--out", out],
            "--gpus",
        ),
        (
            vec![
                "plan",
                "--config",
                "configs/tiny.toml",
                "--gpus",
                "4",
                "--out",
                out,
            ],
            "[plan.mix]",
        ),
        (
            vec![
                "plan",
                "--config",
                "configs/plan-7b.toml",
                "--gpus",
                "8",
                "--cluster",
                "b200",
                "--out",
                out,
            ],
            "not a preset",
        ),
        (
            vec![
                "plan",
                "--config",
                "configs/plan-7b.toml",
                "--gpus",
                "8",
                "--schedule",
                "zigzag",
                "--out",
                out,
            ],
            "--schedule",
        ),
        (
            vec![
                "plan",
                "--config",
                "configs/plan-7b.toml",
                "--gpus",
                "8",
                "--set",
                "plan.seq_len=576",
                "--out",
                out,
            ],
            "one image is 576 LLM tokens",
        ),
        (
            vec![
                "plan",
                "--config",
                "configs/plan-7b.toml",
                "--gpus",
                "0",
                "--out",
                out,
            ],
            "must be at least 1",
        ),
    ] {
        let res = braid(&args);
        assert_eq!(res.status.code(), Some(2), "{args:?}");
        let err = String::from_utf8_lossy(&res.stderr);
        assert!(err.contains(says), "{args:?}: {err}");
    }
}

/// Outputs that cannot be written, or would overwrite the config or each other, are
/// refused before the search, and nothing is written.
#[test]
fn bad_outputs_are_refused_before_anything_is_written() {
    let dir = tempfile::tempdir().unwrap();
    let d = |name: &str| dir.path().join(name).to_str().unwrap().to_string();
    let config = d("plan-7b.toml");
    std::fs::copy(
        concat!(env!("CARGO_MANIFEST_DIR"), "/../configs/plan-7b.toml"),
        &config,
    )
    .unwrap();
    std::fs::write(d("a-file"), b"x").unwrap();
    let (plan, trace) = (d("plan.toml"), d("trace.json"));
    let same_plan = format!("{}/./plan.toml", dir.path().display());
    let in_missing = d("missing/trace.json");
    let under_file = d("a-file/trace.json");
    let folder = dir.path().to_str().unwrap().to_string();
    let cluster = d("cluster.toml");
    let h100 = braid_balancer::cluster::Cluster::preset("h100").unwrap();
    std::fs::write(&cluster, h100.to_toml().unwrap()).unwrap();
    for (extra, says) in [
        (vec!["--out", &plan, "--trace", &in_missing], "--trace"),
        (vec!["--out", &plan, "--trace", &under_file], "not a folder"),
        (vec!["--out", &folder], "a folder"),
        (
            vec!["--out", &plan, "--trace", &same_plan],
            "same file as --out",
        ),
        (
            vec!["--out", &plan, "--baseline-out", &trace, "--trace", &trace],
            "same file as --baseline-out",
        ),
        (vec!["--out", &config], "the config itself"),
        (
            vec!["--out", &plan, "--cluster", &cluster, "--trace", &cluster],
            "the cluster file",
        ),
        (vec!["--check", "9223372036854775808"], "--check"),
    ] {
        let mut args = vec!["plan", "--config", &config, "--gpus", "64"];
        args.extend_from_slice(&extra);
        let res = braid(&args);
        let err = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{extra:?}: {err}");
        assert!(err.contains(says), "{extra:?}: {err}");
        assert!(
            !Path::new(&plan).exists() && !Path::new(&trace).exists(),
            "{extra:?}"
        );
    }
    let cfg = std::fs::read_to_string(&config).unwrap();
    assert!(cfg.contains("[plan"), "the config is untouched");
    assert_eq!(
        std::fs::read_to_string(&cluster).unwrap(),
        h100.to_toml().unwrap(),
        "the cluster file is untouched"
    );
}

/// Values with no meaning, or that would make the synthetic batch unbounded, are refused
/// at once naming the key (each used to hang past minutes or abort on an allocation);
/// `braid trace` refuses a device instead of reading it until memory runs out.
#[test]
fn hostile_plan_values_are_refused_at_once_naming_the_key() {
    let dir = tempfile::tempdir().unwrap();
    let out = dir.path().join("plan.toml");
    for (set, says) in [
        ("plan.mix.image_prob=-1", "plan.mix.image_prob"),
        ("plan.mix.audio_prob=2", "plan.mix.audio_prob"),
        ("plan.mix.text_median=nan", "plan.mix.text_median"),
        ("plan.mix.text_median=inf", "plan.mix.text_median"),
        ("plan.mix.text_sigma=-3", "plan.mix.text_sigma"),
        ("plan.mix.images_max=0", "plan.mix.images_max"),
        ("plan.mix.clip_s=[-5,-1]", "plan.mix.clip_s"),
        ("plan.mix.clip_s=[30,1]", "plan.mix.clip_s"),
        ("plan.seq_len=0", "plan.seq_len"),
        ("plan.seq_len=100000000", "plan.seq_len"),
        ("plan.batches=100000000", "plan.batches"),
        ("train.batch_rows=100000000", "train.batch_rows"),
        ("plan.check=9223372036854775807", "plan.check"),
    ] {
        let t = std::time::Instant::now();
        let res = braid(&[
            "plan",
            "--config",
            "configs/plan-7b.toml",
            "--gpus",
            "64",
            "--out",
            out.to_str().unwrap(),
            "--set",
            set,
        ]);
        let err = String::from_utf8_lossy(&res.stderr);
        assert_eq!(res.status.code(), Some(2), "{set}: {err}");
        assert!(err.contains(says), "{set}: {err}");
        assert!(t.elapsed().as_secs() < 30, "{set}: {:?}", t.elapsed());
        assert!(!out.exists(), "{set}");
    }
    let res = braid(&["trace", "/dev/zero", "--png", out.to_str().unwrap()]);
    let err = String::from_utf8_lossy(&res.stderr);
    assert_ne!(res.status.code(), Some(0), "{err}");
    assert!(err.contains("not a regular file"), "{err}");
}
