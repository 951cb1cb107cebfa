//! Path safety: every media path a manifest names must resolve to a regular file inside the
//! dataset root or a media root the user trusts.
//!
//! Two checks, because either alone is not enough: a lexical one (no absolute paths unless
//! media roots are named, no `..` climbing above the root) gives a clear reason before touching
//! the file system, and a canonical one (resolve symlinks, then require the root or a media
//! root as a prefix) catches links that point outside. Tar members are never written to disk, but names with `..` or a leading `/` are
//! still refused: a shard that carries them was built wrongly or with intent.

use std::io;
use std::path::{Component, Path, PathBuf};

/// A canonical folder that media paths are resolved against and must stay inside, plus the
/// media roots the user trusts (`--media-root`, `[input] media_roots`).
///
/// A relative path is looked up in each media root (in the order given), then in the folder;
/// the first that holds it wins. Its canonical form (symlinks resolved) must lie inside the
/// folder or a media root: a linked media folder pointing into a trusted root is accepted, a
/// link out of every trusted root is refused. An absolute path is accepted only inside a media
/// root.
#[derive(Debug, Clone)]
pub struct DatasetRoot {
    root: PathBuf,
    media_roots: Vec<PathBuf>,
}

impl DatasetRoot {
    /// Canonicalizes `dir`; fails when it does not exist or is not a folder.
    pub fn new(dir: &Path) -> io::Result<DatasetRoot> {
        DatasetRoot::with_media_roots(dir, &[])
    }

    /// Like `new`, trusting `media_roots` too (each canonicalized; the error names it).
    pub fn with_media_roots(dir: &Path, media_roots: &[PathBuf]) -> io::Result<DatasetRoot> {
        let canonical_dir = |d: &Path, what: &str| -> io::Result<PathBuf> {
            let c = d
                .canonicalize()
                .map_err(|e| io::Error::new(e.kind(), format!("{what} {}: {e}", d.display())))?;
            if !c.is_dir() {
                return Err(io::Error::new(
                    io::ErrorKind::NotADirectory,
                    format!("{what} {} is not a folder", d.display()),
                ));
            }
            Ok(c)
        };
        let root = canonical_dir(dir, "dataset root")?;
        let media_roots = media_roots
            .iter()
            .map(|r| canonical_dir(r, "media root"))
            .collect::<io::Result<Vec<_>>>()?;
        Ok(DatasetRoot { root, media_roots })
    }

    pub fn path(&self) -> &Path {
        &self.root
    }

    fn trusted(&self, canonical: &Path) -> bool {
        canonical.starts_with(&self.root)
            || self.media_roots.iter().any(|r| canonical.starts_with(r))
    }

    /// Resolves a media path to a canonical regular file inside the root or a media root. The
    /// `Err` is a reject reason that names the path.
    pub fn resolve(&self, rel: &str) -> Result<PathBuf, String> {
        if rel.is_empty() {
            return Err("empty media path".into());
        }
        if rel.contains('\0') {
            return Err(format!("media path {rel:?} contains a NUL byte"));
        }
        let candidates: Vec<PathBuf> =
            if Path::new(rel).is_absolute() && !self.media_roots.is_empty() {
                vec![PathBuf::from(rel)]
            } else {
                let lexical = lexically_inside(Path::new(rel))
                    .map_err(|why| format!("media path {rel:?} {why}"))?;
                self.media_roots
                    .iter()
                    .chain(std::iter::once(&self.root))
                    .map(|base| base.join(&lexical))
                    .collect()
            };
        let mut canonical = None;
        for joined in &candidates {
            match joined.canonicalize() {
                Ok(p) => {
                    canonical = Some(p);
                    break;
                }
                Err(e) if e.kind() == io::ErrorKind::NotFound => {}
                Err(e) => {
                    return Err(format!(
                        "cannot resolve {rel:?} ({}): {e}",
                        joined.display()
                    ));
                }
            }
        }
        let Some(canonical) = canonical else {
            let tried: Vec<String> = candidates.iter().map(|p| p.display().to_string()).collect();
            let tried = match tried.as_slice() {
                [one] => one.clone(),
                many => format!("none of {}", many.join(", ")),
            };
            return Err(format!("missing file {rel:?} ({tried})"));
        };
        if !self.trusted(&canonical) {
            if Path::new(rel).is_absolute() {
                return Err(format!(
                    "media path {rel:?} is absolute and outside every media root; absolute paths are accepted only inside a --media-root"
                ));
            }
            let roots = if self.media_roots.is_empty() {
                String::new()
            } else {
                let r: Vec<String> = self
                    .media_roots
                    .iter()
                    .map(|r| r.display().to_string())
                    .collect();
                format!(" and every media root ({})", r.join(", "))
            };
            return Err(format!(
                "media path {rel:?} resolves to {} outside the dataset root {}{roots} (symlink); pass --media-root with the target's folder to trust it",
                canonical.display(),
                self.root.display()
            ));
        }
        if !canonical.is_file() {
            return Err(format!("media path {rel:?} is not a regular file"));
        }
        Ok(canonical)
    }
}

/// The normalized relative path when `p` is relative and never climbs above its start; the
/// `Err` completes the sentence "media path X ...".
fn lexically_inside(p: &Path) -> Result<PathBuf, &'static str> {
    let mut out = PathBuf::new();
    let mut depth = 0usize;
    for c in p.components() {
        match c {
            Component::Prefix(_) | Component::RootDir => return Err("is absolute"),
            Component::CurDir => {}
            Component::ParentDir => {
                if depth == 0 {
                    return Err("escapes the dataset root with '..'");
                }
                depth -= 1;
                out.pop();
            }
            Component::Normal(s) => {
                depth += 1;
                out.push(s);
            }
        }
    }
    if depth == 0 {
        return Err("names the dataset root itself, not a file");
    }
    Ok(out)
}

/// Checks a tar member name (raw header bytes): UTF-8, relative, and free of `..` components
/// anywhere (the lexical rule above would allow `a/../b`; a shard has no reason to carry one).
pub fn check_member_name(raw: &[u8]) -> Result<&str, String> {
    let name = std::str::from_utf8(raw)
        .map_err(|_| format!("member name {} is not UTF-8", String::from_utf8_lossy(raw)))?;
    if name.starts_with('/') || name.starts_with('\\') || Path::new(name).is_absolute() {
        return Err(format!("member {name:?} has an absolute name"));
    }
    if name.split(['/', '\\']).any(|c| c == "..") {
        return Err(format!("member {name:?} has a '..' component"));
    }
    if name.contains('\0') {
        return Err(format!("member {name:?} contains a NUL byte"));
    }
    Ok(name)
}
