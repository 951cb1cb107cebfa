//! WebDataset and Parquet readers: mixed shards and files built here and written by HF
//! `datasets`, every bad case a reject with a reason; truncations and corruptions never panic.

#![allow(clippy::unwrap_used, clippy::expect_used)]

mod common;

use std::fs;
use std::path::{Path, PathBuf};
use std::sync::Arc;

use braid_dataloader::read::{
    Format, Limits, MediaBytes, ParquetColumns, RawPart, ReadConfig, ReadError, Role, open,
};

use common::read_util::*;

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
    // The shard-level failures name the file they lost the rest of; no sample's does.
    let damaged: Vec<&str> = bad
        .iter()
        .filter_map(|r| r.damaged_file.as_deref())
        .collect();
    assert_eq!(damaged.len(), 2, "{bad:#?}");
    assert!(damaged[0].ends_with("shard-1.tar") && damaged[1].ends_with("shard-2.tar"));
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

/// Zero blocks inside a shard end a tar reader early: the samples after them are not
/// read, and a reject says so instead of their vanishing; trailing zero padding alone
/// (as `tar` writes) says nothing.
#[test]
fn wds_data_after_the_end_marker_is_a_reject() {
    let tmp = tempfile::tempdir().unwrap();
    let mut b = tar::Builder::new(Vec::new());
    for i in 0..6 {
        member(&mut b, &format!("k{i:03}.txt"), b"caption");
    }
    let full = b.into_inner().unwrap();
    let padded = tmp.path().join("padded.tar");
    let mut bytes = full.clone();
    bytes.extend(std::iter::repeat_n(0u8, 20 * 512));
    fs::write(&padded, &bytes).unwrap();
    let (good, bad) = read_all(&padded, &ReadConfig::new(Format::Wds));
    assert_eq!(good.len(), 6);
    assert!(bad.is_empty(), "{bad:?}");

    // Each member is a 512-byte header and one 512-byte block of data: k003 starts at 3072.
    let mut zeroed = full[..3072].to_vec();
    zeroed.extend([0u8; 1024]);
    zeroed.extend(&full[3072..]);
    let path = tmp.path().join("zeroed.tar");
    fs::write(&path, &zeroed).unwrap();
    let (good, bad) = read_all(&path, &ReadConfig::new(Format::Wds));
    assert_eq!(ids(&good), ["k000", "k001", "k002"]);
    expect_reject(&bad, "zeroed.tar", "data follows the end-of-archive marker");
    assert!(
        bad[0]
            .damaged_file
            .as_deref()
            .is_some_and(|f| f.ends_with("zeroed.tar"))
    );
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
                    // A cut file has no footer: the whole file is lost, and named so.
                    if mode == 0 {
                        assert!(
                            items
                                .iter()
                                .any(|i| matches!(i, Err(r) if r.damaged_file.is_some())),
                            "cut at {cut}: {items:?}"
                        );
                    }
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
