//! `braid pack` flags for real-world inputs: `--format` inferred from the input, `--tokenizer`
//! given a model folder, `--media-root` (and the old `--image-root`) for linked media folders,
//! ShareGPT records, and a non-zero exit above `pack.max_reject_ratio`.

#![allow(clippy::unwrap_used)]

use std::fs;
use std::path::{Path, PathBuf};

use serde_json::json;
mod common;
use common::{braid, text};

fn png(w: u32, h: u32) -> Vec<u8> {
    let img = image::RgbImage::from_fn(w, h, |x, y| image::Rgb([x as u8, y as u8, 7]));
    let mut out = std::io::Cursor::new(Vec::new());
    img.write_to(&mut out, image::ImageFormat::Png).unwrap();
    out.into_inner()
}

/// The small data config the tests pack with (32 px images, 16 tokens each).
fn config(dir: &Path) -> PathBuf {
    let p = dir.join("data.toml");
    fs::write(
        &p,
        "[image]\nsize = 32\npatch = 8\n[pack]\nmax_seq_len = 512\n[shards]\nthreads = 1\n",
    )
    .unwrap();
    p
}

/// `dir/data/train.jsonl` of ShareGPT records whose images sit in a linked folder
/// `dir/data/images -> dir/store`; returns (manifest, store).
fn sharegpt_corpus(dir: &Path, n: usize) -> (PathBuf, PathBuf) {
    let store = dir.join("store");
    let data = dir.join("data");
    fs::create_dir_all(&store).unwrap();
    fs::create_dir_all(&data).unwrap();
    std::os::unix::fs::symlink(&store, data.join("images")).unwrap();
    let mut lines = Vec::new();
    for i in 0..n {
        fs::write(store.join(format!("{i}.png")), png(30 + i as u32, 40)).unwrap();
        lines.push(
            json!({"id": format!("s{i}"), "conversations": [
                {"from": "human", "value": "<image>What is this?"},
                {"from": "gpt", "value": "A gradient."}],
                "images": [format!("images/{i}.png")]})
            .to_string(),
        );
    }
    let manifest = data.join("train.jsonl");
    fs::write(&manifest, lines.join("\n") + "\n").unwrap();
    (manifest, store)
}

#[test]
fn sharegpt_with_linked_media_folder_format_inferred() {
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, store) = sharegpt_corpus(tmp.path(), 6);
    let cfg = config(tmp.path());
    let (m, c) = (manifest.to_str().unwrap(), cfg.to_str().unwrap());
    // Without trusting the store: every image is a path escape, nothing valid, exit 1.
    let out = tmp.path().join("out");
    let o_ = out.to_str().unwrap();
    let o = braid(&["pack", "--config", c, "--input", m, "--output", o_]);
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("nothing valid"), "{}", text(&o));
    // --media-root: all six packed with their image (the failed run's leftovers are cleaned).
    let s = store.to_str().unwrap();
    let o = braid(&[
        "pack",
        "--config",
        c,
        "--input",
        m,
        "--output",
        o_,
        "--media-root",
        s,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let t = text(&o);
    assert!(t.contains("6 read, 6 packed"), "{t}");
    assert!(t.contains("6 images"), "{t}");
    // The old --image-root still works, as a media root.
    let o = braid(&[
        "pack",
        "--config",
        c,
        "--input",
        m,
        "--output",
        o_,
        "--image-root",
        s,
        "--overwrite",
    ]);
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("6 images"), "{}", text(&o));
}

#[test]
fn too_many_rejects_exit_non_zero_with_the_breakdown() {
    let tmp = tempfile::tempdir().unwrap();
    let (manifest, _) = sharegpt_corpus(tmp.path(), 2);
    let mut m = fs::read_to_string(&manifest).unwrap();
    for i in 0..3 {
        m.push_str(
            &json!({"id": format!("bad{i}"), "messages": [
                {"role": "user", "content": "<image><image>"},
                {"role": "assistant", "content": "x"}], "images": ["images/0.png"]})
            .to_string(),
        );
        m.push('\n');
    }
    fs::write(&manifest, m).unwrap();
    let cfg = config(tmp.path());
    let store = tmp.path().join("store");
    let out = tmp.path().join("out");
    let args = |ratio: &'static str| {
        vec![
            "pack".to_string(),
            "--config".into(),
            cfg.display().to_string(),
            "--input".into(),
            manifest.display().to_string(),
            "--output".into(),
            out.display().to_string(),
            "--media-root".into(),
            store.display().to_string(),
            "--max-reject-ratio".into(),
            ratio.into(),
        ]
    };
    let run = |ratio| {
        let a = args(ratio);
        braid(&a.iter().map(String::as_str).collect::<Vec<_>>())
    };
    let o = run("0.5");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let t = text(&o);
    assert!(
        t.contains("3 of 5 samples rejected") && t.contains("read/") && t.contains(" 3"),
        "{t}"
    );
    assert!(!out.join("dataset.json").exists());
    // At 0.6 it passes and the summary breaks the rejects down by kind.
    let o = run("0.6");
    assert!(o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("3 rejected"), "{}", text(&o));
    let o = run("1.5");
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    assert!(text(&o).contains("max_reject_ratio"), "{}", text(&o));
}

#[test]
fn format_is_inferred_and_tokenizer_may_be_a_model_folder() {
    let tmp = tempfile::tempdir().unwrap();
    let dir = tmp.path();
    // A folder holding both .jsonl and .tar files: ambiguous, usage error asking for --format.
    let mixed = dir.join("mixed");
    fs::create_dir_all(&mixed).unwrap();
    fs::write(mixed.join("a.jsonl"), "").unwrap();
    fs::write(mixed.join("b.tar"), "").unwrap();
    let out = dir.join("out");
    let o_ = out.to_str().unwrap();
    let o = braid(&["pack", "--input", mixed.to_str().unwrap(), "--output", o_]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(
        text(&o).contains("ambiguous") && text(&o).contains("--format"),
        "{}",
        text(&o)
    );

    // A .json file is LLaVA/ShareGPT; --tokenizer a folder with tokenizer.json in it.
    fs::write(dir.join("a.png"), png(32, 32)).unwrap();
    let json = dir.join("data.json");
    fs::write(
        &json,
        json!([{"id": "l0", "image": "a.png", "conversations": [
            {"from": "human", "value": "<image>\nWhat?"}, {"from": "gpt", "value": "A gradient."}]}])
        .to_string(),
    )
    .unwrap();
    let model = dir.join("model");
    fs::create_dir_all(&model).unwrap();
    fs::copy(
        Path::new(env!("CARGO_MANIFEST_DIR"))
            .join("../dataloader/tests/fixtures/tokenizer/tiny_bpe.json"),
        model.join("tokenizer.json"),
    )
    .unwrap();
    let cfg = config(dir);
    let o = braid(&[
        "pack",
        "--config",
        cfg.to_str().unwrap(),
        "--input",
        json.to_str().unwrap(),
        "--tokenizer",
        model.to_str().unwrap(),
        "--output",
        o_,
    ]);
    assert!(o.status.success(), "{}", text(&o));
    let info: serde_json::Value =
        serde_json::from_str(&fs::read_to_string(out.join("dataset.json")).unwrap()).unwrap();
    assert_eq!(info["input_format"], "llava");
    assert_eq!(info["images"], 1);
    assert_eq!(info["tokenizer"]["kind"], "hf");
    assert!(
        info["tokenizer"]["path"]
            .as_str()
            .unwrap()
            .ends_with("model/tokenizer.json")
    );
    // A folder without tokenizer.json says so.
    let o = braid(&[
        "pack",
        "--input",
        json.to_str().unwrap(),
        "--tokenizer",
        dir.join("mixed").to_str().unwrap(),
        "--output",
        o_,
        "--overwrite",
    ]);
    assert_eq!(o.status.code(), Some(2), "{}", text(&o));
    assert!(text(&o).contains("without tokenizer.json"), "{}", text(&o));
}
