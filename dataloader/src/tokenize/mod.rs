//! Tokenization: the [`Tokenizer`] trait (a Hugging Face `tokenizer.json` or a byte-level
//! fallback), chat messages, and the chat template that turns a conversation into token
//! ids, a loss mask and the spans of image / audio placeholder tokens.
//!
//! Layout of a sample (default ChatML, as Qwen uses):
//!
//! ```text
//! [BOS] <|im_start|>system\n{system}<|im_end|>\n
//!       <|im_start|>user\n[<begin>]<pad> x count[<end>]{text}<|im_end|>\n
//!       <|im_start|>assistant\n{answer}<|im_end|>\n  [EOS]
//! ```
//!
//! Message text is encoded as plain text: a special token typed by a user (a literal
//! `<|image_pad|>`) becomes ordinary text tokens, never a placeholder or a turn marker.
//! Only the template's own strings are split on special tokens.

mod byte;
mod chat;
pub mod files;
mod hf;
mod media_tokens;

pub use byte::ByteTokenizer;
pub use chat::{ChatTemplate, CompiledTemplate, LossOn, MediaFormat, RoleFormat, tokenize_sample};
pub use hf::HfTokenizer;
pub use media_tokens::check_media_tokens;

use std::fmt;
use std::str::FromStr;

/// Errors of tokenization; each names the input (message, image, clip, token) at fault.
#[derive(Debug, thiserror::Error)]
pub enum TokenizeError {
    #[error("tokenizer {path}: {reason}")]
    Load { path: String, reason: String },
    #[error("the tokenizer failed on {what}: {reason}")]
    Library { what: String, reason: String },
    #[error("token id {id} is outside the vocabulary (size {vocab_size})")]
    InvalidId { id: u32, vocab_size: usize },
    #[error("chat template: {0}")]
    Template(String),
    #[error("chat template: {what} `{token}` is not a single token of this tokenizer")]
    UnknownToken { what: String, token: String },
    #[error("empty conversation: no messages")]
    EmptyConversation,
    #[error("invalid role `{role}` (expected system, user or assistant)")]
    InvalidRole { role: String },
    #[error("message {index}: a system message may only come first")]
    SystemNotFirst { index: usize },
    #[error("no assistant turn: the loss is on assistant tokens only, so nothing would be trained")]
    NoAssistantTurn,
    #[error(
        "message {message}: {modality} {index} is referenced but only {given} {modality} token counts were given"
    )]
    MissingCount {
        message: usize,
        modality: Modality,
        index: usize,
        given: usize,
    },
    #[error("message {message}: {modality} {index} expands to 0 placeholder tokens")]
    ZeroCount {
        message: usize,
        modality: Modality,
        index: usize,
    },
    #[error(
        "message {message}: {modality} {index} referenced out of order (expected {modality} {expected}; each is referenced once, in order)"
    )]
    MediaOrder {
        message: usize,
        modality: Modality,
        index: usize,
        expected: usize,
    },
    #[error(
        "{count} {modality} token count(s) given but only {referenced} {modality}(s) referenced"
    )]
    UnreferencedMedia {
        modality: Modality,
        count: usize,
        referenced: usize,
    },
    #[error("message {message}: cannot place {modality}: {reason}")]
    NoPlaceholder {
        message: usize,
        modality: Modality,
        reason: String,
    },
    #[error("message {message}: text encodes to the {what} token id {id}")]
    ReservedTokenInText {
        message: usize,
        what: &'static str,
        id: u32,
    },
    #[error("{what}: {reason}")]
    Geometry { what: &'static str, reason: String },
}

pub type Result<T, E = TokenizeError> = std::result::Result<T, E>;

/// A tokenizer: plain text to ids and back, and the ids of single (special) tokens.
pub trait Tokenizer: Send + Sync + fmt::Debug {
    /// Ids of `text` as plain text: no BOS/EOS or other post-processing added, and
    /// special tokens written in the text are NOT recognised (they encode as the
    /// characters they are made of).
    fn encode(&self, text: &str) -> Result<Vec<u32>>;
    /// The id of one token given by its text (a special token such as `<|im_end|>`);
    /// `None` when the text is not a single token of the vocabulary.
    fn token_id(&self, token: &str) -> Option<u32>;
    /// Special tokens `(text, id)`: the strings the chat template is split on.
    fn special_tokens(&self) -> Vec<(String, u32)>;
    /// Text of `ids`, special tokens included (for debugging and tests).
    fn decode(&self, ids: &[u32]) -> Result<String>;
    /// One past the largest id: every id this tokenizer produces is below it.
    fn vocab_size(&self) -> usize;
}

/// Speaker of a message.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Role {
    System,
    User,
    Assistant,
}

impl Role {
    pub fn as_str(self) -> &'static str {
        match self {
            Role::System => "system",
            Role::User => "user",
            Role::Assistant => "assistant",
        }
    }
}

impl fmt::Display for Role {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(self.as_str())
    }
}

impl FromStr for Role {
    type Err = TokenizeError;
    /// `system`, `user` or `assistant`, exactly (readers map `human`/`gpt` themselves).
    fn from_str(s: &str) -> Result<Self> {
        match s {
            "system" => Ok(Role::System),
            "user" => Ok(Role::User),
            "assistant" => Ok(Role::Assistant),
            _ => Err(TokenizeError::InvalidRole {
                role: s.chars().take(64).collect(),
            }),
        }
    }
}

/// Image or audio.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Hash)]
pub enum Modality {
    Image,
    Audio,
}

impl fmt::Display for Modality {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.write_str(match self {
            Modality::Image => "image",
            Modality::Audio => "audio clip",
        })
    }
}

/// One piece of a message: text, or the k-th image / audio clip of the sample.
#[derive(Clone, Debug, PartialEq, Eq)]
pub enum Part {
    Text(String),
    Image(usize),
    Audio(usize),
}

/// One turn of a conversation.
#[derive(Clone, Debug, PartialEq, Eq)]
pub struct Message {
    pub role: Role,
    pub parts: Vec<Part>,
}

impl Message {
    /// A message made of one text part.
    pub fn text(role: Role, text: impl Into<String>) -> Self {
        Message {
            role,
            parts: vec![Part::Text(text.into())],
        }
    }
}

/// How many placeholder tokens each image / clip of a sample expands to: `images[k]`
/// for image k (see [`vision_tokens`]), `audio[k]` for clip k (see [`audio_tokens`]).
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct PlaceholderCounts {
    pub images: Vec<usize>,
    pub audio: Vec<usize>,
}

/// A tokenized conversation.
#[derive(Clone, Debug, Default, PartialEq, Eq)]
pub struct TokenizedSample {
    /// (L) token ids.
    pub ids: Vec<u32>,
    /// (L) 1 where `ids[i]` is a training target (predicted from `ids[..i]`), else 0.
    /// Never 1 on a placeholder token.
    pub loss_mask: Vec<u8>,
    /// `(start, len)` of image k's placeholder run in `ids` (begin/end markers
    /// excluded), in image order, which is also position order.
    pub image_spans: Vec<(usize, usize)>,
    /// `(start, len)` of clip k's placeholder run, likewise.
    pub audio_spans: Vec<(usize, usize)>,
    /// Tokens that are not placeholders (template, markers and message text).
    pub text_tokens: usize,
}

impl TokenizedSample {
    /// L
    pub fn len(&self) -> usize {
        self.ids.len()
    }

    pub fn is_empty(&self) -> bool {
        self.ids.is_empty()
    }

    /// Number of training targets.
    pub fn loss_tokens(&self) -> usize {
        self.loss_mask.iter().map(|&m| m as usize).sum()
    }
}

/// LLM tokens one image of `h` x `w` pixels gives: a `(h / patch) x (w / patch)` patch
/// grid, merged `merge x merge` by the projector (Qwen2-VL; 1 for LLaVA), plus one when
/// the encoder's class token is kept as an LLM token (`class_token`; Braid's MLLM drops
/// CLIP's, as LLaVA's `"default"` feature select does). Sizes that do not divide are
/// errors: the image must be resized to a multiple of `patch * merge` first.
pub fn vision_tokens(
    h: usize,
    w: usize,
    patch: usize,
    merge: usize,
    class_token: bool,
) -> Result<usize> {
    let bad = |reason: String| TokenizeError::Geometry {
        what: "vision_tokens",
        reason,
    };
    if h == 0 || w == 0 || patch == 0 || merge == 0 {
        return Err(bad(format!(
            "image {h}x{w}, patch {patch}, merge {merge}: all must be >= 1"
        )));
    }
    let unit = patch
        .checked_mul(merge)
        .ok_or_else(|| bad("overflow".into()))?;
    if !h.is_multiple_of(unit) || !w.is_multiple_of(unit) {
        return Err(bad(format!(
            "image {h}x{w} is not a multiple of patch {patch} x merge {merge} = {unit}"
        )));
    }
    let n = (h / unit)
        .checked_mul(w / unit)
        .ok_or_else(|| bad("overflow".into()))?;
    Ok(n + usize::from(class_token))
}

/// LLM tokens one clip of `mel_frames` mel frames gives: the encoder's strided
/// convolution (kernel 3, padding 1: Whisper's conv2 with `conv_stride` 2) keeps
/// `ceil(F / conv_stride)` frames, the projector stacks `pool_stride` of them (the last
/// group zero-padded): `ceil(ceil(F / conv_stride) / pool_stride)`.
pub fn audio_tokens(mel_frames: usize, conv_stride: usize, pool_stride: usize) -> Result<usize> {
    if mel_frames == 0 || conv_stride == 0 || pool_stride == 0 {
        return Err(TokenizeError::Geometry {
            what: "audio_tokens",
            reason: format!(
                "{mel_frames} mel frames, conv stride {conv_stride}, pool stride {pool_stride}: all must be >= 1"
            ),
        });
    }
    Ok(mel_frames.div_ceil(conv_stride).div_ceil(pool_stride))
}
