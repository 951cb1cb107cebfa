//! Input readers: each format on a small mixed corpus built here, every bad case a reject with a
//! reason, every good sample through.

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use braid_dataloader::read::{
    Format, Limits, MediaBytes, ParquetColumns, RawPart, RawSample, ReadConfig, ReadError, Reject,
    Role, open,
};

fn read_all(input: &Path, cfg: &ReadConfig) -> (Vec<RawSample>, Vec<Reject>) {
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for item in open(input, cfg).unwrap() {
        match item {
            Ok(s) => good.push(s),
            Err(r) => bad.push(r),
        }
    }
    (good, bad)
}

fn ids(samples: &[RawSample]) -> Vec<&str> {
    samples.iter().map(|s| s.id.as_str()).collect()
}

/// The reject whose source ends with `suffix`, checked to mention `reason`.
#[track_caller]
fn expect_reject(rejects: &[Reject], suffix: &str, reason: &str) {
    let r = rejects
        .iter()
        .find(|r| r.source.ends_with(suffix))
        .unwrap_or_else(|| panic!("no reject for {suffix}; rejects: {rejects:#?}"));
    assert!(
        r.reason.contains(reason),
        "reject for {suffix}: {:?} does not mention {reason:?}",
        r.reason
    );
}

fn inline(part: &RawPart) -> &[u8] {
    match part {
        RawPart::Image(m) | RawPart::Audio(m) => match &m.bytes {
            MediaBytes::Inline(b) => b,
            MediaBytes::Path(p) => panic!("expected inline bytes, got {p:?}"),
        },
        RawPart::Text(t) => panic!("expected media, got text {t:?}"),
    }
}

fn text(part: &RawPart) -> &str {
    match part {
        RawPart::Text(t) => t,
        other => panic!("expected text, got {other:?}"),
    }
}

/// `dir/ds` with image and audio files, plus `dir/secret.png` outside it and a symlink to it.
fn dataset(dir: &Path) -> PathBuf {
    let ds = dir.join("ds");
    fs::create_dir_all(ds.join("img")).unwrap();
    fs::create_dir_all(ds.join("audio")).unwrap();
    fs::write(ds.join("img/a.png"), b"not really a png").unwrap();
    fs::write(ds.join("img/b.jpg"), b"jpeg bytes").unwrap();
    fs::write(ds.join("audio/c.wav"), b"RIFF....").unwrap();
    fs::write(dir.join("secret.png"), b"outside").unwrap();
    std::os::unix::fs::symlink(dir.join("secret.png"), ds.join("img/out.png")).unwrap();
    std::os::unix::fs::symlink(ds.join("img/a.png"), ds.join("img/in.png")).unwrap();
    ds
}

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
    cfg.image_root = Some(ds.join("img"));
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

/// Appends a member whose raw header name is `name` (the `tar` crate's `set_path` refuses `..`
/// and absolute names, which is exactly what this test needs to write).
fn append_raw(b: &mut tar::Builder<Vec<u8>>, name: &str, data: &[u8], kind: tar::EntryType) {
    let mut h = tar::Header::new_gnu();
    let gnu = h.as_gnu_mut().unwrap();
    gnu.name = [0; 100];
    gnu.name[..name.len()].copy_from_slice(name.as_bytes());
    h.set_entry_type(kind);
    h.set_size(data.len() as u64);
    h.set_mode(0o644);
    h.set_cksum();
    b.append(&h, data).unwrap();
}

fn member(b: &mut tar::Builder<Vec<u8>>, name: &str, data: &[u8]) {
    append_raw(b, name, data, tar::EntryType::Regular);
}

#[test]
fn wds_mixed_shards() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    let chat = |parts: &str| {
        format!(
            r#"{{"messages": [{{"role": "user", "content": [{parts}]}}, {{"role": "assistant", "content": "ok"}}]}}"#
        )
    };
    let mut b = tar::Builder::new(Vec::new());
    member(&mut b, "s1.jpg", b"jpg-1");
    member(&mut b, "s1.txt", b"  a red square\n");
    member(&mut b, "sub/s2.wav", b"wav-2");
    member(
        &mut b,
        "sub/s2.json",
        chat(r#"{"type": "audio"}, {"type": "text", "text": "transcribe"}"#).as_bytes(),
    );
    member(&mut b, "s3.a.png", b"png-a");
    member(&mut b, "s3.b.PNG", b"png-b");
    member(
        &mut b,
        "s3.json",
        chat(r#"{"type": "image"}, {"type": "text", "text": "vs"}, {"type": "image"}"#).as_bytes(),
    );
    member(&mut b, "../evil.jpg", b"x");
    member(&mut b, "../evil.txt", b"x");
    member(&mut b, "/abs.jpg", b"x");
    member(&mut b, "s4.jpg", b"no text");
    member(&mut b, "s5.txt", b"\xff\xfe");
    member(&mut b, "s6.jpg", b"x");
    member(
        &mut b,
        "s6.json",
        chat(r#"{"type": "text", "text": "no image part"}"#).as_bytes(),
    );
    member(&mut b, "s7.json", chat(r#"{"type": "image"}"#).as_bytes());
    member(
        &mut b,
        "s8.json",
        br#"{"messages": [{"role": "bot", "content": "x"}]}"#,
    );
    member(&mut b, "s9.jpg", &[0u8; 2000]);
    member(&mut b, "s9.txt", b"too big");
    append_raw(&mut b, "s10.jpg", b"", tar::EntryType::Symlink);
    member(&mut b, "s10.txt", b"link");
    member(&mut b, "s11.cls", b"3");
    member(&mut b, "s11.json", br#"{"url": "http://x", "width": 3}"#);
    member(&mut b, "s11.txt", b"caption only");
    member(&mut b, "s12.json", b"{not json");
    member(&mut b, "s1.txt", b"again");
    member(
        &mut b,
        "README",
        b"no extension: not a member of any sample",
    );
    member(&mut b, "s13.flac", b"flac-13");
    member(&mut b, "s13.txt", b"a tone");
    fs::write(dir.join("shard-0.tar"), b.into_inner().unwrap()).unwrap();

    // shard-1: one complete sample, then cut in the middle of the next.
    let mut b = tar::Builder::new(Vec::new());
    member(&mut b, "t1.png", b"png-t1");
    member(&mut b, "t1.txt", b"complete");
    member(&mut b, "t2.png", &[7u8; 900]);
    member(&mut b, "t2.txt", b"lost");
    let bytes = b.into_inner().unwrap();
    // 512-byte blocks: t1 (4), t2.png header + 2 data blocks, t2.txt (2), end (2): cut in t2.png's data.
    fs::write(dir.join("shard-1.tar"), &bytes[..bytes.len() - 2600]).unwrap();
    // shard-2: garbage.
    fs::write(dir.join("shard-2.tar"), [0x5au8; 1500]).unwrap();

    let mut cfg = ReadConfig::new(Format::Wds);
    cfg.limits = Limits {
        max_member_bytes: 1000,
        ..Limits::default()
    };
    let (good, bad) = read_all(dir, &cfg);
    assert_eq!(ids(&good), ["s1", "sub/s2", "s3", "s11", "s13", "t1"]);

    let s1 = &good[0];
    assert!(s1.source.ends_with("shard-0.tar:s1"));
    assert_eq!(inline(&s1.messages[0].parts[0]), b"jpg-1");
    assert_eq!(s1.messages[1].role, Role::Assistant);
    assert_eq!(text(&s1.messages[1].parts[0]), "a red square");
    let s2 = &good[1].messages[0].parts;
    assert!(matches!(&s2[0], RawPart::Audio(m) if m.name == "sub/s2.wav"));
    assert_eq!(text(&s2[1]), "transcribe");
    let s3 = &good[2].messages[0].parts;
    assert_eq!(
        (inline(&s3[0]), inline(&s3[2])),
        (&b"png-a"[..], &b"png-b"[..])
    );
    assert_eq!(
        good[3].messages.len(),
        1,
        "caption only: one assistant message"
    );
    assert!(matches!(&good[4].messages[0].parts[0], RawPart::Audio(_)));

    expect_reject(&bad, "shard-0.tar:../evil", "'..' component");
    expect_reject(&bad, "shard-0.tar:/abs", "absolute name");
    expect_reject(&bad, "shard-0.tar:s4", "no .txt or .json member");
    expect_reject(&bad, "shard-0.tar:s5", "invalid UTF-8");
    expect_reject(&bad, "shard-0.tar:s6", "image(s) without a placeholder");
    expect_reject(&bad, "shard-0.tar:s7", "without an image");
    expect_reject(&bad, "shard-0.tar:s8", "unknown role \"bot\"");
    expect_reject(&bad, "shard-0.tar:s9", "over the 1000-byte limit");
    expect_reject(&bad, "shard-0.tar:s10", "not a regular file");
    expect_reject(&bad, "shard-0.tar:s12", "malformed JSON");
    let dup = bad
        .iter()
        .filter(|r| r.source.ends_with("shard-0.tar:s1"))
        .count();
    assert_eq!(dup, 1);
    expect_reject(&bad, "shard-0.tar:s1", "appears again");
    expect_reject(&bad, "shard-1.tar:t2", "truncated");
    expect_reject(&bad, "shard-1.tar", "truncated tar");
    expect_reject(&bad, "shard-2.tar", "");
    assert_eq!(bad.len(), 14, "{bad:#?}");
}

#[test]
fn wds_dropping_the_reader_early_is_fine() {
    let tmp = tempfile::tempdir().unwrap();
    let mut b = tar::Builder::new(Vec::new());
    for i in 0..100 {
        member(&mut b, &format!("k{i:03}.txt"), b"caption");
    }
    let path = tmp.path().join("many.tar");
    fs::write(&path, b.into_inner().unwrap()).unwrap();
    let mut it = open(&path, &ReadConfig::new(Format::Wds)).unwrap();
    assert_eq!(it.next().unwrap().unwrap().id, "k000");
    drop(it); // the producer thread stops at its next send
}

/// Garbage and every truncation of a small shard: never a panic, never a fatal error.
#[test]
fn wds_truncations_and_garbage_never_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let mut b = tar::Builder::new(Vec::new());
    member(&mut b, "a.png", b"png");
    member(&mut b, "a.txt", b"cap");
    member(
        &mut b,
        "b.json",
        br#"{"messages": [{"role": "user", "content": "hi"}]}"#,
    );
    let full = b.into_inner().unwrap();
    let path = tmp.path().join("x.tar");
    for cut in (0..full.len()).step_by(97) {
        let mut bytes = full[..cut].to_vec();
        if cut % 2 == 1 {
            bytes
                .iter_mut()
                .skip(cut / 3)
                .step_by(7)
                .for_each(|x| *x ^= 0xa5);
        }
        fs::write(&path, &bytes).unwrap();
        let n = open(&path, &ReadConfig::new(Format::Wds)).unwrap().count();
        assert!(n <= 4);
    }
}

/// A Parquet file in the layout HF `datasets` writes (struct{bytes, path} media), written here
/// with the parquet crate.
#[test]
fn parquet_caption_layout_written_by_the_crate() {
    use arrow_array::builder::{BinaryBuilder, StringBuilder, StructBuilder};
    use arrow_array::{ArrayRef, Int64Array, RecordBatch, StringArray};
    use arrow_schema::{DataType, Field, Fields, Schema};

    let tmp = tempfile::tempdir().unwrap();
    let ds = dataset(tmp.path());
    fs::copy(ds.join("img/a.png"), ds.join("side.png")).unwrap();
    let media_fields = Fields::from(vec![
        Field::new("bytes", DataType::Binary, true),
        Field::new("path", DataType::Utf8, true),
    ]);
    let mut image = StructBuilder::from_fields(media_fields.clone(), 8);
    type Row<'a> = (Option<&'a [u8]>, Option<&'a str>, bool); // (bytes, path, struct valid)
    let rows: [Row; 7] = [
        (Some(b"inline-0"), Some("orig.png"), true), // 0: inline, path is a name
        (None, Some("side.png"), true),              // 1: path only, inside the folder
        (None, Some("../secret.png"), true),         // 2: escaping
        (None, None, false),                         // 3: null image: text-only sample
        (None, None, true),                          // 4: neither bytes nor path
        (Some(b"inline-5"), None, true),             // 5: caption null
        (None, Some("img/nope.png"), true),          // 6: missing
    ];
    for (bytes, path, valid) in rows {
        image
            .field_builder::<BinaryBuilder>(0)
            .unwrap()
            .append_option(bytes);
        image
            .field_builder::<StringBuilder>(1)
            .unwrap()
            .append_option(path);
        image.append(valid);
    }
    let image = image.finish();
    let captions = StringArray::from(vec![
        Some("c0"),
        Some("c1"),
        Some("c2"),
        Some("c3"),
        Some("c4"),
        None,
        Some("c6"),
    ]);
    let id_col = Int64Array::from((0..7).collect::<Vec<i64>>());
    let schema = Arc::new(Schema::new(vec![
        Field::new("id", DataType::Int64, false),
        Field::new("image", DataType::Struct(media_fields), true),
        Field::new("caption", DataType::Utf8, true),
    ]));
    let columns: Vec<ArrayRef> = vec![Arc::new(id_col), Arc::new(image), Arc::new(captions)];
    let batch = RecordBatch::try_new(schema.clone(), columns).unwrap();
    let path = ds.join("train.parquet");
    let props = parquet::file::properties::WriterProperties::builder()
        .set_compression(parquet::basic::Compression::SNAPPY)
        .set_max_row_group_row_count(Some(3)) // several row groups
        .build();
    let mut w =
        parquet::arrow::ArrowWriter::try_new(fs::File::create(&path).unwrap(), schema, Some(props))
            .unwrap();
    w.write(&batch).unwrap();
    w.close().unwrap();

    let mut cfg = ReadConfig::new(Format::Parquet);
    cfg.parquet = ParquetColumns {
        id: Some("id".into()),
        image: Some("image".into()),
        text: Some("caption".into()),
        ..ParquetColumns::default()
    };
    cfg.limits = Limits {
        parquet_batch_rows: 2,
        ..Limits::default()
    };
    let (good, bad) = read_all(&path, &cfg);
    assert_eq!(ids(&good), ["0", "1", "3"]);
    assert_eq!(inline(&good[0].messages[0].parts[0]), b"inline-0");
    assert!(matches!(&good[0].messages[0].parts[0], RawPart::Image(m) if m.name == "orig.png"));
    assert!(matches!(&good[1].messages[0].parts[0],
        RawPart::Image(m) if m.bytes == MediaBytes::Path(ds.join("side.png").canonicalize().unwrap())));
    assert_eq!(good[2].messages.len(), 1);
    assert_eq!(text(&good[2].messages[0].parts[0]), "c3");
    assert!(good[2].source.ends_with("train.parquet:3"));
    expect_reject(&bad, "train.parquet:2", "escapes the dataset root");
    expect_reject(&bad, "train.parquet:4", "neither bytes nor path");
    expect_reject(&bad, "train.parquet:5", "text cell is null");
    expect_reject(&bad, "train.parquet:6", "missing file");
    assert_eq!(bad.len(), 4);

    // Mapping errors are fatal and name the column.
    let mut wrong = cfg.clone();
    wrong.parquet.text = Some("nope".into());
    let err = open(&path, &wrong).err().unwrap().to_string();
    assert!(err.contains("no column \"nope\""), "{err}");
    wrong.parquet.text = Some("id".into());
    let err = open(&path, &wrong).err().unwrap().to_string();
    assert!(err.contains("expected a string"), "{err}");
    wrong.parquet.messages = Some("caption".into());
    assert!(matches!(
        open(&path, &wrong).err().unwrap(),
        ReadError::Config(_)
    ));
    // Not Parquet at all: a reject, like a garbage tar shard.
    fs::write(ds.join("junk.parquet"), b"PAR1 not really").unwrap();
    let (good, bad) = read_all(&ds.join("junk.parquet"), &cfg);
    assert!(good.is_empty());
    expect_reject(&bad, "junk.parquet", "not a readable Parquet file");
    assert!(matches!(
        open(&ds.join("absent.parquet"), &cfg).err().unwrap(),
        ReadError::Open { .. }
    ));
}

fn fixture(name: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/read")
        .join(name)
}

/// `png(i)` in tools/fixtures/make_read_fixtures.py: a PNG (decoding is not the reader's job).
fn check_png(bytes: &[u8]) {
    assert_eq!(&bytes[..8], b"\x89PNG\r\n\x1a\n");
}

/// Written by pyarrow through `datasets.Dataset.to_parquet` (snappy, HF schema metadata).
#[test]
fn parquet_written_by_hf_datasets_caption() {
    let mut cfg = ReadConfig::new(Format::Parquet);
    cfg.parquet = ParquetColumns {
        id: Some("id".into()),
        image: Some("image".into()),
        audio: Some("audio".into()),
        text: Some("caption".into()),
        ..ParquetColumns::default()
    };
    let (good, bad) = read_all(&fixture("hf_caption.parquet"), &cfg);
    assert!(bad.is_empty(), "{bad:#?}");
    assert_eq!(ids(&good), ["0", "1", "2"]);
    for (i, s) in good.iter().enumerate() {
        let user = &s.messages[0].parts;
        assert!(matches!(&user[0], RawPart::Image(m) if m.name == format!("img{i}.png")));
        check_png(inline(&user[0]));
        let wav = inline(&user[1]);
        assert_eq!(&wav[..4], b"RIFF");
        assert_eq!(&wav[44..46], (i as i16).to_le_bytes());
        assert_eq!(text(&s.messages[1].parts[0]), format!("caption {i}"));
    }
}

#[test]
fn parquet_written_by_hf_datasets_chat() {
    let mut cfg = ReadConfig::new(Format::Parquet);
    cfg.parquet = ParquetColumns {
        messages: Some("messages".into()),
        image: Some("images".into()),
        ..ParquetColumns::default()
    };
    let (good, bad) = read_all(&fixture("hf_chat.parquet"), &cfg);
    assert!(bad.is_empty(), "{bad:#?}");
    assert_eq!(good.len(), 2);
    let u = &good[1].messages[0];
    assert_eq!(u.role, Role::User);
    assert_eq!(u.parts.len(), 3);
    check_png(inline(&u.parts[0]));
    check_png(inline(&u.parts[1]));
    assert_ne!(inline(&u.parts[0]), inline(&u.parts[1]));
    assert_eq!(text(&u.parts[2]), "Same?");
    assert_eq!(text(&good[1].messages[1].parts[0]), "No.");
    assert_eq!(text(&good[0].messages[0].parts[1]), "What colour?");

    // The chat layout without the images column: the placeholders have nothing to fill them.
    cfg.parquet.image = None;
    let (good, bad) = read_all(&fixture("hf_chat.parquet"), &cfg);
    assert!(good.is_empty());
    assert_eq!(bad.len(), 2);
    assert!(
        bad[0].reason.contains("without an image"),
        "{}",
        bad[0].reason
    );
}

#[test]
fn reject_display_names_source_and_id() {
    let r = Reject::new(Some("x1".into()), "a.jsonl:3", "missing file");
    assert_eq!(r.to_string(), "a.jsonl:3 (id \"x1\"): missing file");
}

/// Every truncation and some corruptions of an HF file: rejects or a fatal `ReadError`, never a panic.
#[test]
fn parquet_truncations_and_corruptions_never_panic() {
    let tmp = tempfile::tempdir().unwrap();
    let full = fs::read(fixture("hf_chat.parquet")).unwrap();
    let mut cfg = ReadConfig::new(Format::Parquet);
    cfg.parquet = ParquetColumns {
        messages: Some("messages".into()),
        image: Some("images".into()),
        ..ParquetColumns::default()
    };
    let path = tmp.path().join("x.parquet");
    let mut outcomes = [0usize; 3]; // fatal (none expected), some rejects, clean
    for cut in (0..full.len()).step_by(61) {
        for mode in 0..3 {
            let mut bytes = full.clone();
            match mode {
                0 => bytes.truncate(cut),
                // Corrupt the data pages, keep the footer readable.
                1 => bytes
                    .iter_mut()
                    .skip(4 + cut % 1000)
                    .take(40)
                    .for_each(|x| *x ^= 0x5a),
                // Corrupt the footer (Thrift metadata), keep its length and magic.
                _ => {
                    let at = full.len() - 8 - 1 - (cut % 600);
                    bytes[at] ^= 0x5a;
                    bytes[at.saturating_sub(17)] = bytes[at.saturating_sub(17)].wrapping_add(1);
                }
            }
            fs::write(&path, &bytes).unwrap();
            match open(&path, &cfg) {
                Err(_) => outcomes[0] += 1,
                Ok(it) => {
                    let items: Vec<_> = it.collect();
                    assert!(items.len() <= 3, "{items:?}");
                    outcomes[if items.iter().any(|i| i.is_err()) {
                        1
                    } else {
                        2
                    }] += 1;
                }
            }
        }
    }
    assert!(outcomes[0] == 0 && outcomes[1] > 0, "{outcomes:?}");
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
