//! WebDataset `.tar` shards: members grouped by key, one sample per group.
//!
//! A member `dir/abc.jpg` has key `dir/abc` (everything before the first dot of the basename)
//! and its type is the last extension: `jpg jpeg png webp gif bmp` image, `wav flac mp3 ogg`
//! audio, `txt` caption, `json` chat record; other members (`.cls`, metadata) are skipped
//! unread. A `.json` with a `messages` list (the JSONL layout, media as `{"type": "image"}`
//! parts taking the group's media in member order) wins over a `.txt`; with a caption, the user
//! message carries the media and the assistant message the text. Members of a group must be
//! contiguous, as WebDataset writes them; a key seen again later is a reject.
//!
//! Memory: the current group's members (each capped at `Limits::max_member_bytes`, larger ones
//! reject the sample unread), the set of keys of the current shard, and a channel of
//! `CHANNEL_DEPTH` finished samples. The `tar` crate's entry iterator borrows its archive, so
//! the shards are read on one producer thread that feeds the iterator through that bounded
//! channel; dropping the iterator stops the thread at its next send.

use std::collections::{HashSet, VecDeque};
use std::fs::File;
use std::io::{BufReader, Read};
use std::path::PathBuf;
use std::sync::mpsc::{Receiver, SyncSender, sync_channel};
use std::thread::JoinHandle;

use serde_json::Value;

use super::jsonl::{MediaSource, messages_from_json};
use super::paths::check_member_name;
use super::sample::{Media, MediaBytes, RawMessage, RawPart, RawSample, Reject, Role};
use super::{ReadError, SampleIter};

const CHANNEL_DEPTH: usize = 4;

type Item = Result<RawSample, Reject>;

pub(crate) fn open(shards: Vec<PathBuf>, max_member_bytes: u64) -> Result<SampleIter, ReadError> {
    for s in &shards {
        File::open(s).map_err(|e| ReadError::open(s, e))?;
    }
    let (tx, rx) = sync_channel(CHANNEL_DEPTH);
    let handle = std::thread::Builder::new()
        .name("braid-wds-reader".into())
        .spawn(move || {
            for shard in shards {
                if read_shard(&shard, max_member_bytes, &tx).is_err() {
                    return; // the iterator was dropped
                }
            }
        })
        .map_err(|e| ReadError::Config(format!("cannot start the tar reader thread: {e}")))?;
    Ok(Box::new(WdsReader {
        rx,
        handle: Some(handle),
    }))
}

struct WdsReader {
    rx: Receiver<Item>,
    handle: Option<JoinHandle<()>>,
}

impl Iterator for WdsReader {
    type Item = Item;

    fn next(&mut self) -> Option<Item> {
        match self.rx.recv() {
            Ok(item) => Some(item),
            Err(_) => {
                // The producer finished (or died): surface a panic as one reject, not silence.
                let handle = self.handle.take()?;
                match handle.join() {
                    Ok(()) => None,
                    Err(_) => Some(Err(Reject::damaged(
                        None,
                        "wds",
                        "wds",
                        "internal error: the tar reader thread panicked",
                    ))),
                }
            }
        }
    }
}

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
enum Kind {
    Image,
    Audio,
    Text,
    Json,
}

fn kind_of_ext(ext: &str) -> Option<Kind> {
    let last = ext.rsplit('.').next().unwrap_or(ext).to_ascii_lowercase();
    match last.as_str() {
        "jpg" | "jpeg" | "png" | "webp" | "gif" | "bmp" => Some(Kind::Image),
        "wav" | "flac" | "mp3" | "ogg" => Some(Kind::Audio),
        "txt" => Some(Kind::Text),
        "json" => Some(Kind::Json),
        _ => None,
    }
}

/// `dir/abc.seg.jpg` -> (`dir/abc`, `seg.jpg`); `None` without a dot or with an empty stem.
fn split_key(name: &str) -> Option<(&str, &str)> {
    let base_start = name.rfind('/').map_or(0, |i| i + 1);
    let dot = name[base_start..].find('.')? + base_start;
    if dot == base_start {
        return None;
    }
    Some((&name[..dot], &name[dot + 1..]))
}

struct Group {
    key: String,
    members: Vec<(Kind, String, Vec<u8>)>,
    /// The first reason this sample is rejected; later members are then skipped unread.
    bad: Option<String>,
}

/// Reads one shard; `Err` only when the receiver is gone.
fn read_shard(
    shard: &std::path::Path,
    max_member_bytes: u64,
    tx: &SyncSender<Item>,
) -> Result<(), ()> {
    let name = shard.display().to_string();
    let send = |item: Item| tx.send(item).map_err(|_| ());
    let file = match File::open(shard) {
        Ok(f) => f,
        Err(e) => {
            return send(Err(Reject::damaged(
                None,
                name.clone(),
                name,
                format!("cannot open shard: {e}"),
            )));
        }
    };
    let mut archive = tar::Archive::new(BufReader::with_capacity(1 << 16, file));
    let entries = match archive.entries() {
        Ok(e) => e,
        Err(e) => {
            return send(Err(Reject::damaged(
                None,
                name.clone(),
                name,
                format!("not a tar archive: {e}"),
            )));
        }
    };
    let mut seen: HashSet<String> = HashSet::new();
    let mut group: Option<Group> = None;
    for (members, entry) in entries.enumerate() {
        let mut entry = match entry {
            Ok(e) => e,
            Err(e) => {
                // The rest of the shard is unreadable; the open group may have lost members.
                if let Some(g) = group.take() {
                    let why = "shard is corrupt or truncated inside this sample";
                    send(Err(Reject::new(
                        Some(g.key.clone()),
                        format!("{name}:{}", g.key),
                        why,
                    )))?;
                }
                let why = format!(
                    "corrupt or truncated tar after {members} members, rest of the shard skipped: {e}"
                );
                return send(Err(Reject::damaged(None, name.clone(), name, why)));
            }
        };
        let entry_type = entry.header().entry_type();
        if entry_type.is_dir() {
            continue;
        }
        let raw = entry.path_bytes().into_owned();
        let (member, key, ext, mut bad) = match check_member_name(&raw) {
            Ok(m) => match split_key(m) {
                Some((k, e)) => (m.to_string(), k.to_string(), e.to_string(), None),
                None => continue, // no extension: not a sample member
            },
            Err(why) => {
                // Group a hostile member under its own (lossy) key so the sample it claims
                // to belong to is rejected with it.
                let lossy = String::from_utf8_lossy(&raw).into_owned();
                let key = split_key(&lossy).map_or(lossy.clone(), |(k, _)| k.to_string());
                (lossy, key, String::new(), Some(why))
            }
        };
        if group.as_ref().is_none_or(|g| g.key != key) {
            if let Some(g) = group.take() {
                send(finish(g, &name, &mut seen))?;
            }
            group = Some(Group {
                key: key.clone(),
                members: Vec::new(),
                bad: None,
            });
        }
        let Some(g) = group.as_mut() else { continue };
        if g.bad.is_some() {
            continue;
        }
        let kind = kind_of_ext(&ext);
        if bad.is_none() && !(entry_type.is_file() || entry_type.is_contiguous()) && kind.is_some()
        {
            bad = Some(format!(
                "member {member:?} is a {entry_type:?} entry, not a regular file"
            ));
        }
        let size = entry.header().size().unwrap_or(u64::MAX);
        if bad.is_none() && kind.is_some() && size > max_member_bytes {
            bad = Some(format!(
                "member {member:?} is {size} bytes, over the {max_member_bytes}-byte limit"
            ));
        }
        if let Some(why) = bad {
            g.bad = Some(why);
            continue;
        }
        let Some(kind) = kind else { continue };
        let mut bytes = Vec::with_capacity(size.min(max_member_bytes) as usize);
        // `take` guards against a header that under-reports its size.
        match (&mut entry)
            .take(max_member_bytes + 1)
            .read_to_end(&mut bytes)
        {
            Ok(n) if n as u64 > max_member_bytes => {
                g.bad = Some(format!(
                    "member {member:?} is over the {max_member_bytes}-byte limit"
                ));
            }
            Ok(n) if (n as u64) < size => {
                g.bad = Some(format!(
                    "member {member:?} is truncated: {n} of {size} bytes"
                ));
            }
            Ok(_) => g.members.push((kind, member, bytes)),
            Err(e) => g.bad = Some(format!("member {member:?} cannot be read: {e}")),
        }
    }
    if let Some(g) = group.take() {
        send(finish(g, &name, &mut seen))?;
    }
    // Reading stops at the end-of-archive marker (zero blocks). Only padding may follow:
    // data there is members lost to zeroed blocks or a concatenated tar, said in a reject.
    let mut rest = archive.into_inner();
    let mut buf = vec![0u8; 1 << 16];
    loop {
        match rest.read(&mut buf) {
            Ok(0) | Err(_) => break,
            Ok(n) if buf[..n].iter().all(|&b| b == 0) => continue,
            Ok(_) => {
                let why = "data follows the end-of-archive marker (zero blocks): the members after it are not read (zeroed blocks inside the shard, or tars joined with `cat`: use `tar --concatenate`)";
                return send(Err(Reject::damaged(None, name.clone(), name, why)));
            }
        }
    }
    Ok(())
}

fn finish(g: Group, shard: &str, seen: &mut HashSet<String>) -> Item {
    let source = format!("{shard}:{}", g.key);
    let reject = |why: String| Reject::new(Some(g.key.clone()), source.clone(), why);
    if !seen.insert(g.key.clone()) {
        return Err(reject(format!(
            "key {:?} appears again after other keys (members not contiguous)",
            g.key
        )));
    }
    if let Some(why) = g.bad {
        return Err(reject(why));
    }
    // Media stay in member order; moved (not copied) into the message parts.
    let mut media: Vec<(Kind, Media)> = Vec::new();
    let mut caption: Option<(String, Vec<u8>)> = None;
    let mut json: Option<(String, Vec<u8>)> = None;
    for (kind, member, bytes) in g.members {
        match kind {
            Kind::Image | Kind::Audio => media.push((
                kind,
                Media {
                    bytes: MediaBytes::Inline(bytes),
                    name: member,
                },
            )),
            Kind::Text => {
                if let Some((first, _)) = &caption {
                    return Err(reject(format!(
                        "two caption members: {first:?} and {member:?}"
                    )));
                }
                caption = Some((member, bytes));
            }
            Kind::Json => {
                if let Some((first, _)) = &json {
                    return Err(reject(format!(
                        "two .json members: {first:?} and {member:?}"
                    )));
                }
                json = Some((member, bytes));
            }
        }
    }
    if let Some((member, bytes)) = &json {
        let value: Value = match serde_json::from_slice(bytes) {
            Ok(v) => v,
            Err(e) => return Err(reject(format!("member {member:?}: malformed JSON: {e}"))),
        };
        // Without `messages` it is a metadata .json (LAION-style url/size fields) and the
        // caption, if any, is the text.
        if let Some(messages) = value.get("messages") {
            let mut images = VecDeque::new();
            let mut audios = VecDeque::new();
            for (kind, m) in media {
                if kind == Kind::Image {
                    images.push_back(m)
                } else {
                    audios.push_back(m)
                }
            }
            let messages = messages_from_json(messages, MediaSource::Queue { images, audios })
                .map_err(|why| reject(format!("member {member:?}: {why}")))?;
            return Ok(RawSample {
                id: g.key.clone(),
                source: source.clone(),
                messages,
            });
        }
    }
    let Some((member, bytes)) = caption else {
        return Err(reject(match json {
            Some((m, _)) => format!("no .txt caption and {m:?} has no \"messages\""),
            None => "no .txt or .json member".into(),
        }));
    };
    let text = match String::from_utf8(bytes) {
        Ok(t) => t.trim().to_string(),
        Err(e) => {
            return Err(reject(format!(
                "member {member:?}: invalid UTF-8 at byte {}",
                e.utf8_error().valid_up_to()
            )));
        }
    };
    let mut messages = Vec::with_capacity(2);
    if !media.is_empty() {
        let parts = media
            .into_iter()
            .map(|(kind, m)| {
                if kind == Kind::Image {
                    RawPart::Image(m)
                } else {
                    RawPart::Audio(m)
                }
            })
            .collect();
        messages.push(RawMessage {
            role: Role::User,
            parts,
        });
    }
    messages.push(RawMessage {
        role: Role::Assistant,
        parts: vec![RawPart::Text(text)],
    });
    Ok(RawSample {
        id: g.key.clone(),
        source,
        messages,
    })
}
