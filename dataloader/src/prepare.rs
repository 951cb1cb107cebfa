//! One raw sample -> a validated, tokenized sample with its stored media and metadata: the
//! per-sample work of `braid pack`, or the reason the sample is rejected.
//!
//! Every image and clip is decoded in full here, even when the shards keep the original bytes:
//! a corrupt file must be a reject at pack time, not a crash at step 10,000. Decoders run under
//! `catch_unwind`, so a third-party decoder that panics on hostile bytes rejects one sample.

use std::io::Read;

use serde::{Deserialize, Serialize};

use crate::config::{AudioSpec, DataConfig, MediaStorage, VisionSpec};
use crate::cost::SampleMeta;
use crate::media::audio::{AudioDecoder, AudioError};
use crate::media::image::{ImageConfig, decode_resized_rgb8};
use crate::read::{Media, MediaBytes, RawPart, RawSample, Reject};
use crate::tokenize::{
    CompiledTemplate, Message, Part, PlaceholderCounts, TokenizeError, TokenizedSample, Tokenizer,
};

/// Where in `braid pack` a sample was rejected.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord, Hash, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Stage {
    /// The input record (JSON, paths, tar members, Parquet cells).
    Read,
    /// Decoding an image or clip.
    Media,
    /// The chat template and tokenizer.
    Tokenize,
    /// Packing (too long, a truncation through a placeholder span).
    Pack,
}

impl Stage {
    pub fn as_str(self) -> &'static str {
        match self {
            Stage::Read => "read",
            Stage::Media => "media",
            Stage::Tokenize => "tokenize",
            Stage::Pack => "pack",
        }
    }
}

/// One line of `rejects.jsonl`.
#[derive(Clone, Debug, PartialEq, Eq, Serialize, Deserialize)]
pub struct SampleReject {
    pub id: Option<String>,
    pub source: String,
    pub stage: Stage,
    /// Short reason name (`truncated`, `too_many_pixels`, `no_assistant_turn`, ...).
    pub kind: String,
    /// The full message.
    pub reason: String,
    /// The input file whose rest was lost with this reject ([`Reject::damaged_file`]);
    /// boxed to keep the type, returned by every sample's preparation, small.
    #[serde(default, skip_serializing_if = "Option::is_none")]
    pub damaged_file: Option<Box<str>>,
}

impl SampleReject {
    /// A reader's reject, its kind read off the reader's message.
    pub fn read(r: Reject) -> SampleReject {
        SampleReject {
            id: r.id,
            source: r.source,
            stage: Stage::Read,
            kind: match r.damaged_file {
                Some(_) => "damaged_file",
                None => read_kind(&r.reason),
            }
            .into(),
            reason: r.reason,
            damaged_file: r.damaged_file.map(String::into_boxed_str),
        }
    }
}

/// How an item's bytes are stored in a shard.
#[derive(Clone, Copy, Debug, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "snake_case")]
pub enum MediaEncoding {
    /// (size, size, 3) packed RGB8, resized (+ cropped) per the `[image]` config.
    Rgb8,
    /// Mono 16 kHz 16-bit little-endian PCM.
    PcmS16le,
    /// The original file bytes.
    Encoded,
}

impl MediaEncoding {
    pub fn as_str(self) -> &'static str {
        match self {
            MediaEncoding::Rgb8 => "rgb8",
            MediaEncoding::PcmS16le => "pcm_s16le",
            MediaEncoding::Encoded => "encoded",
        }
    }

    pub fn parse(s: &str) -> Option<MediaEncoding> {
        match s {
            "rgb8" => Some(MediaEncoding::Rgb8),
            "pcm_s16le" => Some(MediaEncoding::PcmS16le),
            "encoded" => Some(MediaEncoding::Encoded),
            _ => None,
        }
    }
}

/// An image or clip as a shard stores it.
#[derive(Clone, PartialEq, Eq)]
pub struct StoredMedia {
    /// The input's name for it (path, tar member, Parquet cell).
    pub name: String,
    pub encoding: MediaEncoding,
    pub data: Vec<u8>,
}

impl std::fmt::Debug for StoredMedia {
    fn fmt(&self, f: &mut std::fmt::Formatter<'_>) -> std::fmt::Result {
        write!(
            f,
            "StoredMedia({:?}, {}, {} bytes)",
            self.name,
            self.encoding.as_str(),
            self.data.len()
        )
    }
}

/// A sample ready for packing.
#[derive(Clone, Debug, PartialEq)]
pub struct Prepared {
    pub id: String,
    pub source: String,
    pub tokens: TokenizedSample,
    /// Lengths per modality; `images[k]` / `audio[k]` describe `images` / `audio` below.
    pub meta: SampleMeta,
    pub images: Vec<StoredMedia>,
    pub audio: Vec<StoredMedia>,
}

impl Prepared {
    /// Cuts the sample to `keep` (the packer's truncated metadata): tokens past `keep.llm_len`
    /// and the media whose placeholders lay there are dropped.
    pub fn truncate_to(&mut self, keep: &SampleMeta) {
        let n = keep.llm_len as usize;
        self.tokens.ids.truncate(n);
        self.tokens.loss_mask.truncate(n);
        self.tokens.image_spans.truncate(keep.images.len());
        self.tokens.audio_spans.truncate(keep.audio.len());
        self.tokens.text_tokens = keep.text_tokens as usize;
        self.images.truncate(keep.images.len());
        self.audio.truncate(keep.audio.len());
        self.meta = keep.clone();
    }

    /// Bytes this sample takes in memory (for bounded buffers).
    pub fn heap_bytes(&self) -> usize {
        let media: usize = self
            .images
            .iter()
            .chain(&self.audio)
            .map(|m| m.data.len())
            .sum();
        self.tokens.ids.len() * 5 + media + self.id.len() + self.source.len()
    }
}

/// The per-sample work, shared by the pack workers.
#[derive(Debug)]
pub struct Preparer<'t> {
    template: CompiledTemplate<'t>,
    vision: VisionSpec,
    image: ImageConfig,
    audio: AudioSpec,
    media: MediaStorage,
}

impl<'t> Preparer<'t> {
    /// Compiles the template against the tokenizer (fails when a placeholder is not a token).
    pub fn new(cfg: &DataConfig, tokenizer: &'t dyn Tokenizer) -> Result<Self, TokenizeError> {
        Ok(Preparer {
            template: CompiledTemplate::new(&cfg.template, tokenizer)?,
            vision: cfg.image.clone(),
            image: cfg.image.image_config(),
            audio: cfg.audio.clone(),
            media: cfg.shards.media,
        })
    }

    /// A fresh audio decoder for one worker (it caches resampler plans).
    pub fn audio_decoder(&self) -> Result<AudioDecoder, AudioError> {
        AudioDecoder::new(self.audio.decode.clone())
    }

    /// Decodes, tokenizes and measures one sample.
    pub fn prepare(
        &self,
        raw: RawSample,
        audio_dec: &mut AudioDecoder,
    ) -> Result<Prepared, SampleReject> {
        let reject = |stage, kind: &str, reason: String| SampleReject {
            id: Some(raw.id.clone()),
            source: raw.source.clone(),
            stage,
            kind: kind.into(),
            reason,
            damaged_file: None,
        };
        let mut images = Vec::new();
        let mut audio = Vec::new();
        let mut clip_samples = Vec::new();
        let mut messages = Vec::with_capacity(raw.messages.len());
        for m in &raw.messages {
            let mut parts = Vec::with_capacity(m.parts.len());
            for p in &m.parts {
                match p {
                    RawPart::Text(t) => parts.push(Part::Text(t.clone())),
                    RawPart::Image(media) => {
                        let bytes = self
                            .load(media, self.image.max_bytes)
                            .map_err(|(k, r)| reject(Stage::Media, k, r))?;
                        let rgb = guarded(&media.name, || {
                            decode_resized_rgb8(&bytes, &media.name, &self.image)
                                .map_err(|e| (e.kind(), e.to_string()))
                        })
                        .map_err(|(k, r)| reject(Stage::Media, k, r))?;
                        let (encoding, data) = match self.media {
                            MediaStorage::Preprocessed => (MediaEncoding::Rgb8, rgb),
                            MediaStorage::Original => (MediaEncoding::Encoded, bytes),
                        };
                        parts.push(Part::Image(images.len()));
                        images.push(StoredMedia {
                            name: media.name.clone(),
                            encoding,
                            data,
                        });
                    }
                    RawPart::Audio(media) => {
                        let max = self.audio.decode.max_bytes as u64;
                        let bytes = self
                            .load(media, max)
                            .map_err(|(k, r)| reject(Stage::Media, k, r))?;
                        let pcm = guarded(&media.name, || {
                            audio_dec
                                .decode(&bytes, &media.name)
                                .map_err(|e| (e.kind(), e.to_string()))
                        })
                        .map_err(|(k, r)| reject(Stage::Media, k, r))?;
                        clip_samples.push(pcm.len());
                        let (encoding, data) = match self.media {
                            MediaStorage::Preprocessed => {
                                (MediaEncoding::PcmS16le, to_pcm_s16(&pcm))
                            }
                            MediaStorage::Original => (MediaEncoding::Encoded, bytes),
                        };
                        parts.push(Part::Audio(audio.len()));
                        audio.push(StoredMedia {
                            name: media.name.clone(),
                            encoding,
                            data,
                        });
                    }
                }
            }
            messages.push(Message {
                role: m.role,
                parts,
            });
        }
        let image_tokens = self
            .vision
            .llm_tokens()
            .map_err(|e| reject(Stage::Tokenize, "geometry", e.to_string()))?;
        let counts = PlaceholderCounts {
            images: vec![image_tokens; images.len()],
            audio: clip_samples
                .iter()
                .map(|&n| self.audio.llm_tokens(n))
                .collect::<Result<_, _>>()
                .map_err(|e| reject(Stage::Tokenize, "geometry", e.to_string()))?,
        };
        let tokens = self
            .template
            .tokenize(&messages, &counts)
            .map_err(|e| reject(Stage::Tokenize, tokenize_kind(&e), e.to_string()))?;
        let meta = self
            .meta(&tokens, &clip_samples)
            .map_err(|r| reject(Stage::Tokenize, "inconsistent_meta", r))?;
        Ok(Prepared {
            id: raw.id,
            source: raw.source,
            tokens,
            meta,
            images,
            audio,
        })
    }

    /// The sample's metadata from its token layout; checks that every span has the length the
    /// encoders will produce.
    fn meta(&self, t: &TokenizedSample, clip_samples: &[usize]) -> Result<SampleMeta, String> {
        let mut images = Vec::with_capacity(t.image_spans.len());
        for (k, &(start, len)) in t.image_spans.iter().enumerate() {
            let m = self.vision.meta(start as u32).map_err(|e| e.to_string())?;
            if m.llm_tokens as usize != len {
                return Err(format!(
                    "image {k}: span of {len} tokens, expected {}",
                    m.llm_tokens
                ));
            }
            images.push(m);
        }
        let mut audio = Vec::with_capacity(t.audio_spans.len());
        for (k, (&(start, len), &n)) in t.audio_spans.iter().zip(clip_samples).enumerate() {
            let m = self
                .audio
                .meta(n, start as u32)
                .map_err(|e| e.to_string())?;
            if m.llm_tokens as usize != len {
                return Err(format!(
                    "clip {k}: span of {len} tokens, expected {}",
                    m.llm_tokens
                ));
            }
            audio.push(m);
        }
        let meta = SampleMeta::new(t.text_tokens as u32, images, audio);
        if meta.llm_len as usize != t.len() {
            return Err(format!(
                "{} tokens but metadata says {}",
                t.len(),
                meta.llm_len
            ));
        }
        meta.validate().map_err(|e| e.to_string())?;
        Ok(meta)
    }

    /// The item's bytes: a file (size checked before reading, read through a limit in case it
    /// grows) or the inline bytes.
    fn load(&self, media: &Media, max: u64) -> Result<Vec<u8>, (&'static str, String)> {
        match &media.bytes {
            MediaBytes::Inline(b) => Ok(b.clone()),
            MediaBytes::Path(p) => {
                let io = |e: std::io::Error| ("missing_file", format!("{}: {e}", media.name));
                let f = std::fs::File::open(p).map_err(io)?;
                let len = f.metadata().map_err(io)?.len();
                if len > max {
                    let msg = format!("{}: {len} bytes exceeds the limit of {max}", media.name);
                    return Err(("too_many_bytes", msg));
                }
                let mut buf = Vec::with_capacity(len as usize);
                f.take(max + 1).read_to_end(&mut buf).map_err(io)?;
                if buf.len() as u64 > max {
                    let msg = format!("{}: grew past the limit of {max} bytes", media.name);
                    return Err(("too_many_bytes", msg));
                }
                Ok(buf)
            }
        }
    }
}

/// Runs a decoder; a panic inside it becomes a `corrupt` reject.
fn guarded<T>(
    name: &str,
    f: impl FnOnce() -> Result<T, (&'static str, String)>,
) -> Result<T, (&'static str, String)> {
    crate::guard::catch(f)
        .unwrap_or_else(|why| Err(("corrupt", format!("{name}: the decoder panicked: {why}"))))
}

/// f32 in [-1, 1] -> 16-bit PCM (clamped, rounded). The quantization step (2^-15 of full scale,
/// -90 dB) is below the Whisper log-mel's floor (80 dB under the clip's peak).
pub fn to_pcm_s16(x: &[f32]) -> Vec<u8> {
    let mut out = Vec::with_capacity(x.len() * 2);
    for &v in x {
        let s = (v.clamp(-1.0, 1.0) * 32767.0).round() as i16;
        out.extend_from_slice(&s.to_le_bytes());
    }
    out
}

/// 16-bit PCM -> f32 (the inverse scaling of [`to_pcm_s16`]).
pub fn from_pcm_s16(bytes: &[u8]) -> Vec<f32> {
    bytes
        .chunks_exact(2)
        .map(|b| f32::from(i16::from_le_bytes([b[0], b[1]])) / 32767.0)
        .collect()
}

/// Short name of a reader's reject, for counts: the readers' messages are the source of truth
/// (read/*.rs), this only groups them; anything unrecognised counts as `invalid_record`.
fn read_kind(reason: &str) -> &'static str {
    const KINDS: [(&str, &str); 10] = [
        ("malformed JSON", "malformed_json"),
        ("UTF-8", "invalid_utf8"),
        ("missing file", "missing_file"),
        ("(symlink", "path_escape"),
        ("escapes the dataset root", "path_escape"),
        ("is absolute", "path_escape"),
        ("absolute name", "path_escape"),
        ("'..' component", "path_escape"),
        ("without an image", "placeholder_mismatch"),
        ("placeholder", "placeholder_mismatch"),
    ];
    KINDS
        .iter()
        .find(|(needle, _)| reason.contains(needle))
        .map_or("invalid_record", |(_, kind)| kind)
}

/// Short name of a tokenization failure, for reject counts.
pub fn tokenize_kind(e: &TokenizeError) -> &'static str {
    match e {
        TokenizeError::Load { .. } => "tokenizer_load",
        TokenizeError::Library { .. } => "tokenizer",
        TokenizeError::InvalidId { .. } => "invalid_id",
        TokenizeError::Template(_) | TokenizeError::UnknownToken { .. } => "template",
        TokenizeError::EmptyConversation => "empty_conversation",
        TokenizeError::InvalidRole { .. } => "invalid_role",
        TokenizeError::SystemNotFirst { .. } => "system_not_first",
        TokenizeError::NoAssistantTurn => "no_assistant_turn",
        TokenizeError::MissingCount { .. }
        | TokenizeError::ZeroCount { .. }
        | TokenizeError::MediaOrder { .. }
        | TokenizeError::UnreferencedMedia { .. } => "media_mismatch",
        TokenizeError::NoPlaceholder { .. } => "no_placeholder",
        TokenizeError::ReservedTokenInText { .. } => "reserved_token_in_text",
        TokenizeError::Geometry { .. } => "geometry",
    }
}
