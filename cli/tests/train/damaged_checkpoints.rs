//! A run folder whose `step-*` entries are damaged: `braid train` refuses to go on (with
//! `--resume` or without) where a damaged one lies past the newest complete checkpoint,
//! naming it, and changes nothing, instead of resuming from an older checkpoint or from
//! step 0 and saving over it; damaged entries behind the newest, and names no save
//! writes, are left alone.

use super::*;

/// Copies the reference run's checkpoints into a fresh run folder.
fn copy_of_reference(name: &str) -> PathBuf {
    let _ = reference();
    let src = fixture().join("runs/ref/checkpoints");
    let dir = fixture().join("runs").join(name);
    let _ = std::fs::remove_dir_all(&dir);
    for step in std::fs::read_dir(&src).unwrap() {
        let step = step.unwrap();
        let to = dir.join("checkpoints").join(step.file_name());
        std::fs::create_dir_all(&to).unwrap();
        for f in std::fs::read_dir(step.path()).unwrap() {
            let f = f.unwrap();
            std::fs::copy(f.path(), to.join(f.file_name())).unwrap();
        }
    }
    dir
}

/// Every file under `dir` with its bytes, to show nothing changed.
fn snapshot(dir: &Path) -> Vec<(PathBuf, Vec<u8>)> {
    let mut out = Vec::new();
    let mut todo = vec![dir.to_path_buf()];
    while let Some(d) = todo.pop() {
        for e in std::fs::read_dir(&d).unwrap() {
            let p = e.unwrap().path();
            if p.is_dir() {
                todo.push(p);
            } else {
                out.push((p.clone(), std::fs::read(&p).unwrap_or_default()));
            }
        }
    }
    out.sort();
    out
}

#[test]
fn damaged_step_folders_stop_the_run_and_nothing_is_overwritten() {
    let steps = reference().losses.len();
    assert!(steps >= 12);
    type Damage = fn(&Path);
    let cases: [(&str, Damage, &str, bool); 4] = [
        // The newest checkpoint lost its state: resuming the older one would save over it.
        (
            "newest-without-state",
            |c| std::fs::remove_file(c.join("step-00000012/state.json")).unwrap(),
            "no state.json",
            true,
        ),
        // No usable checkpoint at all: --resume used to start again from step 0.
        (
            "none-usable",
            |c| {
                std::fs::remove_file(c.join("step-00000012/state.json")).unwrap();
                std::fs::remove_file(c.join("step-00000010/state.json")).unwrap();
            },
            "no state.json",
            true,
        ),
        (
            "a-file-named-like-a-step",
            |c| {
                std::fs::remove_dir_all(c.join("step-00000012")).unwrap();
                std::fs::write(c.join("step-00000012"), b"x").unwrap();
            },
            "not a folder",
            true,
        ),
        // Without --resume too: a new run would save over it.
        (
            "fresh-run-over-a-damaged-step",
            |c| {
                std::fs::remove_dir_all(c.join("step-00000012")).unwrap();
                std::fs::remove_dir_all(c.join("step-00000010")).unwrap();
                std::fs::create_dir_all(c.join("step-00000004")).unwrap();
            },
            "no state.json",
            false,
        ),
    ];
    for (name, damage, why, resume) in cases {
        let dir = copy_of_reference(name);
        damage(&dir.join("checkpoints"));
        let before = snapshot(&dir);
        let mut c = train(&dir, &[]);
        if resume {
            c.arg("--resume");
        }
        let o = c.output().unwrap();
        let msg = text(&o);
        assert_eq!(o.status.code(), Some(1), "{name}: {msg}");
        assert!(
            msg.contains(why) && msg.contains("not a complete checkpoint") && msg.contains("step-"),
            "{name}: {msg}"
        );
        assert_eq!(snapshot(&dir), before, "{name}: the run folder changed");
    }
}

/// What no save can reach is left alone: a damaged checkpoint older than the newest
/// complete one (a deletion cut short before deletions were made crash-safe) and a name
/// that is no step number. `--resume` goes on from the newest, and leaves both in place.
#[test]
fn damaged_entries_no_save_reaches_do_not_stop_a_resume() {
    let dir = copy_of_reference("behind-the-newest");
    let ckpts = dir.join("checkpoints");
    std::fs::remove_file(ckpts.join("step-00000010/state.json")).unwrap();
    std::fs::create_dir_all(ckpts.join("step-99999999999999999999")).unwrap();
    // What a deletion cut short leaves now: removed at the start, and said so.
    let cut = ckpts.join(".tmp-discard-step-00000008");
    std::fs::create_dir_all(&cut).unwrap();
    std::fs::write(cut.join("model.safetensors"), b"x").unwrap();
    let o = train(&dir, &["--resume"]).output().unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("resuming from"), "{}", text(&o));
    assert!(
        text(&o).contains("whose deletion never finished") && !cut.exists(),
        "{}",
        text(&o)
    );
    assert!(ckpts.join("step-00000010/model.safetensors").is_file());
    assert!(ckpts.join("step-99999999999999999999").is_dir());
}

/// `braid generate` on a run folder whose checkpoints are all incomplete says which one and
/// why, instead of that the folder holds none.
#[test]
fn generate_names_an_incomplete_checkpoint() {
    let dir = copy_of_reference("generate-none-complete");
    let ckpts = dir.join("checkpoints");
    for step in ["step-00000010", "step-00000012"] {
        std::fs::remove_file(ckpts.join(step).join("state.json")).unwrap();
    }
    let o = run(&[
        "generate",
        "--checkpoint",
        dir.to_str().unwrap(),
        "--prompt",
        "x",
    ]);
    let msg = text(&o);
    assert_eq!(o.status.code(), Some(1), "{msg}");
    assert!(
        msg.contains("no complete checkpoint")
            && msg.contains("step-00000012")
            && msg.contains("no state.json"),
        "{msg}"
    );
}
