//! Parquet files as Hugging Face `datasets` exports them: media columns as `struct{bytes:
//! binary, path: string}` (HF `Image`/`Audio` features, or lists of them), text columns mapped
//! by `ParquetColumns`.
//!
//! Two layouts: a caption layout (`text`, optional `prompt`: the user message carries the
//! row's media then the prompt, the assistant message the text) and a chat layout (`messages`:
//! a `list<struct{role, content}>` column read like a JSONL record, media parts
//! `{"type": "image"}` taking the row's `image`/`audio` column items in order). A media cell
//! with `bytes` is inline (its `path` is then only a name); one with only `path` is a file
//! resolved inside the Parquet file's folder, like a JSONL path.
//!
//! Memory: only the mapped columns are decoded (a projection), `batch_rows` rows at a time,
//! row group after row group; the reader holds one page per column plus one batch. Files are
//! checked (footer, columns, types) by `open` and reopened one at a time while iterating. A
//! column mapping that does not fit a file is a fatal `ReadError::Config`; a file that is not
//! Parquet, or whose pages are corrupt, is a reject (the rest of that file is skipped).
//! pyarrow writes snappy by default, hence the `snap` feature next to `zstd`.

use std::collections::VecDeque;
use std::fs::File;
use std::path::{Path, PathBuf};

use ::parquet::arrow::ProjectionMask;
use ::parquet::arrow::arrow_reader::{ParquetRecordBatchReader, ParquetRecordBatchReaderBuilder};
use arrow_array::cast::AsArray;
use arrow_array::types::{Float32Type, Float64Type, Int32Type, Int64Type, UInt32Type, UInt64Type};
use arrow_array::{Array, RecordBatch, StructArray};
use arrow_schema::{DataType, Field, Schema};
use serde_json::{Map, Value};

use super::jsonl::{MediaSource, messages_from_json};
use super::paths::DatasetRoot;
use super::sample::{Media, MediaBytes, RawMessage, RawPart, RawSample, Reject, Role};
use super::{ReadError, SampleIter};

/// Which column holds what. Exactly one of `text` (caption layout) and `messages` (chat
/// layout) must be set; `prompt` goes with `text` only.
#[derive(Debug, Clone, Default, PartialEq, Eq, serde::Serialize, serde::Deserialize)]
#[serde(deny_unknown_fields)]
pub struct ParquetColumns {
    /// A string or integer column; without it a sample's id is its source (`file.parquet:row`).
    pub id: Option<String>,
    /// Chat layout: `list<struct{role: string, content: string | list<struct{type, text, ...}>}>`.
    pub messages: Option<String>,
    /// Caption layout: the assistant's text.
    pub text: Option<String>,
    /// Caption layout: an optional user text after the media (a question, an instruction).
    pub prompt: Option<String>,
    /// `struct{bytes, path}` or a list of them.
    pub image: Option<String>,
    /// `struct{bytes, path}` or a list of them.
    pub audio: Option<String>,
}

impl ParquetColumns {
    fn validate(&self) -> Result<(), ReadError> {
        let err = |s: &str| {
            let set: Vec<String> = self
                .mapped()
                .map(|(key, col)| format!("{key} = {col:?}"))
                .collect();
            Err(ReadError::Config(format!(
                "[input.parquet] ({}): {s}",
                if set.is_empty() {
                    "no column set".to_string()
                } else {
                    set.join(", ")
                }
            )))
        };
        match (&self.text, &self.messages) {
            (Some(_), Some(_)) => {
                return err("set `text` (caption layout) or `messages` (chat layout), not both");
            }
            (None, None) => return err("set `text` (caption layout) or `messages` (chat layout)"),
            _ => {}
        }
        if self.prompt.is_some() && self.text.is_none() {
            return err("`prompt` goes with `text`");
        }
        Ok(())
    }

    /// (config key, column name) for every mapped column.
    fn mapped(&self) -> impl Iterator<Item = (&'static str, &str)> {
        [
            ("id", &self.id),
            ("messages", &self.messages),
            ("text", &self.text),
            ("prompt", &self.prompt),
            ("image", &self.image),
            ("audio", &self.audio),
        ]
        .into_iter()
        .filter_map(|(k, c)| c.as_deref().map(|c| (k, c)))
    }
}

fn is_string(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View
    )
}

fn is_binary(dt: &DataType) -> bool {
    matches!(
        dt,
        DataType::Binary | DataType::LargeBinary | DataType::BinaryView
    )
}

fn is_media_struct(dt: &DataType) -> bool {
    let DataType::Struct(fields) = dt else {
        return false;
    };
    let bytes = fields.iter().find(|f| f.name() == "bytes");
    let path = fields.iter().find(|f| f.name() == "path");
    bytes.is_some_and(|f| is_binary(f.data_type())) && path.is_none_or(|f| is_string(f.data_type()))
}

fn list_item(dt: &DataType) -> Option<&Field> {
    match dt {
        DataType::List(f) | DataType::LargeList(f) => Some(f),
        _ => None,
    }
}

/// Checks one mapped column's type; the `Err` says what was expected.
fn check_type(key: &str, dt: &DataType) -> Result<(), String> {
    let ok = match key {
        "id" => is_string(dt) || dt.is_integer(),
        "text" | "prompt" => is_string(dt),
        "image" | "audio" => {
            is_media_struct(dt) || list_item(dt).is_some_and(|f| is_media_struct(f.data_type()))
        }
        _ => list_item(dt).is_some_and(|f| matches!(f.data_type(), DataType::Struct(_))),
    };
    if ok {
        return Ok(());
    }
    let expected = match key {
        "id" => "a string or integer",
        "text" | "prompt" => "a string",
        "image" | "audio" => "struct{bytes: binary, path: string} or a list of it",
        _ => "list<struct{role, content}>",
    };
    Err(format!("has type {dt}, expected {expected}"))
}

/// Opens the file, checks the mapping against its schema, and returns the batch reader.
fn open_file(
    path: &Path,
    cols: &ParquetColumns,
    batch_rows: usize,
) -> Result<ParquetRecordBatchReader, ReadError> {
    let file = File::open(path).map_err(|e| ReadError::open(path, e))?;
    let builder = ParquetRecordBatchReaderBuilder::try_new(file)
        .map_err(|e| ReadError::invalid(path, format!("not a readable Parquet file: {e}")))?;
    let schema: &Schema = builder.schema();
    let mut roots = Vec::new();
    for (key, name) in cols.mapped() {
        let (i, field) = schema.column_with_name(name).ok_or_else(|| {
            ReadError::Config(format!(
                "{}: no column {name:?} (mapped as `{key}`)",
                path.display()
            ))
        })?;
        check_type(key, field.data_type()).map_err(|why| {
            ReadError::Config(format!(
                "{}: column {name:?} (mapped as `{key}`) {why}",
                path.display()
            ))
        })?;
        roots.push(i);
    }
    let mask = ProjectionMask::roots(builder.parquet_schema(), roots);
    builder
        .with_projection(mask)
        .with_batch_size(batch_rows)
        .build()
        .map_err(|e| ReadError::invalid(path, format!("cannot read: {e}")))
}

pub(crate) fn open(
    files: Vec<PathBuf>,
    cols: &ParquetColumns,
    media_roots: &[PathBuf],
    batch_rows: usize,
) -> Result<SampleIter, ReadError> {
    cols.validate()?;
    // Every file's footer and mapping is checked now; each is reopened when its turn comes,
    // so a folder of many files holds one open reader.
    // A file that is not Parquet at all is a reject when its turn comes, like a garbage tar
    // shard; a mapping that does not fit a file (`Config`) and an unopenable path are fatal.
    for f in &files {
        match open_file(f, cols, batch_rows) {
            Ok(_) | Err(ReadError::Invalid { .. }) => {}
            Err(e) => return Err(e),
        }
    }
    let cols = cols.clone();
    let media_roots = media_roots.to_vec();
    Ok(Box::new(files.into_iter().flat_map(
        move |path| -> SampleIter {
            let name = path.display().to_string();
            let opened = open_file(&path, &cols, batch_rows).and_then(|batches| {
                let dir = path
                    .parent()
                    .filter(|d| !d.as_os_str().is_empty())
                    .unwrap_or(Path::new("."));
                let root = DatasetRoot::with_media_roots(dir, &media_roots)
                    .map_err(|e| ReadError::open(dir, e))?;
                Ok((batches, root))
            });
            match opened {
                Ok((batches, root)) => Box::new(FileReader {
                    name,
                    batches,
                    cols: cols.clone(),
                    root,
                    batch: None,
                    row_in_batch: 0,
                    rows_done: 0,
                    done: false,
                }),
                Err(e) => Box::new(std::iter::once(Err(Reject::damaged(
                    None,
                    name.clone(),
                    name,
                    e.to_string(),
                )))),
            }
        },
    )))
}

struct FileReader {
    name: String,
    batches: ParquetRecordBatchReader,
    cols: ParquetColumns,
    root: DatasetRoot,
    batch: Option<RecordBatch>,
    row_in_batch: usize,
    /// Rows of the file before the current batch.
    rows_done: u64,
    done: bool,
}

impl Iterator for FileReader {
    type Item = Result<RawSample, Reject>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            if self.done {
                return None;
            }
            if let Some(batch) = &self.batch
                && self.row_in_batch < batch.num_rows()
            {
                let r = self.row_in_batch;
                self.row_in_batch += 1;
                let source = format!("{}:{}", self.name, self.rows_done + r as u64);
                return Some(self.row(batch, r, source));
            }
            if let Some(batch) = self.batch.take() {
                self.rows_done += batch.num_rows() as u64;
            }
            match self.batches.next() {
                Some(Ok(batch)) => {
                    self.batch = Some(batch);
                    self.row_in_batch = 0;
                }
                Some(Err(e)) => {
                    self.done = true;
                    let why = format!(
                        "corrupt data after row {}, rest of the file skipped: {e}",
                        self.rows_done
                    );
                    let name = self.name.clone();
                    return Some(Err(Reject::damaged(None, name.clone(), name, why)));
                }
                None => self.done = true,
            }
        }
    }
}

impl FileReader {
    fn row(&self, batch: &RecordBatch, r: usize, source: String) -> Result<RawSample, Reject> {
        let col = |name: &Option<String>| name.as_deref().and_then(|n| batch.column_by_name(n));
        let id = match col(&self.cols.id) {
            Some(c) => scalar_string(c.as_ref(), r)
                .map_err(|why| Reject::new(None, source.clone(), format!("id: {why}")))?,
            None => None,
        };
        let reject = |why: String| Reject::new(id.clone(), source.clone(), why);
        let media_of = |key: &Option<String>| -> Result<VecDeque<Media>, Reject> {
            match (key.as_deref(), col(key)) {
                (Some(name), Some(c)) => media_cell(c.as_ref(), r, name, &source, &self.root)
                    .map_err(|why| reject(format!("column {name:?}: {why}"))),
                _ => Ok(VecDeque::new()),
            }
        };
        let images = media_of(&self.cols.image)?;
        let audios = media_of(&self.cols.audio)?;
        let messages = if let Some(c) = col(&self.cols.messages) {
            let value = to_json(c.as_ref(), r).map_err(|why| reject(format!("messages: {why}")))?;
            if value.is_null() {
                return Err(reject("messages cell is null".into()));
            }
            messages_from_json(&value, MediaSource::Queue { images, audios }).map_err(reject)?
        } else {
            let text = match col(&self.cols.text) {
                Some(c) => {
                    scalar_string(c.as_ref(), r).map_err(|why| reject(format!("text: {why}")))?
                }
                None => None,
            };
            let text = text.ok_or_else(|| reject("text cell is null".into()))?;
            let prompt = match col(&self.cols.prompt) {
                Some(c) => {
                    scalar_string(c.as_ref(), r).map_err(|why| reject(format!("prompt: {why}")))?
                }
                None => None,
            };
            let mut user: Vec<RawPart> = images.into_iter().map(RawPart::Image).collect();
            user.extend(audios.into_iter().map(RawPart::Audio));
            user.extend(prompt.map(RawPart::Text));
            let mut messages = Vec::with_capacity(2);
            if !user.is_empty() {
                messages.push(RawMessage {
                    role: Role::User,
                    parts: user,
                });
            }
            messages.push(RawMessage {
                role: Role::Assistant,
                parts: vec![RawPart::Text(text)],
            });
            messages
        };
        Ok(RawSample {
            id: id.unwrap_or_else(|| source.clone()),
            source,
            messages,
        })
    }
}

/// A string or integer cell as a string; `None` when null.
fn scalar_string(a: &dyn Array, i: usize) -> Result<Option<String>, String> {
    match to_json(a, i)? {
        Value::Null => Ok(None),
        Value::String(s) => Ok(Some(s)),
        Value::Number(n) => Ok(Some(n.to_string())),
        other => Err(format!("expected a string, got {other}")),
    }
}

fn string_at(a: &dyn Array, i: usize) -> Option<&str> {
    if a.is_null(i) {
        return None;
    }
    if let Some(s) = a.as_string_opt::<i32>() {
        Some(s.value(i))
    } else if let Some(s) = a.as_string_opt::<i64>() {
        Some(s.value(i))
    } else {
        a.as_string_view_opt().map(|s| s.value(i))
    }
}

fn binary_at(a: &dyn Array, i: usize) -> Option<&[u8]> {
    if a.is_null(i) {
        return None;
    }
    if let Some(b) = a.as_binary_opt::<i32>() {
        Some(b.value(i))
    } else if let Some(b) = a.as_binary_opt::<i64>() {
        Some(b.value(i))
    } else {
        a.as_binary_view_opt().map(|b| b.value(i))
    }
}

/// The media of one cell: nothing when null, one item for a struct, all items for a list.
fn media_cell(
    a: &dyn Array,
    r: usize,
    column: &str,
    source: &str,
    root: &DatasetRoot,
) -> Result<VecDeque<Media>, String> {
    if a.is_null(r) {
        return Ok(VecDeque::new());
    }
    if let Some(s) = a.as_struct_opt() {
        return Ok(VecDeque::from([media_struct(
            s,
            r,
            || format!("{source}:{column}"),
            root,
        )?]));
    }
    let items = if let Some(l) = a.as_list_opt::<i32>() {
        l.value(r)
    } else if let Some(l) = a.as_list_opt::<i64>() {
        l.value(r)
    } else {
        return Err(format!("unexpected type {}", a.data_type()));
    };
    let s = items
        .as_struct_opt()
        .ok_or_else(|| format!("list items have type {}", items.data_type()))?;
    let mut out = VecDeque::with_capacity(s.len());
    for j in 0..s.len() {
        if s.is_null(j) {
            return Err(format!("item {j} is null"));
        }
        out.push_back(media_struct(
            s,
            j,
            || format!("{source}:{column}[{j}]"),
            root,
        )?);
    }
    Ok(out)
}

fn media_struct(
    s: &StructArray,
    i: usize,
    fallback: impl Fn() -> String,
    root: &DatasetRoot,
) -> Result<Media, String> {
    let bytes = s
        .column_by_name("bytes")
        .and_then(|b| binary_at(b.as_ref(), i));
    let path = s
        .column_by_name("path")
        .and_then(|p| string_at(p.as_ref(), i));
    match (bytes, path) {
        (Some(b), name) => Ok(Media {
            bytes: MediaBytes::Inline(b.to_vec()),
            name: name.map_or_else(&fallback, str::to_string),
        }),
        (None, Some(p)) => Ok(Media {
            bytes: MediaBytes::Path(root.resolve(p)?),
            name: p.to_string(),
        }),
        (None, None) => Err(format!("{}: neither bytes nor path", fallback())),
    }
}

/// One cell of a nested column as JSON, so that chat columns reuse the JSONL conversion.
fn to_json(a: &dyn Array, i: usize) -> Result<Value, String> {
    if a.is_null(i) {
        return Ok(Value::Null);
    }
    let bad = || format!("cannot read a {} value", a.data_type());
    let num = |x: f64| serde_json::Number::from_f64(x).map_or(Value::Null, Value::Number);
    Ok(match a.data_type() {
        DataType::Null => Value::Null,
        DataType::Boolean => Value::Bool(a.as_boolean_opt().ok_or_else(bad)?.value(i)),
        DataType::Int32 => Value::from(a.as_primitive_opt::<Int32Type>().ok_or_else(bad)?.value(i)),
        DataType::Int64 => Value::from(a.as_primitive_opt::<Int64Type>().ok_or_else(bad)?.value(i)),
        DataType::UInt32 => {
            Value::from(a.as_primitive_opt::<UInt32Type>().ok_or_else(bad)?.value(i))
        }
        DataType::UInt64 => {
            Value::from(a.as_primitive_opt::<UInt64Type>().ok_or_else(bad)?.value(i))
        }
        DataType::Float32 => num(f64::from(
            a.as_primitive_opt::<Float32Type>()
                .ok_or_else(bad)?
                .value(i),
        )),
        DataType::Float64 => num(a
            .as_primitive_opt::<Float64Type>()
            .ok_or_else(bad)?
            .value(i)),
        DataType::Utf8 | DataType::LargeUtf8 | DataType::Utf8View => {
            Value::String(string_at(a, i).ok_or_else(bad)?.to_string())
        }
        DataType::List(_) | DataType::LargeList(_) => {
            let items = match a.as_list_opt::<i32>() {
                Some(l) => l.value(i),
                None => a.as_list_opt::<i64>().ok_or_else(bad)?.value(i),
            };
            Value::Array(
                (0..items.len())
                    .map(|j| to_json(items.as_ref(), j))
                    .collect::<Result<_, _>>()?,
            )
        }
        DataType::Struct(fields) => {
            let s = a.as_struct_opt().ok_or_else(bad)?;
            let mut map = Map::with_capacity(fields.len());
            for (f, c) in fields.iter().zip(s.columns()) {
                map.insert(f.name().clone(), to_json(c.as_ref(), i)?);
            }
            Value::Object(map)
        }
        other => return Err(format!("unsupported type {other} inside a messages column")),
    })
}
