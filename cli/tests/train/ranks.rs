//! `braid train` on several ranks (threads): the same losses as one rank, a layout that
//! does not fit failing before any work, and a rank's panic stopping every rank.

use super::*;

/// Loss and grad norm of `a` and `b` agree to 1e-4 relative, step by step.
pub(super) fn assert_close_runs(what: &str, a: &[StepBits], b: &[StepBits]) {
    assert_eq!(a.len(), b.len(), "{what}");
    for (x, y) in a.iter().zip(b) {
        let (lx, ly) = (f64::from_bits(x.1), f64::from_bits(y.1));
        assert!(
            (lx - ly).abs() <= 1e-4 * lx.abs(),
            "{what}: step {} loss {lx} vs {ly}",
            x.0
        );
    }
}

#[test]
fn several_ranks_as_threads_train_like_one() {
    let want = reference();
    // Vision on rank 0, audio on rank 1, the LLM's two data-parallel replicas on 2-3.
    let dir = fixture().join("runs/par");
    let o = train(
        &dir,
        &[
            "--set",
            "eval.interval=6",
            "--set",
            "parallel.world_size=4",
            "--set",
            "parallel.llm.dp=2",
        ],
    )
    .output()
    .unwrap();
    assert!(o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("llm"),
        "the layouts are shown: {}",
        text(&o)
    );
    assert_close_runs("4 ranks", &losses(&dir), &want.losses);
    assert!(dir.join("eval.json").exists() && dir.join("hf/llm").exists());

    // A layout that does not fit fails before any work, naming the key.
    let bad = fixture().join("runs/par-bad");
    let t = Instant::now();
    let o = train(
        &bad,
        &[
            "--set",
            "parallel.world_size=4",
            "--set",
            "parallel.llm.tp=3",
        ],
    )
    .output()
    .unwrap();
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("parallel.llm.tp"), "{}", text(&o));
    assert!(t.elapsed() < Duration::from_secs(2));
    assert!(!bad.exists());
}

#[test]
fn a_rank_that_panics_stops_every_rank_naming_it() {
    reference(); // the dataset is packed once, by the reference run
    let dir = fixture().join("runs/panic");
    let t = Instant::now();
    let o = train(
        &dir,
        &[
            "--set",
            "parallel.world_size=5",
            "--set",
            "parallel.llm.dp=3",
            "--set",
            "fault.panic_at=3",
            "--set",
            "fault.panic_rank=3",
            "--set",
            "parallel.timeout_s=600",
        ],
    )
    .output()
    .unwrap();
    let took = t.elapsed();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(took < Duration::from_secs(60), "took {took:?}");
    let out = text(&o);
    assert!(out.contains("rank 3 of 5 failed"), "{out}");
    assert!(out.contains("fault injection"), "{out}");
    // Steps before the failure were recorded; the failed one was not.
    assert_eq!(losses(&dir).len(), 2, "{out}");
}

/// `log.trace = true` on 4 ranks, then `braid trace`: every rank's share of time per kind
/// of work, and the picture (a band per rank: its size follows the rank count, and the
/// encoder ranks' bands hold their modules' colours).
#[test]
fn a_traced_run_is_summed_up_and_drawn_by_braid_trace() {
    reference();
    let dir = fixture().join("runs/traced");
    let o = train(
        &dir,
        &[
            "--set",
            "parallel.world_size=4",
            "--set",
            "parallel.llm.pp=2",
            "--set",
            "model.llm.layers=2",
            "--set",
            "log.trace=true",
            "--set",
            "train.steps=3",
        ],
    )
    .output()
    .unwrap();
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    assert!(out.contains("timeline of every rank"), "{out}");
    let png = dir.join("timeline.png");
    let o = run(&[
        "trace",
        dir.to_str().unwrap(),
        "--png",
        png.to_str().unwrap(),
        "--step",
        "2",
    ]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    for rank in 0..4 {
        assert!(out.contains(&format!("rank {rank}: ")), "{out}");
    }
    assert!(
        out.contains("vision ") && out.contains("audio ") && out.contains("llm "),
        "{out}"
    );
    let img = image::open(&png).unwrap().to_rgb8();
    assert_eq!((img.width(), img.height()), (1600, 100 + 36 * 4));
    // tab10's first three colours: data (blue), vision (orange), audio (green).
    let count = |c: [u8; 3]| img.pixels().filter(|p| p.0 == c).count();
    assert!(
        count([255, 127, 14]) > 50 && count([44, 160, 44]) > 50,
        "vision and audio boxes"
    );
    // A step that is not in the file is an error, not an empty picture.
    let o = run(&["trace", dir.to_str().unwrap(), "--step", "99"]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    let o = run(&["trace", fixture().join("runs/ref").to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "an untraced run: {}", text(&o));
    assert!(
        text(&o).contains("a folder without trace/trace.json"),
        "{}",
        text(&o)
    );
}
