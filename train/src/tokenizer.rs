//! The tokenizer files a run carries into every checkpoint and into the Hugging Face
//! export (`hf/llm/`), so that either alone is enough to generate and to load with
//! `AutoTokenizer`: read once at set-up from the packed dataset (or, for a dataset packed
//! before the files travelled with it, from the data config's `tokenizer.path`), checked
//! against the sha256 that `dataset.json` recorded at pack time.

use std::path::Path;

use braid_dataloader::dataset::DatasetInfo;
use braid_dataloader::tokenize::files::{
    TOKENIZER_CONFIG_JSON, TOKENIZER_JSON, tokenizer_sha256, tokenizer_sources,
};

use crate::error::{Result, TrainError, io_err};

/// (file name, bytes), `tokenizer.json` first; empty for the byte tokenizer.
pub type TokenizerFiles = Vec<(String, Vec<u8>)>;

/// The tokenizer files of the dataset at `dir`.
pub fn collect(
    dir: &Path,
    info: &DatasetInfo,
    log: &mut dyn FnMut(&str),
) -> Result<TokenizerFiles> {
    let tok = &info.tokenizer;
    if tok.kind != "hf" {
        return Ok(Vec::new());
    }
    let sources: Vec<(String, std::path::PathBuf)> = if tok.files.is_empty() {
        // Packed before the files were copied: the path it had at pack time.
        let Some(p) = info
            .settings
            .tokenizer
            .path
            .as_ref()
            .filter(|p| p.is_file())
        else {
            log(&format!(
                "warning: {} carries no tokenizer files and its tokenizer.path {} is gone: checkpoints and the export will hold no tokenizer",
                dir.display(),
                tok.path.as_deref().unwrap_or("(none)")
            ));
            return Ok(Vec::new());
        };
        tokenizer_sources(p)
            .into_iter()
            .map(|(n, p)| (n.to_string(), p))
            .collect()
    } else {
        tok.files.iter().map(|n| (n.clone(), dir.join(n))).collect()
    };
    let mut files = Vec::with_capacity(sources.len());
    for (name, path) in sources {
        // Bounded, regular files only: a tokenizer.json is megabytes.
        let bytes = braid_nn::files::read_limited(&path, 1 << 30)
            .map_err(io_err(&path, "read the tokenizer file"))?;
        if name == TOKENIZER_JSON
            && let Some(want) = &tok.sha256
        {
            let got = tokenizer_sha256(&bytes);
            if &got != want {
                return Err(TrainError::Data(format!(
                    "{}: sha256 {got}, but {} says the dataset was tokenized with sha256 {want}: the tokenizer changed since packing (pack again)",
                    path.display(),
                    dir.join("dataset.json").display()
                )));
            }
        }
        files.push((name, bytes));
    }
    Ok(files)
}

/// GPT-2's printable stand-in for each byte (what the `ByteLevel` pre-tokenizer maps bytes
/// to before the model looks them up).
fn byte_level_char(b: u8) -> char {
    let printable = |b: u8| matches!(b, b'!'..=b'~' | 0xA1..=0xAC | 0xAE..=0xFF);
    if printable(b) {
        return char::from(b);
    }
    let shift = (0..b).filter(|&c| !printable(c)).count() as u32;
    char::from_u32(256 + shift).unwrap_or(char::REPLACEMENT_CHARACTER)
}

/// A `tokenizer.json` that encodes exactly as [`ByteTokenizer`] does (byte `b` -> id `b`,
/// its specials at 256..): a byte-level BPE without merges, so the byte tokenizer's export
/// loads in `transformers` too.
///
/// [`ByteTokenizer`]: braid_dataloader::tokenize::ByteTokenizer
pub fn byte_tokenizer_json() -> serde_json::Value {
    use braid_dataloader::tokenize::{ByteTokenizer, Tokenizer};
    let vocab: serde_json::Map<String, serde_json::Value> = (0..=255u8)
        .map(|b| (byte_level_char(b).to_string(), serde_json::json!(b)))
        .collect();
    let added: Vec<serde_json::Value> = ByteTokenizer::new()
        .special_tokens()
        .into_iter()
        .map(|(t, id)| {
            serde_json::json!({"id": id, "content": t, "single_word": false, "lstrip": false,
                "rstrip": false, "normalized": false, "special": true})
        })
        .collect();
    let byte_level = serde_json::json!({"type": "ByteLevel", "add_prefix_space": false,
        "trim_offsets": false, "use_regex": false});
    serde_json::json!({
        "version": "1.0",
        "truncation": null,
        "padding": null,
        "added_tokens": added,
        "normalizer": null,
        "pre_tokenizer": byte_level,
        "post_processor": null,
        "decoder": byte_level,
        "model": {"type": "BPE", "dropout": null, "unk_token": null,
            "continuing_subword_prefix": null, "end_of_word_suffix": null, "fuse_unk": false,
            "byte_fallback": false, "ignore_merges": false, "vocab": vocab, "merges": []},
    })
}

/// `dir/name` for a carried file's `name`, which must be a plain file name: a name from a
/// hostile `dataset.json` must not write outside the checkpoint or export folder.
pub(crate) fn plain_child(dir: &Path, name: &str) -> Result<std::path::PathBuf> {
    if !braid_dataloader::shard::is_plain_file_name(name) {
        return Err(TrainError::Data(format!(
            "tokenizer file {name:?} is not a file name: refusing to write it outside {}",
            dir.display()
        )));
    }
    Ok(dir.join(name))
}

/// Writes `files` into `dir` (the export's `llm/`), adding a minimal
/// `tokenizer_config.json` when the source had none so `AutoTokenizer` loads the folder.
/// No files (the byte tokenizer): its equivalent [`byte_tokenizer_json`].
pub fn write_export(files: &TokenizerFiles, dir: &Path, model_max_length: usize) -> Result<()> {
    let byte;
    let files = if files.is_empty() {
        let text = serde_json::to_vec(&byte_tokenizer_json())
            .map_err(|e| TrainError::Other(e.to_string()))?;
        byte = vec![(TOKENIZER_JSON.to_string(), text)];
        &byte
    } else {
        files
    };
    std::fs::create_dir_all(dir).map_err(io_err(dir, "create"))?;
    for (name, bytes) in files {
        let p = plain_child(dir, name)?;
        std::fs::write(&p, bytes).map_err(io_err(&p, "write"))?;
    }
    if !files.iter().any(|(n, _)| n == TOKENIZER_CONFIG_JSON) {
        // The fast tokenizer class reads everything else from `tokenizer.json`.
        let cfg = serde_json::json!({
            "tokenizer_class": "PreTrainedTokenizerFast",
            "model_max_length": model_max_length,
            "clean_up_tokenization_spaces": false,
        });
        let p = dir.join(TOKENIZER_CONFIG_JSON);
        let text =
            serde_json::to_string_pretty(&cfg).map_err(|e| TrainError::Other(e.to_string()))?;
        std::fs::write(&p, text).map_err(io_err(&p, "write"))?;
    }
    Ok(())
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;
    use braid_dataloader::tokenize::{ByteTokenizer, HfTokenizer, Tokenizer};

    #[test]
    fn the_byte_tokenizers_export_encodes_and_decodes_like_it() {
        let bytes = serde_json::to_vec(&byte_tokenizer_json()).unwrap();
        let hf = HfTokenizer::from_bytes(&bytes, "byte export").unwrap();
        let byte = ByteTokenizer::new();
        for text in [
            "hello, world",
            " two  spaces\n\tand tabs",
            "caf\u{e9} \u{1f600} \u{0}\u{7f}",
        ] {
            let ids = byte.encode(text).unwrap();
            assert_eq!(hf.encode(text).unwrap(), ids, "{text:?}");
            assert_eq!(hf.decode(&ids).unwrap(), text);
        }
        assert_eq!(hf.vocab_size(), byte.vocab_size());
        for (t, id) in byte.special_tokens() {
            assert_eq!(hf.token_id(&t), Some(id), "{t}");
        }
    }
}
