//! JSONL and LLaVA readers: each on a small mixed corpus built here, every bad case a reject
//! with a reason, every good sample through; limits, folders and fatal errors.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;

use braid_dataloader::read::{
    Format, Limits, MediaBytes, RawPart, ReadConfig, ReadError, Reject, Role, open,
};

use common::read_util::*;

#[test]
fn jsonl_mixed_corpus() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let img = |p: &str| format!(r#"{{"type": "image", "path": "{p}"}}"#);
    let rec = |id: &str, part: String| {
        format!(
            r#"{{"id": "{id}", "messages": [{{"role": "user", "content": [{part}]}}, {{"role": "assistant", "content": "ok"}}]}}"#
        )
    };
    let mut lines: Vec<Vec<u8>> = vec![
        // 1: image + text, assistant plain string
        format!(
            r#"{{"id": "g1", "messages": [{{"role": "user", "content": [{}, {{"type": "text", "text": "what?"}}]}}, {{"role": "assistant", "content": "a cat"}}]}}"#,
            img("img/a.png")
        )
        .into(),
        // 2: integer id, system + audio
        br#"{"id": 7, "messages": [{"role": "system", "content": "be brief"}, {"role": "user", "content": [{"type": "audio", "path": "./audio/c.wav"}]}, {"role": "assistant", "content": [{"type": "text", "text": "hi"}]}]}"#.to_vec(),
        b"".to_vec(),    // 3: skipped
        b"   \r".to_vec(), // 4: skipped
        br#"{"id": "m", "messages": ["#.to_vec(), // 5: malformed
        b"{\"id\": \"u\", \"messages\": [{\"role\": \"user\", \"content\": \"\xff\xfe\"}]}".to_vec(), // 6
        rec("esc", img("img/../../secret.png")).into(), // 7
        rec("abs", img("/etc/passwd")).into(),           // 8
        rec("sym", img("img/out.png")).into(),           // 9
        rec("miss", img("img/nope.png")).into(),         // 10
        br#"{"id": "role", "messages": [{"role": "bot", "content": "x"}]}"#.to_vec(), // 11
        br#"{"id": "types", "messages": "hello"}"#.to_vec(), // 12
        br#"{"id": ["x"], "messages": []}"#.to_vec(),       // 13
        br#"{"id": "kind", "messages": [{"role": "user", "content": [{"type": "video", "path": "v.mp4"}]}]}"#.to_vec(), // 14
        rec("dir", img("img")).into(),                    // 15: a folder, not a file
        rec("insym", img("img/in.png")).into(),           // 16: symlink inside the root: fine
        br#"[1, 2]"#.to_vec(),                              // 17
        rec("nopath", r#"{"type": "image"}"#.into()).into(), // 18
        // 19: no id -> the source is the id; last line without a newline
        br#"{"messages": [{"role": "assistant", "content": "last"}]}"#.to_vec(),
    ];
    let last = lines.pop().unwrap();
    let mut body = Vec::new();
    for l in &lines {
        body.extend_from_slice(l);
        body.push(b'\n');
    }
    body.extend_from_slice(&last);
    fs::write(ds.join("train.jsonl"), &body).unwrap();

    let (good, bad) = read_all(&ds.join("train.jsonl"), &ReadConfig::new(Format::Jsonl));
    let last_id = format!("{}:19", ds.join("train.jsonl").display());
    assert_eq!(ids(&good), ["g1", "7", "insym", last_id.as_str()]);
    assert_eq!(bad.len(), 13, "{bad:#?}");

    let g1 = &good[0];
    assert!(g1.source.ends_with("train.jsonl:1"));
    assert_eq!(g1.messages.len(), 2);
    assert_eq!(g1.messages[0].role, Role::User);
    match &g1.messages[0].parts[0] {
        RawPart::Image(m) => {
            assert_eq!(m.name, "img/a.png");
            assert_eq!(
                m.bytes,
                MediaBytes::Path(ds.join("img/a.png").canonicalize().unwrap())
            );
        }
        other => panic!("{other:?}"),
    }
    assert_eq!(text(&g1.messages[0].parts[1]), "what?");
    assert_eq!(text(&g1.messages[1].parts[0]), "a cat");
    let roles: Vec<Role> = good[1].messages.iter().map(|m| m.role).collect();
    assert_eq!(roles, [Role::System, Role::User, Role::Assistant]);
    assert!(matches!(good[1].messages[1].parts[0], RawPart::Audio(_)));

    expect_reject(&bad, ":5", "malformed JSON");
    expect_reject(&bad, ":6", "invalid UTF-8");
    expect_reject(&bad, ":7", "escapes the dataset root");
    expect_reject(&bad, ":8", "is absolute");
    expect_reject(&bad, ":9", "outside the dataset root");
    expect_reject(&bad, ":10", "missing file \"img/nope.png\"");
    expect_reject(&bad, ":11", "unknown role \"bot\"");
    expect_reject(&bad, ":12", "\"messages\" must be an array");
    expect_reject(&bad, ":13", "\"id\" must be a string or an integer");
    expect_reject(&bad, ":14", "unknown part type \"video\"");
    expect_reject(&bad, ":15", "not a regular file");
    expect_reject(&bad, ":17", "must be a JSON object");
    expect_reject(&bad, ":18", "without a \"path\"");
    let by_id = bad.iter().find(|r| r.source.ends_with(":10")).unwrap();
    assert_eq!(by_id.id.as_deref(), Some("miss"));
    assert_eq!(
        bad.iter().find(|r| r.source.ends_with(":5")).unwrap().id,
        None
    );
}

#[test]
fn jsonl_limits_folder_and_fatal_errors() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ok = br#"{"id": "a", "messages": [{"role": "user", "content": "hi"}]}"#;
    let long = format!(
        r#"{{"id": "long", "messages": [{{"role": "user", "content": "{}"}}]}}"#,
        "x".repeat(500)
    );
    fs::write(
        dir.join("0.jsonl"),
        [&ok[..], b"\n", long.as_bytes(), b"\n", ok].concat(),
    )
    .unwrap();
    fs::write(dir.join("1.jsonl"), [&ok[..], b"\r\n"].concat()).unwrap();
    fs::write(dir.join("notes.txt"), b"ignored").unwrap();
    let mut cfg = ReadConfig::new(Format::Jsonl);
    cfg.limits = Limits {
        max_record_bytes: 200,
        ..Limits::default()
    };
    let (good, bad) = read_all(dir, &cfg);
    assert_eq!(good.len(), 3);
    assert!(good[2].source.ends_with("1.jsonl:1"));
    expect_reject(&bad, "0.jsonl:2", "longer than 200 bytes");
    assert_eq!(bad.len(), 1);

    // Only an input that cannot be opened is fatal.
    let err = open(&dir.join("missing.jsonl"), &cfg).err().unwrap();
    assert!(matches!(err, ReadError::Open { .. }), "{err}");
    let empty = dir.join("empty");
    fs::create_dir(&empty).unwrap();
    assert!(matches!(
        open(&empty, &cfg).err().unwrap(),
        ReadError::Empty { .. }
    ));
    assert!("tfrecord".parse::<Format>().is_err());
    assert_eq!("wds".parse::<Format>().unwrap(), Format::Wds);
}

#[test]
fn llava_mixed_corpus() {
    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    let conv = |h: &str| {
        format!(r#"[{{"from": "human", "value": "{h}"}}, {{"from": "gpt", "value": "answer"}}]"#)
    };
    let el = |id: &str, image: &str, h: &str| {
        format!(r#"{{"id": "{id}", {image} "conversations": {}}}"#, conv(h))
    };
    let elements = [
        el("g1", r#""image": "a.png","#, r"<image>\nWhat is it?"),
        el("text", "", "no image here"),
        el("noph", r#""image": "a.png","#, "where is it"),
        el("noimg", "", r"<image>\nhm"),
        el("two", r#""image": "a.png","#, "<image><image>"),
        el("esc", r#""image": "../secret.png","#, "<image>"),
        el("abs", r#""image": "/etc/passwd","#, "<image>"),
        el("sym", r#""image": "out.png","#, "<image>"),
        el("miss", r#""image": "nope.png","#, "<image>"),
        r#"{"id": "role", "conversations": [{"from": "bot", "value": "x"}]}"#.into(),
        r#"{"id": "gptimg", "image": "a.png", "conversations": [{"from": "gpt", "value": "<image>"}]}"#.into(),
        r#"{"id": "m", "conversations" []}"#.into(), // malformed, brackets balanced
        "42".into(),
        el("multi", r#""image": ["a.png", "b.jpg"],"#, "first <image> then <image> end"),
        r#"{"id": 12, "image": null, "conversations": [{"from": "system", "value": "s"}, {"from": "human", "value": "q"}]}"#.into(),
    ];
    let mut body = b"[\n".to_vec();
    for (i, e) in elements.iter().enumerate() {
        if i > 0 {
            body.extend_from_slice(b",\n  ");
        }
        body.extend_from_slice(e.as_bytes());
        if i == 2 {
            // invalid UTF-8 inside a string of an extra element
            body.extend_from_slice(b",\n{\"id\": \"utf\", \"conversations\": [{\"from\": \"human\", \"value\": \"\xc3\x28\"}]}");
        }
    }
    body.extend_from_slice(b"\n]\n");
    let json = ds.join("llava.json");
    fs::write(&json, &body).unwrap();
    let mut cfg = ReadConfig::new(Format::Llava);
    cfg.media_roots = vec![ds.join("img")];
    let (good, bad) = read_all(&json, &cfg);
    assert_eq!(ids(&good), ["g1", "text", "multi", "12"]);
    assert_eq!(bad.len(), 12, "{bad:#?}");

    let g1 = &good[0].messages;
    assert_eq!(g1[0].role, Role::User);
    assert!(matches!(&g1[0].parts[0], RawPart::Image(m) if m.name == "a.png"));
    assert_eq!(text(&g1[0].parts[1]), "\nWhat is it?");
    assert_eq!(g1[1].role, Role::Assistant);
    let multi = &good[2].messages[0].parts;
    assert_eq!(multi.len(), 5);
    assert_eq!(text(&multi[0]), "first ");
    assert!(matches!(&multi[1], RawPart::Image(m) if m.name == "a.png"));
    assert!(matches!(&multi[3], RawPart::Image(m) if m.name == "b.jpg"));
    assert_eq!(good[3].messages[0].role, Role::System);

    expect_reject(&bad, "[2]", "image without a placeholder");
    expect_reject(&bad, "[3]", "invalid UTF-8");
    expect_reject(&bad, "[4]", "placeholder without an image");
    expect_reject(&bad, "[5]", "2 <image> placeholders for 1 image");
    expect_reject(&bad, "[6]", "escapes the dataset root");
    expect_reject(&bad, "[7]", "is absolute");
    expect_reject(&bad, "[8]", "outside the dataset root");
    expect_reject(&bad, "[9]", "missing file");
    expect_reject(&bad, "[10]", "unknown role \"bot\"");
    expect_reject(&bad, "[11]", "placeholder in a turn of role assistant");
    expect_reject(&bad, "[12]", "malformed JSON");
    expect_reject(&bad, "[13]", "must be a JSON object");
}

#[test]
fn llava_truncated_and_not_an_array() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let ok = r#"{"id": "a", "conversations": [{"from": "human", "value": "[not, a bracket]"}]}"#;
    fs::write(
        dir.join("cut.json"),
        format!("[{ok}, {ok}, {{\"id\": \"b\", \"conv"),
    )
    .unwrap();
    let cfg = ReadConfig::new(Format::Llava);
    let (good, bad) = read_all(&dir.join("cut.json"), &cfg);
    assert_eq!(good.len(), 2);
    assert_eq!(bad.len(), 1);
    expect_reject(&bad, "cut.json[2]", "truncated");

    fs::write(dir.join("trail.json"), format!("[{ok},]  x")).unwrap();
    let (good, bad) = read_all(&dir.join("trail.json"), &cfg);
    assert_eq!(good.len(), 1);
    expect_reject(&bad, "trail.json[1]", "trailing comma");
    expect_reject(&bad, "trail.json", "trailing data");

    fs::write(dir.join("empty.json"), " [ ] ").unwrap();
    assert_eq!(read_all(&dir.join("empty.json"), &cfg), (vec![], vec![]));

    fs::write(dir.join("obj.json"), "{\"id\": 1}").unwrap();
    let err = open(&dir.join("obj.json"), &cfg).err().unwrap();
    assert!(matches!(err, ReadError::Invalid { .. }), "{err}");
    fs::write(dir.join("nothing.json"), "").unwrap();
    assert!(open(&dir.join("nothing.json"), &cfg).is_err());
}

#[test]
fn reject_display_names_source_and_id() {
    let r = Reject::new(Some("x1".into()), "a.jsonl:3", "missing file");
    assert_eq!(r.to_string(), "a.jsonl:3 (id \"x1\"): missing file");
}

#[test]
fn llava_element_limit() {
    let tmp = tempfile::tempdir().unwrap();
    let el = |id: &str, n: usize| {
        format!(
            r#"{{"id": "{id}", "conversations": [{{"from": "human", "value": "{}"}}]}}"#,
            "y".repeat(n)
        )
    };
    let path = tmp.path().join("l.json");
    fs::write(
        &path,
        format!("[{}, {}, {}]", el("a", 10), el("big", 5000), el("c", 10)),
    )
    .unwrap();
    let mut cfg = ReadConfig::new(Format::Llava);
    cfg.limits = Limits {
        max_record_bytes: 1000,
        ..Limits::default()
    };
    let (good, bad) = read_all(&path, &cfg);
    assert_eq!(ids(&good), ["a", "c"]);
    expect_reject(&bad, "l.json[1]", "longer than 1000 bytes");
}

#[test]
fn format_inferred_from_names_and_folders() {
    use braid_dataloader::read::infer_format;
    let tmp = tempfile::tempdir().unwrap();
    let d = tmp.path();
    for (name, format) in [
        ("a.jsonl", Format::Jsonl),
        ("a.json", Format::Llava),
        ("a.tar", Format::Wds),
        ("a.parquet", Format::Parquet),
    ] {
        assert_eq!(infer_format(&d.join(name)).unwrap(), format, "{name}");
    }
    assert!(
        infer_format(&d.join("a.csv"))
            .unwrap_err()
            .contains("--format")
    );
    let pq = d.join("pq");
    fs::create_dir_all(&pq).unwrap();
    fs::write(pq.join("0.parquet"), b"").unwrap();
    fs::write(pq.join("1.parquet"), b"").unwrap();
    fs::write(pq.join("README.md"), b"").unwrap();
    assert_eq!(infer_format(&pq).unwrap(), Format::Parquet);
    fs::write(pq.join("2.tar"), b"").unwrap();
    let e = infer_format(&pq).unwrap_err();
    assert!(
        e.contains("ambiguous") && e.contains(".parquet") && e.contains(".tar"),
        "{e}"
    );
    let js = d.join("js");
    fs::create_dir_all(&js).unwrap();
    fs::write(js.join("a.json"), b"[]").unwrap();
    assert!(infer_format(&js).unwrap_err().contains("one JSON file"));
    let empty = d.join("empty");
    fs::create_dir_all(&empty).unwrap();
    assert!(infer_format(&empty).unwrap_err().contains("--format"));
}

/// A UTF-8 byte-order mark (Python's `utf-8-sig`, Windows tools) is skipped: the first
/// record reads like the others, in JSONL and in a LLaVA array.
#[test]
fn a_byte_order_mark_is_skipped() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let rec = |id: &str| {
        format!(
            r#"{{"id": "{id}", "messages": [{{"role": "user", "content": "hi"}}, {{"role": "assistant", "content": "ok"}}]}}"#
        )
    };
    let mut body = vec![0xEF, 0xBB, 0xBF];
    body.extend_from_slice(format!("{}\n{}\n", rec("a"), rec("b")).as_bytes());
    fs::write(dir.join("bom.jsonl"), &body).unwrap();
    let (good, bad) = read_all(&dir.join("bom.jsonl"), &ReadConfig::new(Format::Jsonl));
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(ids(&good), ["a", "b"]);

    let ok = r#"{"id": "c", "conversations": [{"from": "human", "value": "hi"}, {"from": "gpt", "value": "ok"}]}"#;
    let mut body = vec![0xEF, 0xBB, 0xBF];
    body.extend_from_slice(format!("[{ok}]").as_bytes());
    fs::write(dir.join("bom.json"), &body).unwrap();
    let (good, bad) = read_all(&dir.join("bom.json"), &ReadConfig::new(Format::Llava));
    assert!(bad.is_empty(), "{bad:?}");
    assert_eq!(ids(&good), ["c"]);
}

/// A device as the input (`--input /dev/zero`) is refused at once, naming it, in every
/// format, instead of being read as one cut-off record after another without end.
#[cfg(unix)]
#[test]
fn a_device_as_the_input_is_refused() {
    for format in [Format::Jsonl, Format::Llava, Format::Wds, Format::Parquet] {
        let e = match open(std::path::Path::new("/dev/zero"), &ReadConfig::new(format)) {
            Ok(_) => panic!("{format:?}: /dev/zero opened"),
            Err(e) => e.to_string(),
        };
        assert!(e.contains("/dev/zero"), "{format:?}: {e}");
        if format == Format::Jsonl {
            assert!(e.contains("a device, not a file"), "{e}");
        }
    }
}
