//! The tokenizer travels with the data: `braid pack` copies it into the dataset, every
//! checkpoint and the Hugging Face export carry it, and `braid generate` reads it from
//! the checkpoint once the original file is gone.

use super::*;

/// The byte-level BPE fixture of the dataloader's tests (ChatML and media tokens).
fn tiny_bpe() -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("../dataloader/tests/fixtures/tokenizer/tiny_bpe.json")
}

#[test]
fn a_checkpoint_alone_is_enough_to_generate_once_the_tokenizer_is_gone() {
    reference(); // the demo data exist
    let root = fixture();
    let src = root.join("tok-src");
    let _ = std::fs::remove_dir_all(&src);
    std::fs::create_dir_all(&src).unwrap();
    std::fs::copy(tiny_bpe(), src.join("tiny.json")).unwrap();
    let data_cfg = std::fs::read_to_string(root.join("data.toml")).unwrap()
        + "[tokenizer]\npath = \"tok-src/tiny.json\"\n";
    std::fs::write(root.join("data-bpe.toml"), data_cfg).unwrap();
    let dir = root.join("runs/bpe");
    let _ = std::fs::remove_dir_all(&dir);
    let sets = |packed: &str| {
        vec![
            format!("data.path={}", root.join(packed).display()),
            format!("data.build={}", root.join("data-bpe.toml").display()),
            format!(
                "eval.path={}",
                root.join(format!("{packed}-heldout")).display()
            ),
            "model.llm.vocab=712".to_string(),
            "train.steps=2".to_string(),
        ]
    };
    let with_sets = |c: &mut Command, sets: &[String]| {
        for s in sets {
            c.args(["--set", s]);
        }
    };
    let mut c = train(&dir, &[]);
    with_sets(&mut c, &sets("packed-bpe"));
    let o = c.output().unwrap();
    assert!(o.status.success(), "{}", text(&o));

    // The dataset holds the tokenizer, under its Hugging Face name, and says so.
    let packed = root.join("packed-bpe");
    assert_eq!(
        std::fs::read(packed.join("tokenizer.json")).unwrap(),
        std::fs::read(tiny_bpe()).unwrap()
    );
    let info: serde_json::Value =
        serde_json::from_str(&std::fs::read_to_string(packed.join("dataset.json")).unwrap())
            .unwrap();
    assert_eq!(
        info["tokenizer"]["files"],
        serde_json::json!(["tokenizer.json"])
    );
    // The checkpoint and the export carry it; the export gets a tokenizer config for
    // `AutoTokenizer` (the source had none).
    let ckpt = dir.join("checkpoints/step-00000002");
    assert!(ckpt.join("tokenizer.json").is_file());
    assert!(dir.join("hf/llm/tokenizer.json").is_file());
    let tc: serde_json::Value = serde_json::from_str(
        &std::fs::read_to_string(dir.join("hf/llm/tokenizer_config.json")).unwrap(),
    )
    .unwrap();
    assert_eq!(tc["tokenizer_class"], "PreTrainedTokenizerFast");

    // The original tokenizer is gone: the checkpoint is enough.
    std::fs::remove_dir_all(&src).unwrap();
    let generate = || {
        run(&[
            "generate",
            "--checkpoint",
            dir.to_str().unwrap(),
            "--prompt",
            "What is it?",
            "--max-new-tokens",
            "4",
        ])
    };
    let o = generate();
    assert!(o.status.success(), "{}", text(&o));
    // Resuming where the checkpoint's tokenizer is not the dataset's: refused, naming both
    // hashes (the same ids would stand for other tokens).
    let mut bytes = std::fs::read(ckpt.join("tokenizer.json")).unwrap();
    bytes.push(b'\n');
    std::fs::write(ckpt.join("tokenizer.json"), bytes).unwrap();
    let mut c = train(&dir, &["--resume"]);
    with_sets(
        &mut c,
        &[sets("packed-bpe"), vec!["train.steps=3".to_string()]].concat(),
    );
    let o = c.output().unwrap();
    assert!(!o.status.success(), "{}", text(&o));
    assert!(text(&o).contains("another tokenizer"), "{}", text(&o));
    // A checkpoint from before tokenizers were kept with it, and no tokenizer at the old
    // path either: the error names both places it looked.
    std::fs::remove_file(ckpt.join("tokenizer.json")).unwrap();
    let o = generate();
    assert_eq!(o.status.code(), Some(1), "{}", text(&o));
    let msg = text(&o);
    assert!(
        msg.contains(&ckpt.join("tokenizer.json").display().to_string()),
        "{msg}"
    );
    assert!(msg.contains("tok-src/tiny.json"), "{msg}");

    // A tokenizer that changed since packing is refused before any step.
    let mut bytes = std::fs::read(packed.join("tokenizer.json")).unwrap();
    bytes.push(b'\n');
    std::fs::write(packed.join("tokenizer.json"), bytes).unwrap();
    let other = root.join("runs/bpe-changed");
    let mut c = train(&other, &[]);
    with_sets(&mut c, &sets("packed-bpe"));
    let o = c.output().unwrap();
    assert!(!o.status.success());
    assert!(text(&o).contains("sha256"), "{}", text(&o));
}
