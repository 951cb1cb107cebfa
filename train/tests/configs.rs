//! The shipped configs resolve and have the shapes they claim: `configs/gpu-1b.toml` is a
//! Llama-3.2-1B (1,235,814,400 parameters, tied), a SigLIP-so400m/14-384 tower (~428M)
//! and a Whisper-small encoder (~88M), at 4096 tokens a row. Checked from the resolved
//! config (building a 1.7B-parameter model on a CI core is not needed to count it).

#![allow(clippy::unwrap_used, clippy::expect_used)]

use std::path::Path;

use braid_train::RunConfig;
use braid_train::assemble::model_config;

fn repo() -> &'static Path {
    Path::new(concat!(env!("CARGO_MANIFEST_DIR"), "/.."))
}

/// Parameters of a Llama block stack + tied embedding + final norm.
fn llama_params(c: &braid_llm::LlmConfig) -> usize {
    let (h, q, kv) = (c.hidden, c.heads * c.head_dim, c.kv_heads * c.head_dim);
    let block = h * q + 2 * h * kv + q * h + 3 * h * c.intermediate + 2 * h;
    let embed = c.vocab * h * if c.tie_embeddings { 1 } else { 2 };
    c.layers * block + embed + h
}

/// Parameters of a pre-LN ViT/Whisper encoder stack (biased linears, two LayerNorms).
fn encoder_params(layers: usize, d: usize, ff: usize) -> usize {
    layers * (4 * (d * d + d) + 2 * d * ff + ff + d + 4 * d)
}

#[test]
fn gpu_1b_is_the_published_shapes() {
    let path = repo().join("configs/gpu-1b.toml");
    // The config targets a GPU; here it is resolved for the CPU (no driver on CI).
    let cfg = RunConfig::from_file(&path, &["parallel.device=\"cpu\"".into()])
        .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
    let m = model_config(&cfg).unwrap_or_else(|e| panic!("{e}"));
    let llm = &m.llm;
    assert_eq!(
        (
            llm.hidden,
            llm.layers,
            llm.heads,
            llm.kv_heads,
            llm.intermediate,
            llm.vocab
        ),
        (2048, 16, 32, 8, 8192, 128256)
    );
    assert!(llm.tie_embeddings);
    assert_eq!(
        llama_params(llm),
        1_235_814_400,
        "Llama-3.2-1B's published count"
    );

    let v = m.vision.as_ref().expect("a vision tower");
    assert_eq!(
        (
            v.hidden_size,
            v.num_layers,
            v.num_heads,
            v.intermediate_size
        ),
        (1152, 27, 16, 4304)
    );
    // 27 x 27 patches of 14 (HF's 384 px input gives the same grid; Braid needs a multiple).
    assert_eq!((v.image_size, v.patch_size), (378, 14));
    let vp = encoder_params(v.num_layers, v.hidden_size, v.intermediate_size);
    assert!(
        (400_000_000..440_000_000).contains(&vp),
        "SigLIP-so400m blocks: {vp}"
    );

    let a = m.audio.as_ref().expect("an audio encoder");
    assert_eq!(
        (
            a.d_model,
            a.encoder_layers,
            a.encoder_attention_heads,
            a.encoder_ffn_dim
        ),
        (768, 12, 12, 3072)
    );
    let ap = encoder_params(a.encoder_layers, a.d_model, a.encoder_ffn_dim);
    assert!(
        (80_000_000..90_000_000).contains(&ap),
        "Whisper-small encoder blocks: {ap}"
    );

    assert_eq!(cfg.train.batch_rows, Some(8));
    let data =
        std::fs::read_to_string(repo().join("configs/data-gpu-1b.toml")).expect("data config");
    assert!(
        data.contains("max_seq_len = 4096")
            && data.contains("size = 378")
            && data.contains("patch = 14")
    );
}
