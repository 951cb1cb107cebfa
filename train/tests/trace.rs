//! `log.trace = true`: every rank's timeline as Chrome trace event JSON, one file per rank
//! and one merged file, with the fields Perfetto and `chrome://tracing` read; the spans
//! cover each module's forward and backward per stage and microbatch, the bridge, the
//! collectives, the optimizer and the data, and never overlap inside one lane of a rank.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use braid_train::Quiet;
use braid_train::metrics::read_metrics;
use braid_train::trace::{LANES, TraceEvent, TraceFile, read};
use braid_train::trainer::train;

mod common;
use common::{config, run_dir};

/// Checks the fields a trace viewer reads, and returns the span names per rank.
fn check_file(file: &TraceFile, ranks: usize) -> Vec<BTreeSet<String>> {
    let mut names = vec![BTreeSet::new(); ranks];
    let mut lanes: Vec<Vec<(f64, f64)>> = vec![Vec::new(); ranks * LANES.len()];
    for e in &file.trace_events {
        assert!(e.pid < ranks, "{e:?}");
        match e.ph.as_str() {
            "X" => {
                let dur = e.dur.unwrap();
                assert!(e.ts > 1.0e15 && dur >= 0.0, "unix microseconds: {e:?}");
                assert!(e.tid < LANES.len() && e.cat == LANES[e.tid], "{e:?}");
                assert!(e.args.contains_key("step"), "{e:?}");
                names[e.pid].insert(e.name.clone());
                lanes[e.pid * LANES.len() + e.tid].push((e.ts, e.ts + dur));
            }
            "M" => assert!(e.args.contains_key("name") || e.args.contains_key("sort_index")),
            other => panic!("phase {other}: {e:?}"),
        }
    }
    // One thread per rank: the spans of a lane follow each other (1 µs of rounding).
    for spans in &mut lanes {
        spans.sort_by(|a, b| a.0.total_cmp(&b.0));
        for w in spans.windows(2) {
            assert!(w[1].0 >= w[0].1 - 1.0, "overlapping spans in a lane: {w:?}");
        }
    }
    names
}

/// Pairs of spans, one matching `a` and one `b`, that run at the same time (by more
/// than 1 µs of rounding).
fn overlapping(
    file: &TraceFile,
    a: impl Fn(&TraceEvent) -> bool,
    b: impl Fn(&TraceEvent) -> bool,
) -> usize {
    let spans = |f: &dyn Fn(&TraceEvent) -> bool| -> Vec<(f64, f64)> {
        file.trace_events
            .iter()
            .filter(|e| e.ph == "X" && f(e))
            .map(|e| (e.ts, e.ts + e.dur.unwrap()))
            .collect()
    };
    let (xs, ys) = (spans(&a), spans(&b));
    xs.iter()
        .map(|x| {
            ys.iter()
                .filter(|y| x.0 < y.1 - 1.0 && y.0 < x.1 - 1.0)
                .count()
        })
        .sum()
}

fn encoder_compute(e: &TraceEvent) -> bool {
    e.cat == "vision" || e.cat == "audio"
}

fn llm_compute(e: &TraceEvent) -> bool {
    e.cat == "llm"
}

/// The overlapped schedule on 4 ranks (vision, audio, a two-stage LLM): each encoder
/// works on later microbatches while the LLM runs earlier ones, and the timeline shows
/// it.
#[test]
fn an_overlapped_run_shows_encoders_working_beside_the_llm() {
    let dir = run_dir("trace-overlapped");
    let _ = std::fs::remove_dir_all(&dir);
    let sets = [
        "parallel.schedule=\"overlapped\"",
        "parallel.world_size=4",
        "parallel.llm.pp=2",
        "train.microbatches=3",
        "log.trace=true",
        "log.trace_steps=3",
        "train.steps=3",
    ];
    train(config(&dir, &sets), false, &mut Quiet).unwrap();
    let merged = read(&dir.join("trace").join("trace.json")).unwrap();
    let names = check_file(&merged, 4);
    for (rank, want) in [
        (
            0,
            &[
                "vision fwd s0 mb0",
                "vision fwd s0 mb2",
                "vision bwd s0 mb1",
            ][..],
        ),
        (1, &["audio fwd s0 mb1", "audio bwd s0 mb2"][..]),
        (2, &["llm fwd s0 mb0", "llm bwd s0 mb2", "wait fwd mb1"][..]),
        (3, &["llm loss mb2", "llm bwd s1 mb1"][..]),
    ] {
        for n in want {
            assert!(
                names[rank].contains(*n),
                "rank {rank} has no span `{n}`: {:?}",
                names[rank]
            );
        }
    }
    // No world-wide bridge exchange: the embeddings moved per microbatch.
    assert!(!names.iter().any(|n| n.contains("bridge fwd")));
    // The encoders' forward of a later microbatch runs while the LLM works on an
    // earlier one.
    let later_encoder_fwd =
        |e: &TraceEvent| encoder_compute(e) && e.name.contains(" fwd ") && !e.name.ends_with("mb0");
    let n = overlapping(&merged, later_encoder_fwd, llm_compute);
    assert!(n > 0, "no encoder forward overlaps the LLM's work");
    // Every step names its slowest rank against the ranks doing the same work.
    let metrics = read_metrics(&dir.join("metrics.jsonl")).unwrap();
    assert_eq!(metrics.len(), 3);
    for m in &metrics {
        let s = m.straggler.expect("a straggler line on 4 ranks");
        assert!(
            s.slowest_rank < 4 && s.busy_s > 0.0 && s.median_busy_s > 0.0,
            "{s:?}"
        );
    }
}

/// Zero-bubble pipelining, phased and overlapped: every LLM stage runs a weight pass
/// ("llm wgt s1 mb2") per microbatch, after that microbatch's backward.
#[test]
fn a_zero_bubble_run_shows_each_weight_pass_after_its_backward() {
    for schedule in ["phased", "overlapped"] {
        let dir = run_dir(&format!("trace-zero-bubble-{schedule}"));
        let _ = std::fs::remove_dir_all(&dir);
        let sets = [
            &format!("parallel.schedule=\"{schedule}\""),
            "parallel.world_size=5",
            "parallel.llm.pp=3",
            "parallel.llm.zero_bubble=true",
            "train.microbatches=4",
            "log.trace=true",
            "log.trace_steps=1",
            "train.steps=1",
            "optim.warmup_steps=1",
            "model.llm.layers=3",
        ];
        train(config(&dir, &sets), false, &mut Quiet).unwrap();
        let merged = read(&dir.join("trace").join("trace.json")).unwrap();
        check_file(&merged, 5);
        let end_of = |name: &str| {
            let e = merged
                .trace_events
                .iter()
                .find(|e| e.ph == "X" && e.name == name)
                .unwrap_or_else(|| panic!("{schedule}: no span `{name}`"));
            (e.ts, e.ts + e.dur.unwrap())
        };
        for s in 0..3 {
            for mb in 0..4 {
                let (b, w) = (
                    end_of(&format!("llm bwd s{s} mb{mb}")),
                    end_of(&format!("llm wgt s{s} mb{mb}")),
                );
                assert!(w.0 >= b.1 - 1.0, "{schedule}: s{s} mb{mb} W before its B");
            }
        }
    }
}

#[test]
fn a_multi_rank_run_writes_every_rank_timeline() {
    let dir = run_dir("trace");
    let _ = std::fs::remove_dir_all(&dir);
    // Vision on rank 0, audio on rank 1, the LLM in two stages (two microbatches each).
    let sets = [
        "parallel.world_size=4",
        "parallel.llm.pp=2",
        "log.trace=true",
        "log.trace_steps=2",
        "train.steps=3",
        "checkpoint.interval=2",
    ];
    train(config(&dir, &sets), false, &mut Quiet).unwrap();
    let trace = dir.join("trace");
    for rank in 0..4 {
        let file = read(&trace.join(format!("rank-{rank:05}.json"))).unwrap();
        assert!(file.trace_events.iter().all(|e| e.pid == rank));
    }
    // The merged file, as text: the keys the viewers read.
    let text = std::fs::read_to_string(trace.join("trace.json")).unwrap();
    for key in [
        "\"traceEvents\"",
        "\"ph\":\"X\"",
        "\"ts\":",
        "\"dur\":",
        "\"pid\":",
        "\"tid\":",
        "\"name\":",
    ] {
        assert!(text.contains(key), "{key}");
    }
    let merged = read(&trace.join("trace.json")).unwrap();
    let steps: BTreeSet<u64> = merged
        .trace_events
        .iter()
        .filter_map(|e| e.args.get("step").and_then(|s| s.as_u64()))
        .collect();
    assert_eq!(
        steps,
        BTreeSet::from([1, 2]),
        "log.trace_steps = 2 of 3 steps"
    );
    let names = check_file(&merged, 4);
    let has = |rank: usize, name: &str| names[rank].contains(name);
    for (rank, want) in [
        (
            0,
            &[
                "data",
                "vision fwd s0",
                "vision bwd s0",
                "bridge fwd",
                "adamw",
            ][..],
        ),
        (
            1,
            &["audio fwd s0", "audio bwd s0", "bridge bwd", "grad norm"][..],
        ),
        (
            2,
            &[
                "llm fwd s0 mb0",
                "llm fwd s0 mb1",
                "llm bwd s0 mb1",
                "recv grad mb0",
            ][..],
        ),
        (
            3,
            &[
                "llm fwd s1 mb1",
                "llm loss mb0",
                "llm bwd s1 mb0",
                "recv act mb1",
            ][..],
        ),
    ] {
        for n in want {
            assert!(
                has(rank, n),
                "rank {rank} has no span `{n}`: {:?}",
                names[rank]
            );
        }
        assert!(
            has(rank, "checkpoint") && has(rank, "grad all-reduce"),
            "rank {rank}"
        );
    }
    // No encoder work on LLM ranks, and no LLM work on encoder ranks.
    assert!(
        !names[2]
            .iter()
            .any(|n| n.starts_with("vision") || n.starts_with("audio"))
    );
    assert!(!names[0].iter().any(|n| n.starts_with("llm")));
    // The phased schedule: the bridge's collectives keep every encoder's work apart from
    // the LLM's (what the overlapped schedule changes).
    assert_eq!(overlapping(&merged, encoder_compute, llm_compute), 0);
}

/// One rank runs every module itself: its timeline has each module's forward and
/// backward per microbatch, the loss, the data, the grad norm, AdamW and the checkpoint,
/// in the same files and names as a run on several ranks.
#[test]
fn a_one_rank_run_writes_its_timeline() {
    let dir = run_dir("trace-one-rank");
    let _ = std::fs::remove_dir_all(&dir);
    let sets = [
        "train.microbatches=2",
        "log.trace=true",
        "train.steps=2",
        "checkpoint.interval=1",
    ];
    train(config(&dir, &sets), false, &mut Quiet).unwrap();
    let trace = dir.join("trace");
    assert!(trace.join("rank-00000.json").is_file());
    let merged = read(&trace.join("trace.json")).unwrap();
    let names = check_file(&merged, 1);
    for want in [
        "data",
        "vision fwd s0 mb0",
        "audio fwd s0 mb1",
        "llm fwd s0 mb0",
        "llm loss mb1",
        "llm bwd s0 mb1",
        "vision bwd s0 mb0",
        "audio bwd s0 mb1",
        "grad norm",
        "adamw",
        "checkpoint",
    ] {
        assert!(names[0].contains(want), "no span `{want}`: {:?}", names[0]);
    }
    let steps: BTreeSet<u64> = merged
        .trace_events
        .iter()
        .filter_map(|e| e.args.get("step").and_then(|s| s.as_u64()))
        .collect();
    assert_eq!(steps, BTreeSet::from([1, 2]));
    // One thread: no module's work overlaps another's.
    assert_eq!(overlapping(&merged, encoder_compute, llm_compute), 0);
}

#[test]
fn without_log_trace_nothing_is_written() {
    let dir = run_dir("no-trace");
    let _ = std::fs::remove_dir_all(&dir);
    let sets = [
        "parallel.world_size=4",
        "parallel.llm.dp=2",
        "train.steps=2",
    ];
    train(config(&dir, &sets), false, &mut Quiet).unwrap();
    assert!(!dir.join("trace").exists());
}

/// The phased schedule with a two-stage vision encoder: a stage's waits for its
/// neighbour are comm spans, apart from its compute span (the straggler check counts
/// compute only, so a stage waiting on a slow one before it is not named).
#[test]
fn a_phased_encoder_stage_waits_on_the_comm_lane() {
    let dir = run_dir("trace-encoder-pp");
    let _ = std::fs::remove_dir_all(&dir);
    let sets = [
        "parallel.world_size=4",
        "parallel.vision.pp=2",
        "log.trace=true",
        "train.steps=2",
    ];
    train(config(&dir, &sets), false, &mut Quiet).unwrap();
    let merged = read(&dir.join("trace").join("trace.json")).unwrap();
    let names = check_file(&merged, 4);
    let rank_of = |n: &str| names.iter().position(|s| s.contains(n)).unwrap();
    let (first, second) = (rank_of("vision fwd s0"), rank_of("vision fwd s1"));
    assert_ne!(first, second);
    assert!(
        names[second].contains("vision recv act"),
        "{:?}",
        names[second]
    );
    assert!(
        names[first].contains("vision recv grad"),
        "{:?}",
        names[first]
    );
    // Per step, the second stage's receive ends before its forward starts.
    let span = |rank: usize, name: &str, step: u64| {
        let e = merged
            .trace_events
            .iter()
            .find(|e| {
                e.pid == rank
                    && e.name == name
                    && e.args.get("step").and_then(|s| s.as_u64()) == Some(step)
            })
            .unwrap();
        (e.ts, e.ts + e.dur.unwrap())
    };
    for step in 1..=2 {
        let (recv, fwd) = (
            span(second, "vision recv act", step),
            span(second, "vision fwd s1", step),
        );
        assert!(recv.1 <= fwd.0 + 1.0, "step {step}: {recv:?} then {fwd:?}");
        assert_eq!(
            merged
                .trace_events
                .iter()
                .filter(|e| e.pid == second && e.name == "vision recv act")
                .map(|e| e.cat.as_str())
                .collect::<BTreeSet<_>>(),
            BTreeSet::from(["comm"])
        );
    }
}

/// A corrupt span (a negative, infinite or absurd time) is an error naming it.
#[test]
fn a_trace_with_an_impossible_span_is_an_error_naming_it() {
    let dir = tempfile::tempdir().unwrap();
    let path = dir.path().join("t.json");
    let span = |ts: &str, dur: &str| {
        format!(
            r#"{{"traceEvents": [{{"name": "ok", "ph": "X", "ts": 0, "dur": 5, "pid": 0, "tid": 0}},
                {{"name": "bad", "ph": "X", "ts": {ts}, "dur": {dur}, "pid": 3, "tid": 1}}]}}"#
        )
    };
    // Offsets from a step's start (plans) and µs since the Unix epoch (runs) both read.
    for ts in ["10", "1796289872743289.8"] {
        std::fs::write(&path, span(ts, "20")).unwrap();
        assert_eq!(read(&path).unwrap().trace_events.len(), 2, "{ts}");
    }
    for (ts, dur) in [
        ("10", "-3"),
        ("1e308", "1"),
        ("0", "1e300"),
        ("-1e300", "1"),
    ] {
        std::fs::write(&path, span(ts, dur)).unwrap();
        let e = read(&path).unwrap_err().to_string();
        assert!(e.contains("event 1 (`bad`, pid 3)"), "{ts} {dur}: {e}");
        // Huge values read as such, not as hundreds of digits.
        assert!(e.len() < 400, "{ts} {dur}: {e}");
    }
}
