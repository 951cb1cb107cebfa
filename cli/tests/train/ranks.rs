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
