//! `braid pack` and `braid inspect` end to end: the demo corpus with bad records mixed in packs
//! with exit 0 and every bad record in rejects.jsonl; inspect verifies and plots; nothing valid
//! and usage errors give non-zero exits with a message.

#![allow(clippy::unwrap_used)]

use std::path::Path;
mod common;
use common::{braid, text};

fn config() -> String {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../configs/data-demo.toml")
        .display()
        .to_string()
}

#[test]
fn pack_demo_with_bad_records_then_inspect() {
    let tmp = tempfile::tempdir().unwrap();
    let data = tmp.path().join("demo");
    let d = data.to_str().unwrap();
    let o = braid(&[
        "demo-data",
        "--output",
        d,
        "--train",
        "30",
        "--heldout",
        "4",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let manifest = data.join("train.jsonl");
    let mut m = std::fs::read_to_string(&manifest).unwrap();
    std::fs::write(data.join("broken.png"), b"\x89PNG\r\n\x1a\nnot really").unwrap();
    m.push_str("{\"id\": \"bad-json\"\n");
    m.push_str(r#"{"id": "bad-image", "messages": [{"role": "user", "content": [{"type": "image", "path": "broken.png"}]}, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]}"#);
    m.push('\n');
    m.push_str(r#"{"id": "bad-escape", "messages": [{"role": "user", "content": [{"type": "audio", "path": "../../etc/hosts"}]}, {"role": "assistant", "content": [{"type": "text", "text": "x"}]}]}"#);
    m.push('\n');
    std::fs::write(&manifest, m).unwrap();

    let out = tmp.path().join("packed");
    let o_ = out.to_str().unwrap();
    let cfg = config();
    let args = [
        "pack",
        "--config",
        &cfg,
        "--input",
        manifest.to_str().unwrap(),
        "--output",
        o_,
    ];
    let o = braid(&args);
    assert!(o.status.success(), "{}", text(&o));
    let summary = text(&o);
    assert!(summary.contains("33 read, 30 packed"), "{summary}");
    assert!(summary.contains("3 rejected"), "{summary}");
    let rejects = std::fs::read_to_string(out.join("rejects.jsonl")).unwrap();
    assert_eq!(rejects.lines().count(), 3, "{rejects}");
    for id in ["bad-image", "bad-escape"] {
        assert!(rejects.contains(id), "{id} missing from {rejects}");
    }

    // Packing into the same folder again needs --overwrite.
    let o = braid(&args);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("--overwrite"), "{}", text(&o));

    let plots = tmp.path().join("plots");
    let o = braid(&[
        "inspect",
        o_,
        "--verify",
        "--plots",
        plots.to_str().unwrap(),
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("verified  1 shards"), "{}", text(&o));
    for name in ["llm_len", "text_tokens", "pack_samples"] {
        let png = image::open(plots.join(format!("{name}.png"))).unwrap();
        assert_eq!((png.width(), png.height()), (800, 480));
    }
    let o = braid(&["inspect", o_, "--json"]);
    let v: serde_json::Value = serde_json::from_slice(&o.stdout).unwrap();
    assert_eq!(v["samples"], 33);
    assert_eq!(v["packed_samples"], 30);
    assert_eq!(v["settings"]["image"]["size"], 32);
}

#[test]
fn nothing_valid_and_usage_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let input = tmp.path().join("x.jsonl");
    std::fs::write(&input, "{oops\n").unwrap();
    let out = tmp.path().join("out");
    let (i, o_) = (input.to_str().unwrap(), out.to_str().unwrap());
    let o = braid(&["pack", "--input", i, "--format", "jsonl", "--output", o_]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("nothing valid"), "{}", text(&o));

    let o = braid(&["pack", "--input", i, "--format", "csv", "--output", o_]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("unknown input format"), "{}", text(&o));
    // No --format: inferred from the name; a name that says nothing is a usage error.
    let o = braid(&["pack", "--input", i, "--output", o_]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("nothing valid"), "{}", text(&o));
    let odd = tmp.path().join("x.txt");
    std::fs::write(&odd, "{}\n").unwrap();
    let o = braid(&["pack", "--input", odd.to_str().unwrap(), "--output", o_]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("--format"), "{}", text(&o));
    let bad_cfg = tmp.path().join("bad.toml");
    std::fs::write(&bad_cfg, "[pack]\nmax_seq_lenn = 3\n").unwrap();
    let o = braid(&[
        "pack",
        "--config",
        bad_cfg.to_str().unwrap(),
        "--input",
        i,
        "--format",
        "jsonl",
        "--output",
        o_,
    ]);
    assert_eq!(o.status.code(), Some(2));
    assert!(text(&o).contains("max_seq_lenn"), "{}", text(&o));
    let o = braid(&["inspect", tmp.path().to_str().unwrap()]);
    assert_eq!(o.status.code(), Some(1));
    assert!(text(&o).contains("no dataset.json"), "{}", text(&o));
    // 100,000 decoding threads for five lines once ran past ten minutes.
    let t = std::time::Instant::now();
    let o = braid(&[
        "pack",
        "--input",
        i,
        "--format",
        "jsonl",
        "--output",
        o_,
        "--threads",
        "100000",
    ]);
    assert!(!o.status.success(), "{}", text(&o));
    assert!(
        text(&o).contains("shards.threads") && text(&o).contains("at most 1024"),
        "{}",
        text(&o)
    );
    assert!(
        t.elapsed() < std::time::Duration::from_secs(10),
        "{:?}",
        t.elapsed()
    );
    // An input with no records says so, not that its "0 samples were rejected".
    let empty = tmp.path().join("empty.jsonl");
    std::fs::write(&empty, "\n  \n").unwrap();
    let o = braid(&["pack", "--input", empty.to_str().unwrap(), "--output", o_]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("holds no records"), "{}", text(&o));
}
