//! LLaVA JSON: one top-level array of `{"id", "image", "conversations": [{"from", "value"}]}`.
//! Elements with `messages`, `images` or `audios` (ShareGPT / LLaMA-Factory arrays) are read
//! as chat records (`sharegpt`), with the same placeholders and media root.
//!
//! The array is not parsed whole (LLaVA-665k is ~1 GB of JSON): a byte scanner that tracks
//! strings, escapes and bracket depth cuts out one element at a time, which serde_json then
//! parses. Memory: one element, capped at `Limits::max_record_bytes` (a longer element is
//! skipped without being held and becomes a reject). A malformed element is a reject and the
//! scan goes on at the next top-level comma; a file cut short rejects its last element.
//!
//! `<image>` marks where the image goes; the placeholder count over all turns must equal the
//! number of images (`image` may be one path or a list). `from`: `human`/`user` -> user,
//! `gpt`/`assistant` -> assistant, `system`. Text around a placeholder is kept verbatim (the
//! `\n` after `<image>` included): the chat template decides what it becomes.

use std::fs::File;
use std::io::{self, BufRead, BufReader};
use std::path::{Path, PathBuf};

use serde_json::Value;

use super::jsonl::{kind_of, parse_object, skip_bom};
use super::paths::DatasetRoot;
use super::sample::{Media, MediaBytes, RawMessage, RawPart, RawSample, Reject, Role};
use super::{ReadError, SampleIter};

const PLACEHOLDER: &str = "<image>";

/// Opens one LLaVA (or ShareGPT) JSON array. Image paths resolve against the media roots (the
/// old `--image-root` is one), then the JSON file's folder.
pub(crate) fn open(
    path: &Path,
    media_roots: &[PathBuf],
    max_record_bytes: usize,
) -> Result<SampleIter, ReadError> {
    let file = File::open(path).map_err(|e| ReadError::open(path, e))?;
    let root_dir = path
        .parent()
        .filter(|d| !d.as_os_str().is_empty())
        .unwrap_or(Path::new("."));
    let root = DatasetRoot::with_media_roots(root_dir, media_roots)
        .map_err(|e| ReadError::open(root_dir, e))?;
    let mut reader = BufReader::with_capacity(1 << 16, file);
    skip_bom(&mut reader).map_err(|e| ReadError::open(path, e))?;
    match skip_ws(&mut reader).map_err(|e| ReadError::open(path, e))? {
        Some(b'[') => reader.consume(1),
        Some(b) => {
            let why = format!(
                "a LLaVA file is one JSON array; it starts with {:?}",
                char::from(b)
            );
            return Err(ReadError::invalid(path, why));
        }
        None => {
            return Err(ReadError::invalid(
                path,
                "empty file (a LLaVA file is one JSON array)",
            ));
        }
    }
    Ok(Box::new(LlavaReader {
        name: path.display().to_string(),
        reader,
        root,
        index: 0,
        buf: Vec::new(),
        max_record_bytes,
        state: State::First,
    }))
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum State {
    /// Just after `[`: `]` here means an empty array.
    First,
    /// After a top-level `,`.
    Next,
    /// After the closing `]`: only whitespace may follow.
    Closed,
    Done,
}

struct LlavaReader {
    name: String,
    reader: BufReader<File>,
    root: DatasetRoot,
    /// Index of the next element.
    index: usize,
    buf: Vec<u8>,
    max_record_bytes: usize,
    state: State,
}

/// How an element's bytes ended.
enum End {
    Comma,
    Bracket,
    Eof,
}

/// Peeks the next non-whitespace byte (consuming the whitespace).
fn skip_ws(r: &mut impl BufRead) -> io::Result<Option<u8>> {
    loop {
        let avail = r.fill_buf()?;
        if avail.is_empty() {
            return Ok(None);
        }
        match avail.iter().position(|b| !b.is_ascii_whitespace()) {
            Some(i) => {
                let b = avail[i];
                r.consume(i);
                return Ok(Some(b));
            }
            None => {
                let n = avail.len();
                r.consume(n);
            }
        }
    }
}

/// Copies one element's bytes (up to its top-level `,` or `]`, which is consumed) into `buf`,
/// holding at most `max` bytes. Returns how it ended and whether it was too long.
fn scan_element(r: &mut impl BufRead, buf: &mut Vec<u8>, max: usize) -> io::Result<(End, bool)> {
    buf.clear();
    let mut depth = 0usize;
    let mut in_string = false;
    let mut escaped = false;
    let mut too_long = false;
    loop {
        let avail = r.fill_buf()?;
        if avail.is_empty() {
            return Ok((End::Eof, too_long));
        }
        let mut end = None;
        let mut used = avail.len();
        for (i, &b) in avail.iter().enumerate() {
            if in_string {
                if escaped {
                    escaped = false;
                } else if b == b'\\' {
                    escaped = true;
                } else if b == b'"' {
                    in_string = false;
                }
            } else {
                match b {
                    b'"' => in_string = true,
                    b'{' | b'[' => depth += 1,
                    b']' if depth == 0 => end = Some(End::Bracket),
                    b',' if depth == 0 => end = Some(End::Comma),
                    // An unbalanced `}` stays in the element, whose parse then fails.
                    b'}' | b']' => depth = depth.saturating_sub(1),
                    _ => {}
                }
                if end.is_some() {
                    used = i + 1;
                    break;
                }
            }
        }
        let body = &avail[..if end.is_some() { used - 1 } else { used }];
        if !too_long {
            if buf.len() + body.len() > max {
                too_long = true;
                buf.clear();
            } else {
                buf.extend_from_slice(body);
            }
        }
        r.consume(used);
        if let Some(end) = end {
            return Ok((end, too_long));
        }
    }
}

impl Iterator for LlavaReader {
    type Item = Result<RawSample, Reject>;

    fn next(&mut self) -> Option<Self::Item> {
        loop {
            match self.state {
                State::Done => return None,
                State::Closed => {
                    self.state = State::Done;
                    return match skip_ws(&mut self.reader) {
                        Ok(None) => None,
                        Ok(Some(_)) => Some(Err(Reject::new(
                            None,
                            self.name.clone(),
                            "trailing data after the JSON array",
                        ))),
                        Err(e) => Some(Err(Reject::damaged(
                            None,
                            self.name.clone(),
                            self.name.clone(),
                            format!("read error after the array: {e}"),
                        ))),
                    };
                }
                State::First | State::Next => {}
            }
            let index = self.index;
            let source = format!("{}[{index}]", self.name);
            if self.state == State::First {
                match skip_ws(&mut self.reader) {
                    Ok(Some(b']')) => {
                        self.reader.consume(1);
                        self.state = State::Closed;
                        continue;
                    }
                    Ok(_) => {}
                    Err(e) => return Some(self.fail(source, e)),
                }
            }
            let (end, too_long) =
                match scan_element(&mut self.reader, &mut self.buf, self.max_record_bytes) {
                    Ok(x) => x,
                    Err(e) => return Some(self.fail(source, e)),
                };
            self.index += 1;
            self.state = match end {
                End::Comma => State::Next,
                End::Bracket => State::Closed,
                End::Eof => State::Done,
            };
            if let End::Eof = end {
                let why = "file ends inside this element (truncated JSON array)";
                return Some(Err(Reject::damaged(None, source, self.name.clone(), why)));
            }
            if too_long {
                let why = format!("element longer than {} bytes", self.max_record_bytes);
                return Some(Err(Reject::new(None, source, why)));
            }
            if self.buf.iter().all(u8::is_ascii_whitespace) {
                if matches!(end, End::Bracket) && self.state == State::Closed && index > 0 {
                    // `[a, b,]`: a trailing comma, not an element. Still malformed JSON.
                    return Some(Err(Reject::new(None, source, "trailing comma before ']'")));
                }
                return Some(Err(Reject::new(None, source, "empty array element")));
            }
            return Some(parse_element(&self.buf, source, &self.root));
        }
    }
}

impl LlavaReader {
    fn fail(&mut self, source: String, e: io::Error) -> Result<RawSample, Reject> {
        self.state = State::Done;
        Err(Reject::damaged(
            None,
            source,
            self.name.clone(),
            format!("read error, rest of the file skipped: {e}"),
        ))
    }
}

fn parse_element(bytes: &[u8], source: String, root: &DatasetRoot) -> Result<RawSample, Reject> {
    let (record, id) = parse_object(bytes, &source, "element", " of the element")?;
    // ShareGPT / LLaMA-Factory JSON arrays: chat `messages`, or media in `images` / `audios`.
    if ["messages", "images", "audios"]
        .iter()
        .any(|k| record.get(*k).is_some_and(|v| !v.is_null()))
    {
        return super::sharegpt::chat_record(&record, id, source, root);
    }
    let reject = |why: String| Reject::new(id.clone(), source.clone(), why);
    if record.get("video").is_some_and(|v| !v.is_null()) {
        return Err(reject("video samples are not supported".into()));
    }
    let images: Vec<&str> = match record.get("image") {
        None | Some(Value::Null) => Vec::new(),
        Some(Value::String(s)) => vec![s.as_str()],
        Some(Value::Array(list)) => {
            let mut out = Vec::with_capacity(list.len());
            for v in list {
                match v {
                    Value::String(s) => out.push(s.as_str()),
                    other => {
                        return Err(reject(format!(
                            "\"image\" list holds {}, not a path string",
                            kind_of(other)
                        )));
                    }
                }
            }
            out
        }
        Some(other) => {
            return Err(reject(format!(
                "\"image\" must be a path or a list of paths, got {}",
                kind_of(other)
            )));
        }
    };
    let turns = match record.get("conversations") {
        Some(Value::Array(turns)) if !turns.is_empty() => turns,
        Some(Value::Array(_)) => return Err(reject("\"conversations\" is empty".into())),
        None | Some(Value::Null) => return Err(reject("no \"conversations\" field".into())),
        Some(other) => {
            return Err(reject(format!(
                "\"conversations\" must be an array, got {}",
                kind_of(other)
            )));
        }
    };
    // Roles and placeholder count first: cheap checks before any file system access.
    let mut parsed = Vec::with_capacity(turns.len());
    let mut placeholders = 0usize;
    for (i, t) in turns.iter().enumerate() {
        let Value::Object(t) = t else {
            return Err(reject(format!(
                "conversations[{i}] must be an object, got {}",
                kind_of(t)
            )));
        };
        let role = match t.get("from") {
            Some(Value::String(f)) => match f.as_str() {
                "human" | "user" => Role::User,
                "gpt" | "assistant" => Role::Assistant,
                "system" => Role::System,
                _ => {
                    return Err(reject(format!(
                        "conversations[{i}].from: unknown role {f:?} (expected \"human\", \"gpt\" or \"system\")"
                    )));
                }
            },
            None | Some(Value::Null) => {
                return Err(reject(format!("conversations[{i}] has no \"from\"")));
            }
            Some(other) => {
                return Err(reject(format!(
                    "conversations[{i}].from must be a string, got {}",
                    kind_of(other)
                )));
            }
        };
        let text = match t.get("value") {
            Some(Value::String(v)) => v.as_str(),
            None | Some(Value::Null) => {
                return Err(reject(format!("conversations[{i}] has no \"value\"")));
            }
            Some(other) => {
                return Err(reject(format!(
                    "conversations[{i}].value must be a string, got {}",
                    kind_of(other)
                )));
            }
        };
        let n = text.matches(PLACEHOLDER).count();
        if n > 0 && role != Role::User {
            return Err(reject(format!(
                "conversations[{i}]: {PLACEHOLDER} placeholder in a turn of role {} (images go in user turns)",
                role.as_str()
            )));
        }
        placeholders += n;
        parsed.push((role, text));
    }
    match (images.len(), placeholders) {
        (a, b) if a == b => {}
        (_, 0) => {
            return Err(reject(format!(
                "image without a placeholder: {} image(s), no {PLACEHOLDER}",
                images.len()
            )));
        }
        (0, n) => {
            return Err(reject(format!(
                "placeholder without an image: {n} {PLACEHOLDER} and no \"image\""
            )));
        }
        (a, n) => {
            return Err(reject(format!(
                "{n} {PLACEHOLDER} placeholders for {a} image(s)"
            )));
        }
    }
    let mut media = Vec::with_capacity(images.len());
    for rel in &images {
        let path = root.resolve(rel).map_err(&reject)?;
        media.push(Media {
            bytes: MediaBytes::Path(path),
            name: (*rel).to_string(),
        });
    }
    let mut media = media.into_iter();
    let mut messages = Vec::with_capacity(parsed.len());
    for (role, text) in parsed {
        let mut parts = Vec::new();
        for (k, piece) in text.split(PLACEHOLDER).enumerate() {
            if k > 0 {
                // Counted above: one image per placeholder.
                if let Some(m) = media.next() {
                    parts.push(RawPart::Image(m));
                }
            }
            if !piece.is_empty() {
                parts.push(RawPart::Text(piece.to_string()));
            }
        }
        messages.push(RawMessage { role, parts });
    }
    Ok(RawSample {
        id: id.unwrap_or_else(|| source.clone()),
        source,
        messages,
    })
}
