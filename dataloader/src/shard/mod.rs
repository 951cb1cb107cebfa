//! Packed dataset on disk: Parquet shards (zstd) of samples in pack order, one row per sample.
//!
//! Columns (a pack is the run of consecutive rows with the same `pack`; packs never straddle a
//! row group, so one pack reads from one row group):
//!
//! | column | type | |
//! |---|---|---|
//! | `pack` | uint64 | global pack index, ascending through the shards |
//! | `id`, `source` | string | the input record's id and where it came from |
//! | `ids` | list<uint32> | (L) token ids |
//! | `loss_mask` | list<uint8> | (L) 1 where the token is a training target |
//! | `text_tokens`, `llm_len` | uint32 | lengths (see `cost::SampleMeta`) |
//! | `images` | list<struct{name, encoding, data, patches, llm_tokens, llm_offset}> | per image |
//! | `audio` | list<struct{name, encoding, data, mel_frames, encoder_frames, llm_tokens, llm_offset}> | per clip |
//! | `cost_{llm,vision,audio}_{linear,attention}` | float64 | forward-FLOP estimate per module |
//!
//! `encoding` is `rgb8` ((size, size, 3) bytes), `pcm_s16le` (mono 16 kHz) or `encoded` (the
//! original file). `dataset.json` (see `dataset.rs`) describes the folder; it is written last.

mod read;
mod write;

use std::sync::Arc;

use arrow_schema::{DataType, Field, Fields, Schema, SchemaRef};

pub use read::{Dataset, PackEntry, StoredSample};
pub(crate) use write::hex;
pub use write::{ShardWriter, Staging};

/// Errors of the shard writer and reader; each names the file.
#[derive(Debug, thiserror::Error)]
pub enum ShardError {
    #[error("{path}: {reason}")]
    Io { path: String, reason: String },
    #[error("{path}: parquet: {reason}")]
    Parquet { path: String, reason: String },
    #[error("{path}: {reason}")]
    Invalid { path: String, reason: String },
}

impl ShardError {
    pub(crate) fn io(path: &std::path::Path, e: impl std::fmt::Display) -> ShardError {
        ShardError::Io {
            path: path.display().to_string(),
            reason: e.to_string(),
        }
    }

    pub(crate) fn parquet(path: &std::path::Path, e: impl std::fmt::Display) -> ShardError {
        ShardError::Parquet {
            path: path.display().to_string(),
            reason: e.to_string(),
        }
    }

    pub(crate) fn invalid(path: &std::path::Path, reason: impl Into<String>) -> ShardError {
        ShardError::Invalid {
            path: path.display().to_string(),
            reason: reason.into(),
        }
    }
}

/// The cost columns, in `SampleCost` order (module, then linear / attention).
pub const COST_COLUMNS: [&str; 6] = [
    "cost_llm_linear",
    "cost_llm_attention",
    "cost_vision_linear",
    "cost_vision_attention",
    "cost_audio_linear",
    "cost_audio_attention",
];

fn u32_field(name: &str) -> Field {
    Field::new(name, DataType::UInt32, false)
}

pub(crate) fn image_fields() -> Fields {
    Fields::from(vec![
        Field::new("name", DataType::Utf8, false),
        Field::new("encoding", DataType::Utf8, false),
        Field::new("data", DataType::Binary, false),
        u32_field("patches"),
        u32_field("llm_tokens"),
        u32_field("llm_offset"),
    ])
}

pub(crate) fn audio_fields() -> Fields {
    Fields::from(vec![
        Field::new("name", DataType::Utf8, false),
        Field::new("encoding", DataType::Utf8, false),
        Field::new("data", DataType::Binary, false),
        u32_field("mel_frames"),
        u32_field("encoder_frames"),
        u32_field("llm_tokens"),
        u32_field("llm_offset"),
    ])
}

pub(crate) fn list_item(dt: DataType) -> Arc<Field> {
    Arc::new(Field::new("item", dt, false))
}

/// The shard schema.
pub fn schema() -> SchemaRef {
    let mut fields = vec![
        Field::new("pack", DataType::UInt64, false),
        Field::new("id", DataType::Utf8, false),
        Field::new("source", DataType::Utf8, false),
        Field::new("ids", DataType::List(list_item(DataType::UInt32)), false),
        Field::new(
            "loss_mask",
            DataType::List(list_item(DataType::UInt8)),
            false,
        ),
        u32_field("text_tokens"),
        u32_field("llm_len"),
        Field::new(
            "images",
            DataType::List(list_item(DataType::Struct(image_fields()))),
            false,
        ),
        Field::new(
            "audio",
            DataType::List(list_item(DataType::Struct(audio_fields()))),
            false,
        ),
    ];
    for c in COST_COLUMNS {
        fields.push(Field::new(c, DataType::Float64, false));
    }
    Arc::new(Schema::new(fields))
}

/// Opens a shard file for reading, refusing what is not a regular file (a FIFO or a
/// device would block or never end; a folder is no shard) before opening it.
pub fn open_shard(path: &std::path::Path) -> std::io::Result<std::fs::File> {
    let meta = std::fs::metadata(path)?;
    if !meta.is_file() {
        return Err(std::io::Error::new(
            std::io::ErrorKind::InvalidInput,
            "not a regular file (a shard is a Parquet file, not a folder, FIFO or device)",
        ));
    }
    std::fs::File::open(path)
}

/// Whether `name` is a plain file name (one component: no folder, no `..`, not absolute):
/// what `dataset.json` may list as a shard, so that a dataset reads only its own folder.
pub fn is_plain_file_name(name: &str) -> bool {
    let mut parts = std::path::Path::new(name).components();
    matches!(
        (parts.next(), parts.next()),
        (Some(std::path::Component::Normal(_)), None)
    ) && !name.contains(['/', '\\'])
}

/// One shard as `dataset.json` lists it.
#[derive(Clone, Debug, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
pub struct ShardInfo {
    /// File name inside the dataset folder.
    pub file: String,
    pub rows: u64,
    pub packs: u64,
    pub row_groups: u64,
    pub bytes: u64,
    /// SHA-256 of the file, hex.
    pub sha256: String,
}
