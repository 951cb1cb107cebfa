//! Input readers for `braid pack`: JSONL chat manifests, LLaVA JSON, WebDataset tars and Hugging Face Parquet.
//!
//! Every reader is an iterator of `Result<RawSample, Reject>`: a bad record (malformed JSON,
//! a path escaping the dataset root, a missing file, a placeholder without an image, ...) is a
//! `Reject` with its source and reason, and the iteration goes on. Only an input that cannot be
//! opened at all (missing file, not a JSON array, Parquet columns absent from the file) is a
//! fatal `ReadError`, reported by `open` before any record is read. Failures in the middle of a
//! file (a read error, a truncated tar, a corrupt Parquet page) reject the rest of that file
//! and the reader moves on to the next one.
//!
//! Memory is bounded by one record, never by the input: JSONL reads a line at a time, LLaVA
//! scans its top-level array element by element, WebDataset streams a tar member group at a
//! time (plus the set of keys seen, to refuse split groups), Parquet decodes `batch_rows` rows
//! of the mapped columns at a time. Each module doc states its bound.

pub mod jsonl;
pub mod llava;
pub mod parquet;
pub mod paths;
pub mod sample;
pub mod sharegpt;
pub mod wds;

use std::path::{Path, PathBuf};
use std::str::FromStr;

pub use self::parquet::ParquetColumns;
pub use sample::{Media, MediaBytes, RawMessage, RawPart, RawSample, Reject, Role};

/// What every reader yields.
pub type SampleIter = Box<dyn Iterator<Item = Result<RawSample, Reject>> + Send>;

/// `--format`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(rename_all = "lowercase")]
pub enum Format {
    Jsonl,
    Llava,
    Wds,
    Parquet,
}

impl Format {
    const ALL: [Format; 4] = [Format::Jsonl, Format::Llava, Format::Wds, Format::Parquet];

    /// The file extension of this format's input files (without the dot).
    pub fn extension(self) -> &'static str {
        match self {
            Format::Jsonl => "jsonl",
            Format::Llava => "json",
            Format::Wds => "tar",
            Format::Parquet => "parquet",
        }
    }
}

impl FromStr for Format {
    type Err = ReadError;

    fn from_str(s: &str) -> Result<Format, ReadError> {
        match s {
            "jsonl" => Ok(Format::Jsonl),
            "llava" => Ok(Format::Llava),
            "wds" | "webdataset" => Ok(Format::Wds),
            "parquet" => Ok(Format::Parquet),
            _ => Err(ReadError::Config(format!(
                "unknown input format {s:?} (expected jsonl, llava, wds or parquet)"
            ))),
        }
    }
}

/// The format of `input` from its name: `.jsonl` -> jsonl, `.json` -> llava (a JSON array:
/// LLaVA or ShareGPT), `.tar` -> wds, `.parquet` -> parquet; a folder by the files directly
/// inside it (one kind only). The `Err` says why and asks for `--format`.
pub fn infer_format(input: &Path) -> Result<Format, String> {
    let by_ext = |p: &Path| {
        let ext = p.extension().and_then(|e| e.to_str())?;
        Format::ALL.into_iter().find(|f| f.extension() == ext)
    };
    let ask = "pass --format jsonl|llava|wds|parquet (or set [input] format)";
    if !input.is_dir() {
        return by_ext(input).ok_or_else(|| {
            format!(
                "cannot tell the format of {} from its name (.jsonl, .json, .tar or .parquet); {ask}",
                input.display()
            )
        });
    }
    let entries = std::fs::read_dir(input).map_err(|e| format!("{}: {e}", input.display()))?;
    let mut kinds: Vec<Format> = Vec::new();
    for entry in entries {
        let path = entry
            .map_err(|e| format!("{}: {e}", input.display()))?
            .path();
        if !path.is_file() {
            continue;
        }
        if let Some(f) = by_ext(&path)
            && !kinds.contains(&f)
        {
            kinds.push(f);
        }
    }
    match kinds.as_slice() {
        [Format::Llava] => Err(format!(
            "{} is a folder of .json files; a LLaVA/ShareGPT input is one JSON file: pass it as --input",
            input.display()
        )),
        [f] => Ok(*f),
        [] => Err(format!(
            "{} holds no .jsonl, .json, .tar or .parquet files; {ask}",
            input.display()
        )),
        many => {
            let exts: Vec<String> = many.iter().map(|f| format!(".{}", f.extension())).collect();
            Err(format!(
                "{} holds {} files: the format is ambiguous; {ask}",
                input.display(),
                exts.join(" and ")
            ))
        }
    }
}

/// Caps that keep one hostile record from taking the memory.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct Limits {
    /// A JSONL line or a LLaVA array element (bytes).
    pub max_record_bytes: usize,
    /// A tar member (bytes); larger members reject their sample unread.
    pub max_member_bytes: u64,
    /// Rows decoded at once from a Parquet file.
    pub parquet_batch_rows: usize,
}

impl Default for Limits {
    fn default() -> Limits {
        Limits {
            max_record_bytes: 16 << 20,
            max_member_bytes: 64 << 20,
            parquet_batch_rows: 64,
        }
    }
}

/// Everything `open` needs besides the input path.
#[derive(Debug, Clone)]
pub struct ReadConfig {
    pub format: Format,
    /// Folders the user trusts (`--media-root`): relative media paths are looked up in them
    /// before the manifest's folder, and symlinks into them are followed (`paths::DatasetRoot`).
    /// JSONL, LLaVA and Parquet paths; WebDataset media are tar members and never paths.
    pub media_roots: Vec<PathBuf>,
    /// Parquet only: which columns hold what.
    pub parquet: ParquetColumns,
    pub limits: Limits,
}

impl ReadConfig {
    pub fn new(format: Format) -> ReadConfig {
        ReadConfig {
            format,
            media_roots: Vec::new(),
            parquet: ParquetColumns::default(),
            limits: Limits::default(),
        }
    }
}

#[derive(Debug, thiserror::Error)]
pub enum ReadError {
    #[error("cannot open input {path}: {source}")]
    Open {
        path: PathBuf,
        source: std::io::Error,
    },
    #[error("input {path}: {reason}")]
    Invalid { path: PathBuf, reason: String },
    #[error("input {path}: no {ext} files in the folder")]
    Empty { path: PathBuf, ext: &'static str },
    #[error("read config: {0}")]
    Config(String),
}

impl ReadError {
    pub(crate) fn open(path: &Path, source: std::io::Error) -> ReadError {
        ReadError::Open {
            path: path.to_path_buf(),
            source,
        }
    }

    pub(crate) fn invalid(path: &Path, reason: impl Into<String>) -> ReadError {
        ReadError::Invalid {
            path: path.to_path_buf(),
            reason: reason.into(),
        }
    }
}

/// Opens `input` (a file, or a folder whose files with the format's extension are read in name
/// order) and returns the record iterator. Every file is opened and checked here, so a missing
/// or unreadable input fails before any sample is produced.
pub fn open(input: &Path, cfg: &ReadConfig) -> Result<SampleIter, ReadError> {
    let lim = cfg.limits;
    if lim.max_record_bytes == 0 || lim.max_member_bytes == 0 || lim.parquet_batch_rows == 0 {
        return Err(ReadError::Config(format!(
            "limits must be positive: {lim:?}"
        )));
    }
    match cfg.format {
        Format::Jsonl => {
            let files = input_files(input, Format::Jsonl.extension())?;
            // Checked now, opened one at a time: a folder of many manifests holds one buffer.
            for f in &files {
                std::fs::File::open(f).map_err(|e| ReadError::open(f, e))?;
            }
            check_media_roots(&cfg.media_roots)?;
            let media_roots = cfg.media_roots.clone();
            Ok(Box::new(files.into_iter().flat_map(
                move |f| -> SampleIter {
                    match jsonl::open(&f, &media_roots, lim.max_record_bytes) {
                        Ok(records) => records,
                        Err(e) => {
                            let name = f.display().to_string();
                            Box::new(std::iter::once(Err(Reject::damaged(
                                None,
                                name.clone(),
                                name,
                                e.to_string(),
                            ))))
                        }
                    }
                },
            )))
        }
        Format::Llava => {
            if input.is_dir() {
                return Err(ReadError::invalid(
                    input,
                    "LLaVA input must be one JSON file, not a folder",
                ));
            }
            llava::open(input, &cfg.media_roots, lim.max_record_bytes)
        }
        Format::Wds => wds::open(
            input_files(input, Format::Wds.extension())?,
            lim.max_member_bytes,
        ),
        Format::Parquet => {
            check_media_roots(&cfg.media_roots)?;
            parquet::open(
                input_files(input, Format::Parquet.extension())?,
                &cfg.parquet,
                &cfg.media_roots,
                lim.parquet_batch_rows,
            )
        }
    }
}

/// How many input files [`open`] reads from `input` for `format` (a damaged one counts
/// against `pack.max_reject_ratio` as a share of these).
pub fn input_count(input: &Path, format: Format) -> Result<usize, ReadError> {
    Ok(match format {
        Format::Llava => 1, // one JSON file, never a folder
        f => input_files(input, f.extension())?.len(),
    })
}

/// Every media root must be an existing folder: a typo would otherwise show up only as
/// thousands of "missing file" rejects.
fn check_media_roots(roots: &[PathBuf]) -> Result<(), ReadError> {
    for r in roots {
        if !r.is_dir() {
            return Err(ReadError::Config(format!(
                "media root {} is not an existing folder",
                r.display()
            )));
        }
    }
    Ok(())
}

/// `input` itself, or the files directly inside it ending in `.ext`, sorted by name.
fn input_files(input: &Path, ext: &'static str) -> Result<Vec<PathBuf>, ReadError> {
    let meta = std::fs::metadata(input).map_err(|e| ReadError::open(input, e))?;
    // A device (/dev/zero) would be read without end, one cut-off record after another;
    // files, pipes (`--input <(zcat x.jsonl.gz)`) and sockets stream to their end.
    #[cfg(unix)]
    let device = {
        use std::os::unix::fs::FileTypeExt;
        meta.file_type().is_char_device() || meta.file_type().is_block_device()
    };
    #[cfg(not(unix))]
    let device = false;
    if device {
        return Err(ReadError::invalid(
            input,
            "a device, not a file, pipe or folder: pack reads files",
        ));
    }
    if !meta.is_dir() {
        return Ok(vec![input.to_path_buf()]);
    }
    let mut files = Vec::new();
    for entry in std::fs::read_dir(input).map_err(|e| ReadError::open(input, e))? {
        let path = entry.map_err(|e| ReadError::open(input, e))?.path();
        if path.is_file() && path.extension().is_some_and(|e| e == ext) {
            files.push(path);
        }
    }
    if files.is_empty() {
        return Err(ReadError::Empty {
            path: input.to_path_buf(),
            ext,
        });
    }
    files.sort();
    Ok(files)
}
