//! `HfTokenizer`: any Hugging Face `tokenizer.json`, through the `tokenizers` crate
//! (built with `fancy-regex`: pure Rust, handles the look-ahead in Qwen's and Llama 3's
//! pre-tokenizer regexes).

use std::path::Path;

use super::{Result, TokenizeError, Tokenizer};

/// A Hugging Face tokenizer loaded from its `tokenizer.json`.
///
/// Encoding treats text as plain text: tokens flagged `special` in the file are not
/// recognised in it. Added tokens that are not special (Qwen3's `<think>`) are still
/// matched, as they are in the model's own training data.
#[derive(Debug)]
pub struct HfTokenizer {
    inner: tokenizers::Tokenizer,
    /// Every added token `(text, id)`, sorted by id.
    added: Vec<(String, u32)>,
    vocab_size: usize,
    source: String,
}

impl HfTokenizer {
    /// Loads a `tokenizer.json` file.
    pub fn from_file(path: impl AsRef<Path>) -> Result<Self> {
        let path = path.as_ref();
        let bytes = std::fs::read(path).map_err(|e| TokenizeError::Load {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        Self::from_bytes(&bytes, &path.display().to_string())
    }

    /// Parses the contents of a `tokenizer.json`; `source` names it in errors.
    pub fn from_bytes(bytes: &[u8], source: &str) -> Result<Self> {
        let load_err = |reason: String| TokenizeError::Load {
            path: source.to_string(),
            reason,
        };
        // A malformed file is a load error, whatever the library does with it.
        let parsed =
            crate::guard::catch(|| tokenizers::Tokenizer::from_bytes(bytes)).map_err(|why| {
                load_err(format!(
                    "the tokenizers library panicked while parsing: {why}"
                ))
            })?;
        let mut inner = parsed.map_err(|e| load_err(e.to_string()))?;
        // Samples are truncated (or rejected) by the packer, which counts them; a
        // truncation or padding setting saved in the file must not act silently.
        inner
            .with_truncation(None)
            .map_err(|e| load_err(e.to_string()))?;
        inner.with_padding(None);
        inner.set_encode_special_tokens(true);

        let mut added: Vec<(String, u32)> = inner
            .get_added_tokens_decoder()
            .into_iter()
            .map(|(id, t)| (t.content, id))
            .collect();
        added.sort_by_key(|&(_, id)| id);
        let vocab_size = inner
            .get_vocab(true)
            .values()
            .map(|&id| id as usize + 1)
            .max()
            .unwrap_or(0);
        if vocab_size == 0 {
            return Err(load_err("the vocabulary is empty".into()));
        }
        Ok(HfTokenizer {
            inner,
            added,
            vocab_size,
            source: source.to_string(),
        })
    }

    /// The file (or name) this tokenizer was loaded from.
    pub fn source(&self) -> &str {
        &self.source
    }

    /// The underlying `tokenizers` object.
    pub fn inner(&self) -> &tokenizers::Tokenizer {
        &self.inner
    }
}

impl Tokenizer for HfTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        let err = |reason: String| TokenizeError::Library {
            what: format!("{} bytes of text", text.len()),
            reason,
        };
        // Input text is untrusted: a panic inside the library is a rejected sample.
        let enc = crate::guard::catch(|| self.inner.encode_fast(text, false))
            .map_err(|why| err(format!("the tokenizers library panicked: {why}")))?
            .map_err(|e| err(e.to_string()))?;
        Ok(enc.get_ids().to_vec())
    }

    fn token_id(&self, token: &str) -> Option<u32> {
        self.inner.token_to_id(token)
    }

    fn special_tokens(&self) -> Vec<(String, u32)> {
        self.added.clone()
    }

    fn decode(&self, ids: &[u32]) -> Result<String> {
        if let Some(&id) = ids.iter().find(|&&id| id as usize >= self.vocab_size) {
            return Err(TokenizeError::InvalidId {
                id,
                vocab_size: self.vocab_size,
            });
        }
        self.inner
            .decode(ids, false)
            .map_err(|e| TokenizeError::Library {
                what: format!("decode of {} ids", ids.len()),
                reason: e.to_string(),
            })
    }

    fn vocab_size(&self) -> usize {
        self.vocab_size
    }
}
