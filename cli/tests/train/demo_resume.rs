//! The demo model (`configs/demo.toml`, 30 steps) killed with `kill -9` after three of its
//! checkpoints and resumed each time: metrics.jsonl reads exactly like the uninterrupted
//! run's, every field but the timings, as the text braid wrote. (Resuming used to parse
//! and rewrite the kept lines, which changed the last bit of a loss or grad norm on 4 of
//! these 30 lines.)

use std::io::{BufRead, BufReader};

use super::*;

/// A folder with the demo's data config where `configs/data-demo.toml` expects it (its
/// input is `../data/demo/train.jsonl`); the data are made by the first run.
fn demo_root() -> &'static Path {
    static DIR: OnceLock<PathBuf> = OnceLock::new();
    DIR.get_or_init(|| {
        let dir = std::env::temp_dir().join(format!("braid-train-demo-{}", std::process::id()));
        let _ = std::fs::remove_dir_all(&dir);
        std::fs::create_dir_all(dir.join("configs")).unwrap();
        let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
        std::fs::copy(
            repo.join("configs/data-demo.toml"),
            dir.join("configs/data-demo.toml"),
        )
        .unwrap();
        dir
    })
}

fn demo_train(run_dir: &Path, resume: bool) -> Command {
    let root = demo_root();
    let repo = Path::new(env!("CARGO_MANIFEST_DIR")).join("..");
    let data = root.join("data/demo");
    let mut c = braid();
    c.arg("train")
        .arg("--config")
        .arg(repo.join("configs/demo.toml"));
    for s in [
        format!("run.dir={}", run_dir.display()),
        format!("data.path={}", data.join("packed").display()),
        format!(
            "data.build={}",
            root.join("configs/data-demo.toml").display()
        ),
        format!("data.demo={}", data.display()),
        format!("eval.path={}", data.join("packed-heldout").display()),
        format!("eval.input={}", data.join("heldout.jsonl").display()),
        "train.steps=30".into(),
        "eval.interval=0".into(),
        "checkpoint.interval=5".into(),
        "log.interval=1".into(),
    ] {
        c.args(["--set", &s]);
    }
    if resume {
        c.arg("--resume");
    }
    c.stdout(Stdio::null()).stderr(Stdio::piped());
    c
}

/// Runs `cmd` until it reports the checkpoint of `step`, then kills it with SIGKILL.
fn kill_after_checkpoint(mut cmd: Command, step: u64) {
    let mut child = cmd.spawn().unwrap();
    let stderr = child.stderr.take().unwrap();
    let want = format!("checkpoint @ step {step}:");
    let mut seen = String::new();
    for line in BufReader::new(stderr).lines() {
        let line = line.unwrap();
        seen.push_str(&line);
        seen.push('\n');
        if line.starts_with(&want) {
            child.kill().unwrap(); // SIGKILL
            let _ = child.wait();
            return;
        }
    }
    let _ = child.wait();
    panic!("the run ended before `{want}`: {seen}");
}

#[test]
fn the_demo_resumed_after_kill_9s_logs_the_same_bits() {
    let root = demo_root();
    let reference = root.join("runs/ref");
    let o = demo_train(&reference, false).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let want = logged(&reference);
    assert_eq!(want.len(), 30);

    let dir = root.join("runs/killed");
    for (i, step) in [10, 15, 25].into_iter().enumerate() {
        kill_after_checkpoint(demo_train(&dir, i > 0), step);
    }
    let o = demo_train(&dir, true).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    let got = logged(&dir);
    let differ: Vec<usize> = (0..want.len().max(got.len()))
        .filter(|&i| want.get(i) != got.get(i))
        .map(|i| i + 1)
        .collect();
    assert!(
        differ.is_empty(),
        "lines {differ:?} differ: {got:#?} vs {want:#?}"
    );
}
