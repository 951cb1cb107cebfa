//! The tokenizer's files as they travel with a packed dataset (and from there with every
//! checkpoint and the Hugging Face export): `tokenizer.json` under that name whatever it
//! was called at the source, plus the `tokenizer_config.json` and
//! `special_tokens_map.json` that sit beside it, when they do.

use std::path::Path;

/// The name the tokenizer itself has in a dataset, checkpoint or export folder.
pub const TOKENIZER_JSON: &str = "tokenizer.json";
/// Hugging Face's tokenizer config (the export writes a minimal one when the source had none).
pub const TOKENIZER_CONFIG_JSON: &str = "tokenizer_config.json";
/// Hugging Face's companion files, copied when they sit beside the tokenizer.
pub const COMPANION_FILES: [&str; 2] = [TOKENIZER_CONFIG_JSON, "special_tokens_map.json"];

/// The SHA-256 of a `tokenizer.json`'s bytes as `dataset.json` records it (lowercase hex):
/// written at pack time, checked when a run starts.
pub fn tokenizer_sha256(bytes: &[u8]) -> String {
    use sha2::{Digest, Sha256};
    crate::shard::hex(&Sha256::digest(bytes))
}

/// Whether `name` is one of the files [`copy_tokenizer_files`] writes.
pub fn is_tokenizer_file(name: &str) -> bool {
    name == TOKENIZER_JSON || COMPANION_FILES.contains(&name)
}

/// The files to carry for the tokenizer at `tokenizer` (a `tokenizer.json`, any name):
/// (name in the destination, source path), the tokenizer first.
pub fn tokenizer_sources(tokenizer: &Path) -> Vec<(&'static str, std::path::PathBuf)> {
    let mut out = vec![(TOKENIZER_JSON, tokenizer.to_path_buf())];
    let dir = tokenizer.parent().unwrap_or(Path::new("."));
    for name in COMPANION_FILES {
        let p = dir.join(name);
        if p.is_file() {
            out.push((name, p));
        }
    }
    out
}

/// Copies the tokenizer at `tokenizer` and its companions into `dest`; returns the names
/// written, the tokenizer first. The error names the file that failed.
pub fn copy_tokenizer_files(tokenizer: &Path, dest: &Path) -> Result<Vec<String>, String> {
    let mut names = Vec::new();
    for (name, src) in tokenizer_sources(tokenizer) {
        let to = dest.join(name);
        // Packing with the tokenizer a dataset already carries: copying a file onto
        // itself would truncate it.
        let same = matches!(
            (src.canonicalize(), to.canonicalize()),
            (Ok(a), Ok(b)) if a == b
        );
        if same {
            names.push(name.to_string());
            continue;
        }
        std::fs::copy(&src, &to).map_err(|e| {
            format!(
                "cannot copy the tokenizer file {} to {}: {e}",
                src.display(),
                to.display()
            )
        })?;
        names.push(name.to_string());
    }
    Ok(names)
}

#[cfg(test)]
mod tests {
    #![allow(clippy::unwrap_used)]
    use super::*;

    #[test]
    fn the_tokenizer_is_renamed_and_its_companions_follow() {
        let src = tempfile::tempdir().unwrap();
        let dest = tempfile::tempdir().unwrap();
        std::fs::write(src.path().join("qwen.json"), b"{}").unwrap();
        std::fs::write(src.path().join("tokenizer_config.json"), b"{\"a\":1}").unwrap();
        let names = copy_tokenizer_files(&src.path().join("qwen.json"), dest.path()).unwrap();
        assert_eq!(names, ["tokenizer.json", "tokenizer_config.json"]);
        assert_eq!(
            std::fs::read(dest.path().join("tokenizer.json")).unwrap(),
            b"{}"
        );
        assert!(!dest.path().join("special_tokens_map.json").exists());
        assert!(is_tokenizer_file("special_tokens_map.json") && !is_tokenizer_file("x.json"));
    }
}
