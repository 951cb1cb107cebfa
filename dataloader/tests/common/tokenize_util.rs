//! Tokenization test helpers: ByteTokenizer special ids, fixture loading, message builders and
//! the structural invariants every tokenized sample must satisfy.

use std::path::PathBuf;

use braid_dataloader::tokenize::{
    HfTokenizer, Message, Part, PlaceholderCounts, Role, TokenizedSample,
};
use serde_json::Value;

// ByteTokenizer special ids.
pub const IM_START: u32 = 256;
pub const IM_END: u32 = 257;
pub const IMAGE: u32 = 258;
pub const AUDIO: u32 = 259;
pub const EOT: u32 = 260;

pub fn fixture(name: &str) -> PathBuf {
    PathBuf::from(env!("CARGO_MANIFEST_DIR"))
        .join("tests/fixtures/tokenizer")
        .join(name)
}

pub fn tiny() -> HfTokenizer {
    HfTokenizer::from_file(fixture("tiny_bpe.json")).unwrap()
}

pub fn json(name: &str) -> Value {
    serde_json::from_str(&std::fs::read_to_string(fixture(name)).unwrap()).unwrap()
}

pub fn ids_of(v: &Value) -> Vec<u32> {
    v.as_array()
        .unwrap()
        .iter()
        .map(|x| x.as_u64().unwrap() as u32)
        .collect()
}

pub fn bytes(s: &str) -> Vec<u32> {
    s.bytes().map(u32::from).collect()
}

pub fn user(parts: Vec<Part>) -> Message {
    Message {
        role: Role::User,
        parts,
    }
}

pub fn text(s: &str) -> Part {
    Part::Text(s.into())
}

pub fn counts(images: &[usize], audio: &[usize]) -> PlaceholderCounts {
    PlaceholderCounts {
        images: images.to_vec(),
        audio: audio.to_vec(),
    }
}

/// Structural invariants every tokenized sample must satisfy.
pub fn check_invariants(s: &TokenizedSample, image_pad: u32, audio_pad: Option<u32>) {
    assert_eq!(s.ids.len(), s.loss_mask.len());
    assert!(s.loss_mask.iter().all(|&m| m <= 1));
    let mut last_end = 0;
    let mut spans: Vec<_> = s.image_spans.iter().map(|&sp| (sp, image_pad)).collect();
    spans.extend(
        s.audio_spans
            .iter()
            .map(|&sp| (sp, audio_pad.unwrap_or(u32::MAX))),
    );
    spans.sort();
    let mut total = 0;
    for ((start, len), pad) in spans {
        assert!(start >= last_end && len > 0 && start + len <= s.ids.len());
        assert!(
            s.ids[start..start + len].iter().all(|&id| id == pad),
            "span {start}+{len}"
        );
        assert!(s.loss_mask[start..start + len].iter().all(|&m| m == 0));
        last_end = start + len;
        total += len;
    }
    assert_eq!(s.text_tokens, s.ids.len() - total);
    // No placeholder outside a span.
    let pads = s
        .ids
        .iter()
        .filter(|&&id| id == image_pad || Some(id) == audio_pad)
        .count();
    assert_eq!(pads, total);
}
