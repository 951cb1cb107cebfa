//! JSONL chat manifests (one record a line; the record schemas are in `sharegpt`), and the
//! chat-`messages` conversion that JSON records, WebDataset `.json` members and Parquet
//! `messages` columns share.
//!
//! Memory: one line at a time, capped at `Limits::max_record_bytes`; a longer line is skipped
//! to its newline without being held and becomes a reject.

use std::collections::VecDeque;
use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::Path;

use serde_json::{Map, Value};

use super::paths::DatasetRoot;
use super::sample::{Media, MediaBytes, RawMessage, RawPart, RawSample, Reject, Role};
use super::{ReadError, SampleIter};

/// Where `{"type": "image"|"audio"}` parts (and `<image>` / `<audio>` text placeholders) get
/// their media from.
pub(crate) enum MediaSource<'a> {
    /// `{"type": "image", "path": "rel/path.png"}`, resolved inside the root (JSONL). A text
    /// placeholder here has no media to take: the record names no `images` / `audios` list.
    Paths(&'a DatasetRoot),
    /// The record's media in order (tar members, Parquet media columns): each part takes the
    /// next item of its kind; a `path` field, if any, is only a name. Text is kept verbatim.
    Queue {
        images: VecDeque<Media>,
        audios: VecDeque<Media>,
    },
    /// The record's own `images` / `audios` lists, already resolved (ShareGPT / LLaMA-Factory):
    /// each `<image>` / `<audio>` in string content, and each typed part without a `path`,
    /// takes the next item of its kind. A typed part that also names a `path` is refused: the
    /// two ways of naming media do not mix in one record.
    Listed {
        images: VecDeque<Media>,
        audios: VecDeque<Media>,
    },
}

/// The text placeholders of ShareGPT / LLaMA-Factory records (and LLaVA's `<image>`).
pub(crate) const IMAGE_PLACEHOLDER: &str = "<image>";
pub(crate) const AUDIO_PLACEHOLDER: &str = "<audio>";

impl MediaSource<'_> {
    fn take(&mut self, image: bool, part: &Map<String, Value>, at: &str) -> Result<Media, String> {
        let kind = if image { "image" } else { "audio" };
        match self {
            MediaSource::Paths(root) => {
                let rel = match part.get("path") {
                    Some(Value::String(s)) => s,
                    Some(Value::Null) | None => {
                        return Err(format!("{at}: {kind} part without a \"path\""));
                    }
                    Some(other) => {
                        return Err(format!(
                            "{at}: \"path\" must be a string, got {}",
                            kind_of(other)
                        ));
                    }
                };
                let path = root.resolve(rel).map_err(|why| format!("{at}: {why}"))?;
                Ok(Media {
                    bytes: MediaBytes::Path(path),
                    name: rel.clone(),
                })
            }
            MediaSource::Queue { images, audios } => {
                let queue = if image { images } else { audios };
                queue.pop_front().ok_or_else(|| {
                    format!("{at}: {kind} part (placeholder) without an {kind} to fill it")
                })
            }
            MediaSource::Listed { .. } => {
                if part.get("path").is_some_and(|p| !p.is_null()) {
                    return Err(format!(
                        "{at}: {kind} part with a \"path\" in a record that also has an \"{kind}s\" list (name each {kind} one way)"
                    ));
                }
                self.take_listed(image, at)
            }
        }
    }

    /// The media item for one `<image>` / `<audio>` text placeholder.
    fn take_listed(&mut self, image: bool, at: &str) -> Result<Media, String> {
        let (kind, list) = if image {
            ("image", "images")
        } else {
            ("audio", "audios")
        };
        match self {
            MediaSource::Listed { images, audios } => {
                let queue = if image { images } else { audios };
                queue.pop_front().ok_or_else(|| {
                    format!("{at}: more {kind} placeholders than entries in \"{list}\"")
                })
            }
            _ => Err(format!(
                "{at}: {kind} placeholder in the text but the record has no \"{list}\" list"
            )),
        }
    }

    /// Whether `<image>` / `<audio>` in string content are placeholders (JSONL and JSON-array
    /// records) rather than text (WebDataset and Parquet chats, whose media are typed parts).
    fn splits_text(&self) -> bool {
        !matches!(self, MediaSource::Queue { .. })
    }

    /// After all parts: every queued media item must have been placed.
    fn finish(self) -> Result<(), String> {
        let (images, audios, how) = match self {
            MediaSource::Paths(_) => return Ok(()),
            MediaSource::Queue { images, audios } => (
                images,
                audios,
                ["{\"type\": \"image\"} part", "{\"type\": \"audio\"} part"],
            ),
            MediaSource::Listed { images, audios } => {
                (images, audios, [IMAGE_PLACEHOLDER, AUDIO_PLACEHOLDER])
            }
        };
        if !images.is_empty() {
            return Err(format!(
                "{} image(s) without a placeholder ({})",
                images.len(),
                how[0]
            ));
        }
        if !audios.is_empty() {
            return Err(format!(
                "{} audio clip(s) without a placeholder ({})",
                audios.len(),
                how[1]
            ));
        }
        Ok(())
    }
}

/// `text` cut at its `<image>` / `<audio>` placeholders, each replaced by the next media item
/// of its kind from `media`. Text around a placeholder is kept verbatim.
fn split_placeholders(
    text: &str,
    media: &mut MediaSource<'_>,
    at: &str,
    parts: &mut Vec<RawPart>,
) -> Result<(), String> {
    if !text.contains(IMAGE_PLACEHOLDER) && !text.contains(AUDIO_PLACEHOLDER) {
        parts.push(RawPart::Text(text.to_string()));
        return Ok(());
    }
    let mut rest = text;
    loop {
        let image = rest.find(IMAGE_PLACEHOLDER);
        let audio = rest.find(AUDIO_PLACEHOLDER);
        let (pos, is_image) = match (image, audio) {
            (None, None) => break,
            (Some(i), None) => (i, true),
            (None, Some(a)) => (a, false),
            (Some(i), Some(a)) => (i.min(a), i < a),
        };
        if pos > 0 {
            parts.push(RawPart::Text(rest[..pos].to_string()));
        }
        let m = media.take_listed(is_image, at)?;
        parts.push(if is_image {
            RawPart::Image(m)
        } else {
            RawPart::Audio(m)
        });
        let len = if is_image {
            IMAGE_PLACEHOLDER.len()
        } else {
            AUDIO_PLACEHOLDER.len()
        };
        rest = &rest[pos + len..];
    }
    if !rest.is_empty() {
        parts.push(RawPart::Text(rest.to_string()));
    }
    Ok(())
}

/// A message's role: `role` (`user`/`assistant`/`system`) or ShareGPT's `from`
/// (`human`/`gpt`/`system`, and the plain names too).
fn message_role(m: &Map<String, Value>, at: &str) -> Result<Role, String> {
    let (key, value) = match (m.get("role"), m.get("from")) {
        (Some(v), _) if !v.is_null() => ("role", v),
        (_, Some(v)) if !v.is_null() => ("from", v),
        _ => return Err(format!("{at} has no \"role\" (or \"from\")")),
    };
    match value {
        Value::String(r) => match r.as_str() {
            "user" | "human" => Ok(Role::User),
            "assistant" | "gpt" => Ok(Role::Assistant),
            "system" => Ok(Role::System),
            _ => Err(format!(
                "{at}.{key}: unknown role {r:?} (expected \"user\"/\"human\", \"assistant\"/\"gpt\" or \"system\")"
            )),
        },
        other => Err(format!(
            "{at}.{key} must be a string, got {}",
            kind_of(other)
        )),
    }
}

/// A message's content: `content`, or ShareGPT's `value`; `None` when neither is set.
pub(crate) fn message_content(m: &Map<String, Value>) -> Option<(&'static str, &Value)> {
    match (m.get("content"), m.get("value")) {
        (Some(v), _) if !v.is_null() => Some(("content", v)),
        (_, Some(v)) if !v.is_null() => Some(("value", v)),
        _ => None,
    }
}

pub(crate) fn kind_of(v: &Value) -> &'static str {
    match v {
        Value::Null => "null",
        Value::Bool(_) => "a boolean",
        Value::Number(_) => "a number",
        Value::String(_) => "a string",
        Value::Array(_) => "an array",
        Value::Object(_) => "an object",
    }
}

/// The record's `id`: a string, or an integer written in decimal. `Ok(None)` when absent.
pub(crate) fn record_id(record: &Map<String, Value>) -> Result<Option<String>, String> {
    match record.get("id") {
        None | Some(Value::Null) => Ok(None),
        Some(Value::String(s)) => Ok(Some(s.clone())),
        Some(Value::Number(n)) if n.is_i64() || n.is_u64() => Ok(Some(n.to_string())),
        Some(other) => Err(format!(
            "\"id\" must be a string or an integer, got {}",
            kind_of(other)
        )),
    }
}

/// Converts a chat `messages` list: `[{"role", "content": "text" | [{"type": "text", "text"} |
/// {"type": "image"|"audio", ...}]}]`, or ShareGPT's `[{"from", "value"}]`. Null-valued keys
/// count as absent and unknown keys are ignored, because Parquet structs carry every field of
/// the union on every part.
pub(crate) fn messages_from_json(
    messages: &Value,
    mut media: MediaSource<'_>,
) -> Result<Vec<RawMessage>, String> {
    let list = match messages {
        Value::Array(list) => list,
        other => {
            return Err(format!(
                "\"messages\" must be an array, got {}",
                kind_of(other)
            ));
        }
    };
    if list.is_empty() {
        return Err("\"messages\" is empty".into());
    }
    let mut out = Vec::with_capacity(list.len());
    for (i, m) in list.iter().enumerate() {
        let at = format!("messages[{i}]");
        let Value::Object(m) = m else {
            return Err(format!("{at} must be an object, got {}", kind_of(m)));
        };
        let role = message_role(m, &at)?;
        let parts = match message_content(m) {
            Some((_, Value::String(s))) if media.splits_text() => {
                let mut parts = Vec::new();
                split_placeholders(s, &mut media, &at, &mut parts)?;
                parts
            }
            Some((_, Value::String(s))) => vec![RawPart::Text(s.clone())],
            Some((key, Value::Array(items))) => {
                let mut parts = Vec::with_capacity(items.len());
                for (j, p) in items.iter().enumerate() {
                    let at = format!("{at}.{key}[{j}]");
                    let Value::Object(p) = p else {
                        return Err(format!("{at} must be an object, got {}", kind_of(p)));
                    };
                    let part = match p.get("type") {
                        Some(Value::String(t)) if t == "text" => match p.get("text") {
                            Some(Value::String(s)) => RawPart::Text(s.clone()),
                            None | Some(Value::Null) => {
                                return Err(format!("{at}: text part without \"text\""));
                            }
                            Some(other) => {
                                return Err(format!(
                                    "{at}.text must be a string, got {}",
                                    kind_of(other)
                                ));
                            }
                        },
                        Some(Value::String(t)) if t == "image" => {
                            RawPart::Image(media.take(true, p, &at)?)
                        }
                        Some(Value::String(t)) if t == "audio" => {
                            RawPart::Audio(media.take(false, p, &at)?)
                        }
                        Some(Value::String(t)) => {
                            return Err(format!(
                                "{at}: unknown part type {t:?} (expected \"text\", \"image\" or \"audio\")"
                            ));
                        }
                        None | Some(Value::Null) => return Err(format!("{at} has no \"type\"")),
                        Some(other) => {
                            return Err(format!(
                                "{at}.type must be a string, got {}",
                                kind_of(other)
                            ));
                        }
                    };
                    parts.push(part);
                }
                parts
            }
            None => return Err(format!("{at} has no \"content\" (or \"value\")")),
            Some((key, other)) => {
                return Err(format!(
                    "{at}.{key} must be a string or an array, got {}",
                    kind_of(other)
                ));
            }
        };
        out.push(RawMessage { role, parts });
    }
    media.finish()?;
    Ok(out)
}

/// Reads one line into `buf` (newline and a trailing `\r` removed), holding at most `max`
/// bytes. `Ok(None)` at end of file; `Ok(Some(true))` when the line was longer than `max`
/// (then `buf` is empty and the line was skipped).
pub(crate) fn read_line_bounded(
    r: &mut impl BufRead,
    buf: &mut Vec<u8>,
    max: usize,
) -> io::Result<Option<bool>> {
    buf.clear();
    let mut too_long = false;
    let mut any = false;
    loop {
        let avail = match r.fill_buf() {
            Ok(a) => a,
            Err(e) if e.kind() == io::ErrorKind::Interrupted => continue,
            Err(e) => return Err(e),
        };
        if avail.is_empty() {
            return Ok(any.then_some(too_long));
        }
        any = true;
        let (chunk, used, done) = match avail.iter().position(|&b| b == b'\n') {
            Some(i) => (&avail[..i], i + 1, true),
            None => (avail, avail.len(), false),
        };
        if !too_long {
            if buf.len() + chunk.len() > max {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(chunk);
            }
        }
        r.consume(used);
        if done {
            if buf.last() == Some(&b'\r') {
                buf.pop();
            }
            return Ok(Some(too_long));
        }
    }
}

/// Opens one JSONL manifest. Media paths resolve against the media roots, then the manifest's
/// folder.
/// Skips a UTF-8 byte-order mark at the start of a text file (Windows tools and Python's
/// `utf-8-sig` write one), which would otherwise make the first record malformed JSON.
pub(crate) fn skip_bom<R: BufRead>(r: &mut R) -> std::io::Result<()> {
    const BOM: [u8; 3] = [0xEF, 0xBB, 0xBF];
    let mut seen = 0;
    // The mark may straddle the buffer's first fill only on a tiny or odd reader.
    while seen < BOM.len() {
        let buf = r.fill_buf()?;
        if buf.is_empty() {
            return Ok(());
        }
        let n = buf.len().min(BOM.len() - seen);
        if buf[..n] != BOM[seen..seen + n] {
            if seen > 0 {
                return Err(std::io::Error::new(
                    std::io::ErrorKind::InvalidData,
                    "a partial UTF-8 byte-order mark",
                ));
            }
            return Ok(());
        }
        r.consume(n);
        seen += n;
    }
    Ok(())
}

pub(crate) fn open(
    path: &Path,
    media_roots: &[std::path::PathBuf],
    max_record_bytes: usize,
) -> Result<SampleIter, ReadError> {
    let file = File::open(path).map_err(|e| ReadError::open(path, e))?;
    let dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let root =
        DatasetRoot::with_media_roots(dir, media_roots).map_err(|e| ReadError::open(dir, e))?;
    let mut reader = BufReader::with_capacity(1 << 16, file);
    skip_bom(&mut reader).map_err(|e| ReadError::open(path, e))?;
    Ok(Box::new(JsonlReader {
        name: path.display().to_string(),
        reader,
        root,
        line: 0,
        buf: Vec::new(),
        max_record_bytes,
        done: false,
    }))
}

struct JsonlReader {
    name: String,
    reader: BufReader<File>,
    root: DatasetRoot,
    /// 1-based number of the last line read.
    line: u64,
    buf: Vec<u8>,
    max_record_bytes: usize,
    done: bool,
}

impl Iterator for JsonlReader {
    type Item = Result<RawSample, Reject>;

    fn next(&mut self) -> Option<Self::Item> {
        while !self.done {
            let read = read_line_bounded(&mut self.reader, &mut self.buf, self.max_record_bytes);
            self.line += 1;
            let source = format!("{}:{}", self.name, self.line);
            match read {
                Ok(None) => self.done = true,
                Err(e) => {
                    // A failing disk mid-file: report once, give up on this file only.
                    self.done = true;
                    return Some(Err(Reject::damaged(
                        None,
                        source,
                        self.name.clone(),
                        format!("read error, rest of the file skipped: {e}"),
                    )));
                }
                Ok(Some(true)) => {
                    let why = format!("line longer than {} bytes", self.max_record_bytes);
                    return Some(Err(Reject::new(None, source, why)));
                }
                Ok(Some(false)) => {
                    if self.buf.iter().all(u8::is_ascii_whitespace) {
                        continue;
                    }
                    return Some(parse_record(&self.buf, source, &self.root));
                }
            }
        }
        None
    }
}

/// Parses one JSON record (a JSONL line, a LLaVA array element) into its object and id.
/// `what` names it in errors ("record", "element"); `utf8_where` follows the byte
/// offset of an invalid UTF-8 sequence (e.g. " of the element").
pub(crate) fn parse_object(
    bytes: &[u8],
    source: &str,
    what: &str,
    utf8_where: &str,
) -> Result<(Map<String, Value>, Option<String>), Reject> {
    let reject = |why: String| Reject::new(None, source.to_string(), why);
    if let Err(e) = std::str::from_utf8(bytes) {
        return Err(reject(format!(
            "invalid UTF-8 at byte {}{utf8_where}",
            e.valid_up_to()
        )));
    }
    let value: Value =
        serde_json::from_slice(bytes).map_err(|e| reject(format!("malformed JSON: {e}")))?;
    let Value::Object(record) = value else {
        return Err(reject(format!(
            "{what} must be a JSON object, got {}",
            kind_of(&value)
        )));
    };
    let id = record_id(&record).map_err(reject)?;
    Ok((record, id))
}

fn parse_record(line: &[u8], source: String, root: &DatasetRoot) -> Result<RawSample, Reject> {
    let (record, id) = parse_object(line, &source, "record", "")?;
    super::sharegpt::chat_record(&record, id, source, root)
}
