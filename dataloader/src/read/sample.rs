//! The reader output: one raw (undecoded, untokenized) chat sample, or the reason a record was rejected.

use std::fmt;
use std::path::PathBuf;

/// Who speaks a message: the tokenizer's role. Every input format maps its own role names
/// (`human`/`gpt`, ...) onto it.
pub use crate::tokenize::Role;

/// Where a media item's encoded bytes are. Decoding is not the reader's job.
#[derive(Clone, PartialEq, Eq)]
pub enum MediaBytes {
    /// A file inside the dataset root: canonical, checked to stay inside the root, and a
    /// regular file at the time it was read (`paths::DatasetRoot::resolve`).
    Path(PathBuf),
    /// Bytes carried by the input itself (a tar member, a Parquet `struct{bytes, path}` cell).
    Inline(Vec<u8>),
}

impl fmt::Debug for MediaBytes {
    // Inline media can be megabytes: print the length, not the bytes.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match self {
            MediaBytes::Path(p) => f.debug_tuple("Path").field(p).finish(),
            MediaBytes::Inline(b) => write!(f, "Inline({} bytes)", b.len()),
        }
    }
}

/// One image or audio clip, still encoded.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Media {
    pub bytes: MediaBytes,
    /// A human-readable name for messages and rejects: the path as written in the input, the
    /// tar member name, or the Parquet `path` field (or `file.parquet:row:column` without one).
    pub name: String,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub enum RawPart {
    Text(String),
    Image(Media),
    Audio(Media),
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawMessage {
    pub role: Role,
    /// In reading order: an image part sits where its placeholder goes.
    pub parts: Vec<RawPart>,
}

#[derive(Debug, Clone, PartialEq, Eq)]
pub struct RawSample {
    /// The record's own id, or its `source` when the record has none.
    pub id: String,
    /// Where the record came from: `file:line` (JSONL), `file[index]` (LLaVA array element),
    /// `shard.tar:key` (WebDataset), `file.parquet:row`.
    pub source: String,
    pub messages: Vec<RawMessage>,
}

impl RawSample {
    /// All media parts in order, with whether each is an image (`true`) or audio (`false`).
    pub fn media(&self) -> impl Iterator<Item = (&Media, bool)> {
        self.messages.iter().flat_map(|m| {
            m.parts.iter().filter_map(|p| match p {
                RawPart::Image(media) => Some((media, true)),
                RawPart::Audio(media) => Some((media, false)),
                RawPart::Text(_) => None,
            })
        })
    }
}

/// A record that could not be read. The iteration goes on after it; `pack` writes it to
/// `rejects.jsonl`.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Reject {
    /// The record's id when it could be read before the failure.
    pub id: Option<String>,
    /// Same form as `RawSample::source`; a whole-file failure uses the file name alone.
    pub source: String,
    pub reason: String,
    /// The input file whose rest (or all) could not be read (a truncated or corrupt
    /// archive, a failing disk): its unread records are lost uncounted, so `braid pack`
    /// counts such files against `pack.max_reject_ratio` on their own.
    pub damaged_file: Option<String>,
}

impl Reject {
    pub fn new(id: Option<String>, source: impl Into<String>, reason: impl Into<String>) -> Self {
        Reject {
            id,
            source: source.into(),
            reason: reason.into(),
            damaged_file: None,
        }
    }

    /// A failure that loses the rest of input file `file` (all of it if nothing was read).
    pub fn damaged(
        id: Option<String>,
        source: impl Into<String>,
        file: impl Into<String>,
        reason: impl Into<String>,
    ) -> Self {
        Reject {
            damaged_file: Some(file.into()),
            ..Reject::new(id, source, reason)
        }
    }
}

impl fmt::Display for Reject {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        match &self.id {
            Some(id) => write!(f, "{} (id {id:?}): {}", self.source, self.reason),
            None => write!(f, "{}: {}", self.source, self.reason),
        }
    }
}
