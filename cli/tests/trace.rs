//! `braid trace` on trace files Braid did not write: spans that overlap on one lane count
//! once, lanes beyond Braid's own count as "other", names are printed without control
//! characters, and the picture never replaces the trace it reads.

// Helpers below are plain functions, outside clippy's allow-unwrap-in-tests.
#![allow(clippy::unwrap_used)]

use std::path::Path;
mod common;
use common::{braid, text};

/// A rank whose vision lane (tid 1) holds three copies of one 100 µs span and a nested
/// one, and a span on lane 99; the rank is named with an escape sequence.
fn write_trace(path: &Path) {
    let span = |ts: u64, dur: u64, tid: u64| {
        format!(
            r#"{{"name":"x","ph":"X","ts":{ts},"dur":{dur},"pid":0,"tid":{tid},"args":{{"step":1}}}}"#
        )
    };
    let events = [
        r#"{"name":"process_name","ph":"M","pid":0,"tid":0,"args":{"name":"evil\u001b[31mred"}}"#
            .to_string(),
        span(0, 100, 1),
        span(0, 100, 1),
        span(0, 100, 1),
        span(20, 50, 1),
        span(100, 100, 99),
    ];
    std::fs::write(path, format!(r#"{{"traceEvents":[{}]}}"#, events.join(","))).unwrap();
}

#[test]
fn overlapping_spans_count_once_and_unknown_lanes_as_other() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    write_trace(&trace);
    let o = braid(&["trace", trace.to_str().unwrap()]);
    let out = text(&o);
    assert!(o.status.success(), "{out}");
    // 200 µs from first to last span: vision covers the first 100, lane 99 the next.
    assert!(
        out.contains("vision 50 %") && out.contains("other 50 %"),
        "{out}"
    );
    assert!(
        !out.contains('\u{1b}') && out.contains("evil?[31mred"),
        "{out}"
    );
}

#[test]
fn the_picture_never_replaces_its_trace_and_a_bad_width_fails_first() {
    let dir = tempfile::tempdir().unwrap();
    let trace = dir.path().join("t.json");
    write_trace(&trace);
    let before = std::fs::read(&trace).unwrap();
    let same = format!("{}/./t.json", dir.path().display());
    let o = braid(&["trace", trace.to_str().unwrap(), "--png", &same]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("is the trace being read"), "{}", text(&o));
    assert_eq!(std::fs::read(&trace).unwrap(), before);
    for width in ["0", "100", "1000000"] {
        let png = dir.path().join("t.png");
        let o = braid(&[
            "trace",
            trace.to_str().unwrap(),
            "--png",
            png.to_str().unwrap(),
            "--width",
            width,
        ]);
        assert_eq!(o.status.code(), Some(2), "{width}: {}", text(&o));
        // Refused before any summary line or picture.
        assert!(
            o.stdout.is_empty() && !png.exists(),
            "{width}: {}",
            text(&o)
        );
        assert!(text(&o).contains("--width"), "{width}: {}", text(&o));
    }
    // A span without "dur" is no span, and the error says what one is.
    let bare = dir.path().join("bare.json");
    std::fs::write(
        &bare,
        r#"{"traceEvents":[{"name":"x","ph":"X","ts":0,"pid":0,"tid":1}]}"#,
    )
    .unwrap();
    let o = braid(&["trace", bare.to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains(r#""ph": "X" with "ts" and "dur""#),
        "{}",
        text(&o)
    );
}
