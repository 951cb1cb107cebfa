//! A config that cannot work fails fast, naming the key, and leaves no run folder behind.

use super::*;

/// A plan file for 2,000 GPUs (disjoint: the LLM on 1,998 of them).
fn big_plan() -> std::path::PathBuf {
    let path = fixture().join("big-plan.toml");
    let layout = |dp: usize| format!("tp = 1\ncp = 1\npp = 1\ndp = {dp}\n");
    let text = format!(
        "gpus = 2000\ncluster = \"h100\"\nstep_time_s = 1.0\nbaseline_step_time_s = 1.0\n\n\
         [plan]\nplacement = \"disjoint\"\nschedule = \"phased\"\nmicrobatches = 1\n\
         recompute = false\nrecompute_encoders = false\nzero1 = true\n\n\
         [plan.llm]\n{}\n[plan.vision]\n{}\n[plan.audio]\n{}",
        layout(1998),
        layout(1),
        layout(1)
    );
    std::fs::write(&path, text).unwrap();
    path
}

#[test]
fn bad_configs_fail_fast_naming_the_key() {
    let dir = fixture().join("runs/bad");
    let plan_set = format!("parallel.plan=\"{}\"", big_plan().display());
    for (sets, needle) in [
        (vec!["train.stpes=3"], "stpes"),
        (vec!["model.llm.kv_heads=3"], "kv_heads"),
        (vec!["optim.lr=-1"], "optim.lr"),
        (
            vec![
                "data.path=/nonexistent/packed",
                "data.build=/nonexistent/data.toml",
            ],
            "/nonexistent/data.toml",
        ),
        (vec!["data.build=\"\""], "data.build"),
        (vec!["model.llm.vocab=100"], "model.llm.vocab"),
        // Sizes no model has, and a world no process holds as threads: named before any
        // allocation (each used to abort, or build layers until memory ran out).
        (vec!["model.llm.layers=1000000"], "`layers` = 1000000"),
        (vec!["model.vision.num_layers=1000000000"], "`num_layers`"),
        // A plan "file" that never ends: refused before it is read; a plan for more ranks
        // than one process runs as threads.
        (vec!["parallel.plan=\"/dev/zero\""], "not a regular file"),
        (vec![plan_set.as_str()], "2000 ranks as threads"),
        // Within each size's limit, but terabytes of weights: refused against the memory.
        (
            vec!["model.llm.layers=4000", "model.llm.intermediate=1000000"],
            "GiB of f32 weights alone, more than this machine's",
        ),
        (
            vec!["model.llm.intermediate=4611686018427387904"],
            "`intermediate`",
        ),
        (
            vec![
                "parallel.world_size=1000000",
                "parallel.placement=\"colocated\"",
                "parallel.llm.dp=1000000",
                "parallel.vision.dp=1000000",
                "parallel.audio.dp=1000000",
            ],
            "parallel.world_size",
        ),
        // A CLIP encoder on SigLIP-made pixels: both keys and both values named.
        (
            vec!["model.vision.family=clip"],
            "model.vision.family: \"clip\" expects",
        ),
        (
            vec!["model.vision.family=clip"],
            "[image] preset = \"siglip\"",
        ),
    ] {
        let mut c = train(&dir, &[]);
        for s in &sets {
            c.args(["--set", s]);
        }
        let t = Instant::now();
        let o = c.output().unwrap();
        let took = t.elapsed();
        assert!(!o.status.success(), "{sets:?}");
        assert!(text(&o).contains(needle), "{sets:?}: {}", text(&o));
        assert!(took < Duration::from_secs(2), "{sets:?} took {took:?}");
        assert!(
            !dir.exists(),
            "{sets:?}: a failed start left {}",
            dir.display()
        );
    }
    // No dataset and no way to build one.
    let no_build = fixture().join("no-build.toml");
    let text_cfg = std::fs::read_to_string(fixture().join("run.toml")).unwrap();
    let text_cfg: String = text_cfg
        .lines()
        .filter(|l| !l.starts_with("build ="))
        .map(|l| format!("{l}\n"))
        .collect();
    std::fs::write(
        &no_build,
        text_cfg
            .replace("/packed\"", "/missing-packed\"")
            .replace("runs/ref", "runs/no-build"),
    )
    .unwrap();
    let o = run(&["train", "--config", no_build.to_str().unwrap()]);
    assert!(!o.status.success());
    assert!(
        text(&o).contains("missing-packed") && text(&o).contains("braid pack"),
        "{}",
        text(&o)
    );

    let o = run(&["train", "--config", "/nonexistent/run.toml"]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("/nonexistent/run.toml"), "{}", text(&o));
}
