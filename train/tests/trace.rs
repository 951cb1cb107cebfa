//! `log.trace = true`: every rank's timeline as Chrome trace event JSON, one file per rank
//! and one merged file, with the fields Perfetto and `chrome://tracing` read; the spans
//! cover each module's forward and backward per stage and microbatch, the bridge, the
//! collectives, the optimizer and the data, and never overlap inside one lane of a rank.

// Helpers are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use std::collections::BTreeSet;

use braid_train::Quiet;
use braid_train::trace::{LANES, TraceFile, read};
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
            &["data", "vision fwd", "vision bwd", "bridge fwd", "adamw"][..],
        ),
        (
            1,
            &["audio fwd", "audio bwd", "bridge bwd", "grad norm"][..],
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
