//! One chat record of a JSONL line or a JSON-array element: Braid's own typed-parts schema, and
//! ShareGPT / LLaMA-Factory records whose media sit in top-level `images` / `audios` lists.
//!
//! ```json
//! {"messages": [{"role": "user", "content": "<image>Describe."}, {"role": "assistant", "content": "A cat."}],
//!  "images": ["a.jpg"], "audios": []}
//! {"conversations": [{"from": "human", "value": "<audio>What is said?"}, {"from": "gpt", "value": "Hi."}],
//!  "audios": ["b.wav"], "system": "Be brief."}
//! ```
//!
//! `<image>` / `<audio>` in string content take the list's items in order (LLaVA's single
//! `image` key is read as a one-item `images` list). Media are never dropped: a count mismatch
//! (placeholders vs list entries, both counts named), a list the reader cannot use, or a video
//! is a reject that says what the record holds. Placeholder counts are checked before any path
//! is resolved, so a mismatched record costs no file system access.

use std::collections::VecDeque;

use serde_json::{Map, Value};

use super::jsonl::{
    AUDIO_PLACEHOLDER, IMAGE_PLACEHOLDER, MediaSource, kind_of, message_content, messages_from_json,
};
use super::paths::DatasetRoot;
use super::sample::{Media, MediaBytes, RawMessage, RawPart, RawSample, Reject, Role};

/// Converts a parsed record (`id` already read) into a sample, or the reason it cannot be one.
pub(crate) fn chat_record(
    record: &Map<String, Value>,
    id: Option<String>,
    source: String,
    root: &DatasetRoot,
) -> Result<RawSample, Reject> {
    match convert(record, root) {
        Ok(messages) => Ok(RawSample {
            id: id.unwrap_or_else(|| source.clone()),
            source,
            messages,
        }),
        Err(why) => Err(Reject::new(id, source, why)),
    }
}

fn present<'v>(record: &'v Map<String, Value>, key: &str) -> Option<&'v Value> {
    record.get(key).filter(|v| !v.is_null())
}

fn convert(record: &Map<String, Value>, root: &DatasetRoot) -> Result<Vec<RawMessage>, String> {
    for key in ["video", "videos"] {
        if present(record, key).is_some() {
            return Err(format!("video samples are not supported (\"{key}\")"));
        }
    }
    let list = match (
        present(record, "messages"),
        present(record, "conversations"),
    ) {
        (Some(m), None) => m,
        (None, Some(c)) => c,
        (Some(_), Some(_)) => {
            return Err("both \"messages\" and \"conversations\": which one is the chat?".into());
        }
        (None, None) => {
            let keys: Vec<&str> = record.keys().map(String::as_str).take(12).collect();
            return Err(format!(
                "no \"messages\" (or \"conversations\") field; the record holds {keys:?}"
            ));
        }
    };
    let images = match (present(record, "images"), present(record, "image")) {
        (Some(_), Some(_)) => {
            return Err("both \"images\" and \"image\": name the images once".into());
        }
        (Some(v), None) => Some(path_list(v, "images")?),
        (None, Some(v)) => Some(path_list(v, "image")?),
        (None, None) => None,
    };
    let audios = present(record, "audios")
        .map(|v| path_list(v, "audios"))
        .transpose()?;
    let counted = count_placeholders(list);
    if counted.with_path > 0 && (images.is_some() || audios.is_some()) {
        return Err(format!(
            "{} typed media part(s) name a \"path\" and the record also has an \"images\"/\"audios\" list: name each item one way",
            counted.with_path
        ));
    }
    check_count(
        "image",
        IMAGE_PLACEHOLDER,
        "images",
        counted.images,
        &images,
    )?;
    check_count(
        "audio",
        AUDIO_PLACEHOLDER,
        "audios",
        counted.audios,
        &audios,
    )?;
    let mut messages = if images.is_none() && audios.is_none() {
        messages_from_json(list, MediaSource::Paths(root))?
    } else {
        let resolve = |list: Option<Vec<&str>>, key: &str| -> Result<VecDeque<Media>, String> {
            let mut out = VecDeque::new();
            for (i, rel) in list.unwrap_or_default().into_iter().enumerate() {
                let path = root
                    .resolve(rel)
                    .map_err(|why| format!("{key}[{i}]: {why}"))?;
                out.push_back(Media {
                    bytes: MediaBytes::Path(path),
                    name: rel.to_string(),
                });
            }
            Ok(out)
        };
        let images = resolve(images, "images")?;
        let audios = resolve(audios, "audios")?;
        messages_from_json(list, MediaSource::Listed { images, audios })?
    };
    // LLaMA-Factory keeps the system prompt beside the turns; losing it would change the data.
    if let Some(system) = present(record, "system") {
        let Value::String(text) = system else {
            return Err(format!(
                "\"system\" must be a string, got {}",
                kind_of(system)
            ));
        };
        if messages.first().is_some_and(|m| m.role == Role::System) {
            return Err("both a top-level \"system\" and a system message".into());
        }
        messages.insert(
            0,
            RawMessage {
                role: Role::System,
                parts: vec![RawPart::Text(text.clone())],
            },
        );
    }
    Ok(messages)
}

/// A media list: one path string or an array of them.
fn path_list<'v>(v: &'v Value, key: &str) -> Result<Vec<&'v str>, String> {
    match v {
        Value::String(s) => Ok(vec![s.as_str()]),
        Value::Array(items) => items
            .iter()
            .enumerate()
            .map(|(i, item)| match item {
                Value::String(s) => Ok(s.as_str()),
                other => Err(format!(
                    "\"{key}\" holds {} media entries, but entry {i} is {}, not a path string; none of them can be placed",
                    items.len(),
                    kind_of(other)
                )),
            })
            .collect(),
        other => Err(format!(
            "\"{key}\" must be a path or a list of paths, got {}; its media cannot be placed",
            kind_of(other)
        )),
    }
}

/// What a media list must match: text placeholders plus typed parts without a `path`.
#[derive(Default)]
struct Counted {
    /// `[text, typed]` placeholders of each kind.
    images: [usize; 2],
    audios: [usize; 2],
    /// Typed image / audio parts that name their own `path`.
    with_path: usize,
}

/// Counts the placeholders of a chat list without judging its shape (the conversion does that).
fn count_placeholders(list: &Value) -> Counted {
    let mut c = Counted::default();
    let Value::Array(list) = list else {
        return c;
    };
    for m in list {
        let Value::Object(m) = m else { continue };
        match message_content(m) {
            Some((_, Value::String(s))) => {
                c.images[0] += s.matches(IMAGE_PLACEHOLDER).count();
                c.audios[0] += s.matches(AUDIO_PLACEHOLDER).count();
            }
            Some((_, Value::Array(parts))) => {
                for p in parts {
                    let Value::Object(p) = p else { continue };
                    let kind = p.get("type").and_then(Value::as_str);
                    if p.get("path").is_some_and(|v| !v.is_null()) {
                        c.with_path += usize::from(matches!(kind, Some("image" | "audio")));
                        continue;
                    }
                    match kind {
                        Some("image") => c.images[1] += 1,
                        Some("audio") => c.audios[1] += 1,
                        _ => {}
                    }
                }
            }
            _ => {}
        }
    }
    c
}

/// Placeholders and list entries must pair up one to one. Without a list, text placeholders
/// are an error too: the record's media were lost before it reached us, or it is mislabelled
/// (a typed part without a path is left to the conversion, which names the part).
fn check_count(
    kind: &str,
    placeholder: &str,
    key: &str,
    [text, typed]: [usize; 2],
    list: &Option<Vec<&str>>,
) -> Result<(), String> {
    let placeholders = if list.is_some() { text + typed } else { text };
    match list {
        Some(list) if list.len() != placeholders => Err(format!(
            "{placeholders} {kind} placeholder(s) ({placeholder} or {{\"type\": \"{kind}\"}} parts) for {} entries in \"{key}\"",
            list.len()
        )),
        None if placeholders > 0 => Err(format!(
            "{placeholders} {kind} placeholder(s) in the text ({placeholder}) but no \"{key}\" list (0 entries)"
        )),
        _ => Ok(()),
    }
}
