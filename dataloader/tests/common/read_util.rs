//! Input-reader test helpers: read a whole input, pick out ids, texts and inline media, check
//! rejects, and build a small dataset folder with media and symlinks.

use std::fs;
use std::path::{Path, PathBuf};

use braid_dataloader::read::{MediaBytes, RawPart, RawSample, ReadConfig, Reject, open};

pub fn read_all(input: &Path, cfg: &ReadConfig) -> (Vec<RawSample>, Vec<Reject>) {
    let mut good = Vec::new();
    let mut bad = Vec::new();
    for item in open(input, cfg).unwrap() {
        match item {
            Ok(s) => good.push(s),
            Err(r) => bad.push(r),
        }
    }
    (good, bad)
}

pub fn ids(samples: &[RawSample]) -> Vec<&str> {
    samples.iter().map(|s| s.id.as_str()).collect()
}

/// The reject whose source ends with `suffix`, checked to mention `reason`.
#[track_caller]
pub fn expect_reject(rejects: &[Reject], suffix: &str, reason: &str) {
    let r = rejects
        .iter()
        .find(|r| r.source.ends_with(suffix))
        .unwrap_or_else(|| panic!("no reject for {suffix}; rejects: {rejects:#?}"));
    assert!(
        r.reason.contains(reason),
        "reject for {suffix}: {:?} does not mention {reason:?}",
        r.reason
    );
}

pub fn inline(part: &RawPart) -> &[u8] {
    match part {
        RawPart::Image(m) | RawPart::Audio(m) => match &m.bytes {
            MediaBytes::Inline(b) => b,
            MediaBytes::Path(p) => panic!("expected inline bytes, got {p:?}"),
        },
        RawPart::Text(t) => panic!("expected media, got text {t:?}"),
    }
}

pub fn text(part: &RawPart) -> &str {
    match part {
        RawPart::Text(t) => t,
        other => panic!("expected text, got {other:?}"),
    }
}

/// `dir/ds` with image and audio files, plus `dir/secret.png` outside it and a symlink to it.
pub fn dataset(dir: &Path) -> PathBuf {
    let ds = dir.join("ds");
    fs::create_dir_all(ds.join("img")).unwrap();
    fs::create_dir_all(ds.join("audio")).unwrap();
    fs::write(ds.join("img/a.png"), b"not really a png").unwrap();
    fs::write(ds.join("img/b.jpg"), b"jpeg bytes").unwrap();
    fs::write(ds.join("audio/c.wav"), b"RIFF....").unwrap();
    fs::write(dir.join("secret.png"), b"outside").unwrap();
    std::os::unix::fs::symlink(dir.join("secret.png"), ds.join("img/out.png")).unwrap();
    std::os::unix::fs::symlink(ds.join("img/a.png"), ds.join("img/in.png")).unwrap();
    ds
}
