//! The data config (`braid pack --config DATA.toml`): input, tokenizer, chat template, the image and
//! audio preprocessing with the encoders' token geometry, packing and shard settings.
//!
//! Every section is optional (defaults shown by `DataConfig::default()`); unknown keys are errors.
//!
//! ```toml
//! [input]     path = "data/train.jsonl"  format = "jsonl"     # or llava, wds, parquet; media_roots = [..]
//! [tokenizer] path = "tokenizer.json"                          # absent: byte-level
//! [template]  loss = "assistant_only"                          # ChatML by default
//! [image]     preset = "clip"  size = 224  patch = 14  merge = 1
//! [audio]     pool_stride = 4      [audio.decode]  n_mels = 80  max_seconds = 30
//! [pack]      max_seq_len = 4096  on_overflow = "truncate"
//! [shards]    media = "preprocessed"  max_shard_mib = 256
//! ```

use std::path::{Path, PathBuf};

use serde::{Deserialize, Serialize};

use crate::cost::{AudioMeta, ImageMeta};
use crate::media::audio::{AudioConfig, AudioError};
use crate::media::image::{Filter, ImageConfig, ImageError};
use crate::media::mel::MelExtractor;
use crate::pack::{PackConfig, PackError};
use crate::read::{Format, Limits, ParquetColumns, ReadConfig};
use crate::tokenize::{ChatTemplate, audio_tokens, vision_tokens};

/// A bad data config; the message names the key.
#[derive(Debug, thiserror::Error)]
pub enum ConfigError {
    #[error("data config {path}: {reason}")]
    Parse { path: String, reason: String },
    #[error("data config: {key}: {reason}")]
    Invalid { key: &'static str, reason: String },
    #[error("data config: {0}")]
    Image(#[from] ImageError),
    #[error("data config: [audio.decode] {0}")]
    Audio(#[from] AudioError),
    #[error("data config: [pack] {0}")]
    Pack(#[from] PackError),
}

fn invalid(key: &'static str, reason: impl Into<String>) -> ConfigError {
    ConfigError::Invalid {
        key,
        reason: reason.into(),
    }
}

/// The whole data config.
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct DataConfig {
    pub input: InputConfig,
    pub tokenizer: TokenizerConfig,
    pub template: ChatTemplate,
    pub image: VisionSpec,
    pub audio: AudioSpec,
    pub pack: PackConfig,
    pub shards: ShardConfig,
}

/// `[input]`: what `braid pack` reads (`--input`/`--format` override it).
#[derive(Clone, Debug, Default, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct InputConfig {
    pub path: Option<PathBuf>,
    pub format: Option<Format>,
    /// Folders of media the user trusts (`--media-root`): relative media paths are looked up
    /// in them, in order, before the manifest's folder, and symlinks into them are followed.
    /// JSONL, LLaVA/ShareGPT JSON and Parquet paths (WebDataset media are tar members).
    pub media_roots: Vec<PathBuf>,
    /// Deprecated, LLaVA's old key: one more media root (kept so old configs still read).
    #[serde(skip_serializing_if = "Option::is_none")]
    pub image_root: Option<PathBuf>,
    /// Parquet: which columns hold what.
    pub parquet: ParquetColumns,
}

/// `[tokenizer]`: a Hugging Face `tokenizer.json`, or the byte-level tokenizer when `path` is unset.
#[derive(Clone, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct TokenizerConfig {
    pub path: Option<PathBuf>,
}

/// The image processor a vision encoder was trained with.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum ImagePreset {
    /// Shortest-edge resize + centre crop, CLIP mean/std; the encoder has a class token.
    #[default]
    Clip,
    /// Exact resize, mean = std = 0.5; no class token.
    Siglip,
}

/// `[image]`: preprocessing of the vision encoder and how many tokens an image becomes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct VisionSpec {
    pub preset: ImagePreset,
    /// Square input side in pixels.
    pub size: usize,
    /// ViT patch side.
    pub patch: usize,
    /// Projector's spatial merge (`merge x merge` patches -> one LLM token; 1 = none).
    pub merge: usize,
    /// Keep the encoder's class token as an LLM token (LLaVA drops it).
    pub class_token: bool,
    /// Override the preset's resampling filter, mean and std.
    pub filter: Option<Filter>,
    pub mean: Option<[f32; 3]>,
    pub std: Option<[f32; 3]>,
    /// Decompression-bomb limits, checked on the header before decoding.
    pub max_pixels: u64,
    pub max_bytes: u64,
}

impl Default for VisionSpec {
    fn default() -> Self {
        let clip = ImageConfig::clip(224);
        VisionSpec {
            preset: ImagePreset::Clip,
            size: 224,
            patch: 14,
            merge: 1,
            class_token: false,
            filter: None,
            mean: None,
            std: None,
            max_pixels: clip.max_pixels,
            max_bytes: clip.max_bytes,
        }
    }
}

impl VisionSpec {
    /// The decoder settings.
    pub fn image_config(&self) -> ImageConfig {
        let mut c = match self.preset {
            ImagePreset::Clip => ImageConfig::clip(self.size),
            ImagePreset::Siglip => ImageConfig::siglip(self.size),
        };
        if let Some(f) = self.filter {
            c.filter = f;
        }
        if let Some(m) = self.mean {
            c.mean = m;
        }
        if let Some(s) = self.std {
            c.std = s;
        }
        c.max_pixels = self.max_pixels;
        c.max_bytes = self.max_bytes;
        c
    }

    /// Vision-encoder sequence length of one image (patches plus CLIP's class token).
    pub fn encoder_tokens(&self) -> usize {
        let side = self.size / self.patch.max(1);
        side * side + usize::from(self.preset == ImagePreset::Clip)
    }

    /// LLM placeholder tokens of one image.
    pub fn llm_tokens(&self) -> Result<usize, ConfigError> {
        vision_tokens(
            self.size,
            self.size,
            self.patch,
            self.merge,
            self.class_token,
        )
        .map_err(|e| invalid("image", e.to_string()))
    }

    /// The metadata of one image at LLM position `offset`.
    pub fn meta(&self, offset: u32) -> Result<ImageMeta, ConfigError> {
        Ok(ImageMeta {
            patches: self.encoder_tokens() as u32,
            llm_tokens: self.llm_tokens()? as u32,
            llm_offset: offset,
        })
    }
}

/// `[audio]`: decoding and how many tokens a clip becomes.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct AudioSpec {
    pub decode: AudioConfig,
    /// The audio encoder's conv stem stride (Whisper: 2).
    pub conv_stride: usize,
    /// The audio projector's frame stacking (1 = none).
    pub pool_stride: usize,
}

impl Default for AudioSpec {
    fn default() -> Self {
        AudioSpec {
            decode: AudioConfig::default(),
            conv_stride: 2,
            pool_stride: 4,
        }
    }
}

impl AudioSpec {
    /// The metadata of a clip of `samples` 16 kHz samples at LLM position `offset`.
    pub fn meta(&self, samples: usize, offset: u32) -> Result<AudioMeta, ConfigError> {
        let mel = MelExtractor::num_frames(samples);
        let tokens = audio_tokens(mel, self.conv_stride, self.pool_stride)
            .map_err(|e| invalid("audio", e.to_string()))?;
        Ok(AudioMeta {
            mel_frames: mel as u32,
            encoder_frames: mel.div_ceil(self.conv_stride) as u32,
            llm_tokens: tokens as u32,
            llm_offset: offset,
        })
    }

    /// LLM placeholder tokens of a clip of `samples` samples.
    pub fn llm_tokens(&self, samples: usize) -> Result<usize, ConfigError> {
        Ok(self.meta(samples, 0)?.llm_tokens as usize)
    }
}

/// What the shards hold for each image and clip.
#[derive(Clone, Copy, Debug, Default, PartialEq, Eq, Serialize, Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum MediaStorage {
    /// Images resized (+ cropped) to `size x size` RGB8, clips as 16 kHz mono 16-bit PCM: the
    /// loader only normalizes and computes the log-mel. Bound to this `[image]`/`[audio]` config.
    #[default]
    Preprocessed,
    /// The encoded bytes as read (validated by a full decode at pack time): smaller shards, the
    /// loader decodes again every epoch.
    Original,
}

/// The most decoding threads `braid pack` starts (`shards.threads`, `--threads`): past the
/// cores they only add memory, and each batch of work grows with them.
pub const MAX_PACK_THREADS: usize = 1024;

/// `[shards]`: the output files.
#[derive(Clone, Debug, PartialEq, Serialize, Deserialize)]
#[serde(deny_unknown_fields, default)]
pub struct ShardConfig {
    pub media: MediaStorage,
    /// A shard is closed after the row group that takes it past this size.
    pub max_shard_mib: u64,
    /// A row group (whole packs) is closed past this much buffered data.
    pub row_group_mib: u64,
    pub zstd_level: i32,
    /// Decoding threads for `braid pack` (0: all cores).
    pub threads: usize,
}

impl Default for ShardConfig {
    fn default() -> Self {
        ShardConfig {
            media: MediaStorage::Preprocessed,
            max_shard_mib: 256,
            row_group_mib: 16,
            zstd_level: 3,
            threads: 0,
        }
    }
}

impl DataConfig {
    /// Parses TOML; `path` only labels errors.
    pub fn from_toml(text: &str, path: &str) -> Result<DataConfig, ConfigError> {
        toml::from_str(text).map_err(|e| ConfigError::Parse {
            path: path.into(),
            reason: e.to_string(),
        })
    }

    /// Reads and parses a TOML file; relative paths inside it are taken from its folder.
    pub fn from_file(path: &Path) -> Result<DataConfig, ConfigError> {
        let text = std::fs::read_to_string(path).map_err(|e| ConfigError::Parse {
            path: path.display().to_string(),
            reason: e.to_string(),
        })?;
        let mut cfg = DataConfig::from_toml(&text, &path.display().to_string())?;
        let base = path.parent().unwrap_or(Path::new("."));
        let rebase = |p: &mut Option<PathBuf>| {
            if let Some(q) = p.as_mut()
                && q.is_relative()
            {
                *q = base.join(&*q);
            }
        };
        rebase(&mut cfg.input.path);
        rebase(&mut cfg.input.image_root);
        for r in &mut cfg.input.media_roots {
            if r.is_relative() {
                *r = base.join(&*r);
            }
        }
        rebase(&mut cfg.tokenizer.path);
        Ok(cfg)
    }

    /// Checks every section; the error names the key.
    pub fn validate(&self) -> Result<(), ConfigError> {
        let v = &self.image;
        if v.patch == 0 || v.merge == 0 {
            return Err(invalid("image.patch/merge", "must be >= 1"));
        }
        if !v.size.is_multiple_of(v.patch * v.merge) {
            return Err(invalid(
                "image.size",
                format!(
                    "{} is not a multiple of patch {} x merge {}",
                    v.size, v.patch, v.merge
                ),
            ));
        }
        v.image_config().validate()?;
        self.audio.decode.validate()?;
        if self.audio.conv_stride == 0 || self.audio.pool_stride == 0 {
            return Err(invalid("audio.conv_stride/pool_stride", "must be >= 1"));
        }
        self.pack.validate()?;
        let s = &self.shards;
        if s.max_shard_mib == 0 || s.row_group_mib == 0 {
            return Err(invalid(
                "shards.max_shard_mib/row_group_mib",
                "must be >= 1",
            ));
        }
        if s.threads > MAX_PACK_THREADS {
            return Err(invalid(
                "shards.threads",
                format!(
                    "{}: at most {MAX_PACK_THREADS} decoding threads (0: one per core)",
                    s.threads
                ),
            ));
        }
        if !(1..=22).contains(&s.zstd_level) {
            return Err(invalid(
                "shards.zstd_level",
                format!("{} (1..=22)", s.zstd_level),
            ));
        }
        Ok(())
    }

    /// `[input] media_roots`, then the deprecated `image_root`.
    pub fn media_roots(&self) -> Vec<PathBuf> {
        let mut roots = self.input.media_roots.clone();
        roots.extend(self.input.image_root.clone());
        roots
    }

    /// The reader settings for `input` in `format`.
    pub fn read_config(&self, format: Format) -> ReadConfig {
        ReadConfig {
            format,
            media_roots: self.media_roots(),
            parquet: self.input.parquet.clone(),
            limits: Limits {
                max_member_bytes: self.image.max_bytes.max(self.audio.decode.max_bytes as u64),
                ..Limits::default()
            },
        }
    }
}
