//! `ByteTokenizer`: UTF-8 bytes as ids 0..=255 plus a few special tokens above 255; the
//! tokenizer used when none is given (any text encodes, nothing to load).

use super::{Result, TokenizeError, Tokenizer};

/// The special tokens of [`ByteTokenizer`], id = 256 + position.
pub const BYTE_SPECIAL_TOKENS: [&str; 5] = [
    "<|im_start|>",
    "<|im_end|>",
    "<|image|>",
    "<|audio|>",
    "<|endoftext|>",
];

/// Byte-level tokenizer: `encode` is the text's UTF-8 bytes; ids 256.. are
/// [`BYTE_SPECIAL_TOKENS`].
#[derive(Clone, Copy, Debug, Default)]
pub struct ByteTokenizer;

impl ByteTokenizer {
    pub fn new() -> Self {
        ByteTokenizer
    }
}

impl Tokenizer for ByteTokenizer {
    fn encode(&self, text: &str) -> Result<Vec<u32>> {
        Ok(text.bytes().map(u32::from).collect())
    }

    fn token_id(&self, token: &str) -> Option<u32> {
        BYTE_SPECIAL_TOKENS
            .iter()
            .position(|&t| t == token)
            .map(|i| 256 + i as u32)
    }

    fn special_tokens(&self) -> Vec<(String, u32)> {
        BYTE_SPECIAL_TOKENS
            .iter()
            .enumerate()
            .map(|(i, t)| (t.to_string(), 256 + i as u32))
            .collect()
    }

    /// Bytes are decoded as UTF-8 with invalid sequences replaced by U+FFFD.
    fn decode(&self, ids: &[u32]) -> Result<String> {
        let mut out = String::new();
        let mut bytes = Vec::new();
        for &id in ids {
            if let Ok(b) = u8::try_from(id) {
                bytes.push(b);
                continue;
            }
            let special = usize::try_from(id - 256)
                .ok()
                .and_then(|i| BYTE_SPECIAL_TOKENS.get(i))
                .ok_or(TokenizeError::InvalidId {
                    id,
                    vocab_size: self.vocab_size(),
                })?;
            out.push_str(&String::from_utf8_lossy(&bytes));
            bytes.clear();
            out.push_str(special);
        }
        out.push_str(&String::from_utf8_lossy(&bytes));
        Ok(out)
    }

    fn vocab_size(&self) -> usize {
        256 + BYTE_SPECIAL_TOKENS.len()
    }
}
